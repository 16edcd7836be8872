"""Chapter 06 — `bench offline`'s bookkeeping, on the tiny random model: the baselines' jobs run between the engine's
steps on clocks of their own, the schedule it reports (steps, sequences per step, the last admission) against a
schedule worked by hand, a ratio only for a baseline that served nanoserve's workload, the static batches' rows,
and a command line and header that say what ran (the flags it was given, parsed back to the same arguments).
Its refusals are in test_cli_errors.py. Timings are measured by the benchmark, never asserted here."""

import re
import shlex
import time

import pytest
import torch

from nanoserve.bench import offline
from nanoserve.bench.offline import command_line, compare, run_nanoserve, static_rows
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from tests.chapter_text import command_defaults
from tests.tiny_model import tiny_llama


def parse(*argv: str):
    return command_defaults(offline, "offline", *argv)


def test_side_jobs_run_between_steps_on_their_own_clock():
    # 3 requests, 5-token prompts, 6 tokens each, 2 seats: A and B prefill in step 1 (their first token) and decode
    # in steps 2-6; C takes the seat A frees and runs steps 7-12
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=32, max_num_seqs=2))
    steps, engine_step = [], engine.step
    engine.step = lambda: steps.append(1) or engine_step()
    ran = []

    def job(name):
        def run():
            time.sleep(0.01)
            ran.append((name, len(steps)))
        return run

    with torch.inference_mode():
        run = run_nanoserve(engine, [([1, 2, 3, 4, 5 + i], 6) for i in range(3)],
                            {"a": [job("a") for _ in range(3)], "b": [job("b") for _ in range(3)]}, {"a": 2, "b": 7})
    assert (run.steps, run.preemptions, run.scheduled, run.last_admitted) == (12, 0, 2 * 6 + 6, 7)
    # a's jobs after steps 1, 3 and 5; b's after 1 and 8, its third after the last step (12); a first after step 1
    assert ran == [("a", 1), ("b", 1), ("a", 3), ("a", 5), ("b", 8), ("b", 12)]
    assert run.side_seconds["a"] >= 3 * 0.01 and run.side_seconds["b"] >= 3 * 0.01
    assert max(r.end for r in run.records) <= run.seconds  # stamped on nanoserve's clock, the pauses left out
    assert [r.output_tokens for r in run.records] == [6, 6, 6]
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks


def test_a_ratio_only_for_a_baseline_that_served_the_whole_workload(capsys):
    workload = [([1], 2)] * 3
    compare("one at a time", workload, workload, [10.0, 12.0, 11.0], [5.0, 5.0, 4.0])
    compare("one at a time", workload, workload, [10.0], [4.0])
    compare("HF static", workload[:2], workload, [10.0], [5.0])
    lines = capsys.readouterr().out.splitlines()
    # medians 11 / 5, and each round's own ratio
    assert lines[0].strip() == "nanoserve / one at a time: 2.20x output tokens/s (each round: 2.00x 2.40x 2.75x)"
    assert lines[1].strip() == "nanoserve / one at a time: 2.50x output tokens/s"
    assert lines[2].strip() == "(the first 2 of 3 requests: not nanoserve's workload, so no ratio)"


def test_static_batches_run_as_long_as_their_longest_member():
    workload = [([1] * p, n) for p, n in ((4, 3), (1, 5), (2, 2), (6, 7), (3, 1))]
    # batches of 2: [3, 5] -> 5 steps of 2 rows, [2, 7] -> 7 of 2, [1] -> 1 of 1; prompts padded to 4, 6 and 3
    assert static_rows(workload, 2) == (5 + 7 + 1, 2 * 5 + 2 * 7 + 1, 2 * 4 + 2 * 6 + 3)
    assert static_rows(workload, 8) == (7, 5 * 7, 5 * 6)


@pytest.mark.parametrize("argv", [
    (),
    ("--num-requests", "8", "--prompt-len", "16", "128", "--rounds", "3", "--threads", "1", "--max-num-seqs", "4"),
    ("--weights", "q4", "--kv-cache-dtype", "bf16", "--hf-requests", "0"),
    ("--hf-requests", "8", "--hf-batch-size", "4"),
    ("-tp", "3", "--sequential-requests", "0", "--no-prefix-caching", "--student", "06", "--num-blocks", "99"),
])
def test_the_command_line_parses_back_to_the_arguments_that_ran(argv):
    args = parse(*argv)
    line = command_line(args)
    assert line.startswith("python -m nanoserve bench offline ")
    again = parse(*shlex.split(line.removeprefix("python -m nanoserve bench offline ")))
    assert vars(again) == vars(args)
    assert "--block-size" not in line  # an engine flag at its default is left out


def test_the_command_names_the_engine_flags_given():
    line = command_line(parse("--weights", "q4", "--kv-cache-dtype", "bf16", "--hf-requests", "0"))
    assert "--weights q4" in line and "--kv-cache-dtype bf16" in line and "--hf-requests 0" in line


def test_the_header_says_what_each_system_ran(capsys, smollm2_tokenizer):
    import copy

    from nanoserve.cli.batch import engine_kwargs
    from nanoserve.llm import LLM
    from nanoserve.model.quant import quantize_model

    args = parse("--weights", "int8", "--kv-cache-dtype", "bf16", "--hf-requests", "0", "--num-requests", "3",
                 "--prompt-len", "4", "8", "--output-len", "2", "4", "--max-num-seqs", "2", "--num-blocks", "32")
    assert offline.check_args(args) is None
    model = quantize_model(copy.deepcopy(tiny_llama()), "int8")
    with torch.inference_mode():
        llm = LLM(model, tokenizer=smollm2_tokenizer, **engine_kwargs(args))
        offline.measure(args, llm)
    out = capsys.readouterr().out
    assert llm.engine.executor.workers[0].dtype == torch.bfloat16  # the pool the header names
    assert f"command: {command_line(args)}\n" in out and "--weights int8 --kv-cache-dtype bf16" in out
    assert ("threads: " in out and "; nanoserve: weights int8, KV pool bf16, 32 blocks of 16 tokens, 2 seats; one at a "
            "time: weights int8, a contiguous float32 cache\n") in out
    assert "HF static" not in out
    # it served all 3 requests: a ratio, of the two rows' rates
    ours, theirs = (float(re.search(rf"{name} +3 req +\d+ out tok +[\d.]+ s +([\d.]+) out tok/s", out)[1])
                    for name in (r"nanoserve \(continuous\)", r"one at a time \(ch04 cache\)"))
    ratio = float(re.search(r"nanoserve / one at a time: ([\d.]+)x output tokens/s\n", out)[1])
    assert ratio == pytest.approx(ours / theirs, rel=0.01, abs=0.01)


def test_what_it_cannot_honour_is_refused_and_the_rest_is_not():
    assert "--sequential-requests 0" in offline.check_args(parse("-tp", "3"))
    assert offline.check_args(parse("-tp", "3", "--sequential-requests", "0")) is None
    assert "--hf-requests 0" in offline.check_args(parse("--weights", "q4"))
    assert offline.check_args(parse("--weights", "q4", "--hf-requests", "0")) is None
    assert "MIN is larger than MAX" in offline.check_args(parse("--output-len", "9", "3"))
    # --hf-batch-size sizes batches only the HF baseline runs: with none, the flag would do nothing
    assert "--hf-requests 0 runs none" in offline.check_args(parse("--hf-requests", "0", "--hf-batch-size", "4"))
    assert offline.check_args(parse("--hf-requests", "2", "--hf-batch-size", "4")) is None
