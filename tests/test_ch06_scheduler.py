"""Chapter 06 — the scheduler, on small worked examples computed by hand, plus invariants (hypothesis).

Graded, one rung at a time (exercises/06-continuous-batching/scheduler.py): a test marked
exercise("6.2") runs the learner's 6.2 (`num_new_tokens`) with the reference's other rungs, so each
rung passes or fails on its own. The block manager is chapter 05's reference, so a failure here is the
scheduler's. The random-workload invariants run once per rung.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.policies.base import PriorityPolicy
from nanoserve.engine.sequence import Sequence, SequenceStatus, child_seq_id
from nanoserve.kv.block_manager import BlockManager
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation

RUNGS = ["6.1", "6.2", "6.3", "6.4"]


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=8, chunked=True, prefix_caching=False,
         **scheduler):
    """A scheduler (the learner's rung under grading) on chapter 05's reference block manager; `scheduler`: the
    Scheduler's own keywords (policy, clock, max_loras)."""
    sched = implementation("nanoserve.engine.scheduler")
    config = sched.SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked)
    return sched.Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
                           **scheduler)


def add(s, seq_id, prompt_len, max_tokens=4, priority=0, arrival=None, n=1, prompt=None, lora_name=None, **params):
    # distinct tokens per request, so nothing is shared by accident; `params`: more SamplingParams (prompt_logprobs)
    base = 1000 * (len(s.seqs) + 1)
    arrival = float(len(s.seqs)) if arrival is None else arrival
    prompt = list(range(base, base + prompt_len)) if prompt is None else prompt
    s.add_seq(Sequence(seq_id, prompt, max_tokens, priority, arrival, SamplingParams(n=n, max_tokens=max_tokens, **params),
                       lora_name=lora_name))


def step(s):
    """One schedule() plus a fake forward pass: every sequence that samples gets token 7, and a request
    with n > 1 forks once its first token is sampled (as LLMEngine._fork does). Sequences whose output
    reaches max_tokens finish. Returns the SchedulerOutput."""
    out = s.schedule()
    sampled = {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}
    for seq in s.update_from_output(out, sampled, now=0.0):
        family = [seq]
        if seq.index == 0 and seq.num_output_tokens == 1:
            for i in range(1, seq.sampling_params.n):
                child = Sequence(child_seq_id(seq.request_id, i), seq.prompt_token_ids, seq.max_tokens, seq.priority,
                                 seq.arrival_time, seq.sampling_params.for_completion(i), request_id=seq.request_id,
                                 index=i)
                s.fork_seq(seq, child)
                child.append_token(7, 0.0)
                family.append(child)
        for q in family:
            if q.num_output_tokens >= q.max_tokens:
                s.finish_seq(q.seq_id, SequenceStatus.FINISHED_LENGTH)
    return out


def drain(s, max_steps=200):
    """Step until idle; the list of each step's num_scheduled_tokens."""
    steps = []
    while s.has_unfinished_seqs():
        steps.append(step(s).num_scheduled_tokens)
        assert len(steps) < max_steps, "the workload does not finish"
    return steps


# ---- 6.1: FCFS admission under the token budget and the seats ---------------------------------------------

@pytest.mark.exercise("6.1")
def test_admission_fills_seats_then_waits_for_one_to_free():
    s = make(max_num_seqs=2)
    add(s, "A", 3, max_tokens=2)
    add(s, "B", 3, max_tokens=4)
    add(s, "C", 2)
    out = step(s)
    assert out.num_scheduled_tokens == {"A": 3, "B": 3}  # two seats: C waits
    assert [q.seq_id for q in s.running] == ["A", "B"] and [q.seq_id for q in s.waiting] == ["C"]
    assert s.seqs["A"].status is SequenceStatus.RUNNING and s.seqs["C"].status is SequenceStatus.WAITING
    assert out.block_tables == {"A": [0], "B": [1]}
    assert step(s).num_scheduled_tokens == {"A": 1, "B": 1}  # A's 2nd token: A finishes
    assert "A" not in s.seqs and s.block_manager.get_num_free_blocks() == 16 - 1
    assert step(s).num_scheduled_tokens == {"B": 1, "C": 2}  # C takes A's seat at once


