"""Chapter 01's worked examples, computed by the code: each figure the chapter works out by hand is built here from
what the attention, the mask, RoPE's tables and SmolLM2's config give, and must appear in the text word for word;
the figures the chapter quotes from the notebook must be what the committed notebook printed."""

import math

import torch

from nanoserve.model import LlamaConfig
from nanoserve.model.attention import causal_mask, scaled_dot_product_attention
from nanoserve.model.rope import rope_cos_sin
from tests.chapter_text import notebook_output, says

CH = "01"


def smol() -> LlamaConfig:
    """SmolLM2's config, read from the embedded GGUF."""
    from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf

    return config_from_gguf(open_gguf(embedded_gguf_path()))


def test_two_token_example():
    """q = [1, 2], k = [1, 0], v = [10, 20], D = 1: out = [10, 11.19]."""
    q, k, v = (torch.tensor(x, dtype=torch.float64).view(1, 1, 2, 1) for x in ([1, 2], [1, 0], [10, 20]))
    out = scaled_dot_product_attention(q, k, v, causal=True).flatten().tolist()
    w = math.exp(2) / (math.exp(2) + 1)
    says(CH, f"`[e²/(e²+1), 1/(e²+1)] = [{w:.3f}, {1 - w:.3f}]`, so `out[1] = {w:.3f}·10 + {1 - w:.3f}·20 = {out[1]:.2f}`")
    assert out[0] == 10


def test_masks_with_an_offset():
    """causal_mask(2, 4): query 0 (position 2) may not see key 3; a decode step's mask is all zeros."""
    assert torch.isinf(causal_mask(2, 4)).tolist() == [[False, False, False, True], [False] * 4]
    assert not torch.isinf(causal_mask(1, 5)).any()
    says(CH, "query 0 (pos 2) 0 0 0 -inf")


def test_stable_softmax_example():
    s = torch.tensor([1000.0, 999.0, 990.0, float("-inf")])
    says(CH, "stable one `[" + ", ".join(f"{p:.3f}" for p in torch.softmax(s, -1).tolist()) + "]`")
    naive = torch.exp(s) / torch.exp(s).sum()
    assert naive[:3].isnan().all() and naive[3] == 0  # the naive formula's [nan, nan, nan, 0]
    says(CH, "from about `x = 88.7`")
    assert f"{math.log(torch.finfo(torch.float32).max):.1f}" == "88.7"


def test_kv_bytes_per_token_and_context():
    c = smol()
    L, D = c.num_hidden_layers, c.head_dim
    for heads, label in ((c.num_attention_heads, "multi-head"), (c.num_key_value_heads, "GQA")):
        per_token = 2 * L * heads * D * 4
        mib = per_token * 8192 // 2**20
        says(CH, f"2 × {L} × {heads} × {D} × 4 = {per_token:,} B")
        says(CH, f"{mib} MiB")
    assert (c.num_attention_heads, c.num_key_value_heads, D, L) == (9, 3, 64, 30)


def test_rope_clock_speeds():
    c = smol()
    _, sin = rope_cos_sin(torch.tensor([1]), c.head_dim, c.rope_theta)
    theta = c.rope_theta ** (-2 * 31 / c.head_dim)
    assert math.isclose(sin[0, 31].item(), theta, rel_tol=1e-4)  # column 31 turns by θ₃₁ a token (sin θ ≈ θ)
    says(CH, f"`θ₃₁ = {theta / 1e-5:.2f}·10⁻⁵`")
    says(CH, f"every {round(2 * math.pi / theta, -3):,.0f} tokens")
    says(CH, f"base = {c.rope_theta:,.0f}")


def test_score_matrix_bytes():
    c = smol()
    gib = c.num_attention_heads * 8192 * 8192 * 4 / 2**30
    says(CH, f"`{c.num_attention_heads} × 8192 × 8192 × 4 B = {gib:.2f} GiB`")


def test_notebook_figures_the_chapter_quotes():
    printed = notebook_output(CH)
    for figure in ("2.00", "8.03", "32.09", "0.966", "0.335", "183"):
        assert figure in printed, figure
