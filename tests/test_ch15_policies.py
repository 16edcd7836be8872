"""Chapter 15 — the scheduling policies, each alone on scripted workloads whose schedules are computed by hand,
then invariants on random workloads (hypothesis) and the fairness property with two tenants at 10:1 load.

The scheduler runs on a fake clock (`Clock`): every step advances it by `dt`, and the fake forward pass
stamps sampled tokens with the clock's time, so deadlines and slack are exact numbers. Graded: 15.1
(next_token_deadline), 15.2 (SLOPolicy.laxity), 15.3 (SLOPolicy.choose_victim), 15.4 (SLOPolicy.reject_reason),
15.5 (fair_order), 15.6 (FairPolicy's virtual-time accounting), each on its own.
"""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.policies import POLICIES, SLOTargets, make_policy
from nanoserve.engine.policies.base import FCFSPolicy, PriorityPolicy
from nanoserve.engine.policies.fair import FairPolicy
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.kv.block_manager import BlockManager
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def slo_policy(budget, step_s=0.0, **kw):
    """The graded SLOPolicy for a scheduler of token budget `budget`; one step takes `step_s` (0: laxity is
    slack, the order EDF's), not measured."""
    return implementation("nanoserve.engine.policies.slo").SLOPolicy(budget, step_s=step_s, **kw)


def fair_policy(weights=None):
    return implementation("nanoserve.engine.policies.fair").FairPolicy(weights)


def make(policy, num_blocks=16, block_size=4, max_num_seqs=8, budget=8):
    clock = Clock()
    s = Scheduler(SchedulerConfig(max_num_seqs, budget), BlockManager(num_blocks, block_size), policy=policy, clock=clock)
    return s, clock


