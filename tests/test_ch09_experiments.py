"""Chapter 09 — the experiments' engine driver on a tiny random model: arrivals at given steps, one record per
request stamped on one clock, and a per-step trace of the pool and the queues that adds up; `bench experiment`
refusing a flag the experiment does not use; the concurrency experiment's levels interleaved round by round on a
server without a prefix cache."""

import pytest
import torch

from nanoserve.bench.experiment import drive, engine_for
from nanoserve.model import Llama, LlamaConfig


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Llama(LlamaConfig.tiny()).eval()


def test_drive_arrivals_and_records(tiny):
    engine = engine_for(tiny, num_blocks=32, block_size=4, enable_prefix_caching=False)
    records, trace = drive(engine, [(0, "a", [1, 2, 3, 4, 5], 4), (2, "b", [6, 7], 3), (20, "late", [8], 2)])
    a, b, late = records["a"], records["b"], records["late"]
    assert (a.output_tokens, b.output_tokens, late.output_tokens) == (4, 3, 2)
    assert len(a.chunk_times) == 4 and a.end == a.chunk_times[-1]  # one chunk per engine step that sampled
    assert a.prompt_tokens == 5 and a.start <= a.chunk_times[0]
    assert a.chunk_times[1] < b.start < b.chunk_times[0]  # b was added before step 2, after a's second token
    # the engine went idle after step 4; the driver jumps to step 20 instead of spinning through empty steps
    assert [row["step"] for row in trace] == [0, 1, 2, 3, 4, 20, 21]
    assert trace[0]["num_tokens"] == 5 and trace[2]["num_tokens"] == 1 + 2  # a decodes while b prefills
    assert trace[-1]["blocks_used"] == 0 and trace[-1]["running"] == 0


def test_drive_trace_under_an_overloaded_pool(tiny):
    # 6 requests of 6 + 10 tokens = 4 blocks of 4 each at the end, in a pool of 10 blocks: preemptions must happen
    engine = engine_for(tiny, num_blocks=10, block_size=4, enable_prefix_caching=False)
    records, trace = drive(engine, [(0, str(i), [10 + i] * 6, 10) for i in range(6)])
    assert all(r.output_tokens == 10 and r.end is not None for r in records.values())
    assert trace[-1]["preemptions"] > 0
    assert max(row["blocks_used"] for row in trace) <= 10 and any(row["waiting"] for row in trace)
    for row in trace:  # the tokens held always fit in the blocks used
        assert row["tokens_held"] <= row["blocks_used"] * 4
    assert engine.block_manager.get_num_free_blocks() == 10  # every block back at the end


def test_interleaved_alternates_the_order_round_by_round():
    """A, B then B, A then A, B: each system sees the same drift, and none always runs first."""
    from nanoserve.bench.experiment import interleaved

    seen = []
    results = interleaved(3, {"A": 1, "B": 2}, lambda name, system, r: seen.append((r, name)) or system * 10 + r)
    assert seen == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    assert results == {"A": [10, 11, 12], "B": [20, 21, 22]}


@pytest.mark.parametrize("argv, message", [
    (["overload", "--rounds", "2"], "overload does not use --rounds (its flags: --out-dir, --output-len, --threads)"),
    (["concurrency", "--num-prompts", "8"], "concurrency does not use --num-prompts"),
    (["prefix-caching", "--url", "http://127.0.0.1:1"], "prefix-caching does not use --url"),
    (["block-size", "--concurrency", "4"], "block-size does not use --concurrency"),
    (["servers", "--threads", "2", "--url", "a=http://x", "--url", "b=http://y"], "servers does not use --threads"),
    (["kv-dtypes", "--output-len", "4"], "kv-dtypes does not use --output-len"),
    (["routing", "--replicas", "3"], "routing does not use --replicas"),  # given at its default value: still refused
    (["concurrency", "--url", "http://x", "--threads", "2"], "give --threads to that server, not here"),
    (["concurrency", "--url", "http://x", "--url", "http://y"], "concurrency measures one server: give --url once"),
])
def test_a_flag_the_experiment_does_not_use_is_refused(argv, message, capsys):
    from nanoserve.bench import experiment
    from tests.chapter_text import command_defaults

    assert experiment.run(command_defaults(experiment, "experiment", *argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_every_experiment_lists_the_flags_it_uses():
    from nanoserve.bench import experiment
    from tests.chapter_text import command_defaults

    assert set(experiment.USES) == set(experiment.EXPERIMENTS)
    flags = set(vars(command_defaults(experiment, "experiment", "overload"))) - {"name", "func", "given", "out_dir"}
    assert set().union(*experiment.USES.values()) == flags  # every flag belongs to some experiment


def test_the_concurrency_levels_are_interleaved_on_a_server_without_a_prefix_cache(monkeypatch, smollm2_tokenizer, capsys):
    """Every level re-sends the same prompts (the first four of the prompt set at each level here): on a server
    with a prefix cache the second level would find the first one's blocks. The server concurrency starts has no
    prefix cache (no token is ever a hit), and --rounds 2 runs the levels A, B then B, A."""
    from types import SimpleNamespace

    from nanoserve.bench import experiment
    from nanoserve.bench.prompts import course_prompts
    from tests.tiny_model import tiny_llama

    engines = []

    def engine_for(*a, **config):
        engines.append(experiment_engine_for(*a, **config))
        return engines[-1]

    experiment_engine_for = experiment.engine_for
    monkeypatch.setattr(experiment, "engine_for", engine_for)
    model = tiny_llama(vocab_size=smollm2_tokenizer.vocab_size, max_position_embeddings=2048)
    with torch.inference_mode():
        result, _ = experiment.concurrency(SimpleNamespace(url=None, output_len=2, concurrency=[1, 2], rounds=2),
                                           model, smollm2_tokenizer)
    assert course_prompts(4, 0) == course_prompts(2 * 2, 0)  # both levels send the same 4 prompts
    (engine,) = engines
    assert not engine.config.cache_config.enable_prefix_caching and engine.block_manager.stats.hit_tokens == 0
    rounds = [line.split(" round ")[1].split(":")[0] for line in capsys.readouterr().err.splitlines() if " round " in line]
    assert rounds == ["1 1", "1 2", "2 2", "2 1"]  # round, level: the order alternates
    assert [len(result["results"][c]) for c in (1, 2)] == [2, 2] and [r["concurrency"] for r in result["runs"]] == [1, 2]
    assert all(run["failed"] == 0 for runs in result["results"].values() for run in runs)
