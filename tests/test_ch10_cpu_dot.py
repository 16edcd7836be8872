"""Chapter 10: cpu_dot.c's integer products (llama.cpp's Q4_1 x Q8_1 and int8 x Q8_1) against the same
arithmetic written out in plain torch, in float64, from the GGUF's bytes; its error against the exact product
within the bound activation rounding allows; its plain-C branch equal to its AVX2 one; the layers using it."""

import copy

import pytest
import torch

from nanoserve.kernels import cpu_dot
from nanoserve.model.quant import Int8Linear, Q4Linear, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_dot.available(), reason=f"kernels/cpu_dot.c does not build here "
                                f"({cpu_dot.build_error()}): install gcc with OpenMP (Debian: build-essential)")


def q4_1_blocks(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Random Q4_1 blocks (out, in/32, 20): nibbles, d > 0 and m < 0 as float16 (a real layer's signs)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (out, inp // 32, 20), dtype=torch.uint8, generator=g)
    d = (torch.rand(out, inp // 32, generator=g) * 0.01 + 1e-4).half()
    m = (-torch.rand(out, inp // 32, generator=g) * 0.08).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(out, inp // 32, 2)
    blocks[..., 2:4] = m.view(torch.uint8).view(out, inp // 32, 2)
    return blocks


def q8_1(x: torch.Tensor):
    """x (tokens, in) -> p (tokens, in/32, 32) integers in -127..127 and dx (tokens, in/32), float64:
    dx = max|x| / 127 per block, p = x / dx rounded to nearest (ties to even, as lrintf)."""
    xb = x.double().view(x.shape[0], -1, 32)
    dx = (xb.float().abs().amax(-1) / 127).double()  # the C code computes dx in float32
    inv = torch.where(dx > 0, (1 / dx.float()).double(), torch.zeros_like(dx))
    p = torch.round((xb.float() * inv.float()[..., None]).double())
    return p, dx


def q4_1_reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Σ_blocks d·dx·Σ q·p + m·dx·Σ p, in float64: what gemv_q4_1 computes, by its definition."""
    out, nb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).double()  # (out, nb)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).double()
    qs = blocks[..., 4:].long()
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).double()  # (out, nb, 32): weights 0..15, then 16..31
    p, dx = q8_1(x)  # (T, nb, 32), (T, nb)
    qp = torch.einsum("onk,tnk->ton", q, p)  # (T, out, nb): one integer dot product per block
    return (d * dx[:, None, :] * qp + m * (dx * p.sum(-1))[:, None, :]).sum(-1)


def int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    p, dx = q8_1(x)
    qp = torch.einsum("onk,tnk->ton", q.double().view(q.shape[0], -1, 32), p)
    return scale.double() * (dx[:, None, :] * qp).sum(-1)


# the C code multiplies tokens in tiles of 8, its accumulators in registers for a full tile and for one token:
# one token, part tiles, a full one, full ones with a remainder
TILED_TOKENS = [1, 3, 5, 8, 9, 16, 17]


@pytest.mark.parametrize("tokens", TILED_TOKENS)
def test_q4_1_matmul_is_the_block_arithmetic(tokens):
    blocks = q4_1_blocks(48, 96)
    x = torch.randn(tokens, 96)
    want = q4_1_reference(x, blocks)
    got = cpu_dot.q4_1_matmul(x, blocks).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("tokens", TILED_TOKENS)
def test_int8_matmul_is_the_block_arithmetic(tokens):
    q, scale = quantize_int8(torch.randn(40, 64))
    x = torch.randn(tokens, 64)
    want = int8_reference(x, q, scale.float())
    got = cpu_dot.int8_matmul(x, q, scale.float()).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt", ["q4", "int8"])
def test_the_error_against_the_exact_product_is_the_activations_rounding(fmt):
    """Each activation is off by at most dx/2 (half a step of its block), so |y − x·Wᵀ| ≤ Σ_i |w_i|·dx_i/2, W the
    weights the product multiplies (Q4_1: w = d·q + m; int8: w = q·s, the row's scale); the bound is reached
    within a factor of a few (not zero: the activations really are rounded)."""
    x = torch.randn(2, 128)
    if fmt == "q4":
        blocks = q4_1_blocks(64, 128, seed=1)
        layer = Q4Linear(blocks, "t")
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        w = (layer.unpacked().float().view(64, 4, 32) * d[..., None] + m[..., None]).view(64, 128)  # the file's
        y = cpu_dot.q4_1_matmul(x, blocks)
    else:
        q, scale = quantize_int8(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05)
        w = q.float() * scale.float()[:, None]  # exactly the weights the kernel multiplies (float32 scales)
        y = cpu_dot.int8_matmul(x, q, scale.float())
    exact = x.double() @ w.double().T
    _, dx = q8_1(x)
    bound = (w.double().abs().view(64, 4, 32).sum(-1)[None] * dx[:, None, :] / 2).sum(-1)  # (T, out)
    err = (y.double() - exact).abs()
    assert (err <= bound + 1e-6).all()
    assert err.max() > 0.01 * bound.max()


def test_the_plain_c_branch_computes_what_the_avx2_one_does():
    """Built without -march=native (x86-64's baseline: no AVX2, no F16C), the same file takes its plain C loops
    and its own float16 conversion: the same numbers up to the order of float32 additions."""
    if not cpu_dot.simd():  # the native build is plain C too: comparing it with itself would prove nothing
        pytest.skip("the native build of kernels/cpu_dot.c has no AVX2 here: run on an x86-64 CPU with AVX2")
    plain = cpu_dot.build(["-O2", "-fopenmp", "-shared", "-fPIC"])
    assert plain.cpu_dot_simd() == 0
    blocks, x = q4_1_blocks(32, 64, seed=2), torch.randn(5, 64)
    torch.testing.assert_close(cpu_dot.q4_1_matmul(x, blocks, plain), cpu_dot.q4_1_matmul(x, blocks), rtol=1e-5, atol=1e-6)
    q, scale = quantize_int8(torch.randn(32, 64))
    torch.testing.assert_close(cpu_dot.int8_matmul(x, q, scale.float(), plain), cpu_dot.int8_matmul(x, q, scale.float()),
                               rtol=1e-5, atol=1e-6)


def test_the_custom_ops_declare_what_the_products_return():
    """Inside torch.compile the products are custom ops: torch's own checks of their registration (the fake
    shapes the compiler plans with against the real outputs)."""
    blocks, x = q4_1_blocks(32, 64, seed=3), torch.randn(2, 64)
    torch.library.opcheck(cpu_dot.q4_1_matmul_op, (x, blocks))
    q, scale = quantize_int8(torch.randn(48, 64))
    torch.library.opcheck(cpu_dot.int8_matmul_op, (x, q, scale.float()))
    compiled = torch.compile(lambda x, b: cpu_dot.q4_1_matmul_op(x, b) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, blocks), 2 * cpu_dot.q4_1_matmul(x, blocks), rtol=0, atol=0)


def test_raw_memory_is_read_only_as_declared():
    """The C code reads pointers: a tensor of another dtype, shape or device is refused, not read past its end."""
    blocks, x = q4_1_blocks(32, 64), torch.randn(1, 64)
    with pytest.raises(ValueError, match="blocks must be torch.uint8"):
        cpu_dot.q4_1_matmul(x, blocks[:, :1])
    with pytest.raises(ValueError, match="divisible by 32"):
        cpu_dot.q4_1_matmul(torch.randn(1, 40), blocks)
    q, scale = quantize_int8(torch.randn(48, 64))
    with pytest.raises(ValueError, match="qweight must be torch.int8"):
        cpu_dot.int8_matmul(x, q.int(), scale.float())
    with pytest.raises(ValueError, match="scale must be torch.float32"):
        cpu_dot.int8_matmul(x, q, scale.float()[:40])


def test_a_failed_build_says_why():
    assert cpu_dot.build(["-fno-such-flag", "-shared"]) is None
    assert "gcc failed" in cpu_dot.build_error(["-fno-such-flag", "-shared"])
    assert cpu_dot.build_error() == ""  # this CPU's own build did not fail


def test_a_layer_takes_the_integer_products_for_small_steps_only():
    """integer_dot on: a step of up to max_kernel_tokens rows is cpu_dot's; a larger one the large-step GEMM on
    the dequantized weight, as without it. Off: torch's kernel, within bf16's rounding of the same product."""
    layer = Q4Linear(q4_1_blocks(64, 96, seed=4), "t")
    layer.max_kernel_tokens = 4
    x = torch.randn(5, 96)
    torch_kernel = layer(x[:4])
    layer.integer_dot = True
    torch.testing.assert_close(layer(x[:4]), cpu_dot.q4_1_matmul(x[:4], layer.blocks), rtol=0, atol=0)
    large = copy.copy(layer)
    large.integer_dot = False
    assert torch.equal(layer(x), large(x))  # 5 rows: the GEMM either way
    scale = torch_kernel.abs().max()
    assert (layer(x[:4]) - torch_kernel).abs().max() < 0.02 * scale  # two roundings of x, one product
    int8 = Int8Linear.from_float(torch.randn(48, 64), "t8")
    int8.integer_dot = True
    torch.testing.assert_close(int8(x[:2, :64]), cpu_dot.int8_matmul(x[:2, :64], int8.qweight, int8.scale.float()),
                               rtol=0, atol=0)


def test_an_explicit_choice_is_refused_where_it_cannot_be_honoured():
    from nanoserve.llm import LLM
    from nanoserve.model.quant import check_integer_dot
    from tests.tiny_model import tiny_llama

    with pytest.raises(ValueError, match="int8 / q4 weights"):
        LLM(weights="fp32", integer_dot=True)  # before any model loads
    with pytest.raises(ValueError, match="a model given keeps"):
        LLM(tiny_llama(), integer_dot=False)
    with pytest.raises(ValueError, match="single-process"):
        check_integer_dot(False, "q4", tensor_parallel_size=3)
    check_integer_dot(True, "q4")  # builds here: accepted