def add(s, seq_id, prompt_len, max_tokens=4, priority=0, arrival=None, tenant=None, slo=None):
    base = 1000 * (int(seq_id.lstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") or 0) + len(s.seqs) + 1)
    arrival = s.clock() if arrival is None else arrival
    s.add_seq(Sequence(seq_id, list(range(base, base + prompt_len)), max_tokens, priority, arrival,
                       SamplingParams(max_tokens=max_tokens), tenant=tenant, slo=slo))


def step(s, clock, dt=0.01):
    """One schedule() and a fake forward pass at the clock's time; then the clock moves on by dt."""
    out = s.schedule()
    sampled = {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}
    for seq in s.update_from_output(out, sampled, now=clock()):
        if seq.num_output_tokens >= seq.max_tokens:
            s.finish_seq(seq.seq_id, SequenceStatus.FINISHED_LENGTH)
    clock.t += dt
    return out


def order(out):
    return [(q.seq_id, out.num_scheduled_tokens[q.seq_id]) for q in out.scheduled_seqs]


# ---- fcfs and priority ---------------------------------------------------------------------------------------

def test_fcfs_ignores_priority_and_priority_honours_it():
    for policy, first in ((FCFSPolicy(), "A"), (PriorityPolicy(), "B")):
        s, clock = make(policy, budget=4)
        add(s, "A", 4, priority=5, arrival=0.0)
        add(s, "B", 4, priority=0, arrival=1.0)
        assert order(step(s, clock)) == [(first, 4)]  # the budget holds one prompt


def test_the_default_policy_is_priority():
    s = Scheduler(SchedulerConfig(), BlockManager(4, 4))
    assert isinstance(s.policy, PriorityPolicy)
    with pytest.raises(ValueError, match="fcfs, priority, slo, fair"):
        make_policy(SchedulerConfig(policy="edf"))


def test_the_slo_policy_counts_steps_in_the_schedulers_own_budget():
    policy = make_policy(SchedulerConfig(max_num_batched_tokens=6, policy="slo", slo_ttft_ms=500))
    assert policy.budget == 6 and policy.default == SLOTargets(ttft_ms=500)
    with pytest.raises(ValueError, match="steps of 2048 tokens, the scheduler's budget is 6"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=6), BlockManager(4, 4), policy=slo_policy(2048))


# ---- slo: 15.1 deadlines (and the EDF order they give at step_s = 0) ---------------------------------------------------------------

@pytest.mark.exercise("15.1")
def test_admission_by_earliest_ttft_deadline_not_arrival():
    # A: a 12-token prompt without targets, first; B: 2 tokens, TTFT 100 ms, second. Budget 4.
    # fcfs: A takes the whole budget (a chunk of 4). slo: B's deadline 0.1 s < A's +inf: B first, A the rest.
    s, clock = make(FCFSPolicy(), budget=4)
    add(s, "A", 12, arrival=0.0)
    add(s, "B", 2, arrival=0.0, slo=SLOTargets(ttft_ms=100, tpot_ms=50))
    assert order(step(s, clock)) == [("A", 4)]
    s, clock = make(slo_policy(4), budget=4)
    add(s, "A", 12, arrival=0.0)
    add(s, "B", 2, arrival=0.0, slo=SLOTargets(ttft_ms=100, tpot_ms=50))
    assert order(step(s, clock)) == [("B", 2), ("A", 2)]
    # t=0.01: B decodes, due at 0 + 1 * 0.05; A (no target) after it
    assert order(step(s, clock)) == [("B", 1), ("A", 3)]


@pytest.mark.exercise("15.1")
def test_deadlines_mix_server_default_tenant_override_and_request_field():
    # server default TTFT 500 ms; tenant "chat" 200 ms; request C asks 50 ms. Arrivals 0, 0.1, 0.2:
    # deadlines A 0.5 (default), B 0.1 + 0.2 = 0.3 (tenant), C 0.2 + 0.05 = 0.25 (its own) -> C, B, A
    policy = slo_policy(4, default=SLOTargets(ttft_ms=500), tenant_slos={"chat": SLOTargets(ttft_ms=200)})
    s, clock = make(policy, budget=4, max_num_seqs=8)
    add(s, "A", 4, arrival=0.0)
    add(s, "B", 4, arrival=0.1, tenant="chat")
    add(s, "C", 4, arrival=0.2, tenant="chat", slo=SLOTargets(ttft_ms=50))
    clock.t = 0.2
    assert [q.seq_id for q in policy.order_waiting(list(s.waiting), clock())] == ["C", "B", "A"]
    assert [order(step(s, clock)) for _ in range(3)][0] == [("C", 4)]


@pytest.mark.exercise("15.1")
def test_equal_deadlines_keep_arrival_order():
    s, clock = make(slo_policy(4), budget=4)
    for i, name in enumerate("CAB"):
        add(s, name, 4, arrival=float(i))  # no targets: all +inf
    assert [q.seq_id for q in s.policy.order_waiting(list(s.waiting), 0.0)] == ["C", "A", "B"]


@pytest.mark.exercise("15.1")
def test_next_token_deadline_by_hand():
    next_token_deadline = implementation("nanoserve.engine.policies.slo").next_token_deadline
    seq = Sequence("a", [1, 2, 3], 8, arrival_time=2.0)
    assert next_token_deadline(seq, SLOTargets(ttft_ms=500, tpot_ms=100)) == pytest.approx(2.5)  # arrival + TTFT
    assert next_token_deadline(seq, SLOTargets(tpot_ms=100)) == math.inf  # no TTFT target: best effort
    seq.append_token(7, now=2.4)  # the first token at 2.4: token k is due at 2.4 + k * TPOT
    seq.append_token(7, now=2.45)
    seq.append_token(7, now=2.5)
    assert next_token_deadline(seq, SLOTargets(ttft_ms=500, tpot_ms=100)) == pytest.approx(2.4 + 3 * 0.1)
    assert next_token_deadline(seq, SLOTargets(ttft_ms=500)) == math.inf  # no TPOT target


# ---- slo: 15.2 least laxity -----------------------------------------------------------------------------------

@pytest.mark.exercise("15.2")
def test_laxity_takes_the_steps_left_before_the_next_token():
    # budget 128, one step 20 ms, now 1.0. A decodes (1 token left), due 1.05: 1.05 - 1.0 - 1 * 0.02 = 0.03.
    # B has 500 of its 510 prompt tokens left, due 1.10: 4 steps, 1.10 - 1.0 - 4 * 0.02 = 0.02.
    policy = slo_policy(budget=128, step_s=0.02)
    a = Sequence("A", [1] * 10, 8, arrival_time=0.0, slo=SLOTargets(ttft_ms=1000, tpot_ms=50))
    a.num_computed_tokens = 10
    a.append_token(7, now=1.0)  # first token at 1.0: the next one is due at 1.05
    b = Sequence("B", [1] * 510, 8, arrival_time=0.3, slo=SLOTargets(ttft_ms=800))
    b.num_computed_tokens = 10
    c = Sequence("C", [1] * 4, 8, arrival_time=0.0)  # no target
    assert policy.laxity(a, 1.0) == pytest.approx(0.03) and policy.laxity(b, 1.0) == pytest.approx(0.02)
    assert policy.laxity(c, 1.0) == math.inf
    # least laxity first: B, though A's deadline is the earlier one (EDF's order: A, B)
    assert [q.seq_id for q in policy.order_running([c, a, b], 1.0)] == ["B", "A", "C"]
    assert [q.seq_id for q in slo_policy(budget=128).order_running([c, a, b], 1.0)] == ["A", "B", "C"]
    b.num_computed_tokens = 300  # 210 left: 2 steps; 1.10 - 1.0 - 0.04 = 0.06 > A's 0.03
    assert [q.seq_id for q in policy.order_waiting([b, a], 1.0)] == ["A", "B"]


@pytest.mark.exercise("15.2")
def test_least_laxity_meets_every_deadline_where_edf_misses_one():
    # budget 3, one step 0.1 s, running sequences served before admissions; each request wants one token.
    # t=0: B (2 tokens, TTFT 200 ms, due 0.2) and C (5 tokens, TTFT 250 ms, due 0.25); t=0.1: A (1 token, due 0.15).
    # EDF:  t=0 B 2, C 1 | t=0.1 C 3 (running first: A waits) | t=0.2 C 1, A 1: A's token at 0.2 > 0.15, late.
    # LLF:  t=0 C 3 (laxity 0.25 - 0.2 = 0.05 < B's 0.2 - 0.1 = 0.1) | t=0.1 C 2, A 1 (A -0.05 < B 0) | t=0.2 B 2.
    def run(step_s):
        s, clock = make(slo_policy(3, step_s=step_s), budget=3)
        add(s, "B", 2, max_tokens=1, slo=SLOTargets(ttft_ms=200))
        add(s, "C", 5, max_tokens=1, slo=SLOTargets(ttft_ms=250))
        seqs = dict(s.seqs)
        plan = [order(step(s, clock, dt=0.1))]
        add(s, "A", 1, max_tokens=1, slo=SLOTargets(ttft_ms=50))
        seqs["A"] = s.seqs["A"]
        while s.has_unfinished_seqs():
            plan.append(order(step(s, clock, dt=0.1)))
        late = sorted(n for n, q in seqs.items() if q.first_token_time > q.arrival_time + q.slo.ttft_ms / 1000 + 1e-9)
        return plan, late

    plan, late = run(0.1)
    assert plan == [[("C", 3)], [("C", 2), ("A", 1)], [("B", 2)]] and late == []
    plan, late = run(0.0)  # step_s 0: laxity is slack, the order EDF's
    assert plan == [[("B", 2), ("C", 1)], [("C", 3)], [("C", 1), ("A", 1)]] and late == ["A"]


def test_the_policy_measures_a_step_from_its_clock_while_something_runs():
    from nanoserve.engine.policies.slo import STEP_S_WEIGHT, SLOPolicy

    policy = SLOPolicy(8)
    assert policy.step_s == 0.0  # nothing measured: pure EDF
    busy = [Sequence("a", [1], 4, arrival_time=0.0)]
    policy.order_running(busy, 1.0)
    policy.order_running(busy, 1.1)  # the first step measured seeds the average: 0.1 s, not 0 + 0.2 * 0.1
    assert policy.step_s == pytest.approx(0.1)
    policy.order_running([], 5.0)  # idle: the gap is no step
    policy.order_running(busy, 5.3)  # 0.1 + 0.2 * (0.3 - 0.1)
    assert policy.step_s == pytest.approx(0.1 + STEP_S_WEIGHT * 0.2)


# ---- slo: 15.3 the preemption victim, by what it costs to recompute ----------------------------------------------

@pytest.mark.exercise("15.3")
def test_preemption_at_equal_cost_takes_the_most_slack_not_the_latest_arrival():
    # two blocks of 4 tokens; A (first, TPOT 1 s) and B (second, TPOT 10 ms) each fill one with a 4-token
    # prompt and sample at t=0; at t=0.001 both need a second block and only one can have it.
    # priority: A is first, B (latest arrival) is preempted. slo: B is due at 0.01, A at 1.0: A has the
    # slack, A is preempted and B decodes.
    expected = {"priority": ("A", "B"), "slo": ("B", "A")}
    for name, policy in (("priority", PriorityPolicy()), ("slo", slo_policy(8))):
        s, clock = make(policy, num_blocks=2, budget=8)
        add(s, "A", 4, arrival=0.0, slo=SLOTargets(tpot_ms=1000))
        add(s, "B", 4, arrival=0.0, slo=SLOTargets(tpot_ms=10))
        assert sorted(order(step(s, clock, dt=0.001))) == [("A", 4), ("B", 4)]
        out = step(s, clock)
        runs, victim = expected[name]
        assert order(out) == [(runs, 1)] and out.preempted_seq_ids == [victim], name
        assert s.seqs[victim].status is SequenceStatus.PREEMPTED


@pytest.mark.exercise("15.3")
def test_the_victim_is_the_cheapest_recompute_that_stays_on_time():
    # budget 4, one step 0.1 s, now 1.0. After preemption a sequence recomputes all its tokens: ceil(n / 4) steps.
    policy = slo_policy(budget=4, step_s=0.1)

    def running(name, n, computed, tpot_ms=None, first=0.9, arrival=0.0):
        seq = Sequence(name, [1] * (n - 1), 64, arrival_time=arrival, slo=SLOTargets(ttft_ms=10, tpot_ms=tpot_ms))
        seq.append_token(7, now=first)  # n tokens, the next one due at first + 1 * tpot
        seq.num_computed_tokens = computed
        return seq

    big = running("big", 12, 11, tpot_ms=1000)      # due 1.9; after: 1.9 - 1.0 - 3 * 0.1 = 0.6  on time, 11 computed
    small = running("small", 8, 7, tpot_ms=1000)     # due 1.9; after: 1.9 - 1.0 - 2 * 0.1 = 0.7  on time, 7 computed
    tight = running("tight", 4, 3, tpot_ms=250)      # due 1.15; after: 1.15 - 1.0 - 0.1 = 0.05  on time, 3 computed
    late = running("late", 8, 7, tpot_ms=150)        # due 1.05; after: 1.05 - 1.0 - 0.2 = -0.15 late
    later = running("later", 12, 11, tpot_ms=150)    # due 1.05; after: 1.05 - 1.0 - 0.3 = -0.25 late
    free = running("free", 16, 15)                   # no TPOT target: best effort, 15 computed
    assert policy.choose_victim([big, small], 1.0) is small        # both on time: the cheaper recompute
    assert policy.choose_victim([big, tight, small], 1.0) is tight  # least slack, but on time and cheapest
    assert policy.choose_victim([late, big], 1.0) is big           # a late one is never taken while one is on time
    assert policy.choose_victim([later, late], 1.0) is late        # all late: the least late after recompute
    assert policy.choose_victim([free, big], 1.0) is big           # best effort on time too, but 15 > 11 computed
    roomy = running("roomy", 8, 7, tpot_ms=2000)                   # small's cost, due 2.9: after 1.7
    assert policy.choose_victim([small, roomy], 1.0) is roomy      # equal cost: the most laxity left
    twin = running("twin", 8, 7, tpot_ms=1000, arrival=0.5)        # small's twin, arrived later
    assert policy.choose_victim([small, twin], 1.0) is twin
    # the most slack is not the answer: at step_s = 0 (EDF) big and small both have 0.9 s; the cheaper goes
    assert slo_policy(4).choose_victim([big, small, free], 1.0) is small


# ---- slo: 15.4 admission control -------------------------------------------------------------------------------

@pytest.mark.exercise("15.4")
def test_slo_reject_refuses_a_request_whose_ttft_is_lost_with_a_reason():
    # budget 4, all arrive at t=0: C (TTFT 5 ms) is the earliest deadline and takes the budget at t=0; at t=0.01
    # B (due 0.015) is still in time and goes before A (due 1.0). Then: two wait 20 ms before any step.
    s, clock = make(slo_policy(reject=True, budget=4), budget=4)
    add(s, "A", 8, arrival=0.0, slo=SLOTargets(ttft_ms=1000))
    add(s, "B", 4, arrival=0.0, slo=SLOTargets(ttft_ms=15))
    add(s, "C", 4, arrival=0.0, slo=SLOTargets(ttft_ms=5))
    out = step(s, clock)
    assert order(out) == [("C", 4)] and not out.rejected_seqs  # t=0: C's deadline is the earliest
    out = step(s, clock)  # t=0.01: B (due 0.015) still in time
    assert order(out) == [("C", 1), ("B", 3)] and not out.rejected_seqs
    s2, clock2 = make(slo_policy(reject=True, budget=4), budget=4)
    add(s2, "A", 4, arrival=0.0, slo=SLOTargets(ttft_ms=1000))
    add(s2, "B", 4, arrival=0.0, slo=SLOTargets(ttft_ms=5))
    clock2.t = 0.02  # both waited 20 ms: B's 5 ms is lost, A's 1 s is not
    out = step(s2, clock2)
    assert [q.seq_id for q in out.rejected_seqs] == ["B"] and order(out) == [("A", 4)]
    reason = out.rejected_seqs[0].reject_reason
    assert "TTFT deadline lost" in reason and "20 ms" in reason and "5 ms" in reason
    assert out.rejected_seqs[0].status is SequenceStatus.FINISHED_ABORTED and "B" not in s2.seqs
    assert s2.block_manager.get_num_free_blocks() == 16 - 1  # B held none; A one


@pytest.mark.exercise("15.4")
def test_reject_looks_at_the_work_left_and_only_at_waiting_requests():
    # budget 4, one step 0.1 s, now 1.0, TTFT 500 ms from arrival 0.65 (due 1.15): a 4-token prompt needs 1 step
    # (laxity 0.05: kept), a 12-token one 3 steps (laxity -0.15: refused now, though its deadline has not passed)
    policy = slo_policy(reject=True, budget=4, step_s=0.1)
    short = Sequence("s", [1] * 4, 4, arrival_time=0.65, slo=SLOTargets(ttft_ms=500))
    long = Sequence("l", [1] * 12, 4, arrival_time=0.65, slo=SLOTargets(ttft_ms=500))
    assert policy.reject_reason(short, 1.0) is None
    assert "TTFT deadline lost" in policy.reject_reason(long, 1.0) and "3 more step" in policy.reject_reason(long, 1.0)
    long.num_computed_tokens = 8  # a chunk went in: 1 step left, laxity 0.05
    assert policy.reject_reason(long, 1.0) is None
    started = Sequence("f", [1] * 4, 4, arrival_time=0.0, slo=SLOTargets(ttft_ms=5, tpot_ms=5))
    started.append_token(7, now=0.5)  # it has its first token: its answer is under way, never refused
    assert policy.reject_reason(started, 9.0) is None
    assert slo_policy(budget=4, step_s=0.1).reject_reason(long, 9.0) is None  # without --slo-reject: never


# ---- fair: 15.5 weighted fair order, 15.6 virtual-time accounting --------------------------------------------------------------------------

def seqs_of(spec):
    """'a1 a2 b1' -> Sequences, tenant = the letter, arrival = position; each a decode (1 token left)."""
    out = []
    for i, name in enumerate(spec.split()):
        seq = Sequence(name, [1, 2, 3], 4, arrival_time=float(i), tenant=name[0])
        seq.num_computed_tokens = 2
        out.append(seq)
    return out


@pytest.mark.exercise("15.5")
def test_fair_order_interleaves_tenants_by_virtual_time():
    fair_order = implementation("nanoserve.engine.policies.fair").fair_order
    names = lambda seqs: [q.seq_id for q in seqs]  # noqa: E731
    # equal weights, both at 0: a1 (a -> 1), b1 (b -> 1), a2 (a -> 2), a3
    assert names(fair_order(seqs_of("a1 a2 a3 b1"), {}, {})) == ["a1", "b1", "a2", "a3"]
    # b behind by 2 tokens: b1, b2 (b -> 2, tie with a at 2: 'a' < 'b'), a1, b3 ...
    assert names(fair_order(seqs_of("a1 a2 b1 b2 b3"), {"a": 2.0}, {})) == ["b1", "b2", "a1", "b3", "a2"]
    # weight 3 for a: a moves 1/3 per token: a1 a2 a3 at 0, 1/3, 2/3, then b1 (b at 0 < a at 1? no: b first)
    assert names(fair_order(seqs_of("a1 a2 a3 a4 b1 b2"), {}, {"a": 3.0})) == ["a1", "b1", "a2", "a3", "a4", "b2"]
    vt = {"a": 1.0}
    fair_order(seqs_of("a1 b1"), vt, {})
    assert vt == {"a": 1.0}  # ordering charges nothing


@pytest.mark.exercise("15.5")
def test_fair_cost_is_the_tokens_left_so_a_long_prefill_counts_in_full():
    fair_order = implementation("nanoserve.engine.policies.fair").fair_order
    long = Sequence("a1", list(range(10)), 4, arrival_time=0.0, tenant="a")  # 10 tokens to compute
    a2 = Sequence("a2", [1], 4, arrival_time=1.0, tenant="a")
    bs = [Sequence(f"b{i}", [1], 4, arrival_time=2.0 + i, tenant="b") for i in range(3)]
    # a1 at 0 (a -> 10), then b's three 1-token prefills (b: 0, 1, 2) before a2
    assert [q.seq_id for q in fair_order([long, a2] + bs, {}, {})] == ["a1", "b0", "b1", "b2", "a2"]


@pytest.mark.exercise("15.5")
def test_two_tenants_at_ten_to_one_load_share_the_tokens_equally():
    """Tenant a sends 10 requests for each of b's; the budget (4 tokens a step) is the bottleneck. Under fair
    sharing, while both have work, the tokens each got differ by at most one step's budget (per weight);
    under fcfs b's requests wait behind a's flood."""
    def run(policy, weights):
        s, clock = make(policy, num_blocks=200, max_num_seqs=64, budget=4)
        for i in range(22):
            tenant = "b" if i % 11 == 10 else "a"
            add(s, f"{tenant}{i}", 4, max_tokens=6, arrival=i * 1e-3, tenant=tenant)
        served, gap, finished = {"a": 0, "b": 0}, 0.0, {}
        while s.has_unfinished_seqs():
            busy = {q.tenant for q in s.waiting + s.running}
            out = step(s, clock)
            for q in out.scheduled_seqs:
                served[q.tenant] += out.num_scheduled_tokens[q.seq_id]
            if busy == {"a", "b"}:
                gap = max(gap, abs(served["a"] / weights.get("a", 1) - served["b"] / weights.get("b", 1)))
            for seq_id in out.finished_seq_ids:
                finished[seq_id] = len(finished)
        assert s.block_manager.get_num_free_blocks() == 200
        return gap, [finished[k] for k in finished if k.startswith("b")]

    gap, b_done = run(fair_policy(), {})
    assert gap <= 4 + 1
    gap3, _ = run(fair_policy({"a": 3.0}), {"a": 3.0})  # a paid for 3x: 3 of every 4 tokens
    assert gap3 <= 4 + 1
    fcfs_gap, fcfs_b_done = run(FCFSPolicy(), {})
    assert fcfs_gap > 20  # without fairness a's flood takes the budget
    assert max(b_done) < max(fcfs_b_done)


@pytest.mark.exercise("15.6")
def test_virtual_time_moves_by_tokens_over_weight_and_idle_is_no_credit():
    policy = fair_policy({"a": 4.0})
    a, b, c = (Sequence(t, [1], 4, arrival_time=0.0, tenant=t) for t in "abc")
    policy.on_scheduled(a, 7)
    policy.on_scheduled(b, 7)
    policy.on_scheduled(b, 3)
    assert policy.virtual_time == {"a": 7 / 4, "b": 10.0}  # tokens / weight, weight 1 by default
    policy.catch_up({"a", "b"})  # nobody was busy before: nothing to catch up to
    assert policy.virtual_time == {"a": 7 / 4, "b": 10.0}
    policy.catch_up({"a", "b", "c"})  # c is new: it starts at the busy tenants' lowest, a's 1.75
    assert policy.virtual_time["c"] == 7 / 4
    policy.catch_up({"b"})  # a and c go idle
    policy.on_scheduled(b, 20)  # b: 30
    policy.catch_up({"a", "b"})  # a comes back: to b's 30, not its old 1.75
    assert policy.virtual_time == {"a": 30.0, "b": 30.0, "c": 7 / 4}
    policy.virtual_time["c"] = 50.0
    policy.catch_up({"a", "b", "c"})  # never moved back
    assert policy.virtual_time["c"] == 50.0


@pytest.mark.exercise("15.6")
def test_a_tenant_back_from_idle_gets_no_credit_for_it():
    # a stays busy (a long decode) while b finishes and goes idle; when b comes back, it starts at a's virtual
    # time (a was charged first this step: running before admissions), then pays for its own chunk
    policy = fair_policy()
    s, clock = make(policy, num_blocks=64, budget=4)
    add(s, "a0", 4, max_tokens=20, tenant="a")
    add(s, "b0", 4, max_tokens=1, tenant="b")
    for _ in range(8):
        step(s, clock)
    assert "b0" not in s.seqs and "a0" in s.seqs and policy.virtual_time["a"] > policy.virtual_time["b"] + 4
    add(s, "b1", 4, max_tokens=1, tenant="b")
    out = step(s, clock)
    assert order(out) == [("a0", 1), ("b1", 3)]
    assert policy.virtual_time["b"] == policy.virtual_time["a"] + 3


def test_fair_preempts_from_the_tenant_served_most_for_its_weight():
    policy = FairPolicy({"a": 2.0})  # the reference's: choose_victim is no exercise
    policy.virtual_time = {"a": 5.0, "b": 2.0}  # a served 10 tokens at weight 2, b 2 tokens
    a1, b1, a2, b2 = seqs_of("a1 b1 a2 b2")
    assert policy.choose_victim([a1, b1, a2, b2], 0.0) is a2  # a's latest arrival (the base policy's: b2, the last)
    policy.virtual_time["b"] = 6.0
    assert policy.choose_victim([a1, b1, a2], 0.0) is b1  # b now the higher; its only candidate


# ---- every policy: invariants on random workloads --------------------------------------------------------------

def build(name, budget):
    if name == "slo":
        return slo_policy(budget, default=SLOTargets(ttft_ms=30, tpot_ms=20), reject=True)
    if name == "fair":
        return fair_policy({"a": 2.0})
    return make_policy(SchedulerConfig(max_num_batched_tokens=budget, policy=name))


workloads = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.sampled_from("abc"), st.integers(0, 2),
                               st.integers(0, 3), st.sampled_from([None, 5, 50, 500])), min_size=1, max_size=10)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=40, deadline=None)
