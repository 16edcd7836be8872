"""Chapter 12's worked examples, computed by the code: the pool `make serve` gives the page, the feed's constants
(history, latency window, throttle, streams per tenant), the page's headers, and the snapshot of the notebook's
scripted schedule (rebuilt here on the tiny model: with EOS ignored the schedule does not depend on the weights) are
built from nanoserve/ and must appear in the chapter word for word; the timings the chapter quotes from that snapshot
and the snapshot's size must be what the committed notebook printed, and the ratios drawn from the cost tables are
recomputed from them."""

import json
import re

import pytest
import torch

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine.event_feed import EventFeed
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.snapshot import HISTORY_STEPS, LATENCY_WINDOW, SnapshotBuilder
from nanoserve.kv.paged_attention import num_blocks_for_budget
from nanoserve.model import LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.server.engine_view import MAX_EVENT_STREAMS, PAGE_HEADERS
from tests.chapter_text import ROOT, chapter, notebook_output, says, table_rows, word
from tests.test_ch08_worked_examples import served_pool_blocks, serve_defaults
from tests.tiny_model import tiny_llama

CH = "12"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def scripted():
    """The notebook's scripted schedule (cell 3): its snapshots, one per step."""
    engine = LLMEngine(tiny_llama(), EngineConfig(cache_config=CacheConfig(num_blocks=12, block_size=4),
                                                  scheduler_config=SchedulerConfig(max_num_batched_tokens=16)))
    arrivals = {1: [("A", list(range(1, 11)), 8), ("B", list(range(1, 9)) + [40, 41], 6)],
                2: [("C", list(range(60, 80)), 6)], 4: [("D", [90, 91, 92], 10)]}
    builder, snaps = SnapshotBuilder(engine), []
    with torch.inference_mode():
        for step in range(1, 40):
            for rid, prompt, n in arrivals.get(step, []):
                engine.add_request(rid, prompt, greedy(n))
            if not engine.has_unfinished_requests():
                break
            outputs = engine.step()
            builder.observe_step(engine.last_scheduler_output, outputs, 0.0)
            snaps.append(builder.snapshot())
    return snaps


def test_make_serves_pool():
    args = serve_defaults()
    blocks = served_pool_blocks(args)
    says(CH, f"With `make serve`'s {args.kv_cache_mib // 1024} GiB pool ({blocks:,} blocks of {args.block_size} tokens in "
             f"{args.kv_cache_dtype}) a burst")
    fp32 = num_blocks_for_budget(LlamaConfig(), 2**30)
    says(CH, f"a {fp32:,}-block pool — the one SmolLM2 gets from 1 GiB in float32")
    says(CH, f"on a {fp32:,}-block pool (SmolLM2's\n1 GiB in float32)")


def test_the_quoted_pool_runs_out_under_the_pages_burst():
    """The chapter's small pool, under the page's Burst as engine.js sends it (its default count and max tokens, the
    chat message it writes, 5 at a time: a browser's 6 connections less the event stream), every reply running to
    its max tokens (EOS ignored: SmolLM2's replies mostly do, at 48): the pool fills and requests are preempted."""
    from nanoserve.text.tokenizer import Tokenizer

    html = (ROOT / "nanoserve/server/static/engine.html").read_text()
    count = int(re.search(r'id="burst-n"[^>]*value="(\d+)"', html)[1])
    max_tokens = int(re.search(r'id="max-tokens"[^>]*value="(\d+)"', html)[1])
    js = (ROOT / "nanoserve/server/static/engine.js").read_text()
    assert "chatBody(`Request ${i + 1}: tell me a story.`, false)" in js
    says(CH, "so 5 burst requests run at a\ntime")
    num_blocks = int(re.search(r"start the server with `--num-blocks (\d+)` to see the pool run out", chapter(CH))[1])
    block_size = serve_defaults().block_size
    tokenizer = Tokenizer.from_gguf()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"Request {i + 1}: tell me a story."}])
               for i in range(count)]
    engine = LLMEngine(tiny_llama(vocab_size=49152), EngineConfig(cache_config=CacheConfig(num_blocks=num_blocks,
                                                                                       block_size=block_size)))
    queue, in_flight, preempted = list(enumerate(prompts)), 0, []
    with torch.inference_mode():
        while queue or engine.has_unfinished_requests():
            while queue and in_flight < 5:
                i, prompt = queue.pop(0)
                engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                in_flight += 1
            in_flight -= sum(out.finished for out in engine.step())
            preempted += engine.last_scheduler_output.preempted_seq_ids
    # by hand: 39-token prompts whose first 16 tokens (one block, of 26 alike) are shared; five of them hold
    # 1 + 5 x 3 = 16 blocks from 49 to 64 tokens each, and a 65th token (the 26th generated) asks for a fifth block
    assert [len(p) for p in prompts] == [39] * count and (count, max_tokens, block_size, num_blocks) == (8, 48, 16, 16)
    alike = next(i for i in range(39) if len({p[i] for p in prompts}) > 1)
    assert alike // block_size == 1
    says(CH, "The Burst's chats have 39 prompt tokens each, the first 16 (one block) the same for all")
    says(CH, f"the Burst preempts {len(preempted)} times")
    assert len(preempted) == 4


