"""Chapter 15 — scheduling policies: who is admitted first, who gets the step's token budget first, who is
preempted. The scheduler (chapter 06) keeps the mechanics — budget, seats, blocks, chunking — and asks a
policy three questions (nanoserve/engine/policies/base.py):

    policy          admission order              budget order (running)         preemption victim
    fcfs            arrival                      arrival                        latest arrival
    priority        (priority, arrival)          (priority, arrival)            least urgent   (the default)
    slo             least laxity                 least laxity                   cheapest recompute still on time
    fair            lowest tenant virtual time   lowest tenant virtual time     from the highest-virtual-time tenant

    config = SchedulerConfig(policy="slo", slo_ttft_ms=500, slo_tpot_ms=100)
    Scheduler(config, block_manager, policy=make_policy(config))  # slo counts steps in the config's budget
"""

from nanoserve.engine.policies.base import POLICIES, SchedulingPolicy, SLOTargets, make_policy

__all__ = ["POLICIES", "SchedulingPolicy", "SLOTargets", "make_policy"]
