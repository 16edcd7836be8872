"""`python -m nanoserve bench paged-kv`: what paging the KV cache buys (chapter 05), measured.

  1. waste: the share of reserved KV memory that holds no token, for chapter 04's seeded request mix
     (`kv_cache.request_lengths`: prompt and output log-normal, medians 256 and 128 tokens).
       - at completion: each request's final length vs max_len (naive) or its blocks (paged);
       - over time: the requests run with the real BlockManager, up to --max-num-seqs at a time
         (prompt in one step, then one token per step); every step compares the tokens held to the
         memory reserved — max_len per running request (naive) or the blocks in use (paged) —
         summed over all steps. Block sizes are swept: small blocks waste less, but mean longer
         block tables and smaller gathers.
  2. prefix caching: requests that share a system prompt, tokenized by the real tokenizer with the
     real chat template, one after another through a BlockManager: hit rate and blocks saved.
  3. speed: one decode step of --max-num-seqs sequences — one layer's attention, batched
     (PagedAttention) vs a Python loop over sequences; the decode gather + attention from our heads-first
     pool vs the same from a block-major pool (vLLM's FlashAttention backend's default), both gathering
     into buffers allocated once; then the whole SmolLM2 forward pass. Each pair: warmed up, alternated in
     both orders, best of the rounds.
  4. with --memory-cap-mib N: the real engine on SmolLM2 in a pool of N MiB, paging (BlockManager) vs
     reserving prompt + max_tokens at admission (kv/reservation.py), the same requests, stepped in
     lockstep (one step of each in turn, the two taking turns at going first, each on its own clock): requests
     running at once, preemptions and steps (exact: they do not depend on the clock), output tokens/s (timed).
"""

import sys
import time

import torch

from nanoserve.bench.kv_cache import request_lengths
from nanoserve.bench.model import timed
from nanoserve.kv.block_manager import BlockManager, cdiv
from nanoserve.kv.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache
from nanoserve.memory import format_bytes, kv_bytes_per_token
from nanoserve.model.config import LlamaConfig

SYSTEM_PROMPT = (
    "You are the support assistant of Nanoserve Cloud, a company that rents GPUs by the hour. "
    "Answer in at most three sentences, politely and precisely. If a question is about billing, "
    "remind the user that invoices are sent on the first day of each month and can be downloaded "
    "from the account page. Never invent prices; if you do not know something, say so and suggest "
    "writing to support@example.com. Do not discuss competitors."
)
QUESTIONS = [
    "How do I download my invoice?", "Can I rent an H100 for two hours?", "Why was I charged twice?",
    "What regions do you have?", "How do I cancel my plan?", "Is there a free trial?",
    "My instance does not start, what can I do?", "Do you support spot instances?",
    "How do I add a teammate to my account?", "What is your uptime guarantee?",
    "Can I pay with a bank transfer?", "How do I change the email of my account?",
    "Where is my data stored?", "Do you offer discounts for students?", "How do I resize a disk?",
    "What happens when my credit runs out?",
]


def register(sub):
    from nanoserve.cli.checks import positive_float, positive_int

    p = sub.add_parser("paged-kv", help="KV waste naive vs paged, prefix-cache savings, batched vs looped paged attention")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=2048, help="tokens the naive cache reserves per request")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=256, help="mean context of the timed decode step")
    p.add_argument("--skip-model", action="store_true", help="skip loading SmolLM2 (the whole-model timing)")
    p.add_argument("--memory-cap-mib", type=positive_float, default=None,
                   help="part 4: paging vs reserving prompt + max_tokens at admission, in a KV pool of this many MiB "
                        "(default: skip part 4)")
    p.add_argument("--cap-requests", type=positive_int, default=32,
                   help="part 4: requests (prompts 32-128, outputs 32-128 tokens)")
    p.set_defaults(func=run)


