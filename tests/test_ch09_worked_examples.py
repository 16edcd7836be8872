"""Chapter 09's worked examples, computed by the code: one request's latencies, the tail of a 1000 ms outlier and
the percentile ranks (nanoserve/metrics.py), the prompt set's lengths and shared prefix (bench/prompts.py), the
profile table's roofline columns and intensities (bench/profile.py's step_cost), MLPerf's query counts and limits,
the prefix-caching and overload experiments' exact counts (run on a tiny model with SmolLM2's vocabulary: with EOS
ignored their schedule does not depend on the weights) and the memory planner's output are built here from
nanoserve/ and must appear in the chapter word for word. The ratios the chapter draws from its timed tables are
recomputed from those tables; the figures it shares with the notebook must be what the notebook printed."""

import json
import math
import re
import statistics
from types import SimpleNamespace

import pytest
import torch

from nanoserve.bench import experiment, mlperf, profile
from nanoserve.bench.prompts import course_prompts
from nanoserve.cli import main
from nanoserve.memory import parameter_counts, weight_bytes
from nanoserve.metrics import RequestRecord, percentile, request_latencies, stats
from nanoserve.model import LlamaConfig
from nanoserve.model.compiled import BUCKETS
from nanoserve.model.gguf_loader import embedded_gguf_path, open_gguf
from tests.chapter_text import ROOT, chapter, command_defaults, notebook_output, says, table_rows, word
from tests.tiny_model import tiny_llama

CH = "09"
SMOL = LlamaConfig()


def number(cell: str) -> float:
    """'**352 ms**', '1,123', '348)' -> the number."""
    return float(cell.replace("*", "").replace(",", "").strip("()").split()[0].strip("()"))


def within(quoted: str, exact: float, digits: int) -> bool:
    """`quoted` is `exact` rounded to `digits` decimals (a ratio of printed, rounded figures may sit a digit off)."""
    return abs(float(quoted) - exact) <= 0.5 * 10 ** -digits + 1e-9


@pytest.fixture(scope="module")
def tiny():
    """The tiny model with SmolLM2's vocabulary, so the experiments draw the very prompts they draw for SmolLM2."""
    return tiny_llama(vocab_size=SMOL.vocab_size)


def test_one_requests_latencies():
    record = RequestRecord(start=10.0, chunk_times=[10.5, 10.6, 10.8, 11.2], end=11.25, output_tokens=5)
    x = request_latencies(record)
    itl = [round(g, 10) for g in x["itl"]]
    says(CH, f"TTFT = {x['ttft']:g} s, ITL = {itl}, E2E = {x['e2e']:g} s, TPOT = ({x['e2e']:g} − {x['ttft']:g}) / "
             f"{record.output_tokens - 1} = {x['tpot']:g} s")
    by_chunks = (x["e2e"] - x["ttft"]) / (len(record.chunk_times) - 1)
    says(CH, f"counting chunks would give TPOT = {x['e2e'] - x['ttft']:g} / {len(record.chunk_times) - 1} = {by_chunks:g} s "
             f"— {by_chunks / x['tpot'] - 1:.0%} slow".replace("%", " %"))


def test_the_tail_and_the_percentile_ranks():
    s = stats([10.0] * 99 + [1000.0])
    says(CH, f"have a mean of {s['mean']:.1f} ms, a median of {s['median']:.0f} and a p99 of {s['p99']:.1f}")
    assert f"{{'mean': {s['mean']}, 'median': {s['median']}" in notebook_output(CH)  # the notebook's cell, the same
    rank = 0.90 * (4 - 1)
    says(CH, f"(`percentile([1, 2, 3, 4], 90)` is at rank {rank:g}: 3 + {rank - 2:.1f} · (4 − 3) = "
             f"{percentile([1, 2, 3, 4], 90):g})")
    says(CH, f"(rank 0.99 · 15 = {0.99 * 15:g})")


