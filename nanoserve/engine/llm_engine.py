"""Chapter 06 — LLMEngine: requests in, one scheduled forward pass per step(), tokens out.

    engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():          # one schedule + one forward pass + sampling
            print(out.request_id, out.new_text, out.finish_reason)

A step: (1) the scheduler picks sequences and token counts, (2) the executor runs them as one
flat batch, (3) each sequence that sampled gets its token, its text delta and a stop check;
(4) finished sequences leave at once and their blocks return to the pool, so the *next*
step can admit someone else. That last point is continuous batching: no one waits for the
slowest member of a batch.

The engine sees token ids. The tokenizer is optional and only turns ids back into text
(incremental detokenizer) and checks stop strings.
"""

import sys
import time
from dataclasses import dataclass, field
from functools import partial

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.executor import Executor
from nanoserve.engine.policies import SLOTargets, make_policy
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus, child_seq_id
from nanoserve.engine.sleep_mode import SLEEP_LEVELS
from nanoserve.engine.worker import KV_CACHE_DTYPES, Worker
from nanoserve.kernels.backend import resolve_attention_backend
from nanoserve.kv.tiered_block_manager import TieredBlockManager
from nanoserve.model.compiled import COMPILE_MODES
from nanoserve.spec_decode.policy import SpecDecodeStats, num_speculative_tokens
from nanoserve.spec_decode.proposer import make_proposer
from nanoserve.structured.manager import StructuredOutputManager
from nanoserve.text.output_text import add_token_to_output
from nanoserve.student import StudentCode, check_engine_selection


_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}


class LoRANameTaken(ValueError):
    """Chapter 19: add_lora's name is empty, already loaded, or still draining (the server's 400 names `lora_name`)."""


class LoRANotLoaded(ValueError):
    """Chapter 19: a request or an unload names an adapter that is not loaded (the server's 404)."""


class EngineAsleep(RuntimeError):
    """Chapter 19: a request for an engine that sleeps (the server's 503 with Retry-After); wake_up() first."""


class SleepConflict(RuntimeError):
    """Chapter 19: sleep or wake_up asked in the wrong state — asleep already, awake, requests in flight (the
    server's 409)."""


