"""Chapter 12 — the snapshot builder and the event feed, on scripted schedules of a tiny random model.

Every expectation below is worked out by hand from chapter 05's allocator (free list in LRU order,
last block freed first) and chapter 06's scheduler (running first, then the waiting head; preempt the
least urgent). The comments walk through each step.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from nanoserve.engine.async_engine import AsyncLLMEngine, EngineStepError
from nanoserve.engine.event_feed import EventFeed, Subscription
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine import snapshot as reference
from nanoserve.engine.snapshot import SnapshotBuilder, encode_pool
from nanoserve.model import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.student import implementation


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


def params(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def stepper(engine, rules=None):
    """A step function that returns the snapshot taken right after the step (unthrottled)."""
    builder = SnapshotBuilder(engine, rules)

    def step():
        t0 = time.perf_counter()
        outputs = engine.step()
        builder.observe_step(engine.last_scheduler_output, outputs, time.perf_counter() - t0)
        return builder.snapshot()

    return builder, step


def owners(snap) -> list[str]:
    return [snap["pool"]["owners"][i] for i in snap["pool"]["blocks"]]


def brief(seqs) -> list[tuple]:
    return [(s["id"], s["state"], s["scheduled"], s["kind"], s["computed"], s["total"]) for s in seqs]


# ---- exercise 12.1: block_owners ------------------------------------------------------------------------
@pytest.mark.exercise("12.1")
def test_block_owners_by_hand():
    block_owners = implementation("nanoserve.engine.snapshot").block_owners
    assert block_owners({"a": [0, 1], "b": [0, 2]}, 6, {3}) == ["shared:2", "a", "b", "cached", "free", "free"]
    assert block_owners({}, 3, set()) == ["free"] * 3
    # a held block stays its holder's even if its hash is in the prefix cache; three tables share block 1
    assert block_owners({"x": [1, 0], "y": [1], "z": [1, 2]}, 4, {0, 3}) == ["x", "shared:3", "z", "cached"]


@pytest.mark.exercise("12.2")
def test_step_kind_by_hand():
    step_kind = implementation("nanoserve.engine.snapshot").step_kind
    assert step_kind(10, 1, 11, 10) == "decode"  # 10-token prompt + 1 generated: compute the generated one
    assert step_kind(0, 10, 10, 10) == "prefill"  # the whole prompt in one step
    assert step_kind(4, 6, 10, 10) == "prefill"  # the last chunk of a chunked prompt
    assert step_kind(9, 1, 10, 10) == "prefill"  # a 1-token last chunk is still the prompt
    assert step_kind(0, 13, 13, 10) == "prefill"  # a preempted sequence recomputes prompt + 3 outputs
    assert step_kind(8, 4, 13, 10) == "prefill"  # ... in chunks
    # a 1-token chunk of that recompute past the prompt: output 1 of 3, not the last token: still recomputing
    assert step_kind(11, 1, 13, 10) == "prefill"
    assert step_kind(12, 1, 13, 10) == "decode"  # the prefix cache covered the rest: only the last token is left


# ---- the builder on scripted schedules ----------------------------------------------------------------
@pytest.mark.exercise("12.1")
def test_prefix_hit_shared_then_cached(tiny):
    """block_size 4, 8 blocks. a = 6-token prompt, 3 tokens; b shares a's first block (4 tokens), 2 tokens."""
    rules = SimpleNamespace(block_owners=implementation("nanoserve.engine.snapshot").block_owners,
                            step_kind=reference.step_kind)
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_batched_tokens=8)))
    builder, step = stepper(engine, rules)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], params(3))

    # step 1: a's whole prompt (6 tokens) in blocks [0, 1]; it samples its first token; block 0 is full: hashed
    s = step()
    assert brief(s["running"]) == [("a", "running", 6, "prefill", 6, 7)]
    assert s["steps"] == [[1, s["steps"][0][1], 6, 0, 1, s["steps"][0][5], 1, 0.25]]
    assert owners(s) == ["a", "a"] + ["free"] * 6
    assert s["pool"]["num_free"] == 6 and s["pool"]["usage"] == 0.25

    # step 2: a decodes; b's first 4 tokens hit block 0 (shared now), its 2 others go to a new block 2
    engine.add_request("b", [1, 2, 3, 4, 9, 10], params(2))
    s = step()
    assert brief(s["running"]) == [("a", "running", 1, "decode", 7, 8), ("b", "running", 2, "prefill", 6, 7)]
    assert owners(s) == ["shared:2", "a", "b"] + ["free"] * 5
    assert s["prefix"] == {"queried_tokens": 6, "hit_tokens": 4, "hit_blocks": 1, "evicted_blocks": 0}
    assert [r[2:5] for r in s["steps"]] == [[2, 1, 2]]  # 2 prefill + 1 decode tokens, 2 sequences

    # step 3: both decode and both finish (length). a's block 1 (full, hashed) and block 0 stay cached;
    # b's block 2 holds a partial block (7 tokens = 1 full block + 3): never hashed, so simply free
    s = step()
    assert [(f["id"], f["reason"], f["output"]) for f in s["finished"]] == [("a", "length", 3), ("b", "length", 2)]
    assert s["running"] == [] and s["waiting"] == [] and s["aborted"] == []
    assert owners(s) == ["cached", "cached"] + ["free"] * 6
    assert s["pool"]["num_free"] == 8 and s["pool"]["usage"] == 0.0
    assert builder.step == 3


