"""Chapter 10 — degrading under overload, on a tiny random model and its int8 copy (fast).

Hand-computed expectations: with max_num_seqs=1 the queue length of every step is known, so is the mode
the hysteresis rule must pick (the queue rises and falls through the gap between its two thresholds); with degradation off (or never triggered) every output equals the plain
engine's, token for token, and carries no precision metrics.
"""

import copy

import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.model.quant import quantize_model
from nanoserve.sampling import SamplingParams
from tests.tiny_model import tiny_llama


@pytest.fixture(scope="module")
def models():
    model = tiny_llama()
    model.weight_format = "fp32"
    return model, quantize_model(copy.deepcopy(model), "int8")


REQUESTS = [[1 + i, 7, 9 + i, 3] for i in range(6)]


def run(engine, max_tokens=4):
    for i, prompt in enumerate(REQUESTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs, modes = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        modes.append((len(engine.scheduler.waiting), engine.degraded))
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks
    return outs, modes


def test_off_or_never_triggered_changes_nothing(models):
    fp32, int8 = models
    config = dict(num_blocks=32, block_size=4, max_num_seqs=1)
    plain, _ = run(LLMEngine(fp32, engine_config(**config)))
    assert all("token_precisions" not in o.metrics for o in plain.values())
    high, _ = run(LLMEngine(fp32, engine_config(**config, degrade_under_load=100), degraded_model=int8))
    assert {k: o.token_ids for k, o in high.items()} == {k: o.token_ids for k, o in plain.items()}
    assert all(o.metrics["token_precisions"] == ["fp32"] * 4 for o in high.values())


def test_switches_under_load_and_back_with_hysteresis(models):
    """The queue rises through 3 without reaching 4 (stays fp32), reaches 4 (degrades), then falls to 3 (stays
    degraded) and to 2 (back): only a rule with two thresholds gives that; `waiting > 2` alone degrades at the
    first 3, `waiting >= 4` alone comes back at the second."""
    fp32, int8 = models
    config = dict(num_blocks=32, block_size=4, max_num_seqs=1)
    engine = LLMEngine(fp32, engine_config(**config, degrade_under_load=4), degraded_model=int8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # each request: a prefill, a decode
    for i in range(4):
        engine.add_request(str(i), REQUESTS[i], params)
    outs, modes = {}, []
    while engine.has_unfinished_requests():
        if len(modes) == 1:  # request 0 runs its decode: a fifth request arrives, 4 now wait
            engine.add_request("4", REQUESTS[4], params)
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        modes.append((len(engine.scheduler.waiting), engine.degraded))
    # (requests waiting after scheduling, degraded?) step by step, by hand: one seat, two steps a request
    assert modes == [(3, False), (4, True), (3, True), (3, True), (2, False), (2, False),
                     (1, False), (1, False), (0, False), (0, False)]
    assert [outs[str(i)].metrics["token_precisions"] for i in range(5)] == \
        [["fp32", "int8"], ["int8", "int8"], ["fp32", "fp32"], ["fp32", "fp32"], ["fp32", "fp32"]]
    # a request computed wholly in fp32 gets exactly the tokens the plain engine gives it
    plain = LLMEngine(fp32, engine_config(**config))
    for i in range(5):
        plain.add_request(str(i), REQUESTS[i], params)
    while plain.has_unfinished_requests():
        outs.update((f"plain {o.request_id}", o) for o in plain.step() if o.finished)
    assert all(outs[str(i)].token_ids == outs[f"plain {i}"].token_ids for i in (2, 3, 4))


def test_threshold_and_copy_go_together(models):
    fp32, int8 = models
    with pytest.raises(ValueError, match="go together"):
        LLMEngine(fp32, EngineConfig(cache_config=CacheConfig(num_blocks=8), degrade_under_load=2))
    with pytest.raises(ValueError, match=">= 1"):
        LLMEngine(fp32, EngineConfig(cache_config=CacheConfig(num_blocks=8), degrade_under_load=0), degraded_model=int8)


def test_server_metrics_show_the_mode_and_the_tokens_served_degraded():
    """Through the real server: a burst on a 1-seat engine with a threshold of 2 degrades, the scrape says so
    while it lasts, and the per-precision counters equal what the steps ran (recorded here, step by step)."""
    import threading
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from nanoserve.server.runner import serving
    from nanoserve.text.tokenizer import Tokenizer

    model = tiny_llama(vocab_size=49152, max_position_embeddings=256)
    model.weight_format = "fp32"
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=16),
                                           scheduler_config=SchedulerConfig(max_num_seqs=1),
                                           degrade_under_load=2),
                       Tokenizer.from_gguf(), degraded_model=quantize_model(copy.deepcopy(model), "int8"))
    steps, step, server, seen = [], engine.step, {}, threading.Event()

    def recorded_step():  # the test's own account of every step: its mode and the tokens it generated
        time.sleep(0.005)  # a real model's pace, so that the burst queues up behind the one seat
        # Not left to timing on a loaded machine (bounded waits: a broken engine fails the asserts, not hangs):
        # the first step waits until the whole burst is handed over, so it queues up behind the one seat; and the
        # step after a degraded one waits until the test has scraped the degraded gauge (else a slow scrape could
        # miss the few degraded steps).
        deadline = time.monotonic() + 60
        while not steps and server["engine"].num_unfinished_requests() < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
        if steps and steps[-1][0] == "int8":
            seen.wait(60)
        outputs = step()
        steps.append((engine.precision, sum(len(o.new_token_ids) for o in outputs)))
        return outputs

    engine.step = recorded_step

    def scrape(url):
        return {(s.name, s.labels.get("precision")): s.value
                for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text) for s in f.samples}

    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with serving(engine, engine.tokenizer, model_name="tiny") as (url, srv):
        server["engine"] = srv.state.engine
        assert scrape(url)[("nanoserve:degraded", None)] == 0
        burst = [threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",), kwargs={"json": body, "timeout": 60})
                 for _ in range(6)]
        for t in burst:
            t.start()
        seen_degraded, deadline = False, time.monotonic() + 60
        try:
            while not seen_degraded and time.monotonic() < deadline:  # 5 of 6 wait at first: it must degrade
                seen_degraded = scrape(url)[("nanoserve:degraded", None)] == 1
        finally:
            seen.set()
        for t in burst:
            t.join()
        after = scrape(url)
    assert seen_degraded
    assert after[("nanoserve:degraded", None)] == 0  # the queue emptied: back to full precision
    served = {p: sum(n for q, n in steps if q == p) for p in ("fp32", "int8")}
    assert served["int8"] > 0 and served["fp32"] > 0 and sum(served.values()) == 6 * 6
    for p, n in served.items():
        assert after[("nanoserve:generation_tokens_by_precision_total", p)] == n
    assert after[("nanoserve:generation_tokens_total", None)] == 36


