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
from nanoserve.memory import kv_bytes_per_token, parameter_counts, weight_bytes
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
    xs = [10.0] * 98 + [1000.0] * 2
    s, rank = stats(xs), 0.99 * (len(xs) - 1)
    assert (sum(xs) / len(xs), sorted(xs)[98], sorted(xs)[99]) == (29.8, 1000.0, 1000.0)  # by hand
    says(CH, f"Ninety-eight requests at 10 ms and two at 1000 ms\nhave a mean of {s['mean']:.1f} ms, a median of "
             f"{s['median']:.0f}, a p90 of {s['p90']:.0f} and a p99 of {s['p99']:.0f}: only the p99 shows")
    says(CH, f"Here the p99's rank\nis {rank:.2f}, between the 99th and the 100th value, both 1000 ms")
    one = stats([10.0] * 99 + [1000.0])
    assert one["p99"] == pytest.approx(one["mean"]) and one["mean"] == pytest.approx((99 * 10 + 1000) / 100)
    says(CH, f"the p99 is {one['p99']:.1f} ms, exactly the mean, (99 · 10 + 1000) / 100")
    assert f"{{'mean': {s['mean']}, 'median': {s['median']}" in notebook_output(CH)  # the notebook's cell, the same
    loadgen = lambda v, p: sorted(v)[int(len(v) * p)]  # noqa: E731  LoadGen's results.cc: sorted[n · p], from 0
    assert loadgen(range(64), 0.99) == 63 and int(64 * 0.99) + 1 == 64  # the 64th of 64: the worst
    single = [10.0] * 99 + [1000.0]
    says(CH, f"that rule takes the 100th value, {loadgen(single, 0.99):.0f} ms, where the\ninterpolation gives "
             f"{one['p99']:.1f} and nearest-rank, the ⌈n · p⌉-th value, the 99th: "
             f"{sorted(single)[math.ceil(len(single) * 0.99) - 1]:.0f} ms")
    says(CH, f"| averaging away the tail | a mean of {s['mean']:.1f} ms over 100 requests, two of them 1000 ms "
             f"(their p99: {s['p99']:.0f}) |")
    rank = 0.90 * (4 - 1)
    says(CH, f"(`percentile([1, 2, 3, 4], 90)` is at rank {rank:g}: 3 + {rank - 2:.1f} · (4 − 3) = "
             f"{percentile([1, 2, 3, 4], 90):g})")
    says(CH, f"(rank 0.99 · 15 = {0.99 * 15:g})")
    eight = percentile(range(1, 9), 99)  # 7 + 0.93 · (8 − 7): between the two worst of 8, not the worst
    assert 7 < eight < 8
    says(CH, f"a p99 of 8 lies between the two\nworst (rank 0.99 · 7 = {eight - 1:g})")


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
    text = chapter(CH)
    goodput, rate = (float(re.search(rf"{label} \((?:req|tok)/s\): ([\d.]+)", text)[1])
                     for label in ("Request goodput", "Output token throughput"))
    wait = float(re.search(r"Median CLIENT_WAIT \(ms\): ([\d.]+)", text)[1])
    ttft = float(re.search(r"Median TTFT \(ms\): ([\d.]+)", text)[1])
    command = re.search(r"\(`bench serve --url \S+ (.*?)`, 2026", text)[1]
    assert "--request-rate" not in command  # the default, inf: all due at t = 0
    n, seats = (int(re.search(rf"--{flag} (\d+)", command)[1]) for flag in ("num-prompts", "max-concurrency"))
    output_len = int(re.search(r"--output-len (\d+) --ignore-eos", command)[1])  # every request exactly this long
    says(CH, f"all {n} requests are due at t = 0: {seats} take the {seats} seats at once")
    # the median of n waits: rank (n - 1) / 2 = 7.5, halfway between the 8th (one of the seated, ~0) and the 9th
    assert (n - 1) / 2 == 7.5 and n - seats == seats
    says(CH, f"the {wait / 1000:.1f} s is no request's\nwait: the shortest real wait was about {2 * wait / 1000:.1f} s")
    says(CH, f"the median is {ttft:.0f} ms")
    requests_per_s = rate / output_len
    says(CH, f"{goodput} of the {requests_per_s:.2f} requests/s,\n{round(goodput * n / requests_per_s)} of the {n}, "
             f"met both objectives")


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
    # busy fraction at a low rate: λ · R, R a request's lone latency (SingleStream), not λ over Offline's batched rate
    rate = float(re.search(r"Offline's ([\d.]+) samples/s would say λ / ([\d.]+)", chapter(CH))[1])
    assert table_rows(CH, "nanoserve, q4 weights")[0][1] == f"**52.9** ({rate} samples/s)"  # the table's own run
    p90 = float(table_rows(CH, "nanoserve, q4 weights")[0][4].split()[0])
    says(CH, f"its p90 is {p90:.2f} s with q4, so take R ≈ {p90:.0f} s")
    lone = round(p90)
    says(CH, f"Some {per_try} λR long prompts then land beside other work, each a likely miss: at 0.25 QPS "
             f"λR ≈ {0.25 * lone:.2f}, about {per_try * 0.25 * lone:.0f} of the {per_try}")
    lowest = 1 / (per_try * lone)  # where one miss is expected
    says(CH, f"Only below about λ = 1 / ({per_try} R) ≈ {lowest:.3f} QPS would none be expected")
    hours = round(queries / lowest / 3600)
    says(CH, f"{queries} queries at that rate take about {word(hours)} hours")
    ours, theirs = (float(table_rows(CH, name)[0][1].split()[0].strip("*")) for name in (
        "nanoserve, q4 weights", "llama.cpp's `llama-server`, 16 slots"))
    says(CH, f"Offline, q4 gave {ours} tokens/s and llama-server {theirs}")


