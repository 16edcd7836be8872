"""`python -m nanoserve bench mlperf`: MLPerf Inference's own load generator (LoadGen) drives nanoserve or any
OpenAI-compatible server, and judges the run (chapter 09).

    python -m nanoserve bench mlperf --scenario Offline --weights q4                   # tokens/s, one big batch
    python -m nanoserve bench mlperf --scenario Server                                 # peak QPS LoadGen calls VALID
    python -m nanoserve bench mlperf --scenario Server --interactive --url http://127.0.0.1:8080
    python -m nanoserve bench mlperf --scenario SingleStream --mode accuracy           # ROUGE-L vs the oracle

Scenarios (LoadGen issues the queries; the SUT, nanoserve/bench/mlperf_sut.py, only answers them):
  Offline       every sample in one query at t = 0: an overnight batch job; the figure is tokens/s.
  Server        queries arrive as a Poisson process at `server_target_qps`: a stream of users. VALID needs
                TTFT p99 <= 2 s and TPOT p99 <= 100 ms (MLPerf's limits for Llama 3.1 8B), or with --interactive
                TTFT p99 <= 0.5 s and TPOT p99 <= 30 ms. MLPerf reports a VALID run's completed tokens/s, at a
                target QPS the submitter chose; here a search that doubles, then bisects finds the highest target
                QPS still VALID (each try printed with LoadGen's verdict and its completed tokens/s).
  SingleStream  one query at a time, the next as soon as the last is answered: one user; the figure is the
                p90 latency of a whole answer.

The run is scaled down to this CPU: MLPerf's own runs last at least 600 s over its full data set; these
last --min-duration seconds (default 10) and at least --min-query-count queries. The Server default, 460, clears
the 459 LoadGen's early stopping needs at p99 with no query over a limit (below 459 no run is VALID, however fast).
`--mode accuracy` issues each sample once and scores the accuracy log LoadGen wrote (the ids as the SUT
reported them) against the float32 oracle's greedy answers (nanoserve/bench/mlperf_data.py).
LoadGen's logs (mlperf_log_summary.txt, mlperf_log_detail.txt, mlperf_log_accuracy.json) go to
--out-dir/NAME/SCENARIO[/qps-Q].
"""

import json
import os
import sys

SCENARIOS = ["Offline", "Server", "SingleStream"]
LIMITS = {"server": (2.0, 0.100), "interactive": (0.5, 0.030)}  # TTFT p99, TPOT p99 in seconds (Llama 3.1 8B)
MIN_QUERIES = {"Offline": 128, "Server": 460, "SingleStream": 64}
MIN_DURATION_S, START_QPS, MAX_TRIES = 10.0, 1.0, 6  # the scaled-down run and the Server search's defaults
PASS_ROUGE_L = 0.99  # MLPerf's accuracy bar is 99 % of the reference's score; the reference scores 1 on itself


def engine_defaults() -> dict:
    """The engine flags (bench offline's, serve's) and their defaults: what --url cannot honour if changed."""
    import argparse

    from nanoserve.cli.batch import add_engine_args

    probe = argparse.ArgumentParser()
    add_engine_args(probe)
    return {**vars(probe.parse_args([])), "threads": None}