class SleepRefused(ValueError):
    """Chapter 19: this engine cannot sleep (at this level); `param`: the request field to blame, or None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def lora_cache_salt(cache_salt: str | None, lora_name: str | None, lora_ids: dict[str, int]) -> str | None:
    """Chapter 19: the salt of a request's prefix-cache chain with its adapter folded in, so that two adapters
    (or one adapter unloaded and loaded again: a new id) never share a block: the same K/V inputs give other
    K/V under another adapter. lora_cache_salt(None, "upper", {"upper": 3}) == "lora:3:upper"."""
    if lora_name is None:
        return cache_salt
    return f"lora:{lora_ids[lora_name]}:{lora_name}" + ("" if cache_salt is None else f"|{cache_salt}")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # generated this step
    text: str  # every generated character so far ("" without a tokenizer)
    new_text: str  # the delta of this step
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    metrics: dict = field(default_factory=dict)
    # n > 1: one output per completion and step, `index` says which; `finished` turns True on the last
    # output of the whole request, each completion's own end is its finish_reason
    index: int = 0
    # chapter 08: the TokenLogprob (nanoserve/engine/sampler.py) of each of new_token_ids, when the request
    # asked for logprobs (None otherwise)
    logprobs: list | None = None
    # chapter 08: SamplingParams.prompt_logprobs asked: one entry per prompt token, None for the first (nothing
    # comes before it) and a TokenLogprob for each other; on the step the first token is out (every completion's)
    prompt_logprobs: list | None = None
    reject_reason: str | None = None  # chapter 15: the scheduling policy refused the request (finish_reason "abort")
    # the request failed alone (its draw raised inside a step, or its grammar refused its tokens, chapter 13):
    # why, in one line (finish_reason "abort"); the others in that step went on
    error: str | None = None
    # chapter 17: on a prefill engine's last output for a request that asked {"do_remote_decode": True}, what a
    # decode engine needs to load its prompt's KV (the connector's request_finished)
    kv_transfer_params: dict | None = None


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None, eos_token_id: int | None = None,
                 degraded_model=None, student: StudentCode | None = None, block_manager=None, model_loader=None):
        """student: the run's StudentCode when the caller built parts of the model with it (LLM shares one, so
        the report names every file of the learner's that ran); block_manager: one built by the caller for the
        same pool (chapter 05's benchmark passes its reserving baseline, kv/reservation.py); None builds the
        paging one. model_loader: a function that builds `model` again from its file (LLM passes one for the GGUF
        it loaded): chapter 19's sleep level 2 wakes with it; None: level 2 is refused."""
        self.config = config = config or EngineConfig()
        cache = config.cache_config
        self.tokenizer = tokenizer
        if (config.degrade_under_load is None) != (degraded_model is None):
            raise ValueError("degrade_under_load and degraded_model go together: the threshold says when to run "
                             "on the degraded copy of the weights, which the worker must hold")
        if config.degrade_under_load is not None and config.degrade_under_load < 1:
            raise ValueError(f"degrade_under_load must be >= 1 waiting requests, got {config.degrade_under_load}")
        self.degraded = False  # does the current step run on the degraded copy?
        self.precision_names = (getattr(model, "weight_format", "fp32"), getattr(degraded_model, "weight_format", None))
        self.token_precisions: dict[str, list[str]] = {}  # with degradation on: per request, per token
        # with config.student: the learner's finished exercises where selected, the reference's elsewhere
        # (`student`: the StudentCode that already built the model, under --student 02, to report it too)
        check_engine_selection(config.student)  # a chapter whose code no step calls (chapter 01's) is refused
        self.student = student = student if student is not None else StudentCode(config.student)
        # the attention backend (chapter 07), checked before anything is built; with "triton" and chapter 07
        # selected, the learner's kernels from exercises/07
        weight = next(model.parameters())  # the pool follows its device, and its dtype unless kv_cache_dtype says
        pool_dtype = weight.dtype if cache.kv_cache_dtype == "auto" else None
        self.attention_backend = resolve_attention_backend(config.attention_backend, weight.device, pool_dtype)
        triton = self.attention_backend == "triton"
        kernel = student.module("nanoserve.kernels.triton_paged_attention") if triton else None
        store_kv = student.module("nanoserve.kernels.triton_store_kv") if triton else None
        # chapter 05's paged attention and metadata (the learner's rungs 5.3, 5.5, 5.6 where finished)
        paged_kv = student.module("nanoserve.kv.paged_attention")
        runner = student.module("nanoserve.engine.model_runner").ModelRunner  # the learner's with 06 (exercise 6.5)
        if cache.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {cache.kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")
        if config.compile_mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile_mode {config.compile_mode!r}; known: {', '.join(COMPILE_MODES)}")
        from nanoserve.distributed.parallel_state import get_tp_group

        if get_tp_group(model).size > 1:  # chapter 11: rank 0's shard, whose workers run the eager float32 step
            config.check_tensor_parallel(chapters=student.chapters)
        config.check_student(student.chapters)  # LLM asks the same before its model loads
        if cache.kv_tier_blocks < 0 or cache.kv_tier_blocks == 1:
            raise ValueError("kv_tier_blocks must be 0 (no second tier) or >= 2 (a load takes at most half the "
                             f"tier's slots), got {cache.kv_tier_blocks}")
        if cache.kv_tier_path is not None and not cache.kv_tier_blocks:
            raise ValueError("kv_tier_path names the second tier's file: it needs kv_tier_blocks > 0")
        swap = config.scheduler_config.preemption_mode == "swap"
        if swap and not cache.kv_tier_blocks:
            raise ValueError("preemption_mode swap writes a preempted sequence's blocks to the second KV tier: it "
                             "needs kv_tier_blocks > 0")
        if cache.kv_tier_blocks and not cache.enable_prefix_caching and not swap:
            raise ValueError("the KV tier holds evicted prefix-cache blocks: it needs enable_prefix_caching (or "
                             "preemption_mode swap, whose swapped-out blocks it holds)")
        if triton and cache.kv_cache_dtype != "auto":
            raise ValueError("kv_cache_dtype applies to the torch attention backend; the Triton kernels read the "
                             "model's dtype (chapter 07)")
        lora = config.lora_config
        spec = config.speculative_config
        if lora is not None and (degraded_model is not None or config.compile_mode != "eager"
                                 or (spec is not None and spec.method == "draft")):
            raise ValueError("LoRA adapters run on one eager model: degrade_under_load, compile_mode and the draft "
                             "proposer are refused with them")
        # chapter 19: the adapter slots' LRU and the batched gather (the learner's, exercises/19, where finished)
        lora_code = {} if lora is None else {"lora_manager_class": student.module("nanoserve.lora.manager").LoRAModelManager,
                                             "punica": student.module("nanoserve.lora.punica")}
        transfer = config.kv_transfer_config
        if transfer is not None and (lora is not None or cache.kv_tier_blocks or cache.kv_cache_dtype in ("int8", "fp8")):
            raise ValueError("a disaggregated engine (kv_transfer_config, chapter 17) moves plain KV blocks of the base "
                             "model: LoRA adapters, the KV tier and int8 / fp8 pools are refused with it")
        if transfer is not None and not transfer.is_producer and student.serves("nanoserve.engine.scheduler", "6.1"):
            raise ValueError("a decode engine (kv_role kv_consumer, chapter 17) loads prompt K/V at admission, in the "
                             "reference scheduler's schedule_waiting: not with your exercise 6.1 (student 06)")
        kv_worker = self._kv_connector_worker()  # chapter 17 (None unless config.kv_transfer_config)
        self.executor = Executor([Worker(model, KV_CACHE_DTYPES[cache.kv_cache_dtype],
                                          attention_backend=self.attention_backend, paged_attention=kernel,
                                          degraded_model=degraded_model, paged_kv=paged_kv,
                                          model_runner_class=runner, store_kv=store_kv,
                                          compile_mode=config.compile_mode,
                                          # chapter 14's acceptance rules (the learner's, exercises 14.2-14.3)
                                          spec_acceptance=student.module("nanoserve.spec_decode.acceptance"),
                                          kv_quant=student.module("nanoserve.kv.kv_quant"),
                                          # chapter 03's sample_batch draws every token (the learner's, exercise 3.1)
                                          sampling=student.module("nanoserve.sampling"),
                                          lora_config=lora, kv_connector=kv_worker, model_loader=model_loader,
                                          **lora_code)])
        num_blocks = cache.num_blocks or self.executor.num_blocks_for(cache.kv_cache_memory, cache.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block of {cache.block_size} "
                             "tokens")
        self.executor.init_kv_cache(num_blocks, cache.block_size)
        # the learner's block allocator, prefix cache and block manager (exercises/05), scheduler (06) and
        # detokenizer and stop check (03) where they are finished, the reference's where not
        allocator = student.module("nanoserve.kv.block_allocator").BlockAllocator(num_blocks)
        prefix_cache = student.module("nanoserve.kv.prefix_cache").PrefixCache()
        if block_manager is None and cache.kv_tier_blocks:  # chapter 18 (the learner's 18.1 / 18.2 where finished)
            block_bytes = self.executor.init_kv_tier(cache.kv_tier_blocks, cache.kv_tier_path)
            block_manager = TieredBlockManager(num_blocks, cache.block_size,
                                               student.module("nanoserve.kv.tier_index").TierIndex(cache.kv_tier_blocks),
                                               block_bytes / cache.block_size,
                                               load_policy=student.module("nanoserve.kv.load_policy"),
                                               enable_prefix_caching=cache.enable_prefix_caching)
        if block_manager is None:
            block_manager = student.module("nanoserve.kv.block_manager").BlockManager(
                num_blocks, cache.block_size, cache.enable_prefix_caching, allocator=allocator,
                prefix_cache=prefix_cache)
        elif (block_manager.num_blocks, block_manager.block_size) != (num_blocks, cache.block_size):
            raise ValueError(f"the block manager's pool ({block_manager.num_blocks} blocks of {block_manager.block_size}) "
                             f"is not the engine's ({num_blocks} blocks of {cache.block_size})")
        self.block_manager = block_manager
        sched = config.scheduler_config
        # chapter 15's policy (the learner's slo/fair policies from exercises/15 where finished)
        policy = make_policy(sched, modules=student.module)
        # chapter 19: the scheduler admits no request whose adapter would be one too many for the step's slots
        lora_slots = {} if lora is None else {"max_loras": lora.max_loras}
        self.kv_connector = self._kv_connector_scheduler(kv_worker)  # chapter 17: its scheduler side, or None
        connector = {"connector": self.kv_connector} if self.kv_connector is not None else {}
        self.scheduler = student.module("nanoserve.engine.scheduler").Scheduler(sched, self.block_manager,
                                                                                 policy=policy, **lora_slots,
                                                                                 **connector)
        self.lora_ids: dict[str, int] = {}  # chapter 19: adapter name -> its id (a new one per load)
        self.lora_draining: set[str] = set()  # unloaded adapters whose weights wait for their last request
        self._next_lora_id = 1
        self.sleep_level = 0  # chapter 19: 0 awake, else the level it sleeps at
        self.can_rebuild_model = model_loader is not None  # chapter 19: may it sleep at level 2?
        self.detokenizer_class = student.module("nanoserve.text.detokenizer").IncrementalDetokenizer
        self.stop_check = student.module("nanoserve.text.stop")  # chapter 03's stop check: the learner's (3.3) where finished
        if student:
            print(student.describe(), file=sys.stderr)
        self.max_model_len = model.config.max_position_embeddings
        # the longest sequence (prompt + output) this engine can ever hold: the context, or the whole pool
        self.max_seq_len = min(self.max_model_len, num_blocks * cache.block_size)
        self.vocab_size = model.config.vocab_size
        # without a tokenizer (token ids in, token ids out) EOS must be given to stop on it
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", -1)
        self.detokenizers = {}  # request_id -> IncrementalDetokenizer
        self.texts: dict[str, str] = {}
        self.prompt_logprobs: dict[str, list] = {}  # chapter 08: request_id -> the prompt entries scored so far
        self.num_live: dict[str, int] = {}  # request_id -> its completions not finished yet (n, then down to 0)
        self.last_scheduler_output: SchedulerOutput | None = None  # for traces (notebook, tests) and chapter 12's feed
        self.num_steps = 0  # steps taken since the engine started (chapter 12's page counts from here)
        self.proposer = self._make_proposer(model)
        self._tier_seen = (0, 0, 0.0)  # chapter 18: the tier's load counts at the last step
        # chapter 14's rollback (the learner's, exercise 14.4, where finished)
        self.rollback = partial(student.module("nanoserve.spec_decode.rollback").rollback_slots, self.block_manager)
        self.spec_stats = SpecDecodeStats()
        # chapter 13: grammars, matchers and each step's token masks (the learner's 13.1-13.3 where finished)
        self.structured = StructuredOutputManager(tokenizer, self.vocab_size,
                                                  matcher_module=student.module("nanoserve.structured.matcher"),
                                                  bitmask_module=student.module("nanoserve.structured.bitmask"),
                                                  choice_module=student.module("nanoserve.structured.choice"))

    # ---- chapter 17: the KV connector ----------------------------------------------------------
    def _kv_connector_worker(self):
        """The connector's worker side for config.kv_transfer_config (None without one); what it cannot serve
        with is refused here."""
        c = self.config
        if c.kv_transfer_config is None:
            return None
        from nanoserve.disagg.connector import SharedMemoryConnectorWorker

        refused = [name for name, on in (("compile_mode", c.compile_mode != "eager"),
                                         ("speculative", c.speculative_config is not None),
                                         ("degrade_under_load", c.degrade_under_load is not None)) if on]
        if refused:
            raise ValueError(f"kv_transfer_config (chapter 17) runs the eager single-process step; it cannot be "
                             f"combined with {refused[0]}")
        return SharedMemoryConnectorWorker(c.kv_transfer_config)

    def _kv_connector_scheduler(self, kv_worker):
        if kv_worker is None:
            return None
        from nanoserve.disagg.connector import DTYPE_NAMES, KVLayout, SharedMemoryConnectorScheduler

        worker = self.executor.workers[0]
        dtype = {v: k for k, v in DTYPE_NAMES.items()}[worker.dtype]
        layout = KVLayout(worker.kv_config.num_hidden_layers, worker.kv_config.num_key_value_heads,
                          worker.kv_config.head_dim, dtype)
        return SharedMemoryConnectorScheduler(self.config.kv_transfer_config, self.config.cache_config.block_size, layout,
                                              kv_worker.control_endpoint,
                                              receive=self.student.module("nanoserve.disagg.receive"))

    @property
    def kv_control_endpoint(self) -> str | None:
        """Chapter 17: a prefill engine's ZMQ endpoint for consumers' releases (None on any other engine)."""
        return self.kv_connector.control_endpoint if self.kv_connector is not None else None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params, priority: int = 0,
                    arrival_time: float | None = None, tenant: str | None = None,
                    slo: SLOTargets | None = None, speculative: bool = True, grammar=None,
                    cache_salt: str | None = None, lora_name: str | None = None,
                    kv_transfer_params: dict | None = None) -> None:
        """tenant: who sent it (chapter 08's --api-keys), stored as Sequence.tenant for the scheduler's and the
        metrics' use; None: nobody in particular. slo: its own SLOTargets (chapter 15). speculative: False opts
        this request out of chapter 14's speculation. grammar: the CompiledGrammar of sampling_params.structured
        when the caller compiled it ahead (chapter 13's async engine, off this thread); None: compiled here.
        cache_salt: only requests with the same salt share prefix cache blocks (vLLM's; None: the cache everyone
        without a salt shares). lora_name: the adapter it runs with (chapter 19; None: the base model).
        kv_transfer_params: chapter 17's, for the KV connector (ValueError on an engine without one, or params it
        cannot honour)."""
        self.check_awake()
        prompt_token_ids = list(prompt_token_ids)
        if lora_name is not None and lora_name not in self.lora_ids:
            raise LoRANotLoaded(f"request {request_id!r}: unknown LoRA adapter {lora_name!r}; loaded: "
                                f"{', '.join(self.lora_ids) or 'none'}")
        # Checked here, at the engine's door: a bad id found inside step() would fail a whole batch.
        if not prompt_token_ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a non-empty list of ints "
                             f"in [0, {self.vocab_size})")
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({sampling_params.max_tokens}) exceeds the model's context of {self.max_model_len}"
            )
        if request_id in self.num_live:
            raise ValueError(f"request id {request_id!r} is already in flight")
        for name in ("logit_bias", "stop_token_ids"):  # a token id past the vocabulary would fail a whole step
            bad = [t for t in getattr(sampling_params, name, None) or () if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"request {request_id!r}: {name} has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need an engine with a tokenizer")
        if slo is not None and self.scheduler.policy.name != "slo":  # chapter 15: refused, not silently ignored
            field = "ttft_slo_ms" if slo.ttft_ms is not None else "tpot_slo_ms"
            raise ValueError(f"request {request_id!r}: {field} is read by the slo scheduling policy only; this engine "
                             f"schedules by {self.scheduler.policy.name!r} (--scheduling-policy slo)")
        if kv_transfer_params is not None:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params: this engine has no KV connector (serve --kv-role)")
            self.kv_connector.check_params(kv_transfer_params)
            if sampling_params.n != 1:
                raise ValueError("kv_transfer_params: a transferred request has one completion (n=1)")
            if sampling_params.prompt_logprobs is not None and not self.kv_connector.config.is_producer:
                raise ValueError("kv_transfer_params: a decode engine does not compute the prompt, so it cannot "
                                 "score it (prompt_logprobs, echo with logprobs)")
        # chapter 13: compiled here unless the async engine compiled it ahead
        if sampling_params.structured is not None:
            grammar = self.structured.prepare(sampling_params, grammar)
        seq = Sequence(request_id, prompt_token_ids, sampling_params.max_tokens, priority, sampling_params=sampling_params,
                       tenant=tenant, slo=slo, cache_salt=lora_cache_salt(cache_salt, lora_name, self.lora_ids),
                       lora_name=lora_name, lora_id=self.lora_ids.get(lora_name))
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.speculative = speculative
        seq.kv_transfer_params = kv_transfer_params
        self.scheduler.add_seq(seq)  # raises if it could never fit (blocks, seats): no request loops forever
        if grammar is not None:
            self.structured.add_request(request_id, grammar)
        if self.tokenizer is not None:
            self.detokenizers[request_id] = self.detokenizer_class(self.tokenizer)
        self.texts[request_id] = ""
        self.num_live[request_id] = sampling_params.n

    # ---- chapter 19: LoRA adapters ----------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` under `name` (ValueError: it does not fit, or the name is taken)."""
        if self.config.lora_config is None:
            raise ValueError("LoRA adapters are off in this engine (EngineConfig.lora_config is None)")
        if not name or name in self.lora_ids:
            raise LoRANameTaken(f"adapter name {name!r} is empty or already loaded")
        if name in self.lora_draining:
            raise LoRANameTaken(f"adapter {name!r} was unloaded but requests still run with it; load it again "
                                "once they finish")
        self.executor.add_lora(name, path)
        self.lora_ids[name] = self._next_lora_id
        self._next_lora_id += 1

    def remove_lora(self, name: str) -> int:
        """Unload an adapter, as vLLM does: from now on no request may name it (LoRANotLoaded), but the requests
        already in the engine with it, running or waiting, finish with it. Its weights (slot, memory) are freed
        when the last of them ends. Returns how many requests still use it (0: its weights are gone already)."""
        if name not in self.lora_ids:
            raise LoRANotLoaded(f"unknown LoRA adapter {name!r}")
        del self.lora_ids[name]
        self.lora_draining.add(name)
        self._free_drained_loras()
        return len({s.request_id for s in self.scheduler.seqs.values() if s.lora_name == name})

    def _free_drained_loras(self) -> None:
        """Free the weights of each unloaded adapter that no live sequence uses any more (after every step and
        abort: a sequence leaves the scheduler there)."""
        for name in [n for n in self.lora_draining if all(s.lora_name != n for s in self.scheduler.seqs.values())]:
            self.executor.remove_lora(name)
            self.lora_draining.discard(name)

    # ---- chapter 19: sleep mode --------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Release the model's memory while nothing runs (vLLM's sleep mode): level 1 writes the weights to a
        temporary file, level 2 drops them (a wake builds the model again from its file); both free the KV pool,
        whose cached prefixes are forgotten first. Until wake_up() every request is refused (EngineAsleep).
        SleepConflict: asleep already, or requests in flight (vLLM leaves that check to its caller); SleepRefused: a
        level that is not 1 or 2, or what this engine cannot do. Returns {"level", "released_bytes": {"weights",
        "kv_cache"}}."""
        if level not in SLEEP_LEVELS:
            raise SleepRefused(f"level must be 1 or 2, got {level!r}", "level")
        if self.sleep_level:
            raise SleepConflict(f"the engine is already asleep (level {self.sleep_level}): wake it up first")
        if self.has_unfinished_requests():
            raise SleepConflict(f"{self.get_num_unfinished_requests()} request(s) in flight: an engine sleeps only "
                                "when idle (let them finish, or send no more, then ask again)")
        refused = self._sleep_refusal(level)
        if refused is not None:
            raise SleepRefused(*refused)
        self.block_manager.reset_prefix_cache()
        released = self.executor.sleep(level)
        self.sleep_level = level
        return {"level": level, "released_bytes": released}

    def wake_up(self) -> dict:
        """Take the memory back (level 1: the weights read from their file; level 2: the model built again from
        its GGUF) and a zeroed KV pool of the same blocks; returns {"level", "wake_s"}. SleepConflict if awake.
        A wake that fails (the model file replaced by another model) raises and leaves the engine asleep."""
        if not self.sleep_level:
            raise SleepConflict("the engine is awake: there is nothing to wake")
        start = time.perf_counter()
        self.executor.wake_up()
        level, self.sleep_level = self.sleep_level, 0
        return {"level": level, "wake_s": time.perf_counter() - start}

    def check_awake(self) -> None:
        if self.sleep_level:
            raise EngineAsleep(f"the model is asleep (level {self.sleep_level}); it serves again once woken up "
                               "(wake_up(); a server's POST /wake_up, with the admin key)")

    def _sleep_refusal(self, level: int) -> tuple[str, str | None] | None:
        """(why, the field to blame) if this engine cannot sleep at `level`, else None."""
        c = self.config
        modes = {"tensor parallelism (its weights live in the worker processes too)": self.executor.tp_group.size > 1,
                 "degrade_under_load (a second copy of the weights)": c.degrade_under_load is not None,
                 "a compiled step (compile_mode)": c.compile_mode != "eager",
                 "a KV connector (chapter 17: the pool is registered with it)": c.kv_transfer_config is not None,
                 "the KV tier (chapter 18: its offloads read the pool that sleep frees)": c.cache_config.kv_tier_blocks > 0}
        refused = [mode for mode, on in modes.items() if on]
        if refused:
            return f"this engine cannot sleep: sleep mode runs one eager model in this process, not {refused[0]}", None
        if level == 2 and not self.can_rebuild_model:
            return ("level 2 builds the model again from its file on wake, and this engine's model was handed in "
                    "already loaded: level 1 keeps its bytes in a file instead"), "level"
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting or running request (every completion of it; a completion's sequence id also
        names its request) now: its blocks are back in the pool on return. Returns the last output."""
        seq = self.scheduler.seqs.get(request_id)
        request_id = seq.request_id if seq is not None else request_id
        if request_id not in self.num_live:
            return None
        out = None
        for seq in [s for s in self.scheduler.seqs.values() if s.request_id == request_id]:
            if seq.index == 0 and seq.num_output_tokens == 0:
                self.num_live[request_id] = 1  # not forked yet: the other completions never existed
            self.scheduler.finish_seq(seq.seq_id, SequenceStatus.FINISHED_ABORTED)
            out = self._finish(seq, [], "")
        if self.lora_draining:
            self._free_drained_loras()
        return out

    def student_proof(self) -> str:
        """With config.student: one line saying how much of the learner's code served so far."""
        return self.student.proof(f"prefix-cache hits: {self.block_manager.stats.hit_blocks} blocks")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return len(self.num_live)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.proposer is not None:
            self._propose()
        scheduler_output = self.scheduler.schedule()
        if self.proposer is not None:
            self._trim_proposals(scheduler_output)
        # taken here, not in the scheduler, so that the learner's scheduler (exercises/06) copies too
        scheduler_output.blocks_to_copy = self.block_manager.take_copies()
        if self.config.cache_config.kv_tier_blocks:  # chapter 18: the step's offloads and loads, in order
            scheduler_output.kv_tier_ops = self.block_manager.take_tier_ops()
        if self.kv_connector is not None:  # chapter 17: this step's KV loads and saves, for the worker side
            scheduler_output.kv_connector_metadata = self.kv_connector.build_connector_meta(scheduler_output)
        self.last_scheduler_output = scheduler_output
        scheduler_output.grammar_bitmask = self.structured.grammar_bitmask(scheduler_output)
        rejected = [self._finish(seq, [], "") for seq in scheduler_output.rejected_seqs]  # chapter 15 (--slo-reject)
        if self.config.degrade_under_load is None:
            sampled = self.executor.execute_model(scheduler_output)
        else:
            self._update_precision()
            sampled = self.executor.execute_model(scheduler_output, self.degraded)
        now = time.perf_counter()
        if self.config.cache_config.kv_tier_blocks:
            self._measure_tier(scheduler_output)
        verified = self._accept(scheduler_output, sampled, now) if self.proposer is not None else {}
        # one sequence whose draw raised fails its request alone (before the scheduler advances it: it has no token)
        failed = getattr(sampled, "failed", {})
        if self.kv_connector is not None:  # chapter 17: a KV load that failed wrote nothing into its blocks
            from nanoserve.disagg.connector import KVLoadError

            for seq_id in [seq_id for seq_id, e in failed.items() if isinstance(e, KVLoadError)]:
                self.block_manager.uncache(seq_id)
        outputs = rejected + [self._fail(seq_id, e) for seq_id, e in failed.items()]
        self._collect_prompt_logprobs(getattr(sampled, "prompt_logprobs", {}))
        for parent in self.scheduler.update_from_output(scheduler_output, sampled, now):
            try:
                outputs += self._advance(parent, sampled, verified, now)
            except Exception as e:  # noqa: BLE001 — its stop check or text failed: its request, not the step
                outputs.append(self._fail(parent.seq_id, e))
        if self.lora_draining:  # chapter 19: an unloaded adapter's last request may have finished
            self._free_drained_loras()
        return self._fail_grammar_violations([out for out in outputs if out is not None])

    # ---- chapter 18: the second KV tier ------------------------------------------------------------
    def _measure_tier(self, out: SchedulerOutput) -> None:
        """Feed the step's measured costs to the load-or-recompute decision: (tokens computed, forward seconds),
        and (bytes, seconds) of its loads."""
        rates = self.block_manager.rates
        stats, step_seconds = self.executor.kv_tier_stats()
        if out.total_num_scheduled_tokens:
            rates.steps.add(out.total_num_scheduled_tokens, step_seconds)
        seen = self._tier_seen
        if stats.loads > seen[0]:
            rates.loads.add(stats.bytes_read - seen[1], stats.load_seconds - seen[2])
        self._tier_seen = (stats.loads, stats.bytes_read, stats.load_seconds)

    def kv_tier_stats(self) -> dict | None:
        """Chapter 18: the second tier's counts so far (None without one): tokens found per tier, blocks moved
        (evicted and loaded back; swapped out and in), bytes, stalls, the measured rates."""
        if not self.config.cache_config.kv_tier_blocks:
            return None
        bm, (tier, _) = self.block_manager, self.executor.kv_tier_stats()
        rates, counts = bm.rates, bm.tier_stats
        return {"pool_hit_tokens": bm.stats.hit_tokens - counts.hit_tokens,
                "tier_hit_tokens": counts.hit_tokens, "queried_tokens": bm.stats.queried_tokens,
                "tier_recomputed_tokens": counts.recomputed_tokens,
                "offloaded_blocks": counts.offloaded_blocks, "loaded_blocks": counts.loaded_blocks,
                "swapped_out_blocks": counts.swapped_out_blocks, "swap_ins": counts.swap_ins,
                "swap_fallbacks": counts.swap_fallbacks, "bytes_written": tier.bytes_written,
                "bytes_read": tier.bytes_read, "stalls": tier.stalls, "stall_seconds": tier.stall_seconds,
                "tier_blocks_used": len(bm.tier), "tier_blocks_pinned": sum(len(s.slots) for s in bm.swapped.values()),
                "tier_capacity": bm.tier.capacity,
                "prefill_s_per_token": rates.prefill_s_per_token(), "tier_bytes_per_s": rates.tier_bytes_per_s()}

    def close(self) -> None:
        """Stop what the engine started beside itself (chapter 17's KV connector: its sockets, its staged
        segments; chapter 18's tier writer and its file); idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        self.executor.close()

    def _fail_grammar_violations(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Chapter 13: a request whose grammar refused its tokens this step (its row had no mask) is aborted,
        its last output carrying the reason in `error`; the other requests' outputs are untouched."""
        for request_id, reason in self.structured.take_failures().items():
            mine = [out for out in outputs if out.request_id == request_id]
            outputs = [out for out in outputs if out.request_id != request_id]
            last = self.abort_request(request_id) or mine[-1]  # None: it finished this very step
            last.error = reason
            outputs.append(last)
        return outputs

    def _advance(self, parent: Sequence, sampled: dict, verified: dict[str, int], now: float) -> list[RequestOutput]:
        """The outputs of a sequence that got its token(s) this step (and of its forks, n > 1): stop checks,
        text, logprobs; a finished one leaves the scheduler."""
        if parent.seq_id in verified:  # it computed 1 + k tokens, of which only the accepted hold real K/V
            parent.num_computed_tokens = parent.num_tokens - 1
        logprobs = getattr(sampled, "logprobs", {})  # chapter 08: only for requests that asked
        prompt_logprobs = self._prompt_logprobs_done(parent)
        outputs = []
        for seq in [parent] + self._fork(parent, sampled, now):
            new_ids, status, new_text = self._check_new_tokens(seq, verified.get(seq.seq_id, 1))
            if status is None:
                outputs.append(self._output(seq, new_ids, new_text))
            else:
                self.scheduler.finish_seq(seq.seq_id, status)  # blocks back in the pool for the next step
                outputs.append(self._finish(seq, new_ids, new_text, now))
            if seq.seq_id in logprobs:
                outputs[-1].logprobs = [logprobs[seq.seq_id]]
            outputs[-1].prompt_logprobs = prompt_logprobs
        return outputs

    def _fail(self, seq_id: str, error: Exception) -> RequestOutput | None:
        """A sequence failed inside this step: its request ends now (every completion, blocks freed), its last
        output saying why; None if the request already ended (a sibling completion failed first)."""
        out = self.abort_request(seq_id)
        if out is not None:
            out.error = f"{type(error).__name__}: {error}"
        return out

    def _collect_prompt_logprobs(self, scored: dict[str, tuple[int, list]]) -> None:
        """Chapter 08: file this step's prompt entries (the model runner's {seq_id: (first index, entries)}); a
        prompt recomputed after a preemption overwrites its entries from `first` on."""
        for seq_id, (first, entries) in scored.items():
            got = self.prompt_logprobs.setdefault(seq_id, [None])  # the first prompt token has no logprob
            del got[first:]
            got += entries

    def _prompt_logprobs_done(self, seq: Sequence) -> list | None:
        """The request's prompt entries, once, on the step its first token came out (else None)."""
        if getattr(seq.sampling_params, "prompt_logprobs", None) is None or seq.index != 0 or seq.num_output_tokens != 1:
            return None
        return self.prompt_logprobs.pop(seq.seq_id, [None])

    def _check_new_tokens(self, seq: Sequence, num_new: int) -> tuple[list[int], SequenceStatus | None, str]:
        """Stop checks for the step's num_new tokens (more than one after a verification), one at a time,
        as if each came from its own step: a stop string met early drops the tokens after it."""
        new_text, status = "", None
        first = seq.num_output_tokens - num_new
        for n in range(first + 1, seq.num_output_tokens + 1):
            if self.config.degrade_under_load is not None:
                self.token_precisions.setdefault(seq.seq_id, []).append(self.precision)
            status, delta = self._check_stop(seq, n)
            new_text += delta
            if status is not None:
                del seq.output_token_ids[n:], seq.token_times[n:]
                break
        return seq.output_token_ids[first:], status, new_text

    # ---- chapter 14: speculative decoding ----------------------------------------------------------
    def _make_proposer(self, model):
        spec = self.config.speculative_config
        if spec is None:
            return None
        # n-gram: the learner's (exercise 14.1) where finished
        return make_proposer(spec, model, self.student.module)

    def _propose(self) -> None:
        """Proposals for the running sequences about to decode (the policy may say none: policy.py). At most
        the tokens the request has left minus one: the verification adds one token of its own."""
        running = self.scheduler.running
        spec = self.config.speculative_config
        k = num_speculative_tokens(spec.num_speculative_tokens, len(running), spec.disable_by_batch_size)
        # verification reports no logprobs; and a constrained request (chapter 13) never speculates: its one mask
        # per step covers one sampled position, a verification samples 1 + k (structured/manager.py)
        plain = lambda p: p.logprobs is None and p.structured is None  # noqa: E731
        for seq in running:
            left = seq.max_tokens - seq.num_output_tokens - 1
            decoding = seq.num_output_tokens > 0 and seq.num_computed_tokens == seq.num_tokens - 1
            seq.spec_token_ids = (self.proposer.propose(seq.token_ids, min(k, left))
                                  if k and left > 0 and seq.speculative and decoding and plain(seq.sampling_params)
                                  else [])

    def _trim_proposals(self, out: SchedulerOutput) -> None:
        """Keep the proposals the scheduler gave budget to (a step short of tokens verifies fewer; a
        preempted sequence none), and note them in the step's plan."""
        for seq in self.scheduler.seqs.values():
            if seq.spec_token_ids:
                n = out.num_scheduled_tokens.get(seq.seq_id, 0)
                del seq.spec_token_ids[max(0, seq.num_computed_tokens + n - seq.num_tokens):]
                if seq.spec_token_ids:
                    out.scheduled_spec_decode_tokens[seq.seq_id] = list(seq.spec_token_ids)

    def _accept(self, out: SchedulerOutput, sampled: dict, now: float) -> dict[str, int]:
        """Turn each verified sequence's [accepted..., correction or bonus] into what update_from_output
        expects: the accepted tokens appended here, the last one left in `sampled`; the slots of the
        rejected ones rolled back (rollback.py). Returns {seq_id: number of new tokens}."""
        verified = {}
        for seq in out.scheduled_seqs:
            tokens = sampled.get(seq.seq_id)
            if not isinstance(tokens, list):
                continue
            k, params = len(seq.spec_token_ids), seq.sampling_params
            seq.spec_token_ids = []
            self.spec_stats.num_drafts += 1
            self.spec_stats.num_draft_tokens += k
            self.spec_stats.num_accepted_tokens += len(tokens) - 1
            self.spec_stats.num_rejections += len(tokens) - 1 < k
            tokens = tokens[:seq.max_tokens - seq.num_output_tokens]
            stop = next((i for i, t in enumerate(tokens) if self.stop_check.is_stop_token(t, params, self.eos_token_id)), None)
            tokens = tokens if stop is None else tokens[:stop + 1]
            for t in tokens[:-1]:
                seq.append_token(t, now)
            sampled[seq.seq_id] = tokens[-1]
            if seq.status is SequenceStatus.RUNNING:
                self.rollback(seq.seq_id, seq.num_tokens)  # [0, num_tokens) hold real K/V now
            verified[seq.seq_id] = len(tokens)
        return verified

    def _fork(self, seq: Sequence, sampled: dict[str, int], now: float) -> list[Sequence]:
        """Parallel sampling: once the prompt of a request with n > 1 is computed and its first token
        sampled, completions [1, n) start as forks holding the same blocks (the runner sampled their first
        tokens from the same logits). A shared, partially filled last block is copied when a completion
        first writes into it (BlockManager.allocate_slots -> SchedulerOutput.blocks_to_copy)."""
        params = seq.sampling_params
        if params.n == 1 or seq.index != 0 or seq.num_output_tokens != 1:
            return []
        children = []
        for i in range(1, params.n):
            child = Sequence(child_seq_id(seq.request_id, i), seq.prompt_token_ids, seq.max_tokens, seq.priority,
                             seq.arrival_time, params.for_completion(i), request_id=seq.request_id, index=i,
                             tenant=seq.tenant, slo=seq.slo, cache_salt=seq.cache_salt, lora_name=seq.lora_name,
                             lora_id=seq.lora_id, speculative=seq.speculative)
            self.scheduler.fork_seq(seq, child)
            child.append_token(sampled[child.seq_id], now)
            if self.tokenizer is not None:
                self.detokenizers[child.seq_id] = self.detokenizer_class(self.tokenizer)
            self.texts[child.seq_id] = ""
            children.append(child)
        return children

    @property
    def precision(self) -> str:
        """The weights the last step ran on: the model's format ("fp32", "int8", "q4"), or the degraded copy's."""
        return self.precision_names[self.degraded]

    def _update_precision(self) -> None:
        """Degrade when `degrade_under_load` requests wait; come back once the queue is down to half of it
        (hysteresis: one request more or less must not flip the mode every step)."""
        waiting, threshold = len(self.scheduler.waiting), self.config.degrade_under_load
        if not self.degraded and waiting >= threshold:
            self.degraded = True
        elif self.degraded and waiting <= threshold // 2:
            self.degraded = False

    def _check_stop(self, seq: Sequence, num_output: int | None = None) -> tuple[SequenceStatus | None, str]:
        """(finish status or None, the text delta to emit) for the newest output token, by chapter 03's rules
        (nanoserve/text/output_text.py, the generate loop's step too): EOS and stop ids stop without text, a stop
        string stops and is cut off, max_tokens is "length".
        num_output: check as if the output ended after that many tokens (None: all of them)."""
        old_text = self.texts[seq.seq_id]
        reason, text = add_token_to_output(seq.output_token_ids[:num_output], old_text, seq.sampling_params,
                                           self.eos_token_id, self.detokenizers.get(seq.seq_id), self.stop_check)
        # A stop string may begin inside text already streamed: the delta is then empty, and the
        # final text is still cut right (chapter 08 holds text back while it could start a stop string).
        self.texts[seq.seq_id] = text
        return _STATUS.get(reason), text[len(old_text):]

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=new_token_ids,
            text=self.texts[seq.seq_id],
            new_text=new_text,
            finished=seq.is_finished and seq.request_id not in self.num_live,
            finish_reason=seq.status.finish_reason,
            metrics=self._metrics(seq) if seq.is_finished else {},
            index=seq.index,
            reject_reason=seq.reject_reason,
        )

    def _metrics(self, seq: Sequence) -> dict:
        metrics = seq.metrics()
        if self.config.degrade_under_load is not None:  # the precision each generated token was computed in
            metrics["token_precisions"] = self.token_precisions.get(seq.seq_id, [])
        return metrics

    def _finish(self, seq: Sequence, new_token_ids: list[int], new_text: str, now: float | None = None) -> RequestOutput:
        seq.finished_time = now or time.perf_counter()
        self.num_live[seq.request_id] -= 1
        if not self.num_live[seq.request_id]:
            del self.num_live[seq.request_id]
        out = self._output(seq, new_token_ids, new_text)
        if self.kv_connector is not None:
            out.kv_transfer_params = self.kv_connector.request_finished(seq)
        self.structured.release(seq.seq_id, seq.request_id, seq.request_id not in self.num_live,
                                seq.output_token_ids if new_token_ids else None)  # chapter 13: its last token checked
        self.detokenizers.pop(seq.seq_id, None)
        self.token_precisions.pop(seq.seq_id, None)
        self.prompt_logprobs.pop(seq.seq_id, None)  # aborted before its prompt was done
        del self.texts[seq.seq_id]
        return out