def test_the_feeds_constants():
    says(CH, f"the page starts with the last {HISTORY_STEPS} step records")
    drawn = int(re.search(r"state\.steps\.slice\(-(\d+)\)", (ROOT / "nanoserve/server/static/engine.js").read_text())[1])
    says(CH, f"the step timeline draws the newest {drawn} of them, the KV-usage chart all {HISTORY_STEPS}")
    says(CH, f"over the last {LATENCY_WINDOW}\nrequests that finished since the page connected")
    says(CH, f"a `deque(maxlen={HISTORY_STEPS})` that drops its oldest")
    feed = EventFeed()
    assert feed.history.maxlen == HISTORY_STEPS
    rate = round(1 / feed.min_interval)
    says(CH, f"at most once per `min_interval` = {feed.min_interval * 1000:.0f} ms (R = {rate} a second)")
    says(CH, f"the snapshots' as `min({rate}/s, 1/step time)` falls below {rate} a second")
    says(CH, f"a tenant holds at most {word(MAX_EVENT_STREAMS)} streams at once")


def test_the_pages_headers():
    says(CH, f"`Content-Security-Policy: {PAGE_HEADERS['Content-Security-Policy']}` and `X-Frame-Options: "
             f"{PAGE_HEADERS['X-Frame-Options']}`")


def test_the_snapshot_of_step_2(scripted):
    snap = scripted[1]
    text = chapter(CH)
    quoted = text.split('```text {"step": 2', 1)[1].split("```", 1)[0]
    assert snap["step"] == 2
    for key in ("config", "prefix"):
        assert f'"{key}": {json.dumps(snap[key])}' in quoted, key
    running = json.dumps(snap["running"][0])
    assert f'"running": [{running[:-1].rsplit(", ", 1)[0]}' in quoted or f'"running": [{running}' in quoted
    owners, blocks = snap["pool"]["owners"], snap["pool"]["blocks"]
    assert f'"pool": {{"owners": {json.dumps(owners)}, "blocks": {json.dumps(blocks)}, ...}}' in quoted
    step, _, prefill, decode, seqs, _, new_tokens, usage = snap["steps"][0]
    quoted_step = re.search(r'"steps": \[\[(.*?)\]\]', quoted)[1].split(", ")
    assert [quoted_step[i] for i in (0, 2, 3, 4, 6, 7)] == [str(v) for v in (step, prefill, decode, seqs, new_tokens, usage)]
    assert f'"tenants": {json.dumps(snap["tenants"])}' in quoted
    assert re.search(rf'"latency": {{"requests": {snap["latency"]["requests"]}, ', quoted)
    # the times are the notebook run's: what its cell printed, rounded as the chapter writes them
    out = notebook_output(CH)
    time, ms = re.search(r"steps \[\[2, ([\d.]+), \d+, \d+, \d+, ([\d.]+),", out).groups()
    ttft, tpot = re.search(r'"ttft_p50": ([\d.]+), "tpot_p50": ([\d.]+)', out).groups()
    assert quoted_step[1] == time and quoted_step[5] == f"{float(ms):.1f}"
    snap_time = re.search(r"snapshot of step 2: \d+ bytes of JSON step 2 time ([\d.]+) config", out)[1]
    assert quoted.startswith(f', "time": {snap_time},')  # the snapshot's own time, not only its step record's
    assert f'"ttft_p50": {float(ttft):.3f}, "tpot_p50": {float(tpot):.4f}' in quoted