def preemption_then_abort(tiny, rules):
    """block_size 4, 4 blocks, two 4-token prompts with 8 tokens each: the pool fills, b is preempted."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=4, block_size=4)))
    _, step = stepper(engine, rules)
    engine.add_request("a", [1, 2, 3, 4], params(8))
    engine.add_request("b", [5, 6, 7, 8], params(8))
    s = step()  # both prompts: a in block 0, b in block 1
    assert brief(s["running"]) == [("a", "running", 4, "prefill", 4, 5), ("b", "running", 4, "prefill", 4, 5)]
    assert owners(s) == ["a", "b", "free", "free"]
    s = step()  # position 4 of each needs a second block: a gets 2, b gets 3; the pool is full
    assert owners(s) == ["a", "b", "a", "b"] and s["pool"]["num_free"] == 0
    assert [r[2:4] for r in s["steps"]] == [[0, 2]]
    for _ in range(3):  # positions 5, 6, 7 fit in the second blocks
        s = step()
    assert s["preempted"] == []
    # step 6: a's position 8 needs a third block, none is free: b (later arrival) is preempted by
    # recompute. Its blocks are freed last-first (3, then 1) and a takes block 3 — evicting b's cached
    # second block; b's first block (its prompt, hashed) stays cached.
    s = step()
    assert s["preempted"] == ["b"]
    assert brief(s["running"]) == [("a", "running", 1, "decode", 9, 10)]
    assert [(w["id"], w["state"], w["computed"], w["total"], w["preemptions"]) for w in s["waiting"]] == [
        ("b", "preempted", 0, 9, 1)]
    assert owners(s) == ["a", "cached", "a", "a"]
    assert s["prefix"]["evicted_blocks"] == 1
    # an abort between steps is reported by the next snapshot; nothing else left the engine
    engine.abort_request("b")
    s = step()
    assert s["aborted"] == ["b"] and s["finished"] == [] and s["waiting"] == []
    assert owners(s) == ["a", "cached", "a", "a"]  # b's cached prompt block outlives b


@pytest.mark.exercise("12.1")
def test_preemption_eviction_and_abort_in_the_pool(tiny):
    preemption_then_abort(tiny, SimpleNamespace(block_owners=implementation("nanoserve.engine.snapshot").block_owners,
                                                step_kind=reference.step_kind))


@pytest.mark.exercise("12.2")
def test_preemption_then_abort(tiny):
    preemption_then_abort(tiny, SimpleNamespace(block_owners=reference.block_owners,
                                                step_kind=implementation("nanoserve.engine.snapshot").step_kind))


@pytest.mark.exercise("12.2")
def test_a_recompute_the_prefix_cache_covers_to_its_last_token_is_a_decode(tiny):
    """block_size 4, 8 blocks, three 3-token prompts with 8 tokens each (11 tokens: 3 blocks each, 9 > 8). The
    preempted request's full blocks stay cached, so its recompute hits all its tokens but the last: it computes
    one generated token, a decode's work, and is shown as a decode."""
    rules = SimpleNamespace(block_owners=reference.block_owners,
                            step_kind=implementation("nanoserve.engine.snapshot").step_kind)
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4)))
    _, step = stepper(engine, rules)
    for rid in "abc":
        engine.add_request(rid, [ord(rid)] * 3, params(8))
    for _ in range(6):  # positions 0..7: two blocks each, 6 of 8 held
        s = step()
    # step 7: position 8 needs a third block each, 2 are free: c (the latest) is preempted, its 9 tokens wait; its
    # two full blocks (positions 0..7) go back to the pool cached
    s = step()
    assert s["preempted"] == ["c"] and [(w["id"], w["computed"], w["total"]) for w in s["waiting"]] == [("c", 0, 9)]
    # step 8: a and b take their 8th token and finish; c needs 3 blocks, and only its own 2 cached ones are not held
    s = step()
    assert [f["id"] for f in s["finished"]] == ["a", "b"] and [w["id"] for w in s["waiting"]] == ["c"]
    # step 9: c is back: positions 0..7 hit its cached blocks (8 tokens), position 8 is computed — its last token, a
    # generated one: a decode, not a prefill
    s = step()
    assert s["prefix"]["hit_tokens"] == 8
    assert brief(s["running"]) == [("c", "running", 1, "decode", 9, 10)]
    assert [r[2:5] + [r[6]] for r in s["steps"]] == [[0, 1, 1, 1]]


