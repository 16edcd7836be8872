"""Chapter 18 — the second KV tier: slot bookkeeping, load or recompute, the file's bytes, the engine end to end.

References: hand-worked slot and LRU sequences; hand-computed costs; a block written out and read back compared
bit for bit; greedy text with the tier against the same requests recomputed without any prefix cache."""

import os
import random
from types import SimpleNamespace

import pytest
import torch

from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.kv.file_tier import FileKVTier, block_nbytes, read_block
from nanoserve.kv.paged_attention import PagedKVCache
from nanoserve.kv.quantized_pool import QuantizedKVCache
from nanoserve.kv.rates import LineFit, MeasuredRates
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation
from tests.test_student import exercises  # noqa: F401  (a fixture: a copy of exercises/ to finish)
from tests.tiny_model import tiny_llama


def tier_index(capacity):
    return implementation("nanoserve.kv.tier_index").TierIndex(capacity)


# --- Exercise 18.1: slots and LRU ------------------------------------------------------------------------------

@pytest.mark.exercise("18.1")
def test_tier_index_worked_example():
    t = tier_index(2)
    assert (len(t), t.num_free_slots) == (0, 2)
    assert t.store(11, None, [1, 2]) == 0 and t.store(12, 11, [3, 4]) == 1 and t.num_free_slots == 0
    assert t.store(11, None, [1, 2]) is None  # held already: nothing to write, now most recently used
    assert t.lookup(12, 11, [3, 4]) == 1 and t.lookup(12, 11, [3, 5]) is None and t.lookup(12, 99, [3, 4]) is None
    assert t.store(13, 12, [5, 6]) == 1  # full: 12 was the least recently used (lookup did not touch it)
    assert t.lookup(12, 11, [3, 4]) is None and t.num_evicted == 1
    t.mark_used(0)  # 11 read by a load: 13 is now the oldest
    assert t.store(14, None, [7, 8]) == 1 and t.lookup(11, None, [1, 2]) == 0
    assert len(t) + t.num_free_slots == 2


@pytest.mark.exercise("18.1")
def test_tier_index_never_loses_a_slot():
    rng, t = random.Random(0), tier_index(5)
    for _ in range(300):
        h = rng.randrange(12)
        slot = t.store(h, None, [h])
        if slot is not None:
            assert 0 <= slot < 5 and t.lookup(h, None, [h]) == slot
        found = t.lookup(h, None, [h])
        assert found is not None
        t.mark_used(found)
        held = [t.lookup(g, None, [g]) for g in range(12)]
        slots = [slot for slot in held if slot is not None]  # public view only: every entry in its own slot
        assert len(t) + t.num_free_slots == 5 and len(slots) == len(set(slots)) == len(t)
    with pytest.raises(ValueError):
        tier_index(0)


# --- Exercise 18.2: load or recompute ------------------------------------------------------------------------------

@pytest.mark.exercise("18.2")
def test_should_load_by_hand():
    should_load = implementation("nanoserve.kv.load_policy").should_load
    # SmolLM2 fp32 46,080 B / token, prefill 0.5 ms / token, 1 ms latency, 1 GB/s: n* = 1 / (0.5 - 0.046) = 2.2
    assert not should_load(2, 46_080, 5e-4, 1e9, 1e-3) and should_load(3, 46_080, 5e-4, 1e9, 1e-3)
    assert not should_load(10_000, 46_080, 5e-4, 5e7, 0.0)  # 0.92 ms per token loaded: never pays
    assert should_load(1, 46_080, 5e-4, 1e9)  # no latency: only the rates matter
    assert not should_load(1, 1000, 1e-3, 1e6)  # equal cost: recompute
    assert should_load(4, 46_080, None, 1e9) and should_load(4, 46_080, 5e-4, None)  # not measured yet: load


