"""Chapter 06 — the scheduler: which sequences run in the next forward pass, and how many
tokens each computes. Called once per step (iteration-level scheduling), so a request joins
the batch the step after it arrives and leaves it the step it finishes.

Everything here is an integer: token counts, block counts, a token budget. A prefill chunk and
a decode are the same request — "compute n more tokens of this sequence" — so a single step
can mix the decodes of running sequences with (chunks of) the prompts of new ones:

    max_num_batched_tokens = 8, block_size = 4; A decoding, B's 10-token prompt arrives
    step 1:  A: 1 token (decode)   B: 7 tokens (chunk [0, 7), samples nothing)
    step 2:  A: 1 token (decode)   B: 3 tokens (chunk [7, 10), samples B's first token)
    step 3:  A: 1 token            B: 1 token                 — both decoding

The policy, one method per idea (exercises/06 writes them one at a time, rungs 6.1 to 6.4):

    schedule()                  the step: running sequences first, then admissions, then a leak check
      schedule_running(out, b)  6.3  running sequences, most urgent first (priority, then arrival), each
                                     computes its remaining tokens (1 for a decode, the rest of its prompt for
                                     a chunked prefill). If the pool cannot hold them, preempt the *least*
                                     urgent running sequence (highest priority value, latest arrival) by
                                     recompute and try again; if that victim is the sequence itself, it waits.
      schedule_waiting(out, b)  6.1  only if nobody was preempted this step: admit from the head of the
                                     waiting queue while there is budget, seats (a request with n
                                     completions takes n) and blocks. The head blocks the ones behind it
                                     (strict FCFS: a long prompt is not overtaken forever by short ones).
      num_new_tokens(seq, c, b) 6.2  how many tokens a sequence computes: all that are left, or a chunk of
                                     the budget (chunked prefill), or none (without chunking, it waits)
      num_cached_tokens(seq)    6.4  the prefix-cache hit an admission skips
    preempt(seq)                6.3  recompute preemption: free the blocks, keep the tokens, wait again
                                     (chapter 18's swap mode: the blocks go to the KV tier and come back)
    check_fits_alone(seq)       6.3  add_seq's guard: refuse what could never run, even alone

Chapter 15 makes the orders a policy (nanoserve/engine/policies/): each step, the scheduler asks it to order
the running sequences (who gets the budget first) and the waiting ones (who is admitted first), to pick the
preemption victim, and whether a waiting request is refused; the default, "priority", is the order above.
Time comes from `clock` (time.perf_counter; tests pass a fake one).

vLLM v0 splits its scheduler the same way (_schedule_running, _schedule_prefills); v1 runs the same two
loops, running then waiting, inside one schedule().

Why this never deadlocks or livelocks: `check_fits_alone` refuses a request whose prompt + max_tokens
could not fit in the whole pool alone (ValueError), so the most urgent running sequence can always grow
by preempting the others; it finishes, frees its blocks, and the next one moves up.

Why nothing starves within a priority: both queues are ordered by (priority, arrival_time) and a
preempted sequence keeps its original arrival time, so it goes back to the *front* of its class,
and the head of the waiting queue is never skipped. Across priorities the order is strict (as in
vLLM): low-priority work waits while more urgent work keeps arriving — that is what priority means.
"""

import bisect
import time

from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.policies.base import PriorityPolicy
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import Sequence, SequenceStatus


