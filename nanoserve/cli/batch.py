"""`python -m nanoserve batch --input requests.jsonl --output results.jsonl`: offline batch inference.

Each input line is one request, a JSON object with either "prompt" (a string), "messages" (a chat)
or "prompt_token_ids", plus optional sampling fields:

    {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16, "temperature": 0}
    {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 1, "stop": ["."]}

Each output line, in input order, carries prompt_token_ids, token_ids, text, finish_reason and the
request's metrics (seconds). A line that cannot be parsed or validated gets {"line": N, "error": ...}
in its output line and a message on stderr; the other requests still run.
"""

import json
import sys

SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"}
INPUT_FIELDS = {"prompt", "messages", "prompt_token_ids", "id", "priority"}


def register(sub):
    p = sub.add_parser("batch", help="run a JSONL file of requests through the engine (continuous batching)")
    p.add_argument("--input", required=True, help="requests, one JSON object per line")
    p.add_argument("--output", required=True, help="results, one JSON object per input line, same order")
    p.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def add_engine_args(p):
    """The engine knobs, shared with `bench offline`."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: from --kv-cache-mib)")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="KV pool bytes, in MiB, when --num-blocks is not given")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--student", action="store_true", help="run YOUR scheduler, block allocator and prefix cache from exercises/ "
                                                        "(serve: and YOUR SSE streaming, exercise 08)")


def llm_from_args(args):
    from nanoserve.llm import LLM

    return LLM(getattr(args, "model", None), block_size=args.block_size,
               num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=not args.no_chunked_prefill,
               enable_prefix_caching=not args.no_prefix_caching, student=args.student)


def parse_line(line: str):
    """(input item, SamplingParams, priority, id or None) of one JSONL line; ValueError naming what is wrong."""
    from nanoserve.sampling import SamplingParams

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - SAMPLING_FIELDS - INPUT_FIELDS
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS | INPUT_FIELDS)}")
    if sum(k in obj for k in ("prompt", "messages", "prompt_token_ids")) != 1:
        raise ValueError('give exactly one of "prompt", "messages" or "prompt_token_ids"')
    params = SamplingParams(**{k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    priority = obj.get("priority", 0)
    if not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    return {k: obj[k] for k in ("prompt", "messages", "prompt_token_ids") if k in obj}, params, priority, obj.get("id")


def run(args):
    llm = llm_from_args(args)
    with open(args.input) as f:
        lines = f.read().splitlines()
    records: list[dict] = []
    request_ids: dict[str, int] = {}  # request id -> index in records
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = {"line": n}
        try:
            item, params, priority, custom_id = parse_line(line)
            if custom_id is not None:
                record["id"] = custom_id
            request_ids[llm.add_request(item, params, priority)] = len(records)
        except (ValueError, TypeError) as e:
            record["error"] = str(e)
            print(f"{args.input}:{n}: {e}", file=sys.stderr)
        records.append(record)
    finished = llm.run(list(request_ids), use_tqdm=not args.no_progress)
    for request_id, i in request_ids.items():
        out = finished[request_id]
        records[i].update(prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids, text=out.text,
                          finish_reason=out.finish_reason, metrics=out.metrics)
    with open(args.output, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    num_errors = sum("error" in r for r in records)
    print(f"wrote {len(records)} results to {args.output} ({num_errors} malformed line(s))", file=sys.stderr)
    return 1 if num_errors else 0
