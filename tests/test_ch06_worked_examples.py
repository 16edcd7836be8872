"""Chapter 06's worked examples, computed by the code: the schedule table, the flat batch, the parallel-sampling
token count, the model's sizes, the figures `bench offline` derives from its seeded workload and the engine steps it
takes, and the notebook's static-vs-continuous step counts (both on the tiny model: with EOS ignored the schedule does
not depend on the weights) are built here from nanoserve/ and must appear in the chapter word for word. The ratios the
chapter draws from its timed tables are recomputed from those tables, and the figures it quotes from the notebook
must be what the committed notebook printed."""

import inspect
import random
import re

import torch

from nanoserve.bench.experiment import BUDGETS, budget_sweep
from nanoserve.bench.linear import model_weights
from nanoserve.bench.offline import make_workload, run_nanoserve
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.paged_attention import AttentionMetadata, num_blocks_for_budget
from nanoserve.memory import kv_bytes_per_token, parameter_counts
from nanoserve.model import LlamaConfig
from nanoserve.sampling import SamplingParams
from tests.chapter_text import chapter, notebook_output, says, table_rows, word
from tests.test_ch06_scheduler import add, drain, make, step
from tests.tiny_model import tiny_llama

CH = "06"
SMOL = LlamaConfig()


def tiny_engine(**config) -> LLMEngine:
    """The tiny model in an engine of LLM's flat settings, for a schedule: positions up to the workloads' longest."""
    return LLMEngine(tiny_llama(max_position_embeddings=1024), engine_config(**config))


def folded(workload):
    """SmolLM2-vocabulary prompts as the tiny model's ids (the schedule only counts them)."""
    return [([t % 256 for t in p], n) for p, n in workload]


def test_why_batch_the_model_sizes():
    total = parameter_counts(SMOL)["total"]
    says(CH, f"every one of the {total / 1e6:.0f} M weights ({total * 4 / 1e6:.0f} MB in float32) is read from memory "
             f"to do about {total / 1e6:.0f} M multiply-adds ({2 * total / 1e6:.0f} M FLOPs)")


def test_the_schedule_table():
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    prompt = {"A": 3, "B": 10, "C": 2}
    for name, n in prompt.items():
        add(s, name, n)
    says(CH, f"(`max_num_batched_tokens` = 8, `max_num_seqs` = 2, block size 4; A has a {prompt['A']}-token prompt, "
             f"B {prompt['B']}, C {prompt['C']})")
    computed = dict.fromkeys(prompt, 0)
    rows = []
    for number in (1, 2, 3):
        out = step(s)
        cells = []
        for name in prompt:
            n, before = out.num_scheduled_tokens.get(name, 0), computed[name]
            if n == 0:
                cells.append("waits: no seat" if number == 1 and len(s.running) == 2 else "waits")
            elif before >= prompt[name]:
                cells.append(f"decode {n}")
            elif before == 0 and n == prompt[name]:
                cells.append(f"prefill {n} → samples")
            else:
                samples = " → samples" if before + n == prompt[name] else " (samples nothing)"
                cells.append(f"chunk [{before}, {before + n}){samples}")
            computed[name] += n
        rows.append([str(number), *cells, str(out.total_num_scheduled_tokens)])
    assert table_rows(CH, r"[123]") == rows


def test_the_flat_batch_of_a_mixed_step():
    # A decodes at position 9, B prefills [0, 3), C decodes at position 4; blocks of 16
    q_lens, seq_lens = [1, 3, 1], [10, 3, 5]
    meta = AttentionMetadata.build([[0], [1], [2]], seq_lens, q_lens, 16)
    n = meta.slot_mapping.numel()
    says(CH, f"(num_tokens,) = ({n},)")
    says(CH, f"cu_seqlens_q {meta.cu_seqlens_q.tolist()} sequence i's queries are tokens cu[i]:cu[i+1] "
             f"seq_lens {meta.seq_lens.tolist()} keys each sequence attends to")
    says(CH, f"The model runs once over the {n} tokens: every linear layer — the bulk of the work — sees one "
             f"({n}, {SMOL.hidden_size}) matrix")


def test_logits_only_where_a_token_is_sampled():
    V, H = SMOL.vocab_size, SMOL.hidden_size
    says(CH, f"The LM head is {V} × {H} = {V * H / 1e6:.0f} M of the {parameter_counts(SMOL)['total'] / 1e6:.0f} M "
             f"weights; computing it for all 2000 tokens of a prefill would cost 2000 × {V} × 4 B = "
             f"{2000 * V * 4 / 1e6:.0f} MB of logits")


