"""Chapter 18's worked examples, computed by the code: the load-or-recompute crossover (load_policy.should_load), the
line fitted through the measured crossover table (rates.LineFit, as the engine fits its rates), the capacity table
per KV dtype (chapter 04's formula and quantized_block_bytes), float8's steps and the returning-users pool are built
here from nanoserve/ and must appear in the chapter word for word; the error ratios are recomputed from the error
table, the notebook's tier walk-through must be what the committed notebook printed, and the swap experiment's
counts are run on the tiny model."""

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
    """The measured table's fit (as the engine fits its rates) and its crossover bandwidth, one run's figures only;
    B* = bytes_per_token / prefill_s_per_token is where should_load turns, at every length."""
    rows = [[float(c.replace(",", "").split()[0]) for c in r] for r in table_rows(CH, r"16|64|256|1024") if len(r) == 3]
    assert [int(r[0]) for r in rows] == [16, 64, 256, 1024]
    prefill, load = LineFit(), LineFit()
    for n, recompute_ms, load_ms in rows:
        prefill.add(n, recompute_ms / 1000)
        load.add(n * PER_TOKEN, load_ms / 1000)
    s_per_token, (latency, s_per_byte) = prefill.fit()[1], load.fit()
    says(CH, f"Fitted from that one run: recompute {s_per_token * 1e3:.2f} ms per token; load {1 / s_per_byte / 1e6:.0f} "
             f"MB/s ({PER_TOKEN:,} B per token: {PER_TOKEN * s_per_byte * 1e3:.3f} ms per token) after\na fixed latency "
             f"of {latency * 1e3:.2f} ms")
    crossover = PER_TOKEN / s_per_token
    says(CH, f"a tier of {PER_TOKEN:,} B / {s_per_token * 1e3:.2f} ms = {crossover / 1e6:.1f} MB/s, "
             f"{1 / (crossover * s_per_byte):.0f}x below the load rate")  # 1 / s_per_byte: the load rate
    for n in (1, 16, 1024, 10**6):  # B* is where the decision turns, whatever the length (without latency)
        assert not should_load(n, PER_TOKEN, s_per_token, crossover * 0.99)
        assert should_load(n, PER_TOKEN, s_per_token, crossover * 1.01)
    # "loading won at every length measured": in the table itself, and by the decision on the run's fitted rates
    assert all(load_ms < recompute_ms for _, recompute_ms, load_ms in rows)
    assert all(should_load(int(n), PER_TOKEN, s_per_token, 1 / s_per_byte, max(latency, 0.0)) for n, *_ in rows)
    lone = [recompute_ms / load_ms for _, recompute_ms, load_ms in rows]
    says(CH, f"A lone prefill cost {min(lone):.0f}–{max(lone):.0f}x its\nload ({lone[0]:.0f}x at {rows[0][0]:.0f} tokens")
    added = [n * s_per_token * 1e3 / load_ms for n, _, load_ms in rows]  # only the marginal cost of the tokens
    says(CH, f"rule: {s_per_token * 1e3:.2f} ms per token), {min(added):.0f}–{max(added):.0f}x")


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
    from nanoserve.bench.kv_tiers import RETURNING_PROMPT_LEN

    says(CH, f"The pool holds the prompts of `max(num_users // 3, 1)` users ({max(6 // 3, 1)} of 6, {max(8 // 3, 1)} of 8)")
    users, visits, question, n_out = 8, 3, 8, 8  # the experiment's defaults
    per_visit = -(-(RETURNING_PROMPT_LEN + question + n_out) // 16)  # blocks of 16 a visit fills
    pool = per_visit * max(users // 3, 1)
    int8 = int(pool * 16 * PER_TOKEN // quantized_block_bytes(SMOL, 16))  # the same bytes in int8 blocks
    says(CH, f"{max(users // 3, 1)} · {per_visit} = {pool} float32 blocks of 16")
    says(CH, f"3.9x\nthe float32 blocks, {int8} — still short of the {users} · {per_visit} = {users * per_visit}")
    rows = {r[0]: r for r in table_rows(CH, "no tier|file tier|int8 pool") if len(r) == 5}
    assert [rows[name][1] for name in ("no tier", "file tier", "int8 pool")] == [str(pool), str(pool), str(int8)]
    looked_up, returning = users * visits * (RETURNING_PROMPT_LEN + question), users * (visits - 1)
    # the file tier: every returning visit's whole system prompt; the int8 pool: 9 of its 12 blocks
    # (test_returning_users_find_what_the_chapter_counts replays the visits)
    for name, pool_share, tier_share in (("file tier", 0, returning * RETURNING_PROMPT_LEN / looked_up),
                                         ("int8 pool", returning * 144 / looked_up, 0)):
        assert rows[name][2] == f"{pool_share:.1%} / {tier_share:.1%}".replace("%", " %"), name
    says(CH, f"192 of its 200 prompt tokens ({RETURNING_PROMPT_LEN / (RETURNING_PROMPT_LEN + question) * 100:.0f} %")
    says(CH, f"({returning} × 192 of {users * visits} × 200)")
    says(CH, f"({returning} × 144 of {users * visits} × 200)")
    ttft = {name: float(rows[name][3].replace("*", "").split("/")[0]) for name in rows}
    says(CH, f"the TTFT p50 falls {ttft['no tier'] / ttft['file tier']:.1f}×")
    says(CH, f"the TTFT falls {ttft['no tier'] / ttft['int8 pool']:.1f}× without any file")

    out = notebook_output(CH)
    visits_ = re.findall(r"([A-D])1: pool \[.*?\] +tier +\d+/32 slots +hits pool +(\d+) tier +(\d+) tokens "
                         r"\(recomputed (\d+)\)", out)
    assert len(visits_) == 4 and all(pool == "0" and recomputed == "0" for _, pool, _, recomputed in visits_)
    found = int(visits_[-1][2])  # the tier's hits accumulate over round 2
    users, prompt = 4, 20  # the notebook's four users, 20-token system prompts in blocks of 4
    cacheable = users * (prompt // 4 * 4)
    says(CH, f"four users, a pool of 16 blocks,\nround 2 finds {found} of {cacheable} cacheable prompt tokens in the file "
             f"tier and none in the pool")


def test_swap_or_recompute_by_hand():
    """Section 6's FLOPs per token (the matrices a token goes through, from the model's config) and the arithmetic
    of its measured table."""
    c = SMOL
    kv = c.num_key_value_heads * c.head_dim
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    n = c.num_hidden_layers * per_layer
    says(CH, f"{c.num_hidden_layers} · (2 · {c.hidden_size} · {c.hidden_size} + 2 · {c.hidden_size} · {kv} + 3 · "
             f"{c.hidden_size} · {c.intermediate_size:,}) = {n:,}")
    embedding = c.vocab_size * c.hidden_size
    says(CH, f"of its {(n + embedding) / 1e6:.1f} M parameters — the other {embedding / 1e6:.1f} M")
    says(CH, f"recompute:  2 · {n / 1e6:.0f} M = {2 * n / 1e6:.0f} MFLOP")
    says(CH, f"(SmolLM2: {2 * n / 1e6:.0f} MFLOP / {PER_TOKEN:,} B, about {round(2 * n / PER_TOKEN, -2):,.0f} FLOPs per byte)")
    rows = {r[0]: r for r in table_rows(CH, "recompute|swap") if len(r) == 9}
    recomputed, blocks = int(rows["recompute"][2].replace(",", "")), int(rows["swap"][3].split("/")[0])
    says(CH, f"{float(rows['swap'][4]):.1f}\nMB are {blocks} blocks of {16 * PER_TOKEN:,} bytes, written once and read "
             f"once ({blocks * 16 * PER_TOKEN / 1e6:.1f} MB each way)")
    says(CH, f"the {recomputed:,} recomputed\ntokens would have been {recomputed * PER_TOKEN / 1e6:.1f} MB of K/V")
    recompute_tps, swap_tps = (float(rows[m][7].replace("*", "")) for m in ("recompute", "swap"))
    tokens = 24 * 96  # the overload workload's requests x output tokens
    says(CH, f"{swap_tps} output tokens/s against {recompute_tps} is {(swap_tps / recompute_tps - 1) * 100:.1f} % more — "
             f"the 24 × 96 = {tokens:,} output\ntokens in {tokens / swap_tps:.1f} s instead of {tokens / recompute_tps:.1f} s, "
             f"{tokens / recompute_tps - tokens / swap_tps:.1f} s saved")


def test_the_swap_experiments_counts_on_the_tiny_model():
    """Section 6: the counts depend on neither the machine (the scheduler plans by counts, never by the clock) nor the
    model's weights: the experiment's own arrivals (SmolLM2's vocabulary) on the tiny model, one round, give
    the table's preemptions, tokens recomputed, blocks swapped out and swap-ins."""
    from nanoserve.bench.experiment import OVERLOAD_BLOCKS, overload_arrivals
    from nanoserve.bench.kv_tiers import compare_preemption_modes
    from tests.tiny_model import tiny_llama

    arrivals = overload_arrivals(SMOL.vocab_size, 96)  # the command's defaults: 96 output tokens
    best = compare_preemption_modes(tiny_llama(vocab_size=SMOL.vocab_size), arrivals, OVERLOAD_BLOCKS, 16, rounds=1)
    recompute, swap = best["recompute"], best["swap"]
    assert swap["swap_fallbacks"] == 0 and swap["same_text_as_recompute"] == 1.0
    assert recompute["swapped_out_blocks"] == recompute["swap_ins"] == 0 and swap["recomputed_tokens"] == 0
    rows = {r[0]: r for r in table_rows(CH, "recompute|swap") if len(r) == 9}
    assert rows["recompute"][1:4] == [str(recompute["preemptions"]), f"{recompute['recomputed_tokens']:,}", "—"]
    assert rows["swap"][1:4] == [str(swap["preemptions"]), "0", f"{swap['swapped_out_blocks']} / {swap['swap_ins']}"]
    says(CH, f"{len(arrivals)} requests of 64–128 prompt tokens and 96 output tokens at once on a pool of "
             f"{OVERLOAD_BLOCKS} blocks of 16")
    says(CH, f"recompute computes fewer tokens again than the table's {recompute['recomputed_tokens']:,}")
    says(CH, f"MB are {swap['swapped_out_blocks']} blocks of {16 * PER_TOKEN:,} bytes")
    says(CH, f"swapping saved {recompute['recomputed_tokens']:,} tokens of prefill")