@given(requests=workloads, num_blocks=st.integers(4, 12), budget=st.integers(1, 10))
def test_every_request_finishes_or_is_rejected_no_block_leaks(name, requests, num_blocks, budget):
    policy = build(name, budget)
    s, clock = make(policy, num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=budget)
    pending = sorted(enumerate(requests), key=lambda r: r[1][4])  # by arrival step
    admitted, done, rejected, steps = set(), set(), {}, 0
    while pending or s.has_unfinished_seqs():
        while pending and pending[0][1][4] <= steps:
            i, (plen, max_tokens, tenant, prio, _, ttft) = pending.pop(0)
            if -(-(plen + max_tokens) // 4) > num_blocks:
                continue  # check_fits_alone would refuse it (chapter 06's test covers that)
            add(s, f"r{i}", plen, max_tokens, priority=prio, tenant=tenant, slo=SLOTargets(ttft_ms=ttft))
            admitted.add(f"r{i}")
        out = step(s, clock)
        for q in out.rejected_seqs:
            assert q.reject_reason and q.first_token_time is None
            rejected[q.seq_id] = q.reject_reason
        done |= {q.seq_id for q in out.scheduled_seqs if q.is_finished}
        steps += 1
        assert steps < 400, "a request starves"
        # the pool's accounting: what the running sequences hold is exactly what is not free
        held = {b for q in s.running for b in s.block_manager.block_table(q.seq_id)}
        assert s.block_manager.get_num_free_blocks() + len(held) == num_blocks
    assert s.block_manager.get_num_free_blocks() == num_blocks
    assert not s.seqs
    if name != "slo":
        assert not rejected
    # every request added either finished with all its tokens or was refused, and never both
    assert done | set(rejected) == admitted and not done & set(rejected)


# ---- through the engine ------------------------------------------------------------------------------------

def test_engine_takes_the_policy_from_its_config_and_reports_a_rejection():
    import time

    from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    from nanoserve.engine.llm_engine import LLMEngine
    from tests.tiny_model import tiny_llama

    engine = LLMEngine(tiny_llama(), EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4),
                                                  scheduler_config=SchedulerConfig(policy="slo", slo_ttft_ms=60_000, slo_reject=True)), eos_token_id=-1)
    assert type(engine.scheduler.policy).__name__ == "SLOPolicy"
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("late", [1, 2, 3], params, arrival_time=time.perf_counter() - 1.0, tenant="t1",
                       slo=SLOTargets(ttft_ms=10))  # arrived a second ago, wanted a token within 10 ms
    engine.add_request("ok", [4, 5, 6], params, tenant="t2")  # the server's 60 s default
    assert engine.scheduler.seqs["late"].tenant == "t1"
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    late = [o for o in outs if o.request_id == "late"]
    assert len(late) == 1 and late[0].finished and late[0].finish_reason == "abort" and late[0].token_ids == []
    assert "TTFT deadline lost" in late[0].reject_reason
    ok = [o for o in outs if o.request_id == "ok"]
    assert ok[-1].finish_reason == "length" and ok[-1].reject_reason is None and len(ok[-1].token_ids) == 2
    assert engine.block_manager.get_num_free_blocks() == 32
    with pytest.raises(ValueError, match="scheduling policy"):
        LLMEngine(tiny_llama(), EngineConfig(cache_config=CacheConfig(num_blocks=8),
                                             scheduler_config=SchedulerConfig(policy="round-robin")))