def test_the_profile_table():
    text = chapter(CH)
    bandwidth, peak, ridge = re.search(r"read bandwidth ([\d.]+) GB/s, GEMM peak ([\d.]+) GFLOP/s \(ridge at ([\d.]+)", text).groups()
    bw, pk = float(bandwidth), float(peak)
    assert (pk - 0.05) / (bw + 0.05) <= float(ridge) + 0.05 and float(ridge) - 0.05 <= (pk + 0.05) / (bw - 0.05)
    says(CH, f"the AMX machine's ridge is at {float(ridge):.0f} FLOP/byte")
    zen4_bw, zen4_peak, zen4_ridge = (float(x) for x in re.search(
        r"on Zen 4 the same command measured ([\d.]+) GB/s and ([\d.]+) GFLOP/s .*? a ridge at ([\d.]+) FLOP/byte", text).groups())
    assert f"{zen4_peak / zen4_bw:.1f}" == f"{zen4_ridge:.1f}"  # 92.4 / 27.1 = 3.41
    prompt = command_defaults(profile, "profile").prompt_len
    nbytes16, flops16 = profile.step_cost(SMOL, 16, 16, [prompt + 2] * 16, 1)
    assert flops16 / nbytes16 > zen4_ridge  # "a decode step at batch 16 is past the ridge already"
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
    says(CH, f"the Python between the labelled parts\n  are {min(python)}–{max(python)} % of every step here")
    norms = [rows[k][1][3] for k in rows]  # the model's own Python, with the ops it dispatches
    says(CH, f"the model's own forward mostly in norms/RoPE/act ({min(norms)}–{max(norms)} % here)")


