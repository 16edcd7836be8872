"""Chapter 01: attention, checked against torch's own SDPA, transformers' RoPE and tiny cases by hand.

Graded: 1.1 the causal mask, 1.2 heads and grouped-query sharing, 1.3 attention. Each graded test asks
`attention()` for its module: under `make grade CH=01`, the learner's rung under test with the reference's
other rungs (nanoserve/student.py, RUNGS), so a slip in the mask does not fail the tests of 1.3.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from nanoserve.model import LlamaConfig
from nanoserve.model.rope import apply_rope, rope_cos_sin
from nanoserve.student import implementation

NEG = float("-inf")


def attention():
    return implementation("nanoserve.model.attention")


# --- Exercise 1.1: the causal mask ------------------------------------------------------------

@pytest.mark.exercise("1.1")
def test_causal_mask_square_by_hand():
    expected = torch.tensor([[0.0, NEG, NEG],
                             [0.0, 0.0, NEG],
                             [0.0, 0.0, 0.0]])
    assert torch.equal(attention().causal_mask(3, 3), expected)


@pytest.mark.exercise("1.1")
def test_causal_mask_queries_are_the_last_positions():
    # 2 new queries on top of 2 cached keys: they sit at positions 2 and 3.
    expected = torch.tensor([[0.0, 0.0, 0.0, NEG],
                             [0.0, 0.0, 0.0, 0.0]])
    mask = attention().causal_mask
    assert torch.equal(mask(2, 4), expected)
    assert torch.equal(mask(1, 5), torch.zeros(1, 5))  # decode sees everything


@pytest.mark.exercise("1.1")
def test_causal_mask_is_in_the_dtype_asked_for():
    mask = attention().causal_mask
    assert mask(2, 4).dtype == torch.float32  # the default
    for dtype in (torch.bfloat16, torch.float16):
        half = mask(2, 4, dtype=dtype)  # bf16 scores + a float32 mask would be float32 scores
        assert half.dtype == dtype
        assert torch.equal(half.float(), torch.tensor([[0.0, 0.0, 0.0, NEG], [0.0, 0.0, 0.0, 0.0]]))


@pytest.mark.exercise("1.1")
def test_causal_mask_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="3 queries"):
        attention().causal_mask(3, 2)


# --- Exercise 1.2: heads — split, merge, and grouped-query sharing -----------------------------

@pytest.mark.exercise("1.2")
def test_split_heads_layout_by_hand():
    heads_of = attention()
    x = torch.arange(12.0).view(1, 2, 6)  # B=1, T=2, 3 heads of D=2
    heads = heads_of.split_heads(x, num_heads=3)
    assert heads.shape == (1, 3, 2, 2)
    assert heads[0, 1].tolist() == [[2.0, 3.0], [8.0, 9.0]]  # head 1 = columns 2:4 of both tokens
    assert torch.equal(heads_of.merge_heads(heads), x)
    with pytest.raises(ValueError):
        heads_of.split_heads(torch.zeros(1, 2, 7), num_heads=3)  # 7 features do not make 3 heads


@pytest.mark.exercise("1.2")
def test_repeat_kv_matches_repeat_interleave():
    repeat_kv = attention().repeat_kv
    kv = torch.randn(2, 3, 5, 4)  # (B, Hkv, S, D)
    assert torch.equal(repeat_kv(kv, 3), kv.repeat_interleave(3, dim=1))  # query head h reads kv head h // 3
    assert torch.equal(repeat_kv(kv, 1), kv)


# --- Exercise 1.3: scaled dot-product attention -----------------------------------------------

@pytest.mark.exercise("1.3")
def test_attention_tiny_case_by_hand():
    # One head, D = 1, two tokens. Query 0 sees only key 0; query 1 sees both keys.
    q = torch.tensor([[[[1.0], [2.0]]]])  # (1, 1, 2, 1)
    k = torch.tensor([[[[1.0], [0.0]]]])
    v = torch.tensor([[[[10.0], [20.0]]]])
    out = attention().scaled_dot_product_attention(q, k, v, causal=True)
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
    out = attention().scaled_dot_product_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("1.3")
def test_attention_in_bfloat16_stays_bfloat16():
    sdpa = attention().scaled_dot_product_attention
    g = torch.Generator().manual_seed(0)
    for T, S in [(6, 6), (3, 8), (1, 9)]:  # a prompt, a chunk on top of a cache, decode
        q = torch.randn(2, 9, T, 64, generator=g).bfloat16()  # SmolLM2's heads: 9 query, 3 K/V, D = 64
        k, v = torch.randn(2, 2, 3, S, 64, generator=g).bfloat16()
        out = sdpa(q, k, v, causal=True)
        assert out.dtype == torch.bfloat16, (T, S)
        # the same bf16 numbers in float32 through torch's SDPA. bf16 keeps 8 significant bits (steps of 0.4 %)
        # and the softmax's exp and sums in bf16 lose a few more: outputs of size ~1 agree to a few hundredths
        allowed = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed,
                                                  enable_gqa=True)
        torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=0)


@pytest.mark.exercise("1.3")
def test_attention_is_numerically_stable():
    q = torch.full((1, 1, 2, 4), 300.0)  # q·k = 360,000: exp() of that overflows without the max trick
    k = torch.full((1, 1, 2, 4), 300.0)
    v = torch.randn(1, 1, 2, 4)
    out = attention().scaled_dot_product_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0, 1], v[0, 0].mean(0))  # equal scores → equal weights


@pytest.mark.exercise("1.3")
def test_attention_rejects_mismatched_shapes_naming_them():
    sdpa = attention().scaled_dot_product_attention

    def message(q, k, v, causal) -> str:
        with pytest.raises(ValueError) as error:
            sdpa(torch.randn(q), torch.randn(k), torch.randn(v), causal=causal)
        return str(error.value)

    q, kv = (1, 4, 3, 8), (1, 2, 3, 8)  # fit together: 4 query heads share 2 K/V heads
    for q, k, v, why in [(q, (1, 3, 3, 8), (1, 3, 3, 8), "4 query heads cannot share 3 K/V heads"),
                         (q, (1, 2, 3, 4), (1, 2, 3, 4), "D differs"),
                         (q, (2, 2, 3, 8), (2, 2, 3, 8), "B differs"),
                         (q, (1, 2, 2, 8), (1, 2, 2, 8), "3 queries cannot be the last of 2 keys"),
                         (q, kv, (1, 2, 5, 8), "k and v differ"),
                         ((4, 3, 8), kv, kv, "q is 3-D: no batch axis"),
                         (q, (1, 1, 2, 3, 8), (1, 1, 2, 3, 8), "k and v are 5-D"),
                         ((1, 1, 4, 3, 8), (1, 1, 2, 3, 8), (1, 1, 2, 3, 8), "all three 5-D: batched twice")]:
        for causal in (True, False):  # the shapes are checked with or without the mask
            text = message(q, k, v, causal)
            for shape in {q, k, v}:  # in any order
                assert str(shape) in text, (why, causal, text)


# --- Why RoPE: what attention without it can tell of order ------------------------------------

def test_attention_cannot_order_the_keys_a_query_sees():
    """Section 7: without the mask a shuffle of the keys (with their values) changes no output; with it, a shuffle
    across the diagonal does, but one among the keys a query sees leaves that query's output as it was."""
    from nanoserve.model.attention import scaled_dot_product_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 1, 5, 8, generator=g, dtype=torch.float64)  # (B, H, T = S = 5, D)

    def shuffled(order, causal):
        return scaled_dot_product_attention(q, k[:, :, order], v[:, :, order], causal=causal)

    across, within = [2, 0, 4, 1, 3], [2, 0, 1, 3, 4]  # `within` reorders keys 0-2 among themselves
    torch.testing.assert_close(shuffled(across, False), scaled_dot_product_attention(q, k, v, causal=False))
    plain = scaled_dot_product_attention(q, k, v, causal=True)
    assert not torch.allclose(shuffled(across, True)[:, :, 0], plain[:, :, 0])  # query 0 now sees key 2, not key 0
    torch.testing.assert_close(shuffled(across, True)[:, :, 4], plain[:, :, 4])  # the last query sees them all
    out = shuffled(within, True)
    torch.testing.assert_close(out[:, :, 2:], plain[:, :, 2:])  # queries 2-4 see keys 0-2 in either order
    assert not torch.allclose(out[:, :, :2], plain[:, :, :2])  # queries 0, 1 see other keys than before


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
