"""Chapter 09 — `bench mlperf`: MLPerf's LoadGen drives the SUT over the tiny model (the real tokenizer and the
committed prompt set). Short runs: the point is the contract (every query LoadGen issues answered, a first
token and an end for each, the accuracy log holding the ids), never the speed."""

import pytest

mlperf_loadgen = pytest.importorskip(
    "mlperf_loadgen", reason="MLPerf's LoadGen is missing: `make setup` installs it (requirements.txt), or "
                             "`.venv/bin/pip install mlcommons-loadgen`")

from nanoserve.bench import mlperf  # noqa: E402
from nanoserve.bench.mlperf_data import load_samples  # noqa: E402
from nanoserve.bench.mlperf_sut import SUT, Completion, engine_generator, openai_generator  # noqa: E402
from nanoserve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine.llm_engine import LLMEngine  # noqa: E402
from tests.tiny_model import tiny_llama  # noqa: E402

SHORT = {"Offline": 16, "Server": 12, "SingleStream": 6}  # min_query_count of each scenario's short run
FEW = 12  # accuracy-mode runs play the first 12 samples (all 3 kinds), each once: what 64 prove, in a fifth of the time


@pytest.fixture(scope="module")
def tokenizer():
    from nanoserve.bench.serve import model_tokenizer

    return model_tokenizer()


@pytest.fixture(scope="module")
def samples():
    return load_samples()


@pytest.fixture(scope="module")
def few(samples):
    assert {s["kind"] for s in samples[:FEW]} == {"chat", "document", "system"}
    return samples[:FEW]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=49152, max_position_embeddings=1024)


def new_engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=600, block_size=16),
                                        scheduler_config=SchedulerConfig(max_num_seqs=8)), tokenizer)


@pytest.fixture(scope="module")
def async_engine(tiny, tokenizer):
    engine = AsyncLLMEngine(new_engine(tiny, tokenizer))
    engine.start()
    yield engine
    engine.shutdown()


class Counting:
    """Wraps a generate(): the sample indices handed to it."""

    def __init__(self, generate):
        self.generate, self.started = generate, []

    async def __call__(self, sample, on_first):
        self.started.append(sample["index"])
        return await self.generate(sample, on_first)


@pytest.fixture
def stamps(monkeypatch):
    """Every query id the SUT hands to LoadGen's FirstTokenComplete and QuerySamplesComplete (then passed on),
    and in `sizes` each (bytes, n_tokens) of the end's responses, by query id."""
    calls = {"FirstTokenComplete": [], "QuerySamplesComplete": [], "sizes": {}}
    for name in ("FirstTokenComplete", "QuerySamplesComplete"):
        real, seen = getattr(mlperf_loadgen, name), calls[name]

        def spy(responses, *rest, real=real, seen=seen, name=name):
            seen.extend(r.id for r in responses)
            if name == "QuerySamplesComplete":
                calls["sizes"].update({r.id: (r.size, r.n_tokens) for r in responses})
            return real(responses, *rest)

        monkeypatch.setattr(mlperf_loadgen, name, spy)
    return calls


def short_settings(scenario, mode="performance", qps=40.0):
    return mlperf.test_settings(scenario, mode, 0.2, SHORT[scenario], qps=qps if scenario == "Server" else None)


def test_the_prompt_set_is_varied_and_carries_its_references(samples, tokenizer):
    assert 64 <= len(samples) <= 128
    lengths = [len(s["prompt_token_ids"]) for s in samples]
    assert min(lengths) < 100 and max(lengths) > 400  # short chats and long documents
    assert {s["kind"] for s in samples} == {"chat", "document", "system"}
    for s in samples:
        assert 1 <= len(s["reference_token_ids"]) <= s["max_tokens"]
        assert tokenizer.decode(s["reference_token_ids"], skip_special_tokens=True) == s["reference_text"]
        assert len(s["prompt_token_ids"]) + s["max_tokens"] <= 1024  # fits the tiny model's context


