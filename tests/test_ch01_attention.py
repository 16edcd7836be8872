"""Chapter 01: attention, checked against torch's own SDPA, transformers' RoPE and tiny cases by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from nanoserve.model import LlamaConfig
from nanoserve.model.rope import apply_rope, rope_cos_sin
from nanoserve.student import implementation

attention = implementation("nanoserve.model.attention")
NEG = float("-inf")


# --- Exercise 1.1: the causal mask ------------------------------------------------------------

@pytest.mark.exercise("1.1")
def test_causal_mask_square_by_hand():
    expected = torch.tensor([[0.0, NEG, NEG],
                             [0.0, 0.0, NEG],
                             [0.0, 0.0, 0.0]])
    assert torch.equal(attention.causal_mask(3, 3), expected)


@pytest.mark.exercise("1.1")
def test_causal_mask_queries_are_the_last_positions():
    # 2 new queries on top of 2 cached keys: they sit at positions 2 and 3.
    expected = torch.tensor([[0.0, 0.0, 0.0, NEG],
                             [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(attention.causal_mask(2, 4), expected)
    assert torch.equal(attention.causal_mask(1, 5), torch.zeros(1, 5))  # decode sees everything


@pytest.mark.exercise("1.1")
def test_causal_mask_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="3 queries"):
        attention.causal_mask(3, 2)


# --- Exercise 1.2: heads — split, merge, and grouped-query sharing -----------------------------

@pytest.mark.exercise("1.2")
def test_split_heads_layout_by_hand():
    x = torch.arange(12.0).view(1, 2, 6)  # B=1, T=2, 3 heads of D=2
    heads = attention.split_heads(x, num_heads=3)
    assert heads.shape == (1, 3, 2, 2)
    assert heads[0, 1].tolist() == [[2.0, 3.0], [8.0, 9.0]]  # head 1 = columns 2:4 of both tokens
    assert torch.equal(attention.merge_heads(heads), x)


@pytest.mark.exercise("1.2")
def test_repeat_kv_matches_repeat_interleave():
    kv = torch.randn(2, 3, 5, 4)  # (B, Hkv, S, D)
    out = attention.repeat_kv(kv, 3)
    assert torch.equal(out, kv.repeat_interleave(3, dim=1))  # query head h reads kv head h // 3
    assert attention.repeat_kv(kv, 1) is kv or torch.equal(attention.repeat_kv(kv, 1), kv)


# --- Exercise 1.3: scaled dot-product attention -----------------------------------------------

@pytest.mark.exercise("1.3")
def test_attention_tiny_case_by_hand():
    # One head, D = 1, two tokens. Query 0 sees only key 0; query 1 sees both keys.
    q = torch.tensor([[[[1.0], [2.0]]]])  # (1, 1, 2, 1)
    k = torch.tensor([[[[1.0], [0.0]]]])
    v = torch.tensor([[[[10.0], [20.0]]]])
    out = attention.scaled_dot_product_attention(q, k, v, causal=True)
    # row 1: scores [2·1, 2·0] / √1 = [2, 0] → weights [e²/(e²+1), 1/(e²+1)]
    w = math.exp(2) / (math.exp(2) + 1)
    expected = torch.tensor([[[[10.0], [w * 10 + (1 - w) * 20]]]])
    torch.testing.assert_close(out, expected)


@pytest.mark.exercise("1.3")
@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), groups=st.integers(1, 3), T=st.integers(1, 7),
       extra=st.integers(0, 5), D=st.sampled_from([4, 8]), causal=st.booleans())
def test_attention_matches_torch_sdpa(B, Hkv, groups, T, extra, D, causal):
    S = T + extra  # queries are the last T of S positions (a cache holds `extra` earlier ones)
    g = torch.Generator().manual_seed(B * 1000 + Hkv * 100 + T * 10 + extra)
    q = torch.randn(B, Hkv * groups, T, D, generator=g)
    k, v = torch.randn(2, B, Hkv, S, D, generator=g)
    # torch's reference: a boolean "may attend" mask, built from tril with the cache offset
    allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=extra) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    out = attention.scaled_dot_product_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("1.3")
def test_attention_is_numerically_stable():
    q = torch.full((1, 1, 2, 4), 300.0)  # q·k = 360,000: exp() of that overflows without the max trick
    k = torch.full((1, 1, 2, 4), 300.0)
    v = torch.randn(1, 1, 2, 4)
    out = attention.scaled_dot_product_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0, 1], v[0, 0].mean(0))  # equal scores → equal weights


@pytest.mark.exercise("1.3")
def test_attention_rejects_mismatched_shapes_naming_them():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"\(1, 4, 3, 8\).*\(1, 3, 3, 8\)"):
        attention.scaled_dot_product_attention(q, torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8))  # 4 % 3 != 0
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 4\)"):
        attention.scaled_dot_product_attention(q, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))  # D differs


# --- RoPE (reference only): against transformers ------------------------------------------------

def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tests.hf_reference import hf_rope

    config = LlamaConfig()  # SmolLM2's head_dim 64 and base 1e5
    positions = torch.tensor([0, 1, 5, 100, 4000])
    q = torch.randn(5, config.num_attention_heads, config.head_dim)  # (T, H, D)
    k = torch.randn(5, config.num_key_value_heads, config.head_dim)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    hf_cos, hf_sin = hf_rope(config, positions)
    torch.testing.assert_close(cos, hf_cos[0])
    # transformers wants (B, H, T, D)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1))


@settings(max_examples=20, deadline=None)
@given(m=st.integers(0, 2000), n=st.integers(0, 2000), shift=st.integers(0, 2000))
def test_rope_scores_depend_only_on_distance(m, n, shift):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 64, generator=g)  # (T=1, H=1, D)

    def score(pos_q, pos_k):
        cq, sq = rope_cos_sin(torch.tensor([pos_q]), 64, 1e5)
        ck, sk = rope_cos_sin(torch.tensor([pos_k]), 64, 1e5)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-3, rtol=1e-4)
