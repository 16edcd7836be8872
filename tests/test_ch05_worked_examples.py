"""Chapter 05's worked examples, computed by the code: the slot mappings, the allocator and fork walk-throughs, the
pool's bytes, `bench paged-kv`'s seeded waste and prefix-cache figures and its memory-cap scheduling (on the tiny
model: with EOS ignored the schedule does not depend on the weights) are built here from nanoserve/kv/ and
nanoserve/bench/paged_kv.py, and must appear in the chapter word for word; the figures it quotes from the notebook
must be what the committed notebook printed."""

import re
import statistics

import pytest
import torch

from nanoserve.bench.kv_cache import request_lengths
from nanoserve.bench.offline import make_workload
from nanoserve.bench.paged_kv import QUESTIONS, SYSTEM_PROMPT, decode_batch, prefix_savings, under_memory_cap, waste_over_time
from nanoserve.kv.block_allocator import BlockAllocator
from nanoserve.kv.block_manager import BlockManager, cdiv, slot_mapping
from nanoserve.kv.paged_attention import num_blocks_for_budget
from nanoserve.kv.prefix_cache import block_hashes
from nanoserve.memory import format_bytes, kv_bytes_per_token
from nanoserve.model import LlamaConfig
from tests.chapter_text import chapter, normalise, notebook_output, says, word
from tests.tiny_model import tiny_llama

CH = "05"
SMOL = LlamaConfig()
PER_TOKEN = kv_bytes_per_token(SMOL, "fp32")


@pytest.fixture(scope="module")
def mix():
    """Chapter 04's seeded request mix, as `bench paged-kv` draws it: (prompt lengths, output lengths)."""
    return tuple(t.tolist() for t in request_lengths(1000, 2048, seed=0))


def test_the_slot_mapping_walk_through():
    m = BlockManager(8, 4, enable_prefix_caching=False)
    prompt = list(range(6))
    table = m.allocate_slots(7, prompt, 6)
    slots = slot_mapping(table, 0, 6, 4)
    says(CH, f"allocate_slots(7, prompt, 6) block table {table} positions [0, 6) -> slots "
             + " | ".join(" ".join(map(str, slots[i:i + 4])) for i in range(0, 6, 4)))
    for n in (7, 8, 9):
        grew = len(m.block_table(7))
        table = list(m.allocate_slots(7, prompt + [0] * (n - 6), n))
        (slot,) = slot_mapping(table, n - 1, n, 4)
        line = f"decode: {n} tokens block table {table} position {n - 1} -> slot {slot}"
        if len(table) > grew:
            line += f" (block {grew - 1} was full: one more block)"
        says(CH, line)


def test_a_table_of_scattered_blocks():
    table = [5, 7, 13]
    slots = slot_mapping(table, 0, 10, 4)
    says(CH, f"a table reads `{table}`, and the slot mapping of its 10 tokens is `{slots}`")
    assert f"block table {table}, 10 tokens -> slots {slots}" in notebook_output(CH)  # "the notebook prints it"


def test_the_waste_of_the_last_block(mix):
    """Half a block empty per request, as a share of what is reserved: over time against the tokens a running
    request holds on average (the measure section 8 leads with), at completion against the final lengths."""
    prompt, output = mix
    final = [p + o for p, o in zip(prompt, output)]
    mean = sum(final) / len(final)
    _, held, naive, paged = waste_over_time(prompt, output, 64, 16, 2048)
    running = naive / 2048  # request-steps: naive reserves 2048 slots per running request per step
    empty = (16 - 1) / 2
    assert abs((paged - held) / running - empty) < 0.1  # the estimate's premise, over time
    pct = lambda x: f"{x:.2%}".replace("%", " %")  # noqa: E731
    says(CH, f"a running request holds {held / running:.0f} tokens on average (it grows towards the mix's mean final "
             f"length of {mean:.0f}), so {empty} empty slots are `{empty} / ({held / running:.0f} + {empty}) ≈ "
             f"{pct(empty / (held / running + empty))}` of what it reserves — and the measurement agrees (section "
             f"8): **{pct(1 - held / paged)}**")
    at_end = 1 - sum(final) / sum(cdiv(n, 16) * 16 for n in final)
    says(CH, f"At completion, on the final lengths, `{empty} / ({mean:.0f} + {empty}) ≈ {pct(empty / (mean + empty))}`; "
             f"measured: {pct(at_end)}.")


