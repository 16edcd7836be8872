"""`python -m nanoserve batch --input requests.jsonl --output results.jsonl`: offline batch inference.

Each input line is one request, a JSON object with exactly one of "prompt" (a string), "messages"
(a chat) or "prompt_token_ids", plus optional "id", "priority" and sampling fields:

    {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16, "temperature": 0}
    {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "top_p": 0.9, "seed": 1, "stop": ["."]}

Each output line, in input order, carries the input's "line" (and "id"), prompt_token_ids, token_ids,
text, finish_reason and the request's metrics (seconds). Results are written as they finish (in
input order), so an interrupted run keeps what it finished.

Every line is checked before the model loads. A line that is not valid gets {"line": N, "error": ...}
in its output line and `error: requests.jsonl:N: ...` on stderr, naming the field it wrote; the
other requests still run. Exit status: 0 all lines ran; 1 some lines were malformed (the others
ran); 2 nothing ran (a bad option, an unreadable --input or an unwritable --output).
"""

import json
import re
import sys

from nanoserve.cli import checks

SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"}
INPUT_FIELDS = {"prompt", "messages", "prompt_token_ids", "id", "priority"}


def register(sub):
    p = sub.add_parser("batch", help="run a JSONL file of requests through the engine (continuous batching)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--input", required=True, type=checks.input_file, help="requests, one JSON object per line")
    p.add_argument("--output", required=True, type=checks.output_file,
                   help="results, one JSON object per input line, same order")
    p.add_argument("--model", type=checks.input_file, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def add_engine_args(p):
    """The engine knobs, shared with `bench offline`."""
    p.add_argument("--block-size", type=checks.positive_int, default=16, help="tokens per KV block")
    checks.add_pool_size_args(p)
    p.add_argument("--max-num-seqs", type=checks.positive_int, default=64, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=checks.positive_int, default=2048, help="token budget of a step")
    p.add_argument("--no-chunked-prefill", action="store_true", help="a prompt that does not fit the budget waits")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse the KV blocks of a shared prefix")
    p.add_argument("--student", nargs="?", const=True, default=False, type=checks.chapters, metavar="CHAPTERS",
                   help="run YOUR finished exercises from exercises/ (the allocator and prefix cache of 05, the "
                        "scheduler of 06, ...) instead of the reference: all of them, or the chapters given, "
                        "e.g. --student 05,06 (serve: also your request params, stream, async engine and limiter, 08); an unfinished one falls back to the reference "
                        "with a warning. A chapter whose code this command never calls is refused, naming the command "
                        "that runs it: 01 and 04 (generate; 04's formula, memory), 09 (bench serve) and those of "
                        "08, 12, 13, 16, 17 and 19 it never calls (serve runs them); so is --student 02 with --tensor-parallel-size > 1")
    p.add_argument("--attention-backend", default=None, type=checks.attention_backend, metavar="{torch,triton}",
                   help="paged attention in torch or in Triton kernels (chapter 07; default: torch on the CPU, "
                        "triton on CUDA; on a CPU triton needs TRITON_INTERPRET=1)")
    p.add_argument("--weights", default="fp32", type=checks.weight_format,
                   help="fp32, int8, q4 or bf16: how the weights are kept (chapter 10)")
    p.add_argument("--degrade-under-load", type=checks.positive_int, default=None, metavar="N",
                   help="with N requests waiting, run steps on a q4 copy of the weights until N/2 wait (chapter 10)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding (chapter 14): n-gram prompt lookup, or the model's first layers as a draft")
    p.add_argument("--num-speculative-tokens", type=checks.positive_int, default=None, metavar="K",
                   help="with --speculative: tokens proposed and verified per step (default 4)")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority", "slo", "fair"],
                   help="who is admitted, served and preempted first (chapter 15; default: priority, then arrival; "
                        "serve with --api-keys: fair)")
    p.add_argument("--slo-ttft-ms", type=checks.positive_float, default=None, metavar="MS",
                   help="the slo policy's default time-to-first-token target (a request may ask its own)")
    p.add_argument("--slo-tpot-ms", type=checks.positive_float, default=None, metavar="MS",
                   help="the slo policy's default time-per-output-token target")
    p.add_argument("--slo-reject", action="store_true",
                   help="slo policy: refuse a request whose TTFT deadline is already lost instead of serving it late")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp8"],
                   help="the KV pool's dtype: auto = the model's (float32); bf16 halves the bytes per token (ch 06); "
                        "int8 / fp8: 8-bit codes with a scale per token and kv head, 1.94x bf16's blocks (ch 18)")
    p.add_argument("--kv-tier-blocks", type=checks.tier_blocks, default=0, metavar="N",
                   help="a second KV tier (chapter 18): evicted prefix blocks go to a file of N >= 2 block slots and "
                        "are loaded back on a hit, at most N/2 blocks per new sequence (0: off)")
    p.add_argument("--kv-tier-path", default=None, metavar="FILE", type=checks.new_file,
                   help="with --kv-tier-blocks: the tier's file, which must not exist yet (default: a temporary file; "
                        "either is removed at exit)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request loses: recompute = its KV blocks, computed again when it resumes "
                        "(ch 06); swap = none, its blocks wait in the --kv-tier-blocks tier and come back (ch 18)")
    p.add_argument("--compile-mode", default="eager", choices=["eager", "buckets", "dynamic"],
                   help="eager: op by op (the reference); buckets / dynamic: each step's forward through torch.compile, "
                        "padded up to a few fixed token counts or with a symbolic one (chapter 09; compiled code is "
                        "cached under $TORCHINDUCTOR_CACHE_DIR, default ~/.cache/nanoserve/inductor)")
    p.add_argument("--integer-dot", default="auto", choices=["auto", "on", "off"],
                   help="int8 / q4 small steps in kernels/cpu_dot.c's integer products (on) or torch's kernels (off); "
                        "auto: cpu_dot where the CPU has no native bf16 (chapter 10); a learner's exercise "
                        "10.2 / 10.3 code keeps torch's int4 kernel")
    p.add_argument("--native-decode", default="auto", choices=["auto", "on", "off"],
                   help="q4: a step of one token per sequence (up to 16 sequences on a CPU without native bf16, one elsewhere) "
                        "runs every layer in one C call (kernels/cpu_decode.c, "
                        "chapter 09) instead of the model's forward; auto: on for q4 where it can run (not with "
                        "--integer-dot off, an int8 / fp8 KV pool, Triton, LoRA, --student 02, 05 or 10; on: refused there)")
    p.add_argument("--tensor-parallel-size", "-tp", type=checks.positive_int, default=1,
                   help="split the model over this many processes (chapter 11); SmolLM2 splits 1 or 3 ways (9 would "
                        "split its heads, but not its 1536 MLP features)")


