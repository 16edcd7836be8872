"""Exercises 6.1–6.4 — the scheduler of continuous batching, one idea per rung.

This file mirrors nanoserve/engine/scheduler.py. Your class inherits the reference Scheduler, so
everything you do not write is given — queues, `add_seq`, `fork_seq`, `update_from_output`,
`finish_seq` — and so is `schedule()` itself, which only composes the methods below:

    def schedule(self):
        out = SchedulerOutput(finished_seq_ids=...)
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)   # 6.3
        if not out.preempted_seq_ids:
            self.schedule_waiting(out, budget)                                     # 6.1
        ...                                      # RuntimeError if nothing runs and nothing could start
        return out

    6.1  schedule_waiting    FCFS admission under the token budget and the seats
    6.2  num_new_tokens      chunked prefill: how many tokens a sequence computes this step
    6.3  schedule_running, preempt, check_fits_alone
                             preemption by recompute, and the guard that makes it never deadlock
    6.4  num_cached_tokens   prefix-aware admission: skip what the prefix cache holds

Each rung is graded alone (`make grade CH=06 EX=6.2`): while you work on one, the reference's code
runs for the others. What you have:

    self.config.max_num_seqs, .max_num_batched_tokens, .enable_chunked_prefill
    self.waiting, self.running     lists of Sequence. `schedule()` has the policy order both, most urgent
                                   first, at the start of every step (the running set before
                                   schedule_running, the waiting queue before schedule_waiting): there,
                                   index 0 is the most urgent. The default policy's urgency is _urgency
                                   (priority, then arrival_time), chapter 15's have their own. Between
                                   steps self.waiting stays in _urgency order (insort); self.running
                                   need not be sorted
    self.block_manager             chapter 05's BlockManager (lookup_prefix, free, ...)
    self._allocate(seq, n)         grow seq's block table to cover tokens [0, n); None if the pool is short
                                   (all or nothing: on None nothing changed)
    self._schedule(out, seq, n)    record "seq computes n tokens this step" in the SchedulerOutput
    bisect.insort(self.waiting, seq, key=_urgency)     keep the waiting queue sorted when you add to it
    self.lora_fits(seq)            chapter 19: can seq's LoRA adapter run beside the running set's? (True
                                   without adapters)
    self.choose_victim(i)          the preemption victim among self.running[i:] (the policy's choice), taken
                                   out of self.running
    self.clock()                   the scheduler's time source, in seconds: time.perf_counter in the engine, a
                                   fake clock in the tests (read the time from it, never from `time` directly)

A Sequence gives you num_tokens, num_computed_tokens, token_ids, num_seats, status, seq_id,
num_preemptions, scheduled_time, needs_prompt_logprobs. README.md has the design questions to answer before
each rung.

The engine refuses `--student 06` where the reference scheduler does work this file does not ask of you:
chapter 18's swap preemption, and, once your 6.1 is written, chapter 17's decode role (a KV connector that loads
prompt K/V at admission).
"""

import bisect  # noqa: F401  (you will want bisect.insort)

from nanoserve.engine.scheduler import Scheduler as ReferenceScheduler
from nanoserve.engine.scheduler import SchedulerConfig, _urgency  # noqa: F401
from nanoserve.engine.scheduler_output import SchedulerOutput  # noqa: F401
from nanoserve.engine.sequence import Sequence, SequenceStatus  # noqa: F401


