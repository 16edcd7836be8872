"""Chapter 06 — the engine's request handling (tiny random model) and the offline API and batch CLI
(real model): abort, stops, metrics, input forms, output order, malformed lines."""

import json

import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama


def assert_pool_whole(engine):
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_abort_frees_blocks_at_once_running_or_waiting(tiny):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4),
                                          scheduler_config=SchedulerConfig(max_num_seqs=1)))
    engine.add_request("run", list(range(1, 10)), greedy(5))
    engine.add_request("wait", [1, 2, 3], greedy(5))
    engine.step()
    assert engine.block_manager.get_num_free_blocks() == 8 - 3  # 9 prompt tokens + 1 = 3 blocks of 4
    out = engine.abort_request("run")
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 1
    assert_pool_whole(engine)  # the same step, not the next one
    assert engine.abort_request("wait").finish_reason == "abort"
    assert engine.abort_request("unknown") is None
    assert not engine.has_unfinished_requests()
    assert engine.step() == []  # an empty step is fine
    assert_pool_whole(engine)


def test_eos_and_stop_ids_and_length(tiny):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4)))
    engine.add_request("probe", [5, 6, 7], greedy(8))
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    probe = out.token_ids
    assert out.finish_reason == "length" and len(probe) == 8
    # the first token that did not appear before it: stopping on it must keep exactly probe[:k + 1]
    k = next(i for i, t in enumerate(probe) if t not in probe[:i] and i > 0)
    # the same prompt, now stopping on tokens it is known to produce
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=4)), eos_token_id=probe[0])
    engine.add_request("eos", [5, 6, 7], greedy(8))
    engine.add_request("ignore", [5, 6, 7], greedy(8, ignore_eos=True))
    engine.add_request("stop-id", [5, 6, 7], greedy(8, ignore_eos=True, stop_token_ids=[probe[k]]))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert (done["eos"].finish_reason, done["eos"].token_ids) == ("stop", probe[:1])
    assert (done["ignore"].finish_reason, done["ignore"].token_ids) == ("length", probe)
    assert (done["stop-id"].finish_reason, done["stop-id"].token_ids) == ("stop", probe[:k + 1])
    assert_pool_whole(engine)


def test_refuses_requests_that_could_never_run(tiny):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=4, block_size=4)))
    with pytest.raises(ValueError, match="can never fit"):
        engine.add_request("big", list(range(10)), greedy(10))
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [1] * 500, greedy(20))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", [[], [1, 256], [-1, 2], [1, "2"], [1.0]])
def test_refuses_bad_token_ids_and_keeps_serving(tiny, bad):
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=8, block_size=4)))  # the tiny vocabulary is 256
    with pytest.raises(ValueError, match=r"prompt_token_ids.*\[0, 256\)"):
        engine.add_request("bad", bad, greedy(2))
    engine.add_request("good", [1, 2, 3], greedy(2))
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert_pool_whole(engine)


# ---- the offline API, on the real model ---------------------------------------------------------

@pytest.fixture(scope="module")
def llm(smollm2):
    from nanoserve.llm import LLM

    return LLM(smollm2, num_blocks=256)


