"""Chapter 05 — the baseline paging replaces, reserving prompt + max_tokens at admission (kv/reservation.py), by
hand; and the memory-cap comparison of `bench paged-kv --memory-cap-mib` on a tiny random model: the same
requests, the same tokens, fewer running at once and no preemption when reserving, nothing leaked."""

import pytest
import torch

from nanoserve.bench.offline import make_workload
from nanoserve.bench.paged_kv import under_memory_cap
from nanoserve.kv.block_manager import BlockManager
from nanoserve.kv.reservation import ReservingBlockManager
from nanoserve.model import Llama, LlamaConfig


def test_reserves_prompt_plus_max_tokens_at_admission_and_never_grows():
    m = ReservingBlockManager(8, 4, max_total_tokens={"a": 12, "b": 24}.get)
    assert m.allocate_slots("a", list(range(6)), 6) == [0, 1, 2]  # cdiv(6 + 6, 4) = 3 blocks at once
    assert m.get_num_free_blocks() == 5
    for n in range(7, 13):  # decoding up to the reservation takes nothing more
        assert m.allocate_slots("a", list(range(n)), n) == [0, 1, 2]
    assert m.allocate_slots("b", list(range(3)), 3) is None  # 6 blocks wanted, 5 free: it waits
    assert m.get_num_free_blocks() == 5  # (a refusal changes nothing)
    m.free("a")
    assert m.allocate_slots("b", list(range(3)), 3) == [3, 4, 5, 6, 7, 2]  # a's blocks went to the back
    paged = BlockManager(8, 4, enable_prefix_caching=False)
    assert paged.allocate_slots("a", list(range(6)), 6) == [0, 1]  # what paging takes for the same prompt


def test_reservation_admits_fewer_and_never_preempts_under_the_same_cap():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny()).eval()
    workload = make_workload(10, (8, 24), (8, 24), 0, model.config.vocab_size)
    stats = under_memory_cap(model, num_blocks=24, block_size=4, workload=workload)  # asserts no leak itself
    paged, reserved = stats["paged"], stats["reserve prompt+max_tokens"]
    assert paged["output_tokens"] == reserved["output_tokens"] == sum(n for _, n in workload)
    assert reserved["preemptions"] == 0
    # reserving holds cdiv(prompt + max_tokens, 4) blocks per running request for its whole life
    assert reserved["peak_running"] <= 24 // min(-(-(len(p) + n) // 4) for p, n in workload)
    assert paged["mean_running"] > reserved["mean_running"]
    assert paged["peak_running"] > reserved["peak_running"]


def test_the_engine_refuses_a_block_manager_for_another_pool():
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine

    model = Llama(LlamaConfig.tiny()).eval()
    config = EngineConfig(cache_config=CacheConfig(num_blocks=24, block_size=4, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="23 blocks of 4.*24 blocks of 4"):
        LLMEngine(model, config, block_manager=ReservingBlockManager(23, 4, lambda seq_id: 8))
    manager = ReservingBlockManager(24, 4, lambda seq_id: 8)
    assert LLMEngine(model, config, block_manager=manager).scheduler.block_manager is manager