def test_the_server_takes_per_request_slo_fields_and_answers_a_rejection_with_503():
    import json

    from prometheus_client.parser import text_string_to_metric_families
    import urllib.error
    import urllib.request

    from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.server.runner import serving
    from nanoserve.text.tokenizer import Tokenizer
    from tests.tiny_model import tiny_llama

    tokenizer = Tokenizer.from_gguf()
    engine = LLMEngine(tiny_llama(vocab_size=49152, max_position_embeddings=1024),
                       EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=16),
                                    scheduler_config=SchedulerConfig(policy="slo", slo_reject=True)), tokenizer)

    def post(body):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers, json.load(r) if not body.get("stream") else r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.load(e)

    def counted(metrics, name, **labels):
        return sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        # a TTFT target of 1 microsecond is lost before the first step: refused, with the reason and a Retry-After
        status, headers, body = post({"prompt": "Hi", "max_tokens": 2, "ttft_slo_ms": 0.001})
        assert status == 503 and "TTFT deadline lost" in body["error"]["message"], body
        assert headers["Retry-After"] == "1"
        status, _, events = post({"prompt": "Hi", "max_tokens": 2, "ttft_slo_ms": 0.001, "stream": True})
        assert status == 200 and '"code": 503' in events and events.endswith("data: [DONE]\n\n")
        status, _, body = post({"prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "ttft_slo_ms": 60_000})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, _, body = post({"prompt": "Hi", "ttft_slo_ms": -5})
        assert status == 400 and body["error"]["param"] == "ttft_slo_ms"
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    # its own counter, by the way it was answered; the 503 is in http_responses{5xx}, where the alert subtracts it
    assert counted(metrics, "nanoserve:slo_rejections_total", stream="false") == 1
    assert counted(metrics, "nanoserve:slo_rejections_total", stream="true") == 1
    assert counted(metrics, "nanoserve:http_responses_total", status="5xx") == 1


# ---- the tenants file: weights and SLO targets through the HTTP server -----------------------------------------

TENANTS_FAIR = """
[keys."sk-big"]
tenant = "big"
weight = 4
[keys."sk-small"]
tenant = "small"
"""
TENANTS_SLO = """
[keys."sk-small"]
tenant = "small"
[keys."sk-strict"]
tenant = "strict"
ttft_slo_ms = 0.001
tpot_slo_ms = 50
"""


def serve_args(tmp_path, tenants, *flags):
    """`serve --api-keys FILE ...` parsed and checked as serve's run does it: (args, check_args' problem)."""
    import argparse

    from nanoserve.cli import serve

    path = tmp_path / "keys.toml"
    path.write_text(tenants)
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-keys", str(path), "--weights", "fp32", "--kv-cache-dtype", "auto",
                              "--num-blocks", "32", *flags])
    return args, serve.check_args(args)


