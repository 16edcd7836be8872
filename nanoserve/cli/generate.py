"""`python -m nanoserve generate --prompt TEXT`: one completion from the embedded model (chapter 03).

    python -m nanoserve generate --prompt "What is the capital of France?" --chat --temperature 0
    python -m nanoserve generate --prompt "Once upon a time" --max-tokens 20 --seed 1 --json
    python -m nanoserve generate --prompt "Once upon a time" --no-cache --student 01,02,03
    python -m nanoserve generate --prompt "Hi" --chat --student 01,02,03,04    # your exercises of chapters 01-04

Without --chat the prompt is raw text to continue; with --chat it is one user message, rendered
with the model's chat template. The text streams to the terminal as it is generated; --json
prints one JSON object at the end instead. The loop is chapter 03's with chapter 04's KV cache;
--no-cache makes it chapter 03's loop as written, recomputing the whole sequence every step.
--student builds the model from your exercises/02 files (blocks, norms, the model), runs your exercises/01
attention in every layer (with the cache, chapter 04's cache calls it: the queries are the last of the cached
keys, so your mask's offset matters; with --no-cache the model calls it on the whole sequence), and your
sampler, detokenizer and stop check (03) and KV cache (04, without --no-cache).
"""

import json
import sys

from nanoserve.cli import checks


def add_sampling_args(p):
    p.add_argument("--max-tokens", type=checks.positive_int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    p.add_argument("--seed", type=int, default=None, help="for reproducible sampling")
    p.add_argument("--gguf", type=checks.input_file, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence every step (chapter 03) instead of using chapter 04's KV cache")
    p.add_argument("--weights", default="fp32", type=checks.weight_format,
                   help="fp32, int8, q4 or bf16: how the weights are kept (chapter 10)")


def sampling_params(args):
    """The sampling flags as SamplingParams, or a UsageError naming the bad one (before anything loads)."""
    fields = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  max_tokens=args.max_tokens)
    return checks.sampling_params(fields, flags=True)


def register(sub):
    p = sub.add_parser("generate", help="generate a completion for one prompt (chapters 03-04)")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: your message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(p)
    p.add_argument("--student", nargs="?", const=True, default=False, type=checks.chapters, metavar="CHAPTERS",
                   help="run YOUR finished exercises instead of the reference: 01 (the attention), 02 (RMSNorm, the "
                        "block, the model), 03 (sampler, detokenizer, stop check), 04 (the KV cache, without "
                        "--no-cache); alone: those of 01-04 that this run uses. An unfinished one falls back to "
                        "the reference with a warning")
    p.set_defaults(func=run)


def run(args):
    import sys

    from nanoserve.generate import generate
    from nanoserve.model import load_gguf
    from nanoserve.student import StudentCode, parse_selection

    if args.student is True:  # bare --student: the chapters of 01-04 this loop runs
        args.student = "01,02,03" if args.no_cache else "01,02,03,04"
    chosen = parse_selection(args.student)
    if not chosen <= {"01", "02", "03", "04"}:
        raise checks.UsageError(f"--student {args.student}: generate runs chapters 01-04 only (batch and serve run "
                                f"the engine's chapters)")
    if "04" in chosen and args.no_cache:
        raise checks.UsageError("--student 04 runs your KV cache, which --no-cache leaves out: drop one of them")
    params = sampling_params(args)
    if not args.prompt.strip():
        raise checks.UsageError("--prompt is empty")
    tokenizer = checks.load_tokenizer(args.gguf)
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    checks.check_fits(len(prompt_ids), params.max_tokens, checks.context_length(args.gguf), "--prompt")
    student = StudentCode(args.student)
    model = load_gguf(args.gguf, args.weights, modules=student.module)
    stream = None if args.json else (lambda delta: print(delta, end="", flush=True))
    out = generate(model, prompt_ids, params, tokenizer.eos_token_id, tokenizer, on_text=stream,
                   use_cache=not args.no_cache, modules=student.module)
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
                          "finish_reason": out.finish_reason}, ensure_ascii=False))
    else:
        print()
    if student:  # whose code ran (known once the loop has asked for each part), and how often
        print(student.describe(runs="the generate loop ran") + "\n" + student.proof(), file=sys.stderr)
    return 0
