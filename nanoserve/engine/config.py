"""The engine's settings, grouped by the idea they belong to (vLLM's names, so its `VllmConfig` reads the same).

    EngineConfig(
        cache_config=CacheConfig(block_size=16, num_blocks=64),        # chapters 04–05: the KV pool
        scheduler_config=SchedulerConfig(max_num_seqs=8),              # chapters 06, 15, 18: who runs, in what order
        speculative_config=SpeculativeConfig(method="ngram"),          # chapter 14 (None: off)
        lora_config=LoRAConfig(max_loras=4, max_lora_rank=16),         # chapter 19 (None: off)
    )

`LLM(...)` and the CLI keep one flat list of keyword arguments and flags (vLLM's `EngineArgs`); they build these.
Each dataclass is read by the layer it names: the block manager and the worker read `CacheConfig`, the scheduler
and its policy `SchedulerConfig`, the proposer and the verify step `SpeculativeConfig`.
"""

from dataclasses import dataclass, field

from nanoserve.spec_decode.policy import DEFAULT_DISABLE_BY_BATCH_SIZE


@dataclass
class CacheConfig:
    """The KV pool (chapters 04, 05, 10) and the tier behind it (chapter 18)."""

    block_size: int = 16  # tokens per block
    num_blocks: int | None = None  # None: as many as fit in kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when num_blocks is None
    enable_prefix_caching: bool = True
    # vLLM's --kv-cache-dtype: "auto" = the model's parameters' (float32 for every GGUF format), "fp32", or
    # "bf16" — half the bytes per token, so twice the blocks in the same memory and half the bytes each decode
    # step gathers; the attention math then runs in bf16 (torch backend only).
    kv_cache_dtype: str = "auto"
    # Chapter 18: "int8" / "fp8" store 8-bit codes with a bf16 scale per token and kv head (1.94x bf16's blocks).
    # A second KV tier: evicted prefix blocks go to a file of kv_tier_blocks block slots (0: off) at kv_tier_path
    # (None: a temporary file), least recently used dropped first, and come back when a prompt needs them and
    # loading is measured to beat recomputing (nanoserve/kv/tiered_block_manager.py); with
    # SchedulerConfig.preemption_mode "swap" it also holds preempted sequences' blocks, pinned until they resume.
    kv_tier_blocks: int = 0
    kv_tier_path: str | None = None


PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    """Who runs in a step and in what order (chapters 06 and 15), and what a preempted sequence loses (18)."""

    max_num_seqs: int = 64  # seats: sequences in the running set at once
    max_num_batched_tokens: int = 2048  # token budget of one forward pass
    enable_chunked_prefill: bool = True
    # Chapter 15: the scheduling policy (nanoserve/engine/policies/): "fcfs" | "priority" | "slo" | "fair" (the
    # CLI's --scheduling-policy); the default SLO targets (ms), per-tenant SLO overrides and fair-share weights,
    # and whether the slo policy refuses a request whose TTFT deadline is lost (instead of serving it late)
    policy: str = "priority"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_reject: bool = False
    tenant_weights: dict | None = None  # tenant -> weight (fair); missing tenants weigh 1
    tenant_slos: dict | None = None  # tenant -> SLOTargets (slo)
    # What a preempted sequence loses (vLLM's preemption_mode): "recompute" (chapter 06: its blocks are freed, its
    # tokens computed again) or "swap" (chapter 18: its blocks go to the KV tier, CacheConfig.kv_tier_blocks, and
    # come back when it resumes; recompute when the tier has no room)
    preemption_mode: str = "recompute"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; known: {', '.join(PREEMPTION_MODES)}")
        unused = self.unused_policy_setting()
        if unused:
            raise ValueError(unused)

    def unused_policy_setting(self) -> str | None:
        """The first setting the chosen policy would not read, in words (None: all are read): refused, not
        dropped. The SLO settings are slo's; weights other than 1 are fair's.

            SchedulerConfig(policy="priority", slo_reject=True)   ValueError: slo_reject (--slo-reject) is ...
        """
        slo = {"slo_ttft_ms": self.slo_ttft_ms is not None, "slo_tpot_ms": self.slo_tpot_ms is not None,
               "slo_reject": self.slo_reject, "tenant_slos": bool(self.tenant_slos)}
        for name, given in slo.items():
            if given and self.policy != "slo":
                flag = "a tenant's ttft_slo_ms / tpot_slo_ms" if name == "tenant_slos" else "--" + name.replace("_", "-")
                return (f"{name} ({flag}) is read by the slo scheduling policy only, and the policy is "
                        f"{self.policy!r}: add --scheduling-policy slo or drop it")
        weighted = sorted(t for t, w in (self.tenant_weights or {}).items() if w != 1)
        if weighted and self.policy != "fair":
            return (f"tenant weights ({', '.join(map(str, weighted))}: a tenant's weight) are read by the fair "
                    f"scheduling policy only, and the policy is {self.policy!r}: add --scheduling-policy fair or "
                    f"drop them")
        return None


