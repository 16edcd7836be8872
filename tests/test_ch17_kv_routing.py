"""Chapter 17: why the KV-aware router beats chapter 16's prefix router when users share a system prompt — the
kv-routing experiment's own fleet and routers, on the tiny model, a case worked by hand."""

from nanoserve.bench.kv_routing import Fleet, make_router
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama

BS = 16  # the fleet's engines' block size (engine_config's default)


def test_a_returning_user_goes_where_their_conversation_is():
    """Six users share a 2-block system prompt S; each has 2 blocks of their own, N0 ... N5. Their first turns
    arrive at once and the prefix router places them (imbalance 4):

        user 0   no owner: power of two choices on {r0: 0, r1: 0} -> r1 (Random(0) draws r1 first; a tie keeps it)
        1 .. 4   S is r1's and r1 is at most 4 busier than r0 -> r1
        user 5   r1 holds 5, r0 none: 5 > 4 -> r0, and S's owner entry now says r0

    so r1 holds S, N0 ... N4 and r0 holds S, N5. User 0 comes back (S, N0, then the new question). The prefix
    router's run of leading blocks must have one owner: S says r0, N0 says r1, so the run stops after S ->
    r0, a hit of 2 blocks. The index knows both replicas hold S and only r1 holds N0: matches {r0: 2, r1: 4},
    queues empty -> r1, a hit of 4 blocks."""
    fleet = Fleet(tiny_llama(vocab_size=97), None, num_replicas=2, num_blocks=64)  # 64 blocks: nothing evicted
    prefix, kv_aware = make_router("prefix (chapter 16)", fleet, BS), make_router("kv-aware, fresh", fleet, BS)
    system = list(range(1, 2 * BS + 1))
    turn1 = [system + [40 + u] * BS + [60 + u] * BS + [90] for u in range(6)]
    try:
        placed = []
        for u, p in enumerate(turn1):  # all six in flight before any step: each one queued before the next is routed
            placed.append(prefix(p))
            fleet.engines[placed[-1]].add_request(str(u), p, SamplingParams(max_tokens=2, ignore_eos=True))
        while any(e.has_unfinished_requests() for e in fleet.engines.values()):
            for e in fleet.engines.values():
                e.step()
        assert placed == ["r1"] * 5 + ["r0"]
        held = {r: [e.block_manager.lookup_prefix(p) // BS for p in turn1] for r, e in fleet.engines.items()}
        assert held == {"r0": [2, 2, 2, 2, 2, 4], "r1": [4, 4, 4, 4, 4, 2]}  # S everywhere, N_u where u went

        returning = turn1[0] + [91, 92]
        assert (prefix(returning), kv_aware(returning)) == ("r0", "r1")
        assert {r: e.block_manager.lookup_prefix(returning) // BS for r, e in fleet.engines.items()} == {"r0": 2, "r1": 4}
    finally:
        fleet.close()


def test_a_workload_the_experiment_does_not_have_is_refused(capsys):
    from nanoserve.bench import experiment
    from tests.chapter_text import command_defaults

    for argv, message in ((("kv-routing", "--workload", "shared"), "--workload is one of shared-prompts, per-user"),
                          (("routing", "--workload", "per-user"), "routing does not use --workload")):
        assert experiment.run(command_defaults(experiment, "experiment", *argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_the_fleets_flags_are_refused_on_other_experiments(capsys):
    from nanoserve.bench import experiment
    from tests.chapter_text import command_defaults

    for argv in (("routing", "--replicas", "5"), ("scheduling", "--num-blocks", "40")):
        assert experiment.run(command_defaults(experiment, "experiment", *argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {argv[0]} does not use {argv[1]} (its flags: ") and err.count("\n") == 1, err
