"""Chapter 10 — degrading under overload, on a tiny random model and its int8 copy (fast).

Hand-computed expectations: with max_num_seqs=1 the queue length of every step is known, so is the mode
the hysteresis rule must pick; with degradation off (or never triggered) every output equals the plain
engine's, token for token, and carries no precision metrics.
"""

import copy

import pytest

from nanoserve.engine.llm_engine import EngineConfig, LLMEngine
from nanoserve.model.quant import quantize_model
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama


@pytest.fixture(scope="module")
def models():
    model = tiny_llama()
    model.weight_format = "fp32"
    return model, quantize_model(copy.deepcopy(model), "int8")


REQUESTS = [[1 + i, 7, 9 + i, 3] for i in range(6)]


def run(engine, max_tokens=4):
    for i, prompt in enumerate(REQUESTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs, modes = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        modes.append((len(engine.scheduler.waiting), engine.degraded))
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks
    return outs, modes


def test_off_or_never_triggered_changes_nothing(models):
    fp32, int8 = models
    config = dict(num_blocks=32, block_size=4, max_num_seqs=1)
    plain, _ = run(LLMEngine(fp32, EngineConfig(**config)))
    assert all("token_precisions" not in o.metrics for o in plain.values())
    high, _ = run(LLMEngine(fp32, EngineConfig(**config, degrade_under_load=100), degraded_model=int8))
    assert {k: o.token_ids for k, o in high.items()} == {k: o.token_ids for k, o in plain.items()}
    assert all(o.metrics["token_precisions"] == ["fp32"] * 4 for o in high.values())


def test_switches_under_load_and_back_with_hysteresis(models):
    fp32, int8 = models
    engine = LLMEngine(fp32, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=1, degrade_under_load=4),
                       degraded_model=int8)
    outs, modes = run(engine)
    # One request runs at a time, 4 tokens each; 5 then 4, 3, ... wait. Degraded from the first step
    # (5 waiting >= 4), and back only once the queue is down to 4 // 2 = 2 — not at 3 (hysteresis).
    for waiting, degraded in modes:
        assert degraded == (waiting > 2), modes
    precisions = [outs[str(i)].metrics["token_precisions"] for i in range(6)]
    assert precisions[0] == ["int8"] * 4 and precisions[-1] == ["fp32"] * 4
    assert all(len(p) == 4 for p in precisions)
    # a request computed wholly in fp32 gets exactly the tokens the plain engine gives it
    plain, _ = run(LLMEngine(fp32, EngineConfig(num_blocks=32, block_size=4, max_num_seqs=1)))
    assert outs["5"].token_ids == plain["5"].token_ids


def test_threshold_and_copy_go_together(models):
    fp32, int8 = models
    with pytest.raises(ValueError, match="go together"):
        LLMEngine(fp32, EngineConfig(num_blocks=8, degrade_under_load=2))
    with pytest.raises(ValueError, match=">= 1"):
        LLMEngine(fp32, EngineConfig(num_blocks=8, degrade_under_load=0), degraded_model=int8)