def command_line(args, add_arguments, command: str) -> str:
    """The command that reproduces a run of `command` ("bench offline"): every flag `add_arguments` adds, the engine's
    (add_engine_args) only where not at their default."""
    import argparse
    import shlex

    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    engine_flags = {a.dest for a in engine._actions}  # noqa: SLF001 — argparse's list of actions
    p = argparse.ArgumentParser()
    add_arguments(p)
    words = []
    for action in p._actions:  # noqa: SLF001
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "help" or value is None or (
                action.dest in engine_flags and value == action.default):
            continue
        flag = max(action.option_strings, key=len)
        if value is True:
            words.append(flag)
        elif value is not False:
            words.append(" ".join([flag, *(shlex.quote(str(v)) for v in (value if isinstance(value, list) else [value]))]))
    return f"python -m nanoserve {command} " + " ".join(words)


def engine_kwargs(args, **extra) -> dict:
    """LLM's keyword arguments (all but the model and the tokenizer) that the engine flags describe; `extra`: more
    of them (serve: the tenants' weights and SLO targets, chapter 15). One function for one process and for every
    replica of a fleet (chapter 16), so a flag cannot reach one and not the other."""
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_mib << 20,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill, enable_prefix_caching=not args.no_prefix_caching,
                student=args.student, attention_backend=args.attention_backend, weights=args.weights,
                degrade_under_load=args.degrade_under_load, tensor_parallel_size=args.tensor_parallel_size,
                speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens or 4,
                scheduling_policy=args.scheduling_policy or "priority", slo_ttft_ms=args.slo_ttft_ms,
                slo_tpot_ms=args.slo_tpot_ms, slo_reject=args.slo_reject, kv_cache_dtype=args.kv_cache_dtype,
                compile_mode=args.compile_mode, kv_tier_blocks=args.kv_tier_blocks, kv_tier_path=args.kv_tier_path,
                preemption_mode=args.preemption_mode,
                integer_dot=checks.AUTO_ON_OFF[args.integer_dot],
                native_decode=checks.AUTO_ON_OFF[getattr(args, "native_decode", "auto")], **extra)


def native_settings(args) -> tuple:
    """cpu_decode.native_decode_blocker's arguments from the engine flags (chapter 09's native step)."""
    from nanoserve.student import parse_selection

    return (args.weights, checks.AUTO_ON_OFF[args.integer_dot], args.tensor_parallel_size,
            bool(getattr(args, "enable_lora", False) or getattr(args, "lora_modules", None)), args.kv_cache_dtype,
            args.attention_backend, parse_selection(args.student))


