"""Chapter 06 — one request's state as it moves through the engine.

    add_request ─▶ WAITING ─▶ RUNNING ─▶ FINISHED_STOPPED   (EOS, a stop id or a stop string)
                                │  ▲  └─▶ FINISHED_LENGTH    (max_tokens reached)
                                ▼  │
                             PREEMPTED     (blocks ran out: blocks freed, recomputed when readmitted)
                             or SWAPPED    (chapter 18's swap mode: its blocks in the KV tier, swapped back in)
    abort_request, from any live state ─▶ FINISHED_ABORTED

The scheduler reads only integers from here: how many tokens the sequence has
(`num_tokens` = prompt + generated so far), how many of them already have K/V in the cache
(`num_computed_tokens`), its priority and its arrival time. A decode step and a prefill chunk
are the same thing seen this way: "compute tokens [num_computed_tokens, num_computed_tokens + n)".

    prompt = [t0 t1 t2 t3 t4], generated = [t5]      num_tokens = 6
    K/V cached for positions [0, 5): t0 to t4       num_computed_tokens = 5
    next step computes 1 token (t5) and samples t6   -> a decode

Preemption by recompute frees the blocks: num_computed_tokens drops to 0 and the sequence waits
with its prompt *and* the tokens it had generated, in the waiting queue but PREEMPTED, not WAITING:
its admission makes it RUNNING again. Readmitted, its tokens are a prompt like any other: with
prefix caching on, its own freed blocks that are still cached are hits, and only the rest is
recomputed (tests/test_ch06_llm.py: 5 tokens of 13 recomputed, all 13 without prefix caching).
Preemption by swap (chapter 18) keeps num_computed_tokens: the K/V wait in the KV tier, and nothing is recomputed.

Parallel sampling (n > 1): completion 0 is the request's own sequence (seq_id = request_id); once
its prompt is computed the engine forks completions [1, n) (child_seq_id), each with its `index`.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from nanoserve.kv.prefix_cache import SaltedTokenIds
from nanoserve.metrics import e2e, itl, tpot, ttft


def child_seq_id(request_id: str, index: int) -> str:
    """The sequence id of completion `index` >= 1 of a request with n > 1 (completion 0 is the request id)."""
    return f"{request_id}#{index}"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its blocks freed
    SWAPPED = "swapped"  # back in the waiting queue, its blocks in the KV tier (chapter 18), its K/V kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop", "length", "abort"; None while the sequence lives."""
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Sequence:
    """A request in flight. `priority`: a lower value is served first (vLLM's convention)."""

    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    sampling_params: Any = None  # the engine's SamplingParams; the scheduler reads only num_seats from it
    # parallel sampling (n > 1): the request this sequence is completion `index` of; "" = seq_id
    request_id: str = ""
    index: int = 0
    tenant: str | None = None  # chapter 08: the API key's tenant that sent it (None: no tenants); chapter 15's fair policy
    slo: Any = None  # chapter 15: the request's own SLOTargets (nanoserve/engine/policies/base.py), or None
    cache_salt: str | None = None  # chapter 08: whose prefix cache its blocks are in (None: everyone's)
    lora_name: str | None = None  # chapter 19: the LoRA adapter it runs with (None: the base model)
    lora_id: int | None = None  # chapter 19: that adapter's id (a new one each time it is loaded)

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    # chapter 14: proposed next tokens to verify in the next step (never in token_ids until accepted)
    spec_token_ids: list[int] = field(default_factory=list)
    speculative: bool = True  # add_request(..., speculative=False): this request never speculates
    reject_reason: str | None = None  # chapter 15: why the scheduling policy refused it (--slo-reject)
    # chapter 17: what the KV connector reads (nanoserve/disagg/connector.py): {"do_remote_decode": True} on a
    # prefill engine, the prefill engine's answer on a decode engine; None: an ordinary request
    kv_transfer_params: dict | None = None
    # metrics (perf_counter seconds)
    scheduled_time: float | None = None  # first time the scheduler admitted it
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finished_time: float | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.seq_id!r}: prompt_token_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.seq_id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        self.request_id = self.request_id or self.seq_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt + generated ids; with a cache_salt they carry it, and the adapter, to the block manager
        (SaltedTokenIds; an adapter's requests always have a salt: chapter 19's lora_cache_salt)."""
        ids = self.prompt_token_ids + self.output_token_ids
        if self.cache_salt is None:
            return ids
        return SaltedTokenIds(ids, self.cache_salt, None if self.lora_name is None else (self.lora_id, self.lora_name))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold in the cache."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def num_seats(self) -> int:
        """Seats (max_num_seqs) the sequence takes in the running set: n for a request with n > 1 completions
        that has not forked yet (its prompt not computed, or recomputed after a preemption before the fork),
        since it forks into n sequences the step its prompt is done; 1 for anything else."""
        n = getattr(self.sampling_params, "n", 1)
        return n if self.index == 0 and self.num_output_tokens == 0 else 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Chapter 08: does the request want its prompt tokens scored, and are they not scored yet? (Until the
        first token is out: a preemption before it recomputes, and rescores, the prompt from position 0.)"""
        return getattr(self.sampling_params, "prompt_logprobs", None) is not None and self.num_output_tokens == 0 \
            and self.index == 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def metrics(self) -> dict:
        """Per-request latencies in seconds (None where not reached yet), by chapter 09's definitions
        (nanoserve/metrics.py) on the engine's clock: from arrival, one timestamp per generated token.

        queue_time: arrival -> first scheduled      ttft: arrival -> first token
        tpot: (e2e - ttft) / (tokens - 1)           itl: gaps between consecutive tokens
        e2e: arrival -> finished
        """
        first, total = ttft(self.arrival_time, self.token_times), e2e(self.arrival_time, self.finished_time)
        return {
            "queue_time": None if self.scheduled_time is None else self.scheduled_time - self.arrival_time,
            "ttft": first,
            "tpot": tpot(first, total, self.num_output_tokens),
            "itl": itl(self.token_times),
            "e2e": total,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
        }