@pytest.mark.parametrize("scenario", ["Offline", "Server", "SingleStream"])
def test_every_query_loadgen_issues_is_answered(scenario, samples, async_engine, stamps, tmp_path):
    counting = Counting(engine_generator(async_engine))
    with SUT(samples, counting) as sut:
        detail = mlperf.run_test(sut, short_settings(scenario), str(tmp_path))
    # Offline: one query of min_query_count samples; the others: one sample per query, at least min_query_count
    issued = SHORT["Offline"] if scenario == "Offline" else detail["result_query_count"]
    assert issued >= SHORT[scenario] and len(counting.started) == issued
    firsts, ends = stamps["FirstTokenComplete"], stamps["QuerySamplesComplete"]
    assert len(ends) == len(set(ends)) == issued  # every sample completed, once
    assert sorted(firsts) == sorted(ends)  # and its first token reported, once
    # the end carries n_tokens, LoadGen's TPOT divisor: one int32 per token of the answer
    assert all(n_tokens >= 1 and size == 4 * n_tokens for size, n_tokens in stamps["sizes"].values())
    assert sorted(n for _, n in stamps["sizes"].values()) == sorted(len(ids) for outs in sut.outputs.values()
                                                                     for ids in outs)
    assert sum(len(v) for v in sut.outputs.values()) == issued
    assert detail["failed_requests"] == 0 and not sut.failures
    if scenario == "Server":  # 12 queries: early stopping needs 459 with none over a limit (the chapter's arithmetic)
        assert detail["result_validity"] == "INVALID" and detail["early_stopping_met"] is False
    for index, outs in sut.outputs.items():  # greedy: every issue of a sample gave the same answer
        assert all(ids == outs[0] and 1 <= len(ids) <= samples[index]["max_tokens"] for ids in outs)
    assert (tmp_path / "mlperf_log_summary.txt").exists()


