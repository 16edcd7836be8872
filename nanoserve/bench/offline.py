"""`python -m nanoserve bench offline`: chapter 06's throughput, measured side by side in one run.

The same seeded workload (random prompt ids, every request generating exactly its output length,
EOS ignored) through three systems:

  nanoserve       every request submitted at once; continuous batching, paged KV, chunked prefill
  one at a time   chapter 04's generate loop with its contiguous KV cache, request after request
  HF static       transformers' generate (float32) on static, left-padded batches of --hf-batch-size
                  (default: --max-num-seqs, nanoserve's seats): a batch runs until its longest request is
                  done, and only requested tokens count

Output tokens per second of wall time, the same measure for all three. A ratio to nanoserve is printed
only for a baseline that served every request of the workload: with --sequential-requests / --hf-requests
N smaller than the workload, the baseline times the first N requests alone, a different workload, and
only its tokens/s are printed. nanoserve's TTFT, TPOT, ITL and E2E percentiles (chapter 09's definitions,
nanoserve/metrics.py) are printed beside its tokens/s, with its schedule: engine steps, sequences per
step, and the step that first scheduled the last request (every request arrives at once, so TTFT includes
the time queued behind the others' prefills). The HF line counts its decode rows and prompt tokens, the
padded ones too.

This machine's speed drifts by tens of per cent over minutes, so the baselines do not run after
nanoserve's run but inside it: their jobs (one request, or one static batch) run between nanoserve's
engine steps, spread over the run, each system's time summed on its own clock (pausing between steps
changes nothing for the engine: its requests all arrived at once). Every system serves one small
workload first, untimed (warm-up). With --rounds R the whole run repeats R times, the baselines' order
reversed every other round, each round's requests under a cache salt of their own (no round finds the
last one's prompts in the prefix cache); each system's figures are from its median round.

The engine flags (nanoserve/cli/batch.py) configure nanoserve. The `command:` line prints this benchmark's
own flags, and the engine flags not at their default, and the header the weights and KV pool each system ran with. Refused, before the
model loads: tensor parallelism with the one-at-a-time baseline (chapter 04's loop would run rank 0's
shard alone), --weights other than fp32 with the HF baseline (transformers runs the float32 model), and
--hf-batch-size with --hf-requests 0 (no HF batch to size).
"""

import random
import statistics
import time
from functools import partial
from typing import NamedTuple

import torch

from nanoserve.cli import checks
from nanoserve.metrics import summarize


def add_arguments(p) -> None:
    from nanoserve.cli.batch import add_engine_args

    p.add_argument("--num-requests", type=checks.positive_int, default=16)
    p.add_argument("--prompt-len", type=checks.positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=checks.positive_int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential-requests", type=checks.count_or_all, default=-1,
                   help="run the one-at-a-time baseline on every request (-1), none (0) or the first N (its tokens/s "
                        "alone: no ratio)")
    p.add_argument("--hf-requests", type=checks.count_or_all, default=-1,
                   help="run the HF static-batch baseline on every request (-1), none (0) or the first N (its "
                        "tokens/s alone: no ratio)")
    p.add_argument("--hf-batch-size", type=checks.positive_int, default=None,
                   help="requests per HF static batch (default: --max-num-seqs, as many seats as nanoserve has)")
    p.add_argument("--rounds", type=checks.positive_int, default=1,
                   help="repeat the whole run; each system's figures are its median round")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, = the cores). On a machine shared with other jobs, 1 thread "
                        "avoids the oversubscription that makes 2 threads up to 10x slower")
    add_engine_args(p)


def register(sub):
    p = sub.add_parser("offline", help="continuous batching vs one-at-a-time vs HF static batches (chapter 06)")
    add_arguments(p)
    p.set_defaults(func=run)


def check_args(args) -> str | None:
    """What this benchmark cannot honour, in words, or None; asked before the model loads."""
    for flag, (low, high) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
        if low > high:
            return f"{flag} {low} {high}: MIN is larger than MAX"
    if args.tensor_parallel_size > 1 and args.sequential_requests:
        return ("--tensor-parallel-size runs nanoserve's other ranks in worker processes, and the one-at-a-time "
                "baseline would run chapter 04's loop on rank 0's shard alone: give --sequential-requests 0")
    if args.hf_batch_size is not None and args.hf_requests == 0:
        return "--hf-batch-size sizes the HF baseline's batches; --hf-requests 0 runs none: drop one of the two"
    if args.weights != "fp32" and args.hf_requests:
        return (f"the HF static baseline runs transformers' float32 model, not --weights {args.weights}: give "
                "--hf-requests 0 (bench peers compares the weight formats with transformers)")
    return None