def tenants_server(tmp_path, tenants, *flags):
    """What `serve --api-keys FILE ...` builds, on the tiny model: check_args (which picks the default policy),
    then the engine from the very keyword arguments serve's llm_from_args passes (engine_kwargs)."""
    from nanoserve.cli.batch import engine_kwargs
    from nanoserve.llm import LLM
    from nanoserve.text.tokenizer import Tokenizer
    from tests.tiny_model import tiny_llama

    args, problem = serve_args(tmp_path, tenants, *flags)
    assert problem is None, problem
    tokenizer = Tokenizer.from_gguf()
    llm = LLM(tiny_llama(vocab_size=49152, max_position_embeddings=1024), tokenizer=tokenizer,
              **engine_kwargs(args, **args.tenant_settings))
    return llm.engine, tokenizer, args.api_keys


@pytest.mark.parametrize("tenants, flags, message", [
    (TENANTS_FAIR, ["--scheduling-policy", "slo"], "tenant weights (big: a tenant's weight) are read by the fair"),
    (TENANTS_SLO, [], "tenant_slos (a tenant's ttft_slo_ms / tpot_slo_ms) is read by the slo scheduling policy only"
                      ", and the policy is 'fair'"),
    (TENANTS_FAIR, ["--slo-reject"], "slo_reject (--slo-reject) is read by the slo scheduling policy only"),
    (TENANTS_FAIR, ["--scheduling-policy", "priority", "--slo-tpot-ms", "50"], "slo_tpot_ms (--slo-tpot-ms)"),
    (TENANTS_FAIR, ["--scheduling-policy", "fair", "--slo-ttft-ms", "500"], "slo_ttft_ms (--slo-ttft-ms)"),
])
def test_serve_refuses_a_scheduling_setting_the_policy_would_not_read(tmp_path, tenants, flags, message):
    args, problem = serve_args(tmp_path, tenants, *flags)
    assert problem is not None and message in problem, problem
    from nanoserve.engine.config import SchedulerConfig

    with pytest.raises(ValueError, match="read by the slo scheduling policy only"):
        SchedulerConfig(policy="priority", slo_reject=True)
    SchedulerConfig(policy="slo", tenant_weights={"a": 1.0})  # weight 1 everywhere is what every policy assumes


