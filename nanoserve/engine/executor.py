"""Chapter 06 — the executor: the engine's one handle on however many workers there are.

    LLMEngine.step() ─▶ Scheduler.schedule() ─▶ Executor.execute_model() ─▶ Worker(s) ─▶ ModelRunner

With one in-process worker it only forwards calls. The seam is there for chapter-later
parallelism: a tensor-parallel executor starts one worker per device, broadcasts each
SchedulerOutput to all of them, and returns rank 0's sampled tokens — the engine and the
scheduler do not change.
"""

from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.worker import Worker


class Executor:
    def __init__(self, workers: list[Worker]):
        if not workers:
            raise ValueError("an Executor needs at least one worker")
        self.workers = workers

    def num_blocks_for(self, kv_cache_bytes: int, block_size: int) -> int:
        """The pool must fit on every device: the smallest worker decides."""
        return min(w.num_blocks_for(kv_cache_bytes, block_size) for w in self.workers)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        for w in self.workers:
            w.init_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput, degraded: bool = False) -> dict[str, int]:
        results = [w.execute_model(scheduler_output, degraded) for w in self.workers]
        return results[0]