def _urgency(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager, policy=None, clock=time.perf_counter,
                 max_loras: int | None = None, connector=None):
        """max_loras (chapter 19): distinct LoRA adapters the running set may hold (None: adapters are off).
        connector: chapter 17's KV connector, its scheduler side (nanoserve/disagg/connector.py): at admission it
        says how many prompt tokens another engine computed, and learns where they land."""
        self.config = config
        self.max_loras = max_loras
        self.connector = connector
        self.block_manager = block_manager  # chapter 05's BlockManager (or the learner's)
        self.policy = policy or PriorityPolicy()  # chapter 15: the orders (nanoserve/engine/policies/)
        budget = getattr(self.policy, "budget", config.max_num_batched_tokens)  # slo counts its laxity in steps
        if budget != config.max_num_batched_tokens:
            raise ValueError(f"the policy counts steps of {budget} tokens, the scheduler's budget is "
                             f"{config.max_num_batched_tokens}: build it with make_policy(config)")
        self.clock = clock
        self.now = clock()  # the current step's time, read once per schedule()
        self.waiting: list[Sequence] = []  # WAITING, PREEMPTED and SWAPPED ones; the policy orders them each step
        self.running: list[Sequence] = []  # they hold blocks; the policy orders them each step
        self.seqs: dict[str, Sequence] = {}  # every live sequence by id
        self._finished_seq_ids: list[str] = []

    def add_seq(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in flight")
        self.check_fits_alone(seq)
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=_urgency)

    def check_fits_alone(self, seq: Sequence) -> None:
        """Raise ValueError for a request that could never be scheduled, even alone in an empty pool: the
        guard that lets the most urgent sequence always grow, by preempting all the others if it must."""
        bm = self.block_manager
        blocks_needed = -(-seq.max_total_tokens // bm.block_size)
        if blocks_needed > bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id!r} can never fit: prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.max_tokens}) "
                f"needs {blocks_needed} blocks of {bm.block_size} tokens, the whole pool has {bm.num_blocks}"
            )
        if seq.num_seats > self.config.max_num_seqs:
            raise ValueError(f"request {seq.seq_id!r}: n={seq.num_seats} completions need as many seats, "
                             f"max_num_seqs is {self.config.max_num_seqs}")
        if not self.config.enable_chunked_prefill and seq.max_total_tokens > self.config.max_num_batched_tokens:
            # without chunking a (re)computed prefill must fit in one step's token budget
            raise ValueError(
                f"request {seq.seq_id!r} can never be scheduled: prompt + max_tokens = {seq.max_total_tokens} tokens "
                f"> max_num_batched_tokens={self.config.max_num_batched_tokens} and chunked prefill is off"
            )

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """One step's plan: the running sequences first, then admissions (the policy: see the top of this file)."""
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        self.now = now = self.clock()
        for seq in list(self.waiting):
            seq.reject_reason = self.policy.reject_reason(seq, now)
            if seq.reject_reason:
                out.rejected_seqs.append(self.finish_seq(seq.seq_id, SequenceStatus.FINISHED_ABORTED))
        self.running = self.policy.order_running(self.running, now)
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        self.waiting = self.policy.order_waiting(self.waiting, now)  # after the running ones were charged (fair)
        if not out.preempted_seq_ids:  # memory is too tight for who runs already: admitting more would only preempt
            self.schedule_waiting(out, budget)
        if not out.scheduled_seqs and self.waiting and not self.running:
            # check_fits_alone guarantees the queue head fits an empty pool; if it does not, blocks leaked
            raise RuntimeError(
                f"cannot schedule {self.waiting[0].seq_id!r} with nothing running: the block manager has "
                f"{self.block_manager.get_num_free_blocks()}/{self.block_manager.num_blocks} blocks free"
            )
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running sequences, most urgent first, preempting from the least urgent end when the
        pool is short; returns the budget left. The victims are taken from the end of self.running, so a
        sequence already scheduled in this step is never one."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self.num_new_tokens(seq, seq.num_computed_tokens, budget)
            while self._allocate(seq, seq.num_computed_tokens + n) is None:
                victim = self.choose_victim(i)
                self.preempt(victim)
                out.preempted_seq_ids.append(victim.seq_id)
                if victim is seq:
                    break
            else:
                self._schedule(out, seq, n)
                budget -= n
                i += 1
        return budget

    def choose_victim(self, i: int) -> Sequence:
        """Take the preemption victim out of self.running[i:] (not scheduled yet this step): the policy's choice;
        with the default policy the last one, the least urgent."""
        victim = self.policy.choose_victim(self.running[i:], self.now)
        self.running.remove(victim)
        return victim

    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit from the head of the waiting queue while budget, seats and blocks last; returns the budget left.
        The head that does not fit stops the admissions: nobody overtakes it."""
        seats = sum(seq.num_seats for seq in self.running)
        while self.waiting and budget > 0 and seats + self.waiting[0].num_seats <= self.config.max_num_seqs:
            seq = self.waiting[0]
            # chapter 18: a swapped-out sequence keeps its computed tokens (its blocks come back in _allocate)
            computed = seq.num_computed_tokens if seq.status is SequenceStatus.SWAPPED else self.num_cached_tokens(seq)
            # chapter 17: prompt tokens a prefill engine computed are loaded, not computed (and cost no budget)
            external = self.connector.get_num_new_matched_tokens(seq, computed) if self.connector else 0
            n = self.num_new_tokens(seq, computed + external, budget)
            if n == 0 or not self.lora_fits(seq) or self._allocate(seq, computed + external + n) is None:
                break  # the head waits for budget, an adapter slot or blocks
            if external:
                self.connector.update_state_after_alloc(seq, self.block_manager.block_table(seq.seq_id), computed,
                                                        external)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = computed + external
            if seq.scheduled_time is None:
                seq.scheduled_time = self.clock()
            self.running.append(seq)  # the policy re-orders the running set next step
            self._schedule(out, seq, n)
            budget -= n
            seats += seq.num_seats
        return budget

    def lora_fits(self, seq: Sequence) -> bool:
        """Chapter 19: can `seq` run beside the running set without more than max_loras distinct adapters? The
        base model takes no slot. A head that does not fit waits, and (strict FCFS) so does everyone behind it, so
        it is not starved by a stream of requests for the adapters already running: those drain, a slot frees.

            max_loras = 2, running adapters {a, b}:   a request for a, b or the base fits; one for c waits
        """
        if self.max_loras is None or seq.lora_name is None:
            return True
        running = {s.lora_name for s in self.running} - {None}
        return seq.lora_name in running or len(running) < self.max_loras

    def num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int) -> int:
        """How many tokens `seq` computes this step, from `num_computed_tokens` on, with `budget` tokens left
        (budget >= 1): all it has left (1 for a decode) if they fit, else a chunk of the budget (chunked
        prefill), or 0 without chunking — a prefill that does not fit waits whole.

            10-token prompt, 0 computed, budget 8:   8 (chunk [0, 8));  without chunking 0
            the same, 8 computed, budget 8:          2 (the last chunk, [8, 10): it samples)
            a decode (1 left), any budget:            1
            a decode carrying 4 proposals, budget 3:   3 (chapter 14: it verifies 2 of them), chunking or not
        """
        known = seq.num_tokens - num_computed_tokens
        n = known + len(seq.spec_token_ids)  # chapter 14: + the proposals to verify
        if n <= budget:
            return n
        # a prompt waits whole without chunking; proposals are no prompt: a short budget verifies fewer of them
        return budget if self.config.enable_chunked_prefill or known <= budget else 0

    def num_cached_tokens(self, seq: Sequence) -> int:
        """The leading tokens of `seq` whose K/V the prefix cache already holds (whole blocks, never all of
        them): admission skips them. A preempted sequence looks up its generated tokens too, so it finds its
        own freed blocks that are still cached and recomputes only the tail. Chapter 08: a request that wants
        its prompt logprobs looks nothing up (its prompt positions must all be computed to be scored)."""
        if seq.needs_prompt_logprobs:
            return 0
        return self.block_manager.lookup_prefix(seq.token_ids)

    def _allocate(self, seq: Sequence, num_tokens: int) -> list[int] | None:
        if seq.status is SequenceStatus.SWAPPED:  # chapter 18: all its blocks back from the tier, as one unit
            return self.block_manager.swap_in(seq.seq_id, seq.token_ids, num_tokens)
        if seq.needs_prompt_logprobs:  # no prefix hits for it, as num_cached_tokens said
            with self.block_manager.prefix_lookups_off():
                return self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, num_tokens)
        return self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, num_tokens)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.scheduled_seqs.append(seq)
        out.num_scheduled_tokens[seq.seq_id] = n
        out.block_tables[seq.seq_id] = list(self.block_manager.block_table(seq.seq_id))  # a snapshot
        self.policy.on_scheduled(seq, n)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Parallel sampling: `child` joins the running set holding the parent's blocks (BlockManager.fork:
        ref counts up, nothing copied) and the parent's computed tokens. Its seat was reserved when the
        parent was admitted (Sequence.num_seats)."""
        if child.seq_id in self.seqs:
            raise ValueError(f"request id {child.seq_id!r} is already in flight")
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.scheduled_time = parent.scheduled_time
        self.seqs[child.seq_id] = child
        bisect.insort(self.running, child, key=_urgency)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the cache, keep the tokens, go back to the front of the class.

        Chapter 18's swap mode (preemption_mode "swap"): the block manager writes all the sequence's blocks to the
        second tier instead, and it keeps its computed tokens (SWAPPED); when the tier has no room, recompute."""
        if self.config.preemption_mode == "swap" and self.block_manager.swap_out(seq.seq_id):
            seq.status = SequenceStatus.SWAPPED
        else:
            self.block_manager.free(seq.seq_id)
            seq.status = SequenceStatus.PREEMPTED
            seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_urgency)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: dict[str, int], now: float) -> list[Sequence]:
        """Advance each scheduled sequence by the tokens it computed; append the sampled ones.
        Returns the sequences that got a new token (the engine checks them for stops)."""
        advanced = []
        for seq in out.scheduled_seqs:
            if seq.status is not SequenceStatus.RUNNING:  # aborted since the step was planned
                continue
            seq.num_computed_tokens += out.num_scheduled_tokens[seq.seq_id]
            if seq.seq_id in sampled_token_ids:
                seq.append_token(sampled_token_ids[seq.seq_id], now)
                advanced.append(seq)
        return advanced

    def finish_seq(self, seq_id: str, status: SequenceStatus) -> Sequence:
        """Finish (or abort) a running or waiting sequence; its blocks are free on return."""
        if not status.is_finished:
            raise ValueError(f"finish_seq needs a FINISHED_* status, got {status}")
        seq = self.seqs.pop(seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq_id)
        else:  # WAITING, PREEMPTED or SWAPPED: holds no pool blocks
            self.waiting.remove(seq)
            if seq.status is SequenceStatus.SWAPPED:  # chapter 18: its blocks wait in the tier: free their slots
                self.block_manager.free(seq_id)
        seq.status = status
        self._finished_seq_ids.append(seq_id)
        return seq