@pytest.mark.exercise("18.1")
def test_the_tiered_block_manager_s_worked_example():
    """nanoserve/kv/tiered_block_manager.py's docstring, step by step (loading always pays here)."""
    from nanoserve.kv.tiered_block_manager import TieredBlockManager

    always = SimpleNamespace(should_load=lambda *costs: True)
    bm = TieredBlockManager(3, 4, tier_index(8), bytes_per_token=1.0, load_policy=always)
    a, b = list(range(100, 112)), list(range(200, 212))
    assert bm.allocate_slots(1, a, 12) == [0, 1, 2] and bm.take_tier_ops() == []
    bm.free(1)
    assert bm.allocate_slots(2, b, 12) == [2, 1, 0]
    assert bm.take_tier_ops() == [("offload", 2, 0), ("offload", 1, 1), ("offload", 0, 2)]
    bm.free(2)
    assert bm.lookup_prefix(a) == 8
    assert bm.allocate_slots(3, a, 12) == [0, 1, 2]
    assert bm.take_tier_ops() == [("offload", 0, 3), ("load", 2, 0), ("offload", 1, 4), ("load", 1, 1),
                                  ("offload", 2, 5)]
    assert bm.tier_stats.hit_tokens == 8 and bm.tier_stats.loaded_blocks == 2


def test_line_fit_by_hand():
    fit = LineFit()
    assert fit.fit() is None
    fit.add(100, 0.06)
    assert fit.fit() == (0.0, 0.06 / 100)  # one size seen: through the origin
    fit.add(300, 0.16)
    intercept, slope = fit.fit()
    assert intercept == pytest.approx(0.01) and slope == pytest.approx(0.0005)


# --- the file --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", [PagedKVCache(3, 6, 4, 2, 8), PagedKVCache(2, 6, 4, 2, 8, torch.bfloat16),
                                  QuantizedKVCache(2, 6, 4, 2, 8)], ids=["fp32", "bf16", "int8"])