def test_the_allocator_walk_through():
    a = BlockAllocator(4)
    free = lambda: f"free list {list(a.free_list)}"  # noqa: E731
    says(CH, f"a = BlockAllocator(4) {free()}")
    says(CH, f"a.allocate(2) -> {a.allocate(2)} {free()}")
    assert a.allocate(3) is None and list(a.free_list) == [2, 3]
    says(CH, f"a.allocate(3) -> None only {a.get_num_free_blocks()} free: says no, changes nothing")
    a.incref(1)
    says(CH, f"a.incref(1) ref_count(1) == {a.ref_count(1)}: two tables share block 1")
    a.free(1), a.free(0)
    says(CH, f"a.free(1); a.free(0) ref_count(1) == {a.ref_count(1)}; block 0 drops to {a.ref_count(0)}: {free()}")
    says(CH, f"a.allocate(3) -> {a.allocate(3)}")


def test_fork_and_copy_on_write():
    m = BlockManager(8, 4, enable_prefix_caching=False)
    prompt = list(range(100, 110))
    m.allocate_slots("c0", prompt, 10)
    m.fork("c0", "c1"), m.fork("c0", "c2")
    shared = {b for s in ("c0", "c1", "c2") for b in m.block_table(s)}
    for s in ("c0", "c1", "c2"):
        m.allocate_slots(s, prompt + [1], 11)
    copies = m.take_copies()
    tables = [m.block_table(s) for s in ("c0", "c1", "c2")]
    copied = [s for s, t in zip(("c0", "c1", "c2"), tables) if t[2] != 2]
    assert copied == ["c0", "c1"] and [src for src, _ in copies] == [2, 2]  # the first two copy, the last writes in place
    assert all(t[:2] == [0, 1] and m.allocator.ref_count(b) == 3 for t in tables for b in t[:2])
    says(CH, f"the three tables share {len(shared)} blocks after the prompt; at the first decode the first two "
             f"completions get copies of the partial block `[8, 12)` and the last one writes in place: "
             f"{len({b for t in tables for b in t})} blocks, {len(copies)} copies, the full blocks `[0, 4)` and "
             f"`[4, 8)` still shared three ways")


def test_a_chain_hash_names_the_whole_prefix():
    a, b = list(range(48)), list(range(40)) + [999] * 8  # agree on their first 40 tokens
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    says(CH, "Prompts that agree on their first 40 tokens share `h0` and `h1`, and differ from `h2` on")


def test_the_pool_bytes():
    c = SMOL
    says(CH, f"`2 · {c.num_hidden_layers} layers · {c.num_key_value_heads} kv heads · {c.head_dim} · 4 B = "
             f"{PER_TOKEN:,} B` per token, so `{16 * PER_TOKEN:,} B = {format_bytes(16 * PER_TOKEN).replace('.0 ', ' ')}` "
             f"per 16-token block")
    n = num_blocks_for_budget(c, 2**30)
    says(CH, f"`num_blocks_for_budget(config, 2**30)` is **{n} blocks = {n * 16:,} tokens** per GiB (the notebook's "
             f"pool cell prints it)")
    assert f"a 1.0 GiB budget: {n} blocks = {n * 16:,} tokens" in notebook_output(CH)


def test_the_two_layouts_gather_sizes():
    c, KiB = SMOL, 1024
    chunk, tile = 16 * c.num_key_value_heads * c.head_dim * 4, 16 * c.head_dim * 4
    says(CH, f"block-major as one {chunk // KiB} KiB chunk per block (all {word(c.num_key_value_heads)} kv heads), "
             f"heads-first as {word(c.num_key_value_heads)} {tile // KiB} KiB tiles")
    says(CH, f"each a contiguous `16 · {c.head_dim}` floats")
    says(CH, f"whole rows of one head ({c.head_dim} floats, {c.head_dim * 4} B")
    # the layout timings are runs of their own; the lead the text derives from them is arithmetic
    runs = re.search(r"gave block-major \*\*(.*?)×\*\*", chapter(CH)).group(1)
    ratios = [float(r) for r in re.findall(r"[\d.]+", runs)]
    assert len(ratios) == 6 and "Six runs in a row" in chapter(CH)
    slower = [r for r in ratios if r > 1]
    assert len(slower) == 5 and ratios[-1] < 1  # "slower in five runs ... faster by a fifth in the last"
    says(CH, f"slower in five runs, by {round((min(slower) - 1) * 100)} % to {round((max(slower) - 1) * 100)} %, "
             f"faster by a\nfifth in the last")
    assert round(1 - ratios[-1], 1) == 0.2
    says(CH, f"at the median, {statistics.median(ratios):.3f}×")


