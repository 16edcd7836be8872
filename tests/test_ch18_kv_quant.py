"""Chapter 18 — the int8 / fp8 KV pool: quantize on store, dequantize in the gather.

References: the quantizer against the arithmetic written out here; the pool's attention against attention
written out over dense, dequantized K/V (chapter 01's formula, GQA by repetition); capacity against chapter
04's formula by hand; greedy SmolLM2 against the float32 oracle, per token, at near-ties only."""

import math

import pytest
import torch

from nanoserve.kv.paged_attention import AttentionMetadata, PagedKVCache
from nanoserve.kv.quantized_pool import QuantizedKVCache, QuantizedPagedAttention, quantized_block_bytes
from nanoserve.memory import GiB, kv_bytes_per_token
from nanoserve.model.config import LlamaConfig
from nanoserve.student import implementation

DTYPES = [torch.int8, torch.float8_e4m3fn]


def quant():
    return implementation("nanoserve.kv.kv_quant")


# --- Exercise 18.3: one row to 8 bits and back -------------------------------------------------------------

@pytest.mark.exercise("18.3")
def test_int8_worked_example():
    codes, scale = quant().quantize_kv(torch.tensor([[0.5, -1.27, 0.01, 1.0]]))
    assert codes.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (1,)
    assert codes.tolist() == [[50, -127, 1, 100]]
    assert scale.item() == torch.tensor(1.27 / 127).to(torch.bfloat16).item() == 0.010009765625
    back = quant().dequantize_kv(codes, scale)  # the docstring's row: the bf16 scale's rounding shows
    assert [round(v, 4) for v in back[0].tolist()] == [0.5005, -1.2712, 0.0100, 1.0010]


@pytest.mark.exercise("18.3")
def test_int8_against_the_arithmetic_and_its_error_bound():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.1, 1.0, 30.0])[:, None, None]
    codes, scale = quant().quantize_kv(x)
    assert codes.shape == x.shape and scale.shape == x.shape[:-1]
    s = (x.abs().amax(-1) / 127).to(torch.bfloat16).float()  # written out: per row, rounded to bf16 first
    assert torch.equal(scale.float(), s)
    assert torch.equal(codes, (x / s[..., None]).round().clamp(-127, 127).to(torch.int8))
    back = quant().dequantize_kv(codes, scale)
    assert back.dtype == torch.float32
    assert torch.all((back - x).abs() <= s[..., None] / 2 + 1e-6 * x.abs())  # half a step, at most