def test_n_3_forks_decode_and_finish(tiny):
    """One request with n = 3: block_size 4, 12 blocks, a 6-token prompt, 4 tokens per completion. Its forks are
    decodes like its own sequence, every completion's tokens count, and all three finish (none is an abort)."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=12, block_size=4)))
    _, step = stepper(engine)
    engine.add_request("r", [1, 2, 3, 4, 5, 6], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4,
                                                               ignore_eos=True))
    # step 1: the prompt (6 tokens, blocks 0 and 1) once; the three first tokens are drawn from its logits, and
    # r#1, r#2 fork holding r's two blocks: 3 new tokens from one sequence's prefill
    s = step()
    assert [r[2:5] + [r[6], r[7]] for r in s["steps"]] == [[6, 0, 1, 3, 0.1667]]
    assert brief(s["running"]) == [("r", "running", 6, "prefill", 6, 7), ("r#1", "running", 0, None, 6, 7),
                                   ("r#2", "running", 0, None, 6, 7)]
    assert owners(s) == ["shared:3", "shared:3"] + ["free"] * 10
    assert "shared" not in s["pool"]  # who shares what: only with tenants, for tenant_view
    # step 2: each computes position 6, in the shared last block: r and r#1 copy it into blocks 2 and 3 on
    # their first write, r#2 keeps it; block 0 (full, read only) stays shared. 3 decodes, 3 new tokens
    s = step()
    assert [r[2:5] + [r[6], r[7]] for r in s["steps"]] == [[0, 3, 3, 3, 0.3333]]
    assert brief(s["running"]) == [(i, "running", 1, "decode", 7, 8) for i in ("r", "r#1", "r#2")]
    assert owners(s) == ["shared:3", "r#2", "r", "r#1"] + ["free"] * 8
    # step 3: position 7 fills those blocks; step 4: position 8 takes a block each, and the 4th tokens end all three
    s = step()
    assert [r[2:5] + [r[6]] for r in s["steps"]] == [[0, 3, 3, 3]]
    s = step()
    assert [r[2:5] + [r[6], r[7]] for r in s["steps"]] == [[0, 3, 3, 3, 0.0]]
    assert [(f["id"], f["reason"], f["output"]) for f in s["finished"]] == [("r", "length", 4), ("r#1", "length", 4),
                                                                            ("r#2", "length", 4)]
    assert s["aborted"] == [] and s["running"] == [] and set(owners(s)) <= {"free", "cached"}
    assert s["tenants"] == {"r": None, "r#1": None, "r#2": None}


def test_a_verification_step_is_a_decode_and_counts_its_accepted_tokens(tiny):
    """Chapter 14's n-gram speculation (k = 4): a 12-token prompt [1 2 3] x 4, 16 tokens out, greedy. The test's
    model (N(0, 1) embeddings, tied head) repeats its last token, so it writes 3 3 3 ...; prompt lookup proposes
    what followed the first earlier occurrence of the longest suffix. By hand, step by step:

        step  tokens' tail     longest earlier suffix  proposals    verified       new tokens
        1     prompt                                   -            (prefill 12)   1: 3
        2     ... 1 2 3 3      [3] at 2                [1 2 3 1]    1 rejected     1: the correction 3
        3     ... 2 3 3 3      [3 3] at 11             [3]          accepted       2: 3 + the bonus 3
        4     ... 3 3 3 3      [3 3 3 3] at 11         [3]          accepted       2
        5     (18 tokens)      [3 3 3 3] at 11         [3 3 3]      all            4
        6     (22 tokens)      [3 3 3 3] at 11         [3 3 3 3]    all            5 (15 out: 1 left)
        7     (27 tokens)      -                       none: 0 left to propose     1

    Every verification computes 1 + k tokens after the prompt: a decode, whatever it accepts."""
    engine = LLMEngine(tiny, engine_config(num_blocks=64, block_size=4, speculative="ngram",
                                           num_speculative_tokens=4, speculative_disable_by_batch_size=None))
    _, step = stepper(engine)
    engine.add_request("r", [1, 2, 3] * 4, params(16))
    records, kinds = [], []
    while engine.has_unfinished_requests():
        s = step()
        records += [r[2:5] + [r[6]] for r in s["steps"]]  # prefill, decode, sequences, new tokens
        kinds += [(seq["scheduled"], seq["kind"]) for seq in s["running"]] or [None]
        finished = s["finished"]
    assert records == [[12, 0, 1, 1], [0, 5, 1, 1], [0, 2, 1, 2], [0, 2, 1, 2], [0, 4, 1, 4], [0, 5, 1, 5],
                       [0, 1, 1, 1]]
    assert kinds == [(12, "prefill"), (5, "decode"), (2, "decode"), (2, "decode"), (4, "decode"), (5, "decode"), None]
    assert [(f["id"], f["output"]) for f in finished] == [("r", 16)]
    assert engine.spec_stats.num_draft_tokens == 4 + 1 + 1 + 3 + 4 and engine.spec_stats.num_accepted_tokens == 9


def test_a_tenant_sees_only_its_own_share_of_the_pool(tiny):
    """chapter 08's tenants, block_size 4, 16 blocks. a1 (tenant a) and b2 (tenant b) send the same 9-token prompt
    with the same cache_salt (the explicit way to share a prefix across tenants); b1 (tenant b) has 2 completions.
    Step 1: a1's prompt takes blocks 0, 1, 2; b1's takes 3 and 4 (partial), and its fork b1#1 shares both.
    Step 2: b2 hits a1's two full blocks; b1 and b1#1 write position 6 into block 4: b1 copies it into block 5,
    b1#1 keeps it; b2 computes its last prompt token in block 6."""
    from nanoserve.server.engine_view import tenant_view

    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4)))
    builder, step = stepper(engine)
    engine.add_request("a1", list(range(1, 10)), params(4), tenant="a", cache_salt="public")
    engine.add_request("b1", list(range(20, 26)), SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True),
                       tenant="b")
    step()
    engine.add_request("b2", list(range(1, 10)), params(4), tenant="b", cache_salt="public")
    s = step()
    free = ["free"] * 9
    assert owners(s) == ["shared:2", "shared:2", "a1", "shared:2", "b1#1", "b1", "b2"] + free
    assert s["pool"]["shared"] == {0: ["a1", "b2"], 1: ["a1", "b2"], 3: ["b1", "b1#1"]}
    # a: its own blocks, a1's alone (b2's share of 0 and 1 is b's to know); b1's fork-shared block 3 is "other" like
    # any other b block, and no list of who shares what reaches it
    a = tenant_view(s, "a")
    assert owners(a) == ["a1"] * 3 + ["other"] * 4 + free and "shared" not in a["pool"]
    # b: block 3 shared by its own two completions; 0 and 1 are b2's (a1's share is a's)
    assert owners(tenant_view(s, "b")) == ["b2", "b2", "other", "shared:2", "b1#1", "b1", "b2"] + free