def test_the_prompt_set(smollm2_tokenizer):
    lengths = {}
    for item in course_prompts(400, seed=0):  # bench/prompts.py's docstring measures over these
        lengths.setdefault(item["kind"], []).append(len(smollm2_tokenizer.encode_chat(item["messages"])))
    chat, document = lengths["chat"], lengths["document"]
    says(CH, f"half short chat turns (after 0–2 earlier turns; {min(chat)}–{max(chat)} prompt tokens), a quarter long "
             f"documents with a question ({min(document)}–{max(document)})")
    system = [smollm2_tokenizer.encode_chat(i["messages"]) for i in course_prompts(400, seed=0) if i["kind"] == "system"]
    shared = min(next(j for j, (a, b) in enumerate(zip(system[0], p)) if a != b) for p in system if p != system[0])
    assert smollm2_tokenizer.decode(system[0][:shared]).endswith("<|im_end|>\n<|im_start|>user\n")
    says(CH, f"(their first {shared} tokens are the same: what prefix caching saves)")
    says(CH, f"the first {shared} tokens are common), one arriving every 2 engine steps")
    says(CH, f"the system prompt's {shared // 16} full blocks ({shared // 16 * 16} tokens)")
    says(CH, f"(the prompt set's documents are up to {max(document)} tokens)")
    says(CH, f"(the course's prompt set, up to {max(document)} tokens) plus 128 output tokens can overflow it")
    assert max(document) + 128 > 8192 // 16


def test_the_load_test_table():
    goodput, rate = re.search(r"Request goodput \(req/s\): ([\d.]+)", chapter(CH))[1], re.search(
        r"Output token throughput \(tok/s\): ([\d.]+)", chapter(CH))[1]
    wait = float(re.search(r"Median CLIENT_WAIT \(ms\): ([\d.]+)", chapter(CH))[1])
    output_len = int(re.search(r"--output-len (\d+) --ignore-eos", chapter(CH))[1])  # every request exactly this long
    says(CH, f"half the requests waited {wait / 1000:.1f} s in the client for one of the 8 seats, so only {goodput} of "
             f"the {float(rate) / output_len:.2f} requests/s met a 2-second TTFT")


def test_the_peer_runs():
    rows = {r[0].split(" (")[0]: r for r in table_rows(CH, r"nanoserve \(float32.*|llama-cpp-python.*")}
    ours, theirs = ([number(x) for x in rows[name][1].split(" / ")] for name in ("nanoserve", "llama-cpp-python"))
    says(CH, f"llama-cpp-python delivered {max(theirs) / max(ours):.2f}× nanoserve's tokens/s")
    says(CH, f"llama-cpp-python's own two rounds differ {max(theirs) / min(theirs):.0f}×")
    reader = open_gguf(embedded_gguf_path())
    q4_1 = sum(int(t.n_bytes) for t in reader.tensors)  # the GGUF's tensors: what llama.cpp reads per token
    says(CH, f"it reads {weight_bytes(SMOL, 'fp32') / q4_1:.1f}× fewer bytes than our float32")
    says(CH, "`-c 32768`: " + f"{32768 // 16:,} tokens per slot; with `-c 8192` a slot holds {8192 // 16}")
    rows = {r[0].split(" (")[0]: r for r in table_rows(CH, r"nanoserve \(q4.*|llama\.cpp `llama-server --parallel 16`.*")}
    ours, theirs = ([number(x) for x in rows[name][1].split(" / ")] for name in ("nanoserve", "llama.cpp `llama-server --parallel 16`"))
    says(CH, f"nanoserve delivered {max(ours) / max(theirs):.2f}× llama.cpp's tokens/s, but llama.cpp's own two rounds "
             f"differ by {max(theirs) / min(theirs) - 1:.0%} ({theirs[0]} and {theirs[1]})".replace("%", " %"))