def register(sub):
    from nanoserve.cli.batch import add_engine_args

    p = sub.add_parser("mlperf", help="MLPerf's LoadGen drives nanoserve or a server: Offline / Server / "
                                      "SingleStream, VALID or not, accuracy (chapter 09)")
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--mode", choices=["performance", "accuracy"], default="performance")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server to measure (default: nanoserve in-process)")
    p.add_argument("--api-key", default=None, help="--url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="--url: the model name to send (default: the first of /v1/models)")
    add_engine_args(p)  # in-process nanoserve: --weights, --kv-cache-dtype, --max-num-seqs, ...
    p.add_argument("--threads", type=int, default=None, help="in-process: torch threads (default: torch's)")
    p.add_argument("--interactive", action="store_true", help="Server: the interactive limits (TTFT 0.5 s, TPOT 30 ms)")
    p.add_argument("--target-qps", type=float, default=None, help="Server: one run at this QPS instead of the search")
    p.add_argument("--start-qps", type=float, default=None, help=f"Server: the search's first try (default {START_QPS:g})")
    p.add_argument("--max-tries", type=int, default=None, help=f"Server: runs the search may take (default {MAX_TRIES})")
    p.add_argument("--min-duration", type=float, default=None,
                   help=f"performance runs: seconds a run lasts at least (default {MIN_DURATION_S:g}; MLPerf: 600)")
    p.add_argument("--min-query-count", type=int, default=None,
                   help=f"performance runs: queries a run issues at least (default {MIN_QUERIES})")
    p.add_argument("--out-dir", default="results/mlperf", help="LoadGen's logs go under here")
    p.add_argument("--name", default=None, help="the system's name in the log path (default: the weights or the URL)")
    p.set_defaults(func=run)


def check_args(args) -> None:
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
        given = ["--" + k.replace("_", "-") for k, v in engine_defaults().items() if getattr(args, k) != v]
        if given:
            raise ValueError(f"{', '.join(given)}: set(s) up nanoserve in-process; with --url the server is already "
                             "running")
    elif args.api_key is not None or args.model is not None:
        raise ValueError("--api-key and --model go with --url")
    if args.scenario != "Server":
        given = [f for f, v in [("--interactive", args.interactive), ("--target-qps", args.target_qps)] if v]
        if given:
            raise ValueError(f"{', '.join(given)}: only for --scenario Server")
    if args.mode == "accuracy" and args.target_qps is None and args.scenario == "Server":
        raise ValueError("--mode accuracy with --scenario Server needs --target-qps (there is no peak to search)")
    searching = args.scenario == "Server" and args.mode == "performance" and args.target_qps is None
    given = [f for f, v in [("--start-qps", args.start_qps), ("--max-tries", args.max_tries)] if v is not None]
    if given and not searching:
        raise ValueError(f"{', '.join(given)}: only for the Server search (--scenario Server, performance mode, "
                         "no --target-qps)")
    given = [f for f, v in [("--min-duration", args.min_duration), ("--min-query-count", args.min_query_count)]
             if v is not None]
    if given and args.mode == "accuracy":
        raise ValueError(f"{', '.join(given)}: only for performance runs (accuracy mode issues each sample once)")
    for flag, value in [("--threads", args.threads), ("--max-tries", args.max_tries),
                        ("--min-query-count", args.min_query_count)]:
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in [("--target-qps", args.target_qps), ("--start-qps", args.start_qps),
                        ("--min-duration", args.min_duration)]:
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{flag} must be a positive number, got {value}")


# ---- LoadGen's settings and logs ---------------------------------------------------------------------------------

def test_settings(scenario: str, mode: str, min_duration: float, min_queries: int, interactive: bool = False,
                  qps: float | None = None):
    """LoadGen's TestSettings for one run; token latencies on (TTFT and TPOT stamped, limits checked)."""
    import mlperf_loadgen as lg

    s = lg.TestSettings()
    s.scenario = getattr(lg.TestScenario, scenario)
    s.mode = lg.TestMode.AccuracyOnly if mode == "accuracy" else lg.TestMode.PerformanceOnly
    s.use_token_latencies = True
    ttft, tpot = LIMITS["interactive" if interactive else "server"]
    s.ttft_latency, s.tpot_latency = int(ttft * 1e9), int(tpot * 1e9)
    s.min_duration_ms = int(min_duration * 1000)
    s.min_query_count = min_queries
    if scenario == "Server":
        s.server_target_qps = qps
        s.server_target_latency_ns = int(ttft * 1e9)  # the over-latency count LoadGen reports
    elif scenario == "Offline":
        s.offline_expected_qps = 1.0  # the one query's size: max(min_query_count, qps x min_duration)
    return s


def read_detail(out_dir: str) -> dict:
    """{key: value} of LoadGen's mlperf_log_detail.txt (one ':::MLLOG {json}' event per line)."""
    detail = {}
    with open(os.path.join(out_dir, "mlperf_log_detail.txt")) as f:
        for line in f:
            if line.startswith(":::MLLOG "):
                event = json.loads(line[len(":::MLLOG "):])
                detail[event["key"]] = event["value"]
    return detail


def run_test(sut, settings, out_dir: str) -> dict:
    """One LoadGen run of `sut` (an mlperf_sut.SUT) under `settings`; its logs in out_dir; LoadGen's detail."""
    import mlperf_loadgen as lg

    os.makedirs(out_dir, exist_ok=True)
    log = lg.LogSettings()
    log.log_output.outdir = out_dir
    log.log_output.copy_summary_to_stdout = False
    n = len(sut.samples)
    qsl = lg.ConstructQSL(n, n, lambda indices: None, lambda indices: None)  # the samples are in memory already
    failed_before = len(sut.failures)
    try:
        lg.StartTestWithLogSettings(sut.handle, qsl, settings, log)
    finally:
        lg.DestroyQSL(qsl)
    detail = read_detail(out_dir) if settings.mode != lg.TestMode.AccuracyOnly else {}
    detail["failed_requests"] = len(sut.failures) - failed_before
    return detail


def verdict(detail: dict) -> str:
    """LoadGen's VALID / INVALID, and why, in one line; a run with failed requests is no result whatever it says."""
    ttft = detail.get("result_first_token_99.00_percentile_latency_ns")
    tpot = detail.get("result_time_per_output_token_99.00_percentile_ns")
    parts = [f"LoadGen: {detail['result_validity']}"]
    if ttft is not None:
        parts.append(f"TTFT p99 {ttft / 1e9:.3f} s, TPOT p99 {tpot / 1e6:.1f} ms")
    why = [label for k, label in [("result_perf_constraints_met", "latency limits"), ("result_min_duration_met",
           "min duration"), ("result_min_queries_met", "min queries"), ("early_stopping_met", "early stopping")]
           if detail.get(k) is False]
    if why:
        parts.append("not met: " + ", ".join(why))
    if detail["failed_requests"]:
        parts.append(f"{detail['failed_requests']} requests FAILED: counted INVALID")
    return "; ".join(parts)


def is_valid(detail: dict) -> bool:
    return detail["result_validity"] == "VALID" and not detail["failed_requests"]


def find_peak(try_qps, start: float, max_tries: int) -> tuple[float | None, list[tuple[float, bool]]]:
    """The highest QPS with try_qps(qps) True, within max_tries tries: double from `start` while VALID (halve
    while INVALID), then bisect between the best VALID and the lowest INVALID. Returns (peak or None, tries).

    >>> find_peak(lambda q: q <= 3.0, 1.0, 5)
    (3.0, [(1.0, True), (2.0, True), (4.0, False), (3.0, True), (3.5, False)])
    """
    valid, invalid, tries, qps = None, None, [], start
    for _ in range(max_tries):
        ok = try_qps(qps)
        tries.append((qps, ok))
        if ok:
            valid = qps
        else:
            invalid = qps
        if valid is not None and invalid is not None and invalid / valid < 1.05:
            break  # within 5 %: the noise of a short run is larger than that
        qps = (valid * 2 if invalid is None else invalid / 2 if valid is None else (valid + invalid) / 2)
    return valid, tries


# ---- accuracy ----------------------------------------------------------------------------------------------------

def rouge_l(candidate: list, reference: list) -> float:
    """ROUGE-L F-measure: the longest common subsequence (LCS) of the two sequences, as precision LCS / len(cand)
    and recall LCS / len(ref), combined by their harmonic mean. 1 for identical, 0 for nothing in common.

    >>> round(rouge_l("the cat sat".split(), "the cat sat down".split()), 3)
    0.857
    """
    if not candidate or not reference:
        return float(candidate == reference)
    row = [0] * (len(reference) + 1)  # row[j]: LCS of candidate[:i] and reference[:j], one row at a time
    for a in candidate:
        diagonal = 0
        for j, b in enumerate(reference, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if a == b else max(row[j], row[j - 1])
    lcs = row[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(candidate) + len(reference))


def words(text: str) -> list[str]:
    """ROUGE's tokens: lower-cased runs of letters and digits (as the rouge-score package splits them)."""
    import re

    return re.findall(r"[a-z0-9]+", text.lower())


def read_accuracy_log(out_dir: str) -> dict[int, list[int]]:
    """{sample index: its output token ids} from LoadGen's mlperf_log_accuracy.json (hex of int32s)."""
    import numpy as np

    with open(os.path.join(out_dir, "mlperf_log_accuracy.json")) as f:
        entries = json.load(f)
    return {e["qsl_idx"]: np.frombuffer(bytes.fromhex(e["data"]), dtype=np.int32).tolist() for e in entries}


def score(outputs: dict[int, list[int]], samples, tokenizer) -> dict:
    """Greedy agreement (answers identical to the reference's text: a server's stream carries no end-of-sequence
    token, so ids are compared as the text they decode to) and mean ROUGE-L over words."""
    exact, rouges = 0, []
    for index, ids in outputs.items():
        text, reference = tokenizer.decode(ids, skip_special_tokens=True), samples[index]["reference_text"]
        exact += text == reference
        rouges.append(rouge_l(words(text), words(reference)))
    rouge = sum(rouges) / len(rouges)
    return {"samples": len(outputs), "exact": exact, "rouge_l": rouge, "passed": rouge >= PASS_ROUGE_L}


def oracle_gaps(outputs: dict[int, list[int]], samples, oracle) -> list[float]:
    """Every answer read by the float32 oracle, teacher-forced on the answer's own tokens: at each token the
    system chose, how far (in logits) it was below the oracle's own best choice there; 0 where they agree.
    A greedy answer that drifted from the reference through near-ties shows only small gaps (two candidates the
    oracle itself nearly tied, flipped by rounding); a broken system shows large ones.

        logits at one position   {"the": 12.0, "a": 11.7, "dog": 3.0}
        the system chose "a"     gap 0.3   (a near-tie: q4's rounding moves logits by about that much)
        the system chose "dog"   gap 9.0   (not a tie: the answer is worse, not merely different)
    """
    import torch

    gaps = []
    for index, ids in outputs.items():
        if not ids:
            continue
        prompt = samples[index]["prompt_token_ids"]
        with torch.inference_mode():  # logits[i] predicts token i + 1: the answer's are from len(prompt) - 1
            logits = oracle.compute_logits(oracle(torch.tensor(prompt + ids)))[len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
        gaps += (logits.max(-1).values - chosen).tolist()
    return gaps


# ---- the command -------------------------------------------------------------------------------------------------

def engine_system(args):
    """(generate, close) for nanoserve in this process: the LLM args describe, its engine in a thread."""
    import torch

    from nanoserve.bench.mlperf_sut import engine_generator
    from nanoserve.cli.batch import llm_from_args
    from nanoserve.engine.async_engine import AsyncLLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = llm_from_args(args)
    engine = AsyncLLMEngine(llm.engine)
    engine.start()

    def close():
        engine.shutdown()
        llm.close()

    return engine_generator(engine), close


def url_system(args, sut_loop):
    """(generate, close) for the server at --url, its httpx client living on the SUT's event loop."""
    import asyncio

    import httpx

    from nanoserve.bench.mlperf_sut import openai_generator
    from nanoserve.bench.serve import first_model, model_tokenizer

    async def connect():
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10), limits=limits)
        try:
            return client, args.model or await first_model(client, args.url)
        except ValueError:  # first_model's message names the URL
            await client.aclose()
            raise

    client, model = asyncio.run_coroutine_threadsafe(connect(), sut_loop).result()
    close = lambda: asyncio.run_coroutine_threadsafe(client.aclose(), sut_loop).result()  # noqa: E731
    return openai_generator(client, args.url, model, model_tokenizer()), close


def system_name(args) -> str:
    if args.name:
        return args.name
    if args.url:
        return args.url.split("://", 1)[1].replace("/", "_").replace(":", "_")
    return f"nanoserve-{args.weights}" + ("-kv-bf16" if args.kv_cache_dtype == "bf16" else "")


def measure(args, sut, out_dir: str) -> int:
    """Run the scenario and mode `args` describe on `sut`; print LoadGen's verdicts; the exit status."""
    from nanoserve.bench.serve import model_tokenizer

    min_queries = args.min_query_count or MIN_QUERIES[args.scenario]
    min_duration = args.min_duration or MIN_DURATION_S
    settings = lambda qps=None: test_settings(args.scenario, args.mode, min_duration, min_queries,  # noqa: E731
                                              args.interactive, qps)
    limits = "interactive" if args.interactive else "server"
    ttft, tpot = LIMITS[limits]
    if args.mode == "accuracy":
        print(f"accuracy mode: each of the {len(sut.samples)} prompts of nanoserve/bench/mlperf_prompts.jsonl once")
        run_test(sut, settings(args.target_qps), out_dir)
        result = score(read_accuracy_log(out_dir), sut.samples, model_tokenizer())
        print(f"accuracy ({result['samples']} samples, from {out_dir}/mlperf_log_accuracy.json): "
              f"{result['exact']}/{result['samples']} the same text as the float32 oracle's greedy answer, "
              f"ROUGE-L {result['rouge_l']:.4f} (pass: >= {PASS_ROUGE_L}): {'PASS' if result['passed'] else 'FAIL'}")
        from nanoserve.metrics import percentile
        from nanoserve.model import load_gguf

        gaps = oracle_gaps(read_accuracy_log(out_dir), sut.samples, load_gguf())
        if gaps:  # (no answer had a token: every request failed, said below)
            print(f"under the float32 oracle, teacher-forced: {sum(g > 0 for g in gaps)} of {len(gaps)} tokens not its "
                  f"own first choice; gap to its choice p99 {percentile(gaps, 99):.2f}, largest {max(gaps):.2f} "
                  f"logits" + (" (ids re-encoded from the server's text)" if args.url else ""))
        failed = len(sut.failures)
        if failed:
            print(f"{failed} requests FAILED (completed to LoadGen with what they had): {sut.failures[:3]}")
        return 0 if result["passed"] and not failed else 1
    print(f"scaled down: min_duration {min_duration:g} s (MLPerf: 600 s), min_query_count {min_queries}, "
          f"the {len(sut.samples)} prompts of nanoserve/bench/mlperf_prompts.jsonl")
    if args.scenario != "Server":
        detail = run_test(sut, settings(), out_dir)
        print(verdict(detail))
        if args.scenario == "Offline":
            print(f"Offline: {detail['result_samples_per_second']:.2f} samples/s, "
                  f"{detail['result_tokens_per_second']:.1f} tokens/s ({out_dir})")
        else:
            # with token latencies, LoadGen's early-stopping estimate is of the TTFT (its last check), not the answer
            estimate = (f"early stopping's p90 TTFT estimate {detail['early_stopping_latency_ss'] / 1e9:.3f} s"
                        if detail["early_stopping_met"] else "too few queries for early stopping's estimate")
            print(f"SingleStream: p90 latency {detail['result_90.00_percentile_latency_ns'] / 1e9:.3f} s, "
                  f"{estimate} ({out_dir})")
        return 0 if is_valid(detail) else 1
    print(f"Server limits ({limits}): TTFT p99 <= {ttft:g} s, TPOT p99 <= {tpot * 1000:g} ms")

    def try_qps(qps: float) -> bool:
        where = os.path.join(out_dir, f"qps-{qps:g}")
        detail = run_test(sut, settings(qps), where)
        print(f"  target {qps:7.3f} qps: {verdict(detail)}; completed "  # MLPerf reports a VALID run's tokens/s
              f"{detail['result_completed_samples_per_sec']:.2f} qps, "
              f"{detail['result_completed_tokens_per_second']:.1f} tokens/s ({where})", flush=True)
        return is_valid(detail)

    if args.target_qps is not None:
        return 0 if try_qps(args.target_qps) else 1
    peak, tries = find_peak(try_qps, args.start_qps or START_QPS, args.max_tries or MAX_TRIES)
    shown = "none of the tries was VALID" if peak is None else f"{peak:g} qps"
    print(f"peak Server QPS LoadGen calls VALID ({limits} limits, {len(tries)} tries): {shown}")
    return 0 if peak is not None else 1


def run(args):
    from nanoserve.bench.mlperf_data import load_samples
    from nanoserve.bench.mlperf_sut import SUT

    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = load_samples()
    out_dir = os.path.join(args.out_dir, system_name(args), args.scenario + ("-interactive" if args.interactive else "")
                           + ("-accuracy" if args.mode == "accuracy" else ""))
    with SUT(samples, None) as sut:  # its generate() comes once the system is up
        try:
            sut.generate, close = url_system(args, sut.loop) if args.url else engine_system(args)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            print(f"system: {args.url or system_name(args)}  scenario: {args.scenario}  mode: {args.mode}")
            return measure(args, sut, out_dir)
        finally:
            close()