@pytest.mark.exercise("6.1")
def test_admission_stops_at_the_token_budget():
    s = make(max_num_batched_tokens=8, chunked=False)
    add(s, "A", 3, max_tokens=1)
    add(s, "B", 4, max_tokens=1)
    add(s, "C", 2, max_tokens=1)
    add(s, "D", 1, max_tokens=1)
    # 3 + 4 = 7 of 8: C (2) does not fit the 1 token left, and D (1), which would, is behind it
    assert step(s).num_scheduled_tokens == {"A": 3, "B": 4}
    assert step(s).num_scheduled_tokens == {"C": 2, "D": 1}


@pytest.mark.exercise("6.1")
def test_the_queue_head_that_lacks_blocks_is_never_overtaken():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    add(s, "A", 8, max_tokens=4)  # 2 blocks
    assert step(s).num_scheduled_tokens == {"A": 8}
    add(s, "B", 9, max_tokens=2)  # 3 blocks: only 2 are free
    add(s, "C", 2, max_tokens=2)  # 1 block would be free for it, but B is first
    assert step(s).num_scheduled_tokens == {"A": 1}
    assert [q.seq_id for q in s.waiting] == ["B", "C"]
    steps = drain(s)
    assert steps[:3] == [{"A": 1}, {"A": 1}, {"B": 9, "C": 2}]  # A finishes: now B, and C with it


@pytest.mark.exercise("6.1")
def test_admission_follows_priority_then_arrival():
    s = make(max_num_seqs=1)
    add(s, "late-urgent", 2, priority=0, arrival=5.0)
    add(s, "early-lax", 2, priority=1, arrival=1.0)
    add(s, "early-urgent", 2, priority=0, arrival=2.0)
    order = []
    while s.has_unfinished_seqs():
        out = step(s)
        order += [q.seq_id for q in out.scheduled_seqs if q.seq_id not in order]
    assert order == ["early-urgent", "late-urgent", "early-lax"]
    assert s.block_manager.get_num_free_blocks() == 16


@pytest.mark.exercise("6.1")
def test_an_admitted_sequence_is_running_in_urgency_order_with_its_queue_time():
    s = make(max_num_batched_tokens=16)
    add(s, "A", 3, arrival=2.0)
    assert step(s).num_scheduled_tokens == {"A": 3}
    add(s, "B", 3, priority=-1, arrival=3.0)  # more urgent: it goes in front of A in the running set
    out = step(s)
    assert out.num_scheduled_tokens == {"A": 1, "B": 3}
    b = s.seqs["B"]
    assert b.status is SequenceStatus.RUNNING and b.scheduled_time is not None and b.num_computed_tokens == 3
    # the policy re-orders the running set every step: from the next one on, B's decode is served first
    assert [q.seq_id for q in step(s).scheduled_seqs] == ["B", "A"]


@pytest.mark.exercise("6.1")
def test_a_readmitted_sequence_keeps_its_first_scheduled_time():
    """Chapter 09's queue time runs from arrival to the first admission: a preempted sequence that comes back
    keeps the scheduled_time of its first one (a fake clock: the step's number)."""
    now = [0.0]
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=16, clock=lambda: now[0])
    for name in "ABC":
        add(s, name, 4, max_tokens=8)
    a, c = s.seqs["A"], s.seqs["C"]
    now[0] = 1.0
    assert step(s).num_scheduled_tokens == {"A": 4, "B": 4, "C": 4}
    now[0] = 2.0
    assert step(s).preempted_seq_ids == ["C"]  # as in test_preemption_takes_the_latest_arrival_and_it_keeps_its_place
    while c.status is not SequenceStatus.RUNNING:
        now[0] += 1.0
        step(s)
        assert now[0] < 50, "C is never readmitted"
    assert now[0] > 2.0 and c.num_preemptions == 1
    assert (a.scheduled_time, c.scheduled_time) == (1.0, 1.0)  # readmitted at step now[0], admitted first at step 1
    add(s, "D", 2)  # a new arrival gets its own time
    now[0] += 1.0
    while s.seqs["D"].status is not SequenceStatus.RUNNING:
        step(s)
    assert s.seqs["D"].scheduled_time == now[0]


@pytest.mark.exercise("6.1")
def test_the_head_waits_for_a_slot_for_its_lora_adapter():
    """Chapter 19: the running set holds at most max_loras distinct adapters (the base model takes none). A head
    whose adapter would be one too many waits, and everyone behind it with it, as for blocks."""
    s = make(max_num_batched_tokens=32, max_loras=1)
    add(s, "A", 3, max_tokens=2, lora_name="a")
    add(s, "B", 3, max_tokens=2, lora_name="b")  # a second adapter: no slot while A runs
    add(s, "C", 3, max_tokens=2)  # the base model would fit, but C is behind B
    add(s, "A2", 3, max_tokens=2, lora_name="a")  # A's adapter, but behind B and C
    # A finishes in step 2; then B takes the slot with C, and A2 waits for B's adapter to leave
    assert drain(s) == [{"A": 3}, {"A": 1}, {"B": 3, "C": 3}, {"B": 1, "C": 1}, {"A2": 3}, {"A2": 1}]


