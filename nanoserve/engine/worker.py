"""Chapter 06 — a worker owns one device: the model's weights and the KV block pool on it.

The engine never touches tensors. It asks the worker how many KV blocks fit (so the scheduler's
BlockManager can count them), then hands it one SchedulerOutput per step and gets token ids back.
Here the one worker lives in the engine's process and runs on the CPU. With tensor parallelism
(chapter 11) every rank runs this same class on its shard of every weight and of every KV block:
rank 0 here, the others in their own processes, reached over torch.distributed.
"""

import ctypes
import ctypes.util
import gc
import time
from contextlib import ExitStack
from dataclasses import replace

import torch

import nanoserve.sampling as reference_sampling
from nanoserve.engine.model_runner import ModelRunner, SampledTokens
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sleep_mode import SleepingWeights
from nanoserve.kernels.backend import attention_class
from nanoserve.kv.file_tier import FileKVTier, block_nbytes
from nanoserve.kv.paged_attention import AttentionMetadata, PagedKVCache, num_blocks_for_budget
from nanoserve.kv.quantized_pool import (KV_QUANT_DTYPES, QuantizedKVCache, QuantizedPagedAttention,
                                         quantized_block_bytes)
from nanoserve.model.compiled import CompiledModel
from nanoserve.spec_decode import acceptance


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


