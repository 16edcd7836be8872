"""`python -m nanoserve bench model`: chapter 02's baseline numbers, before any cache.

  - load time of the GGUF (dequantize to float32, build the model)
  - prefill tokens/s: one forward pass over a P-token prompt
  - decode tokens/s *without a cache*: every new token recomputes the whole sequence,
    so step t costs a forward pass over P + t tokens. Chapters 04–06 improve on this.
"""

import time

import torch


def register(sub):
    p = sub.add_parser("model", help="load time, prefill tokens/s and no-cache decode tokens/s (chapter 02)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=run)


def timed(fn, repeats: int) -> float:
    """Best of `repeats` wall times: the least disturbed run on a noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def run(args):
    from nanoserve.model import load_gguf

    t0 = time.perf_counter()
    model = load_gguf()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0))

    prefill_s = timed(lambda: model.compute_logits(model(prompt)[-1:]), args.repeats)

    def decode_without_cache():
        ids = prompt
        for _ in range(args.decode_tokens):
            next_id = model.compute_logits(model(ids)[-1:]).argmax(-1)  # the whole sequence, again
            ids = torch.cat([ids, next_id])

    decode_s = timed(decode_without_cache, 1)
    print(f"command: python -m nanoserve bench model --prompt-len {args.prompt_len} --decode-tokens {args.decode_tokens}")
    print(f"threads: {torch.get_num_threads()}")
    print(f"load time:            {load_s:8.2f} s")
    print(f"prefill ({args.prompt_len} tokens):  {args.prompt_len / prefill_s:8.1f} tokens/s  ({prefill_s * 1000:.0f} ms)")
    print(f"decode, no cache:     {args.decode_tokens / decode_s:8.1f} tokens/s  "
          f"({args.decode_tokens} tokens after a {args.prompt_len}-token prompt)")