def command_line(args) -> str:
    """The command that reproduces this run: this benchmark's own flags, and every engine flag not at its default."""
    from nanoserve.cli.batch import command_line as engine_command_line

    return engine_command_line(args, add_arguments, "bench offline")


def make_workload(num_requests: int, prompt_len, output_len, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt_token_ids, num_output_tokens)], the same for every system."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num_requests)]


def params(num_output_tokens: int):
    from nanoserve.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=num_output_tokens, ignore_eos=True)


class OfflineRun(NamedTuple):
    seconds: float  # nanoserve's, side jobs left out
    side_seconds: dict  # {name: seconds of that list of side jobs, on its own clock}
    steps: int
    preemptions: int
    records: list  # one RequestRecord per request
    scheduled: int  # sequences scheduled, summed over the steps (a sequence in a step counts once)
    last_admitted: int  # the step that first scheduled the last request to start


def run_nanoserve(engine, workload, side_jobs: dict | None = None, every: dict | None = None) -> OfflineRun:
    """nanoserve serving `workload`, [(prompt ids, output tokens[, add_request kwargs])], submitted at once.

    side_jobs: {name: [callables]}; list `name`'s jobs run one after engine step 1, 1 + every[name],
    1 + 2·every[name], ... (any left over at the end), in the dict's order where two fall after the same step,
    each timed on its name's clock, which nanoserve's seconds leave out. The records are stamped on nanoserve's
    clock too (wall time minus the side jobs so far), so their TTFT and TPOT are not inflated by the pauses.
    The engine ends empty.
    """
    from nanoserve.metrics import RequestRecord

    queues = {name: list(jobs) for name, jobs in (side_jobs or {}).items()}
    side = dict.fromkeys(queues, 0.0)
    t0 = time.perf_counter()
    records = {str(i): RequestRecord(start=0.0, prompt_tokens=len(prompt)) for i, (prompt, *_) in enumerate(workload)}
    for i, (prompt, n, *kwargs) in enumerate(workload):
        engine.add_request(str(i), prompt, params(n), **(kwargs[0] if kwargs else {}))
    steps = preemptions = scheduled = last_admitted = 0
    started: set[str] = set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stamp_outputs(records, outputs, time.perf_counter() - t0 - sum(side.values()))  # on nanoserve's clock
        steps += 1
        plan = engine.last_scheduler_output
        preemptions += len(plan.preempted_seq_ids)
        scheduled += len(plan.scheduled_seqs)
        if {s.seq_id for s in plan.scheduled_seqs} - started:
            started |= {s.seq_id for s in plan.scheduled_seqs}
            last_admitted = steps
        for name, jobs in queues.items():
            if jobs and (steps - 1) % every[name] == 0:
                side[name] += timed(jobs.pop(0))
    seconds = time.perf_counter() - t0 - sum(side.values())
    for name, jobs in queues.items():
        side[name] += sum(timed(job) for job in jobs)
    return OfflineRun(seconds, side, steps, preemptions, list(records.values()), scheduled, last_admitted)


def timed(job) -> float:
    t0 = time.perf_counter()
    job()
    return time.perf_counter() - t0


def stamp_outputs(records: dict, outputs, now: float) -> None:
    """One engine step's RequestOutputs into their RequestRecords: a chunk at `now` for each, the end if finished."""
    for out in outputs:
        record = records[out.request_id]
        record.chunk_times.append(now)
        record.output_tokens = len(out.token_ids)
        if out.finished:
            record.end = now


def one_at_a_time_jobs(model, workload) -> list:
    """Chapter 04's generate loop with its contiguous KV cache: one job per request."""
    from nanoserve.generate import generate

    return [partial(generate, model, prompt, params(n), eos_token_id=-1, use_cache=True) for prompt, n in workload]


@torch.inference_mode()
def hf_static_batch(hf_model, batch) -> None:
    """One static batch through transformers' generate: left-padded, run until its longest member is done."""
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
    longest = max(n for _, n in batch)  # a static batch runs until its longest member is done
    hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                      do_sample=False, pad_token_id=0)


