"""Chapter 12 — the engine after a step, as a small dict of numbers and ids: what the live page draws.

Everything here is read from state the engine already keeps (the scheduler's queues, each sequence's
counters, the block manager's tables, the prefix cache's stats); nothing is a tensor, and the engine's one count
for it is its steps (LLMEngine.num_steps). Worked example: block_size 4, a pool of 6 blocks, request "a" holds
blocks [0, 1], request "b" got a prefix hit on block 0 and holds [0, 2], block 3 keeps the contents of
a finished request (its hash is still in the prefix cache), blocks 4 and 5 were never written:

    block_owners({"a": [0, 1], "b": [0, 2]}, 6, cached_blocks={3})
    -> ["shared:2", "a", "b", "cached", "free", "free"]

One owner per block: "free" (on the free list, nothing worth keeping), "cached" (on the free list
too, but a prefix hit can revive it until the allocator hands it out again: the free list is least recently
freed first, cached or not), a request id (held by that one block table), or "shared:k" (held by k tables: a
prefix hit, or a fork).

`step_record` sums one step into eight numbers for the timeline (the event feed keeps the last
HISTORY_STEPS of them, watched or not, so a page opened mid-run starts with the recent past).
`SnapshotBuilder` turns steps into snapshots. `observe_step` runs after every step while someone
watches (cheap: a few integers per scheduled sequence); `snapshot` runs at most ~20 times a second
and adds the full picture: queues, pool, and the events and step records gathered since the last one.
"""

import sys
import time
from collections import deque

from nanoserve.engine.sequence import child_seq_id
from nanoserve.metrics import percentile

MAX_STEPS_PER_SNAPSHOT = 256  # step records kept between two snapshots; older ones are counted, not kept
HISTORY_STEPS = 240  # step records a viewer gets when it connects (the page's KV chart draws as many, its
# step timeline the newest 120)
LATENCY_WINDOW = 20  # finished requests in the snapshot's latency figures


def block_owners(block_tables: dict[str, list[int]], num_blocks: int, cached_blocks) -> list[str]:
    """The owner of every block of the pool, by block id (see the module docstring for the names).

    >>> block_owners({"x": [2]}, 3, cached_blocks={0})
    ['cached', 'free', 'x']
    """
    owners = ["free"] * num_blocks
    for block_id in cached_blocks:
        owners[block_id] = "cached"
    num_holders: dict[int, int] = {}  # held blocks only: past the one C-level fill above, the work grows
    # with the blocks in use (held or cached), not with the size of the pool
    for seq_id, table in block_tables.items():
        for block_id in table:
            k = num_holders[block_id] = num_holders.get(block_id, 0) + 1
            owners[block_id] = seq_id if k == 1 else f"shared:{k}"  # held wins over cached
    return owners


def shared_holders(block_tables: dict[str, list[int]]) -> dict[int, list[str]]:
    """The holders of every block in two tables or more, by block id: what a server needs to show a tenant its own
    shares (chapter 08's tenants) and no one else's.

    >>> shared_holders({"a": [0, 1], "b": [0, 2]})
    {0: ['a', 'b']}
    """
    holders: dict[int, list[str]] = {}
    for seq_id, table in block_tables.items():
        for block_id in table:
            holders.setdefault(block_id, []).append(seq_id)
    return {block_id: ids for block_id, ids in holders.items() if len(ids) > 1}


def encode_pool(owners: list[str]) -> dict:
    """Compact form for the wire: each distinct owner once, and one small int per block.

    >>> encode_pool(["free", "a", "a", "free"])
    {'owners': ['free', 'a'], 'blocks': [0, 1, 1, 0]}
    """
    index: dict[str, int] = {}
    blocks = [index.setdefault(owner, len(index)) for owner in owners]
    return {"owners": list(index), "blocks": blocks}


def step_kind(num_computed_before: int, num_scheduled: int, num_tokens_before: int, num_prompt_tokens: int) -> str:
    """"decode" when the step computes exactly one generated token, the sequence's last; else "prefill"
    (a prompt chunk, or the recompute of a preempted sequence, which re-prefills its outputs too; one the prefix
    cache covers up to its last token computes only that one: a decode).

    >>> step_kind(10, 1, 11, 10), step_kind(0, 8, 10, 10), step_kind(9, 1, 10, 10)
    ('decode', 'prefill', 'prefill')
    """
    last_token_only = num_scheduled == 1 and num_computed_before == num_tokens_before - 1
    return "decode" if last_token_only and num_computed_before >= num_prompt_tokens else "prefill"