@dataclass
class SpeculativeConfig:
    """Chapter 14: speculative decoding (EngineConfig.speculative_config None: off)."""

    method: str = "ngram"  # "ngram" (prompt lookup) | "draft" (the model's first layers)
    num_speculative_tokens: int = 4  # proposals per sequence and step (k)
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # None: speculate at any batch
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: the longest
    draft_num_layers: int | None = None  # draft: the first L layers (None: a quarter of them)

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")


KV_ROLES = ("kv_producer", "kv_consumer")
KV_CONNECTORS = ("SharedMemoryConnector",)
CLI_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # serve --kv-role's words


@dataclass
class KVTransferConfig:
    kv_role: str = "kv_producer"
    kv_connector: str = "SharedMemoryConnector"
    # producer: where its control socket binds ("tcp://127.0.0.1:*": a free port, see the connector's endpoint)
    kv_control_endpoint: str = "tcp://127.0.0.1:*"
    # producer: staged KV nobody asked for within this many seconds is freed (a proxy died between the two halves)
    kv_release_timeout_s: float = 60.0

    def __post_init__(self):
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"unknown kv_role {self.kv_role!r}; known: {', '.join(KV_ROLES)}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}; known: {', '.join(KV_CONNECTORS)}")
        if not self.kv_release_timeout_s > 0:
            raise ValueError(f"kv_release_timeout_s must be > 0, got {self.kv_release_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"


# Chapter 19: the fused projections an adapter may touch (nanoserve/model/stacked.py), and the checkpoint's names
# of the parts each one stacks: an adapter's q_proj lands in the first slice of qkv_proj.
LORA_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRAConfig:
    """Chapter 19: LoRA adapters (nanoserve/lora/); EngineConfig.lora_config None: off."""

    max_loras: int = 4  # adapters one step may hold (slots in the LoRA layers' weights)
    max_lora_rank: int = 16  # every slot is this rank wide; an adapter of a higher rank is refused
    max_cpu_loras: int | None = None  # adapters kept in memory, slots included (None: max_loras); the rest: disk
    modules: tuple[str, ...] = tuple(LORA_MODULES)  # the fused projections that get LoRA layers

    def __post_init__(self):
        self.modules = tuple(self.modules)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoRAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                             "an adapter in a slot is also kept in memory")
        unknown = [m for m in self.modules if m not in LORA_MODULES]
        if unknown:
            raise ValueError(f"unknown LoRA modules {unknown}; known: {', '.join(LORA_MODULES)}")