def hf_static_jobs(hf_model, workload, batch_size: int) -> list:
    """One job per static batch of `batch_size` requests, in order."""
    return [partial(hf_static_batch, hf_model, workload[b:b + batch_size]) for b in range(0, len(workload), batch_size)]


def run_hf_static(hf_model, workload, batch_size: int) -> float:
    """Seconds for every static batch of the workload, one after the other."""
    return sum(timed(job) for job in hf_static_jobs(hf_model, workload, batch_size))


def static_rows(workload, batch_size: int) -> tuple[int, int, int]:
    """(steps, rows, prompt tokens computed) of static batches: each batch runs its longest output's steps (its
    prefill, which samples the first token, and the decodes after it) with every member a row, and its prompts are
    left-padded to its longest."""
    batches = [workload[b:b + batch_size] for b in range(0, len(workload), batch_size)]
    longest = [max(n for _, n in batch) for batch in batches]
    return (sum(longest), sum(len(batch) * n for batch, n in zip(batches, longest)),
            sum(len(batch) * max(len(p) for p, _ in batch) for batch in batches))


def load_hf_model():
    from transformers import AutoModelForCausalLM

    from nanoserve.model import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def report(name: str, workload, seconds: float) -> float:
    out_tokens = sum(n for _, n in workload)
    all_tokens = out_tokens + sum(len(p) for p, _ in workload)
    rate = out_tokens / seconds
    print(f"  {name:28s} {len(workload):4d} req {out_tokens:7d} out tok {seconds:8.1f} s "
          f"{rate:8.1f} out tok/s {all_tokens / seconds:8.1f} total tok/s")
    return rate


def compare(label: str, batch, workload, ours: list[float], theirs: list[float]) -> None:
    """A baseline's line under its row: nanoserve's ratio if it served the same requests as nanoserve, else why there
    is none. ours, theirs: output tokens/s per round; the ratio is of the median rounds', each round's beside it."""
    if len(batch) < len(workload):
        print(f"    (the first {len(batch)} of {len(workload)} requests: not nanoserve's workload, so no ratio)")
        return
    per_round = " ".join(f"{a / b:.2f}x" for a, b in zip(ours, theirs))
    print(f"    nanoserve / {label}: {statistics.median_high(ours) / statistics.median_high(theirs):.2f}x output "
          f"tokens/s" + (f" (each round: {per_round})" if len(ours) > 1 else ""))


def print_latencies(summary: dict, indent: str = "") -> None:
    """TTFT / TPOT / ITL / E2E rows (ms) of a metrics.summarize() result."""
    print(f"{indent}{'ms':6s}" + "".join(f"{k:>10s}" for k in ("mean", "median", "p90", "p99")))
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = summary[f"{name}_ms"]
        print(f"{indent}{name.upper():6s}" + "".join(
            f"{row[k]:10.1f}" if row[k] is not None else f"{'-':>10s}" for k in ("mean", "median", "p90", "p99")))


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype).removeprefix("torch."))


def cpu_description() -> str:
    """The CPU a benchmark ran on, for its header: torch's capability (AVX2, AVX512, ...) and the CPU's bf16
    instructions (amx_bf16, avx512_bf16 or None), which set the kernels oneDNN picks and the dtype of int8 / q4's
    large-step GEMM (chapter 10). torch's capability reads AVX512 with AMX or without; the bf16 flag tells those
    machines apart."""
    from nanoserve.model.quant import bf16_instructions

    return f"CPU: {torch.backends.cpu.get_cpu_capability()}, bf16 instructions: {bf16_instructions()}"


def served_format(model, engine) -> tuple[str, str]:
    """(the weights' format, the KV pool's dtype) the engine runs: what a benchmark's header says it measured."""
    kv = engine.config.cache_config.kv_cache_dtype
    return getattr(model, "weight_format", "fp32"), dtype_name(next(model.parameters()).dtype) if kv == "auto" else kv


def run(args):
    from nanoserve.cli.batch import llm_from_args

    problem = check_args(args)
    if problem is not None:
        raise checks.UsageError(problem)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = llm_from_args(args)
    try:
        measure(args, llm)
    finally:
        llm.close()


