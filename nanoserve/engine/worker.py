"""Chapter 06 — a worker owns one device: the model's weights and the KV block pool on it.

The engine never touches tensors. It asks the worker how many KV blocks fit (so the scheduler's
BlockManager can count them), then hands it one SchedulerOutput per step and gets token ids back.
Here the one worker lives in the engine's process and runs on the CPU. With tensor parallelism
(chapter 11) every rank runs this same class on its shard of every weight and of every KV block:
rank 0 here, the others in their own processes, reached over torch.distributed.
"""

import ctypes
import ctypes.util
from dataclasses import replace

import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.kernels.backend import attention_class
from nanoserve.kv.paged_attention import AttentionMetadata, PagedKVCache, num_blocks_for_budget
from nanoserve.model.compiled import CompiledModel


def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS.

    Why: a prefill step allocates activations of many MB per op (2048 tokens x 1536 floats = 12 MiB)
    and frees them an op later. By default glibc hands such blocks straight back to the kernel, so the
    next op's allocation page-faults every 4 KiB page in again. Measured here on the prefill of
    `bench offline`'s 64 prompts: 0.3–1.8 million page faults before, 19 thousand after, and up to 15 %
    less time. Blocks up to 32 MiB now come from the heap, which keeps up to 1 GiB free. A GPU worker gets
    the same from torch's caching allocator. Returns False where there is no glibc (macOS, musl):
    nothing changes there.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from glibc's <malloc.h>
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


KV_CACHE_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}  # None: the model's


class Worker:
    def __init__(self, model, dtype: torch.dtype | None = None, attention_backend: str = "torch",
                 paged_attention=None, degraded_model=None, paged_kv=None, model_runner_class=ModelRunner,
                 store_kv=None, compile_mode: str = "eager", kv_connector=None):
        """attention_backend: "torch" or "triton" (resolved by the engine: resolve_attention_backend);
        paged_attention, store_kv: the Triton kernel modules for "triton" (None: the reference); paged_kv: chapter 05's
        paged_attention module, whose AttentionMetadata (and PagedAttention, for "torch") the steps use —
        the learner's under --student 05 (None: the reference); model_runner_class: the reference
        ModelRunner, or the learner's (exercise 6.5); compile_mode: "eager", or how the runner's steps run
        compiled (chapter 09, nanoserve/model/compiled.py: "buckets" or "dynamic"); kv_connector: chapter 17's
        KV connector, its worker side (nanoserve/disagg/connector.py), or None."""
        keep_freed_host_memory()
        self.model = model.eval()
        self.degraded_model = degraded_model  # chapter 10: a second, quantized copy of the weights (or None)
        self.dtype = dtype or next(model.parameters()).dtype  # the KV pool's; by default the model's (chapter 09: bf16)
        self.device = next(model.parameters()).device  # the pool lives where the weights do
        self.attention = attention_class(attention_backend, paged_attention, store_kv)
        if paged_kv is not None and attention_backend == "torch":
            self.attention = paged_kv.PagedAttention
        self.metadata = AttentionMetadata if paged_kv is None else paged_kv.AttentionMetadata
        # A tensor-parallel shard (chapter 11) holds only its KV heads: its pool is that of a model with fewer.
        self.kv_config = replace(model.config, num_key_value_heads=model.layers[0].self_attn.num_kv_heads)
        self.model_runner_class = model_runner_class
        # what the runner calls: the model itself, or its compiled forward (the same weights)
        self.step_model = self.model if compile_mode == "eager" else CompiledModel(self.model, compile_mode)
        self.step_degraded = (degraded_model if compile_mode == "eager" or degraded_model is None
                              else CompiledModel(degraded_model, compile_mode))
        self.model_runner: ModelRunner | None = None  # built once the pool is sized
        self.kv_connector = kv_connector

    def num_blocks_for(self, kv_cache_bytes: int, block_size: int) -> int:
        return num_blocks_for_budget(self.kv_config, kv_cache_bytes, block_size, self.dtype)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.kv_config
        cache = PagedKVCache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim, self.dtype,
                             self.device)
        self.model_runner = self.model_runner_class(self.step_model, cache, self.attention, self.step_degraded,
                                                    self.metadata)
        if self.kv_connector is not None:  # it loads before and saves after each decoder layer
            self.kv_connector.register_kv_caches(cache, self.model.layers)

    def execute_model(self, scheduler_output: SchedulerOutput, degraded: bool = False) -> dict[str, int]:
        connector = self.kv_connector
        if connector is None:
            return self.model_runner.execute_model(scheduler_output, degraded)
        # chapter 17, vLLM's order: bind the step's loads and saves, start the loads; the layers' hooks wait for
        # each layer's load and save each layer; then wait for the saves
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            connector.start_load_kv()
            return self.model_runner.execute_model(scheduler_output, degraded)
        finally:
            connector.wait_for_save()
            connector.clear_connector_metadata()
