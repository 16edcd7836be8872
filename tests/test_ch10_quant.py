"""Chapter 10 — quantized weights on random data and a tiny random model (fast).

References: int8 against hand-computed values and a dequantize-then-matmul written here; Q4_1 against
the `gguf` package's own quantizer and dequantizer (independent of nanoserve); the quantized kernels
against plain float32 products. Graded tests (exercises 10.1, 10.2, 10.3) run on the learner's code too, each
rung alone (the reference stands in for the others).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch.nn import functional as F

from nanoserve.kernels import cpu_dot
from nanoserve.model import Llama, LlamaConfig
from nanoserve.model.quant import (QUANT_MAX_TOKENS, Int8Linear, Q4Linear, check_weight_format, quantize_model,
                                   unpack_q4_1)
from nanoserve.student import implementation
from tests.test_student import exercises, finish  # noqa: F401  (a fixture, and a helper that finishes rungs)

Q4_1 = GGMLQuantizationType.Q4_1


def quant():
    return implementation("nanoserve.model.quant")


def q4_1_blocks(w: np.ndarray) -> torch.Tensor:
    """(out, in) float32 -> the GGUF's Q4_1 bytes (out, in/32, 20), made by the gguf package."""
    return torch.from_numpy(gguf_quantize(w, Q4_1).reshape(w.shape[0], -1, 20))


def bf16_close(y: torch.Tensor, ref: torch.Tensor, rel: float):
    """|y − ref| within `rel` of the output's scale: bf16 has 8 bits of mantissa (2^-8 = 0.4 %)."""
    err = (y.float() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err:.4g} vs max |ref| {ref.abs().max().item():.4g}"


# ---- 10.1: int8 per output channel --------------------------------------------------------------------

@pytest.mark.exercise("10.1")
def test_int8_by_hand():
    w = torch.tensor([[0.5, -1.27, 0.01], [0.0, 0.0, 0.0], [2.54, 1.0, -2.0]])
    q, scale = quant().quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (3,)
    s = torch.tensor([1.27 / 127, 0.0, 2.54 / 127]).to(torch.bfloat16).float()  # rounded to bf16 first
    assert torch.equal(scale.float()[[0, 2]], s[[0, 2]])
    expected = torch.round(w[[0, 2]] / s[[0, 2], None]).clamp(-127, 127)
    assert torch.equal(q[[0, 2]].float(), expected)
    assert q[0].tolist() == [50, -127, 1] and q[1].tolist() == [0, 0, 0]  # an all-zero row stays zero, no NaN


@pytest.mark.exercise("10.1")
def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.rand(64, 1) * 3
    q, scale = quant().quantize_int8(w)
    assert int(q.abs().max()) <= 127
    w_hat = quant().dequantize_int8(q, scale)
    assert w_hat.dtype == torch.float32 and torch.equal(w_hat, q.float() * scale.float()[:, None])
    step = scale.float()[:, None]
    assert ((w_hat - w).abs() <= step / 2 + 1e-6).all()  # rounding to the nearest step, or the clamp at 127


# ---- 10.2: Q4_1 blocks ----------------------------------------------------------------------------------

@pytest.mark.exercise("10.2")
def test_unpack_q4_1_gives_the_quantizers_integers_scales_and_minimums():
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    q, d, m = quant().unpack_q4_1(q4_1_blocks(w))
    assert q.shape == (16, 64) and q.dtype == torch.uint8 and d.shape == m.shape == (16, 2)
    # What gguf's Q4_1 quantizer computes, written out: per block of 32, d = (max - min) / 15 stored as float16,
    # m = min stored as float16, q = trunc((w - min) / d + 0.5) with the unrounded d.
    blocks = w.reshape(16, 2, 32)
    lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
    d_exact = (hi - lo) / 15
    q_expected = np.trunc((blocks - lo) * (1 / d_exact) + np.float32(0.5)).clip(0, 15).reshape(16, 64)
    assert np.array_equal(q.numpy(), q_expected.astype(np.uint8))
    assert np.array_equal(d.numpy(), d_exact[..., 0].astype(np.float16).astype(np.float32))
    assert np.array_equal(m.numpy(), lo[..., 0].astype(np.float16).astype(np.float32))