def test_a_block_written_out_and_read_back_is_bit_exact(pool, tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = pool.block_tensors() if hasattr(pool, "block_tensors") else pool.k_cache + pool.v_cache
    for t in tensors:  # random bits in every byte (NaN patterns too: compared as bytes)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    original = [t.clone() for t in tensors]
    tier = FileKVTier(4, block_nbytes(pool), str(tmp_path / "kv.bin"))
    assert tier.block_nbytes == sum(t[:, 0].nbytes for t in original)
    tier.apply(pool, [("offload", 2, 3), ("offload", 4, 0)])
    tier.apply(pool, [("load", 3, 5), ("load", 0, 1)])  # may wait for the writer: a stall
    for t, o in zip(tensors, original):
        assert torch.equal(t[:, 5].view(torch.uint8), o[:, 2].view(torch.uint8))
        assert torch.equal(t[:, 1].view(torch.uint8), o[:, 4].view(torch.uint8))
        assert torch.equal(t[:, [0, 2, 3, 4]].view(torch.uint8), o[:, [0, 2, 3, 4]].view(torch.uint8))
    tier.flush()
    assert torch.equal(tier.slots[3], read_block(pool, 2))  # the file itself holds the bytes
    s = tier.stats
    assert (s.offloads, s.loads, s.bytes_written, s.bytes_read) == (2, 2, 2 * tier.block_nbytes, 2 * tier.block_nbytes)
    assert os.path.getsize(tmp_path / "kv.bin") == 4 * tier.block_nbytes
    tier.close()
    assert not tier.writer.is_alive() and not os.path.exists(tmp_path / "kv.bin")  # the tier's own file: removed


def test_a_load_waits_for_its_slot_s_write():
    """A load of a slot whose write is still queued is a stall: it waits for the writer, then reads the new bytes.
    Holding the tier's condition keeps the writer from finishing its write until the load waits on it."""
    pool = PagedKVCache(1, 3, 2, 1, 4)
    pool.store_kv(0, torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([0, 1]))
    tier = FileKVTier(2, block_nbytes(pool))
    with tier.done:
        tier.offload(pool, 0, 1)
        tier.load(pool, 1, 2)
    assert tier.stats.stalls == 1 and torch.equal(pool.k_cache[0][:, 2], torch.ones(1, 2, 4))
    path = tier.path
    tier.close()
    assert not os.path.exists(path)  # its own temporary file is removed


def test_an_existing_file_is_never_taken_over(tmp_path):
    """--kv-tier-path names a new file: an existing one (the user's data) is refused, untouched and not removed."""
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(ValueError, match="exists"):
        FileKVTier(4, 64, str(precious))
    assert precious.read_text() == "keep me"


def test_a_failed_write_fails_the_next_load_and_flush_instead_of_hanging():
    """The writer thread's error is recorded, its write still counts as finished (nobody waits forever), and the
    next load and flush raise it. A file too narrow for the block makes the write raise."""
    pool = PagedKVCache(1, 3, 2, 1, 4)
    tier = FileKVTier(2, block_nbytes(pool))
    tier.slots = torch.zeros(2, 1, dtype=torch.uint8)  # copy_ of a whole block into 1 byte raises in the writer
    tier.offload(pool, 0, 1)
    with pytest.raises(RuntimeError, match="writer failed") as failure:
        tier.load(pool, 1, 2)
    assert isinstance(failure.value.__cause__, RuntimeError) and not tier.pending
    with pytest.raises(RuntimeError, match="writer failed"):
        tier.flush()
    assert tier.stats.bytes_written == 0
    tier.close()
    assert not tier.writer.is_alive()


# --- the engine ---------------------------------------------------------------------------------------------------

def serve(engine, prompts, max_tokens=4, abort=()):
    """Each prompt alone, one after another (users returning); {index: greedy tokens}. Requests in `abort` are
    aborted after their first step."""
    outs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[i] = out.token_ids
            if i in abort and engine.has_unfinished_requests():
                engine.abort_request(str(i))
    return outs


def always_load(engine):
    """The engine's load-or-recompute decision still runs (and is counted) but loading is taken: on the tiny model a
    prefill and a load both cost microseconds, and which one measures cheaper on a busy machine is chance. The
    decision itself is tested by hand (test_should_load_by_hand) and by rates (test_recompute_is_chosen_...)."""
    decide = engine.block_manager.should_load
    engine.block_manager.should_load = lambda *costs: decide(*costs) or True
    return engine


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def users(vocab, n_users=4, prompt_len=40, rounds=2, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n_users)]
    return [s + [rng.randrange(vocab)] for _ in range(rounds) for s in systems]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_second_tier_hit_gives_the_recomputed_text(tiny, kv_cache_dtype):
    """4 users x 40-token system prompts, 2 rounds, on a pool of 16 blocks of 4 (each prompt needs 11): every
    return finds its prompt evicted from the pool, in the tier. Greedy text equals the same requests computed from
    scratch (no prefix cache at all) on the same pool dtype."""
    prompts = users(tiny.config.vocab_size)
    config = dict(num_blocks=16, block_size=4, kv_cache_dtype=kv_cache_dtype)
    expected = serve(LLMEngine(tiny, engine_config(**config, enable_prefix_caching=False)), prompts)
    engine = always_load(LLMEngine(tiny, engine_config(**config, kv_tier_blocks=64)))
    try:
        assert serve(engine, prompts) == expected
        stats = engine.kv_tier_stats()
        # round 2: 4 prompts x 10 full blocks of 4 before the last token, all from the tier
        assert stats["tier_hit_tokens"] == 4 * 40 and stats["pool_hit_tokens"] == 0
        assert stats["loaded_blocks"] == 40 and stats["bytes_read"] == 40 * engine.executor.workers[0].kv_tier.block_nbytes
        assert stats["offloaded_blocks"] > 0 and stats["tier_blocks_used"] <= 64
        assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks
    finally:
        engine.close()


def test_recompute_is_chosen_when_the_tier_is_measured_slow(tiny):
    """The decision reads the rates: with a tier at 1 byte per second against a prefill of 1 ms a token, nothing is
    loaded. (The rates are pinned: the ones the engine measures on the tiny model are microseconds either way, and
    which one wins on a busy machine is chance.)"""

    class SlowTier(MeasuredRates):
        def prefill_s_per_token(self):
            return 1e-3

        def tier_bytes_per_s(self):
            return 1.0

    prompts = users(tiny.config.vocab_size)
    engine = LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, kv_tier_blocks=64))
    try:
        engine.block_manager.rates = SlowTier()
        expected = serve(LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, enable_prefix_caching=False)), prompts)
        assert serve(engine, prompts) == expected
        stats = engine.kv_tier_stats()
        assert stats["tier_hit_tokens"] == 0 and stats["tier_recomputed_tokens"] == 4 * 40 and stats["loaded_blocks"] == 0
    finally:
        engine.close()


