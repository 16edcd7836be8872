"""Run by tests/test_ch16_torchrun.py under torchrun on each "node": greedy tokens of the tiny model at
tensor-parallel size WORLD_SIZE; rank 0 writes them to argv[1] (the other ranks only serve its steps)."""

import json
import sys

import torch

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 11], [1, 2, 3], list(range(30, 70))]


def greedy_tokens(model, tp_size: int) -> list[list[int]]:
    from nanoserve.distributed.multiproc import start_workers

    workers = None
    if tp_size > 1:
        workers, model = start_workers(model, tp_size)  # under torchrun: ranks > 0 never return
    try:
        engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4),
                                               scheduler_config=SchedulerConfig(max_num_seqs=4)))
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return [done[f"r{i}"] for i in range(len(PROMPTS))]
    finally:
        if workers is not None:
            workers.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    tp_size = int(sys.argv[2])
    tokens = greedy_tokens(tiny_llama(), tp_size)
    with open(sys.argv[1], "w") as f:
        json.dump(tokens, f)