def test_parallel_sampling_schedules_the_prompt_once():
    s = make(max_num_batched_tokens=16)
    add(s, "r", 10, max_tokens=4, n=3)
    per_step = [sum(x.values()) for x in drain(s)]
    alone = 3 * (10 + 3)  # three requests: each its prompt and 3 decodes
    says(CH, f"a 10-token prompt with `n=3` and 4 new tokens schedules {' + '.join(map(str, per_step))} = "
             f"{sum(per_step)} tokens, not 3 × 10 + 9")
    assert 3 * 10 + 9 == alone


def test_the_readmission_example_is_the_tests():
    from tests.test_ch06_llm import test_readmission_after_preemption_recomputes_only_the_uncached_tail as test

    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    recomputed = dict(mark.args[1])
    says(CH, f"recompute **{recomputed[True]} tokens with prefix caching, {recomputed[False]} without**")
    says(CH, f"{recomputed[True]} tokens recomputed with prefix caching, {recomputed[False]} without")


def test_bench_offline_workload_and_schedule():
    workload = make_workload(16, (32, 512), (16, 256), 0, SMOL.vocab_size)  # --num-requests 16, the defaults
    prompt, output = sum(len(p) for p, _ in workload), sum(n for _, n in workload)
    longest_prompt, longest_output = max(len(p) for p, _ in workload), max(n for _, n in workload)
    says(CH, f"threads: 1, float32, KV pool: {num_blocks_for_budget(SMOL, 1024 * 2**20)} blocks of 16 tokens")
    says(CH, f"workload: 16 requests, {prompt:,} prompt tokens (longest {longest_prompt}), {output:,} output tokens "
             f"(longest {longest_output})")
    says(CH, f"on the same 16 requests ({prompt:,} prompt tokens, {output:,} output tokens)")
    says(CH, f"as many steps as the longest output ({longest_output} here) on prompts padded to the longest ({longest_prompt})")
    engine = tiny_engine(num_blocks=num_blocks_for_budget(SMOL, 1024 * 2**20), max_num_seqs=64, max_num_batched_tokens=2048)
    with torch.inference_mode():
        _, _, steps, preemptions, _ = run_nanoserve(engine, folded(workload))
    says(CH, f"{steps} engine steps, {preemptions} preemptions")
    says(CH, f"one every {longest_output // 16} steps")  # the one-at-a-time requests, spread over the run
    # each system's row: out tok/s and total tok/s are its tokens over its seconds; the ratios are of those rates
    rates = {}
    for name, reqs, out, seconds, rate, total in re.findall(
            r"(nanoserve \(continuous\)|one at a time \(ch04 cache\)|HF static batches of 16) +(\d+) req +(\d+) out tok "
            r"+([\d.]+) s +([\d.]+) out tok/s +([\d.]+) total tok/s", chapter(CH)):
        assert (int(reqs), int(out)) == (16, output), name
        assert (f"{output / float(seconds):.1f}", f"{(prompt + output) / float(seconds):.1f}") == (rate, total), name
        rates[name] = float(rate)
    assert len(rates) == 3
    one, hf = (rates["nanoserve (continuous)"] / rates[n] for n in ("one at a time (ch04 cache)", "HF static batches of 16"))
    says(CH, f"nanoserve / one at a time: {one:.1f}x output tokens/s")
    says(CH, f"nanoserve / HF static: {hf:.1f}x output tokens/s")
    says(CH, f"**{one:.1f}× one at a time, {hf:.1f}× HF's static batches**")


def test_the_notebooks_static_and_continuous_steps():
    # the notebook's cell: 24 requests, most wanting 4-16 tokens, every eighth 96; static batches of 8 run as long
    # as their longest member, 8 seats refilled every step
    rng = random.Random(1)
    work = [([rng.randrange(1000, 20000) for _ in range(rng.randint(16, 64))], 96 if i % 8 == 0 else rng.randint(4, 16))
            for i in range(24)]
    engine = LLMEngine(tiny_llama(), EngineConfig(cache_config=CacheConfig(num_blocks=128),
                                                  scheduler_config=SchedulerConfig(max_num_seqs=8)))

    def run(batch):
        for i, (p, n) in enumerate(folded(batch)):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps

    with torch.inference_mode():
        static = sum(run([(p, max(n for _, n in work[b:b + 8])) for p, _ in work[b:b + 8]]) for b in range(0, 24, 8))
        continuous = run(work)
    out = notebook_output(CH)
    assert f"useful output tokens: {sum(n for _, n in work)}" in out
    assert re.search(rf"static \(batches of 8\): {static} steps", out) and re.search(rf"\(max 8 seats\): {continuous} steps", out)
    assert f"steps: {static / continuous:.2f}x fewer" in out
    says(CH, f"**{static} vs {continuous} engine steps, {static / continuous:.2f}× fewer**")
    static_rate, continuous_rate = (re.search(rf"{what}.*? ([\d.]+) useful tok/s", out)[1] for what in ("static", "continuous"))
    wall = float(re.search(r"wall time: ([\d.]+)x less", out)[1])
    says(CH, f"{static_rate} vs {continuous_rate} useful tokens/s — a {wall:.0f}× that measures the load")