def test_returning_users_find_what_the_chapter_counts(tiny):
    """bench experiment returning-users' visits (8 users, 3 visits, 192-token system prompts, 8 output tokens) on the
    tiny model's pools of the experiment's block counts: 26 blocks with no tier finds nothing; with a tier (loading
    taken) every returning visit loads its whole system prompt; an int8 pool of 100 blocks (< 8 users x 13 blocks)
    finds 144 of each returning visit's 192 tokens in the pool. Counts only: they do not depend on the model."""
    from nanoserve.bench.kv_tiers import RETURNING_PROMPT_LEN, returning_visits

    arrivals = returning_visits(8, tiny.config.vocab_size, n_out=8)
    returning = [rid for _, rid, *_ in arrivals if not rid.endswith("v0")]

    def found(engine) -> list[tuple[int, int]]:
        """(tokens found in the pool, in the tier) by each returning visit, each visit served alone as drive() does."""
        def counts():
            tier = (engine.kv_tier_stats() or {}).get("tier_hit_tokens", 0)
            return engine.block_manager.stats.hit_tokens - tier, tier

        per_visit = {}
        try:
            for _, rid, prompt, n in arrivals:
                before = counts()
                engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                while engine.has_unfinished_requests():
                    engine.step()
                per_visit[rid] = tuple(after - b for after, b in zip(counts(), before))
        finally:
            engine.close()
        assert all(per_visit[rid] == (0, 0) for rid in per_visit if rid.endswith("v0"))
        return [per_visit[rid] for rid in returning]

    assert found(LLMEngine(tiny, engine_config(num_blocks=26, block_size=16))) == [(0, 0)] * 16
    tiered = always_load(LLMEngine(tiny, engine_config(num_blocks=26, block_size=16, kv_tier_blocks=8 * 14)))
    assert found(tiered) == [(0, RETURNING_PROMPT_LEN)] * 16
    int8 = LLMEngine(tiny, engine_config(num_blocks=100, block_size=16, kv_cache_dtype="int8"))
    assert found(int8) == [(144, 0)] * 16


def test_stress_of_evictions_hits_and_aborts_leaves_no_block_or_slot(tiny):
    """Random users, prompt lengths and arrivals, several requests at once, every fifth one aborted mid-way, a tier
    too small for everything (LRU drops): at the end the pool is whole, every tier slot is free or holds one entry,
    no write is pending, and close() stops the writer and removes its file."""
    rng = random.Random(1)
    vocab = tiny.config.vocab_size
    systems = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 48))] for _ in range(6)]
    engine = LLMEngine(tiny, engine_config(num_blocks=24, block_size=4, max_num_seqs=4, kv_tier_blocks=20))
    tier = engine.executor.workers[0].kv_tier
    n = 0
    for step in range(150):
        if rng.random() < 0.5 and engine.get_num_unfinished_requests() < 6:
            prompt = rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            engine.add_request(str(n), prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 8), ignore_eos=True))
            n += 1
        if engine.has_unfinished_requests():
            engine.step()
        if rng.random() < 0.15 and n:
            engine.abort_request(str(rng.randrange(n)))
    while engine.has_unfinished_requests():
        engine.step()
    bm, stats = engine.block_manager, engine.kv_tier_stats()
    assert bm.get_num_free_blocks() == bm.num_blocks and not bm.tier_ops
    assert len(bm.tier) + bm.tier.num_free_slots == bm.tier.capacity == 20
    assert sorted(bm.tier.entries) == sorted(bm.tier.slot_of.values())
    assert stats["tier_hit_tokens"] > 0 and bm.tier.num_evicted > 0  # the stress did hit the tier and fill it
    tier.flush()
    assert not tier.pending and tier.stats.bytes_written == tier.stats.offloads * tier.block_nbytes
    engine.close()
    assert not tier.writer.is_alive() and not os.path.exists(tier.path)


