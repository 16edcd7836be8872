"""Chapter 04's worked examples, computed by the code: the cache's bytes, the KV table, the memory plan and the
reservation waste are built here from nanoserve/kv/naive.py, nanoserve/memory.py and `bench kv-cache`'s request
mix, and must appear in the chapter word for word; the figures it quotes from the notebook must be what the
committed notebook printed. The measured figures cannot come from the code: section 4's must be chapter 06's
and chapter 09's profiles, section 6's table must agree with its own speed-ups and shares and with the README's
ledger."""

import argparse
import re

import pytest

from nanoserve.bench.kv_cache import register, request_lengths, reservation_waste
from nanoserve.generate import check_prompt_fits
from nanoserve.cli import main
from nanoserve.kv.naive import NaiveKVCache
from nanoserve.memory import GiB, activation_bytes, format_bytes, kv_bytes_per_token, memory_plan, parameter_counts
from nanoserve.model import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS
from nanoserve.model.layers import SWAP_AB_MAX_TOKENS
from nanoserve.text.tokenizer import Tokenizer
from tests.chapter_text import ROOT, chapter, notebook_output, says, table_rows

CH = "04"
SMOL = LlamaConfig()
MIB = 2**20


def test_the_cache_layout_bytes():
    cache = NaiveKVCache(SMOL, max_len=2048)
    c = SMOL
    says(CH, f"{c.num_hidden_layers} · 2 · 2048 · {c.num_key_value_heads} · {c.head_dim} · 4 B = {cache.nbytes:,} B = "
             f"{cache.nbytes // MIB} MiB")
    assert cache.nbytes % MIB == 0
    says(CH, f"SmolLM2's {c.num_attention_heads} query heads share {c.num_key_value_heads} K/V heads")


def test_the_bill_without_a_cache():
    P, n = 256, 32
    says(CH, f"{n * P + n * (n - 1) // 2:,} of them for {n} tokens after a {P}-token prompt")


def test_the_shapes_row_is_what_the_notebook_printed():
    tok = Tokenizer.from_gguf()
    P = len(tok.encode_chat([{"role": "user", "content": "What is a KV cache, in one sentence?"}]))  # notebook cell 5
    H, Hkv, D = SMOL.num_attention_heads, SMOL.num_key_value_heads, SMOL.head_dim
    says(CH, f"| shapes at layer 0 (SmolLM2, {P}-token prompt) | q `({P}, {H}, {D})`, k/v `({P}, {Hkv}, {D})` | "
             f"q `(1, {H}, {D})`, k/v `(1, {Hkv}, {D})`, {P + 1} keys |")
    out = notebook_output(CH)
    assert f"layer 0: q ({P}, {H}, {D}), k/v ({P}, {Hkv}, {D}) -> attends to {P} cached keys" in out
    assert f"layer 0: q (1, {H}, {D}), k/v (1, {Hkv}, {D}) -> attends to {P + 1} cached keys" in out
    diff = float(out.split("cache vs recompute: max |diff| =")[1].split()[0])
    says(CH, f"SmolLM2 measures about {diff:.0e}".replace("e-0", "e-"))


@pytest.mark.parametrize("row", table_rows(CH, r"SmolLM2-135M|Llama-3-8B|Mistral-7B|Qwen2\.5-7B|Llama-3-70B"))
def test_the_kv_table(row):
    name, shape, fp32, bf16, sequence = row
    config = KNOWN_CONFIGS[name.lower()]
    L, Hkv, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    assert shape == f"{L} × {Hkv} × {D}"
    for cell, dtype in ((fp32, "fp32"), (bf16, "bf16")):  # "262,144 B", or "2·32·8·128·2 = **131,072 B** (128 KiB)"
        if " = " in cell:
            assert cell.split(" = ")[0] == f"2·{L}·{Hkv}·{D}·{4 if dtype == 'fp32' else 2}"
        assert cell.replace("*", "").split(" (")[0].split(" = ")[-1] == f"{kv_bytes_per_token(config, dtype):,.0f} B"
    seq = kv_bytes_per_token(config, "bf16") * 4096
    assert sequence == (f"{seq / MIB:.0f} MiB" if seq < GiB else f"{seq / GiB:g} GiB")
    if seq >= GiB:  # the exact size, then what the CLI's one decimal makes of it
        says(CH, f"{name}'s {sequence} is {seq:,} B, which the `memory` command and the notebook print to one "
                 f"decimal, as {format_bytes(seq)}.")


