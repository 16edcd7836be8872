"""Chapter 18's worked examples, computed by the code: the load-or-recompute crossover (load_policy.should_load), the
line fitted through the measured crossover table (rates.LineFit, as the engine fits its rates), the capacity table
per KV dtype (chapter 04's formula and quantized_block_bytes), float8's steps and the returning-users pool are built
here from nanoserve/ and must appear in the chapter word for word; the error ratios are recomputed from the error
table, and the notebook's tier walk-through must be what the committed notebook printed."""

import re

import torch

from nanoserve.kv.load_policy import should_load
from nanoserve.kv.quantized_pool import quantized_block_bytes
from nanoserve.kv.rates import LineFit
from nanoserve.memory import GiB, kv_bytes_per_token
from nanoserve.model import LlamaConfig
from tests.chapter_text import chapter, notebook_output, says, table_rows

CH = "18"
SMOL = LlamaConfig()
PER_TOKEN = kv_bytes_per_token(SMOL, "fp32")


def test_load_or_recompute():
    prefill, latency = 0.5e-3, 1e-3
    fast, slow = 1e9, 50e6
    per_token = PER_TOKEN / fast
    crossover = latency / (prefill - per_token)
    n = int(crossover)
    assert not should_load(n, PER_TOKEN, prefill, fast, latency) and should_load(n + 1, PER_TOKEN, prefill, fast, latency)
    says(CH, f"SmolLM2 in float32 keeps {PER_TOKEN:,} bytes per token. With a prefill of 0.5 ms per token and a 1 ms\n"
             f"latency, a 1 GB/s tier loads a token in {per_token * 1e3:.3f} ms: n* = 1 / (0.5 − {per_token * 1e3:.3f}) ≈ "
             f"{crossover:.1f} tokens. A 50 MB/s tier ({PER_TOKEN / slow * 1e3:.2f} ms\nper token) never beats recompute")
    assert not any(should_load(k, PER_TOKEN, prefill, slow, latency) for k in (1, 10, 1000, 10**6))


def test_the_measured_crossover():
    rows = [[float(c.replace(",", "").split()[0]) for c in r] for r in table_rows(CH, r"16|64|256|1024") if len(r) == 3]
    assert [int(r[0]) for r in rows] == [16, 64, 256, 1024]
    prefill, load = LineFit(), LineFit()
    for n, recompute_ms, load_ms in rows:
        prefill.add(n, recompute_ms / 1000)
        load.add(n * PER_TOKEN, load_ms / 1000)
    s_per_token, (latency, s_per_byte) = prefill.fit()[1], load.fit()
    assert latency <= 0  # "no measurable fixed latency": the fitted intercept is not positive
    says(CH, f"Fitted from that one round: recompute {s_per_token * 1e3:.0f} ms per token; load {1 / s_per_byte / 1e6:.0f} "
             f"MB/s ({PER_TOKEN:,} B per token: {PER_TOKEN * s_per_byte * 1e3:.1f} ms per token)")
    says(CH, f"a tier of {PER_TOKEN:,} B / {s_per_token * 1e3:.0f} ms = {PER_TOKEN / s_per_token / 1e6:.1f} MB/s")
    (small, small_ms), (large, large_ms) = [(r[0], r[2]) for r in rows[:2]]
    says(CH, f"the\n{small:.0f}-token load ({small_ms} ms) is {large_ms / small_ms:.0f}x faster than the {large:.0f}-token "
             f"one ({large_ms:.0f} ms) for {large / small:.0f}x the bytes")
    quiet = float(re.search(r"chapter 02's prefill: (\d+) tokens/s", chapter(CH))[1])
    says("02", f"| prefill, 256 tokens | {quiet:.0f} tokens/s")  # chapter 02's quiet run
    says(CH, f"prefill: {quiet:.0f} tokens/s, {1000 / quiet:.0f} ms per token), the crossover bandwidth rises to about "
             f"{PER_TOKEN * quiet / 1e6:.0f} MB/s")
    assert PER_TOKEN * quiet > 1 / s_per_byte  # "above the 17 MB/s load rate measured here"


def test_capacity_per_kv_dtype():
    rows = {r[0]: r for r in table_rows(CH, "fp32|bf16|int8|fp8") if len(r) == 6}
    bf16_blocks = GiB // (16 * kv_bytes_per_token(SMOL, "bf16"))
    for name, row in rows.items():
        formula = 16 * kv_bytes_per_token(SMOL, "int8" if name == "fp8" else name)
        pool = formula if name in ("fp32", "bf16") else quantized_block_bytes(SMOL, 16)
        blocks = int(GiB // pool)
        assert row[1:] == [f"{formula:,.0f}", f"{pool:,.0f}", f"{int(GiB // formula):,}", f"{blocks:,}",
                           str(blocks // (2000 // 16))], name
    eight = GiB // quantized_block_bytes(SMOL, 16)
    says(CH, f"2,000-token sequences ({2000 // 16} blocks each)")
    says(CH, f"The 8-bit pools hold {eight / bf16_blocks:.2f}x bf16's blocks, not 2x: {SMOL.head_dim} codes + a 2-byte "
             f"scale per row is {SMOL.head_dim + 2} bytes where bf16 spends\n{2 * SMOL.head_dim}")
    says(CH, f"the same bytes of pool in int8: {eight / (GiB // (16 * PER_TOKEN)):.1f}x the float32 blocks")


def test_the_error_table():
    rows = {r[0]: [float(x) for x in r[1:3]] for r in table_rows(CH, "fp32|bf16|int8|fp8") if len(r) == 4}
    (bf16_max, bf16_mean), (int8_max, int8_mean), (fp8_max, fp8_mean) = rows["bf16"], rows["int8"], rows["fp8"]
    says(CH, f"int8 costs {int8_mean / bf16_mean:.1f}x bf16's error ({int8_mean} / {bf16_mean})")
    says(CH, f"costs {fp8_mean / int8_mean:.1f}x int8's ({fp8_mean:.4f} / {int8_mean})")
    says(CH, f"(By max |Δlogit| the ratios are\n{int8_max / bf16_max:.1f}x and {fp8_max / int8_max:.1f}x")


def test_float8_steps():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    normal = values[torch.isfinite(values) & (values >= 2**-6)].unique().sort().values
    step = ((normal[1:] - normal[:-1]) / normal[:-1]).max().item()
    says(CH, f"fp8 (three mantissa\nbits: steps of up to 1/{1 / step:.0f} of a value, rounding errors up to 1/{2 / step:.0f})")


def test_returning_users_and_the_notebooks_tier():
    says(CH, f"The pool holds the prompts of `max(num_users // 3, 1)` users ({max(6 // 3, 1)} of 6, {max(8 // 3, 1)} of 8)")
    out = notebook_output(CH)
    visits = re.findall(r"([A-D])1: pool \[.*?\] +tier +\d+/32 slots +hits pool +(\d+) tier +(\d+) tokens", out)
    assert len(visits) == 4 and all(pool == "0" for _, pool, _ in visits)
    found = int(visits[-1][2])  # the tier's hits accumulate over round 2
    users, prompt = 4, 20  # the notebook's four users, 20-token system prompts in blocks of 4
    cacheable = users * (prompt // 4 * 4)
    says(CH, f"four users, a pool of 16 blocks,\nround 2 finds {found} of {cacheable} cacheable prompt tokens in the file "
             f"tier and none in the pool")