def test_a_request_slo_field_under_another_policy_is_a_400_naming_it():
    from nanoserve.engine.config import CacheConfig, EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.server.runner import serving
    from nanoserve.text.tokenizer import Tokenizer
    from tests.tiny_model import tiny_llama
    import httpx

    tokenizer = Tokenizer.from_gguf()
    engine = LLMEngine(tiny_llama(vocab_size=49152, max_position_embeddings=1024),
                       EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=16)), tokenizer)
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        for field in ("ttft_slo_ms", "tpot_slo_ms"):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: 500}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "'priority'" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
    assert engine.block_manager.get_num_free_blocks() == 16


def test_the_tenants_file_gives_the_fair_policy_its_weights(tmp_path):
    import httpx

    from nanoserve.server.runner import serving

    engine, tokenizer, keys = tenants_server(tmp_path, TENANTS_FAIR)  # no --scheduling-policy: fair, with tenants
    policy = engine.scheduler.policy
    assert policy.name == "fair" and policy.weights == {"big": 4, "small": 1.0}
    with serving(engine, tokenizer, model_name="tiny", api_keys=keys) as (url, _):
        for key, prompt in (("sk-big", [10, 11, 12, 13, 14]), ("sk-small", [20, 21, 22, 23, 24])):
            r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                           json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
    # each request: a 5-token prefill, then 2 decodes = 7 tokens; virtual time = tokens / weight
    assert policy.virtual_time == {"big": 7 / 4, "small": 7.0}


