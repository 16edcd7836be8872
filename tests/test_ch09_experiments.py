"""Chapter 09 — the experiments' engine driver on a tiny random model: arrivals at given steps, one record per
request stamped on one clock, and a per-step trace of the pool and the queues that adds up."""

import pytest
import torch

from nanoserve.bench.experiment import drive, engine_for
from nanoserve.model import Llama, LlamaConfig


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


def test_drive_arrivals_and_records(tiny):
    engine = engine_for(tiny, num_blocks=32, block_size=4, enable_prefix_caching=False)
    records, trace = drive(engine, [(0, "a", [1, 2, 3, 4, 5], 4), (2, "b", [6, 7], 3), (20, "late", [8], 2)])
    a, b, late = records["a"], records["b"], records["late"]
    assert (a.output_tokens, b.output_tokens, late.output_tokens) == (4, 3, 2)
    assert len(a.chunk_times) == 4 and a.end == a.chunk_times[-1]  # one chunk per engine step that sampled
    assert a.prompt_tokens == 5 and a.start <= a.chunk_times[0]
    assert a.chunk_times[1] < b.start < b.chunk_times[0]  # b was added before step 2, after a's second token
    # the engine went idle after step 4; the driver jumps to step 20 instead of spinning through empty steps
    assert [row["step"] for row in trace] == [0, 1, 2, 3, 4, 20, 21]
    assert trace[0]["num_tokens"] == 5 and trace[2]["num_tokens"] == 1 + 2  # a decodes while b prefills
    assert trace[-1]["blocks_used"] == 0 and trace[-1]["running"] == 0


def test_drive_trace_under_an_overloaded_pool(tiny):
    # 6 requests of 6 + 10 tokens = 4 blocks of 4 each at the end, in a pool of 10 blocks: preemptions must happen
    engine = engine_for(tiny, num_blocks=10, block_size=4, enable_prefix_caching=False)
    records, trace = drive(engine, [(0, str(i), [10 + i] * 6, 10) for i in range(6)])
    assert all(r.output_tokens == 10 and r.end is not None for r in records.values())
    assert trace[-1]["preemptions"] > 0
    assert max(row["blocks_used"] for row in trace) <= 10 and any(row["waiting"] for row in trace)
    for row in trace:  # the tokens held always fit in the blocks used
        assert row["tokens_held"] <= row["blocks_used"] * 4
    assert engine.block_manager.get_num_free_blocks() == 10  # every block back at the end


def test_interleaved_alternates_the_order_round_by_round():
    """A, B then B, A then A, B: each system sees the same drift, and none always runs first."""
    from nanoserve.bench.experiment import interleaved

    seen = []
    results = interleaved(3, {"A": 1, "B": 2}, lambda name, system, r: seen.append((r, name)) or system * 10 + r)
    assert seen == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    assert results == {"A": [10, 11, 12], "B": [20, 21, 22]}