def release_memory() -> None:
    """Collect reference cycles now, then hand the freed heap back to the OS: glibc keeps the freed pages of its heap
    (keep_freed_host_memory asks it to), so the process' RSS would not fall until malloc_trim returns them. After
    a retired engine (chapter 15) or a sleep (chapter 19)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): the memory is free for this process, if not the OS
        pass


# None: the model's; int8 / fp8: 8-bit codes with a scale per token and kv head (chapter 18)
KV_CACHE_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, **KV_QUANT_DTYPES}


def without_failed(sampled: dict, failed: dict[str, Exception]) -> SampledTokens:
    """`sampled` less the sequences in `failed` (no token for them), which join its `failed`."""
    def keep(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in failed}

    return SampledTokens(keep(sampled), keep(getattr(sampled, "logprobs", {})),
                         keep(getattr(sampled, "prompt_logprobs", {})), {**getattr(sampled, "failed", {}), **failed})


class Worker:
    def __init__(self, model, dtype: torch.dtype | None = None, attention_backend: str = "torch",
                 paged_attention=None, degraded_model=None, paged_kv=None, model_runner_class=ModelRunner,
                 store_kv=None, compile_mode: str = "eager", spec_acceptance=acceptance, kv_quant=None,
                 lora_config=None, lora_manager_class=None, punica=None, kv_connector=None, model_loader=None,
                 sampling=reference_sampling):
        """attention_backend: "torch" or "triton" (resolved by the engine: resolve_attention_backend);
        paged_attention, store_kv: the Triton kernel modules for "triton" (None: the reference); paged_kv: chapter 05's
        paged_attention module, whose AttentionMetadata (and PagedAttention, for "torch") the steps use —
        the learner's under --student 05 (None: the reference); model_runner_class: the reference
        ModelRunner, or the learner's (exercise 6.5); compile_mode: "eager", or how the runner's steps run
        compiled (chapter 09, nanoserve/model/compiled.py: "buckets" or "dynamic"); spec_acceptance: chapter 14's
        acceptance module for the runner's verifications (the learner's under --student 14); kv_quant: chapter 18's
        quantize_kv / dequantize_kv module for an int8 / fp8 pool (the learner's under --student 18);
        lora_config: chapter 19's LoRAConfig — the model's projections get LoRA layers and each step sets which
        token uses which adapter;
        lora_manager_class, punica: the LoRAModelManager class and the module of its bgmv / sgmv (the learner's
        under --student 19; None: the reference's); kv_connector: chapter 17's KV connector, its worker side
        (nanoserve/disagg/connector.py), or None; model_loader: a function that builds `model` again from its file
        (chapter 19's sleep level 2 wakes with it; None: level 2 is refused); sampling: chapter 03's sampling module,
        whose sample_batch draws the tokens (the learner's under --student 03)."""
        keep_freed_host_memory()
        self.model = model.eval()
        self.lora_manager = None
        if lora_config is not None:
            from nanoserve.lora.manager import LoRAModelManager

            self.lora_manager = (lora_manager_class or LoRAModelManager)(self.model, lora_config, punica=punica)
        self.degraded_model = degraded_model  # chapter 10: a second, quantized copy of the weights (or None)
        self.dtype = dtype or next(model.parameters()).dtype  # the KV pool's; by default the model's (chapter 09: bf16)
        self.device = next(model.parameters()).device  # the pool lives where the weights do
        self.attention = attention_class(attention_backend, paged_attention, store_kv)
        if paged_kv is not None and attention_backend == "torch":
            self.attention = paged_kv.PagedAttention
        self.metadata = AttentionMetadata if paged_kv is None else paged_kv.AttentionMetadata
        self.model_dtype = next(model.parameters()).dtype
        self.kv_quant = kv_quant
        self.quantized = self.dtype in KV_QUANT_DTYPES.values()
        if self.quantized:  # chapter 18: quantize on store, dequantize in the gather
            self.attention = QuantizedPagedAttention
        self.kv_tier: FileKVTier | None = None  # chapter 18's second tier (init_kv_tier)
        self.step_seconds = 0.0  # the last step's forward pass (the engine's measured prefill rate)
        # A tensor-parallel shard (chapter 11) holds only its KV heads: its pool is that of a model with fewer.
        self.kv_config = replace(model.config, num_key_value_heads=model.layers[0].self_attn.num_kv_heads)
        self.model_runner_class = model_runner_class
        self.spec_acceptance = spec_acceptance
        self.sampling = sampling
        # what the runner calls: the model itself, or its compiled forward (the same weights)
        self.step_model = self.model if compile_mode == "eager" else CompiledModel(self.model, compile_mode)
        self.step_degraded = (degraded_model if compile_mode == "eager" or degraded_model is None
                              else CompiledModel(degraded_model, compile_mode))
        self.model_runner: ModelRunner | None = None  # built once the pool is sized
        self.kv_connector = kv_connector
        self.model_loader = model_loader
        self.kv_shape: tuple[int, int] | None = None  # (num_blocks, block_size): the pool a wake builds again
        self.asleep: SleepingWeights | None = None  # chapter 19: the weights while the worker sleeps

    def num_blocks_for(self, kv_cache_bytes: int, block_size: int) -> int:
        if self.quantized:
            return int(kv_cache_bytes // quantized_block_bytes(self.kv_config, block_size))
        return num_blocks_for_budget(self.kv_config, kv_cache_bytes, block_size, self.dtype)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_shape = (num_blocks, block_size)
        c = self.kv_config
        shape = (c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        cache = (QuantizedKVCache(*shape, self.dtype, self.model_dtype, self.device, self.kv_quant) if self.quantized
                 else PagedKVCache(*shape, self.dtype, self.device))
        self.model_runner = self.model_runner_class(self.step_model, cache, self.attention, self.step_degraded,
                                                    self.metadata, self.spec_acceptance, self.sampling)
        if self.kv_connector is not None:  # it loads before and saves after each decoder layer
            self.kv_connector.register_kv_caches(cache, self.model.layers)

    def init_kv_tier(self, capacity: int, path: str | None = None) -> int:
        """Chapter 18: a file of `capacity` block slots behind the pool; returns a block's bytes."""
        self.kv_tier = FileKVTier(capacity, block_nbytes(self.model_runner.kv_cache), path)
        return self.kv_tier.block_nbytes

    def execute_model(self, scheduler_output: SchedulerOutput, degraded: bool = False) -> dict[str, int]:
        if scheduler_output.kv_tier_ops:  # before anything writes into the pool (copy-on-write copies included)
            self.kv_tier.apply(self.model_runner.kv_cache, scheduler_output.kv_tier_ops)
        start = time.perf_counter()
        with ExitStack() as after_step:  # what runs once the forward pass is over, last registered first
            if self.lora_manager is not None:
                # chapter 19: the step's rows in the runner's order (each sequence's scheduled tokens end to end)
                self.lora_manager.set_step([(seq.lora_name, scheduler_output.num_scheduled_tokens[seq.seq_id])
                                            for seq in scheduler_output.scheduled_seqs])
                after_step.callback(self.lora_manager.end_step)
            if self.kv_connector is not None:
                # chapter 17, vLLM's order: bind the step's loads and saves, start the loads; the layers' hooks wait
                # for each layer's load and save each layer; then wait for the saves, then unbind
                connector = self.kv_connector
                connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
                after_step.callback(connector.clear_connector_metadata)
                after_step.callback(connector.wait_for_save)
                connector.start_load_kv()
            sampled = self.model_runner.execute_model(scheduler_output, degraded)
        if self.kv_connector is not None and self.kv_connector.failed:  # chapter 17: a load that failed fails
            sampled = without_failed(sampled, self.kv_connector.failed)  # its request alone, like a failed draw
        self.step_seconds = time.perf_counter() - start
        return sampled

    # ---- chapter 19: sleep mode (the engine checked that it is idle and that this worker can sleep) -----------
    def sleep(self, level: int) -> dict[str, int]:
        """Release the weights (level 1: to a file, level 2: dropped) and the KV pool (its contents are lost: the
        engine emptied the prefix cache); returns the bytes released, {"weights": ..., "kv_cache": ...}."""
        if level == 2 and self.model_loader is None:
            raise ValueError("level 2 builds the model again from its file, and this worker was given no loader")
        kv_bytes = self.model_runner.kv_cache.nbytes
        self.asleep = SleepingWeights(self.model, level)
        self.model_runner = None  # the pool's only holder: it goes with the runner
        release_memory()
        return {"weights": self.asleep.nbytes, "kv_cache": kv_bytes}

    def wake_up(self) -> None:
        """The weights back (level 1: read from the file; level 2: the model built again, its LoRA layers too, so
        every name matches, and the adapters written into the slots again when a step needs them), then a zeroed
        pool of the same blocks. A wake that fails leaves the worker asleep."""
        level = self.asleep.level
        self.asleep.wake(self._build_again if level == 2 else None)
        self.asleep = None
        if level == 2 and self.lora_manager is not None:
            self.lora_manager.forget_slots()
        self.init_kv_cache(*self.kv_shape)
        release_memory()  # level 2: what the load freed (the file's float32 copies, the unused parts of the model)

    def _build_again(self):
        model = self.model_loader()
        if self.lora_manager is not None:  # the same LoRA layers, so that every tensor that slept finds its name
            self.lora_manager.add_layers(model)
        return model

    def close(self) -> None:
        if self.asleep is not None:  # its file (unlinked already) closed
            self.asleep.close()
        if self.kv_tier is not None:
            self.kv_tier.close()
        if self.kv_connector is not None:  # chapter 17: its release sockets, its staged segments
            self.kv_connector.close()
            self.kv_connector = None