@pytest.mark.exercise("6.1")
def test_a_request_with_n_completions_takes_n_seats():
    s = make(max_num_seqs=4, max_num_batched_tokens=32)
    add(s, "A", 3, max_tokens=3, n=3)
    add(s, "B", 3, max_tokens=2, n=2)  # 3 + 2 seats > 4: B waits for A's completions to finish
    add(s, "C", 2, max_tokens=2)  # 1 seat would be free, but C is behind B
    assert step(s).num_scheduled_tokens == {"A": 3}  # A forks into A, A#1, A#2
    assert [q.seq_id for q in s.running] == ["A", "A#1", "A#2"]
    assert drain(s) == [{"A": 1, "A#1": 1, "A#2": 1}] * 2 + [{"B": 3, "C": 2}, {"B": 1, "B#1": 1, "C": 1}]


@pytest.mark.exercise("6.1")
def test_abort_frees_blocks_in_the_same_step_running_or_waiting():
    s = make(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=16)
    add(s, "run", 9)
    add(s, "wait", 3)
    step(s)
    assert s.block_manager.get_num_free_blocks() == 8 - 3
    s.finish_seq("run", SequenceStatus.FINISHED_ABORTED)
    assert s.block_manager.get_num_free_blocks() == 8  # before any other step
    s.finish_seq("wait", SequenceStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_seqs()
    assert step(s).finished_seq_ids == ["run", "wait"]  # the worker hears about both


# ---- 6.2: chunked prefill ------------------------------------------------------------------------------

@pytest.mark.exercise("6.2")
def test_mixes_decodes_and_prefill_chunks_within_the_token_budget():
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    add(s, "A", 3)
    add(s, "B", 10)
    add(s, "C", 2)
    out = step(s)
    # A's whole prompt (3) + the first 5 of B's 10; C has no seat (max_num_seqs=2)
    assert out.num_scheduled_tokens == {"A": 3, "B": 5}
    assert [q.seq_id for q in s.running] == ["A", "B"] and [q.seq_id for q in s.waiting] == ["C"]
    assert s.seqs["A"].num_output_tokens == 1 and s.seqs["B"].num_output_tokens == 0  # a partial chunk samples nothing
    assert out.block_tables == {"A": [0], "B": [1, 2]}
    out = step(s)
    assert out.num_scheduled_tokens == {"A": 1, "B": 5}  # A decodes, B's last chunk
    assert s.seqs["B"].num_output_tokens == 1
    out = step(s)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}  # both decoding


@pytest.mark.exercise("6.2")
def test_a_long_prompt_is_chunked_and_only_its_last_chunk_samples():
    s = make(max_num_batched_tokens=4)
    add(s, "A", 10, max_tokens=2)
    a = s.seqs["A"]
    plan = []
    for _ in range(3):
        out = step(s)
        plan.append((out.num_scheduled_tokens["A"], a.num_computed_tokens, a.num_output_tokens, out.block_tables["A"]))
    assert plan == [(4, 4, 0, [0]), (4, 8, 0, [0, 1]), (2, 10, 1, [0, 1, 2])]  # chunks [0, 4), [4, 8), [8, 10)
    assert drain(s) == [{"A": 1}]


@pytest.mark.exercise("6.2")
def test_a_running_chunked_prefill_goes_before_new_admissions():
    s = make(max_num_batched_tokens=6)
    add(s, "A", 10, max_tokens=1)
    assert step(s).num_scheduled_tokens == {"A": 6}
    add(s, "B", 4, max_tokens=1)
    # A's remaining 4 first (it runs), B gets the 2 left of the budget
    assert step(s).num_scheduled_tokens == {"A": 4, "B": 2}
    assert step(s).num_scheduled_tokens == {"B": 2}


@pytest.mark.exercise("6.2")
def test_without_chunking_a_prompt_waits_for_room_in_one_step():
    s = make(max_num_batched_tokens=12, chunked=False)
    add(s, "A", 3, max_tokens=2)
    add(s, "B", 10, max_tokens=2)
    add(s, "C", 2)
    # B (10) does not fit next to A (3) in 12 tokens; C, behind B, waits too (FCFS)
    assert step(s).num_scheduled_tokens == {"A": 3}
    assert step(s).num_scheduled_tokens == {"A": 1, "B": 10}
    assert step(s).num_scheduled_tokens == {"B": 1, "C": 2}