def test_a_python_loop_over_the_decodes():
    says(CH, f"A Python loop over 64 sequences in each of {SMOL.num_hidden_layers} layers is "
             f"{64 * SMOL.num_hidden_layers:,} tiny attention calls per step")


def test_bench_paged_kv_part_1_the_waste(mix):
    prompt, output = mix
    used = [p + o for p, o in zip(prompt, output)]
    says(CH, f"1. KV waste: 1000 requests of chapter 04's mix (seed 0); tokens per request mean "
             f"{sum(used) / len(used):.0f}, max {max(used)}; SmolLM2 fp32 = {PER_TOKEN:,} B/token")
    naive_end = 1 - sum(used) / (len(used) * 2048)
    paged_end = 1 - sum(used) / sum(cdiv(u, 16) * 16 for u in used)
    says(CH, f"at completion: naive (max_len 2048) {naive_end:.1%} waste, paged (block 16) {paged_end:.2%} waste")
    waste = {}
    for size in (1, 8, 16, 32, 128):
        steps, held, naive, paged = waste_over_time(prompt, output, 64, size, 2048)
        waste[size] = 1 - held / paged
        row = normalise(f"{size} {waste[size]:.2%} {1 - held / naive:.1%} {sum(cdiv(u, size) for u in used) / len(used):.1f}")
        assert chapter(CH).count(row) == 2, row  # section 1 and section 8 quote the same table
        if size == 16:
            mean = {name: x / steps * PER_TOKEN for name, x in (("held", held), ("naive", naive), ("paged", paged))}
            naive_waste = 1 - held / naive
    says(CH, f"mean KV memory per step (block 16): tokens {format_bytes(mean['held'])}, paged reserves "
             f"{format_bytes(mean['paged'])}, naive reserves {format_bytes(mean['naive'])}: naive holds "
             f"{mean['naive'] / mean['paged']:.1f}x the memory")
    says(CH, f"**{naive_waste:.1%} vs {waste[16]:.2%}**: the same {format_bytes(mean['held'])} of tokens needs "
             f"{format_bytes(mean['naive'])} reserved naively, {format_bytes(mean['paged'])} paged. That "
             f"{mean['naive'] / mean['paged']:.1f}×".replace("%", " %"))
    says(CH, "Seventy-two percent of the KV memory holds nothing")
    assert f"{naive_waste:.0%}" == "72%"
    says(CH, f"({waste[8]:.2%} at 8, {waste[128]:.0%} at 128)".replace("%", " %"))


def test_bench_paged_kv_part_2_prefix_caching(smollm2_tokenizer):
    tok = smollm2_tokenizer
    says(CH, f"2. prefix caching: {len(QUESTIONS)} chat requests one after another, block 16")
    system = [tok.encode_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]) for q in QUESTIONS]
    default = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    prefix = {}
    for name, prompts in (("own system prompt", system), ("template's default system prompt", default)):
        common = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
        s = prefix_savings(prompts, 16).stats
        says(CH, f"{name}: prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, common prefix {common} "
                 f"tokens ({common // 16} full block{'s' * (common // 16 != 1)}) hit rate {s.hit_rate:.1%} of prompt "
                 f"tokens ({s.hit_tokens} of {s.queried_tokens} never computed), blocks saved {s.hit_blocks} "
                 f"({format_bytes(s.hit_blocks * 16 * PER_TOKEN)} of KV not recomputed nor stored twice)")
        prefix[name] = common, s
    # the common prefix is the system turn and the user turn's opening: its tokens end with "<|im_start|>user\n"
    common, s = prefix["own system prompt"]
    assert tok.decode(system[0][:common]).endswith("<|im_end|>\n<|im_start|>user\n")
    blocks = common // 16
    assert s.hit_blocks == (len(QUESTIONS) - 1) * blocks
    says(CH, f"the first {common} tokens of every prompt (the system turn and the opening of the user's) are common "
             f"to every request, {word(blocks)} full blocks; the first request computes them, the other "
             f"{word(len(QUESTIONS) - 1)} find them: {len(QUESTIONS) - 1} × {blocks} = **{s.hit_blocks} blocks saved**, and **{s.hit_rate:.1%}**"
             .replace("%", " %"))
    says(CH, f"Only full blocks count: the {common}-token prefix gives {blocks * 16} shareable tokens")
    common, _ = prefix["template's default system prompt"]
    assert tok.decode(default[0][:common]).endswith("<|im_end|>\n<|im_start|>user\n")
    says(CH, f"SmolLM2's chat template inserts a default one, and with the user turn's opening the first {common} "
             f"tokens are common: {word(common // 16)} full block shared by every chat request")


