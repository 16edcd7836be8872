"""Chapter 01's worked examples, computed by the code: each figure the chapter works out by hand is built here from
what the attention, the mask, RoPE's tables and SmolLM2's config give, and must appear in the text word for word;
the figures the chapter quotes from the notebook must be what the committed notebook printed."""

import dataclasses
import math
import re

import torch

from nanoserve.memory import kv_bytes_per_token
from nanoserve.model import LlamaConfig
from nanoserve.model.attention import causal_mask, merge_heads, repeat_kv, scaled_dot_product_attention, split_heads
from nanoserve.model.rope import rope_cos_sin
from tests.chapter_text import notebook_lines, says

CH = "01"
NEG = float("-inf")


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


def mask_row(row: torch.Tensor) -> str:
    return " ".join("-inf" if x else "0" for x in torch.isinf(row).tolist())


def test_masks_with_and_without_the_offset():
    """causal_mask(2, 4): query 0 (position 2) may not see key 3; a decode step's mask is all zeros. The classic bug,
    the queries taken as the first T positions (torch's top-left `tril`), shown beside it in the text."""
    assert torch.isinf(causal_mask(2, 4)).tolist() == [[False, False, False, True], [False] * 4]
    assert not torch.isinf(causal_mask(1, 5)).any()
    says(CH, f"query 0 (pos 2) {mask_row(causal_mask(2, 4)[0])}")
    no_offset = {(T, S): torch.zeros(T, S).masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), NEG)
                 for T, S in ((2, 4), (1, 5))}
    says(CH, f"query 0 (pos 2) {mask_row(no_offset[2, 4][0])} should see keys 0..2 "
             f"query 1 (pos 3) {mask_row(no_offset[2, 4][1])} should see keys 0..3")
    says(CH, f"a decode step's `causal_mask(1, 5)` into `{mask_row(no_offset[1, 5][0])}`: "
             "the new token sees key 0 only")


def test_split_and_merge_example():
    """Section 5: T = 2 tokens, H = 3 heads of D = 2; every head's rows, the shapes, and the exact round trip."""
    x = torch.arange(12).view(1, 2, 6)
    heads = split_heads(x, 3)
    says(CH, " ".join(f"head {h}: [{heads[0, h, 0].tolist()}," for h in range(3)) + f" {tuple(heads.shape)} "
             + " ".join(f"{heads[0, h, 1].tolist()}]" for h in range(3)))
    assert torch.equal(merge_heads(heads), x)
    says(CH, "merge_heads(...) [" + ", ".join(f"[{' '.join(map(str, row))}]" for row in x[0].tolist())
             + f"] = x, exactly {tuple(x.shape)}")


def test_repeat_kv_order():
    """Section 6: three K/V heads, groups of 3, in repeat_kv's order and in the wrong (tiled) one."""
    kv = torch.arange(3.0).view(1, 3, 1, 1)  # K/V head i holds the number i

    def names(heads: torch.Tensor) -> str:
        return "[" + ", ".join(f"k{int(i)}" for i in heads.flatten().tolist()) + "]"

    ours, tiled = repeat_kv(kv, 3), kv.repeat(1, 3, 1, 1)
    says(CH, f"repeat_kv([k0, k1, k2], 3) = {names(ours)} query head h reads entry h "
             f"not {names(tiled)} (query head 1 would read k{int(tiled[0, 1])}, not k{int(ours[0, 1])})")
    assert torch.equal(repeat_kv(kv, 3), kv.repeat_interleave(3, dim=1))


def test_stable_softmax_example():
    s = torch.tensor([1000.0, 999.0, 990.0, float("-inf")])
    says(CH, "stable one `[" + ", ".join(f"{p:.3f}" for p in torch.softmax(s, -1).tolist()) + "]`")
    naive = torch.exp(s) / torch.exp(s).sum()
    assert naive[:3].isnan().all() and naive[3] == 0  # the naive formula's [nan, nan, nan, 0]
    says(CH, "from about `x = 88.7`")
    assert f"{math.log(torch.finfo(torch.float32).max):.1f}" == "88.7"


def test_kv_bytes_per_token_and_context():
    """Chapter 04's kv_bytes_per_token on SmolLM2's config, as it is (GQA, 3 K/V heads) and with 9 (multi-head)."""
    c = smol()
    L, D = c.num_hidden_layers, c.head_dim
    for heads in (c.num_attention_heads, c.num_key_value_heads):
        per_token = int(kv_bytes_per_token(dataclasses.replace(c, num_key_value_heads=heads), "fp32"))
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


# --- the figures the chapter quotes from the notebook: each read from the one line that prints it ---------------

NUM = r"(-?[\d.]+(?:e[+-]\d+)?|nan)"


def printed(pattern: str, lines=None) -> re.Match:
    """The one line of the notebook's output that matches `pattern` whole (a regex; `{n}` stands for a number)."""
    lines = notebook_lines(CH) if lines is None else lines
    matches = [m for line in lines if (m := re.fullmatch(pattern.replace("{n}", NUM), line))]
    assert len(matches) == 1, f"{len(matches)} lines of notebook {CH} match {pattern!r}"
    return matches[0]


