"""Chapter 06 — the scheduler, on small worked examples computed by hand, plus invariants (hypothesis).

Graded (exercise 6.1): every test that calls `schedule()` runs the learner's scheduler under
`make grade CH=06`. The block manager is chapter 05's reference, so a failure here is the scheduler's.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.kv.block_manager import BlockManager
from nanoserve.student import implementation

graded = pytest.mark.exercise("6.1")  # the tests that call schedule()


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=8, chunked=True):
    sched = implementation("nanoserve.engine.scheduler")
    config = sched.SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked)
    return sched.Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def add(s, seq_id, prompt_len, max_tokens=4, priority=0, arrival=None):
    # distinct tokens per request, so nothing is shared by accident
    base = 1000 * (len(s.seqs) + 1)
    arrival = float(len(s.seqs)) if arrival is None else arrival
    s.add_seq(Sequence(seq_id, list(range(base, base + prompt_len)), max_tokens, priority, arrival))


def step(s, finish_after=None):
    """One schedule() plus a fake forward pass: every sequence that samples gets token 7.
    Sequences whose output reaches max_tokens finish. Returns the SchedulerOutput."""
    out = s.schedule()
    sampled = {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}
    for seq in s.update_from_output(out, sampled, now=0.0):
        if seq.num_output_tokens >= seq.max_tokens:
            s.finish_seq(seq.seq_id, SequenceStatus.FINISHED_LENGTH)
    return out


@graded
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


@graded
def test_finished_sequence_leaves_and_the_next_joins_the_next_step():
    s = make(max_num_seqs=2)
    add(s, "A", 3, max_tokens=2)
    add(s, "B", 3, max_tokens=4)
    add(s, "C", 2)
    assert step(s).num_scheduled_tokens == {"A": 3, "B": 3}
    assert step(s).num_scheduled_tokens == {"A": 1, "B": 1}  # A's 2nd token: A finishes
    assert "A" not in s.seqs and s.block_manager.get_num_free_blocks() == 16 - 1
    assert step(s).num_scheduled_tokens == {"B": 1, "C": 2}  # C takes A's seat at once


@graded
def test_without_chunking_a_prompt_waits_for_room_in_one_step():
    s = make(max_num_batched_tokens=12, chunked=False)
    add(s, "A", 3, max_tokens=2)
    add(s, "B", 10, max_tokens=2)
    add(s, "C", 2)
    # B (10) does not fit next to A (3) in 12 tokens; C, behind B, waits too (FCFS)
    assert step(s).num_scheduled_tokens == {"A": 3}
    assert step(s).num_scheduled_tokens == {"A": 1, "B": 10}
    assert step(s).num_scheduled_tokens == {"B": 1, "C": 2}


def test_request_that_can_never_fit_is_refused_not_looped():
    s = make(num_blocks=4, block_size=4)  # 16 slots in the whole pool
    with pytest.raises(ValueError, match="can never fit"):
        add(s, "big", 10, max_tokens=7)
    s = make(max_num_batched_tokens=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        add(s, "long", 6, max_tokens=3)
    assert not s.has_unfinished_seqs()


@graded
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


@graded
def test_preemption_victim_is_the_lowest_priority():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=16)
    add(s, "A", 4, max_tokens=8, priority=0)
    add(s, "B", 4, max_tokens=8, priority=1)  # lower priority (a higher value), earlier than C
    add(s, "C", 4, max_tokens=8, priority=0)
    step(s)
    out = step(s)
    assert out.preempted_seq_ids == ["B"]
    assert out.num_scheduled_tokens == {"A": 1, "C": 1}


@graded
def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_least_urgent():
    s = make(num_blocks=2, block_size=4, max_num_batched_tokens=16)
    add(s, "A", 4, max_tokens=4)
    add(s, "B", 4, max_tokens=4)
    step(s)  # both prompts: 2 blocks, the pool is full
    out = step(s)
    # A's decode needs a block: B (later) is preempted and A takes it. Then nothing is left for B.
    assert out.preempted_seq_ids == ["B"] and out.num_scheduled_tokens == {"A": 1}
    while s.has_unfinished_seqs():
        step(s)
    assert s.block_manager.get_num_free_blocks() == 2


@graded
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


@graded
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


@graded
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=12),
    st.integers(4, 24),  # blocks
    st.sampled_from([1, 2, 4, 8]),  # block_size
    st.integers(1, 6),  # max_num_seqs
    st.integers(1, 64),  # max_num_batched_tokens
    st.booleans(),  # chunked prefill
)
def test_invariants_on_random_workloads(requests, num_blocks, block_size, max_num_seqs, budget, chunked):
    s = make(num_blocks, block_size, max_num_seqs, budget, chunked)
    accepted = []
    for i, (prompt_len, max_tokens, priority) in enumerate(requests):
        try:
            add(s, f"r{i}", prompt_len, max_tokens, priority)
            accepted.append(f"r{i}")
        except ValueError:  # cannot ever fit: refused up front
            continue
    seqs = dict(s.seqs)
    bound = sum(seqs[r].max_total_tokens for r in accepted) * (len(accepted) + 1) + 10
    for _ in range(bound):
        if not s.has_unfinished_seqs():
            break
        out = step(s)
        assert out.total_num_scheduled_tokens <= budget
        assert len(s.running) <= max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        used = {b for q in s.running for b in s.block_manager.block_table(q.seq_id)}
        assert len(used) == num_blocks - s.block_manager.get_num_free_blocks()
        for q in s.running:  # every running sequence's table covers its computed tokens
            assert len(s.block_manager.block_table(q.seq_id)) * block_size >= q.num_computed_tokens
    assert not s.has_unfinished_seqs(), "workload did not finish: livelock"
    assert all(seqs[r].num_output_tokens == seqs[r].max_tokens for r in accepted)
    assert s.block_manager.get_num_free_blocks() == num_blocks


@graded
def test_prefix_cache_hit_is_not_computed_again():
    sched = implementation("nanoserve.engine.scheduler")
    s = sched.Scheduler(sched.SchedulerConfig(8, 64, True), BlockManager(16, 4, enable_prefix_caching=True))
    prompt = list(range(100, 110))  # 10 tokens: two full blocks of 4, and 2 more
    s.add_seq(Sequence("A", prompt, 1, arrival_time=0.0))
    assert step(s).num_scheduled_tokens == {"A": 10}  # A samples its only token and finishes
    s.add_seq(Sequence("B", prompt + [5], 1, arrival_time=1.0))
    out = step(s)
    # B's 11 tokens: the two full blocks A left in the cache are shared, 8 tokens skipped
    assert out.num_scheduled_tokens == {"B": 3}
    assert out.block_tables["B"][:2] == [0, 1]
    assert s.block_manager.get_num_free_blocks() == 16