def test_the_notebook_printed_the_snapshot_the_code_builds(scripted):
    printed = re.findall(r"^  (\w+) ", "\n".join(
        line for line in json.loads((ROOT / "notebooks/12-engine-view.ipynb").read_text())["cells"][5]["outputs"][0]["text"]),
        re.M)
    assert printed == list(scripted[1])


def test_a_snapshots_size_on_a_large_pool():
    out = notebook_output(CH)
    size, ms = re.search(r"([\d,]+) bytes of JSON, ([\d.]+) ms to build and encode", out).groups()
    rate = int(re.search(r"at 20 snapshots/s: (\d+) KiB/s", out)[1])
    says(CH, f"with 11 requests running, the notebook measures {size} bytes of JSON and {float(ms):.1f} ms to build and "
             f"encode one")
    says(CH, f"i.e. about {round(rate, -1)} KiB/s to the page")


def big_snapshot(num_blocks: int) -> dict:
    """The notebook's last cell: 24 requests of 200 tokens on a pool of blocks of 16, one step (11 of them run)."""
    big = LLMEngine(tiny_llama(), EngineConfig(cache_config=CacheConfig(num_blocks=num_blocks, block_size=16)))
    for i in range(24):
        big.add_request(str(i), [(7 * i + j) % 256 for j in range(200)], greedy(4))
    with torch.inference_mode():
        big.step()
    snap = SnapshotBuilder(big).snapshot()
    assert len(snap["running"]) == 11
    return snap


def size(obj) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


def test_the_notebooks_snapshot_size_is_the_codes():
    """The notebook's last cell, rebuilt: the same pool and requests; only the times' digits may differ a little."""
    printed = int(re.search(r"([\d,]+) bytes of JSON, [\d.]+ ms to build", notebook_output(CH))[1].replace(",", ""))
    assert abs(size(big_snapshot(1456)) - printed) <= 20


def test_the_served_pools_snapshot_size():
    """The same requests on `make serve`'s pool (2,912 bf16 blocks): each block more is free, "11," in the pool part
    (the free blocks' owner comes after the 11 running requests' names): 3 bytes a block; the rest stays. The chapter
    quotes the whole."""
    fp32, served = num_blocks_for_budget(LlamaConfig(), 2**30), served_pool_blocks(serve_defaults())
    small, large = big_snapshot(fp32), big_snapshot(served)
    assert large["pool"]["owners"] == small["pool"]["owners"] and small["pool"]["owners"].index("free") == 11
    assert size(large["pool"]) - size(small["pool"]) == 3 * (served - fp32)
    whole = size(large)
    assert abs(size(small) + 3 * (served - fp32) - whole) <= 20  # the times' digits
    says(CH, f"The page `make serve` opens reads its {served:,}-block bf16 pool: the same 11 requests' snapshot there is "
             f"about {round(whole, -2):,} bytes, some {round(20 * whole / 1024, -1):.0f} KiB/s at 20 a second")


def test_the_cost_tables_ratios():
    rows = [r for r in table_rows(CH, "no feed|page closed|page open") if "×" in r[2]]
    assert len(rows) == 3  # the tiny model's table; SmolLM2's gives no ratio (its whole-run rates are noise)
    runs = lambda cell: cell.split(" / ")  # noqa: E731  the tiny model's cells hold two runs, "first / second"
    assert rows[0][2] == "×1.000"
    for r in rows[1:]:
        for rate, ratio, base in zip(runs(r[1]), runs(r[2]), runs(rows[0][1]), strict=True):
            rate, ratio, e = float(rate), float(ratio.lstrip("×")), 0.5 * 10 ** -len(rate.split(".")[1])
            base = float(base)  # e: what the printed rates' rounding allows
            assert (rate - e) / (base + e) - 5e-4 <= ratio <= (rate + e) / (base - e) + 5e-4, r
    smol = {r[0]: float(r[1]) for r in table_rows(CH, "no feed|page closed|page open") if "×" not in r[2]}
    assert smol["no feed"] < smol["page closed"]  # what makes its rates noise:
    says(CH, "the bare loop cannot be slower than itself plus a record")