@dataclass
class EngineConfig:
    """Everything LLMEngine is built from: one sub-config per idea, and the few settings of the step itself."""

    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    # the learner's finished exercises to run instead of the reference (nanoserve/student.py):
    # True = every chapter, "05,06" or ["05"] = those chapters, False = none
    student: bool | str | list[str] = False
    attention_backend: str | None = None  # "torch" | "triton" (chapter 07); None: triton on CUDA, torch on CPU
    # Chapter 10: with at least this many requests waiting, steps run on the degraded (quantized) copy of the
    # weights, until the queue falls to half of it (hysteresis). None: off, nothing changes.
    degrade_under_load: int | None = None
    # Chapter 09: "eager" (op by op, the reference), "buckets" (torch.compile, the step padded up to a few fixed
    # token counts) or "dynamic" (torch.compile with a symbolic token count); see nanoserve/model/compiled.py.
    compile_mode: str = "eager"
    lora_config: LoRAConfig | None = None  # chapter 19 (None: no adapters)
    # Chapter 17: this engine's part in disaggregated serving (prefill = kv_producer, decode = kv_consumer), or
    # None: it serves alone (KVTransferConfig, above)
    kv_transfer_config: KVTransferConfig | None = None

    def check_student(self, chapters=frozenset()) -> None:
        """Refuse the settings given here that run the reference in place of a chapter `student` selects. chapters:
        those it selects (parse_selection; student=True selects every chapter, so these refuse it too). LLM calls
        it before the model loads, the CLI before it builds an LLM, LLMEngine before it builds anything.

            EngineConfig(kv_cache_dtype="int8").check_student({"05"})
            ValueError: kv_cache_dtype int8 runs chapter 18's quantized attention, not chapter 05's paged attention ...
        """
        cache = self.cache_config
        if self.compile_mode != "eager" and "02" in chapters:
            # CompiledModel runs its own layer loop over the reference's block halves: 2.2 and 2.3 would not run
            raise ValueError(f"compile_mode {self.compile_mode} runs its own loop over the reference block's halves, "
                             "not Llama.forward and DecoderBlock.forward: not with chapter 02's exercises selected "
                             "in student")
        if self.scheduler_config.preemption_mode == "swap" and {"06", "18"} & set(chapters):
            raise ValueError("preemption_mode swap runs on the reference scheduler and tier index: not with chapter "
                             "06's or 18's exercises selected in student")
        if cache.kv_tier_blocks and "05" in chapters:
            raise ValueError("the KV tier runs on the reference block manager: not with chapter 05's exercises "
                             "selected in student")
        if cache.kv_cache_dtype in ("int8", "fp8") and "05" in chapters:
            raise ValueError(f"kv_cache_dtype {cache.kv_cache_dtype} runs chapter 18's quantized attention, not "
                             "chapter 05's paged attention selected in student: drop one of them")

    def check_tensor_parallel(self, weights: str = "fp32", model=None, chapters=frozenset()) -> None:
        """Refuse, in one ValueError naming each, the settings given here that tensor parallelism (chapter 11)
        cannot run: its ranks run float32 shards (LLM's `weights`, or the model given: its weight_format and every
        parameter float32) on a float32 pool ("auto" or "fp32") with torch's attention, eager, each rank holding its
        slice of every layer and block of the reference Llama. chapters: those `student` selects (parse_selection;
        this file imports nothing of the course): chapter 02 among them is refused, its exercises build no shard.
        LLM calls it before any worker starts, LLMEngine for a shard handed to it.

            EngineConfig(compile_mode="buckets").check_tensor_parallel()
            ValueError: tensor_parallel_size > 1 runs ...: compile_mode='buckets' is single-process only
        """
        cache, spec = self.cache_config, self.speculative_config
        # a model given is copied into float32 shards: an int8 / q4 one would not load, a bf16 one would be upcast
        form = getattr(model, "weight_format", "fp32")
        dtypes = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"}) if model is not None else []
        given = {
            f"weights={weights!r}": weights != "fp32",
            f"a model given as weight_format={form!r}": form != "fp32",
            f"a model given with {', '.join(dtypes)} parameters": form == "fp32" and bool(dtypes),
            f"kv_cache_dtype={cache.kv_cache_dtype!r}": cache.kv_cache_dtype not in ("auto", "fp32"),
            f"compile_mode={self.compile_mode!r}": self.compile_mode != "eager",
            "degrade_under_load": self.degrade_under_load is not None,
            "attention_backend='triton'": self.attention_backend == "triton",
            "speculative='draft' (its layers would run on rank 0 alone)": spec is not None and spec.method == "draft",
            "LoRA adapters (enable_lora, lora_modules)": self.lora_config is not None,
            "the KV tier (kv_tier_blocks)": cache.kv_tier_blocks > 0,
            "a KV connector (kv_transfer_config)": self.kv_transfer_config is not None,
            # shard_llama builds every rank's shard, rank 0's too, from the reference's blocks and norms
            "chapter 02's exercises in student (every rank builds its shard of the reference Llama; student=True "
            "selects every chapter)": "02" in chapters,
        }
        refused = [name for name, on in given.items() if on]
        if refused:
            raise ValueError("tensor_parallel_size > 1 runs float32 shards in worker processes, on a float32 KV pool, "
                             f"eager, with the torch attention backend: {', '.join(refused)} "
                             f"{'is' if len(refused) == 1 else 'are'} single-process only")


# the flat names LLM(...) and the CLI use, where they differ from the sub-config's field
_RENAMED = {"scheduling_policy": "policy", "speculative": "method", "speculative_disable_by_batch_size":
            "disable_by_batch_size"}


def engine_config(**kwargs) -> EngineConfig:
    """One flat list of settings (LLM's keyword arguments, the CLI's flags: vLLM's `EngineArgs`) grouped into
    an EngineConfig; `speculative=None` (or absent) leaves speculation off.

        engine_config(block_size=4, max_num_seqs=8, speculative="ngram") == EngineConfig(
            cache_config=CacheConfig(block_size=4), scheduler_config=SchedulerConfig(max_num_seqs=8),
            speculative_config=SpeculativeConfig(method="ngram"))
    """
    groups = {"cache_config": CacheConfig, "scheduler_config": SchedulerConfig, "speculative_config": SpeculativeConfig}
    parts = {name: {} for name in groups}
    top = {}
    for key, value in kwargs.items():
        field_name = _RENAMED.get(key, key)
        group = next((g for g, cls in groups.items() if field_name in cls.__dataclass_fields__), None)
        if key in _RENAMED.values():  # a sub-config's own name for a setting the flat list calls otherwise
            group = None
        if group is not None:
            parts[group][field_name] = value
        elif key in EngineConfig.__dataclass_fields__ and key not in groups:
            top[key] = value
        else:
            raise TypeError(f"engine_config() got an unexpected setting {key!r}")
    speculative = parts.pop("speculative_config")
    spec = SpeculativeConfig(**speculative) if speculative.get("method") is not None else None
    return EngineConfig(cache_config=CacheConfig(**parts["cache_config"]),
                        scheduler_config=SchedulerConfig(**parts["scheduler_config"]), speculative_config=spec, **top)