@pytest.mark.exercise("10.2")
def test_q4_1_values_equal_ggufs_own_dequantization_exactly():
    w = np.random.default_rng(1).standard_normal((32, 96)).astype(np.float32)
    blocks = q4_1_blocks(w)
    q, d, m = quant().unpack_q4_1(blocks)
    theirs = gguf_dequantize(blocks.numpy().reshape(32, -1), Q4_1)  # (32, 96)
    ours = d.repeat_interleave(32, dim=1) * q.float() + m.repeat_interleave(32, dim=1)
    assert np.array_equal(ours.numpy(), theirs)


@pytest.mark.exercise("10.2")
def test_unpack_q4_1_refuses_other_shapes():
    with pytest.raises(ValueError, match="20"):
        quant().unpack_q4_1(torch.zeros(4, 2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quant().unpack_q4_1(torch.zeros(4, 2, 20, dtype=torch.int32))


# ---- 10.3: Q4_1 onto torch's int4 kernel -------------------------------------------------------------------

@pytest.mark.exercise("10.3")
def test_int4_scale_and_zero_by_hand():
    """d = 0.5, m = -3: every q of 0..15 gives d·q + m through the kernel's (q − 8)·scale + zero."""
    d, m = torch.tensor([[0.5, 2.0]]), torch.tensor([[-3.0, 0.25]])
    scale, zero = quant().int4_scale_and_zero(d, m)
    assert scale.shape == zero.shape == (1, 2)
    assert scale.tolist() == [[0.5, 2.0]] and zero.tolist() == [[1.0, 16.25]]
    q = torch.arange(16, dtype=torch.uint8).repeat(4)[None]  # one row, 2 groups of 32
    w = quant().dequantize_q4(q, scale, zero)
    assert w.dtype == torch.float32 and w.shape == (1, 64)
    assert w[0, :16].tolist() == [0.5 * i - 3 for i in range(16)] and w[0, 32:48].tolist() == [2.0 * i + 0.25 for i in range(16)]


@pytest.mark.exercise("10.3")
def test_kernels_form_equals_ggufs_dequantization():
    """Your scale and zero, put through your kernel rule, give `gguf`'s own float32 weights (up to the float32
    rounding of m + 8d)."""
    w = np.random.default_rng(1).standard_normal((32, 96)).astype(np.float32)
    blocks = q4_1_blocks(w)
    q, d, m = unpack_q4_1(blocks)
    theirs = torch.from_numpy(gguf_dequantize(blocks.numpy().reshape(32, -1), Q4_1))
    torch.testing.assert_close(quant().dequantize_q4(q, *quant().int4_scale_and_zero(d, m)), theirs, rtol=0, atol=1e-6)


@pytest.mark.exercise("10.3")
def test_torchs_int4_kernel_with_your_scale_and_zero_computes_the_files_weights():
    """The mapping serves: a Q4Linear built with YOUR int4_scale_and_zero multiplies x by the file's weights
    through torch's int4 kernel, within the bf16 rounding of x, the scales, the zeros and the output."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 128)).astype(np.float32) + 2.0  # groups far from zero: zero ≠ m
    blocks = q4_1_blocks(w)
    layer = Q4Linear(blocks, "test.q4", unpack_q4_1, quant().int4_scale_and_zero)
    x = torch.from_numpy(rng.standard_normal((3, 128)).astype(np.float32))
    w_gguf = torch.from_numpy(gguf_dequantize(blocks.numpy().reshape(48, -1), Q4_1))
    bf16_close(layer(x), x.to(torch.bfloat16).float() @ w_gguf.t(), 2**-6)


# ---- the layers against plain-torch references ------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 7, QUANT_MAX_TOKENS, QUANT_MAX_TOKENS + 1, 200])
def test_int8_linear_equals_dequantize_then_matmul(tokens):
    g = torch.Generator().manual_seed(tokens)
    w, x = torch.randn(96, 64, generator=g), torch.randn(tokens, 64, generator=g)
    layer = Int8Linear.from_float(w, "test.int8")
    q, scale = layer.qweight, layer.scale
    w_hat = q.float() * scale.float()[:, None]  # written out, in float32
    if tokens > QUANT_MAX_TOKENS:  # the prefill path multiplies a bf16 copy of it
        w_hat = w_hat.to(torch.bfloat16).float()
    ref = x.to(torch.bfloat16).float() @ w_hat.t()
    y = layer(x)
    assert y.shape == (tokens, 96) and y.dtype == torch.float32
    bf16_close(y, ref, 2**-8)
    bf16_close(y, F.linear(x, w), 0.02)  # and near the float32 product (int8 + bf16 rounding)


@pytest.mark.parametrize("tokens", [1, 7, QUANT_MAX_TOKENS, QUANT_MAX_TOKENS + 1, 200])
def test_q4_linear_equals_ggufs_dequantized_weights_times_x(tokens):
    rng = np.random.default_rng(tokens)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    blocks = q4_1_blocks(w)
    layer = Q4Linear(blocks, "test.q4")
    x = torch.from_numpy(rng.standard_normal((tokens, 128)).astype(np.float32))
    w_gguf = torch.from_numpy(gguf_dequantize(blocks.numpy().reshape(48, -1), Q4_1))
    y = layer(x)
    assert y.shape == (tokens, 48) and y.dtype == torch.float32
    # bf16 input and output rounding, and the bf16 scales and zeros of the kernel (2^-8 relative each)
    bf16_close(y, x.to(torch.bfloat16).float() @ w_gguf.t(), 2**-7)


def test_q4_linear_keeps_the_files_integers_and_the_kernels_scales():
    w = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    blocks = q4_1_blocks(w)
    layer = Q4Linear(blocks, "test.q4")
    q, d, m = unpack_q4_1(blocks)
    assert torch.equal(layer.blocks, blocks) and torch.equal(layer.unpacked(), q)
    scale, zero = layer.scale_and_zero.transpose(0, 1).unbind(-1)  # (out, in/32) each, bf16
    assert torch.equal(scale, d.to(torch.bfloat16)) and torch.equal(zero, (m + 8 * d).to(torch.bfloat16))


@pytest.mark.parametrize("make", ["int8", "q4"])
def test_kernel_rows_do_not_depend_on_the_batch_up_to_quant_max_tokens(make):
    """Batch invariance of the layer: every row i of a 64-row product is the same bits as row i alone.
    Beyond QUANT_MAX_TOKENS the layer takes the other path (dequantize + F.linear): same inputs and
    weights, other order of additions, so equal only to float rounding — that is where it cannot hold."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    layer = Int8Linear.from_float(w) if make == "int8" else Q4Linear(q4_1_blocks(w.numpy()))
    x = torch.randn(QUANT_MAX_TOKENS + 1, 128, generator=g)
    batched = layer(x[:QUANT_MAX_TOKENS])
    for i in range(QUANT_MAX_TOKENS):
        assert torch.equal(layer(x[i:i + 1]), batched[i:i + 1]), i
    other_path = layer(x)[:QUANT_MAX_TOKENS]
    bf16_close(other_path, batched, 2**-7)


SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}


NO_CPU_DOT = pytest.mark.skipif(not cpu_dot.available(), reason=f"kernels/cpu_dot.c does not build here "
                                f"({cpu_dot.build_error()}): install gcc with OpenMP (Debian: build-essential)")


@pytest.mark.parametrize("integer_dot", [False, pytest.param(True, marks=NO_CPU_DOT)], ids=["torch", "cpu_dot"])
@pytest.mark.parametrize("make, shape", [(f, s) for f in ("int8", "q4") for s in SHAPES.values()] + [("int8", (49152, 576))],
                         ids=[f"{f}-{n}" for f in ("int8", "q4") for n in SHAPES] + ["int8-lm_head"])
def test_kernel_rows_do_not_depend_on_the_batch_at_the_models_shapes(make, shape, integer_dot):
    """The same at SmolLM2's product shapes (the LM head is int8 in both formats), 16 rows, with torch's kernels
    and with kernels/cpu_dot.c's integer products (the small-step kernel where the CPU has no native bf16, and
    q4's in chapter 09's native step; the C code multiplies tokens in tiles of 8 and its own threads split the
    rows, so a row alone and a row in a tile must still get the same bits): torch promises no batch invariance
    for any kernel, and cpu_dot.c none of its own, so this is what the chapter's claim rests on, checked on the
    CPU the tests run on."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g) * 0.02
    layer = Int8Linear.from_float(w) if make == "int8" else Q4Linear(q4_1_blocks(w.numpy()))
    layer.integer_dot = integer_dot
    x = torch.randn(16, shape[1], generator=g)
    with torch.inference_mode():
        batched = layer(x)
        for i in range(16):
            assert torch.equal(layer(x[i:i + 1]), batched[i:i + 1]), i


def at_threads(n: int, f):
    """f() computed with torch's CPU pool at n threads (the pool put back afterwards)."""
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return f()
    finally:
        torch.set_num_threads(was)


def paged_pool(lens: list[int], H: int = 9, Hkv: int = 3, D: int = 64, bs: int = 16):
    """SmolLM2's heads, 16-token blocks: a pool holding random K/V for sequences of these lengths, their block
    tables, and a random query per position of each (len(lens), max(lens), H, D)."""
    from nanoserve.kv.paged_attention import PagedKVCache

    torch.manual_seed(0)
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // bs))))
        first += len(tables[-1])
    cache = PagedKVCache(num_layers=1, num_blocks=first, block_size=bs, num_kv_heads=Hkv, head_dim=D)
    cache.k_cache[0].normal_(), cache.v_cache[0].normal_()
    return cache, tables, torch.randn(len(lens), max(lens), H, D)


def test_the_decode_group_alone_and_beside_others():
    """DecodeGroup itself (notebook 10's section 5 writes its call out on contiguous tensors): a 20-token
    sequence's decode attention alone and beside others. Padding gets no weight, so the output beside others stays
    within float32 rounding of the one alone; whether its bits are the same is the CPU's kernel's, and may change
    with the threads: printed under pytest -s at one thread and at two, for chapter 10's section 5."""
    from nanoserve.kv.paged_attention import AttentionMetadata, DecodeGroup

    lens = [20, 40, 7, 33, 20, 20, 20]  # sequence 0 is the one watched
    cache, tables, queries = paged_pool(lens)
    q = queries[:, 0]  # one query per sequence

    def attend(seqs):  # one decode step of these sequences, one query each -> (len(seqs), H, D)
        meta = AttentionMetadata.build([tables[i] for i in seqs], [lens[i] for i in seqs], [1] * len(seqs), 16)
        return DecodeGroup(cache, meta, list(range(len(seqs)))).attend(q[seqs], cache.k_cache[0], cache.v_cache[0])

    for threads in (1, 2):
        alone = at_threads(threads, lambda: attend([0])[0])
        for others in ([1], [1, 2, 3], [4, 5, 6]):
            together = at_threads(threads, lambda: attend([0] + others)[0])
            print(f"{threads} thread(s): DecodeGroup, 20 tokens beside {str([lens[i] for i in others]):14s} "
                  f"same bits as alone: {torch.equal(alone, together)}  "
                  f"(largest difference {(alone - together).abs().max():.1e})")
            torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_a_prefill_row_in_chunks_of_other_sizes():
    """attend_sequence, the prefill's attention: the last query of a 40-token prompt (position 39) computed as the
    last row of a 16-, an 8- and a 1-row chunk over the same 40 keys. A chunk's size depends on the step's other
    requests under a token budget (chapter 06's chunked prefill), so this row can be computed either way. The rows
    agree within float32 rounding; whether bit for bit is the CPU's kernel's, printed under pytest -s at one thread
    and at two, for chapter 10's section 5."""
    from nanoserve.kv.paged_attention import attend_sequence
    from nanoserve.model.attention import causal_mask

    cache, tables, queries = paged_pool([40])
    table, S = torch.tensor(tables[0]), 40

    def last_row(T):  # position 39 as the last of a T-row chunk -> (H, D)
        return attend_sequence(queries[0, S - T:S], cache.k_cache[0], cache.v_cache[0], table, S,
                               causal_mask(T, S))[-1]

    for threads in (1, 2):
        in_16 = at_threads(threads, lambda: last_row(16))
        for T in (8, 1):
            other = at_threads(threads, lambda: last_row(T))
            print(f"{threads} thread(s): prefill row 39 of 40, a {T}-row chunk against a 16-row one, same bits: "
                  f"{torch.equal(in_16, other)}  (largest difference {(in_16 - other).abs().max():.1e})")
            torch.testing.assert_close(other, in_16, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", ["int8", "q4"])
def test_llms_crossover_runs_a_16_token_step_on_the_kernel_and_17_on_the_copy(make):
    """LLM's default (set_kernel_crossover with the copy): a step of 16 tokens, every batch-16 decode step, runs
    the integer kernel; one token more, the GEMM on the kept large-step copy. Bit for bit, and the two paths give
    other bits on these inputs, so the check tells them apart."""
    from nanoserve.model.quant import KERNEL_CROSSOVER_TOKENS, LARGE_STEP_DTYPE, set_kernel_crossover

    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g)
    layer = Int8Linear.from_float(w) if make == "int8" else Q4Linear(q4_1_blocks(w.numpy()))
    set_kernel_crossover(torch.nn.Sequential(layer))
    assert KERNEL_CROSSOVER_TOKENS == layer.max_kernel_tokens == 16 and layer.large_step_copy is not None
    x = torch.randn(17, 128, generator=g)
    with torch.inference_mode():
        kernel = layer.kernel(x[:16]).float()
        gemm = F.linear(x.to(LARGE_STEP_DTYPE), layer.large_step_copy).float()  # (17, 64)
        assert not torch.equal(kernel, gemm[:16])
        assert torch.equal(layer(x[:16]), kernel)
        assert torch.equal(layer(x), gemm)


def test_unsupported_shapes_and_formats_name_the_layer():
    w = np.random.default_rng(0).standard_normal((24, 64)).astype(np.float32)  # 24 rows: not a multiple of 16
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj.*divisible by 16"):
        Q4Linear(q4_1_blocks(w), "layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="layers.1.self_attn.q_proj"):
        Q4Linear(torch.zeros(16, 2, 18, dtype=torch.uint8), "layers.1.self_attn.q_proj")
    with pytest.raises(ValueError, match="lm_head"):
        Int8Linear(torch.zeros(4, 4), torch.ones(4), "lm_head")  # float, not int8
    with pytest.raises(ValueError, match="known: fp32, int8, q4"):
        check_weight_format("int4")


# ---- a whole tiny model -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair():
    """A tiny float32 Llama whose weights are Q4_1 values, and the Q4_1 blocks they came from."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    blocks = {}
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                blocks[name] = q4_1_blocks(module.weight.numpy())
                module.weight.copy_(torch.from_numpy(gguf_dequantize(blocks[name].numpy().reshape(len(module.weight), -1), Q4_1)))
    return model, blocks


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_quantized_tiny_model_stays_near_float32(tiny_pair, weights):
    import copy

    model, blocks = tiny_pair
    qmodel = quantize_model(copy.deepcopy(model), weights, blocks)
    assert qmodel.weight_format == weights
    assert qmodel.lm_head.qweight is qmodel.embed_tokens.qweight  # tied: one int8 matrix read both ways
    kinds = {type(m).__name__ for n, m in qmodel.named_modules() if n.endswith("_proj")}
    assert kinds == {"Q4Linear" if weights == "q4" else "Int8Linear"}
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for n in (5, 80):  # the kernel path and the dequantize path
            ref, got = model.compute_logits(model(ids[:n])), qmodel.compute_logits(qmodel(ids[:n]))
            assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("weights", ["fp32", "int8", "q4", "bf16"])
@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_formula_matches_the_tensors_a_step_reads(tiny_pair, weights, tied):
    """memory.weight_bytes (counted from the config) == decode_bytes (counted over the model's tensors), plus an
    untied model's embedding table: held, but a decode step reads only a row of it."""
    import copy
    import dataclasses

    from nanoserve.memory import weight_bytes
    from nanoserve.model.quant import decode_bytes

    config = dataclasses.replace(LlamaConfig.tiny(), tie_word_embeddings=tied)
    model = Llama(config).eval()
    model.load_state_dict(copy.deepcopy(tiny_pair[0].state_dict()))  # untied: the head starts as the embedding's copy
    model = quantize_model(model, weights, tiny_pair[1])
    table = [*model.embed_tokens.parameters(), *model.embed_tokens.buffers()]  # weight, or qweight and scale
    embedding = 0 if tied else sum(t.numel() * t.element_size() for t in table)
    assert tied or embedding >= config.vocab_size * config.hidden_size  # at least a byte per weight
    assert decode_bytes(model) + embedding == weight_bytes(config, weights)


def test_q4_without_blocks_names_the_layer(tiny_pair):
    import copy

    with pytest.raises(ValueError, match="layers.0.self_attn.qkv_proj.*Q4_1"):
        quantize_model(copy.deepcopy(tiny_pair[0]), "q4", {})


def test_llm_and_cli_refuse_unknown_weights_before_loading(tiny_pair, tmp_path, capsys):
    from nanoserve.cli import main
    from nanoserve.llm import LLM

    with pytest.raises(ValueError, match="known: fp32, int8, q4"):
        LLM(weights="int3")  # raised before the GGUF is opened
    with pytest.raises(ValueError, match="already loaded as 'fp32'"):
        LLM(tiny_pair[0], weights="q4")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    for argv in (["batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--weights", "fp8"],
                 ["generate", "--prompt", "hi", "--weights", "fp8"]):
        with pytest.raises(SystemExit) as exit:  # refused while argparse reads the command line
            main(argv)
        assert exit.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "unknown weights 'fp8'; known: fp32, int8, q4" in err[0]


def test_info_says_which_kernels_and_which_step_this_cpu_runs(capsys):
    """`info` names the small steps' kernel and the path of q4's steps of one token per sequence (and how many sequences) as LLM's defaults choose them on
    this CPU: cpu_dot.c where quant.default_integer_dot() says so, and chapter 09's native step (int8 activations,
    on every CPU where it builds, whatever the small-step kernel) where cpu_decode.default_native_decode does."""
    from nanoserve.cli import main
    from nanoserve.kernels import cpu_decode
    from nanoserve.model.quant import default_integer_dot

    assert main(["info"]) in (0, None)
    out = capsys.readouterr().out.splitlines()
    kernel = next(line for line in out if line.startswith("  the integer kernel: "))
    step = next(line for line in out if line.startswith("  q4's steps of one token per sequence"))
    assert ("cpu_dot.c" in kernel) == default_integer_dot()
    assert ("kernels/cpu_decode.c" in step) == cpu_decode.default_native_decode("q4", None)
    assert ("the model's forward, with the kernel above" in step) == (not cpu_decode.available())
    assert ("(up to 16 sequences)" in step) == default_integer_dot()  # cpu_decode.max_rows on LLM's defaults


def test_llm_refuses_crossover_settings_it_cannot_honour(tiny_pair):
    """kernel_crossover_tokens and large_step_weights choose between an int8 / q4 layer's kernel and its GEMM:
    an unknown value, or either one where there is no such choice (fp32, bf16, a model already loaded), is a
    ValueError before any model loads (nothing here opens the GGUF)."""
    from nanoserve.llm import LLM

    with pytest.raises(ValueError, match="unknown large_step_weights 'both'; known: dequantize, copy"):
        LLM(weights="q4", large_step_weights="both")
    with pytest.raises(ValueError, match="kernel_crossover_tokens must be an int >= 0, got -1"):
        LLM(weights="int8", kernel_crossover_tokens=-1)
    for weights in (None, "fp32", "bf16"):
        for settings in ({"kernel_crossover_tokens": 8}, {"large_step_weights": "dequantize"},
                         {"kernel_crossover_tokens": 8, "large_step_weights": "bogus"}):
            with pytest.raises(ValueError, match=f"weights='{weights or 'fp32'}' has no integer kernel"):
                LLM(weights=weights, num_blocks=8, **settings)
    with pytest.raises(ValueError, match="a model given keeps what quant.set_kernel_crossover made of it"):
        LLM(tiny_pair[0], kernel_crossover_tokens=8)


def test_quantize_model_makes_the_weights_with_the_functions_it_is_given(tiny_pair):
    """The plug for exercise 10 (LLM(student=True) passes the learner's module): every weight comes from it,
    and the bf16 weight of a large step (a copy made once, as LLM keeps it, or per step) from its dequantize."""
    import copy
    from types import SimpleNamespace

    from nanoserve.model import quant as reference
    from nanoserve.model.quant import set_kernel_crossover

    calls = []
    def counted(fn):
        return lambda *a: calls.append(fn.__name__) or fn(*a)
    names = ["quantize_int8", "dequantize_int8", "unpack_q4_1", "int4_scale_and_zero", "dequantize_q4"]
    functions = SimpleNamespace(**{name: counted(getattr(reference, name)) for name in names})
    model = quantize_model(copy.deepcopy(tiny_pair[0]), "q4", tiny_pair[1], functions)
    assert calls.count("unpack_q4_1") == calls.count("int4_scale_and_zero") == 8  # 2 layers x 4 (qkv_proj, o_proj, gate_up_proj, down_proj)
    assert calls.count("quantize_int8") == 1 and len(calls) == 17  # the tied embedding and head; nothing dequantized yet
    calls.clear()
    set_kernel_crossover(model, large_step_weights="dequantize")
    ids = torch.arange(QUANT_MAX_TOKENS + 1)
    with torch.inference_mode():
        model(ids[:QUANT_MAX_TOKENS])  # every product in the kernel
        assert calls == []
        model.compute_logits(model(ids))  # every product on a bf16 weight dequantized for this step
    assert sorted(calls) == ["dequantize_int8"] + ["dequantize_q4"] * 8
    calls.clear()
    set_kernel_crossover(model)  # LLM's default: one bf16 copy per weight, made now (the tied head's once)
    assert sorted(calls) == ["dequantize_int8"] + ["dequantize_q4"] * 8
    calls.clear()
    quantize_model(copy.deepcopy(tiny_pair[0]), "int8", None, functions)
    assert calls == ["quantize_int8"] * 9


def test_a_learners_q4_reading_keeps_torchs_kernel(tiny_pair, exercises):
    """--student 10 with only 10.2 done: the learner's unpack_q4_1 makes the packed integers torch's int4 kernel
    reads, so the q4 layers keep that kernel (cpu_dot.c reads the file's bytes itself and would bypass it); the
    LM head's int8 rows are the reference's quantize_int8's either way, so it may take cpu_dot."""
    import copy

    from nanoserve.student import StudentCode, unfinished

    path = finish("nanoserve.model.quant", ["unpack_q4_1"])
    assert set(unfinished(path)) == {"Exercise 10.1", "Exercise 10.3"}
    code = StudentCode("10")
    with pytest.warns(UserWarning, match="not finished"):
        functions = code.module("nanoserve.model.quant")
    model, blocks = tiny_pair
    theirs = quantize_model(copy.deepcopy(model), "q4", blocks, functions, integer_dot=True)
    projections = [m for name, m in theirs.named_modules() if name.endswith("_proj")]
    assert projections and not any(m.integer_dot for m in projections)
    assert code.calls["unpack_q4_1"] == len(projections)
    ours = quantize_model(copy.deepcopy(model), "q4", blocks, integer_dot=True)
    assert all(m.integer_dot for name, m in ours.named_modules() if name.endswith("_proj"))


def test_a_finished_rung_of_exercise_10_builds_the_served_weights(tiny_pair, exercises):
    """--student 10 with 10.3 done and 10.1, 10.2 stubbed: the learner's int4_scale_and_zero makes every q4
    layer's kernel scales and their dequantize_q4 the bf16 copy a large step multiplies, the reference's
    unpack_q4_1 and quantize_int8 the rest; the logits equal the reference's exactly, on the kernel path and on
    the copy (the same numbers, computed by the same code)."""
    import copy

    from nanoserve.model.quant import KERNEL_CROSSOVER_TOKENS, set_kernel_crossover
    from nanoserve.student import StudentCode, unfinished

    path = finish("nanoserve.model.quant", ["int4_scale_and_zero", "dequantize_q4"])
    assert set(unfinished(path)) == {"Exercise 10.1", "Exercise 10.2"}
    code = StudentCode("10")
    with pytest.warns(UserWarning, match="Exercise 10.1, Exercise 10.2 not finished"):
        functions = code.module("nanoserve.model.quant")
    model, blocks = tiny_pair
    # the learner's mapping is what torch's int4 kernel reads: with it the q4 layers keep that kernel even when
    # cpu_dot.c's integer products (which read the file's d and m themselves) are asked for; the reference's take them
    asked = [quantize_model(copy.deepcopy(model), "q4", blocks, f, integer_dot=True) for f in (functions, None)]
    assert [[m.integer_dot for name, m in q.named_modules() if name.endswith("_proj")] for q in asked] == \
        [[False] * 8, [True] * 8]
    code.calls.clear()
    theirs = quantize_model(copy.deepcopy(model), "q4", blocks, functions, integer_dot=False)
    ours = quantize_model(copy.deepcopy(model), "q4", blocks, integer_dot=False)  # the same kernels, the reference's code
    set_kernel_crossover(theirs), set_kernel_crossover(ours)  # as LLM(weights="q4") serves
    assert code.calls["int4_scale_and_zero"] == 8 and code.calls["dequantize_q4"] == 8  # 2 layers x 4 products
    assert "int4_scale_and_zero, dequantize_q4" in code.describe() and "(Exercise 10.2 not finished)" in code.describe()
    for n in (4, KERNEL_CROSSOVER_TOKENS + 1):  # the kernel, then the bf16 copy
        ids = torch.arange(n) * 7 % 256
        assert torch.equal(theirs.compute_logits(theirs(ids)), ours.compute_logits(ours(ids)))