@pytest.mark.exercise("6.2")
def test_a_decode_carrying_proposals_computes_them_in_the_same_step():
    """Chapter 14 sets seq.spec_token_ids before the step: the proposals ride after the known tokens."""
    s = make(max_num_batched_tokens=8)
    add(s, "A", 4, max_tokens=8)
    add(s, "B", 4, max_tokens=8)
    step(s)  # both prefill and sample their first token: 5 tokens, 4 computed
    s.seqs["A"].spec_token_ids = [7, 7, 7]  # 3 proposals: A computes its last token and all 3
    s.seqs["B"].spec_token_ids = [7, 7, 7, 7]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"A": 4, "B": 4}  # B's 5 do not fit the 4 left: a chunk of the budget
    assert out.block_tables == {"A": [0, 2], "B": [1, 3]}  # a 2nd block each, for positions [4, 8)
    s = make(max_num_batched_tokens=9, chunked=False)  # without chunking a prompt waits whole, but proposals are cut
    add(s, "A", 4, max_tokens=5)
    add(s, "B", 4, max_tokens=5)
    step(s)
    s.seqs["A"].spec_token_ids = [7, 7, 7, 7]
    s.seqs["B"].spec_token_ids = [7, 7, 7, 7]
    assert s.schedule().num_scheduled_tokens == {"A": 5, "B": 4}  # B verifies 3 of its 4, never 0 tokens


# ---- 6.3: preemption by recompute, and the guard that keeps it from deadlocking ------------------------------

@pytest.mark.exercise("6.3")
def test_request_that_can_never_fit_is_refused_not_looped():
    s = make(num_blocks=4, block_size=4)  # 16 slots in the whole pool
    with pytest.raises(ValueError, match="can never fit"):
        add(s, "big", 10, max_tokens=7)
    add(s, "just", 10, max_tokens=6)  # 16 tokens: the whole pool, alone
    s = make(max_num_batched_tokens=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        add(s, "long", 6, max_tokens=3)  # a recompute after preemption would be a 9-token prefill
    s = make(max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs is 2"):
        add(s, "wide", 3, n=3)
    assert not s.has_unfinished_seqs()


@pytest.mark.exercise("6.3")
def test_preemption_takes_the_latest_arrival_and_it_keeps_its_place():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    for name in "ABC":
        add(s, name, 4, max_tokens=8)  # 4-token prompts: one full block each
    assert step(s).num_scheduled_tokens == {"A": 4, "B": 4, "C": 4}  # 3 blocks used, 1 free
    add(s, "D", 2)  # arrives later than C
    out = step(s)
    # each decode needs a 2nd block: A takes the free one, B takes C's (C preempted: latest arrival)
    assert out.preempted_seq_ids == ["C"]
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}  # no admissions in a step that preempted
    c = s.seqs["C"]
    assert c.status is SequenceStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.num_tokens == 5  # it keeps its prompt and its first token: it will recompute both
    assert [q.seq_id for q in s.waiting] == ["C", "D"]  # its arrival time keeps it ahead of D
    assert "C" not in s.block_manager.block_tables and s.block_manager.get_num_free_blocks() == 0


@pytest.mark.exercise("6.3")
def test_preemption_victim_is_the_lowest_priority():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    add(s, "A", 4, max_tokens=8, priority=0)
    add(s, "B", 4, max_tokens=8, priority=1)  # lower priority (a higher value), earlier than C
    add(s, "C", 4, max_tokens=8, priority=0)
    step(s)
    out = step(s)
    assert out.preempted_seq_ids == ["B"]
    assert out.num_scheduled_tokens == {"A": 1, "C": 1}


class NamesTheVictim(PriorityPolicy):
    """A policy (chapter 15's interface) that names its own victim: `victim` when it is a candidate, else the last."""

    def __init__(self, victim: str):
        self.victim = victim

    def choose_victim(self, candidates, now):
        return next((q for q in candidates if q.seq_id == self.victim), candidates[-1])


@pytest.mark.exercise("6.3")
def test_the_victim_is_the_one_the_policy_names():
    """Chapter 15's policies choose the victim (scheduler.choose_victim): a policy that names C, not D, the default's."""
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=16, policy=NamesTheVictim("C"))
    for name in "ABCD":
        add(s, name, 4, max_tokens=8)  # 4-token prompts: one full block each
    assert step(s).num_scheduled_tokens == {"A": 4, "B": 4, "C": 4, "D": 4}  # 4 blocks used, 1 free
    out = step(s)
    # each decode needs a 2nd block: A takes the free one; B's turn: the policy names C, whose block B takes; D's
    # turn: D is the only candidate left, its own victim (the default would have taken D for B, then C itself)
    assert out.preempted_seq_ids == ["C", "D"]
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    assert [q.seq_id for q in s.waiting] == ["C", "D"]


