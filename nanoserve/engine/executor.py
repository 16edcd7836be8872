"""Chapter 06 — the executor: the engine's one handle on however many workers there are.

    LLMEngine.step() ─▶ Scheduler.schedule() ─▶ Executor.execute_model() ─▶ Worker(s) ─▶ ModelRunner

With one in-process worker it only forwards calls. With tensor parallelism (chapter 11,
`LLM(tensor_parallel_size=n)`) the one worker here is rank 0 of a process group whose ranks
1 .. n−1 are worker processes (nanoserve/distributed/multiproc.py): the executor tells them to
build their KV pools, rank 0's model runner broadcasts each step's integers to them, every rank
runs its shard, and rank 0 returns the sampled tokens — the engine and the scheduler do not change.
A fault in any rank fails the step with a WorkerError and shuts the group down.
"""

from nanoserve.distributed.parallel_state import INIT_KV_CACHE, get_tp_group
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.worker import Worker


class Executor:
    def __init__(self, workers: list[Worker]):
        if not workers:
            raise ValueError("an Executor needs at least one worker")
        self.workers = workers
        self.tp_group = get_tp_group(workers[0].model)  # size 1 unless it is rank 0's shard (chapter 11)

    def num_blocks_for(self, kv_cache_bytes: int, block_size: int) -> int:
        """The pool must fit on every device: the smallest worker decides."""
        return min(w.num_blocks_for(kv_cache_bytes, block_size) for w in self.workers)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.tp_group.broadcast_command(INIT_KV_CACHE, num_blocks, block_size)  # the worker processes too
        for w in self.workers:
            w.init_kv_cache(num_blocks, block_size)

    # chapter 19: LoRA adapters, registered on every worker (one worker: a tensor-parallel engine has no LoRA)
    def add_lora(self, name: str, path: str):
        return [w.lora_manager.add_adapter(name, path) for w in self.workers][0]

    def remove_lora(self, name: str) -> None:
        for w in self.workers:
            w.lora_manager.remove_adapter(name)

    # chapter 18: the second KV tier lives beside the one worker's pool (single process only)
    def init_kv_tier(self, capacity: int, path: str | None = None) -> int:
        return self.workers[0].init_kv_tier(capacity, path)

    # chapter 19: sleep mode (one worker: the engine refuses it under tensor parallelism)
    def sleep(self, level: int) -> dict[str, int]:
        return self.workers[0].sleep(level)

    def wake_up(self) -> None:
        self.workers[0].wake_up()

    def kv_tier_stats(self):
        """The tier's FileTierStats and the last step's forward seconds (the engine's measured rates)."""
        return self.workers[0].kv_tier.stats, self.workers[0].step_seconds

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def execute_model(self, scheduler_output: SchedulerOutput, degraded: bool = False) -> dict[str, int]:
        try:
            results = [w.execute_model(scheduler_output, degraded) for w in self.workers]
        except Exception as e:
            if self.tp_group.workers is None:
                raise
            raise self.tp_group.workers.fail(e) from e  # a rank died or raised: a WorkerError, the group ended
        return results[0]