def test_mlperf_counts_and_limits():
    n = math.ceil(math.log(0.01) / math.log(0.99))  # the fewest queries with none over the limit: 0.99^n <= 0.01
    says(CH, f"With t = 0 that is 0.99ⁿ ≤ 0.01, so n ≥ {n}: below {n} queries no Server run can be VALID")
    assert mlperf.MIN_QUERIES["Server"] == n + 1
    says(CH, f"SingleStream's p90 needs {mlperf.MIN_QUERIES['SingleStream']} queries")
    says(CH, f"`--min-duration {mlperf.MIN_DURATION_S:g}` s and `--min-query-count` {mlperf.MIN_QUERIES['Server']} "
             f"(Server), {mlperf.MIN_QUERIES['SingleStream']} (SingleStream) and {mlperf.MIN_QUERIES['Offline']} samples (Offline)")
    (server_ttft, server_tpot), (fast_ttft, fast_tpot) = mlperf.LIMITS["server"], mlperf.LIMITS["interactive"]
    says(CH, f"TTFT p99 ≤ {server_ttft:g} s and TPOT p99 ≤ {server_tpot * 1000:g} ms (Server) and TTFT p99 ≤ {fast_ttft:g} s, "
             f"TPOT p99 ≤ {fast_tpot * 1000:g} ms (Interactive)")
    says(CH, f"ROUGE-L ≥ {mlperf.PASS_ROUGE_L}")
    from nanoserve.bench.mlperf_data import load_samples

    samples = load_samples()
    says(CH, f"The query sample library is {len(samples)} prompts of the course's mix")
    lengths = sorted(len(x["prompt_token_ids"]) for x in samples)
    long = sum(n > 500 for n in lengths)
    says(CH, f"{word(long).capitalize()} of the {len(samples)} prompts are over 500 tokens")
    says(CH, f"{lengths[0]} to {lengths[-1]} tokens)")
    says(CH, f"its {lengths[-1]}-token prompt")
    answers = sum(len(x["reference_token_ids"]) for x in samples) / len(samples)
    says(CH, f"the prompts averaging {sum(lengths) / len(lengths):.0f} tokens\n  against answers of {answers:.1f}")
    queries = mlperf.MIN_QUERIES["Server"]
    per_try = round(long / len(samples) * queries)
    says(CH, f"about {per_try} of the\n  {queries} queries are long")
    rate = float(re.search(r"busy about λ / ([\d.]+) of the time \(the interleaved", chapter(CH))[1])
    says(CH, f"some {per_try} λ / {rate:g} long\n  prompts land beside other work, each a likely miss: at 0.25 QPS about {per_try * 0.25 / rate:.0f}")
    lowest = float(re.search(r"Only below about ([\d.]+) QPS would none", chapter(CH))[1])
    assert abs(per_try * lowest / rate - 1) < 0.1  # where one miss is expected
    hours = round(queries / (rate / per_try) / 3600)
    says(CH, f"{queries} queries at such a rate take\n  about {word(hours)} hours")
    ours = [float(x) for x in re.search(r"gave q4 at 64 sequences ([\d.]+) and ([\d.]+) tokens/s", chapter(CH)).groups()]
    q16 = [float(x) for x in re.search(r"q4 at 16 sequences ([\d.]+) and ([\d.]+), llama-server", chapter(CH)).groups()]
    theirs = [float(x) for x in re.search(r"llama-server\n?\s*([\d.]+) and ([\d.]+): \*\*", chapter(CH)).groups()]
    says(CH, f"**{ours[0] / theirs[0]:.2f}× and {ours[1] / theirs[1]:.2f}×** in the same rounds at nanoserve's default, "
             f"{q16[0] / theirs[0]:.2f}× and {q16[1] / theirs[1]:.2f}× at 16 sequences")


def test_the_profile_table():
    text = chapter(CH)
    bandwidth, peak, ridge = re.search(r"read bandwidth ([\d.]+) GB/s, GEMM peak ([\d.]+) GFLOP/s \(ridge at ([\d.]+)", text).groups()
    bw, pk = float(bandwidth), float(peak)
    assert (pk - 0.05) / (bw + 0.05) <= float(ridge) + 0.05 and float(ridge) - 0.05 <= (pk + 0.05) / (bw - 0.05)
    says(CH, f"this machine's ridge is at {float(ridge):.0f} FLOP/byte")
    prompt = command_defaults(profile, "profile").prompt_len
    says(CH, f"gives the engine B fresh\n{prompt}-token prompts")
    rows, intensity = {}, {}
    for kind, b, ms, *parts, mem, compute, bound in re.findall(
            r"(decode|prefill) B=(\d+) +([\d.]+)" + r" +(\d+)%" * 6 + r" +([\d.]+) / +([\d.]+) +(memory|compute)", text):
        b = int(b)
        if kind == "decode":  # step_cost as profile_batch calls it
            nbytes, flops = profile.step_cost(SMOL, b, b, [prompt + 2] * b, 1)
        else:
            nbytes, flops = profile.step_cost(SMOL, b * prompt, b, [prompt] * b, prompt)
        # the roofline columns: bytes over the printed bandwidth, FLOPs over the printed peak (each rounded to 0.1)
        assert nbytes / (bw + 0.05) / 1e6 - 0.05 <= float(mem) <= nbytes / (bw - 0.05) / 1e6 + 0.05, (kind, b)
        assert flops / (pk + 0.05) / 1e6 - 0.05 <= float(compute) <= flops / (pk - 0.05) / 1e6 + 0.05, (kind, b)
        assert bound == ("memory" if float(mem) > float(compute) else "compute")
        rows[kind, b] = float(ms), [int(p) for p in parts], max(float(mem), float(compute))
        intensity[kind, b] = flops / nbytes, nbytes, flops
    assert len(rows) == 6
    ms, parts, roof = rows["decode", 1]
    _, nbytes, flops = intensity["decode", 1]
    assert round(weight_bytes(SMOL, "fp32") / 1e6) == 538
    says(CH, f"1 token reads {weight_bytes(SMOL, 'fp32') / 1e6:.0f} MB for {flops / 1e9:.2f} GFLOP ({flops / nbytes:.1f}\n"
             f"FLOP/byte): the roofline says {roof} ms, the step took {ms} ms — **{roof / ms:.0%} of the bandwidth "
             f"roofline**".replace("%", " %"))
    ms16 = rows["decode", 16][0]
    says(CH, f"At batch 16 the same weights serve 16 tokens ({intensity['decode', 16][0]:.0f} FLOP/byte; "
             f"{ms16 / 16:.1f} ms per token instead of {ms:.0f})")
    ms64, parts64, roof64 = rows["decode", 64]
    says(CH, f"at batch 64, {intensity['decode', 64][0]:.0f} FLOP/byte, past the ridge")
    says(CH, f"ran at only {roof64 / ms64:.0%} of its roofline, and attention plus the K/V gathers have grown from\n"
             f"{parts[1] + parts[2]:.0f} % to {parts64[1] + parts64[2]} % of the step".replace("%", " %"))
    linear = [rows["prefill", b][1][0] for b in (1, 16, 64)]
    says(CH, f"**Prefill is compute-bound** ({intensity['prefill', 1][0]:.0f} FLOP/byte for one {prompt}-token prompt) "
             f"and the linear layers take {min(linear)}–{max(linear)} % of it")
    ms1, _, roof1 = rows["prefill", 1]
    says(CH, f"at batch 1 it reached {roof1 / ms1:.0%} of the GEMM peak".replace("%", " %"))
    python = [rows[k][1][5] for k in rows]
    says(CH, f"the Python between ops are {min(python)}–{max(python)} % of\nevery step here")