def check_engine_args(args) -> str | None:
    """The engine flags that argparse cannot refuse one at a time, in words, or None."""
    from nanoserve.engine.config import engine_config
    from nanoserve.student import engine_refusal, parse_selection

    # refused here, before the model loads: a chapter no engine calls (the engine refuses the same), or one this
    # command never calls (batch: chapter 16's routing, which serve --replicas runs)
    command = " ".join(filter(None, (getattr(args, "command", "batch"), getattr(args, "bench", None))))
    refused = engine_refusal(args.student, command)
    if refused is not None:
        return f"--student {args.student}: {refused}"
    if args.integer_dot != "auto":
        from nanoserve.kernels import cpu_dot

        if args.weights in ("fp32", "bf16"):
            return f"--integer-dot chooses the small-step kernel of int8 / q4 weights, not of --weights {args.weights}"
        if args.tensor_parallel_size > 1:
            return "--integer-dot is single-process only (tensor parallelism runs float32 weights)"
        if args.integer_dot == "on" and not cpu_dot.available():
            return f"--integer-dot on: kernels/cpu_dot.c does not build here ({cpu_dot.build_error()})"
    if getattr(args, "native_decode", "auto") == "on":
        from nanoserve.kernels.cpu_decode import check_native_decode

        try:
            check_native_decode(True, *native_settings(args))
        except ValueError as e:
            return f"--native-decode on: {str(e).removeprefix('native_decode=True, but ')}"
    if args.num_speculative_tokens is not None and args.speculative is None:
        return "--num-speculative-tokens needs --speculative ngram or draft"
    if args.attention_backend == "triton" and args.kv_cache_dtype not in (None, "auto"):
        # refused here, before the model loads; the engine refuses the same (LLMEngine: "kv_cache_dtype applies")
        return (f"--kv-cache-dtype {args.kv_cache_dtype} applies to the torch attention backend; the Triton kernels "
                "read the model's dtype (chapter 07): not with --attention-backend triton")
    if args.preemption_mode == "swap" and not args.kv_tier_blocks:
        return "--preemption-mode swap writes preempted requests' KV blocks to the second tier: give --kv-tier-blocks N"
    if args.preemption_mode == "swap" and args.tensor_parallel_size > 1:
        return "--preemption-mode swap needs the KV tier, which is single-process: not with --tensor-parallel-size"
    if args.tensor_parallel_size > 1 and "02" in parse_selection(args.student):
        # refused here, before the model loads; LLM refuses the same (EngineConfig.check_tensor_parallel)
        return ("--tensor-parallel-size > 1 builds every rank's shard from the reference Llama, not your chapter 02 "
                "blocks and norms: not with --student 02 (a bare --student selects every chapter: name the ones to "
                "run, e.g. --student 05,06,11)")
    if args.compile_mode != "eager" and "02" in parse_selection(args.student):
        # refused here, before the model loads; the engine refuses the same (LLMEngine: "its own loop")
        return (f"--compile-mode {args.compile_mode} runs its own loop over the reference block's halves, not your "
                "Llama.forward and DecoderBlock.forward: not with --student 02 (a bare --student selects every chapter)")
    if args.preemption_mode == "swap" and {"06", "18"} & parse_selection(args.student):
        # refused here, before the model loads; the engine refuses the same (LLMEngine: "reference scheduler")
        return ("--preemption-mode swap runs on the reference scheduler and tier index: not with --student 06 or 18 "
                "(a bare --student selects every chapter)")
    try:  # the KV tier or an int8 / fp8 pool with chapter 05: asked of the engine's own check, before the model loads
        engine_config(kv_tier_blocks=args.kv_tier_blocks,
                      kv_cache_dtype=args.kv_cache_dtype).check_student(parse_selection(args.student))
    except ValueError as e:
        bare = args.student is True
        return f"--student{'' if bare else ' ' + args.student}: {e}" + (
            " (a bare --student selects every chapter)" if bare else "")
    return None


def llm_from_args(args, tokenizer=None, **extra):
    """The LLM the engine flags describe (engine_kwargs); the flags check_engine_args refuses are a UsageError
    here too, for the commands that build an engine without calling it first (bench offline, bench http)."""
    from nanoserve.llm import LLM

    problem = check_engine_args(args)
    if problem is not None:
        raise checks.UsageError(problem)
    return LLM(getattr(args, "model", None), tokenizer=tokenizer, **engine_kwargs(args, **extra))