def output_seq_id(out) -> str:
    """The sequence a RequestOutput is of: the request's own for completion 0, a fork's (n > 1) for the others."""
    return child_seq_id(out.request_id, out.index) if out.index else out.request_id


def step_record(engine, scheduler_output, outputs, step_seconds: float, t0: float, step_kind=step_kind):
    """One step summed up for the timeline, and what it gave each scheduled sequence:

        ([step, time since t0 (s), prefill tokens, decode tokens, sequences, step ms, new tokens, KV usage],
         {seq id: (tokens computed, "prefill" | "decode")})

    New tokens: the output tokens the step added, every completion's (n > 1: the forks' first ones too) and every
    accepted proposal (chapter 14). A verification computes the sequence's last token and its k proposals: a
    decode, its 1 + k tokens counted as decode tokens.
    Work: one look at each scheduled sequence and each output (at most max_num_seqs), none at the pool or the
    history."""
    new = {output_seq_id(out): len(out.new_token_ids) for out in outputs}
    proposals = scheduler_output.scheduled_spec_decode_tokens
    num_prefill = num_decode = 0
    kinds = {}
    for seq in scheduler_output.scheduled_seqs:
        n = scheduler_output.num_scheduled_tokens[seq.seq_id]
        k = len(proposals.get(seq.seq_id, ()))
        num_tokens_before = seq.num_tokens - new.get(seq.seq_id, 0)  # the step's new tokens are in num_tokens
        # a verification started one short of its known tokens (its counter is reset to the accepted ones since)
        computed_before = num_tokens_before - 1 if k else seq.num_computed_tokens - n
        kind = step_kind(computed_before, n - k, num_tokens_before, seq.num_prompt_tokens)
        kinds[seq.seq_id] = (n, kind)
        if kind == "decode":
            num_decode += n
        else:
            num_prefill += n
    bm = engine.block_manager
    record = [engine.num_steps, round(time.time() - t0, 4), num_prefill, num_decode,
              len(scheduler_output.scheduled_seqs), round(step_seconds * 1000, 3), sum(new.values()),
              round(1 - bm.get_num_free_blocks() / bm.num_blocks, 4)]
    return record, kinds


def _seq_view(seq, scheduled: int = 0, kind: str | None = None) -> dict:
    return {"id": seq.seq_id, "state": seq.status.value, "priority": seq.priority,
            "prompt": seq.num_prompt_tokens, "output": seq.num_output_tokens, "max_tokens": seq.max_tokens,
            "computed": seq.num_computed_tokens, "total": seq.num_tokens, "preemptions": seq.num_preemptions,
            "scheduled": scheduled, "kind": kind}