def test_tier_settings_are_checked(tiny, tmp_path):
    for blocks in (-1, 1):  # one slot could never be loaded from: a load takes at most half the tier
        with pytest.raises(ValueError, match="kv_tier_blocks must be 0"):
            LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=blocks))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=8, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="needs kv_tier_blocks > 0"):
        LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_path="/tmp/kv.bin"))
    with pytest.raises(ValueError, match="chapter 05"):
        LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=8, student="05"))
    for dtype in ("int8", "fp8"):  # chapter 05's attention would be dropped for the quantized one: refused
        with pytest.raises(ValueError, match="chapter 05's paged attention"):
            LLMEngine(tiny, engine_config(num_blocks=8, kv_cache_dtype=dtype, student="05"))
    precious = tmp_path / "kv.bin"
    precious.write_bytes(b"user data")
    with pytest.raises(ValueError, match="exists"):
        LLMEngine(tiny, engine_config(num_blocks=8, kv_tier_blocks=8, kv_tier_path=str(precious)))
    assert precious.read_bytes() == b"user data"


@pytest.mark.parametrize("flags, named", [(["--kv-tier-blocks", "1"], "0 or an integer >= 2"),
                                          (["--kv-tier-blocks", "8", "--kv-tier-path", "EXISTING"], "exists")])
def test_tier_flags_are_refused_in_one_line(flags, named, tmp_path, capsys):
    from nanoserve.cli import main

    (tmp_path / "kv.bin").write_bytes(b"user data")
    argv = ["batch"] + [str(tmp_path / "kv.bin") if f == "EXISTING" else f for f in flags]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert (tmp_path / "kv.bin").read_bytes() == b"user data"


def test_student_18_serves_the_learners_tier_policy_and_quantizer(tiny, exercises):
    """--student 18 with the three rungs done (the reference copied in): the engine's tier index, load decision
    and KV quantizer are the learner's, they are called, and the greedy text is the reference engine's."""
    for module in ("nanoserve.kv.tier_index", "nanoserve.kv.load_policy", "nanoserve.kv.kv_quant"):
        exercises(module)
    prompts = users(tiny.config.vocab_size)
    config = dict(num_blocks=16, block_size=4, kv_tier_blocks=64, kv_cache_dtype="int8")
    expected_engine = always_load(LLMEngine(tiny, engine_config(**config)))
    engine = always_load(LLMEngine(tiny, engine_config(**config, student="18")))
    try:
        assert type(engine.block_manager.tier).__module__ == "student_nanoserve_kv_tier_index"
        assert serve(engine, prompts) == serve(expected_engine, prompts)
        calls = engine.student.calls
        assert calls["TierIndex.store"] > 0 and calls["TierIndex.lookup"] > 0 and calls["TierIndex.mark_used"] > 0
        assert calls["should_load"] > 0 and calls["quantize_kv"] > 0 and calls["dequantize_kv"] > 0
        assert engine.kv_tier_stats()["tier_hit_tokens"] == 4 * 40
    finally:
        engine.close()
        expected_engine.close()


def test_metrics_count_the_tier(tiny):
    """/metrics' kv_tier counters are the engine's counts, as deltas step after step (a hand check: the same numbers
    kv_tier_stats() reports, and tier hits = 4 returning users x 40 tokens)."""
    from nanoserve.server.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    engine = always_load(LLMEngine(tiny, engine_config(num_blocks=16, block_size=4, kv_tier_blocks=64)))
    try:
        for i, prompt in enumerate(users(tiny.config.vocab_size)):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            while engine.has_unfinished_requests():
                logger.record(engine, engine.step(), engine.last_scheduler_output)
        engine.executor.workers[0].kv_tier.flush()  # the writer thread's last bytes, then one more record
        logger.record(engine, [])
        stats = engine.kv_tier_stats()
        value = lambda name: logger.registry.get_sample_value(f"nanoserve:kv_tier_{name}_total", {"model_name": "m"})  # noqa: E731
        assert value("tier_hit_tokens") == stats["tier_hit_tokens"] == 4 * 40
        for name in ("offloaded_blocks", "loaded_blocks", "bytes_written", "bytes_read", "stalls"):
            assert value(name) == stats[name], name
    finally:
        engine.close()
