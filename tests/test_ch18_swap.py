"""Chapter 18 — swap instead of recompute on preemption (SchedulerConfig.preemption_mode "swap").

References: which blocks and slots move, worked by hand (the tier index, the block manager, the scheduler); greedy
tokens against the same requests served in a pool big enough that nothing is preempted; tokens recomputed counted
from the steps themselves (every request computes each of its prompt + output - 1 tokens once; anything more was
computed again); a preempted sequence's K/V, its partly filled last block too, compared bit for bit before it
left the pool and after it came back."""

import os
import random

import pytest
import torch

from nanoserve.engine.config import SchedulerConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.kv.tier_index import TierIndex
from nanoserve.kv.tiered_block_manager import TieredBlockManager
from nanoserve.sampling import SamplingParams
from tests.test_ch18_tier import always_load
from tests.tiny_model import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


# --- by hand: slots, blocks, the scheduler's plan ---------------------------------------------------------------

def test_pinned_slots_are_outside_the_lru():
    """nanoserve/kv/tier_index.py's worked example, on from its LRU part."""
    t = TierIndex(2)
    t.store(1, None, [1]), t.store(2, 1, [2]), t.store(1, None, [1])
    t.mark_used(t.lookup(2, 1, [2]))
    assert t.store(3, 2, [3]) == 0  # h1 dropped; LRU order h2, h3
    assert t.pin(1) == [1] and t.lookup(2, 1, [2]) is None and t.num_evicted == 2  # h2 dropped for the pin
    assert t.store(4, 3, [4]) == 0 and t.lookup(3, 2, [3]) is None  # full: h3 goes, never the pinned slot 1
    assert t.pin(2) is None and (len(t), t.num_free_slots, t.num_pinned) == (1, 0, 1)  # nothing changed
    t.unpin([1])
    assert (len(t), t.num_free_slots, t.num_pinned) == (1, 1, 0)
    assert t.pin(2) == [1, 0] and len(t) == 0  # the free slot first, then h4's
    assert t.store(5, None, [5]) is None and t.num_pinned == 2  # every slot pinned: the evicted block is lost


def test_swap_worked_example():
    """nanoserve/kv/tiered_block_manager.py's swap example: all of B's blocks, its partly filled last one too, go to
    pinned slots and come back as one unit into whatever blocks are free."""
    bm = TieredBlockManager(5, 4, TierIndex(8), bytes_per_token=1.0, enable_prefix_caching=False)
    a, b, c = list(range(100, 108)), list(range(200, 206)), list(range(300, 308))
    assert bm.allocate_slots("A", a, 8) == [0, 1] and bm.allocate_slots("B", b, 6) == [2, 3]
    assert bm.swap_out("B")
    assert bm.take_tier_ops() == [("swap_out", 2, 0), ("swap_out", 3, 1)]
    assert bm.tier.pinned == {0, 1} and "B" not in bm.block_tables and bm.get_num_free_blocks() == 3
    assert bm.allocate_slots("C", c, 8) == [4, 3]
    assert bm.swap_in("B", b + [7], 7) is None and bm.take_tier_ops() == [] and bm.tier.pinned == {0, 1}
    bm.free("A")
    assert bm.swap_in("B", b + [7], 7) == [2, 1]
    assert bm.take_tier_ops() == [("swap_in", 0, 2), ("swap_in", 1, 1)]
    assert bm.tier.num_pinned == 0 and bm.tier.num_free_slots == 8 and bm.num_slots["B"] == 7
    s = bm.tier_stats
    assert (s.swapped_out_blocks, s.swap_ins, s.swap_fallbacks) == (2, 1, 0)
    bm.free("B"), bm.free("C")
    assert bm.get_num_free_blocks() == 5


def test_a_swap_the_tier_cannot_hold_changes_nothing():
    bm = TieredBlockManager(4, 4, TierIndex(2), bytes_per_token=1.0, enable_prefix_caching=False)
    bm.allocate_slots("A", list(range(12)), 12)  # 3 blocks, 2 slots
    assert not bm.swap_out("A") and bm.block_tables["A"] == [0, 1, 2] and bm.take_tier_ops() == []
    assert bm.tier_stats.swap_fallbacks == 1 and bm.tier.num_free_slots == 2