def test_the_compiled_step():
    says(CH, "padded up to the next of " + ", ".join(map(str, BUCKETS[:-1])) + f", {BUCKETS[-1]} tokens")
    text = chapter(CH)
    warm = {name: float(s) for name, s in re.findall(r"warm-up nanoserve (q4, kv bf16(?:, buckets)?): ([\d.]+)s", text)}
    says(CH, f"the\nwarm-up round took {warm['q4, kv bf16, buckets'] - warm['q4, kv bf16']:.0f} s longer")
    tokens = int(re.search(r"16 requests \(\d+ prompt tokens, (\d+) output tokens\)", text)[1])
    rates = {}
    for name, rate, ratio, r1, r2 in re.findall(r"(nanoserve q4, kv bf16(?:, buckets)?|transformers bf16 static) +([\d.]+) "
                                                r"out tok/s +([\d.]+)x +rounds: ([\d.]+)s ([\d.]+)s", text):
        assert within(rate, 2 * tokens / (float(r1) + float(r2)), 1), name  # both rounds' tokens over both rounds' time
        rates[name] = float(rate), (float(r1), float(r2))
    for name, (rate, _) in rates.items():
        assert re.search(rf"{re.escape(name)} +{rate} out tok/s +{rate / rates['transformers bf16 static'][0]:.2f}x", text)
    (e1, e2), (b1, b2) = rates["nanoserve q4, kv bf16"][1], rates["nanoserve q4, kv bf16, buckets"][1]
    says(CH, f"({b1} vs {e1} s, {b2} vs {e2} s: {e1 / b1:.1f}×\nand {e2 / b2:.1f}×)")


def test_the_prefix_caching_experiment(tiny, smollm2_tokenizer):
    with torch.inference_mode():
        result, _ = experiment.prefix_caching(SimpleNamespace(output_len=None, rounds=1), tiny, smollm2_tokenizer)
    on, off = result["best"]["prefix caching on"], result["best"]["prefix caching off"]
    assert off["prompt_tokens_computed"] == off["prompt_tokens"]
    (row_on,) = table_rows(CH, "prefix caching on")
    (row_off,) = table_rows(CH, "prefix caching off")
    assert row_on[4] == f"**{on['prompt_tokens_computed']}** of {on['prompt_tokens']}"
    assert row_off[4] == f"{off['prompt_tokens']} of {off['prompt_tokens']}"
    says(CH, f"{1 - on['prompt_tokens_computed'] / on['prompt_tokens']:.0%} fewer prompt tokens computed".replace("%", " %"))
    on1, on2 = number(row_on[1]), number(row_on[1].split("round 2: ")[1])
    off1, off2 = number(row_off[1]), number(row_off[1].split("(")[1])
    says(CH, f"TTFT **{off1 / on1:.1f}× lower** ({off1 / on1:.1f}× in\nround 1, {off2 / on2:.1f}× in round 2)")