def test_the_accuracy_log_decodes_to_the_ids_the_engine_produced(few, tiny, tokenizer, async_engine, tmp_path):
    samples = few
    with SUT(samples, engine_generator(async_engine)) as sut:
        mlperf.run_test(sut, short_settings("Offline", "accuracy"), str(tmp_path))
    logged = mlperf.read_accuracy_log(str(tmp_path))
    assert sorted(logged) == list(range(len(samples)))  # accuracy mode: every sample once
    assert logged == {i: outs[0] for i, outs in sut.outputs.items()}
    # and those are the engine's greedy answers: the same prompts through a fresh engine, stepped directly
    from nanoserve.sampling import SamplingParams

    engine = new_engine(tiny, tokenizer)
    picks = [0, 1, 2, 9]  # a chat, a shared system prompt, two documents
    for i in picks:
        engine.add_request(str(i), samples[i]["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=samples[i]["max_tokens"]))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert {i: logged[i] for i in picks} == {i: finished[str(i)] for i in picks}
    result = mlperf.score(logged, samples, tokenizer)  # random weights: nothing like the oracle's answers
    assert result["samples"] == len(samples) and not result["passed"] and result["rouge_l"] < 0.5


def test_a_failed_request_is_still_completed_to_loadgen(few, async_engine, tmp_path):
    samples, real = few, engine_generator(async_engine)

    async def flaky(sample, on_first):
        if sample["index"] % 3 == 0:
            raise RuntimeError("connection reset")
        if sample["index"] % 3 == 1:
            return Completion([7, 8], 2, "aborted by the engine")  # partial output, then an abort
        return await real(sample, on_first)

    with SUT(samples, flaky) as sut:
        detail = mlperf.run_test(sut, short_settings("Offline", "accuracy"), str(tmp_path))
    logged = mlperf.read_accuracy_log(str(tmp_path))
    assert sorted(logged) == list(range(len(samples)))  # nothing dropped
    assert all(logged[i] == [] for i in range(0, len(samples), 3))
    assert all(logged[i] == [7, 8] for i in range(1, len(samples), 3))
    assert detail["failed_requests"] == len(sut.failures) == sum(1 for i in range(len(samples)) if i % 3 != 2)
    assert "RuntimeError: connection reset" in " ".join(sut.failures)
    perf = {"result_validity": "VALID", "failed_requests": 3}
    assert not mlperf.is_valid(perf) and "3 requests FAILED" in mlperf.verdict(perf)


def test_the_url_sut_measures_nanoserve_own_server(few, tiny, tokenizer, tmp_path):
    import asyncio

    import httpx

    from nanoserve.server.runner import serving

    samples = few
    with serving(new_engine(tiny, tokenizer), tokenizer, model_name="tiny") as (url, _):
        with SUT(samples, None) as sut:
            client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))
            counting = Counting(openai_generator(client, url, "tiny", tokenizer))
            sut.generate = counting
            detail = mlperf.run_test(sut, short_settings("Server"), str(tmp_path / "perf"))
            mlperf.run_test(sut, short_settings("Offline", "accuracy"), str(tmp_path / "acc"))
            asyncio.run_coroutine_threadsafe(client.aclose(), sut.loop).result()
    assert not sut.failures and detail["failed_requests"] == 0
    assert detail["result_query_count"] >= SHORT["Server"]
    assert len(counting.started) == detail["result_query_count"] + len(samples)  # then accuracy: each sample once
    logged = mlperf.read_accuracy_log(str(tmp_path / "acc"))
    assert sorted(logged) == list(range(len(samples)))
    # the server's greedy answers are the engine's: the same text as a direct run of the same prompts
    from nanoserve.sampling import SamplingParams

    engine = new_engine(tiny, tokenizer)
    for i in (4, 9):  # two documents, the shortest answers of the few
        engine.add_request(str(i), samples[i]["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=samples[i]["max_tokens"]))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.text for o in engine.step() if o.finished})
    assert {i: tokenizer.decode(logged[i]) for i in (4, 9)} == {i: finished[str(i)] for i in (4, 9)}


def test_rouge_l_the_peak_search_and_the_verdict_by_hand():
    # LCS("a b c d e", "a c e f") = "a c e" (3): P = 3/5, R = 3/4, F = 2PR / (P + R) = 2/3
    assert mlperf.rouge_l("a b c d e".split(), "a c e f".split()) == pytest.approx(2 / 3)
    assert mlperf.rouge_l([], []) == 1.0 and mlperf.rouge_l(["x"], []) == 0.0 and mlperf.rouge_l(["x"], ["y"]) == 0.0
    assert mlperf.words("The Cat, sat!") == ["the", "cat", "sat"]
    # VALID up to 3 qps: 1 ok, 2 ok, 4 no, then bisect 3 ok, 3.5 no
    assert mlperf.find_peak(lambda q: q <= 3.0, 1.0, 5) == (3.0, [(1.0, True), (2.0, True), (4.0, False),
                                                                   (3.0, True), (3.5, False)])
    # INVALID from the start: halve until VALID, then bisect
    assert mlperf.find_peak(lambda q: q <= 0.3, 1.0, 4) == (0.25, [(1.0, False), (0.5, False), (0.25, True),
                                                                    (0.375, False)])
    assert mlperf.find_peak(lambda q: False, 1.0, 2) == (None, [(1.0, False), (0.5, False)])
    # LoadGen's verdict in one line, with the reasons its detail log gives
    detail = {"result_validity": "INVALID", "result_perf_constraints_met": False, "result_min_duration_met": True,
              "early_stopping_met": False, "failed_requests": 0,
              "result_first_token_99.00_percentile_latency_ns": 7_100_000_000,
              "result_time_per_output_token_99.00_percentile_ns": 330_000_000}
    assert mlperf.verdict(detail) == "LoadGen: INVALID; TTFT p99 7.100 s, TPOT p99 330.0 ms; not met: latency limits, " \
                                     "early stopping"


@pytest.mark.parametrize("argv, fragment", [
    (["--scenario", "Offline", "--interactive"], "--interactive: only for --scenario Server"),
    (["--scenario", "Server", "--url", "http://x", "--weights", "q4"], "--weights: set(s) up nanoserve in-process"),
    (["--scenario", "Server", "--url", "ftp://x"], "--url must start with"),
    (["--scenario", "Server", "--mode", "accuracy"], "needs --target-qps"),
    (["--scenario", "Server", "--target-qps", "0"], "--target-qps must be a positive number"),
    (["--scenario", "Offline", "--model", "m"], "go with --url"),
    (["--scenario", "Offline", "--start-qps", "2"], "--start-qps: only for the Server search"),
    (["--scenario", "Server", "--target-qps", "1", "--max-tries", "3"], "--max-tries: only for the Server search"),
    (["--scenario", "Offline", "--mode", "accuracy", "--min-duration", "5"], "--min-duration: only for performance runs"),
])
def test_bad_flags_are_one_error_line_and_exit_2(argv, fragment, capsys):
    from nanoserve.cli import main

    assert main(["bench", "mlperf", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


def test_a_repeated_sample_is_computed_again_not_read_from_the_prefix_cache(few, tiny, tokenizer):
    """LoadGen issues each sample many times; each query's own cache_salt keeps a repeat from hitting the blocks
    its last issue left (the control: the same prompt twice without a salt is a hit)."""
    import asyncio

    import httpx

    from nanoserve.sampling import SamplingParams
    from nanoserve.server.runner import serving

    sample = few[4]  # a document: several full blocks

    async def twice(generate):
        for _ in range(2):
            await generate(sample, lambda ids: None)

    control = new_engine(tiny, tokenizer)
    for i in range(2):
        control.add_request(str(i), sample["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=1))
        while control.has_unfinished_requests():
            control.step()
    assert control.block_manager.stats.hit_tokens >= 16 * (len(sample["prompt_token_ids"]) // 16 - 1)

    engine = AsyncLLMEngine(new_engine(tiny, tokenizer))
    engine.start()
    try:
        asyncio.run(twice(engine_generator(engine)))
    finally:
        engine.shutdown()
    assert engine.engine.block_manager.stats.queried_tokens > 0 and engine.engine.block_manager.stats.hit_tokens == 0

    served = new_engine(tiny, tokenizer)
    with serving(served, tokenizer, model_name="tiny") as (url, _):
        async def over_http():
            async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
                await twice(openai_generator(client, url, "tiny", tokenizer))

        asyncio.run(over_http())
    assert served.block_manager.stats.queried_tokens > 0 and served.block_manager.stats.hit_tokens == 0


def test_oracle_gaps_are_zero_on_the_oracles_own_answer_and_the_logit_gap_where_it_differs(tiny):
    """Teacher-forced under the oracle: its own greedy answer has no gap; a token swapped for its runner-up has
    exactly the oracle's top-1 minus top-2 logit there, and the tokens before it still none."""
    import torch

    prompt, answer = [5, 17, 3, 99], []
    with torch.inference_mode():
        for _ in range(6):  # greedy, the plain way: the whole sequence every time
            answer.append(int(tiny.compute_logits(tiny(torch.tensor(prompt + answer)))[-1].argmax()))
        logits = tiny.compute_logits(tiny(torch.tensor(prompt + answer[:2])))[-1]
    top2 = logits.topk(2)
    samples = {0: {"prompt_token_ids": prompt}}
    assert mlperf.oracle_gaps({0: answer}, samples, tiny) == [0.0] * 6
    swapped = answer[:2] + [int(top2.indices[1])] + answer[3:]
    gaps = mlperf.oracle_gaps({0: swapped}, samples, tiny)
    assert gaps[:2] == [0.0, 0.0] and len(gaps) == 6
    assert gaps[2] == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5) and gaps[2] > 0


@pytest.mark.parametrize("scenario, extra, printed", [
    ("Offline", {}, r"Offline: [\d.]+ samples/s, [\d.]+ tokens/s"),
    ("SingleStream", {}, r"SingleStream: p90 latency [\d.]+ s"),
    ("Server", {"target_qps": 40.0}, r"target  40\.000 qps: LoadGen: INVALID; .*completed [\d.]+ qps, [\d.]+ tokens/s"),
])
def test_the_command_prints_loadgens_figures(scenario, extra, printed, samples, async_engine, tmp_path, capsys):
    """measure(), the command's body, on the tiny model: it reads LoadGen's detail log and prints its figures."""
    import re
    from types import SimpleNamespace

    args = SimpleNamespace(scenario=scenario, mode="performance", min_query_count=SHORT[scenario], min_duration=0.2,
                           interactive=False, target_qps=None, start_qps=None, max_tries=None, url=None)
    for k, v in extra.items():
        setattr(args, k, v)
    with SUT(samples, engine_generator(async_engine)) as sut:
        status = mlperf.measure(args, sut, str(tmp_path))
    out = capsys.readouterr().out
    assert re.search(printed, out), out
    assert status == (0 if "LoadGen: VALID" in out else 1)
    assert "min_query_count " + str(SHORT[scenario]) in out
