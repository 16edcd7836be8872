"""The fast paths against the float32 oracle, greedy, on real prompts: bf16 weights (every product a bf16
GEMM) and q4 with the kernel crossover (the small-step kernel — torch's int4, or kernels/cpu_dot.c's integer
products where quant.default_integer_dot — for small steps, a GEMM in quant.LARGE_STEP_DTYPE for large ones, with the weight dequantized per step or kept as a copy), each also on a bf16 KV pool (kv_cache_dtype="bf16"), and
q4 on a bf16 pool through the compiled step (compile_mode="buckets", chapter 09).

Greedy decoding amplifies a near-tie: once one token differs, the texts part. So the check is per token,
teacher-forced: float32 reads the fast path's own output, and wherever the fast path picked another token
than float32's argmax, float32 must have found the two nearly tied — its logit for the fast path's token
within MARGIN of its best. Stated margins (logits of SmolLM2 span about ±40): bf16 1.0, q4 2.5 (chapter 10's
|Δlogit| bounds for q4, tests/test_ch10_model.py: 2.0 with torch's kernel, 2.5 with cpu_dot.c's; a tie is broken
the other way only where the two logits' errors add up to their gap, so the margin is not tighter than the bound)."""

import pytest
import torch
from torch.nn import functional as F

from nanoserve.bench.quality import CHAT_PROMPTS, greedy_outputs

PROMPTS, NEW_TOKENS = CHAT_PROMPTS[:8], 16


def near_tie_violations(oracle, tokenizer, outputs, margin):
    """[(prompt, position, gap)] where the fast path chose a token float32 rates more than `margin` below its best."""
    bad = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        with torch.inference_mode():
            logits = oracle.compute_logits(oracle(torch.tensor(ids + out)))[len(ids) - 1:-1]  # (NEW_TOKENS, vocab)
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]  # 0 where they agree
        bad += [(i, int(p), round(float(gap[p]), 3)) for p in torch.nonzero(gap > margin).flatten()]
    return bad


