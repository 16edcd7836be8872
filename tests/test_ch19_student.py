"""Chapter 19: `--student 19` — the learner's finished sgmv, bgmv (19.1, 19.2) and lru_slots (19.3) serve a
mixed batch of two adapters and the base, token for token what the reference serves; an unfinished rung falls
back to the reference with a warning naming it."""

import pytest

from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.config import LoRAConfig
from nanoserve.sampling import SamplingParams
from tests.lora_reference import tiny_llama
from tests.test_student import exercises, finish  # noqa: F401 — the fixture that copies exercises/

REQUESTS = {"r-a": ([5, 17, 99, 3, 42], "a"), "r-b": ([8, 1, 200, 31], "b"), "r-base": ([64, 65, 66], None),
            "r-c": ([7, 7, 9], "c")}


def serve(adapters, **config):
    """Three adapters (c is a again) on max_loras 2: the slots' LRU evicts while the batch mixes them."""
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8),
                                                  **config), eos_token_id=-1)
    for name, path in {**adapters, "c": adapters["a"]}.items():
        engine.add_lora(name, path)
    for rid, (ids, lora) in REQUESTS.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=5), lora_name=lora)
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
    return engine, tokens


def test_finished_19_serves_a_mixed_batch(exercises, tiny_adapters):  # noqa: F811
    _, expected = serve(tiny_adapters)
    exercises("nanoserve.lora.manager")
    finish("nanoserve.lora.punica", ["sgmv", "bgmv"])
    engine, got = serve(tiny_adapters, student="19")
    assert got == expected
    calls = engine.student.calls
    assert calls["sgmv"] > 0 and calls["bgmv"] > 0 and calls["lru_slots"] > 0


def test_unfinished_19_falls_back_with_a_warning(exercises, tiny_adapters):  # noqa: F811
    _, expected = serve(tiny_adapters)
    finish("nanoserve.lora.punica", ["sgmv"])  # 19.2 (bgmv) and 19.3 (lru_slots) still stubs
    with pytest.warns(UserWarning, match=r"Exercise 19\.2"):
        engine, got = serve(tiny_adapters, student="19")
    assert got == expected and engine.student.calls["sgmv"] > 0