class Scheduler(ReferenceScheduler):
    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Exercise 6.1: admit waiting sequences, head first; return the budget left.

        What must hold when it returns:
          - admission is first come, first served in urgency order: a sequence is admitted only if every
            sequence before it in `self.waiting` was; the first one that cannot start (no budget, no seat,
            no slot for its LoRA adapter, no blocks) stops the admissions this step — nobody overtakes it;
          - the adapter slot (chapter 19): `self.lora_fits(seq)` says whether seq's adapter can run beside
            those of the running set (always True without adapters); a head for which it is False waits;
          - the running set never holds more than `max_num_seqs` seats (a sequence takes `seq.num_seats`:
            n for a request with n completions, 1 otherwise);
          - an admitted sequence skips what the prefix cache already holds (6.4), computes as many tokens
            as 6.2 allows from there, has blocks for them, is RUNNING, is in `self.running` (where in it does
            not matter: the policy orders the running set at the start of the next step), is in `out` with its
            token count, and those tokens are off the budget;
          - its `scheduled_time` is `self.clock()` at its *first* admission, and is set only then (chapter 09
            measures queueing time from it: a preempted sequence coming back keeps its first one; a sequence
            that never ran has None there);
          - a sequence that is not admitted is left exactly as it was (it holds no new blocks).
        Example: budget 8, chunking off, waiting [A (5-token prompt), B (5), C (1)]: A is admitted (3 left);
        B does not fit whole, so B and C both wait, although C would fit. With a clock reading 1.0 at that
        step, A's scheduled_time is 1.0; if A is preempted at 2.0 and readmitted at 5.0, it is still 1.0.
        """
        raise NotImplementedError("Exercise 6.1: write Scheduler.schedule_waiting (see its docstring and README.md)")

    def num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int) -> int:
        """Exercise 6.2: how many tokens `seq` computes this step, starting at `num_computed_tokens`, with
        `budget` (>= 1) tokens of the step left.

        Returns an int in [0, budget]: all the tokens it has left to compute if they fit, else with
        `self.config.enable_chunked_prefill` a chunk filling the budget (the rest follows in later steps), else
        0 (the prefill waits until it fits whole). The tokens left are its known tokens not yet computed (1 for
        a decode), plus, from chapter 14 on, the proposals it carries to verify (`seq.spec_token_ids`: they ride
        after its known tokens, in the same step). Proposals are not a prompt: when only they overflow the
        budget, it fills the budget and verifies fewer of them, chunking or not.
        Examples: a 10-token prompt, 0 computed, budget 8: 8 (chunk [0, 8)), without chunking 0; the same with 8
        computed: 2; a decode: 1; a decode carrying 3 proposals, budget 8: 4; with 4 proposals, budget 3: 3.
        """
        raise NotImplementedError("Exercise 6.2: write Scheduler.num_new_tokens (see its docstring and README.md)")

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Exercise 6.3: schedule the running sequences, most urgent first; return the budget left.

        What must hold when it returns:
          - the running sequences are served in urgency order (`self.running[0]` first) while budget lasts,
            each computing what 6.2 allows and holding the blocks for it;
          - when the pool is short for the sequence at index i, blocks are taken back by preempting
            (`self.preempt`) the victims `self.choose_victim(i)` names (chapter 15's policies choose, and may name
            any sequence of `self.running[i:]`; by default the LEAST urgent running sequence), one at a time,
            until it fits; each victim leaves `self.running` and its id is in `out.preempted_seq_ids`;
          - a sequence never preempts a more urgent one: if the only one left to take blocks from is the
            sequence itself, it is the one preempted, and it waits;
          - every sequence still in `self.running` afterwards is in `out`, or was not reached for lack of budget.
        Example: running [A, B, C] (A most urgent), a pool with one free block and A and B each needing a new
        one: A takes it; B's turn preempts C, whose freed blocks give B its block.
        """
        raise NotImplementedError("Exercise 6.3: write Scheduler.schedule_running (see its docstring and README.md)")

    def preempt(self, seq: Sequence) -> None:
        """Exercise 6.3: preemption by recompute. Free seq's blocks (the block manager), make it PREEMPTED with
        0 computed tokens (it keeps its tokens: prompt and generated), count it in seq.num_preemptions, and put
        it back into self.waiting in urgency order.
        Example, blocks of 4: B (a 4-token prompt + 5 generated = 9 tokens, 8 computed, 2 blocks) preempted: 0
        blocks, status PREEMPTED, num_computed_tokens 0, num_tokens still 9, num_preemptions 1, and in self.waiting ahead of
        every sequence of its priority that arrived after it."""
        raise NotImplementedError("Exercise 6.3: write Scheduler.preempt (see its docstring and README.md)")

    def check_fits_alone(self, seq: Sequence) -> None:
        """Exercise 6.3: the guard `add_seq` calls. Raise ValueError, naming the numbers, for a request that
        could never run even alone in an empty pool:
          - its prompt + max_tokens (seq.max_total_tokens) need more blocks than the whole pool has
            (`self.block_manager.num_blocks` blocks of `.block_size` tokens), with "can never fit" in the message;
          - it needs more seats (seq.num_seats) than max_num_seqs, with "max_num_seqs is N" in the message;
          - without chunked prefill, seq.max_total_tokens > max_num_batched_tokens (a preempted sequence is
            recomputed as one prefill of all its tokens), with "chunked prefill is off" in the message.
        Example: a pool of 4 blocks of 4 tokens: prompt 10 + max_tokens 6 = 16 tokens is accepted, prompt 10 +
        max_tokens 7 = 17 tokens (5 blocks) is refused; with max_num_seqs 2, a request with n=3 is refused.
        """
        raise NotImplementedError("Exercise 6.3: write Scheduler.check_fits_alone (see its docstring and README.md)")

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Exercise 6.4: how many leading tokens of `seq` the prefix cache already holds, so admission skips
        them. Ask chapter 05's block manager. Which tokens do you look up for a sequence that was preempted
        after generating some?
        Returns a multiple of the block size, < seq.num_tokens. Example: blocks of 4, a new 11-token prompt whose
        first 8 tokens are cached: 8; a prompt of exactly those 8 tokens: 4 (its last token must be computed,
        its logits pick the next).
        Except: a request that wants its prompt logprobs (`seq.needs_prompt_logprobs`: chapter 08's echo with
        logprobs, until its first token is out) gets 0, cache or not. Every prompt position must be computed to
        be scored, and `_allocate` gives such a request fresh blocks (no prefix lookups): a count > 0 would mark
        positions as computed whose K/V no block holds. Example: the same 11-token prompt with prompt
        logprobs: 0, and all 11 tokens are computed."""
        raise NotImplementedError("Exercise 6.4: write Scheduler.num_cached_tokens (see its docstring and README.md)")