@pytest.mark.slow
def test_generate_takes_every_input_form_and_keeps_the_order(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = ["Once upon a time", chat, {"prompt_token_ids": llm.tokenizer.encode("1, 2, 3, 4,")}, "The sky is"]
    outs = llm.generate(inputs, [greedy(12), greedy(20), greedy(8), greedy(5)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.prompt_token_ids(x) for x in inputs]
    assert outs[1].prompt_token_ids == llm.tokenizer.encode_chat(chat)
    for out in outs:
        assert out.finished and out.finish_reason in ("stop", "length")
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        m = out.metrics
        assert 0 <= m["queue_time"] <= m["ttft"] <= m["e2e"]
        assert len(m["itl"]) == len(out.token_ids) - 1
    assert [len(o.token_ids) for o in (outs[0], outs[2], outs[3])] == [12, 8, 5]
    assert llm.generate("The sky is", greedy(5), use_tqdm=False)[0].token_ids == outs[3].token_ids
    assert_pool_whole(llm.engine)


@pytest.mark.slow
def test_stop_string_cuts_the_text(llm):
    (full,) = llm.generate("The river wound slowly through the", greedy(24, ignore_eos=True), use_tqdm=False)
    words = full.text.split()
    assert len(words) > 4
    stop = " " + words[3]
    (cut,) = llm.generate("The river wound slowly through the", greedy(24, ignore_eos=True, stop=[stop]), use_tqdm=False)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert_pool_whole(llm.engine)


@pytest.mark.slow
def test_generate_names_the_bad_input(llm):
    with pytest.raises(ValueError, match="input 1"):
        llm.generate(["fine", {"nothing": 1}], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="sampling_params 1: expected a SamplingParams, got dict"):
        llm.generate(["fine", "also fine"], [greedy(4), {"temperature": 0}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_batch_cli_keeps_order_and_reports_bad_lines(llm, tmp_path, monkeypatch, capsys):
    from nanoserve.cli import batch, main

    monkeypatch.setattr(batch, "llm_from_args", lambda args, tokenizer=None: llm)
    monkeypatch.setattr(batch.checks, "load_tokenizer", lambda path: llm.tokenizer)
    lines = [
        json.dumps({"prompt": "The sky is", "max_tokens": 5, "temperature": 0, "id": "a"}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}),
        json.dumps({"prompt": "x", "max_token": 5}),
        json.dumps({"prompt": "x", "temperature": -1}),
        json.dumps({"prompt_token_ids": [504, 3458], "max_tokens": 3, "seed": 1}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["batch", "--input", str(src), "--output", str(dst), "--no-progress"]) == 1
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [("error" in r) for r in records] == [False, True, False, True, True, False]
    assert "max_token" in records[3]["error"] and "temperature" in records[4]["error"]
    assert records[0]["id"] == "a" and records[0]["token_ids"] == llm.generate("The sky is", greedy(5), use_tqdm=False)[0].token_ids
    assert len(records[5]["token_ids"]) == 3 and records[5]["finish_reason"] == "length"
    assert set(records[2]) >= {"prompt_token_ids", "token_ids", "text", "finish_reason", "metrics"}
    err = capsys.readouterr().err
    assert "in.jsonl:2:" in err and "in.jsonl:4:" in err and "in.jsonl:5:" in err
    assert_pool_whole(llm.engine)


def test_batch_cli_reads_a_file_that_starts_with_a_utf8_bom(tiny, tmp_path, monkeypatch):
    """Editors on Windows write a byte-order mark (EF BB BF) before the first line: it is not part of the JSON."""
    from nanoserve.cli import batch, main
    from nanoserve.llm import LLM

    monkeypatch.setattr(batch, "llm_from_args", lambda args, tokenizer=None: LLM(tiny, num_blocks=16, block_size=4))
    monkeypatch.setattr(batch.checks, "load_tokenizer", lambda path: type("T", (), {"vocab_size": 64})())
    monkeypatch.setattr(batch.checks, "context_length", lambda path: 64)
    lines = [json.dumps({"prompt_token_ids": [5, 9, 2], "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
             json.dumps({"prompt_token_ids": [7, 1], "max_tokens": 2, "temperature": 0, "ignore_eos": True})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())
    assert main(["batch", "--input", str(src), "--output", str(dst), "--no-progress"]) == 0
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2] and not any("error" in r for r in records)
    assert [len(r["token_ids"]) for r in records] == [3, 2] and records[0]["prompt_token_ids"] == [5, 9, 2]


@pytest.mark.parametrize("prefix_caching, recomputed", [(True, 5), (False, 13)])
def test_readmission_after_preemption_recomputes_only_the_uncached_tail(tiny, prefix_caching, recomputed):
    """Worked by hand, block_size 4, a 6-block pool; A and B: 8-token prompts, 8 new tokens each.
    Step 1 prefills both (2 blocks each); step 2 decodes position 8, so each takes its 3rd block: the pool is
    full. Steps 2-5 decode positions 8-11.
    Step 6: A's position 12 needs a 4th block: B (later arrival) is preempted with 13 tokens (8 + 5 generated);
    its blocks go to the free list tail-first, so A's new block evicts B's [8, 12) and B's [0, 4), [4, 8) stay
    cached. After A finishes B returns: with prefix caching it hits its own 2 freed blocks and recomputes
    13 - 8 = 5 tokens; without, all 13. Either way B's tokens are those of a pool that never preempts."""
    done, scheduled_b = two_requests(tiny, 6, prefix_caching, greedy(8, ignore_eos=True))
    assert scheduled_b == [8, 1, 1, 1, 1, "preempted", 0, 0, recomputed, 1, 1]
    assert done == two_requests(tiny, 64, prefix_caching, greedy(8, ignore_eos=True))[0]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_seeded_sampled_request_draws_the_same_tokens_across_a_preemption(tiny, prefix_caching):
    """The worked example above, sampled (temperature 1, a seed per request): a sequence's generator lives with it
    through the preemption, and the recompute samples only at its last token, so B draws, token for token, what it
    draws in a pool that never preempts."""
    params = {rid: SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
              for rid, seed in (("A", 1), ("B", 2))}
    done, scheduled_b = two_requests(tiny, 6, prefix_caching, params)
    assert "preempted" in scheduled_b
    assert done == two_requests(tiny, 64, prefix_caching, params)[0]
    assert done["A"] != done["B"]  # sampled, not a greedy repeat


def two_requests(tiny, num_blocks, prefix_caching, params):
    """A and B, 8-token prompts of their own, through a pool of `num_blocks` blocks of 4 (params: one for both, or
    {request id: params}). Returns ({request id: token ids}, what B did each step: tokens scheduled or "preempted")."""
    engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=num_blocks, block_size=4,
                                                                   enable_prefix_caching=prefix_caching)))
    for rid, first in (("A", 10), ("B", 20)):
        engine.add_request(rid, list(range(first, first + 8)), params[rid] if isinstance(params, dict) else params)
    done, scheduled_b = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        plan = engine.last_scheduler_output
        scheduled_b.append(plan.num_scheduled_tokens.get("B", 0) if "B" not in plan.preempted_seq_ids else "preempted")
    assert_pool_whole(engine)
    return done, scheduled_b