def measure(args, llm) -> None:
    model, engine = llm.model, llm.engine
    workload = make_workload(args.num_requests, args.prompt_len, args.output_len, args.seed, model.config.vocab_size)
    outputs = [n for _, n in workload]
    subset = lambda n: workload if n < 0 else workload[:n]  # noqa: E731
    sequential, hf_batch = subset(args.sequential_requests), subset(args.hf_requests)
    hf_size = args.hf_batch_size or args.max_num_seqs
    hf_model = load_hf_model() if hf_batch else None

    def baseline_jobs(batch_of_sequential, batch_of_hf) -> dict:
        """{name: its jobs} of the baselines that run (fresh callables: a round pops them)."""
        jobs = {"one at a time": one_at_a_time_jobs(model, batch_of_sequential),
                "HF static": hf_static_jobs(hf_model, batch_of_hf, hf_size) if batch_of_hf else []}
        return {name: j for name, j in jobs.items() if j}

    warm = make_workload(4, (8, 16), (2, 4), 1, model.config.vocab_size)  # every system once, untimed
    run_nanoserve(engine, warm)
    for job in sum(baseline_jobs(warm[:1] if sequential else [], warm if hf_batch else []).values(), []):
        job()

    print("command: " + command_line(args))
    weights, pool = served_format(model, engine)
    print(f"threads: {torch.get_num_threads()}; nanoserve: weights {weights}, KV pool {pool}, "
          f"{engine.block_manager.num_blocks} "
          f"blocks of {args.block_size} tokens, {args.max_num_seqs} seats"
          + (f"; one at a time: weights {weights}, a contiguous {dtype_name(model.norm.weight.dtype)} cache"
             if sequential else "") + ("; HF static: transformers, float32" if hf_batch else ""))
    print(f"workload: {len(workload)} requests, {sum(len(p) for p, _ in workload):,} prompt tokens (longest "
          f"{max(len(p) for p, _ in workload)}), {sum(outputs):,} output tokens (longest {max(outputs)}); "
          f"{args.rounds} round{'s' if args.rounds > 1 else ''} after a warm-up")
    # spread each baseline's jobs over the run, which takes at least as many steps as the longest output and as the
    # output tokens over the seats
    least_steps = max(max(outputs), -(-sum(outputs) // args.max_num_seqs))
    every = {name: max(1, least_steps // len(jobs)) for name, jobs in baseline_jobs(sequential, hf_batch).items()}
    runs = []
    for r in range(args.rounds):
        jobs = baseline_jobs(sequential, hf_batch)
        order = list(jobs) if r % 2 == 0 else list(jobs)[::-1]  # which goes first when two fall after one step
        salted = [(p, n, {"cache_salt": f"round-{r}"}) for p, n in workload]
        runs.append(run_nanoserve(engine, salted, {name: jobs[name] for name in order}, every))

    def rounds(seconds: list[float]) -> str:
        return f"; rounds: {' '.join(f'{s:.1f} s' for s in seconds)}" if len(seconds) > 1 else ""

    seconds = [x.seconds for x in runs]
    median = runs[seconds.index(statistics.median_low(seconds))]
    report("nanoserve (continuous)", workload, median.seconds)
    print(f"    {median.steps} engine steps, {median.preemptions} preemptions, {median.scheduled / median.steps:.1f} "
          f"sequences per step on average, the last request first scheduled in step {median.last_admitted}"
          + rounds(seconds))
    print_latencies(summarize(median.records, median.seconds), "    ")
    for name, batch, label in (("one at a time", sequential, "one at a time (ch04 cache)"),
                               ("HF static", hf_batch, f"HF static batches of {hf_size}")):
        if not batch:
            continue
        side = [x.side_seconds[name] for x in runs]
        report(label, batch, statistics.median_low(side))
        if name == "HF static":
            steps, rows, padded = static_rows(batch, hf_size)
            useful = sum(n for _, n in batch)
            print(f"    {steps} steps (each batch's prefill and its decodes), {rows:,} rows for {useful:,} requested "
                  f"tokens ({useful / rows:.0%} of the rows useful); {padded:,} prompt tokens computed for "
                  f"{sum(len(p) for p, _ in batch):,} (each batch padded to its longest)")
        print(f"    its jobs ran between nanoserve's steps, one every {every[name]} steps{rounds(side)}")
        compare(name, batch, workload, [sum(outputs) / s for s in seconds], [sum(n for _, n in batch) / s for s in side])
