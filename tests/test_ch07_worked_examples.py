"""Chapter 07's worked examples, computed by the code: the grid of a 37-token prompt under the GPU's and the
interpreter's tile sizes (launch_config, query_blocks), the memory math of a decode step, the store kernel's padded
axes and `bench attention`'s programs column are built here from nanoserve/kernels/ and nanoserve/bench/, and must
appear in the chapter word for word. The profile run it quotes must be the one chapter 09 prints, and the estimates
it draws from its timed tables are recomputed from those tables. (Nothing is launched: the kernels' parity is
tests/test_ch07_kernels.py's.)"""

import re
from decimal import ROUND_HALF_UP, Decimal

import torch
import triton

from nanoserve.bench import profile
from nanoserve.bench.attention import INTERPRETER_CASES, PEAK_GBS
from nanoserve.kernels.triton_paged_attention import launch_config, min_dot_k, query_blocks
from nanoserve.kv.paged_attention import AttentionMetadata
from nanoserve.memory import kv_bytes_per_token
from nanoserve.model import LlamaConfig
from tests.chapter_text import chapter, command_defaults, says, word

CH = "07"
SMOL = LlamaConfig()
H, HKV, D = SMOL.num_attention_heads, SMOL.num_key_value_heads, SMOL.head_dim
H200_SMS = 132  # streaming multiprocessors of an H200 (NVIDIA's data sheet)
H200_FP32_TFLOPS = 67  # an H200's float32 peak on its CUDA cores, no tensor cores (NVIDIA's data sheet)