class Untouchable:
    """Stands in for a queue that must not be read: any look at it raises."""

    def _touched(self, *args):
        raise AssertionError("observe_step read a queue")

    __iter__ = __len__ = __contains__ = __getitem__ = __getattr__ = _touched


def test_observing_a_step_reads_no_queue(tiny):
    """A watched step between two snapshots costs a look at each scheduled sequence and each output: it reads
    neither the waiting queue nor the table of every sequence, which grow under overload; the snapshot does."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_seqs=1)))
    builder = SnapshotBuilder(engine)
    for i in range(3):  # one seat: a runs, b and c wait
        engine.add_request("abc"[i], [1, 2, 3], params(2))
    outputs = engine.step()
    scheduler = engine.scheduler
    queues = scheduler.seqs, scheduler.waiting, scheduler.running
    scheduler.seqs = scheduler.waiting = scheduler.running = Untouchable()
    try:
        record = builder.observe_step(engine.last_scheduler_output, outputs, 0.001)
    finally:
        scheduler.seqs, scheduler.waiting, scheduler.running = queues
    assert record[2:5] == [3, 0, 1]
    s = builder.snapshot()
    assert [w["id"] for w in s["waiting"]] == ["b", "c"] and brief(s["running"]) == [("a", "running", 3, "prefill", 3, 4)]


def test_encode_pool_round_trips():
    pool = ["free", "x", "shared:2", "x", "cached", "free"]
    enc = encode_pool(pool)
    assert enc["owners"] == ["free", "x", "shared:2", "cached"]
    assert [enc["owners"][i] for i in enc["blocks"]] == pool


# ---- the feed: off, throttled, bounded ------------------------------------------------------------------
def test_feed_is_nearly_off_without_subscribers(tiny):
    """Nobody watching: no snapshot, no builder; only each step's record, in a ring of the last HISTORY_STEPS."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4)))
    feed = EventFeed()
    engine.add_request("a", [1, 2, 3], params(2))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        feed.record(engine, engine.last_scheduler_output, outputs, 0.002)
    assert not feed.watched and feed._builder is None and feed.flush(engine) is None
    # by hand: step 1 prefills the 3 prompt tokens (and samples 1, in block 0 of 4 tokens: 1/16 of the pool);
    # step 2 decodes 1 token and finishes, its block back in the pool
    assert [r[:1] + r[2:] for r in feed.history] == [[1, 3, 0, 1, 2.0, 1, 0.0625], [2, 0, 1, 1, 2.0, 1, 0.0]]