def minus(figure: str) -> str:
    return figure.replace("-", "−")  # the text writes a minus sign


def test_notebook_std_and_medians():
    """Section 2: std(q·k) for D = 4, 64, 1024 and after scaling; the medians and quantiles of D = 64."""
    std_line = r"D = {d} std\(q·k\) = {n} \(√D = {n}\) std\(q·k/√D\) = {n}"
    stds = {d: printed(std_line.replace("{d}", str(d))) for d in (4, 64, 1024)}
    says(CH, f"`std(q·k)` is {stds[4][1]}, {stds[64][1]} and {stds[1024][1]} for `D` = 4, 64 and 1024")
    (after_scaling,) = {m[3] for m in stds.values()}
    says(CH, f"and {after_scaling} after scaling")
    # the two lines that follow D = 64's, and only those: D = 1024 prints a scaled median of 0.335 too
    lines = notebook_lines(CH)
    block = lines[lines.index(stds[64][0]) + 1:][:2]
    top = r"largest of 8 softmax weights, {kind} ?: median {n}, 10 % of rows below {n}, 10 % above {n}"
    unscaled = printed(top.replace("{kind}", "unscaled"), block)
    scaled = printed(top.replace("{kind}", "scaled"), block)
    says(CH, f"median of {unscaled[1]} without the scaling (above {unscaled[2]} in 90 % of the rows) and "
             f"{scaled[1]} with it (between {scaled[2]} and {scaled[3]} in 80 % of them)")


def test_notebook_stable_softmax():
    naive = printed(r"naive : tensor\(\[(.*)\]\)")[1]
    stable = printed(r"stable: tensor\(\[(.*)\]\)")[1]
    assert printed(r"torch.softmax: tensor\(\[(.*)\]\)")[1] == stable
    says(CH, f"the naive formula gives `[{naive.replace('0.', '0')}]`, the stable one `[{stable}]`, "
             "equal to `torch.softmax`")


def test_notebook_kv_bytes():
    for label, heads in (("multi-head \\(Hkv = H = 9\\)", 9), ("grouped-query \\(Hkv = 3\\)", 3)):
        line = printed(rf"{label} ([\d,]+) B/token {{n}} MiB for an 8192-token context")
        mib = float(line[2])
        assert mib.is_integer(), line[0]
        says(CH, f"× {heads} × 64 × 4 = {line[1]} B → {mib:.0f} MiB")


def test_notebook_rope_scores():
    score = {m: printed(rf"m = {m}, n = {m - 3}: {{n}}")[1] for m in (3, 10, 100, 1000, 5000)}
    assert score[3] == score[10] == score[100]
    says(CH, f"(3, 0), (10, 7) and (100, 97) all score {minus(score[3])}, at (1000, 997) {minus(score[1000])} "
             f"and at (5000, 4997) {minus(score[5000])}")


def test_notebook_recording_attention_and_head_counts():
    """Section 9: the recording attention's logits, the sink count and the previous-token count."""
    diff = float(printed(r"same logits as the default attention: max \|diff\| = {n}")[1])
    says(CH, f"(a max difference of {diff:g} in the notebook's run)")
    sink = printed(r"\(layer, head\) pairs putting more than half their weight on the first token: (\d+) of (\d+); "
                   r"more than a quarter: \d+")
    says(CH, f"in {sink[1]} of the {sink[2]} (layer, head) pairs the queries after the first put more than half of "
             "their weight, on average, on the first token")
    prev = printed(r"\(layer, head\) pairs putting more than half their weight on the previous token: (\d+) of (\d+); "
                   r"more than 0.3: (\d+); the strongest: layer (\d+), head (\d+), {n}")
    says(CH, f"in {prev[1]} of the {prev[2]} pairs the queries from the third on put more than half of their weight "
             f"on the token just before them ({prev[3]} pairs put more than 0.3 there; the strongest is layer "
             f"{prev[4]}, head {prev[5]}, at {prev[6]}, and the cell draws it)")


def test_notebook_sdpa_differences():
    """Section 10: the three cases against PyTorch's SDPA, and 'a few times 10⁻⁷'."""
    (T1, S1), (T2, S2), (T3, _) = cases = ((6, 6), (2, 7), (1, 7))
    runs = [printed(rf"T={T} S={S}: out \(.*\), max \|ours - torch\| = {{n}}") for T, S in cases]
    assert T1 == S1 and T3 == 1  # a whole prompt, then decode
    says(CH, f"for `T = S`, for {T2} new tokens on {S2 - T2} cached ones, and for decode")
    worst = max(float(m[1]) for m in runs)
    exponent = math.floor(math.log10(worst))
    assert worst / 10**exponent < 6, worst  # "a few"
    superscript = str(exponent).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
    says(CH, f"the largest difference is a few times 10{superscript}")