def test_the_kv_table_has_every_model_and_the_ratios():
    assert len(table_rows(CH, r"SmolLM2-135M|Llama-3-8B|Mistral-7B|Qwen2\.5-7B|Llama-3-70B")) == 5
    small, big = KNOWN_CONFIGS["llama-3-8b"], KNOWN_CONFIGS["llama-3-70b"]
    params = parameter_counts(big)["total"] / parameter_counts(small)["total"]
    kv = kv_bytes_per_token(big) / kv_bytes_per_token(small)
    says(CH, f"Llama-3-70B has {params:.0f}× the parameters of Llama-3-8B and only {kv:g}× the KV per token")
    qwen = KNOWN_CONFIGS["qwen2.5-7b"]
    # "less than half": half from the K/V heads, the rest from the layers
    assert kv_bytes_per_token(qwen) / kv_bytes_per_token(small) == \
        (qwen.num_key_value_heads / small.num_key_value_heads) * (qwen.num_hidden_layers / small.num_hidden_layers)
    says(CH, f"it has {qwen.num_key_value_heads} K/V heads instead of {small.num_key_value_heads} (and "
             f"{qwen.num_hidden_layers} layers instead of {small.num_hidden_layers})")


def test_the_memory_command_output_is_quoted_as_printed(capsys):
    args = ["memory", "--model", "llama-3-8b", "--device-gb", "80", "--seq-len", "4096", "--dtype", "bf16"]
    assert main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    body = printed[printed.index("KV cache"):printed.index("tokens in the KV cache at once: 462,848") + 1]
    says(CH, "$ .venv/bin/python -m nanoserve memory " + " ".join(args[1:]) + " " + " ".join(body))
    plan = memory_plan(KNOWN_CONFIGS["llama-3-8b"], 80 * GiB, 4096)
    says(CH, f"it is the right size: {format_bytes(plan.activations).replace('.0 ', ' ')} for Llama-3-8B at 4096 "
             f"tokens, next to {plan.weights / GiB:.0f} GiB of weights")
    says(CH, f"{plan.kv_budget / GiB:.1f} GiB of cache next to {plan.weights / GiB:.0f} GiB of weights")


def test_the_smollm2_and_70b_plans():
    smol = memory_plan(SMOL, 80 * GiB, 4096)
    says(CH, f"answers **{smol.num_sequences}** sequences: {smol.kv_per_sequence / MIB:.0f} MiB each, with only "
             f"{smol.weights / MIB:.0f} MiB of weights and {smol.activations / MIB:.0f} MiB of activations")
    big = memory_plan(KNOWN_CONFIGS["llama-3-70b"], 80 * GiB, 4096)
    assert big.num_sequences == 0
    says(CH, f"({big.weights / GiB:.1f} GiB of weights; the command says so)")