def test_bench_degrade_summary_by_hand():
    """bench degrade's figures from lockstep's [(clock, outputs)]: TTFT = the clock of a request's first output,
    tok/s over the last clock, the q4 share from token_precisions, agreement up to the first divergence."""
    from nanoserve.bench.degrade import summarize
    from nanoserve.engine.llm_engine import RequestOutput

    def out(rid, tokens, finished, precisions=()):
        return RequestOutput(rid, [1], tokens, tokens[-1:], "", "", finished, "length" if finished else None,
                             {"token_precisions": list(precisions)} if finished else {})

    steps = [(0.5, [out("a", [7], False)]),
             (1.0, [out("a", [7, 8], True, ["q4", "q4"]), out("b", [5], False)]),
             (2.0, [out("b", [5, 9], True, ["q4", "fp32"])])]
    row, tokens = summarize(steps, reference={"a": [7, 8], "b": [5, 6]})
    assert tokens == {"a": [7, 8], "b": [5, 9]}
    # the two first tokens came at 0.5 and 1.0; percentiles interpolate between ranks (nanoserve.metrics)
    assert row["ttft_p50"] == 0.75 and row["ttft_p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert row["tok_s"] == 4 / 2.0 and row["degraded"] == 3 / 4
    assert row["agreement"] == (2 + 1) / 4 and row["identical"] == 1


def test_lockstep_alternates_which_engine_steps_first():
    """bench weights' and bench degrade's lockstep: every engine one step per round, the round's order reversed
    every other round (so no engine always runs first, on a machine that drifts), each engine stepped until idle."""
    from types import SimpleNamespace

    from nanoserve.bench.weights import lockstep

    order = []

    class Engine:  # steps left for its one request; a step is one decode token
        def __init__(self, name):
            self.name, self.left = name, 0
            self.last_scheduler_output = SimpleNamespace(total_num_scheduled_tokens=1, scheduled_seqs=[0])

        def add_request(self, rid, prompt, params):
            self.left = params.max_tokens

        def has_unfinished_requests(self):
            return self.left > 0

        def step(self):
            order.append(self.name)
            self.left -= 1
            return []

    times = lockstep({n: Engine(n) for n in ("a", "b", "c")}, [([1, 2], 4)])
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}


@pytest.mark.parametrize("weights", ["int9", "bf16"])
def test_bench_weights_refuses_unknown_weights_before_loading(weights):
    """An unknown format, and bf16, which has no small-step kernel to time (bench linear --formats compares it):
    one error: line, exit 2, before any model loads."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "nanoserve", "bench", "weights", "--weights", "fp32", weights],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: argument --weights: invalid choice: '{weights}' (choose from 'fp32', 'int8', 'q4') "
        "(see python -m nanoserve bench weights --help)"]