def test_bench_paged_kv_part_3_the_decode_step():
    cache, meta = decode_batch(SMOL, 64, 256, 16, num_layers=1)
    lo, hi, mean = meta.seq_lens.min().item(), meta.seq_lens.max().item(), meta.seq_lens.float().mean().item()
    says(CH, f"3. one decode step, 64 sequences, contexts {lo}..{hi} (mean {mean:.0f}), block 16, pool "
             f"{format_bytes(cache.nbytes)} per layer")
    says(CH, f"one decode step of 64 sequences (contexts {lo}–{hi}, mean {mean:.0f})")
    says(CH, f"64 sequences, mean context {mean:.0f}")
    # the timings are one run's; the ratios and rates the chapter derives from them are arithmetic
    t = re.search(r"batched ([\d.]+) ms, looped over sequences ([\d.]+) ms \(([\d.]+)x\)", chapter(CH))
    assert f"{float(t[2]) / float(t[1]):.1f}" == t[3]
    says(CH, f"**{t[1]} ms batched vs {float(t[2]):.1f} ms** looping over the sequences ({t[3]}×) in the run above")
    ratios = re.search(r"looped took (.*?)× the batched time \(median ([\d.]+)×\)", chapter(CH))
    runs = [float(r) for r in re.findall(r"[\d.]+", ratios[1])]
    assert len(runs) == 6 and t[3] in ratios[1] and f"{statistics.median(runs):.1f}" == ratios[2]
    rates = re.findall(r"batched (\d+) ms = (\d+) tokens/s, looped (\d+) ms = (\d+) tokens/s", chapter(CH))
    assert len(rates) == 1
    for ms, rate in (rates[0][:2], rates[0][2:]):
        assert round(64 / (int(ms) / 1000)) == int(rate), (ms, rate)
        says(CH, f"{int(ms):,}")


def test_bench_paged_kv_part_4_a_memory_cap():
    num_blocks = num_blocks_for_budget(SMOL, 64 * 2**20, 16)
    says(CH, f"4. a fixed memory cap: 64 MiB of KV = {num_blocks} blocks of 16 ({num_blocks * 16} tokens); 32 requests "
             f"at once, prompts 32-128, outputs 32-128")
    workload = make_workload(32, (32, 128), (32, 128), 0, SMOL.vocab_size)
    tiny = tiny_llama()  # the scheduling is the point: ids folded into the tiny vocabulary, every output forced
    with torch.inference_mode():
        stats = under_memory_cap(tiny, num_blocks, 16, [([t % 256 for t in p], n) for p, n in workload])
    paged, reserved = stats["paged"], stats["reserve prompt+max_tokens"]
    for name, x in stats.items():  # the command's seconds are the run's own; tokens / seconds is the printed rate
        row = re.search(re.escape(name) + r" +(\d+) +([\d.]+) +(\d+) +(\d+) +([\d.]+) +([\d.]+)", chapter(CH))
        assert row.groups()[:4] == (str(x["peak_running"]), f"{x['mean_running']:.1f}", str(x["preemptions"]), str(x["steps"])), name
        x["rate"] = float(row[6])
        assert f"{x['output_tokens'] / float(row[5]):.1f}" == row[6], name
    ratio, speed = paged["mean_running"] / reserved["mean_running"], paged["rate"] / reserved["rate"]
    says(CH, f"paged / reserving: {ratio:.2f}x the requests running (mean), {speed:.2f}x the output tokens/s")
    says(CH, f"still runs **{reserved['mean_running']:.1f} requests at a time on average (peak {reserved['peak_running']}) "
             f"against paging's {paged['mean_running']:.1f} (peak {paged['peak_running']}): {ratio:.2f}× the requests "
             f"and {speed:.2f}× the output tokens/s**. Paging pays for it with **{paged['preemptions']} preemptions**")
    assert reserved["preemptions"] == 0  # "reserving never preempts"
    assert paged["output_tokens"] == reserved["output_tokens"]  # "the same output tokens"
    says(CH, f"the same output tokens in **{paged['steps']} steps instead of {reserved['steps']}**, "
             f"{reserved['steps'] / paged['steps']:.2f}× fewer")
    says(CH, f"its `max_len` of 2048 positions, {2048 // 16} blocks — and would not fit a single request in this pool")
    assert 2048 // 16 > num_blocks


def test_the_notebook_differences_are_under_1e_4():
    diffs = [float(x) for x in re.findall(r"max \|logits paged - alone\| = ([\d.e+-]+)", notebook_output(CH))]
    assert len(diffs) == 6 and max(diffs) < 1e-4
    says(CH, "the notebook prints differences under 1e-4")