def test_mistrals_sliding_window_beside_the_full_plan(capsys):
    args = ["memory", "--model", "mistral-7b", "--seq-len", "32768", "--dtype", "bf16"]
    main(args)
    out = capsys.readouterr().out
    full = memory_plan(KNOWN_CONFIGS["mistral-7b"], 80 * GiB, 32768)
    window = 4096 * kv_bytes_per_token(KNOWN_CONFIGS["mistral-7b"])
    per_window, fit = format_bytes(window), int(full.kv_budget // window)  # 512.0 MiB, 109
    assert f"({per_window}) per sequence, {fit} sequences" in out
    says(CH, f"`.venv/bin/python -m nanoserve memory {' '.join(args[1:])}` plans "
             f"{format_bytes(full.kv_per_sequence)} and {full.num_sequences} sequences, where a window-only cache "
             f"would hold {per_window} per sequence and {fit} sequences")


def test_the_reservation_waste(capsys):
    prompt, output = request_lengths(1000, 2048, seed=0)
    used = prompt + output
    per_token = kv_bytes_per_token(SMOL, "fp32")
    says(CH, f"tokens used: mean {used.float().mean():.0f}, median {used.median():.0f}, max {used.max()}")
    says(CH, f"KV reserved {format_bytes(1000 * 2048 * per_token)}, used {format_bytes(used.sum().item() * per_token)}")
    waste = reservation_waste(used, 2048)
    says(CH, f"waste = 1 - used / reserved = {waste:.1%}")
    says(CH, "After its table, `.venv/bin/python -m nanoserve bench kv-cache` counts this waste")
    says(CH, f"**{waste:.1%} of the reserved cache is never used.**")
    # the same device as section 5, Llama-3-8B, planned for 2048-token requests: the command the text names
    args = ["memory", "--model", "llama-3-8b", "--device-gb", "80", "--seq-len", "2048", "--dtype", "bf16"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    plan, mean = memory_plan(KNOWN_CONFIGS["llama-3-8b"], 80 * GiB, 2048), round(used.float().mean().item())
    assert f"left for the KV cache {plan.kv_budget:,.0f} B" in " ".join(printed.split())
    assert f"concurrent sequences of 2048 tokens: {plan.num_sequences} " in printed
    at_mean = int(plan.kv_budget // (mean * plan.kv_per_token))
    says(CH, f"`.venv/bin/python -m nanoserve memory {' '.join(args[1:])}` leaves Llama-3-8B "
             f"{plan.kv_budget / GiB:.1f} GiB for its cache (the activations now sized for a 2048-token prefill): "
             f"{plan.num_sequences} requests at 2048 reserved tokens ({plan.kv_per_sequence / MIB:.0f} MiB) each. Were "
             f"each request to hold only the {mean} tokens it uses on average, the same bytes would hold about "
             f"{at_mean} — the same device, {at_mean / plan.num_sequences:.1f} times the batch")


def test_a_prompt_that_leaves_no_room_for_one_token_is_refused():
    context = SMOL.max_position_embeddings
    check_prompt_fits(context - 1, context)  # one token's room: taken
    with pytest.raises(ValueError) as refused:
        check_prompt_fits(context, context)
    says(CH, f"a prompt of exactly {context} tokens too: `{refused.value}`")


def test_the_score_matrix_of_a_prefill():
    H, T = SMOL.num_attention_heads, 4096
    scores, kv = H * T * T * 4, kv_bytes_per_token(SMOL, "fp32") * T
    says(CH, f"{H} × {T} × {T} × 4 B = {scores // MIB} MiB per layer for a {T}-token prefill of SmolLM2 — "
             f"{['', 'once', 'twice', 'three times'][round(scores / kv)]} the {kv / MIB:.0f} MiB of its whole fp32 KV cache")
    assert activation_bytes(SMOL, T) < scores  # the fused kernel's estimate never stores them


def test_the_repeat_kv_copy_of_a_decode_step():
    """Chapter 01's attention copies the cache's 3 K/V heads to 9 at every decode step: repeat_kv is a new tensor,
    not a view of the cache — nor of a contiguous source: the copy does not come from the layout — and its bytes
    are what the text computes."""
    from nanoserve.model.attention import repeat_kv

    H, Hkv, D, L, S = SMOL.num_attention_heads, SMOL.num_key_value_heads, SMOL.head_dim, SMOL.num_hidden_layers, 1024
    cache = NaiveKVCache(SMOL, max_len=S)
    keys = cache.kv[0, 0, :S].transpose(0, 1)[None]  # (1, Hkv, S, D): what the cache hands the attention
    copy = repeat_kv(keys, H // Hkv)
    assert copy.shape == (1, H, S, D)
    assert copy.untyped_storage().data_ptr() != cache.kv.untyped_storage().data_ptr()  # materialised, not a view
    contiguous = keys.contiguous()  # a head-major source would not avoid it
    assert repeat_kv(contiguous, H // Hkv).untyped_storage().data_ptr() != contiguous.untyped_storage().data_ptr()
    per_layer = 2 * copy.numel() * copy.element_size()  # K and V
    weights = parameter_counts(SMOL)["total"] * 4
    says(CH, f"2 × {H} × {S} × {D} × 4 B = {per_layer / MIB:.1f} MiB per layer, {L * per_layer / MIB:.0f} MiB per "
             f"step, written and then read again — next to the {weights / MIB:.0f} MiB of fp32 weights")


def test_the_profile_quoted_in_section_4_is_chapter_06s():
    """Section 4 quotes chapter 06's `bench profile` run: its figures must be that block's, and the arithmetic
    between them (69 % of 62.4 ms, 78.4 / 62.4) must hold; its ridges and serve's q4 step are chapter 09's."""
    text = chapter("06")
    command = "bench profile --batch-sizes 1 4 16 --prompt-len 128 --threads 1"
    block = text[text.index("$ .venv/bin/python -m nanoserve " + command):]
    bandwidth, ridge = re.search(r"read bandwidth ([\d.]+) GB/s, .* \(ridge at ([\d.]+) FLOP/byte\)", block).groups()
    one = re.search(r"decode B=1 ([\d.]+) (\d+)% \d+% \d+% (\d+)% \d+% \d+% ([\d.]+) /", block).groups()
    step, linear, small_ops, reads = float(one[0]), int(one[1]), int(one[2]), one[3]
    four = float(re.search(r"decode B=4 ([\d.]+) ", block).group(1))
    says(CH, f"one run of `.venv/bin/python -m nanoserve {command}`")
    says(CH, f"at {reads} ms, at the {bandwidth} GB/s it measured, and the decode step of one sequence at {step} ms. "
             f"The linear layers took {linear} % of that step, about {round(linear / 100 * step)} ms")
    says(CH, f"took {small_ops} %")
    says(CH, f"a decode step of 4 sequences took {four} ms, {four / step:.2f}× the step of one")
    says(CH, f"whose ridge chapter 06's profile (quoted next) measures at {ridge},")
    # chapter 09's run of the same profile on the same VM measured another ridge: its bandwidth and peak give it
    bw9, peak9, ridge9 = re.search(r"on Zen 4 the same command measured ([\d.]+) GB/s and ([\d.]+) GFLOP/s .*?a ridge "
                                   r"at ([\d.]+) FLOP/byte", chapter("09")).groups()
    assert f"{float(peak9) / float(bw9):.1f}" == ridge9
    says(CH, f"and chapter 09's run of `bench profile` (section 5, under more load) at {ridge9}")
    # serve's q4 step, which chapter 09 profiles with the native decode step
    threads, ms = re.search(r"--threads (\d+) --weights q4 --kv-cache-dtype bf16`, one run, load [\d.]+\): ([\d.]+) ms "
                            r"a batch-1 decode step", chapter("09")).groups()
    threads = {"1": "one thread", "2": "two threads"}[threads]
    says(CH, f"measures the engine's batch-1 decode step at {ms} ms ({threads}, one run")
    # a prefill does 2·P flops per weight: P/2 flops a byte in fp32, P in bf16; arithmetic-bound past the ridge
    says(CH, f"from about {2 * float(ridge):.0f}–{2 * float(ridge9):.0f} tokens on, and the table's 41-token prompt is "
             f"well past it")
    # the machines by chapter 09's names: chapter 06's float32 runs were on the Zen 4 VM; chapter 09's profile, on
    # the AMX machine, measured another ridge
    assert " ".join(text.split()).count('were made on 2026-12-03 on a 2-core AMD EPYC recorded then as "AVX-512, no '
                                     'AMX", which among the three is the Zen 4 VM') == 1
    nine = chapter("09")
    assert "| Zen 4 (other chapters: the Zen 4 VM) | AMD EPYC, AVX-512 BF16 and VNNI, no AMX |" in nine
    assert "| the AMX machine | Intel Xeon with AMX" in nine
    says(CH, "on the course's Zen 4 VM (a 2-core AMD EPYC, AVX-512, no AMX), whose ridge chapter 06's profile")
    amx_ridge = re.search(r"on the AMX machine .*?\(ridge at ([\d.]+) FLOP/byte\)", nine).group(1)
    says(CH, f"on the AMX machine, whose ridge chapter 09's profile (section 5) measures at {amx_ridge}, from about "
             f"{2 * float(amx_ridge):.0f} tokens")
    flops, bandwidth = 989, 3.35  # H100 SXM datasheet, as chapter 11 quotes it
    assert f"HBM {bandwidth} TB/s, {flops} TFLOP/s bf16" in chapter("11")
    says(CH, f"({flops} TFLOP/s bf16, {bandwidth} TB/s) puts its ridge near {flops / bandwidth:.0f}, so there a "
             f"prompt shorter than a few hundred tokens is memory-bound too")


def test_the_cache_benchmark_table_and_what_follows_from_it():
    """Section 6's table is measured, once (its command and load are named); its speed-ups, attention shares and the
    line through its attention column are arithmetic on its own cells, and the README's ledger repeats its rows."""
    rows = {int(r[0]): r[1:] for r in table_rows(CH, r"64|256|512")}
    assert sorted(rows) == [64, 256, 512]
    def span(cell: str) -> tuple[float, float]:
        """The values a printed figure stands for: "0.54" is 0.535 .. 0.545 (the command divides unrounded rates)."""
        half = 0.5 * 10 ** -len(cell.partition(".")[2])
        return float(cell) - half, float(cell) + half

    attention = {}
    for context, (no_cache, cache, speed_up, attn) in rows.items():
        (slow_lo, slow_hi), (fast_lo, fast_hi) = span(no_cache.split()[0]), span(cache.split()[0])
        lo, hi = span(speed_up.removesuffix("×"))
        assert fast_lo / slow_hi <= hi and lo <= fast_hi / slow_lo, (context, speed_up)  # cache ÷ no cache
        ms, share = re.fullmatch(r"([\d.]+) ms \((\d+)%(?: of the step)?\)", attn).groups()
        (ms_lo, ms_hi), (lo, hi) = span(ms), span(share)
        assert ms_lo * fast_lo / 10 <= hi and lo <= ms_hi * fast_hi / 10, (context, attn)  # ms × steps/s, in %
        attention[context] = float(ms)
        (slow, slow_worst), (fast, fast_worst) = (map(float, re.fullmatch(r"([\d.]+) \(([\d.]+)\)", cell).groups())
                                                  for cell in (no_cache, cache))
        assert slow / slow_worst <= 1.1 and fast / fast_worst <= 1.1, context  # "agree within 10 %"
        assert fast_worst > slow, context  # "even the cache's worst round beats the best round without it"
    says(CH, "A path's two rounds agree within 10 %.")
    says(CH, "even the cache's worst round beats the best round without it")
    # the timed steps of a row attend context + 1 .. context + steps keys (the prefill leaves `context` cached)
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    steps = sub.choices["kv-cache"].get_default("cache_tokens")
    keys = {context: context + (steps + 1) / 2 for context in (64, 512)}  # the mean over a row's steps
    says(CH, f"A row's {steps} timed steps attend `context + 1` … `context + {steps}` keys, on average {keys[64]} in "
             f"the 64-token row and {keys[512]} in the 512-token row")
    slope = (attention[512] - attention[64]) / (keys[512] - keys[64])
    fixed = attention[64] - keys[64] * slope
    says(CH, f"a fixed part of about {fixed:.2f} ms a step plus about {slope:.3f} ms per cached "
             f"key (({attention[512]} − {attention[64]}) / {keys[512] - keys[64]:.0f})")
    assert fixed > keys[64] * slope and keys[512] * slope > fixed  # the fixed part most at 64, the per-key at 512
    says(CH, f"most of it ({fixed:.2f} of {attention[64]} ms); at 512 the per-key part is most of it "
             f"({keys[512] * slope:.2f} of {attention[512]} ms); the two are equal at about "
             f"{round(fixed / slope, -1):.0f} keys")
    added = attention[512] - attention[256]
    says(CH, f"From 256 to 512 tokens that is {added:.1f} ms more a step")
    best, worst = map(float, re.fullmatch(r"([\d.]+) \(([\d.]+)\)", rows[512][1]).groups())
    assert 1000 / worst - 1000 / best > added  # the extra attention is less than the row's spread of step times
    says(CH, f"less than the spread of the 512-token row's own rounds ({1000 / best:.1f} to {1000 / worst:.1f} ms a "
             f"step), so the table's best cached rate can stay at {rows[256][1].split()[0]} tokens/s there")
    assert rows[256][1].split()[0] == rows[512][1].split()[0]
    share = {context: rows[context][3].split("(")[1].split("%")[0] for context in rows}
    says(CH, f"from {attention[64]} ms, {share[64]} % of the step, at 64 tokens to {attention[512]} ms, {share[512]} %, "
             f"at 512")
    ledger = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| 04 | decode with the KV cache"))
    fast512, slow512 = rows[512][1].split()[0], rows[512][0].split()[0]
    assert f"{fast512} tokens/s (attention over the cache: {share[512]} % of a step)" in ledger
    assert f"without a cache: {slow512} tokens/s → **{rows[512][2]}** (64 tokens: {rows[64][2]}, 256: {rows[256][2]})" \
        in ledger
    assert "`.venv/bin/python -m nanoserve bench kv-cache --contexts 64 256 512 --rounds 2 --threads 1`" in ledger
    says(CH, "`.venv/bin/python -m nanoserve bench kv-cache --contexts 64 256 512 --rounds 2 --threads 1`")
    # measured before the swap-AB limit went from 64 to 4 tokens: a timed pass is 1 token (cached, swapped under
    # either limit) or at least the smallest context + 1 (uncached, F.linear under either), so the table stands
    assert 1 <= SWAP_AB_MAX_TOKENS <= 64 < min(rows) + 1
    says(CH, f"a cached step is a 1-token pass, chapter 02's swapped products under either limit, and an uncached one "
             f"is {min(rows) + 1} tokens or more, `F.linear` under either")
    assert f"which touches none of its timed passes (1 token cached, {min(rows) + 1} or more uncached)" in ledger