class SnapshotBuilder:
    def __init__(self, engine, rules=None, t0: float | None = None):
        """rules: the module whose block_owners and step_kind are used: this one, or the learner's
        exercises/12-engine-view/snapshot.py (EventFeed picks it when the engine runs with student=True).
        t0: the wall-clock origin of the snapshots' times (the feed's, so its history shares it); default now."""
        self.engine = engine
        self.rules = rules if rules is not None else sys.modules[__name__]
        self.step = engine.num_steps  # the engine's own count: a page opened mid-run shows the same
        self.t0 = time.time() if t0 is None else t0
        # ids alive at the last snapshot, and those scheduled since -> their tenant
        self._live: dict[str, str | None] = self._tenants()
        self._stats_seen = self._stats()
        self._reset_events()
        self._last_step: dict[str, tuple[int, str]] = {}  # seq id -> (tokens, kind) of the latest step
        self.recent: deque = deque(maxlen=LATENCY_WINDOW)  # (ttft, tpot) of the last finished completions, seconds

    def _tenants(self) -> dict[str, str | None]:
        return {seq_id: seq.tenant for seq_id, seq in self.engine.scheduler.seqs.items()}

    def _stats(self) -> tuple[int, int, int, int]:
        s = self.engine.block_manager.stats
        return s.queried_tokens, s.hit_tokens, s.hit_blocks, s.evicted_blocks

    def _reset_events(self) -> None:
        self.steps: deque[list] = deque()
        self.dropped_steps = 0
        self.preempted: list[str] = []
        self.finished: list[dict] = []
        self._ended: set[str] = set()  # the ids in self.finished

    def observe_step(self, scheduler_output, outputs, step_seconds: float) -> list:
        """After LLMEngine.step(): record the step's tokens and events. `outputs` are the step's RequestOutputs.
        Returns the step's record (step_record). Work: a look at each scheduled sequence and each output, none at
        the queues (a long waiting queue costs nothing here) or the pool."""
        record, self._last_step = step_record(self.engine, scheduler_output, outputs, step_seconds, self.t0,
                                              self.rules.step_kind)
        self.step = record[0]
        for seq in scheduler_output.scheduled_seqs:
            self._live[seq.seq_id] = seq.tenant
        for out in outputs:
            if out.finish_reason is None:  # each completion (n > 1) ends on its own; `finished` marks the last
                continue
            seq_id = output_seq_id(out)
            m = out.metrics
            self.finished.append({"id": seq_id, "reason": out.finish_reason, "ttft": m.get("ttft"),
                                  "tpot": m.get("tpot"), "e2e": m.get("e2e"), "output": len(out.token_ids)})
            self.recent.append((m.get("ttft"), m.get("tpot")))
            self._ended.add(seq_id)
            self._live.setdefault(seq_id, self._live.get(out.request_id))  # a fork that ended the step it was made
        self.preempted.extend(scheduler_output.preempted_seq_ids)
        self.steps.append(record)
        if len(self.steps) > MAX_STEPS_PER_SNAPSHOT:
            self.steps.popleft()
            self.dropped_steps += 1
        return record

    def latency(self) -> dict:
        """p50 TTFT and p50 TPOT (seconds; None before any) of the last LATENCY_WINDOW finished requests and of
        the running ones that have their first token (their TPOT so far), with chapter 09's percentile: a page
        opened while requests stream shows theirs at once. TPOT, not ITL: the engine's clock sees tokens, not
        a stream's chunks."""
        def p50(values):
            values = [v for v in values if v is not None]
            return round(percentile(values, 50), 6) if values else None

        live = [(seq.first_token_time - seq.arrival_time,
                 (seq.token_times[-1] - seq.token_times[0]) / (len(seq.token_times) - 1) if len(seq.token_times) > 1
                 else None) for seq in self.engine.scheduler.running if seq.first_token_time is not None]
        both = [*self.recent, *live]
        return {"requests": len(both), "ttft_p50": p50(t for t, _ in both), "tpot_p50": p50(t for _, t in both)}

    def snapshot(self) -> dict:
        """The engine now, plus what happened since the previous snapshot (then forgotten). An id that was alive
        at the last snapshot or scheduled since, is gone now and did not finish in a step was aborted (between
        steps); one that came and went between two snapshots without ever being scheduled is not seen."""
        engine, scheduler, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        live = self._tenants()
        gone = {seq_id: tenant for seq_id, tenant in self._live.items() if seq_id not in live}
        aborted = sorted(set(gone) - self._ended)
        running = [_seq_view(seq, *self._last_step.get(seq.seq_id, (0, None))) for seq in scheduler.running]
        waiting = [_seq_view(seq) for seq in scheduler.waiting]
        # a finished block keeps its K/V (and its hash) until the allocator hands it out again
        cached = getattr(bm.prefix_cache, "entries", ())
        owners = self.rules.block_owners(bm.block_tables, bm.num_blocks, cached)
        stats = self._stats()
        queried, hit, hit_blocks, evicted = (now - seen for now, seen in zip(stats, self._stats_seen))
        self._stats_seen = stats
        cfg = engine.config.scheduler_config
        snap = {
            "step": self.step, "time": round(time.time() - self.t0, 4),
            "config": {"block_size": bm.block_size, "num_blocks": bm.num_blocks, "max_num_seqs": cfg.max_num_seqs,
                       "max_num_batched_tokens": cfg.max_num_batched_tokens},
            "running": running, "waiting": waiting,
            "preempted": self.preempted, "finished": self.finished, "aborted": aborted,
            "prefix": {"queried_tokens": queried, "hit_tokens": hit, "hit_blocks": hit_blocks, "evicted_blocks": evicted},
            "pool": {**encode_pool(owners), "num_free": bm.get_num_free_blocks(),
                     "usage": round(1 - bm.get_num_free_blocks() / bm.num_blocks, 4),
                     # with tenants only (nobody else needs it): who shares each shared block, for tenant_view
                     **({"shared": shared_holders(bm.block_tables)} if any(live.values()) else {})},
            "steps": list(self.steps), "dropped_steps": self.dropped_steps,
            "latency": self.latency(),
            # chapter 08's tenants: whose each id above is (None: no tenant), so a server can show a tenant its own
            "tenants": {**gone, **live},
        }
        self._live = live
        self._reset_events()
        return snap