@pytest.mark.exercise("18.3")
def test_fp8_is_e4m3_of_the_scaled_row():
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)) * 7
    codes, scale = quant().quantize_kv(x, torch.float8_e4m3fn)
    s = (x.abs().amax(-1) / 448).to(torch.bfloat16).float()
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(scale.float(), s)
    assert torch.equal(codes.float(), (x / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    back = quant().dequantize_kv(codes, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert torch.all((back.float() - x).abs() <= x.abs() / 16 + s[..., None] * 2 ** -9 + 1e-2 * x.abs())


@pytest.mark.exercise("18.3")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_zero_row_stays_finite_and_zero(dtype):
    codes, scale = quant().quantize_kv(torch.zeros(2, 8), dtype)
    assert torch.all(scale > 0) and torch.equal(quant().dequantize_kv(codes, scale), torch.zeros(2, 8))


# --- the pool ------------------------------------------------------------------------------------------------

def dense_attention(q, k, v, causal_offset):
    """Chapter 01 written out: q (T, H, D), k, v (S, Hkv, D); query t sees keys <= causal_offset + t."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # GQA by repetition
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    visible = torch.arange(S)[None, :] <= causal_offset + torch.arange(T)[:, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hts,shd->thd", weights, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_pool_attention_against_dense_attention_over_dequantized_kv(dtype):
    """Two steps — a prefill of a 6- and a 3-token prompt, then one decode each — through the int8 / fp8 pool,
    against dense attention over every K/V row quantized and dequantized: the pool, its scales, the scratch
    renumbering and both attention paths (one by one, batched decodes) must give exactly that."""
    from nanoserve.kv.kv_quant import dequantize_kv, quantize_kv

    g = torch.Generator().manual_seed(2)
    H, Hkv, D, bs = 4, 2, 16, 4
    pool = QuantizedKVCache(1, 8, bs, Hkv, D, dtype)
    tables, lens = [[3, 5], [1]], [6, 3]
    ks, vs = [torch.randn(n, Hkv, D, generator=g) for n in lens], [torch.randn(n, Hkv, D, generator=g) for n in lens]
    rt = lambda x: dequantize_kv(*quantize_kv(x, dtype))  # noqa: E731  the round trip every row goes through
    q = torch.randn(9, H, D, generator=g)
    out = QuantizedPagedAttention(pool, AttentionMetadata.build(tables, lens, lens, bs))(0, q, torch.cat(ks), torch.cat(vs))
    expected = torch.cat([dense_attention(q[:6], rt(ks[0]), rt(vs[0]), 0), dense_attention(q[6:], rt(ks[1]), rt(vs[1]), 0)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    q2, k2, v2 = torch.randn(2, H, D, generator=g), torch.randn(2, Hkv, D, generator=g), torch.randn(2, Hkv, D, generator=g)
    out = QuantizedPagedAttention(pool, AttentionMetadata.build(tables, [7, 4], [1, 1], bs))(0, q2, k2, v2)
    for i in range(2):
        k_all, v_all = torch.cat([rt(ks[i]), rt(k2[i:i + 1])]), torch.cat([rt(vs[i]), rt(v2[i:i + 1])])
        torch.testing.assert_close(out[i:i + 1], dense_attention(q2[i:i + 1], k_all, v_all, lens[i]), atol=1e-5, rtol=1e-5)
    assert pool.k_cache[0].dtype == dtype and pool.k_scale[0].dtype == torch.bfloat16


def test_copy_blocks_moves_codes_and_scales():
    pool = QuantizedKVCache(2, 4, 2, 1, 8)
    pool.store_kv(1, torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.tensor([2, 3]))
    pool.copy_blocks([(1, 0)])
    for t in pool.block_tensors():
        assert torch.equal(t[:, 0], t[:, 1])


def test_capacity_per_dtype_against_chapter_04():
    """Blocks of 16 tokens in 1 GiB for SmolLM2, by hand: chapter 04's formula is 2 · 30 · 3 · 64 · bytes per token;
    the 8-bit pools add a 2-byte scale per row of 64 (quantized_block_bytes), so they hold 1.94x bf16's blocks, not 2x."""
    c = LlamaConfig()
    formula = {name: int(GiB // (16 * kv_bytes_per_token(c, name))) for name in ("fp32", "bf16", "int8")}
    assert formula == {"fp32": 1456, "bf16": 2912, "int8": 5825}  # 1 GiB / (16 · 46,080), / 23,040, / 11,520
    assert quantized_block_bytes(c, 16) == 2 * 30 * 3 * 16 * (64 + 2) == 190_080
    assert GiB // quantized_block_bytes(c, 16) == 5648
    assert round(5648 / 2912, 2) == 1.94
    pool = QuantizedKVCache(3, 5, 4, 2, 8)  # a real pool's bytes are the formula's: codes + scales
    assert pool.nbytes == 5 * quantized_block_bytes(LlamaConfig(num_hidden_layers=3, num_key_value_heads=2,
                                                                 num_attention_heads=2, hidden_size=16), 4)
    assert PagedKVCache(3, 5, 4, 2, 8, torch.bfloat16).nbytes == 5 * 2 * 3 * 2 * 4 * 8 * 2


# --- the engine --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8bit_engine_pool_is_sized_by_the_quantized_formula(kv_cache_dtype):
    """The engine sizes its pool with quantized_block_bytes: on the tiny model (head_dim 8) that is
    2·8 / (8 + 2) = 1.6x bf16's blocks; on SmolLM2's config (head_dim 64) the same formula gives 1.94x."""
    from nanoserve.engine.config import engine_config
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.kv.paged_attention import num_blocks_for_budget
    from tests.tiny_model import tiny_llama

    model = tiny_llama()
    blocks = {dt: LLMEngine(model, engine_config(kv_cache_memory=1 << 20, kv_cache_dtype=dt)).block_manager.num_blocks
              for dt in ("bf16", kv_cache_dtype)}
    c = model.config
    per_block = 2 * c.num_hidden_layers * c.num_key_value_heads * 16 * (c.head_dim + 2)
    assert blocks[kv_cache_dtype] == (1 << 20) // per_block
    assert blocks["bf16"] == num_blocks_for_budget(c, 1 << 20, 16, torch.bfloat16)
    assert blocks[kv_cache_dtype] / blocks["bf16"] == pytest.approx(2 * c.head_dim / (c.head_dim + 2), rel=0.01)
    smol = LlamaConfig()  # the two formulas the engine calls, on SmolLM2's shape (no model load)
    ratio = (GiB // quantized_block_bytes(smol, 16)) / num_blocks_for_budget(smol, GiB, 16, torch.bfloat16)
    assert round(ratio, 2) == 1.94


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype, margin", [("int8", 1.0), ("fp8", 4.0)])
def test_smollm2_on_an_8bit_pool_matches_float32_except_near_ties(smollm2, smollm2_tokenizer, kv_cache_dtype, margin):
    """Greedy, 4 chat prompts x 16 tokens, teacher-forced check (tests/test_speed_parity.py's): wherever the 8-bit pool
    chose another token than float32's argmax, float32 found the two within `margin` (logits span about ±40)."""
    from nanoserve.bench.quality import greedy_outputs
    from tests.test_speed_parity import NEW_TOKENS, PROMPTS, near_tie_violations

    outputs = greedy_outputs(smollm2, smollm2_tokenizer, PROMPTS[:4], NEW_TOKENS, kv_cache_dtype=kv_cache_dtype)
    assert near_tie_violations(smollm2, smollm2_tokenizer, outputs, margin) == []
    shifted = [o[1:] + o[:1] for o in outputs]  # and the check can fail
    assert near_tie_violations(smollm2, smollm2_tokenizer, shifted, margin)