@pytest.mark.parametrize("k", [5, reference.HISTORY_STEPS + 7])
def test_a_viewer_connecting_after_k_steps_gets_the_last_min_k_n(tiny, k):
    """The page opened mid-run: its first snapshot carries the records of the last min(K, N) steps, the same
    records a builder that watched from the start wrote (times aside: each counts from its own origin)."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=160, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_batched_tokens=8)))
    feed, watcher = EventFeed(min_interval=0), SnapshotBuilder(engine)
    # two requests, chunked prefills of 8 tokens, then decodes: both kinds of record in the history
    engine.add_request("a", list(range(1, 21)), params(k))
    engine.add_request("b", list(range(1, 13)), params(k))
    for _ in range(k):
        outputs = engine.step()
        feed.record(engine, engine.last_scheduler_output, outputs, 0.001)
        watcher.observe_step(engine.last_scheduler_output, outputs, 0.001)
    sub = feed.subscribe()
    assert feed.flush(engine) is None  # the idle engine's loop: the new viewer gets the state now
    first = feed.with_history(sub.take())
    n = min(k, reference.HISTORY_STEPS)
    assert [r[0] for r in first["steps"]] == list(range(k - n + 1, k + 1)) and first["step"] == k
    expected = list(watcher.steps)[-n:]
    assert [r[:1] + r[2:] for r in first["steps"]] == [r[:1] + r[2:] for r in expected]
    assert first["steps"][0][2] == (8 if k < 10 else 0)  # 5 steps: the first is a prefill chunk; 247: a decode
    # later snapshots carry only their own steps, as before
    outputs = engine.step()
    feed.record(engine, engine.last_scheduler_output, outputs, 0.001)
    assert [r[0] for r in sub.take()["steps"]] == [k + 1]


def test_a_viewer_that_comes_after_an_idle_spell_starts_fresh(tiny):
    """A page closed, then opened again (or reloaded) while the engine is idle: the new viewer's first snapshot has
    none of the requests the earlier one saw finish, in its events or its latency window; only the step history
    (the timeline's) carries over."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4)))
    feed = EventFeed(min_interval=0)
    first = feed.subscribe()
    engine.add_request("a", [1, 2, 3, 4, 5], params(3))
    engine.add_request("b", [6, 7, 8, 9, 10], params(3))
    while engine.has_unfinished_requests():  # step 1 prefills both, steps 2 and 3 decode; both finish at step 3
        outputs = engine.step()
        feed.record(engine, engine.last_scheduler_output, outputs, 0.001)
    last = first.take()
    assert [f["id"] for f in last["finished"]] == ["a", "b"] and last["latency"]["requests"] == 2
    feed.unsubscribe(first)  # the page goes; the engine stays idle: no step, no record
    second = feed.subscribe()
    assert feed.flush(engine) is None  # the idle loop, woken by the new viewer, sends it the state at once
    snap = feed.with_history(second.take())
    assert snap["latency"] == {"requests": 0, "ttft_p50": None, "tpot_p50": None}  # not the first page's two
    assert snap["finished"] == snap["aborted"] == snap["preempted"] == [] and snap["tenants"] == {}
    assert snap["step"] == 3 and [r[0] for r in snap["steps"]] == [1, 2, 3]  # the timeline's history stays


def test_subscription_keeps_only_the_latest():
    woken = []
    sub = Subscription(notify=lambda: woken.append(1))
    for i in range(100):
        sub.put({"step": i})
    assert sub.take() == {"step": 99} and sub.dropped == 99
    assert woken == [1]  # one wake-up for a full mailbox, not one per snapshot
    assert sub.take() is None
    sub.put({"step": 100})
    assert woken == [1, 1]


def test_feed_throttles_and_flushes(tiny):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4)))
    feed = EventFeed(min_interval=3600)  # one snapshot an hour: everything after the first is held back
    sub = feed.subscribe()
    engine.add_request("a", [1, 2, 3], params(4))
    snaps = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        feed.record(engine, engine.last_scheduler_output, outputs, 0.001)
        snap = sub.take()
        if snap is not None:
            snaps.append(snap)
    assert [s["step"] for s in snaps] == [1]  # 4 steps, 1 snapshot
    assert 3500 < feed.flush(engine) <= 3600  # the idle loop is told how long to wait
    feed.min_interval = 0
    assert feed.flush(engine) is None  # sent now: nothing pending any more
    last = sub.take()
    # the held-back steps arrive as step records, with the finish: nothing is lost in between
    assert [r[0] for r in last["steps"]] == [2, 3, 4] and [f["id"] for f in last["finished"]] == ["a"]
    # 3 + 4 = 7 tokens: block 0 (positions 0..3) was full and hashed, block 1 was not
    assert owners(last) == ["cached"] + ["free"] * 15
    feed.unsubscribe(sub)
    assert not feed.watched