def test_the_compiled_step():
    says(CH, "padded up to the next of " + ", ".join(map(str, BUCKETS[:-1])) + f", {BUCKETS[-1]} tokens")
    text = chapter(CH)
    warm = {name: float(s) for name, s in re.findall(r"warm-up nanoserve (q4, kv bf16(?:, buckets)?): ([\d.]+)s", text)}
    says(CH, f"the\nwarm-up round took {warm['q4, kv bf16, buckets'] - warm['q4, kv bf16']:.0f} s longer")
    tokens = int(re.search(r"16 requests \(\d+ prompt tokens, (\d+) output tokens\)", text)[1])
    rates = {}
    # the column against transformers is withdrawn (nanoserve's rounds could hit its prefix cache): a dash
    for name, rate, r1, r2 in re.findall(r"(nanoserve q4, kv bf16(?:, buckets)?) +([\d.]+) "
                                         r"out tok/s +— +rounds: ([\d.]+)s ([\d.]+)s", text):
        assert within(rate, 2 * tokens / (float(r1) + float(r2)), 1), name  # both rounds' tokens over both rounds' time
        rates[name] = float(rate), (float(r1), float(r2))
    assert "transformers bf16 static " not in text.split("16 requests (")[1].split("```")[0]
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
    # each request's hit, by hand: the longest block-aligned prefix it shares with an earlier one (less its last
    # token, which is always computed); their sum is what the engine computed
    items = course_prompts(16, seed=0, kinds=["system"])
    prompts = [smollm2_tokenizer.encode_chat(item["messages"]) for item in items]
    questions = len({item["messages"][-1]["content"] for item in course_prompts(400, seed=0, kinds=["system"])})
    says(CH, f"then one of {questions} short questions")
    distinct = len({tuple(p) for p in prompts})
    says(CH, f"With {questions} questions to draw from, the 16 requests hold only {distinct} distinct prompts: "
             f"{16 - distinct} are exact repeats")
    hits, new, repeats = [], [], []
    for i, p in enumerate(prompts):
        common = max((next((j for j, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q))) for q in prompts[:i]),
                     default=0)
        hits.append(min(common, len(p) - 1) // 16 * 16)
        (repeats if p in prompts[:i] else new).append(i)
    assert sum(len(p) - h for p, h in zip(prompts, hits)) == on["prompt_tokens_computed"]
    says(CH, f"The first request computes all of its {len(prompts[0])} tokens")
    firsts = [len(prompts[i]) - hits[i] for i in new[1:] if hits[i] == 160]
    says(CH, f"finds the system prompt's 10 full blocks\n(160 tokens) in the cache and prefills the rest of its prompt, "
             f"{min(firsts)}–{max(firsts)} tokens (one of them shares 176 tokens")
    assert len(firsts) == len(new) - 2 and sorted(hits[i] for i in new[1:])[-1] == 176
    assert {hits[i] for i in repeats} == {176}
    rest = [len(prompts[i]) - 176 for i in repeats]
    says(CH, f"a repeat finds its prompt's 11 full blocks (176 tokens) and prefills only\nits last, partial block, "
             f"{min(rest)}–{max(rest)} tokens")


def test_the_block_size_experiment(capsys):
    """The block-size experiment's schedule, replayed on the tiny model (EOS ignored: the schedule does not depend
    on the weights) in a pool scaled to the tiny model's KV bytes, so each block size gets SmolLM2's block count."""
    model = tiny_llama(vocab_size=SMOL.vocab_size)
    smol, tiny = kv_bytes_per_token(SMOL, "fp32"), kv_bytes_per_token(model.config, "fp32")
    budget = experiment.BLOCK_SIZE_POOL * tiny // smol
    for bs in (8, 16, 32):
        assert budget // (bs * tiny) == experiment.BLOCK_SIZE_POOL // (bs * smol)
    with torch.inference_mode():
        result, _ = experiment.block_size(SimpleNamespace(output_len=None, rounds=1), model, None, budget=budget)
    printed = capsys.readouterr().out
    need = int(re.search(r"at once, (\d+) tokens at their ends", printed)[1])
    pool = {bs: experiment.BLOCK_SIZE_POOL // (bs * smol) * bs for bs in (8, 16, 32)}
    says(CH, f"SmolLM2's float32 KV takes {smol:,} bytes a token, so 64 MiB holds\n{pool[16]:,} tokens ({pool[32]:,} in "
             f"blocks of 32), and the 24 requests hold {need:,} at their ends")
    rows = {r[0]: r for r in table_rows(CH, "8|16|32") if len(r) == 6}
    for bs in (8, 16, 32):
        x = result["best"][f"block {bs}"]
        assert rows[str(bs)][2] == f"{x['mean_waste']:.1%}".replace("%", " %")
        assert rows[str(bs)][3:] == [str(x["preemptions"]), str(x["recomputed_tokens"]), f"{x['computed_tokens']:,}"]
        assert x["num_blocks"] * bs == pool[bs]
    computed = {bs: result["best"][f"block {bs}"]["computed_tokens"] for bs in (8, 16, 32)}
    preempted = {bs: result["best"][f"block {bs}"]["preemptions"] for bs in (8, 16, 32)}
    says(CH, f"block 8 preempted {word(preempted[8])} times and block 32 {'twice' if preempted[32] == 2 else preempted[32]}, "
             f"so block 8 computed {computed[8] / computed[32] - 1:.0%} more tokens".replace("%", " %"))
    best = [max(number(v) for v in rows[str(bs)][1].split(" / ")) for bs in (8, 16, 32)]
    says(CH, "keeps each row's better one (" + ", ".join(f"{v:.1f}" for v in best[:2]) + f" and {best[2]:.1f} tokens/s)")
    r1, r2 = (number(x) for x in rows["32"][1].split(" / "))
    says(CH, f"its other round ran the very same schedule {r1 / r2:.1f}× slower")


def test_the_chunked_prefill_experiment():
    """The long prompt's prefill steps, replayed on the tiny model (the schedule does not depend on the weights):
    5 with chunking — 4 streams decode in each step, so a 512-token budget leaves 508 for the prompt — and 1 without;
    the ratios the text draws from its table."""
    model = tiny_llama(vocab_size=SMOL.vocab_size, max_position_embeddings=4096)
    with torch.inference_mode():
        result, _ = experiment.chunked_prefill(SimpleNamespace(output_len=None, rounds=1), model, None)
    steps = {name: x["long_prompt_prefill_steps"] for name, x in result["best"].items()}
    assert steps == {"chunked (budget 512)": math.ceil(2048 / (512 - 4)), "whole prompts (budget 4096)": 1}
    chunked, whole = table_rows(CH, r"chunked, 512 per step")[0], table_rows(CH, "whole prompts")[0]
    assert [chunked[6], whole[6]] == [str(steps["chunked (budget 512)"]), "1"]
    says(CH, f"With chunking its prefill takes {steps['chunked (budget 512)']} steps — each step's 512 tokens are shared "
             f"with the 4\nstreams' decodes: 508 prompt tokens four times, then {2048 - 4 * 508}")
    itl = [[number(v) for v in row[4].split(" / ")] for row in (chunked, whole)]
    says(CH, f"the worst gap was\n{itl[1][0] / itl[0][0]:.1f}× shorter in round 1 ({itl[0][0]:.2f} s, about the whole "
             f"prompt's stall over {steps['chunked (budget 512)']} steps) and {itl[1][1] / itl[0][1]:.1f}× in round 2")
    assert abs(itl[1][0] / steps["chunked (budget 512)"] / itl[0][0] - 1) < 0.05  # "about": 12.24 / 5 = 2.45
    assert whole[4] == whole[5]  # whole prompts: the streams' worst gap is the long prompt's one step


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
    dtype = {r[0]: r for r in table_rows(CH, "float32|bfloat16")}
    says(CH, f"the {number(dtype['bfloat16'][2]) / number(dtype['float32'][2]):.1f}× can come from")
    total = parameter_counts(SMOL)["total"]
    assert (dtype["float32"][3], dtype["bfloat16"][3]) == (f"{total * 4 / 2**20:.0f} MiB", f"{total * 2 / 2**20:.0f} MiB")
    linear = [r for r in table_rows(CH, r"\d+") if len(r) == 4 and r[3].endswith("×")]  # tokens | fp32 | bf16 | ratio
    assert len(linear) == 4
    for tokens, fp32, bf16, ratio in linear:
        assert f"{number(bf16) / number(fp32):.2f}×" == ratio, tokens

def test_the_native_step_table():
    """Section 5's batch-1 table: each median is its five rounds', and the ratios and falls the text draws from it."""
    def runs(first_cell):  # [(median, [rounds])] per run
        (row,) = table_rows(CH, first_cell)
        cells = [re.fullmatch(r"\**([\d.]+)\** \(([\d. ]+)\)", c) for c in row[1:]]
        return [(float(m[1]), [float(x) for x in m[2].split()]) for m in cells]

    native, forward, llama = (runs(f) for f in (r"q4, native step \(the default now\)", r"q4, the model's forward .*",
                                                r"llama\.cpp `llama-bench -t 2` tg128"))
    for median, rounds in native + forward + llama:
        assert len(rounds) == 5 and median == statistics.median(rounds)
    over = [n[0] / ll[0] for n, ll in zip(native, llama)]
    says(CH, "So one sequence decodes at " + ", ".join(f"**{r:.2f}×**" for r in over[:2]) + f" and **{over[2]:.2f}×**")
    old = [f[0] / ll[0] for f, ll in zip(forward, llama)][1:]  # run 1's forward collapsed: not drawn
    gain = [n[0] / f[0] for n, f in zip(native, forward)][1:]
    says(CH, f"from {old[0]:.2f}× and {old[1]:.2f}× for the previous default in runs 2 and 3 ({gain[0]:.1f}× and "
             f"{gain[1]:.1f}× faster;")

    def fall(system):  # the largest best-to-worst fall of one run's rounds: (factor, best, worst, run)
        return max((max(r) / min(r), max(r), min(r), i + 1) for i, (_, r) in enumerate(system))

    for what, system in (("native step's fell furthest,", native), ("the old forward's", forward),
                         ("llama.cpp's at most", llama)):
        f, best, worst, run = fall(system)
        says(CH, f"{what} {f:.1f}× ({best} to {worst} in run {run})")
    assert fall(native)[0] > fall(forward)[0] > fall(llama)[0]  # "the most fragile of the three"


def test_the_batched_native_step_table():
    """Section 5's 16-request table: each rate is the two rounds' output tokens (16 × 128 each) over their summed
    seconds, to the rounds' own rounding; the ratios the text draws from it (runs 1-2 tiles of 4, 3-4 tiles of 8,
    5 TILE 4 on a machine as quiet as 3-4), the runs' and their rounds'; in each run every native round beats every
    forward round."""
    def runs(first_cell):  # [(rate, [round seconds])] per run
        (row,) = table_rows(CH, first_cell)
        cells = [re.fullmatch(r"\**([\d.]+)\** \(([\d.]+) s, ([\d.]+) s\)", c) for c in row[1:]]
        return [(float(m[1]), [float(m[2]), float(m[3])]) for m in cells]

    native, forward, hf = (runs(f) for f in (r"q4, native step \(batched\)", r"q4 through the model's forward .*",
                                             r"transformers, float32, static batch"))
    for rate, rounds in native + forward + hf:
        assert 2 * 16 * 128 / (sum(rounds) + 0.1) <= rate <= 2 * 16 * 128 / (sum(rounds) - 0.1), (rate, rounds)
    assert len(native) == len(forward) == len(hf) == 5
    over_forward = [n[0] / f[0] for n, f in zip(native, forward)]
    over_hf = [n[0] / h[0] for n, h in zip(native, hf)]
    rounds_hf = [[h / n for n, h in zip(n_rounds, h_rounds)] for (_, n_rounds), (_, h_rounds) in zip(native, hf)]
    says(CH, f"at {min(over_forward):.2f}–{max(over_forward):.2f}× the forward's rate")
    says(CH, f"{over_hf[0]:.2f}× and {over_hf[1]:.2f}× with tiles of 4, then\n**{over_hf[2]:.2f}×** and "
             f"**{over_hf[3]:.2f}×** with tiles of 8")
    for (_, n_rounds), (_, f_rounds) in zip(native, forward):
        assert max(n_rounds) < min(f_rounds)
    assert max(over_hf[:2]) < 2 <= min(over_hf[2:4]) and over_hf[4] < 2  # met by runs 3 and 4's medians
    says(CH, f"by {round(100 * (min(over_hf[2:4]) - 2) / 2)}–{round(100 * (max(over_hf[2:4]) - 2) / 2)} %")
    (a, b), (c, d) = rounds_hf[2:4]
    says(CH, f"{a:.2f} and {b:.2f} in run 3, {c:.2f} and {d:.2f} in run 4")
    assert sum(r >= 2 for r in rounds_hf[2] + rounds_hf[3]) == 3  # "in 3 of their 4 rounds"
    assert [sum(r >= 2 for r in rounds) for rounds in rounds_hf[:2]] == [1, 1]  # runs 1 and 2: "one round past 2×"
    says(CH, f"past 2× as well ({max(rounds_hf[0]):.2f} and {max(rounds_hf[1]):.2f})")
    says(CH, f"gave {over_hf[4]:.2f}× transformers (rounds {rounds_hf[4][0]:.2f} and {rounds_hf[4][1]:.2f})")
    gain = [native[i][0] / native[4][0] - 1 for i in (2, 3)]
    says(CH, f"its rate was {round(100 * min(gain))}–{round(100 * max(gain))} % higher")


def test_the_http_runs_against_llama_server_on_the_avx2_vm():
    """Section 3's AVX2 table: each round's ratio is nanoserve's tokens/s over llama.cpp's in that round (the same
    prompts), and the text's least ratio and best-against-best figure are run 2's."""
    runs = {}
    for row in table_rows(CH, r"run [12]: .*"):
        ours, theirs, ratios = ([float(v.strip("* ")) for v in cell.split(" / ")] for cell in row[1:4])
        assert [round(a / b, 2) for a, b in zip(ours, theirs)] == ratios, row[0]
        runs[row[0][:5]] = ours, theirs, ratios
    ours, theirs, ratios = runs["run 2"]
    says(CH, f"In run 2 nanoserve served at least {min(ratios):.2f}× llama.cpp's tokens/s in every round")
    says(CH, f"{max(ours)} / {max(theirs)} = {max(ours) / max(theirs):.2f}×")
    assert sum(r >= 1.5 for r in runs["run 1"][2]) == 1  # "reached it in one round of five"


def test_the_concurrency_experiment():
    """The levels' ratios, within a round, from the table; the per-level request counts from the experiment's rule."""
    rows = {int(r[0].split()[0]): r for r in table_rows(CH, r"(1|4|16) \(\d+\)")}
    assert [r[0] for r in rows.values()] == [f"{c} ({max(4, 2 * c)})" for c in (1, 4, 16)]
    rate = {c: [number(v) for v in rows[c][1].split(" / ")] for c in rows}
    assert all(rate[c][0] >= rate[c][1] for c in rate)  # the columns after are round 1's: the better one
    says(CH, f"From 1 to 4 clients the server turned shared decode steps into {rate[4][0] / rate[1][0]:.1f}× the tokens/s\n"
             f"({rate[4][1] / rate[1][1]:.1f}× in round 2)")
    tpot = {c: number(rows[c][4].split(" / ")[1]) for c in rows}  # mean / median / p99: the median
    says(CH, f"each user's median TPOT grew {tpot[4] / tpot[1]:.1f}×")
    says(CH, f"({rate[16][0] / rate[4][0]:.1f}× in round 1, {rate[16][1] / rate[4][1]:.1f}× in round 2)")


def test_the_memory_planner(capsys):
    args = ["memory", "--model", "smollm2-135m", "--device-gb", "2", "--seq-len", "1000", "--dtype", "fp32"]
    for extra, first in ((["--block-size", "16"], "paged, blocks of 16"), (["--kv-fill", "0.95"], "at the measured fill")):
        assert main(args + extra) == 0
        printed = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(printed) if line.startswith(first))
        shown = printed[start:start + (2 if extra[0] == "--block-size" else 1)]
        says(CH, "$ .venv/bin/python -m nanoserve " + " ".join(args + extra) + " " + " ".join(shown))