def test_the_prefill_budget_sweep():
    defaults = {k: v.default for k, v in inspect.signature(budget_sweep).parameters.items() if k != "model"}
    says(CH, f"{defaults['num_streams']} streams ({32}-token prompts, {defaults['stream_output']} output tokens each) "
             f"decode while {word(len(defaults['long_arrivals']))} {defaults['long_len']}-token prompts arrive, at steps "
             f"{', '.join(map(str, defaults['long_arrivals'][:-1]))} and {defaults['long_arrivals'][-1]}")
    rows = {r[0]: r for r in table_rows(CH, "chunked, budget \\d+|chunking off.*")}
    assert list(rows) == list(BUDGETS)
    ms = {name: [float(c.replace("*", "").replace(",", "").removesuffix(" ms")) for c in r[1:6]] for name, r in rows.items()}
    itl99, ttft50 = (lambda name: ms[name][1]), (lambda name: ms[name][3])
    off, b256, b512, b2048 = ms["chunking off (budget 2048)"], *(f"chunked, budget {b}" for b in (256, 512, 2048))
    says(CH, f"the streams' p99 ITL of {off[1] / 1000:.1f} s")
    says(CH, f"**{itl99(b256):.0f} ms with a budget of 256, {off[1] / itl99(b256):.1f}× less** "
             f"({itl99(b512) / 1000:.1f} s at 512)")
    says(CH, f"so it behaves like no chunking ({itl99(b2048) / 1000:.2f} vs {off[1] / 1000:.2f} s)")
    says(CH, f"TTFT p50 {ttft50(b256) / 1000:.2f} s against {off[3] / 1000:.2f} s, **+{ttft50(b256) / off[3] - 1:.0%}** "
             f"(+{ttft50(b512) / off[3] - 1:.0%} at a budget of 512)".replace("%", " %"))


def test_what_limits_a_step_the_profile_row():
    text = chapter(CH)
    bandwidth, peak, ridge = re.search(r"read bandwidth ([\d.]+) GB/s, GEMM peak ([\d.]+) GFLOP/s \(ridge at ([\d.]+)", text).groups()
    assert f"{float(peak) / float(bandwidth):.1f}" == ridge
    ms, *parts, mem, compute = re.search(r"decode B=32 +([\d.]+)" + r" +(\d+)%" * 6 + r" +([\d.]+) / +([\d.]+) +memory",
                                         text).groups()
    linear, attention, gather, norms, sampling, scheduler = map(int, parts)
    says(CH, f"its roofline is the time to read the weights and the K/V once ({float(mem):.0f} ms at the measured "
             f"bandwidth), above the time its FLOPs need ({float(compute):.0f} ms). It ran {float(ms) / float(mem):.1f}× above")
    says(CH, f"**The linear layers ({linear} %) are the largest part")
    says(CH, f"**Attention is memory traffic: {attention} % attention, {gather} % the K/V gather and store.**")
    says(CH, f"norms, RoPE and activations {norms} %, sampling {sampling} %")
    says("05", f"the K/V gather and store took {gather} % of it, the attention kernels {attention} %; chapter 06 quotes the run")
    kv = 32 * 400 * kv_bytes_per_token(SMOL, "fp32")
    says(CH, f"a 32 × 400-token batch holds {kv / 1e6:.0f} MB of K/V — as much as the weights")


def test_the_linear_table():
    weights = model_weights(SMOL)
    n = sum(w.numel() for w in weights)
    says(CH, f"(all {len(weights)} weight matrices, cold from memory")
    tokens, plain, swapped, speedup = (table_rows(CH, label)[0][1:] for label in ("tokens", "`F.linear` ms", "swapped ms", "speed-up"))
    for p, s, x in zip(plain, swapped, speedup):
        assert f"{float(p) / float(s):.2f}×" == x.strip("*"), (p, s, x)
    ms = dict(zip(map(int, tokens), map(float, plain)))
    says(CH, f"At 1,024 tokens the products run at 2 · {n / 1e6:.1f} M · 1,024 FLOPs / {ms[1024]:,.0f} ms ≈ "
             f"{2 * n * 1024 / ms[1024] / 1e6:.0f} GFLOP/s")
    says(CH, f"at 16 tokens at ~{2 * n * 16 / ms[16] / 1e6:.0f} GFLOP/s, so a batch-16 decode step costs as much as "
             f"~{ms[16] / (ms[1024] / 1024):.0f} tokens of prefill")
    gate = weights[4].shape
    says(CH, f"for the {gate[0]} × {gate[1]} gate and up products: `SGEMM(T,N,{gate[0]},16,{gate[1]}…)` vs "
             f"`SGEMM(T,N,16,{gate[0]},{gate[1]}…)`")
