"""Exercise 6.1 — write `Scheduler.schedule()`, the heart of continuous batching.

This file mirrors nanoserve/engine/scheduler.py. Everything around `schedule()` is given: your
class inherits the queues and helpers of the reference Scheduler, so you write the policy only.

What you have (see nanoserve/engine/scheduler.py for their code):

    self.config.max_num_seqs, .max_num_batched_tokens, .enable_chunked_prefill
    self.waiting, self.running     lists of Sequence, each kept sorted by urgency
                                   (priority, then arrival_time): index 0 is the most urgent
    self.block_manager             chapter 05's BlockManager (lookup_prefix, get_num_free_blocks, ...)
    self._allocate(seq, n)         grow seq's block table to cover n tokens; None if the pool is short
    self._schedule(out, seq, n)    record "seq computes n tokens this step" in the SchedulerOutput
    self._preempt(seq)             free seq's blocks, reset it, put it back in self.waiting (sorted)
    bisect.insort(self.running, seq, key=_urgency)     keep self.running sorted when you admit

A Sequence gives you num_tokens, num_computed_tokens, token_ids, status, seq_id.

Run `make grade CH=06` to grade it, and `python -m nanoserve batch --student ...` to serve with it.
"""

import bisect  # noqa: F401  (you will want bisect.insort)
import time  # noqa: F401  (seq.scheduled_time, for the queue-time metric)

from nanoserve.engine.scheduler import Scheduler as ReferenceScheduler
from nanoserve.engine.scheduler import SchedulerConfig, SchedulerOutput, _urgency  # noqa: F401
from nanoserve.engine.sequence import SequenceStatus  # noqa: F401


class Scheduler(ReferenceScheduler):
    def schedule(self) -> SchedulerOutput:
        """Plan one step: which sequences compute how many tokens.

        Start with `out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)`, then reset
        `self._finished_seq_ids = []`, and spend a budget of `max_num_batched_tokens` tokens:

        1. Running sequences, in order (most urgent first). Each wants its remaining tokens,
           `num_tokens - num_computed_tokens` (1 for a decode), capped by the budget left.
           If `_allocate` says no, preempt the LAST running sequence (pop it, `_preempt` it, and
           record its id in `out.preempted_seq_ids`) and try again — unless the victim was the
           sequence itself, which then just waits.
        2. Only if nobody was preempted this step: admit from the head of `self.waiting` while
           there is budget and a seat (len(self.running) < max_num_seqs). A sequence's first
           `block_manager.lookup_prefix(seq.token_ids)` tokens are already cached: set
           num_computed_tokens to that and schedule the rest — all of it, or with chunked prefill
           as much as the budget allows (without chunking, a prompt that does not fit waits).
           If `_allocate` says no, stop: the head of the queue is never overtaken.
           An admitted sequence becomes RUNNING, gets `scheduled_time` (if it has none) and joins
           `self.running` in urgency order.
        3. If nothing could be scheduled while nothing runs, raise RuntimeError: the pool is
           leaking blocks (add_seq already refused every request that could never fit).
        """
        raise NotImplementedError("Exercise 6.1: write Scheduler.schedule() (see the docstring and README.md)")