def test_the_tenants_file_gives_the_slo_policy_its_targets_and_a_stream_gets_the_rejection(tmp_path):
    import httpx

    from nanoserve.server.runner import serving

    engine, tokenizer, keys = tenants_server(tmp_path, TENANTS_SLO, "--scheduling-policy", "slo", "--slo-reject",
                                             "--slo-ttft-ms", "60000")
    policy = engine.scheduler.policy
    assert policy.tenant_slos == {"strict": SLOTargets(ttft_ms=0.001, tpot_ms=50)}
    assert policy.default == SLOTargets(ttft_ms=60000)

    def post(key, stream=False, **extra):
        body = {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "stream": stream, **extra}
        with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body,
                          timeout=60) as r:
            return r.status_code, [line for line in r.iter_lines() if line]

    with serving(engine, tokenizer, model_name="tiny", api_keys=keys) as (url, _):
        status, lines = post("sk-strict")  # its tenant's 1-microsecond TTFT target: lost before the first step
        assert status == 503 and "TTFT deadline lost" in json.loads(lines[0])["error"]["message"]
        assert "target is 0.001 ms" in json.loads(lines[0])["error"]["message"]
        assert post("sk-small")[0] == 200  # the server's 60 s default
        assert post("sk-strict", ttft_slo_ms=60000)[0] == 200  # the request's own field over its tenant's
        # streamed: the status line went out before the scheduler refused it; the refusal is an error event
        status, lines = post("sk-strict", stream=True)
        assert status == 200 and lines[-1] == "data: [DONE]", lines
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "TTFT deadline lost" in error["message"]
        assert not any('"finish_reason": "abort"' in line for line in lines)
    assert engine.block_manager.get_num_free_blocks() == 32


@pytest.mark.parametrize("setting, message", [
    ('weight = 0', "weight must be > 0"), ('weight = "heavy"', "weight must be > 0"),
    ('ttft_slo_ms = -1', "ttft_slo_ms must be > 0"), ('tpot_slo_ms = true', "tpot_slo_ms must be > 0"),
])
def test_the_tenants_file_refuses_bad_weights_and_targets(setting, message):
    from nanoserve.server.limits import load_api_keys_dict, scheduling_settings
    import tomllib

    with pytest.raises(ValueError, match=message):
        load_api_keys_dict(tomllib.loads(f'[keys."k"]\ntenant = "t"\n{setting}\n'))
    two_keys = load_api_keys_dict(tomllib.loads('[keys."k1"]\ntenant = "t"\nweight = 2\n[keys."k2"]\ntenant = "t"\n'))
    with pytest.raises(ValueError, match="different weights"):
        scheduling_settings(two_keys)
