"""Chapter 09 — `bench profile`'s accounting: a step split into the course's parts, and the roofline's cost model
worked out by hand for the tiny config."""

from types import SimpleNamespace

import pytest
import torch

from nanoserve.bench import profile
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.model import Llama, LlamaConfig
from nanoserve.model.layers import Linear


def test_breakdown_of_a_real_step_on_a_tiny_model():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4, enable_prefix_caching=False),
                                           scheduler_config=SchedulerConfig(max_num_seqs=4)))
    original = Linear.forward
    result = profile.profile_batch(SimpleNamespace(engine=engine, model=model), batch=3, prompt_len=8, decode_steps=2, seed=0,
                                   adapters=[None])
    assert Linear.forward is original  # the labels are gone after the profile
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.get_num_free_blocks() == 32  # nothing left in the pool
    for phase, tokens in (("prefill", 24), ("decode", 3)):
        x = result[phase]
        assert x["tokens"] == tokens and x["step_ms"] > 0
        assert set(x["parts_ms"]) == set(profile.PARTS)
        # a labelled range never claims less than its labelled children took: no part goes negative
        assert all(ms >= 0 for ms in x["parts_ms"].values()), x["parts_ms"]
        for part in ("linear", "attention", "K/V gather/store", "norms/RoPE/act", "sampling", "scheduler/Python"):
            assert x["parts_ms"][part] > 0, part  # every part of the step is seen
        assert x["parts_ms"]["LoRA"] == 0  # no adapter, no gather


def test_each_shape_is_timed_warm(monkeypatch):
    """The ms column is each shape's run after a warm-up, never its first: on a fake clock a step costs 1 s the
    first time its token count runs and 0.1 s after, so a prefill timed cold would print 1000 ms, not 100."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4, enable_prefix_caching=False),
                                           scheduler_config=SchedulerConfig(max_num_seqs=4)))
    clock, seen, real_step = [0.0], set(), engine.step

    def step():
        outputs = real_step()
        tokens = engine.last_scheduler_output.total_num_scheduled_tokens
        clock[0] += 0.1 if tokens in seen else 1.0
        seen.add(tokens)
        return outputs

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    result = profile.profile_batch(SimpleNamespace(engine=engine, model=model), batch=3, prompt_len=8, decode_steps=2,
                                   seed=0)
    assert seen == {24, 3}  # a prefill of 3 × 8 tokens, decodes of 3
    assert result["prefill"]["step_ms"] == pytest.approx(100) and result["decode"]["step_ms"] == pytest.approx(100)


def test_the_sampling_part_runs_the_sampler_the_flags_ask_for(monkeypatch):
    """Chapter 03: by default every request is greedy, so the "sampling" part never reaches top-p; with a temperature
    and a top-p every row of every step (warm-up, timed and profiled: 3 × 3 steps × 3 rows) goes through top-p."""
    import nanoserve.sampling

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4, enable_prefix_caching=False),
                                           scheduler_config=SchedulerConfig(max_num_seqs=4)))
    calls, top_p_filter = [], nanoserve.sampling.top_p_filter
    monkeypatch.setattr(nanoserve.sampling, "top_p_filter", lambda logits, p: calls.append(p) or top_p_filter(logits, p))
    llm = SimpleNamespace(engine=engine, model=model)
    profile.profile_batch(llm, batch=3, prompt_len=8, decode_steps=2, seed=0)
    assert calls == []
    result = profile.profile_batch(llm, batch=3, prompt_len=8, decode_steps=2, seed=0, temperature=1.0, top_p=0.9)
    assert calls == [0.9] * 27
    assert result["decode"]["parts_ms"]["sampling"] > 0


def test_the_lora_share_is_its_gathers(tiny_adapters):
    """Chapter 19: with adapters mixed in the batch, LoRAMapping.apply's time is the LoRA part, taken out of the
    ranges around it; a batch of the base model alone on the same engine spends none there."""
    from nanoserve.engine.config import LoRAConfig, engine_config
    from tests.lora_reference import tiny_llama

    model = tiny_llama()
    engine = LLMEngine(model, engine_config(num_blocks=32, block_size=4, enable_prefix_caching=False, max_num_seqs=4,
                                            lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)), eos_token_id=-1)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    llm = SimpleNamespace(engine=engine, model=model)
    mixed = profile.profile_batch(llm, batch=3, prompt_len=8, decode_steps=2, seed=0, adapters=["a", "b", None])
    alone = profile.profile_batch(llm, batch=3, prompt_len=8, decode_steps=2, seed=0, adapters=[None])
    for phase in ("prefill", "decode"):
        assert mixed[phase]["parts_ms"]["LoRA"] > 0 and alone[phase]["parts_ms"]["LoRA"] == 0
        assert all(ms >= 0 for ms in mixed[phase]["parts_ms"].values()), mixed[phase]["parts_ms"]
    assert engine.block_manager.get_num_free_blocks() == 32 and not engine.has_unfinished_requests()


def test_step_cost_by_hand():
    # tiny: 2 layers of (attention 2·64·4·16 + 2·64·2·16 = 12,288; MLP 3·64·128 = 24,576; norms 128) = 73,984
    # weights; LM head 256·64 = 16,384; K/V 2·2 layers·2 heads·16·4 B = 512 B per token
    config = LlamaConfig.tiny()
    weights = (73_984 + 16_384) * 4
    # decode, one sequence with 10 keys: 2 FLOPs per weight, 4·L·H·D = 512 FLOPs per (query, key) pair
    assert profile.step_cost(config, 1, 1, [10], 1) == (weights + 10 * 512, 2 * 73_984 + 2 * 16_384 + 512 * 10)
    # prefill of 8 tokens: causal, 8·9/2 = 36 pairs, and only the last row goes through the LM head
    assert profile.step_cost(config, 8, 1, [8], 8) == (weights + 8 * 512, 2 * 8 * 73_984 + 2 * 16_384 + 512 * 36)


def test_bound_by_hand():
    # 1 GB at 10 GB/s = 100 ms, 1 GFLOP at 100 GFLOP/s = 10 ms: memory-bound, at 50 % of the roofline
    phase = {"cost": (1e9, 1e9), "step_ms": 200.0, "parts_ms": {"linear": 90.0, "scheduler/Python": 10.0}}
    b = profile.bound(phase, 10e9, 100e9)
    assert (b["memory_ms"], b["compute_ms"], b["bound"]) == (pytest.approx(100), pytest.approx(10), "memory")
    assert b["of_roofline"] == pytest.approx(0.5) and b["intensity_flop_per_byte"] == 1
    phase["parts_ms"]["scheduler/Python"] = 60.0  # 40 % of the step outside the model: overhead-bound
    assert profile.bound(phase, 10e9, 100e9)["bound"] == "overhead"
    phase = {"cost": (1e9, 1e11), "step_ms": 2000.0, "parts_ms": {"linear": 1.0, "scheduler/Python": 0.0}}
    assert profile.bound(phase, 10e9, 100e9)["bound"] == "compute"