@pytest.fixture(scope="module")
def fp32_outputs(smollm2, smollm2_tokenizer):
    return greedy_outputs(smollm2, smollm2_tokenizer, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("weights, large_step_weights, kv_cache_dtype, margin, compile_mode",
                         [("bf16", None, "auto", 1.0, "eager"), ("q4", "dequantize", "auto", 2.5, "eager"),
                          ("q4", "copy", "auto", 2.5, "eager"), ("bf16", None, "bf16", 1.0, "eager"),
                          ("q4", "copy", "bf16", 2.5, "eager"), ("q4", "copy", "bf16", 2.5, "buckets")])
def test_fast_path_matches_float32_except_near_ties(smollm2, smollm2_tokenizer, fp32_outputs, weights,
                                                    large_step_weights, kv_cache_dtype, margin, compile_mode):
    from nanoserve.model import load_gguf
    from nanoserve.model.quant import set_kernel_crossover

    model = load_gguf(weights=weights)
    if large_step_weights:
        set_kernel_crossover(model, None, large_step_weights)  # prefill steps take the bf16 GEMM, decodes the kernel
    outputs = greedy_outputs(model, smollm2_tokenizer, PROMPTS, NEW_TOKENS, kv_cache_dtype=kv_cache_dtype,
                             compile_mode=compile_mode)  # "buckets": the compiled step (chapter 09)
    assert near_tie_violations(smollm2, smollm2_tokenizer, outputs, margin) == []
    # and the check can fail: float32's own outputs pass at margin 0.01 (the batched engine adds in another order), a shifted copy does not
    assert near_tie_violations(smollm2, smollm2_tokenizer, fp32_outputs, 0.01) == []
    shifted = [o[1:] + o[:1] for o in fp32_outputs]
    assert near_tie_violations(smollm2, smollm2_tokenizer, shifted, margin)
    # most prompts give float32's exact text (measured 2026-12: bf16 and q4 agree on most of these 8)
    assert sum(o == f for o, f in zip(outputs, fp32_outputs)) >= 2


# --- cheap checks on tiny random models -------------------------------------------------------------

def test_fused_projections_equal_the_separate_products():
    """qkv_proj / gate_up_proj give exactly the rows of q, k, v / gate, up computed one by one."""
    from tests.tiny_model import tiny_llama

    model = tiny_llama()
    block, state = model.layers[0], model.state_dict()
    assert "layers.0.self_attn.q_proj.weight" in state and "layers.0.mlp.gate_up_proj.weight" not in state
    x = torch.randn(5, model.config.hidden_size)
    q, k, v = (x @ state[f"layers.0.self_attn.{n}_proj.weight"].T for n in "qkv")
    torch.testing.assert_close(block.self_attn.qkv_proj(x), torch.cat([q, k, v], -1))
    gate, up = (x @ state[f"layers.0.mlp.{n}_proj.weight"].T for n in ("gate", "up"))
    torch.testing.assert_close(block.mlp.gate_up_proj(x), torch.cat([gate, up], -1))
    again = tiny_llama()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again.load_state_dict(state)  # the checkpoint's names load back into the fused layers
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


def test_qkv_parallel_rows_are_the_column_slices():
    from nanoserve.distributed.linear import ColumnParallelLinear, QKVParallelLinear

    class Rank:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

    full = {s: torch.randn(n, 8) for s, n in (("q", 12), ("k", 4), ("v", 4))}  # 6 heads, 2 KV heads, D = 2
    for rank in range(3):  # 2 KV slices over 3 ranks: rank r holds slice r·2//3 (shared by ranks 0 and 1)
        tp = Rank(rank, 3)
        layer = QKVParallelLinear(8, 2, 6, 2, tp, num_kv_shards=2, kv_shard=rank * 2 // 3)
        for i, s in enumerate("qkv"):
            layer.weight_loader(full[s], i)
        expected = []
        for s, n in (("q", (None, None)), ("k", (2, rank * 2 // 3)), ("v", (2, rank * 2 // 3))):
            col = ColumnParallelLinear(8, len(full[s]), tp, *n)
            col.weight_loader(full[s])
            expected.append(col.weight.data)
        assert torch.equal(layer.weight.data, torch.cat(expected))


def test_bf16_weights_and_the_kernel_crossover():
    """bf16: every product a bf16 GEMM, near float32. q4/int8 with a kept copy: the kernel up to the crossover,
    the GEMM on the copy beyond, the copy equal to the dequantized weight in LARGE_STEP_DTYPE (bf16 where the CPU
    multiplies bf16 natively, float32 elsewhere)."""
    import copy

    from nanoserve.model.quant import (KERNEL_CROSSOVER_TOKENS, LARGE_STEP_DTYPE, BF16Linear, Int8Linear,
                                       quantize_model, set_kernel_crossover)
    from tests.tiny_model import tiny_llama

    fp32 = tiny_llama()
    bf16 = quantize_model(copy.deepcopy(fp32), "bf16")
    assert all(isinstance(m, BF16Linear) for m in (bf16.layers[0].self_attn.qkv_proj, bf16.lm_head))
    ids = torch.arange(40) % fp32.config.vocab_size
    with torch.inference_mode():
        ref, got = fp32.compute_logits(fp32(ids)), bf16.compute_logits(bf16(ids))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    int8 = quantize_model(copy.deepcopy(fp32), "int8")
    added = set_kernel_crossover(int8, None, "copy")
    layer = int8.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Int8Linear) and layer.max_kernel_tokens == KERNEL_CROSSOVER_TOKENS
    size = LARGE_STEP_DTYPE.itemsize  # bytes per weight of the copy: 2 (bf16) on a CPU with native bf16, else 4
    assert added == sum(size * m.in_features * m.out_features for m in int8.modules() if isinstance(m, Int8Linear)
                        and m.name != "lm_head") + size * int8.lm_head.in_features * int8.lm_head.out_features
    assert torch.equal(layer.large_step_copy, layer.dequantize().to(LARGE_STEP_DTYPE))
    x = torch.randn(KERNEL_CROSSOVER_TOKENS + 1, layer.in_features)
    with torch.inference_mode():
        small = layer(x[:KERNEL_CROSSOVER_TOKENS])
        torch.testing.assert_close(small, layer.kernel(x[:KERNEL_CROSSOVER_TOKENS]).float())
        large = layer(x)
        torch.testing.assert_close(large, F.linear(x.to(LARGE_STEP_DTYPE), layer.large_step_copy).float())
    with pytest.raises(ValueError, match="large_step_weights"):
        set_kernel_crossover(int8, None, "both")


def test_a_bf16_kv_pool_holds_twice_the_blocks_and_attends_like_float32():
    """kv_cache_dtype="bf16": the pool is bf16 (2 bytes per element, so a budget holds twice the blocks), the
    model's activations stay float32, and greedy decoding gives the float32 pool's tokens."""
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.sampling import SamplingParams
    from tests.tiny_model import tiny_llama

    model = tiny_llama()
    engines = {dt: LLMEngine(model, EngineConfig(cache_config=CacheConfig(kv_cache_memory=1 << 20, kv_cache_dtype=dt))) for dt in ("auto", "bf16")}
    pools = {dt: e.executor.workers[0].model_runner.kv_cache for dt, e in engines.items()}
    assert pools["auto"].k_cache[0].dtype == torch.float32 and pools["bf16"].k_cache[0].dtype == torch.bfloat16
    assert pools["bf16"].num_blocks == 2 * pools["auto"].num_blocks
    prompts = [[(7 * i + j) % model.config.vocab_size for j in range(5 + 9 * i)] for i in range(4)]
    outs = {}
    for dt, engine in engines.items():
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        outs[dt] = done
    for rid in outs["auto"]:
        a, b = outs["auto"][rid], outs["bf16"][rid]
        assert a.token_ids == b.token_ids  # a random tiny model has no near-ties at this scale
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(model, EngineConfig(cache_config=CacheConfig(kv_cache_memory=1 << 20, kv_cache_dtype="fp16")))


def test_the_large_step_dtype_follows_the_cpus_bf16_instructions(tmp_path):
    """bf16 only where the kernel's flags list AMX's or AVX-512's bf16 dot products; float32 on an AVX2 CPU and
    where there is no /proc/cpuinfo to read. bf16_instructions names which (AMX first: an AMX CPU lists both),
    what torch's get_cpu_capability() cannot tell apart (AVX512 on either)."""
    from nanoserve.model.quant import bf16_instructions, native_bf16

    cases = {"fpu sse avx2 fma f16c": None, "avx2 avx512f avx512bw avx512_vnni": None,
             "avx2 avx512f avx512_bf16": "avx512_bf16", "avx512f avx512_bf16 amx_tile amx_bf16 amx_int8": "amx_bf16",
             "amx_bf16x": None}
    for flags, instructions in cases.items():
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert bf16_instructions(str(tmp_path / "cpuinfo")) == instructions, flags
        assert native_bf16(str(tmp_path / "cpuinfo")) is (instructions is not None), flags
    assert bf16_instructions(str(tmp_path / "missing")) is None
    assert native_bf16(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_large_step_runs_in_the_large_step_dtype(monkeypatch, dtype):
    """Either CPU's path, on any CPU: the copy is made in LARGE_STEP_DTYPE, and a step wider than the crossover
    multiplies activations in it by the copy (float32: nothing rounded to bf16), the kernel's rows staying bf16."""
    import copy

    from nanoserve.model import quant
    from tests.tiny_model import tiny_llama

    monkeypatch.setattr(quant, "LARGE_STEP_DTYPE", dtype)
    model = quant.quantize_model(copy.deepcopy(tiny_llama()), "int8")
    added = quant.set_kernel_crossover(model)
    layer = model.layers[0].mlp.down_proj
    assert layer.large_step_copy.dtype == dtype and torch.equal(layer.large_step_copy, layer.dequantize().to(dtype))
    assert added == dtype.itemsize * sum(m.in_features * m.out_features for m in model.modules()
                                         if isinstance(m, quant.Int8Linear) and m.name != "lm_head") \
        + dtype.itemsize * model.lm_head.in_features * model.lm_head.out_features
    x = torch.randn(quant.KERNEL_CROSSOVER_TOKENS + 1, layer.in_features)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x.to(dtype), layer.large_step_copy).float())
        small = x[:quant.KERNEL_CROSSOVER_TOKENS]
        assert torch.equal(layer(small), layer.kernel(small).float())