def rounded(x: str) -> str:
    """'196.5' -> '197': a printed figure rounded to a whole number as a reader would (half up)."""
    return str(Decimal(x).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def test_the_profile_run_is_chapter_09s():
    args = command_defaults(profile, "profile")
    says(CH, f"(one thread, float32, {args.prompt_len}-token prompts, then {args.decode_steps} decode steps) was run on "
             "chapter 09's AMX machine, an Intel Xeon with AMX, shared at load 6–12 on 2026-12-01")
    says("09", "One run, 2026-12-01, on the AMX machine (section 4) at load 6–12")
    rows = {}
    for batch in (16, 64):  # chapter 09's printed rows: step ms, then linear, attention, gather/store %
        ms, linear, attention, gather = re.search(rf"decode B={batch} +([\d.]+) +(\d+)% +(\d+)% +(\d+)%", chapter("09")).groups()
        rows[batch] = rounded(ms), linear, attention, gather
    ms, linear, attention, gather = rows[64]
    says(CH, f"times a decode step of 64 sequences at **{ms} ms**: linear layers {linear} %, attention {attention} %, "
             f"and **{gather} % in K/V gather/store**")
    ms, _, attention, gather = rows[16]
    says(CH, f"At 16 sequences the step is {ms} ms, with {attention} % attention and {gather} % gather/store")
    context = args.prompt_len + (args.decode_steps + 1) // 2  # the decode steps' mean context: 129, 130, 131
    per_token = kv_bytes_per_token(SMOL, "fp32")
    says(CH, f"that batch of 64 holds 64 × ~{context} tokens × {per_token:,} bytes per token = "
             f"~{64 * context * per_token / 1e6:.0f} MB of K/V")


def test_the_grid_of_a_37_token_prompt():
    says(CH, f"SmolLM2's {H} query heads share {HKV} kv heads (G = {H // HKV} query heads per kv head)")
    gpu, interpreter = launch_config(H, HKV, D, block_m=16), launch_config(H, HKV, D)  # TRITON_INTERPRET=1: tests/conftest.py
    assert gpu["BLOCK_Q"] * gpu["G_PAD"] == 16 and interpreter["BLOCK_Q"] * interpreter["G_PAD"] == 64
    says(CH, f"one row in {word(gpu['G_PAD'])} padding for SmolLM2 (G = {gpu['G']} → G_PAD = {gpu['G_PAD']})")
    blocks = {name: len(query_blocks([0, 37], c["BLOCK_Q"])[0]) for name, c in (("gpu", gpu), ("interpreter", interpreter))}
    says(CH, f"**16 on a GPU** (the tensor cores multiply tiles of 16 rows, and Triton pads a dot with fewer rows up to "
             f"them; a float32 pool's dots run on the CUDA cores instead, section 5), so BLOCK_Q = {gpu['BLOCK_Q']} "
             f"tokens and a 37-token prompt is {blocks['gpu']} query blocks; "
             f"**64 in the interpreter**")
    says(CH, f"so BLOCK_Q = {interpreter['BLOCK_Q']} and the same prompt is {blocks['interpreter']}")
    # the dots' shared axis: the pinned Triton's nvidia minimum (min_dot_k, checked against min_dot_size in
    # test_ch07_kernels.py) and SmolLM2's padded head dim
    says(CH, f"K ≥ {min_dot_k(torch.float16)} for 16-bit inputs, K ≥ {min_dot_k(torch.float32)} for float32 (its "
             f"nvidia backend's `min_dot_size`)")
    says(CH, f"the padded head dim (`D_PAD`, {gpu['D_PAD']} for SmolLM2)")
    assert min_dot_k(torch.float32) > 4  # "the tests use tiles of 4": the interpreter only
    says(CH, f"the K/V traffic of GQA is Hkv/H = 1/{H // HKV} of what multi-head attention would read")


def test_the_memory_math_of_a_decode_step():
    kv = 2 * 64 * 2048 * HKV * D * 2  # K and V, bf16
    says(CH, f"2 × 64 × 2048 × {HKV} heads × {D} × 2 bytes = **{kv / 1e6:.0f} MB per layer**, "
             f"{kv / (PEAK_GBS['H200'] * 1e9) * 1e6:.0f} µs at an H200's {PEAK_GBS['H200'] / 1000:.1f} TB/s")
    says(CH, f"past 2³¹ elements ({2**31 * 2 // 2**30} GiB of bf16 in one pool tensor")
    says(CH, f"The grid of a decode step is batch × Hkv programs: 64 × {HKV} = {64 * HKV} at batch 64 — about "
             f"{64 * HKV / H200_SMS:.1f} per SM on an H200, too few to keep the memory busy. At batch 1 it is {HKV} programs: "
             f"{HKV} of {H200_SMS} SMs")


def test_the_float32_dots_flops_per_byte():
    """Section 5: a float32 pool's "ieee" dots on the CUDA cores, FLOPs per byte of K/V against the H200's ratio."""
    rows = launch_config(H, HKV, D, block_m=16)  # the GPU's tiles
    block_m, d = rows["BLOCK_Q"] * rows["G_PAD"], rows["D_PAD"]
    key_bytes = 2 * d * 4  # its K and V rows, float32
    flops = 2 * (2 * block_m * d)  # q·kᵀ and p·v: block_m × d multiply-adds each, 2 FLOP apiece
    says(CH, f"(its K and V rows, 2 × {d} float32 values = {key_bytes} bytes) meets the program's {block_m} rows in "
             f"both dots: 2 × {block_m} × {d} multiply-adds, **{flops // key_bytes} FLOP per byte**")
    ridge = H200_FP32_TFLOPS * 1e12 / (PEAK_GBS["H200"] * 1e9)
    says(CH, f"gives its CUDA cores {H200_FP32_TFLOPS} TFLOP/s of float32 against {PEAK_GBS['H200'] / 1000:.1f} TB/s, "
             f"{ridge:.0f} FLOP per byte")
    assert flops / key_bytes < ridge


def test_the_store_kernels_padded_axes():
    assert HKV * D & (HKV * D - 1)  # not a power of two
    says(CH, f"SmolLM2's Hkv · D = {HKV * D} values per token is not a power of two, so heads and dims are two axes "
             f"({HKV} heads padded to {triton.next_power_of_2(HKV)}, masked)")  # store_kv's H_PAD


def test_bench_attention_programs_and_the_interpreters_cost():
    text = chapter(CH)
    per_program = []
    for name, (hkv, g, d, bs), seq_lens, query_lens in INTERPRETER_CASES:
        meta = AttentionMetadata.build([[0] * -(-s // bs) for s in seq_lens], seq_lens, query_lens, bs)
        programs = len(query_blocks(meta.cu_seqlens_q.tolist(), launch_config(hkv * g, hkv, d)["BLOCK_Q"])[0]) * hkv
        row = re.search(re.escape(name) + r" +(\d+) +([\d.]+) +([\d.]+) +[\d.e-]+", text)
        assert row and int(row[1]) == programs, name
        per_program.append((float(row[2]), programs))
    # round 2's attention column, in the table's order, in the sentence after it
    second = [float(x) for x in re.search(r"A second round right after gave ([\d.]+), ([\d.]+), ([\d.]+) and ([\d.]+) s",
                                          text).groups()]
    ms = [1000 * seconds / programs for (first, programs), again in zip(per_program, second) for seconds in (first, again)]
    says(CH, f"the attention column is {min(ms):.0f}–{max(ms):.0f} ms per program (seconds ÷ programs)")
    # served: the prefill in each of the 30 layers, then 3 decode steps, at each round's times
    layers = SMOL.num_hidden_layers
    (decode, _), (prefill, _) = per_program[2:]
    served = [layers * p + 3 * layers * d for p, d in ((prefill, decode), (second[3], second[2]))]
    says(CH, f"{layers} × {prefill:.2f} s + {3 * layers} × {decode:.2f} s ≈ {served[0]:.0f} s of interpreted attention "
             f"in round 1 (≈ {served[1]:.0f} s in round 2)")


def gpu_row(text: str, batch: int, context: int) -> dict:
    """One row of section 9's H200 table (the chapter's text, whitespace normalised): MB moved, triton us, GB/s,
    % peak, torch us, sdpa us."""
    row = re.search(rf" {batch} {context} ([\d.]+) \| ([\d.]+) (\d+) ([\d.]+)% \| ([\d.]+) ([\d.]+) \|", text)
    assert row, (batch, context)
    return dict(zip(("mb", "triton", "gbs", "pct", "torch", "sdpa"), map(float, row.groups())))


def test_the_gpu_runs_aim_and_its_miss():
    """Section 9: the figures drawn from the H200 table, recomputed from its rows."""
    text = chapter(CH)
    peak = PEAK_GBS["H200"]
    for batch in (1, 4, 16, 64, 256):
        for context in (128, 512, 2048, 8192):  # every row's GB/s and % peak follow from its bytes and time
            r = gpu_row(text, batch, context)
            printed = r["gbs"] * (0.05 / r["mb"] + 0.05 / r["triton"]) + 0.5  # MB and us printed to 0.1, GB/s to 1
            assert abs(r["mb"] / r["triton"] * 1000 - r["gbs"]) <= printed, (batch, context)
            assert abs(r["gbs"] / peak * 100 - r["pct"]) <= 0.06, (batch, context)
    r = gpu_row(text, 64, 2048)
    aim_us = r["mb"] * 1e6 / (0.70 * peak * 1e9) * 1e6
    says(CH, f"It moves {r['mb']} MB in\n  {r['triton']} µs: {r['gbs']:.0f} GB/s, **{r['pct']} % of the peak**, "
             f"{70 - r['pct']:.1f} points short. At 70 % the same bytes would take {aim_us:.1f} µs, so the\n  kernel is "
             f"**{r['triton'] / aim_us:.1f}× too slow** there. SDPA on contiguous K/V takes {r['sdpa']} µs "
             f"({r['mb'] / r['sdpa'] * 1000 / peak * 100:.0f} %); chapter 05's torch path takes\n  {r['torch']} µs, "
             f"{r['torch'] / r['triton']:.0f}× the kernel.")
    fp32 = re.search(r"`--dtype fp32` gave ([\d.]+) µs", text)
    says(CH, f"It moves twice fp16's bytes and takes {float(fp32[1]) / r['triton']:.1f} times as long "
             f"({fp32[1]} against\n  {r['triton']} µs)")
    same_bytes = [gpu_row(text, b, c) for b, c in ((16, 8192), (64, 2048), (256, 512))]
    assert all(abs(x["mb"] - 101) < 1 for x in same_bytes) and [x["triton"] for x in same_bytes] == sorted(
        [x["triton"] for x in same_bytes], reverse=True)  # the same bytes, faster with more programs