@pytest.mark.exercise("6.3")
def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_least_urgent():
    s = make(num_blocks=2, block_size=4, max_num_batched_tokens=16)
    add(s, "A", 4, max_tokens=4)
    add(s, "B", 4, max_tokens=4)
    step(s)  # both prompts: 2 blocks, the pool is full
    out = step(s)
    # A's decode needs a block: B (later) is preempted and A takes it. Then nothing is left for B.
    assert out.preempted_seq_ids == ["B"] and out.num_scheduled_tokens == {"A": 1}
    drain(s)
    assert s.block_manager.get_num_free_blocks() == 2


@pytest.mark.exercise("6.3")
def test_a_full_pool_drains_one_sequence_at_a_time_without_deadlock():
    s = make(num_blocks=3, block_size=2, max_num_batched_tokens=16)
    for name in "ABC":
        add(s, name, 2, max_tokens=4)  # each needs 3 blocks at its end: the whole pool
    steps = drain(s)
    # A, the most urgent, always grows: B then C are preempted, recomputed (prompt + generated) and finish
    assert steps == [{"A": 2, "B": 2, "C": 2}, {"A": 1}, {"A": 1}, {"A": 1},
                     {"B": 3}, {"B": 1}, {"B": 1}, {"C": 3}, {"C": 1}, {"C": 1}]
    assert [s.block_manager.get_num_free_blocks(), s.has_unfinished_seqs()] == [3, False]


# ---- 6.4: prefix-aware admission ------------------------------------------------------------------------------

@pytest.mark.exercise("6.4")
def test_prefix_cache_hit_is_not_computed_again():
    s = make(max_num_batched_tokens=64, prefix_caching=True)
    prompt = list(range(100, 110))  # 10 tokens: two full blocks of 4, and 2 more
    add(s, "A", 0, max_tokens=1, prompt=prompt)
    assert step(s).num_scheduled_tokens == {"A": 10}  # A samples its only token and finishes
    add(s, "B", 0, max_tokens=1, prompt=prompt + [5])
    out = step(s)
    # B's 11 tokens: the two full blocks A left in the cache are shared, 8 tokens skipped
    assert out.num_scheduled_tokens == {"B": 3}
    assert out.block_tables["B"][:2] == [0, 1]
    add(s, "C", 0, max_tokens=1, prompt=prompt[:8])
    # C is exactly the 2 cached blocks: its last token must still be computed (its logits pick the next)
    assert step(s).num_scheduled_tokens == {"C": 4}
    assert s.block_manager.get_num_free_blocks() == 16


