"""`python -m nanoserve bench offline`: chapter 06's throughput, measured side by side in one run.

The same seeded workload (random prompt ids, every request generating exactly its output length,
EOS ignored) through three systems:

  nanoserve       every request submitted at once; continuous batching, paged KV, chunked prefill
  one at a time   chapter 04's generate loop with its contiguous KV cache, request after request
  HF static       transformers' generate on static, left-padded batches of --hf-batch-size: a batch
                  runs until its longest request is done, and only requested tokens count

The baselines are slow, so by default they run on the first --sequential-requests / --hf-requests
requests of the workload; their tokens/s are then compared with nanoserve's tokens/s on the whole
workload (output tokens per second of wall time, the same measure for all three). nanoserve's TTFT,
TPOT, ITL and E2E percentiles (chapter 09's definitions, nanoserve/metrics.py) are printed beside its
tokens/s; every request arrives at once, so TTFT includes the time queued behind the others' prefills.

This machine's speed drifts by tens of per cent over minutes, so the one-at-a-time requests do not
run after nanoserve's run but inside it: one between every few engine steps, each system's time
summed on its own clock. Both are then timed across the same minutes and the drift cancels out of
their ratio (pausing between steps changes nothing for the engine: its requests all arrived at once).
"""

import random
import time
from functools import partial

import torch

from nanoserve.bench.model import timed
from nanoserve.metrics import summarize


def register(sub):
    from nanoserve.cli.batch import add_engine_args

    p = sub.add_parser("offline", help="continuous batching vs one-at-a-time vs HF static batches (chapter 06)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential-requests", type=int, default=8,
                   help="run the one-at-a-time baseline on the first N requests (-1: all, 0: skip it)")
    p.add_argument("--hf-requests", type=int, default=16,
                   help="run the HF static-batch baseline on the first N requests (-1: all, 0: skip it)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, = the cores). On a machine shared with other jobs, 1 thread "
                        "avoids the oversubscription that makes 2 threads up to 10x slower")
    add_engine_args(p)
    p.set_defaults(func=run)