def step(s):
    """One schedule() and a fake forward pass: every sequence that samples gets token 7."""
    out = s.schedule()
    s.update_from_output(out, {q.seq_id: 7 for q in out.scheduled_seqs if out.samples(q)}, now=0.0)
    out.kv_tier_ops = s.block_manager.take_tier_ops()  # what the engine hands the worker
    return out


def test_the_scheduler_plans_the_swaps():
    """A pool of 4 blocks of 4, a tier of 8 slots. A (7 tokens) and B (8) fill it; B, the least urgent, has to grow
    and is swapped out with its 8 computed tokens; C (priority -1) is admitted ahead of it; B comes back into the
    blocks A frees, and nothing of it is computed again."""
    bm = TieredBlockManager(4, 4, TierIndex(8), bytes_per_token=1.0, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap"), bm)
    s.add_seq(Sequence("A", list(range(100, 107)), 3, arrival_time=0.0))
    s.add_seq(Sequence("B", list(range(200, 208)), 3, arrival_time=1.0))
    out = step(s)
    assert out.num_scheduled_tokens == {"A": 7, "B": 8} and bm.block_table("A") == [0, 1] and bm.block_table("B") == [2, 3]
    out = step(s)  # A decodes position 7 in block 1; B needs a third block for position 8: none is free
    B = s.seqs["B"]
    assert out.preempted_seq_ids == ["B"] and out.num_scheduled_tokens == {"A": 1}
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)] and out.kv_tier_ops == [("swap_out", 2, 0), ("swap_out", 3, 1)]
    assert (B.status, B.num_computed_tokens, B.num_preemptions) == (SequenceStatus.SWAPPED, 8, 1)
    s.add_seq(Sequence("C", list(range(300, 303)), 2, priority=-1, arrival_time=2.0))
    out = step(s)  # A takes block 3 for position 8; C (more urgent) is admitted into block 2; B waits
    assert out.num_scheduled_tokens == {"A": 1, "C": 3} and bm.block_table("A") == [0, 1, 3] and bm.block_table("C") == [2]
    assert out.kv_tier_ops == [] and B.status is SequenceStatus.SWAPPED
    s.finish_seq("A", SequenceStatus.FINISHED_LENGTH)  # free list [3 1 0]
    out = step(s)
    assert out.num_scheduled_tokens == {"C": 1, "B": 1}  # B computes position 8 only: its 8 tokens came back
    assert out.blocks_to_swap_in == [(0, 3), (1, 1)] and bm.block_table("B") == [3, 1, 0]
    assert B.status is SequenceStatus.RUNNING and bm.tier.num_free_slots == 8


def test_aborting_a_swapped_out_sequence_frees_its_slots():
    bm = TieredBlockManager(4, 4, TierIndex(8), bytes_per_token=1.0, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, preemption_mode="swap"), bm)
    s.add_seq(Sequence("A", list(range(100, 107)), 3, arrival_time=0.0))
    s.add_seq(Sequence("B", list(range(200, 208)), 3, arrival_time=1.0))
    step(s), step(s)
    assert s.seqs["B"].status is SequenceStatus.SWAPPED and bm.tier.pinned == {0, 1}
    s.finish_seq("B", SequenceStatus.FINISHED_ABORTED)
    assert bm.tier.num_pinned == 0 and bm.tier.num_free_slots == 8 and not bm.swapped and "B" not in s.seqs


# --- the engine end to end --------------------------------------------------------------------------------------