@pytest.mark.exercise("6.4")
def test_the_budget_pays_only_for_the_uncached_tail():
    s = make(max_num_batched_tokens=4, prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens
    add(s, "A", 0, max_tokens=1, prompt=prompt)
    assert [plan["A"] for plan in drain(s)] == [4, 4, 3]  # chunked: 4 + 4 + 3
    add(s, "B", 0, max_tokens=2, prompt=prompt)
    out = step(s)
    assert out.num_scheduled_tokens == {"B": 3}  # 8 cached: the last 3 fit in one step, and it samples
    assert s.seqs["B"].num_computed_tokens == 11 and s.seqs["B"].num_output_tokens == 1


@pytest.mark.exercise("6.4")
def test_a_request_for_its_prompt_logprobs_looks_nothing_up():
    """Chapter 08's echo with logprobs scores every prompt position, so a prefix hit may skip none: the request
    gets fresh blocks (the scheduler turns its lookups off) and computes its whole prompt. Once its first token is
    out the rule ends: preempted later, it would look its tokens up like any other."""
    s = make(max_num_batched_tokens=64, prefix_caching=True)
    prompt = list(range(100, 110))  # 10 tokens: two full blocks of 4, and 2 more
    add(s, "A", 0, max_tokens=1, prompt=prompt)
    assert step(s).num_scheduled_tokens == {"A": 10}  # A leaves [0, 8) in the cache
    add(s, "B", 0, max_tokens=1, prompt=prompt, prompt_logprobs=0)
    out = step(s)
    assert out.num_scheduled_tokens == {"B": 10}  # not 2: the cached 8 are computed again, to be scored
    assert not set(out.block_tables["B"]) & {0, 1}  # in blocks of its own, not A's cached ones
    add(s, "C", 0, max_tokens=1, prompt=prompt)
    assert step(s).num_scheduled_tokens == {"C": 2}  # without prompt logprobs: the hit


@pytest.mark.exercise("6.4")
@pytest.mark.parametrize("prefix_caching, recomputed", [(True, 5), (False, 9)])
def test_a_preempted_sequence_is_recomputed_from_its_own_cached_blocks(prefix_caching, recomputed):
    """Worked by hand, blocks of 4, a 4-block pool. A and B: 4-token prompts, 8 new tokens each.
    Step 1 prefills both (a block each), step 2 gives each a 2nd block: the pool is full. After step 5 each
    holds 9 tokens (4 + 5 generated) and [4, 8) is full and cached. Step 6: A's position 8 needs a block:
    B is preempted, its blocks freed last block first, and A takes B's [4, 8). B keeps [0, 4) cached and 9
    tokens; once A finishes (step 8) B comes back and recomputes 9 - 4 = 5 tokens, or all 9 without the cache."""
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=16, prefix_caching=prefix_caching)
    add(s, "A", 4, max_tokens=8)
    add(s, "B", 4, max_tokens=8)
    b = s.seqs["B"]
    plan = []
    while s.has_unfinished_seqs():
        out = step(s)
        plan.append("preempted" if "B" in out.preempted_seq_ids else out.num_scheduled_tokens.get("B", 0))
    assert plan == [4, 1, 1, 1, 1, "preempted", 0, 0, recomputed, 1, 1]
    assert b.num_output_tokens == 8 and b.num_preemptions == 1


# ---- every rung: random workloads ------------------------------------------------------------------------------

@pytest.mark.parametrize("rung", [pytest.param(rung, marks=pytest.mark.exercise(rung)) for rung in RUNGS])
@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 12),
                       st.sampled_from([1, 1, 2, 3])), min_size=1, max_size=12),  # prompt, max_tokens, priority, shared, n
    st.integers(4, 24),  # blocks
    st.sampled_from([1, 2, 4, 8]),  # block_size
    st.integers(1, 6),  # max_num_seqs
    st.integers(1, 64),  # max_num_batched_tokens
    st.booleans(),  # chunked prefill
    st.booleans(),  # prefix caching
)
def test_invariants_on_random_workloads(rung, requests, num_blocks, block_size, max_num_seqs, budget, chunked, caching):
    s = make(num_blocks, block_size, max_num_seqs, budget, chunked, caching)
    accepted = []
    for i, (prompt_len, max_tokens, priority, shared, n) in enumerate(requests):
        prompt = list(range(min(shared, prompt_len))) + list(range(1000 * (i + 1), 1000 * (i + 1) + prompt_len))[shared:]
        try:
            add(s, f"r{i}", 0, max_tokens, priority, n=n, prompt=prompt)
            accepted.append((f"r{i}", n))
        except ValueError:  # cannot ever fit (blocks, seats, or one step without chunking): refused up front
            continue
    seqs = dict(s.seqs)
    bound = sum(seqs[r].max_total_tokens * n for r, n in accepted) * (len(accepted) + 1) + 10
    for _ in range(bound):
        if not s.has_unfinished_seqs():
            break
        queue = list(s.waiting)
        out = step(s)
        assert out.total_num_scheduled_tokens <= budget
        assert len(s.running) <= max_num_seqs and sum(q.num_seats for q in s.running) <= max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        admitted = [q for q in out.scheduled_seqs if q in queue]
        assert admitted == queue[:len(admitted)], "the queue head was overtaken"
        used = {b for q in s.running for b in s.block_manager.block_table(q.seq_id)}
        assert len(used) == num_blocks - s.block_manager.get_num_free_blocks()
        for q in s.running:  # every running sequence's table covers its computed tokens
            assert len(s.block_manager.block_table(q.seq_id)) * block_size >= q.num_computed_tokens
    assert not s.has_unfinished_seqs(), "workload did not finish: livelock"
    assert all(seqs[r].num_output_tokens == seqs[r].max_tokens for r, _ in accepted)
    assert s.block_manager.get_num_free_blocks() == num_blocks