def test_the_overload_experiment(tiny):
    with torch.inference_mode():
        result, _ = experiment.overload(SimpleNamespace(output_len=None, rounds=1), tiny, None)
    s, trace = result["summary"], result["trace"]
    need = math.ceil((128 + 96) / 16)
    says(CH, f"a pool of only {s['num_blocks']} blocks of 16 tokens ({s['num_blocks'] * 16} slots) and\n"
             f"{s['requests']} requests at once, prompts of 64–128 tokens, 96 output tokens each. A request needs up to "
             f"{need} blocks at its end, so\na plan that reserves full length would run {s['num_blocks']} // {need} = "
             f"{s['num_blocks'] // need} at a time")
    # while the queue held requests (but the one step in which the first cohort finished together, emptying the pool)
    busy = [row["running"] for row in trace if row["waiting"] and row["running"]]
    assert sum(1 for row in trace if row["waiting"] and not row["running"]) == 1
    says(CH, f"and, while requests waited, ran {min(busy)}–{max(busy)} at once (median {statistics.median(r['running'] for r in trace):.0f}), paying "
             f"with **{s['preemptions']} preemptions in {s['steps']} steps**")
    assert table_rows(CH, r"\d+ %")[0] == [f"{s[k]:.0%}".replace("%", " %") for k in (
        "peak_kv_usage", "mean_kv_usage", "mean_kv_usage_while_waiting", "token_fill_of_used_blocks")]
    mean, fill = s["mean_kv_usage"], s["token_fill_of_used_blocks"]
    says(CH, f"kept {mean:.0%} of its blocks in use on average ({s['mean_kv_usage_while_waiting']:.0%}\nwhile requests "
             f"waited: the scheduler fills what it has) and {fill:.0%} of the slots".replace("%", " %"))
    says(CH, f"about {mean:.2f} × {fill:.2f} ≈ {round(mean, 2) * round(fill, 2):.0%} of the\nplan's tokens".replace("%", " %"))
    says(CH, f"ran a median of {statistics.median(r['running'] for r in trace):.0f} requests where a full-length plan "
             f"allows {s['num_blocks'] // need}")


def test_the_timed_tables_ratios():
    chunked = table_rows(CH, r"chunked, 512 per step")[0]
    whole = table_rows(CH, "whole prompts")[0]
    says(CH, f"the long prompt itself waited {number(chunked[5]) / number(whole[5]):.1f}× longer")
    says(CH, f"the stall is split over {2048 // 512} steps")
    dtype = {r[0]: r for r in table_rows(CH, "float32|bfloat16")}
    says(CH, f"the\n{number(dtype['bfloat16'][2]) / number(dtype['float32'][2]):.1f}× must come from")
    total = parameter_counts(SMOL)["total"]
    assert (dtype["float32"][3], dtype["bfloat16"][3]) == (f"{total * 4 / 2**20:.0f} MiB", f"{total * 2 / 2**20:.0f} MiB")
    linear = [r for r in table_rows(CH, r"\d+") if len(r) == 4 and r[3].endswith("×")]  # tokens | fp32 | bf16 | ratio
    assert len(linear) == 4
    for tokens, fp32, bf16, ratio in linear:
        assert f"{number(bf16) / number(fp32):.2f}×" == ratio, tokens
    concurrency = {r[0]: r for r in table_rows(CH, "1|4|16") if len(r) == 5}
    says(CH, f"From 1 to 4 clients the server turns shared decode steps into "
             f"{number(concurrency['4'][1]) / number(concurrency['1'][1]):.1f}× the tokens/s")
    assert round(number(concurrency["4"][4].split(" / ")[0]) / number(concurrency["1"][4].split(" / ")[0])) == 2  # "doubles"
    block = {r[0]: r for r in table_rows(CH, "8|16|32") if len(r) == 3}
    r1, r2 = (number(x) for x in block["32"][1].split(" / "))
    says(CH, f"a neighbour's\nburst made that run {r1 / r2:.1f}× slower")


def test_the_memory_planner(capsys):
    args = ["memory", "--model", "smollm2-135m", "--device-gb", "2", "--seq-len", "1000", "--dtype", "fp32"]
    for extra, first in ((["--block-size", "16"], "paged, blocks of 16"), (["--kv-fill", "0.95"], "at the measured fill")):
        assert main(args + extra) == 0
        printed = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(printed) if line.startswith(first))
        shown = printed[start:start + (2 if extra[0] == "--block-size" else 1)]
        says(CH, "$ .venv/bin/python -m nanoserve " + " ".join(args + extra) + " " + " ".join(shown))