@pytest.mark.parametrize("end", ["the client leaves", "its step fails"])
def test_an_abort_that_leaves_the_engine_idle_reaches_the_page(tiny, end):
    """The real AsyncLLMEngine with one viewer on watch(), a snapshot after every step (min_interval 0, so nothing
    is pending when the request ends): a client that stops reading after 3 tokens (or a step that fails) aborts the
    only request between two steps. No step follows, yet the page's last frame must be the idle engine: the request
    aborted, no queue, no block held, KV usage 0 (not the frame before, with the request running)."""
    llm = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=128, block_size=4)))
    executor, real = llm.executor, llm.executor.execute_model
    outputs_seen = []

    def execute_model(scheduler_output):  # 5 ms a step: 400 tokens would take 2 s, the abort comes after 3
        time.sleep(0.005)
        if end == "its step fails" and len(outputs_seen) >= 3:
            raise RuntimeError("simulated kernel failure")
        return real(scheduler_output)

    executor.execute_model = execute_model
    engine = AsyncLLMEngine(llm)
    engine.event_feed.min_interval = 0

    async def main():
        engine.start()
        frames, ended = [], asyncio.Event()

        async def page():
            quiet = 0
            async for snap in engine.watch(keepalive=0.2):
                if snap is not None:
                    frames.append(snap)
                elif ended.is_set() and not llm.has_unfinished_requests():
                    quiet += 1  # 2 pings in a row with the engine idle: the page has its last frame
                    if quiet == 2:
                        return

        viewer = asyncio.create_task(page())
        try:
            async for out in engine.generate("a", [1, 2, 3, 4, 5], params(400)):
                outputs_seen.append(out)
                if len(outputs_seen) == 3 and end == "the client leaves":
                    break
        except EngineStepError:
            assert end == "its step fails"
        ended.set()
        await viewer
        return frames

    try:
        frames = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert any([r["id"] for r in f["running"]] == ["a"] for f in frames)  # the page saw it run
    last = frames[-1]
    assert last["aborted"] == ["a"] and last["running"] == [] and last["waiting"] == [] and last["finished"] == []
    assert set(owners(last)) <= {"free", "cached"} and last["pool"]["num_free"] == 128 and last["pool"]["usage"] == 0