def prompt_token_ids(obj: dict, tokenizer) -> tuple[list[int], str]:
    """(prompt ids, the field they came from) of one request; ValueError naming the field."""
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        return tokenizer.encode(obj["prompt"]), "prompt"
    if "messages" in obj:
        messages = obj["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ValueError('"messages" must be a non-empty list of {"role": "...", "content": "..."}')
        return tokenizer.encode_chat(messages), "messages"
    ids = obj["prompt_token_ids"]
    if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < tokenizer.vocab_size for t in ids)):
        raise ValueError(f'"prompt_token_ids" must be a non-empty list of ints in [0, {tokenizer.vocab_size})')
    return ids, "prompt_token_ids"


def parse_line(line: str, tokenizer, context: int):
    """(prompt ids, SamplingParams, priority, id or None) of one JSONL line; ValueError naming what is wrong."""
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
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if isinstance(fields.get("stop"), str):  # OpenAI's APIs take one stop string too
        fields["stop"] = [fields["stop"]]
    params = checks.sampling_params(fields)
    priority = obj.get("priority", 0)
    if type(priority) is not int:
        raise ValueError(f'"priority" must be an int, got {priority!r}')
    ids, field = prompt_token_ids(obj, tokenizer)
    checks.check_fits(len(ids), params.max_tokens, context, f'"{field}"')
    return ids, params, priority, obj.get("id")


class InOrderWriter:
    """Writes result records in input order, each as soon as it and all before it are complete."""

    def __init__(self, path: str, records: list[dict]):
        self.file = open(path, "w")
        self.records, self.next = records, 0

    def flush(self) -> None:
        while self.next < len(self.records) and ({"error", "token_ids"} & set(self.records[self.next])):
            self.file.write(json.dumps(self.records[self.next]) + "\n")
            self.next += 1
        self.file.flush()

    def close(self) -> None:
        self.flush()
        self.file.close()


def run(args):
    problem = check_engine_args(args)
    if problem is not None:
        raise checks.UsageError(problem)
    try:
        # utf-8-sig: a leading byte-order mark (Windows editors write one) is skipped, not read as JSON
        with open(args.input, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise checks.UsageError(f"{args.input} is not UTF-8 text: {e}") from None
    if not any(line.strip() for line in lines):
        raise checks.UsageError(f"{args.input} holds no requests")
    tokenizer = checks.load_tokenizer(args.model)
    context = checks.context_length(args.model)

    records: list[dict] = []  # one per non-blank input line, in order
    requests = []  # (index in records, prompt ids, params, priority)

    def reject(i: int, message: str) -> None:
        records[i]["error"] = message
        print(f"error: {args.input}:{records[i]['line']}: {message}", file=sys.stderr)

    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        records.append({"line": n})
        try:
            ids, params, priority, custom_id = parse_line(line, tokenizer, context)
            if custom_id is not None:
                records[-1]["id"] = custom_id
            requests.append((len(records) - 1, ids, params, priority))
        except ValueError as e:
            reject(len(records) - 1, str(e))

    writer = InOrderWriter(args.output, records)
    writer.flush()  # the malformed lines at the top are on disk before the model loads
    if requests:
        try:
            # a model that cannot be split --tensor-parallel-size ways is a ValueError before any process starts
            llm = llm_from_args(args, tokenizer)
        except ValueError as e:
            raise checks.UsageError(str(e)) from None
        with llm:  # with tensor parallelism (chapter 11) the worker processes stop at the end, whatever happens
            run_requests(llm, requests, records, writer, reject, not args.no_progress)
    writer.close()
    num_errors = sum("error" in r for r in records)
    print(f"wrote {len(records)} results to {args.output} ({num_errors} malformed line(s))", file=sys.stderr)
    return 1 if num_errors else 0


def run_requests(llm, requests, records, writer, reject, use_tqdm: bool) -> None:
    """Serve the parsed requests; each result is written the moment it and all lines before it are done."""
    from nanoserve.distributed.parallel_state import WorkerError

    index = {}  # request id -> index in records
    for i, ids, params, priority in requests:
        try:
            index[llm.add_request({"prompt_token_ids": ids}, params, priority)] = i
        except ValueError as e:  # e.g. more tokens than the whole KV pool holds
            reject(i, re.sub(r"^request '[^']*':? ", "", str(e)))  # the line number names it better

    def finished(out):
        records[index[out.request_id]].update(
            prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids, text=out.text,
            finish_reason=out.finish_reason, metrics=out.metrics)
        writer.flush()

    try:
        llm.run(list(index), use_tqdm=use_tqdm, on_finished=finished)
    except WorkerError as e:  # a tensor-parallel worker died: its requests failed, the group is shut down
        raise checks.UsageError(str(e)) from None
