"""Chapter 15 — the interface every scheduling policy implements, and the SLO targets a request carries.

The scheduler calls, once per step, with `now` from its clock (injectable, so tests are deterministic):

    rejected = [s for s in waiting if policy.reject_reason(s, now)]   # admission control (--slo-reject)
    running  = policy.order_running(running, now)    # the step's budget goes to running[0] first
    victim   = policy.choose_victim(candidates, now) # when the pool is short: who loses its blocks
    waiting  = policy.order_waiting(waiting, now)    # admission: the head first, nobody overtakes it
    policy.on_scheduled(seq, n)                      # n tokens of seq go into this step (fair: charge it)

A policy only orders and chooses: it never touches blocks, seats or the budget, so two of chapter 06's
guarantees (no deadlock, no leaked block) hold for every policy. The third, "nothing starves", holds for fcfs,
and for priority within a class: the head of the queue, in the policy's order, is never skipped, but the order
is re-computed every step, so under slo a best-effort request (no target) stays behind every request that has
one for as long as such requests keep coming, and under fair a tenant's request waits while other tenants with
lower virtual times have work. That is what a deadline or a share means; nanoserve does not age requests.
"""

from dataclasses import dataclass, replace

from nanoserve.engine.sequence import Sequence


@dataclass(frozen=True)
class SLOTargets:
    """A request's service-level targets in milliseconds (chapter 09's TTFT and TPOT); None: no target.

        SLOTargets(ttft_ms=500, tpot_ms=100)   first token within 0.5 s of arrival, then one every 0.1 s
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 milliseconds, got {value}")

    def over(self, base: "SLOTargets | None") -> "SLOTargets":
        """These targets where set, `base`'s elsewhere: request over tenant over server default."""
        if base is None:
            return self
        return replace(base, **{k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)) if v is not None})


def arrival_order(seq: Sequence) -> tuple[float, str]:
    return (seq.arrival_time, seq.seq_id)


class SchedulingPolicy:
    """The base is FCFS: arrival order everywhere, the latest arrival is the victim. Subclasses override
    what they change. `order_*` return a new list; the scheduler re-sorts its queues with them every step."""

    name = "fcfs"

    def order_waiting(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        return sorted(waiting, key=arrival_order)

    def order_running(self, running: list[Sequence], now: float) -> list[Sequence]:
        return sorted(running, key=arrival_order)

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        """The sequence to preempt among `candidates` (the running sequences not scheduled yet this step,
        in budget order): by default the last one, the one the budget order cares least about."""
        return candidates[-1]

    def reject_reason(self, seq: Sequence, now: float) -> str | None:
        """Why a waiting request should be refused now instead of admitted (None: keep it)."""
        return None

    def on_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` of `seq` go into this step."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: priorities ignored."""


class PriorityPolicy(SchedulingPolicy):
    """Chapter 06's behaviour: (priority, arrival) everywhere, a lower priority value first."""

    name = "priority"

    @staticmethod
    def key(seq: Sequence) -> tuple[int, float]:
        return (seq.priority, seq.arrival_time)

    def order_waiting(self, waiting, now):
        return sorted(waiting, key=self.key)

    def order_running(self, running, now):
        return sorted(running, key=self.key)


POLICIES = ("fcfs", "priority", "slo", "fair")


def make_policy(config, modules=None) -> SchedulingPolicy:
    """The policy a SchedulerConfig names (config.policy), with its settings: the SLO targets and --slo-reject
    (slo), the tenant weights (fair), and the step's token budget slo's laxity counts steps in — the scheduler's
    own max_num_batched_tokens, so the two cannot disagree. `modules(name)` gives the module to take slo/fair
    from (the learner's with --student, nanoserve/student.py); by default the reference's.

        make_policy(SchedulerConfig(policy="slo", slo_ttft_ms=500, max_num_batched_tokens=256))  # budget 256
    """
    name = config.policy
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}; got {name!r}")
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    import importlib

    load = modules or importlib.import_module
    if name == "slo":
        return load("nanoserve.engine.policies.slo").SLOPolicy(
            config.max_num_batched_tokens, SLOTargets(config.slo_ttft_ms, config.slo_tpot_ms), config.tenant_slos,
            reject=config.slo_reject)
    return load("nanoserve.engine.policies.fair").FairPolicy(config.tenant_weights or {})