def make_workload(num_requests: int, prompt_len, output_len, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    """[(prompt_token_ids, num_output_tokens)], the same for every system."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num_requests)]


def params(num_output_tokens: int):
    from nanoserve.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=num_output_tokens, ignore_eos=True)


def run_nanoserve(engine, workload, side_jobs=(), every: int = 1):
    """(seconds nanoserve took to finish every request, seconds of the side jobs, engine steps, preemptions,
    one RequestRecord per request). workload: [(prompt ids, output tokens[, add_request kwargs])].

    side_jobs: callables run one after step 1, 1 + every, 1 + 2·every, ... (any left over at the end), each
    timed on a clock of its own, which nanoserve's seconds leave out. The records are stamped on nanoserve's
    clock too (wall time minus the side jobs so far), so their TTFT and TPOT are not inflated by the pauses.
    The engine ends empty.
    """
    from nanoserve.metrics import RequestRecord

    jobs, side_seconds = list(side_jobs), 0.0
    t0 = time.perf_counter()
    records = {str(i): RequestRecord(start=0.0, prompt_tokens=len(prompt)) for i, (prompt, *_) in enumerate(workload)}
    for i, (prompt, n, *kwargs) in enumerate(workload):
        engine.add_request(str(i), prompt, params(n), **(kwargs[0] if kwargs else {}))
    steps = preemptions = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        stamp_outputs(records, outputs, time.perf_counter() - t0 - side_seconds)  # on nanoserve's clock
        steps += 1
        preemptions += len(engine.last_scheduler_output.preempted_seq_ids)
        if jobs and (steps - 1) % every == 0:
            side_seconds += timed(jobs.pop(0), 1)
    seconds = time.perf_counter() - t0 - side_seconds
    side_seconds += sum(timed(job, 1) for job in jobs)
    return seconds, side_seconds, steps, preemptions, list(records.values())


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
def run_hf_static(hf_model, workload, batch_size: int) -> float:
    t0 = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)  # a static batch runs until its longest member is done
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                          do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def report(name: str, workload, seconds: float) -> float:
    out_tokens = sum(n for _, n in workload)
    all_tokens = out_tokens + sum(len(p) for p, _ in workload)
    rate = out_tokens / seconds
    print(f"  {name:28s} {len(workload):4d} req {out_tokens:7d} out tok {seconds:8.1f} s "
          f"{rate:8.1f} out tok/s {all_tokens / seconds:8.1f} total tok/s")
    return rate


def print_latencies(summary: dict, indent: str = "") -> None:
    """TTFT / TPOT / ITL / E2E rows (ms) of a metrics.summarize() result."""
    print(f"{indent}{'ms':6s}" + "".join(f"{k:>10s}" for k in ("mean", "median", "p90", "p99")))
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = summary[f"{name}_ms"]
        print(f"{indent}{name.upper():6s}" + "".join(
            f"{row[k]:10.1f}" if row[k] is not None else f"{'-':>10s}" for k in ("mean", "median", "p90", "p99")))


def run(args):
    from nanoserve.cli.batch import llm_from_args

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = llm_from_args(args)
    model = llm.model
    workload = make_workload(args.num_requests, args.prompt_len, args.output_len, args.seed, model.config.vocab_size)
    subset = lambda n: workload if n < 0 else workload[:n]  # noqa: E731

    run_nanoserve(llm.engine, make_workload(4, (8, 16), (2, 4), 1, model.config.vocab_size))  # warm up
    print("command: python -m nanoserve bench offline " + " ".join([
        f"--num-requests {args.num_requests}", f"--prompt-len {args.prompt_len[0]} {args.prompt_len[1]}",
        f"--output-len {args.output_len[0]} {args.output_len[1]}", f"--seed {args.seed}",
        f"--sequential-requests {args.sequential_requests}", f"--hf-requests {args.hf_requests}",
        f"--hf-batch-size {args.hf_batch_size}", f"--max-num-seqs {args.max_num_seqs}",
        f"--max-num-batched-tokens {args.max_num_batched_tokens}"] + ([f"--threads {args.threads}"] if args.threads else [])))
    print(f"threads: {torch.get_num_threads()}, float32, KV pool: {llm.engine.block_manager.num_blocks} blocks "
          f"of {args.block_size} tokens")
    print(f"workload: {len(workload)} requests, {sum(len(p) for p, _ in workload):,} prompt tokens (longest "
          f"{max(len(p) for p, _ in workload)}), {sum(n for _, n in workload):,} output tokens (longest "
          f"{max(n for _, n in workload)})")
    sequential = subset(args.sequential_requests) if args.sequential_requests else []
    # spread the sequential requests over the run, which takes at least as many steps as the longest output
    every = max(1, max(n for _, n in workload) // max(1, len(sequential)))
    seconds, sequential_seconds, steps, preemptions, records = run_nanoserve(
        llm.engine, workload, one_at_a_time_jobs(model, sequential), every)
    ours = report("nanoserve (continuous)", workload, seconds)
    print(f"    {steps} engine steps, {preemptions} preemptions")
    print_latencies(summarize(records, seconds), "    ")
    if sequential:
        rate = report("one at a time (ch04 cache)", sequential, sequential_seconds)
        print(f"    nanoserve / one at a time: {ours / rate:5.1f}x output tokens/s "
              f"(its requests ran between nanoserve's steps, one every {every} steps)")
    if args.hf_requests:
        from transformers import AutoModelForCausalLM

        from nanoserve.model import embedded_gguf_path

        path = embedded_gguf_path()
        hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        batch = subset(args.hf_requests)
        rate = report(f"HF static batches of {args.hf_batch_size}", batch, run_hf_static(hf_model, batch, args.hf_batch_size))
        print(f"    nanoserve / HF static: {ours / rate:5.1f}x output tokens/s")
    if min(args.sequential_requests, args.hf_requests) >= 0 and min(args.sequential_requests, args.hf_requests) < len(workload):
        print(f"  (a baseline that ran on the first N of {len(workload)} requests is compared by tokens/s, not seconds)")
