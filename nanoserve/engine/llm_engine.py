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

import importlib
import time
import warnings
from dataclasses import dataclass, field

from nanoserve.engine.executor import Executor
from nanoserve.engine.scheduler import SchedulerConfig, SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.worker import Worker
from nanoserve.stop import check_stop, is_stop_token
from nanoserve.student import STUDENT_FILES, load_student


_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as fit in kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool when num_blocks is None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    student: bool = False  # run the learner's scheduler, block allocator and prefix cache (exercises/05, 06)


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


def _module(name: str, student: bool, probe=lambda mod: None):
    """The reference module, or with `student` the learner's mirror of it (exercises/) — if it is finished:
    an exercise whose `probe(module)` still raises NotImplementedError falls back to the reference, with a warning."""
    if student and name in STUDENT_FILES:
        mod = load_student(name)
        try:
            probe(mod)
            return mod
        except NotImplementedError as e:
            warnings.warn(f"exercises/{STUDENT_FILES[name]} is not finished ({e}): using the reference {name}")
    return importlib.import_module(name)


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None, eos_token_id: int | None = None):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.executor = Executor([Worker(model)])
        num_blocks = config.num_blocks or self.executor.num_blocks_for(config.kv_cache_memory, config.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no block of {config.block_size} tokens")
        self.executor.init_kv_cache(num_blocks, config.block_size)
        # with student=True: the learner's block allocator and prefix cache (exercises/05) and scheduler (06)
        allocator = _module("nanoserve.kv.block_allocator", config.student,
                            lambda m: m.BlockAllocator(1).allocate(1)).BlockAllocator(num_blocks)
        prefix_cache = _module("nanoserve.kv.prefix_cache", config.student,
                               lambda m: m.PrefixCache().get(m.hash_block(None, [0]), None, [0])).PrefixCache()
        self.block_manager = _module("nanoserve.kv.block_manager", config.student).BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, allocator=allocator, prefix_cache=prefix_cache
        )
        scheduler_mod = _module("nanoserve.engine.scheduler", config.student)
        scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.scheduler = scheduler_mod.Scheduler(scheduler_config, self.block_manager)
        self.max_model_len = model.config.max_position_embeddings
        # the longest sequence (prompt + output) this engine can ever hold: the context, or the whole pool
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self.vocab_size = model.config.vocab_size
        # without a tokenizer (token ids in, token ids out) EOS must be given to stop on it
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", -1)
        self.detokenizers = {}  # request_id -> IncrementalDetokenizer
        self.texts: dict[str, str] = {}
        self.last_scheduler_output: SchedulerOutput | None = None  # for traces (notebook, tests)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        prompt_token_ids = list(prompt_token_ids)
        # Checked here, at the engine's door: a bad id found inside step() would fail a whole batch.
        if not prompt_token_ids or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a non-empty list of ints "
                             f"in [0, {self.vocab_size})")
        if len(prompt_token_ids) + sampling_params.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({sampling_params.max_tokens}) exceeds the model's context of {self.max_model_len}"
            )
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need an engine with a tokenizer")
        seq = Sequence(request_id, prompt_token_ids, sampling_params.max_tokens, priority, sampling_params=sampling_params)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.scheduler.add_seq(seq)  # raises if it could never fit: no request loops forever
        if self.tokenizer is not None:
            from nanoserve.detokenizer import IncrementalDetokenizer

            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.texts[request_id] = ""

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting or running request now: its blocks are back in the pool on return."""
        if request_id not in self.scheduler.seqs:
            return None
        seq = self.scheduler.finish_seq(request_id, SequenceStatus.FINISHED_ABORTED)
        return self._finish(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.seqs)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.last_scheduler_output = scheduler_output
        sampled = self.executor.execute_model(scheduler_output)
        now = time.perf_counter()
        outputs = []
        for seq in self.scheduler.update_from_output(scheduler_output, sampled, now):
            token_id = seq.output_token_ids[-1]
            status, new_text = self._check_stop(seq, token_id)
            if status is None:
                outputs.append(self._output(seq, [token_id], new_text))
            else:
                self.scheduler.finish_seq(seq.seq_id, status)  # blocks back in the pool for the next step
                outputs.append(self._finish(seq, [token_id], new_text, now))
        return outputs

    def _check_stop(self, seq: Sequence, token_id: int) -> tuple[SequenceStatus | None, str]:
        """(finish status or None, the text delta to emit), by chapter 03's rules (nanoserve/stop.py):
        EOS and stop ids stop without text, a stop string stops and is cut off, max_tokens is "length"."""
        params = seq.sampling_params
        detok = self.detokenizers.get(seq.seq_id)
        stop_token = is_stop_token(token_id, params, self.eos_token_id)
        new_text = detok.add(token_id) if detok is not None and not stop_token else ""
        old_text = self.texts[seq.seq_id]
        reason, text = check_stop(seq.output_token_ids, old_text + new_text, params, self.eos_token_id, len(new_text))
        if reason is not None and detok is not None and len(text) == len(detok.text):
            text += detok.flush()  # not cut at a stop string: an unfinished character's bytes become '�'
        # A stop string may begin inside text already streamed: the delta is then empty, and the
        # final text is still cut right (chapter 08 holds text back while it could start a stop string).
        self.texts[seq.seq_id] = text
        return _STATUS.get(reason), text[len(old_text):]

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=new_token_ids,
            text=self.texts[seq.seq_id],
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.status.finish_reason,
            metrics=seq.metrics() if seq.is_finished else {},
        )

    def _finish(self, seq: Sequence, new_token_ids: list[int], new_text: str, now: float | None = None) -> RequestOutput:
        seq.finished_time = now or time.perf_counter()
        out = self._output(seq, new_token_ids, new_text)
        self.detokenizers.pop(seq.seq_id, None)
        del self.texts[seq.seq_id]
        return out