def workload(vocab, lengths=(6, 14), n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def serve(engine, prompts, max_tokens=10, on_step=None):
    """All prompts at once, greedy; ({request id: tokens}, tokens the steps computed beyond the work)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs, computed = {}, 0
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        computed += engine.last_scheduler_output.total_num_scheduled_tokens
        if on_step is not None:
            on_step(engine)
    return outs, computed - sum(len(p) + max_tokens - 1 for p in prompts)


def test_swapped_sequences_give_the_unpreempted_text_and_recompute_nothing(tiny):
    """6 requests of 6-13 + 10 tokens at once on a pool of 10 blocks of 4: preemptions are forced. Swapped, every
    request's greedy tokens are those of a pool of 64 blocks (never preempted) and no token is computed twice;
    preempted by recompute, the same requests compute tokens again (so the count can tell)."""
    prompts = workload(tiny.config.vocab_size)
    expected, extra = serve(LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, enable_prefix_caching=False)),
                            prompts)
    assert extra == 0
    recompute, again = serve(LLMEngine(tiny, engine_config(num_blocks=10, block_size=4, enable_prefix_caching=False)),
                             prompts)
    assert recompute == expected and again > 0
    for caching in (False, True):
        got, again, preempted, stats, block_nbytes = serve_swapping(tiny, prompts, 64, enable_prefix_caching=caching)
        assert got == expected and again == 0 and preempted
        assert stats["swap_ins"] == len(preempted) and stats["swap_fallbacks"] == 0
        assert stats["swapped_out_blocks"] >= len(preempted) and stats["tier_blocks_pinned"] == 0
        # no two prompts share a block, so nothing is loaded as a prefix: every read is a swapped-out block coming back
        assert stats["loaded_blocks"] == 0 and stats["bytes_read"] == stats["swapped_out_blocks"] * block_nbytes


def serve_swapping(tiny, prompts, kv_tier_blocks, **config):
    """serve() on a pool of 10 blocks of 4 in swap mode: (tokens, tokens computed again, the preempted ids, the
    tier's stats, a block's bytes)."""
    engine = LLMEngine(tiny, engine_config(num_blocks=10, block_size=4, kv_tier_blocks=kv_tier_blocks,
                                           preemption_mode="swap", **config))
    preempted = []
    try:
        got, again = serve(engine, prompts, on_step=lambda e: preempted.extend(e.last_scheduler_output.preempted_seq_ids))
        return got, again, preempted, engine.kv_tier_stats(), engine.executor.workers[0].kv_tier.block_nbytes
    finally:
        engine.close()


def gather(pool, table, n):
    """The K and V rows of positions [0, n) of a block table, every layer: (layers, 2, n, Hkv, D)."""
    bs = pool.block_size
    rows = lambda t: torch.stack([t[:, table[p // bs], p % bs] for p in range(n)])  # noqa: E731
    return torch.stack([torch.stack([rows(k), rows(v)]) for k, v in zip(pool.k_cache, pool.v_cache)])


def test_a_swapped_sequence_s_kv_comes_back_bit_for_bit(tiny):
    """After every step each running sequence's K/V rows are kept; when a swapped-out sequence is back, the rows it
    had computed (its partly filled last block's included) are read through its new block table and must be the
    same bytes."""
    engine = LLMEngine(tiny, engine_config(num_blocks=10, block_size=4, enable_prefix_caching=False,
                                           kv_tier_blocks=64, preemption_mode="swap"))
    pool = engine.executor.workers[0].model_runner.kv_cache
    kept, checked = {}, []

    def check(e):
        out = e.last_scheduler_output
        back = {seq.seq_id for seq in out.scheduled_seqs  # swapped out since it was last seen, and back in
                if seq.seq_id in kept and seq.num_preemptions > kept[seq.seq_id][2]}
        for seq in e.scheduler.running:
            table = e.block_manager.block_table(seq.seq_id)
            if seq.seq_id in back:
                before, n, _ = kept[seq.seq_id]
                assert torch.equal(gather(pool, table, n).view(torch.uint8), before.view(torch.uint8)), seq.seq_id
                checked.append(n)
            kept[seq.seq_id] = (gather(pool, table, seq.num_computed_tokens), seq.num_computed_tokens,
                                seq.num_preemptions)

    try:
        serve(engine, workload(tiny.config.vocab_size), on_step=check)
    finally:
        engine.close()
    assert checked and any(n % 4 for n in checked)  # a partly filled last block did travel


def test_swap_falls_back_to_recompute_when_the_tier_is_full(tiny):
    """A tier of 2 slots cannot hold any victim here (prompts of 9 tokens or more: 3 blocks of 4 at least): every
    preemption is recomputed, counted as a fallback, and the text is still the unpreempted one."""
    prompts = workload(tiny.config.vocab_size, lengths=(9, 14))
    expected, _ = serve(LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, enable_prefix_caching=False)), prompts)
    got, again, preempted, stats, _ = serve_swapping(tiny, prompts, 2, enable_prefix_caching=False)
    assert got == expected and preempted and again > 0
    assert stats["swap_fallbacks"] == len(preempted) and stats["swapped_out_blocks"] == stats["swap_ins"] == 0


def test_stress_of_preemptions_swaps_and_aborts_leaves_no_block_or_slot(tiny):
    """Random arrivals into a pool of 12 blocks, a tier of 4 slots (some swaps fit, some fall back), prefix caching
    on (evictions are offloaded beside the swaps, and loaded back), every so often a random live request aborted, or a swapped-out one.
    At the end the pool is whole, no slot is pinned, every slot is free or holds one entry, no write is pending, and
    close() removes the file."""
    rng = random.Random(2)
    vocab = tiny.config.vocab_size
    engine = always_load(LLMEngine(tiny, engine_config(num_blocks=12, block_size=4, max_num_seqs=6, kv_tier_blocks=4,
                                                       preemption_mode="swap")))
    tier, bm = engine.executor.workers[0].kv_tier, engine.block_manager
    n, aborted_swapped = 0, 0
    for _ in range(250):
        if rng.random() < 0.4 and engine.get_num_unfinished_requests() < 8:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(2, 16))]
            engine.add_request(str(n), prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 14), ignore_eos=True))
            n += 1
        if engine.has_unfinished_requests():
            engine.step()
        live = sorted(engine.scheduler.seqs.values(), key=lambda q: q.seq_id)
        swapped = [q for q in live if q.status is SequenceStatus.SWAPPED]
        victim = (rng.choice(swapped) if swapped and rng.random() < 0.3
                  else rng.choice(live) if live and rng.random() < 0.1 else None)
        if victim is not None:
            aborted_swapped += victim.status is SequenceStatus.SWAPPED
            engine.abort_request(victim.seq_id)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.kv_tier_stats()
    assert stats["swap_ins"] > 0 and stats["swap_fallbacks"] > 0 and aborted_swapped > 0  # the stress did all three,
    assert stats["offloaded_blocks"] > 0 and stats["loaded_blocks"] > 0  # and evicted prefix blocks moved beside them
    assert bm.get_num_free_blocks() == bm.num_blocks and not bm.tier_ops and not bm.swapped
    assert bm.tier.num_pinned == 0 and len(bm.tier) + bm.tier.num_free_slots == bm.tier.capacity == 4
    assert sorted(bm.tier.entries) == sorted(bm.tier.slot_of.values())
    tier.flush()
    assert not tier.pending and tier.stats.bytes_written == tier.stats.offloads * tier.block_nbytes
    engine.close()
    assert not tier.writer.is_alive() and not os.path.exists(tier.path)


def test_metrics_count_the_swaps(tiny):
    """/metrics' swap counters are the engine's counts (kv_tier_stats), as deltas step after step, and every
    preemption is in num_preemptions."""
    from nanoserve.server.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    engine = LLMEngine(tiny, engine_config(num_blocks=10, block_size=4, enable_prefix_caching=False,
                                           kv_tier_blocks=64, preemption_mode="swap"))
    preempted = []

    def record(e):
        logger.record(e, [], e.last_scheduler_output)
        preempted.extend(e.last_scheduler_output.preempted_seq_ids)

    try:
        serve(engine, workload(tiny.config.vocab_size), on_step=record)
        stats = engine.kv_tier_stats()
    finally:
        engine.close()
    value = lambda name: logger.registry.get_sample_value(f"nanoserve:{name}_total", {"model_name": "m"})  # noqa: E731
    assert value("num_preemptions") == len(preempted) == stats["swap_ins"] > 0
    for name in ("swapped_out_blocks", "swap_ins", "swap_fallbacks"):
        assert value(f"kv_tier_{name}") == stats[name], name


# --- settings and flags -----------------------------------------------------------------------------------------

def test_swap_settings_are_checked(tiny):
    with pytest.raises(ValueError, match="unknown preemption_mode"):
        SchedulerConfig(preemption_mode="swap-out")
    with pytest.raises(ValueError, match="needs kv_tier_blocks > 0"):
        LLMEngine(tiny, engine_config(num_blocks=8, preemption_mode="swap"))
    for chapter in ("06", "18"):  # the learner's scheduler and tier index know nothing of swapping
        with pytest.raises(ValueError, match="reference scheduler and tier index"):
            LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=8, preemption_mode="swap", student=chapter))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):  # recompute: the tier would hold nothing
        LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=8, enable_prefix_caching=False))


@pytest.mark.parametrize("argv, named", [
    (["batch", "--input", "IN", "--output", "OUT", "--preemption-mode", "swap"], "give --kv-tier-blocks"),
    (["batch", "--input", "IN", "--output", "OUT", "--preemption-mode", "swap", "--kv-tier-blocks", "8", "-tp", "3"],
     "single-process"),
    (["bench", "offline", "--preemption-mode", "swap"], "give --kv-tier-blocks"),
    (["batch", "--input", "IN", "--output", "OUT", "--preemption-mode", "swap", "--kv-tier-blocks", "8", "--student",
      "06"], "reference scheduler"),
    (["batch", "--input", "IN", "--output", "OUT", "--preemption-mode", "swap", "--kv-tier-blocks", "8", "--student"],
     "a bare --student"),
    (["batch", "--input", "IN", "--output", "OUT", "--preemption-mode", "evict"], "invalid choice")])
def test_swap_flags_are_refused_in_one_line(argv, named, tmp_path, capsys):
    from nanoserve.cli import main

    (tmp_path / "in.jsonl").write_text('{"prompt_token_ids": [1, 2], "max_tokens": 2}\n')
    argv = [{"IN": str(tmp_path / "in.jsonl"), "OUT": str(tmp_path / "out.jsonl")}.get(a, a) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and named in err[0], err


# --- the comparison -----------------------------------------------------------------------------------------------

def test_the_comparison_counts_what_each_mode_recomputes(tiny):
    """bench experiment swap-vs-recompute's comparison on the tiny model: both modes preempt, swap recomputes nothing
    and moves every swapped block out and back, recompute's count equals the tokens its victims held (drive()'s own
    count), and the greedy text is the same."""
    from nanoserve.bench.experiment import drive, engine_for, random_prompt
    from nanoserve.bench.kv_tiers import compare_preemption_modes

    rng = random.Random(1)
    arrivals = [(0, f"r{i}", random_prompt(rng, rng.randint(8, 20), tiny.config.vocab_size), 12) for i in range(8)]
    best = compare_preemption_modes(tiny, arrivals, num_blocks=12, block_size=4, rounds=1)
    swap, recompute = best["swap"], best["recompute"]
    assert swap["preemptions"] > 0 and recompute["preemptions"] > 0
    assert swap["recomputed_tokens"] == 0 and swap["swap_fallbacks"] == 0 and swap["swap_ins"] == swap["preemptions"]
    assert swap["bytes_written"] == swap["bytes_read"] > 0 and swap["same_text_as_recompute"] == 1.0
    _, trace = drive(engine_for(tiny, num_blocks=12, block_size=4, enable_prefix_caching=False), arrivals)
    assert recompute["recomputed_tokens"] == trace[-1]["recomputed_tokens"] > 0