def test_a_failing_view_never_stops_the_engine(tiny):
    """A bug in the snapshot code (say a learner's block_owners under --student) skips snapshots, with a warning."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4)))
    feed = EventFeed(min_interval=0)
    sub = feed.subscribe()

    def broken(*args):
        raise KeyError("a bug")

    feed._builder = SnapshotBuilder(engine, SimpleNamespace(block_owners=broken, step_kind=reference.step_kind))
    engine.add_request("a", [1, 2, 3], params(3))
    outputs = engine.step()
    with pytest.warns(UserWarning, match="event feed failed"):
        feed.record(engine, engine.last_scheduler_output, outputs, 0.0)
    assert sub.take() is None
    outputs = engine.step()  # the next step builds a fresh builder with the reference rules
    feed.record(engine, engine.last_scheduler_output, outputs, 0.0)
    assert owners(sub.take()) == ["a"] + ["free"] * 7  # 3 prompt tokens + 1 computed by step 2: one block


def test_a_view_opened_mid_run_counts_steps_from_the_engine_and_shows_the_streaming_latencies(tiny):
    """A page opened while requests run: its step numbers are the engine's (a user can match them to the engine's
    logs and to another page), and the latency panel already has the running requests' TTFT (and TPOT so far)."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=16, block_size=4)))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(3):  # nobody watching yet
        engine.step()
    builder, step = stepper(engine)
    s = step()
    assert s["step"] == 4 and [r[0] for r in s["steps"]] == [4]
    (seq,) = engine.scheduler.running
    ttft = seq.first_token_time - seq.arrival_time  # by hand, from the engine's own clock readings
    tpot = (seq.token_times[-1] - seq.token_times[0]) / (len(seq.token_times) - 1)  # 4 tokens so far
    assert len(seq.token_times) == 4 and s["latency"] == {"requests": 1, "ttft_p50": round(ttft, 6),
                                                            "tpot_p50": round(tpot, 6)}


def test_the_cost_benchmark_runs_the_three_systems_it_names(tiny):
    """`bench engine-view`'s run_once: every output token counted, one feed time per step; the closed feed keeps
    every step's record and builds nothing, the open one hands its viewer a snapshot per step (no throttle here)."""
    from nanoserve.bench.engine_view import run_once

    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4)))
    workload = [([1, 2, 3, 4, 5], 3), ([6, 7], 5)]  # prompts of 5 and 2 tokens, 3 and 5 tokens out: 5 steps
    seconds, tokens, per_step, encoded, steps = run_once(engine, workload)
    assert (tokens, per_step, encoded, steps) == (8, [], 0, 5)
    closed = EventFeed()
    _, tokens, per_step, encoded, steps = run_once(engine, workload, feed=closed)
    assert (tokens, len(per_step), encoded, steps) == (8, 5, 0, 5) and closed._builder is None
    assert [r[0] for r in closed.history] == [6, 7, 8, 9, 10] and [r[6] for r in closed.history] == [2, 2, 2, 1, 1]
    open_feed = EventFeed(min_interval=0)
    viewer = open_feed.subscribe()
    _, tokens, per_step, encoded, steps = run_once(engine, workload, feed=open_feed, viewer=viewer)
    assert (tokens, len(per_step), encoded, steps) == (8, 5, 5, 5)