def waste_over_time(prompt: list[int], output: list[int], max_num_seqs: int, block_size: int, max_len: int,
                    trace: list | None = None):
    """Run the requests through a BlockManager; return (steps, tokens held, naive reserved, paged reserved),
    the last three summed over all steps (token-steps). `trace` collects each step's three numbers."""
    num_blocks = max_num_seqs * cdiv(max_len, block_size)  # room for all: this measures waste, not preemption
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    waiting = list(range(len(prompt)))[::-1]
    length: dict[int, int] = {}  # running request -> tokens it holds
    steps = held = naive = paged = 0
    while waiting or length:
        steps += 1
        while waiting and len(length) < max_num_seqs:  # admit: the whole prompt is prefilled in one step
            r = waiting.pop()
            length[r] = prompt[r]
        for r in length:
            assert manager.allocate_slots(r, range(length[r]), length[r]) is not None
        now = (sum(length.values()), len(length) * max_len, (num_blocks - manager.get_num_free_blocks()) * block_size)
        held, naive, paged = held + now[0], naive + now[1], paged + now[2]
        if trace is not None:
            trace.append(now)
        for r in list(length):  # each request samples a token; the finished leave
            length[r] += 1
            if length[r] > prompt[r] + output[r] - 1:
                manager.free(r)
                del length[r]
    return steps, held, naive, paged


def prefix_savings(prompts: list[list[int]], block_size: int) -> BlockManager:
    """Serve the prompts one after another (each freed before the next): what the prefix cache saves."""
    manager = BlockManager(sum(cdiv(len(p) + 1, block_size) for p in prompts), block_size)
    for seq_id, ids in enumerate(prompts):
        assert manager.allocate_slots(seq_id, ids, len(ids)) is not None
        manager.free(seq_id)
    return manager


def decode_batch(config: LlamaConfig, num_seqs: int, mean_context: int, block_size: int, num_layers: int):
    """A pool with `num_seqs` sequences of random contexts (mean_context/2 .. 3·mean_context/2) in shuffled
    blocks, and the metadata of one decode step (one new token each)."""
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(mean_context // 2, mean_context * 3 // 2, (num_seqs,), generator=g).tolist()
    need = [cdiv(s, block_size) for s in seq_lens]
    order = torch.randperm(sum(need), generator=g).tolist()
    tables = [order[sum(need[:i]): sum(need[:i + 1])] for i in range(num_seqs)]
    cache = PagedKVCache(num_layers, sum(need), block_size, config.num_key_value_heads, config.head_dim)
    for k, v in zip(cache.k_cache, cache.v_cache):
        k.normal_(generator=g), v.normal_(generator=g)
    return cache, AttentionMetadata.build(tables, seq_lens, [1] * num_seqs, block_size)


def block_major_buffers(group, k_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather buffers for block_major_attend, allocated once like DecodeGroup's own: (Sd · MB, block_size, Hkv, D)."""
    blocks = len(group.tiles) // k_pool.shape[2]
    shape = (blocks, *k_pool.shape[1:])
    return torch.empty(shape, dtype=k_pool.dtype), torch.empty(shape, dtype=k_pool.dtype)


def block_major_attend(group, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       buffers: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """DecodeGroup.attend on a block-major pool, (num_blocks, block_size, Hkv, D) as vLLM's FlashAttention
    backend lays it out by default: one gather of whole blocks (every head at once) into preallocated buffers
    (block_major_buffers), as DecodeGroup.attend gathers into its own, then attention on a (Sd, Hkv, C, D)
    view whose rows of one head are Hkv · D floats apart. q: (Sd, H, D) -> (Sd, H, D)."""
    Sd, H, D = q.shape
    Hkv = k_pool.shape[2]
    blocks = group.tiles[: len(group.tiles) // Hkv]  # kv head 0's tiles are the block ids themselves: (Sd · MB,)
    keys = torch.index_select(k_pool, 0, blocks, out=buffers[0]).view(Sd, -1, Hkv, D).transpose(1, 2)  # (Sd, Hkv, C, D)
    values = torch.index_select(v_pool, 0, blocks, out=buffers[1]).view(Sd, -1, Hkv, D).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q.view(Sd, Hkv, H // Hkv, D), keys, values,
                                                           attn_mask=group.mask)
    return out.reshape(Sd, H, D)


def decode_attention(attn: PagedAttention, q: torch.Tensor, attend) -> torch.Tensor:
    """Every decode group of `attn` through attend(group, q of its tokens): the gather and the attention,
    without the K/V store."""
    out = torch.empty_like(q)
    for group in attn.decode_groups:
        out[group.tokens] = attend(group, q[group.tokens])
    return out


def under_memory_cap(model, num_blocks: int, block_size: int, workload) -> dict:
    """Paged vs reserving, the same requests in the same pool; the two engines step in turn, each timed on
    its own clock. {name: {steps, seconds, output_throughput, preemptions, peak_running, mean_running}}."""
    from nanoserve.bench.experiment import greedy
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.kv.reservation import ReservingBlockManager

    config = EngineConfig(cache_config=CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                                   enable_prefix_caching=False))
    # The reserving engine's manager reads each sequence's prompt + max_tokens from that engine's scheduler.
    def max_total_tokens(seq_id: str) -> int:
        return engines["reserve prompt+max_tokens"].scheduler.seqs[seq_id].max_total_tokens

    engines = {"paged": LLMEngine(model, config),
               "reserve prompt+max_tokens": LLMEngine(model, config, block_manager=ReservingBlockManager(
                   num_blocks, block_size, max_total_tokens))}
    stats = {name: {"steps": 0, "seconds": 0.0, "preemptions": 0, "running": [], "output_tokens": 0}
             for name in engines}
    for engine in engines.values():
        for i, (prompt, n) in enumerate(workload):
            engine.add_request(str(i), prompt, greedy(n))
    order = list(engines.items())
    while any(e.has_unfinished_requests() for e in engines.values()):
        order.reverse()  # the two engines take turns at stepping first, so neither always runs after the other
        for name, engine in order:
            if not engine.has_unfinished_requests():
                continue
            x, t0 = stats[name], time.perf_counter()
            outputs = engine.step()
            x["seconds"] += time.perf_counter() - t0
            x["steps"] += 1
            x["preemptions"] += len(engine.last_scheduler_output.preempted_seq_ids)
            x["running"].append(len(engine.last_scheduler_output.scheduled_seqs))
            x["output_tokens"] += sum(len(o.new_token_ids) for o in outputs)
    for name, x in stats.items():
        assert engines[name].block_manager.get_num_free_blocks() == num_blocks  # nothing leaked
        running = x.pop("running")
        x.update(peak_running=max(running), mean_running=sum(running) / len(running),
                 output_throughput=x["output_tokens"] / x["seconds"])
    return stats


def interleaved_best(fns: dict, repeats: int) -> dict:
    """Best wall time of each function after one untimed warm-up call each, alternating them and the order
    they run in (A B, B A, ...) so that a noisy neighbour, and running second, hurt all alike."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    order = list(fns.items())
    for _ in range(repeats):
        for name, fn in order:
            best[name] = min(best[name], timed(fn, 1))
        order.reverse()
    return best


@torch.inference_mode()
def run(args):
    bs = args.block_size
    config = LlamaConfig()  # SmolLM2-135M's shapes (the numbers only; the weights load in part 3)
    if args.memory_cap_mib:  # checked before anything runs: part 4 comes last
        from nanoserve.bench.offline import make_workload
        from nanoserve.kv.paged_attention import num_blocks_for_budget

        num_blocks = num_blocks_for_budget(config, args.memory_cap_mib * 2**20, bs)
        workload = make_workload(args.cap_requests, (32, 128), (32, 128), args.seed, config.vocab_size)
        need = max(cdiv(len(p) + n, bs) for p, n in workload)
        if args.skip_model or num_blocks < need:
            print("error: --memory-cap-mib runs the model: drop --skip-model" if args.skip_model else
                  f"error: --memory-cap-mib {args.memory_cap_mib:g} holds {num_blocks} blocks of {bs} tokens; the "
                  f"longest request needs {need}", file=sys.stderr)
            return 2
    per_token = kv_bytes_per_token(config, "fp32")
    print(f"command: python -m nanoserve bench paged-kv --requests {args.requests} --max-len {args.max_len} "
          f"--max-num-seqs {args.max_num_seqs} --block-size {bs} --seed {args.seed} --context {args.context}"
          + (" --skip-model" if args.skip_model else "")
          + (f" --memory-cap-mib {args.memory_cap_mib:g} --cap-requests {args.cap_requests}" if args.memory_cap_mib else ""))
    print(f"threads: {torch.get_num_threads()}\n")

    # 1. waste
    prompt, output = (t.tolist() for t in request_lengths(args.requests, args.max_len, args.seed))
    used = [p + o for p, o in zip(prompt, output)]
    print(f"1. KV waste: {args.requests} requests of chapter 04's mix (seed {args.seed}); "
          f"tokens per request mean {sum(used) / len(used):.0f}, max {max(used)}; SmolLM2 fp32 = {per_token:,} B/token")
    naive_end = 1 - sum(used) / (len(used) * args.max_len)
    paged_end = 1 - sum(used) / sum(cdiv(u, bs) * bs for u in used)
    print(f"   at completion: naive (max_len {args.max_len}) {naive_end:.1%} waste, paged (block {bs}) {paged_end:.2%} waste")
    print(f"   over time, {args.max_num_seqs} running at once:")
    print(f"   {'block_size':>10s} {'paged waste':>12s} {'naive waste':>12s} {'blocks/request':>15s}")
    for size in sorted({1, 8, bs, 32, 128}):
        steps, held, naive, paged = waste_over_time(prompt, output, args.max_num_seqs, size, args.max_len)
        print(f"   {size:10d} {1 - held / paged:12.2%} {1 - held / naive:12.1%} {sum(cdiv(u, size) for u in used) / len(used):15.1f}"
              + ("   <- the default" if size == bs else ""))
        if size == bs:
            mean = {name: x / steps * per_token for name, x in [("held", held), ("naive", naive), ("paged", paged)]}
    print(f"   mean KV memory per step (block {bs}): tokens {format_bytes(mean['held'])}, paged reserves "
          f"{format_bytes(mean['paged'])}, naive reserves {format_bytes(mean['naive'])}: "
          f"naive holds {mean['naive'] / mean['paged']:.1f}x the memory\n")

    # 2. prefix caching
    from nanoserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf()
    system = [tok.encode_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]) for q in QUESTIONS]
    default = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    print(f"2. prefix caching: {len(QUESTIONS)} chat requests one after another, block {bs}, SmolLM2's tokenizer and template")
    for name, prompts in [("own system prompt", system), ("template's default system prompt", default)]:
        m = prefix_savings(prompts, bs)
        shared = len(next(iter(prompts)))
        for p in prompts[1:]:
            shared = min(shared, next((i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b), len(p)))
        print(f"   {name}: prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, common prefix {shared} "
              f"tokens ({shared // bs} full block{'s' * (shared // bs != 1)})")
        print(f"     hit rate {m.stats.hit_rate:.1%} of prompt tokens ({m.stats.hit_tokens} of {m.stats.queried_tokens} "
              f"never computed), blocks saved {m.stats.hit_blocks} "
              f"({format_bytes(m.stats.hit_blocks * bs * per_token)} of KV not recomputed nor stored twice)")
    print()

    # 3. speed of one decode step
    n = args.max_num_seqs
    cache, meta = decode_batch(config, n, args.context, bs, num_layers=1)
    q = torch.randn(n, config.num_attention_heads, config.head_dim)
    k = v = torch.randn(n, config.num_key_value_heads, config.head_dim)
    batched, looped = PagedAttention(cache, meta), PagedAttention(cache, meta, batch_decodes=False)
    assert (batched(0, q, k, v) - looped(0, q, k, v)).abs().max() < 1e-4
    t = interleaved_best({"batched": lambda: batched(0, q, k, v), "looped": lambda: looped(0, q, k, v)}, repeats=20)
    print(f"3. one decode step, {n} sequences, contexts {meta.seq_lens.min()}..{meta.seq_lens.max()} (mean {meta.seq_lens.float().mean():.0f}), "
          f"block {bs}, pool {format_bytes(cache.nbytes)} per layer")
    print(f"   one layer's attention: batched {t['batched'] * 1000:.2f} ms, looped over sequences {t['looped'] * 1000:.2f} ms "
          f"({t['looped'] / t['batched']:.1f}x)")
    # the same decode gather + attention from the block-major layout (vLLM's FlashAttention default): the same
    # numbers, permuted
    k_pool, v_pool = (c[0].permute(1, 2, 0, 3).contiguous() for c in (cache.k_cache, cache.v_cache))  # (nb, bs, Hkv, D)
    heads_first = lambda group, qg: group.attend(qg, cache.k_cache[0], cache.v_cache[0])  # noqa: E731
    buffers = {group: block_major_buffers(group, k_pool) for group in batched.decode_groups}
    block_major = lambda group, qg: block_major_attend(group, qg, k_pool, v_pool, buffers[group])  # noqa: E731
    assert (decode_attention(batched, q, heads_first) - decode_attention(batched, q, block_major)).abs().max() < 1e-4
    t = interleaved_best({"heads-first": lambda: decode_attention(batched, q, heads_first),
                          "block-major": lambda: decode_attention(batched, q, block_major)}, repeats=20)
    print(f"   one layer's decode gather + attention by pool layout: heads-first (Hkv, num_blocks, block, D) "
          f"{t['heads-first'] * 1000:.2f} ms, block-major (num_blocks, block, Hkv, D) {t['block-major'] * 1000:.2f} ms "
          f"({t['block-major'] / t['heads-first']:.2f}x)")
    if args.skip_model:
        return
    from nanoserve.model import load_gguf

    model = load_gguf()
    cache, meta = decode_batch(config, n, args.context, bs, num_layers=config.num_hidden_layers)
    ids = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    positions = meta.seq_lens - 1

    def step(batch_decodes: bool):
        return model.compute_logits(model(ids, positions, PagedAttention(cache, meta, batch_decodes))).argmax(-1)

    t = interleaved_best({"batched": lambda: step(True), "looped": lambda: step(False)}, repeats=2)
    print(f"   whole model (30 layers + LM head): batched {t['batched'] * 1000:.0f} ms = {n / t['batched']:.0f} tokens/s, "
          f"looped {t['looped'] * 1000:.0f} ms = {n / t['looped']:.0f} tokens/s")
    if args.memory_cap_mib:
        print(f"\n4. a fixed memory cap: {args.memory_cap_mib:g} MiB of KV = {num_blocks} blocks of {bs} "
              f"({num_blocks * bs} tokens); {len(workload)} requests at once, prompts 32-128, outputs 32-128 "
              f"(EOS ignored: max_tokens is exactly what each generates, the best case for reserving)")
        print(f"   {'':28s}{'running at once: peak':>22s}{'mean':>7s}{'preemptions':>13s}{'steps':>7s}"
              f"{'seconds':>9s}{'out tok/s':>11s}")
        stats = under_memory_cap(model, num_blocks, bs, workload)
        for name, x in stats.items():
            print(f"   {name:28s}{x['peak_running']:22d}{x['mean_running']:7.1f}{x['preemptions']:13d}{x['steps']:7d}"
                  f"{x['seconds']:9.1f}{x['output_throughput']:11.1f}")
        paged, reserved = stats.values()
        print(f"   paged / reserving: {paged['mean_running'] / reserved['mean_running']:.2f}x the requests running "
              f"(mean), {paged['output_throughput'] / reserved['output_throughput']:.2f}x the output tokens/s")
