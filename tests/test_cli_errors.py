"""Every user mistake on the command line is one `error: …` line on stderr and exit status 2, with no
traceback, and is found before the model loads; `batch` names the line and the field, and still runs
the good lines. Only the last test loads a model (the session's real SmolLM2)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.cli import checks, main


@pytest.fixture
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture
def no_model(monkeypatch, tokenizer):
    """The embedded tokenizer loads once for the module; loading the model fails the test (it must not be needed)."""
    import nanoserve.model

    real = checks.load_tokenizer  # a file the test names is read for real (its refusals are under test)
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: tokenizer if path is None else real(path))

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for an input that is wrong before it is needed")

    monkeypatch.setattr(nanoserve.model, "load_gguf", refuse)


def run_cli(argv, capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    return rc, capsys.readouterr().err


def assert_one_error(rc, err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def files(tmp_path):
    good = tmp_path / "in.jsonl"
    good.write_text(json.dumps({"prompt": "Hi", "max_tokens": 2}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "not.gguf").write_text("hello")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe{}\n")
    import gguf  # a GGUF whose tokenizer is byte-level BPE with another model's pre-tokenizer

    writer = gguf.GGUFWriter(str(tmp_path / "qwen2.gguf"), "llama")
    writer.add_context_length(64)  # a model's config, so the context checks pass and the tokenizer is what fails
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_token_types([1, 3, 3])
    writer.add_token_merges(["a b"])
    writer.add_chat_template("{{ messages }}")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path


BAD = [
    # (argv, what the error line must say); {d} is a temporary folder with the files above
    (["generate", "--prompt", ""], ["--prompt is empty"]),
    (["generate", "--prompt", "x", "--temperature", "-1"], ["--temperature must be"]),
    (["generate", "--prompt", "x", "--top-p", "1.5"], ["--top-p must be in (0, 1]"]),
    (["generate", "--prompt", "x", "--top-k", "-3"], ["--top-k"]),
    (["generate", "--prompt", "x", "--max-tokens", "0"], ["--max-tokens", "integer > 0"]),
    (["generate", "--prompt", "x", "--gguf", "{d}/missing.gguf"], ["--gguf", "no such file"]),
    (["generate", "--prompt", "hi " * 9000], ["--prompt", "exceeds the model's context of 8192"]),
    (["generate", "--prompt", "x", "--student", "05"], ["--student 05", "chapters 01-04 only"]),
    (["generate", "--prompt", "x", "--no-cache", "--student", "04"], ["--student 04", "--no-cache leaves out"]),
    (["chat", "--temperature", "-0.5"], ["--temperature must be"]),
    (["chat", "--top-p", "0"], ["--top-p"]),
    (["chat", "--max-tokens", "-1"], ["--max-tokens"]),
    # greedy (chat's default, or --temperature 0) draws nothing: a flag that shapes the draw is refused
    (["chat", "--top-p", "0.9"], ["--top-p 0.9 needs --temperature > 0"]),
    (["generate", "--prompt", "x", "--temperature", "0", "--top-k", "5", "--seed", "3"],
     ["--top-k 5, --seed 3 need --temperature > 0"]),
    (["generate", "--prompt", "x", "--temperature", "0", "--seed", "0"], ["--seed 0 needs --temperature > 0"]),
    (["chat", "--seed", "1"], ["--seed 1 needs --temperature > 0"]),
    (["chat", "--seed", "-1", "--top-k", "1"], ["--top-k 1, --seed -1 need --temperature > 0"]),
    # a tokenizer the course cannot read: one line naming the key, before any model loads (chat's local model too)
    (["generate", "--prompt", "x", "--gguf", "{d}/qwen2.gguf"], ["tokenizer.ggml.pre = 'qwen2' is not supported"]),
    (["chat", "--gguf", "{d}/qwen2.gguf"], ["tokenizer.ggml.pre = 'qwen2' is not supported"]),
    # a flag chat's back end cannot honour: the local model's with --url, a server's without (nothing connects)
    (["chat", "--url", "http://127.0.0.1:9/v1", "--no-cache"], ["--no-cache is for the local model", "drop it or --url"]),
    (["chat", "--url", "http://127.0.0.1:9/v1", "--weights", "fp32"], ["--weights is for the local model"]),
    (["chat", "--url", "http://127.0.0.1:9/v1", "--gguf", "{d}/not.gguf", "--weights", "int8"],
     ["--gguf, --weights are for the local model"]),
    (["chat", "--model", "smollm2"], ["--model is for an OpenAI-compatible server", "give its --url"]),
    (["chat", "--api-key", "k", "--model", "m"], ["--model, --api-key are for an OpenAI-compatible server"]),
    (["serve", "--port", "70000"], ["--port must be in [0, 65535]"]),
    (["serve", "--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["serve", "--rate-limit", "-1"], ["--rate-limit"]),
    (["batch", "--input", "{d}/missing.jsonl", "--output", "{d}/out.jsonl"], ["--input", "no such file"]),
    (["batch", "--input", "{d}", "--output", "{d}/out.jsonl"], ["--input", "is not a file"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/nowhere/out.jsonl"], ["--output", "does not exist"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}"], ["--output", "is a folder"]),
    (["batch", "--input", "{d}/empty.jsonl", "--output", "{d}/out.jsonl"], ["holds no requests"]),
    (["batch", "--input", "{d}/binary.jsonl", "--output", "{d}/out.jsonl"], ["not UTF-8"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "20"], ["chapters with exercises"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "02", "--compile-mode", "dynamic"],
     ["--compile-mode dynamic", "not with --student 02"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "-tp", "2"],
     ["--tensor-parallel-size > 1 builds every rank's shard from the reference Llama", "not with --student 02",
      "a bare --student selects every chapter"]),
    (["serve", "--student", "02,11", "--tensor-parallel-size", "3"], ["not with --student 02"]),
    # chapter 01's attention never runs in the engine (it attends with chapter 05's paged attention): the engine's
    # commands refuse a selection that names 01, and name the command that runs it
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "01"],
     ["--student 01: the engine attends with chapter 05's paged attention", "generate --student 01 runs it"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "1,05"],
     ["--student 1,05:", "never calls chapter 01's code"]),
    (["serve", "--student", "01,02"], ["--student 01,02:", "generate --student 01 runs it"]),
    (["serve", "--disaggregated", "--student", "01"], ["--student 01:", "generate --student 01 runs it"]),
    (["bench", "offline", "--student", "01"], ["--student 01:", "generate --student 01 runs it"]),
    # nor does chapter 04's cache or formula (the engine keeps its K/V in chapter 05's paged blocks)
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "04"],
     ["--student 04: the engine keeps its K/V in chapter 05's paged blocks and never calls chapter 04's code",
      "generate --student 04 runs your cache, memory --student 04 your formula"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "03,4"],
     ["--student 03,4:", "never calls chapter 04's code"]),
    (["serve", "--student", "04,05"], ["--student 04,05:", "generate --student 04 runs your cache"]),
    (["serve", "--disaggregated", "--student", "04"], ["--student 04:", "generate --student 04 runs your cache"]),
    (["bench", "offline", "--student", "01,04"],
     ["--student 01,04:", "generate --student 01 runs it; the engine keeps its K/V", "memory --student 04"]),
    # a chapter whose code this command never calls, though the engine takes it (serve runs it): refused per command,
    # naming the command that runs it
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "16"],
     ["--student 16: batch never calls chapter 16's code (a fleet's routing decisions)",
      "serve --replicas N --student 16 runs it"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "05,8"],
     ["--student 05,8: batch never calls chapter 08's code", "serve --student 08 runs it"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "12"],
     ["batch never calls chapter 12's code (the snapshot rules and event feed", "serve --student 12 runs it"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "13,19"],
     ["batch never calls chapter 13's code", "serve --student 13 runs it",
      "batch never calls chapter 19's code", "serve --lora-modules NAME=PATH --student 19 runs it"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "17"],
     ["batch never calls chapter 17's code", "serve --kv-role decode --student 17",
      "bench experiment kv-routing --student 17"]),
    (["bench", "offline", "--student", "12"], ["--student 12: bench offline never calls chapter 12's code"]),
    (["bench", "http", "--student", "08"], ["--student 08: bench http never calls chapter 08's code"]),
    # chapter 09's metrics and load run in bench serve alone: every command that builds an engine refuses it
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "09"],
     ["--student 09: the engine never calls chapter 09's code", "bench serve --student 09 runs it"]),
    (["serve", "--student", "06,09"], ["--student 06,09: the engine never calls chapter 09's code"]),
    # the KV tier and an int8 / fp8 pool run on the reference's block manager and attention: refused with chapter 05,
    # and with a bare --student (every chapter), before the model loads
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "05", "--kv-tier-blocks", "64"],
     ["--student 05: the KV tier runs on the reference block manager"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "--kv-tier-blocks", "64"],
     ["--student: the KV tier runs on the reference block manager", "a bare --student selects every chapter"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--student", "05,06", "--kv-cache-dtype",
      "int8"], ["--student 05,06: kv_cache_dtype int8 runs chapter 18's quantized attention"]),
    (["serve", "--student", "--kv-cache-dtype", "fp8"],
     ["--student: kv_cache_dtype fp8 runs chapter 18's quantized attention", "a bare --student selects every chapter"]),
    (["bench", "offline", "--student", "05", "--kv-tier-blocks", "64"], ["--student 05: the KV tier"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--block-size", "0"], ["--block-size"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--kv-cache-mib", "-1"], ["--kv-cache-mib"]),
    # two sizes of one KV pool: the pair is refused in either order, the default's own value (1024) included
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--num-blocks", "64", "--kv-cache-mib", "1"],
     ["argument --kv-cache-mib: not allowed with argument --num-blocks"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--kv-cache-mib", "1024", "--num-blocks", "64"],
     ["argument --num-blocks: not allowed with argument --kv-cache-mib"]),
    (["bench", "offline", "--num-blocks", "64", "--kv-cache-mib", "1"], ["--kv-cache-mib: not allowed with argument --num-blocks"]),
    (["serve", "--num-blocks", "64", "--kv-cache-mib", "1"], ["--kv-cache-mib: not allowed with argument --num-blocks"]),
    (["bench", "engine-view", "--num-blocks", "64", "--kv-cache-mib", "1"],
     ["--kv-cache-mib: not allowed with argument --num-blocks"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--model", "{d}/not.gguf"], ["not a GGUF file"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--integer-dot", "on"],
     ["--integer-dot", "int8 / q4 weights, not of --weights fp32"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--weights", "q4", "--integer-dot", "off",
      "-tp", "3"], ["--integer-dot is single-process only"]),
    (["bench", "peers", "--formats", "fp32", "--integer-dot", "off"], ["--integer-dot", "give --formats int8 or q4"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--native-decode", "on"],
     ["--native-decode on", "not 'fp32' weights"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--weights", "q4", "--integer-dot", "off",
      "--native-decode", "on"], ["--native-decode on", "integer_dot=False"]),
    (["bench", "peers", "--formats", "fp32", "--native-decode", "off"], ["--native-decode", "give --formats q4"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--weights", "q4", "--kv-cache-dtype", "int8",
      "--native-decode", "on"], ["--native-decode on", "kv_cache_dtype 'int8'"]),
    (["batch", "--input", "{d}/in.jsonl", "--output", "{d}/out.jsonl", "--weights", "q4", "--student", "05",
      "--native-decode", "on"], ["--native-decode on", "your chapter 05 attention"]),
    (["bench", "peers", "--formats", "q4", "--integer-dot", "off", "--native-decode", "on"],
     ["--native-decode on", "--integer-dot off"]),
    (["bench", "profile", "--native-decode", "on"], ["--native-decode on", "not 'fp32' weights"]),
    (["bench", "profile", "--weights", "q4", "--native-decode", "on", "--lora-rank", "4"],
     ["--native-decode on", "LoRA"]),
    # bench spec loads the model as LLM would: what the engine refuses is refused before the model loads
    (["bench", "spec", "--native-decode", "on"], ["--native-decode on", "not 'fp32' weights"]),
    (["bench", "spec", "--weights", "int8", "--native-decode", "on"], ["--native-decode on", "not 'int8' weights"]),
    (["bench", "spec", "--weights", "q4", "--kv-cache-dtype", "fp8", "--native-decode", "on"],
     ["--native-decode on", "kv_cache_dtype 'fp8'"]),
    (["bench", "spec", "--weights", "q5"], ["--weights"]),
    (["bench", "spec", "--kv-cache-dtype", "fp16"], ["--kv-cache-dtype", "invalid choice"]),
    (["memory", "--device-gb", "0"], ["--device-gb", "> 0"]),
    (["memory", "--seq-len", "-5"], ["--seq-len"]),
    (["memory", "--reserve", "1"], ["--reserve", "[0, 1)"]),
    (["memory", "--reserve", "-0.1"], ["--reserve"]),
    (["memory", "--model", "gpt-5"], ["invalid choice", "llama-3-8b", "smollm2-135m"]),
    (["memory", "--seq-len", "100000"], ["100000", "context"]),
    (["memory", "--student", "05"], ["--student 05", "chapter 04's exercises only"]),
    (["memory", "--student", "04,06"], ["--student 04,06", "chapter 04's exercises only"]),
    (["info", "--gguf", "{d}/missing.gguf"], ["no such file"]),
    (["info", "--gguf", "{d}/not.gguf"], ["not a GGUF file"]),
    (["bench", "no-such-bench"], ["invalid choice", "offline"]),
    (["bench", "offline", "--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["bench", "offline", "-tp", "3"], ["one-at-a-time baseline", "--sequential-requests 0"]),
    (["bench", "offline", "--weights", "q4"], ["float32 model, not --weights q4", "--hf-requests 0"]),
    (["bench", "offline", "--output-len", "9", "3"], ["--output-len 9 3", "MIN is larger than MAX"]),
    (["bench", "offline", "--hf-requests", "0", "--hf-batch-size", "4"], ["--hf-batch-size", "--hf-requests 0 runs none"]),
    (["bench", "offline", "--hf-requests", "-2"], ["--hf-requests"]),
    (["bench", "offline", "--num-requests", "0"], ["--num-requests"]),
    # bench kv-cache: every count below 1 (a zero used to divide by zero or crash in the model), and what the
    # types cannot see, before the model loads
    (["bench", "kv-cache", "--contexts", "16", "0"], ["--contexts", "integer > 0, got 0"]),
    (["bench", "kv-cache", "--cache-tokens", "0"], ["--cache-tokens", "integer > 0, got 0"]),
    (["bench", "kv-cache", "--no-cache-tokens", "-1"], ["--no-cache-tokens", "integer > 0, got -1"]),
    (["bench", "kv-cache", "--max-len", "0"], ["--max-len", "integer > 0, got 0"]),
    (["bench", "kv-cache", "--requests", "0"], ["--requests", "integer > 0, got 0"]),
    (["bench", "kv-cache", "--rounds", "0"], ["--rounds", "integer > 0, got 0"]),
    # bench experiment: a count of 0 is not the experiment's default; one token has no gap between tokens to measure
    (["bench", "experiment", "prefix-caching", "--output-len", "0"], ["--output-len must be >= 1"]),
    (["bench", "experiment", "prefill-budget", "--output-len", "1"], ["prefill-budget", "--output-len must be >= 2"]),
    (["bench", "experiment", "chunked-prefill", "--output-len", "1"], ["chunked-prefill", "--output-len must be >= 2"]),
    (["bench", "kv-cache", "--threads", "0"], ["--threads", "integer > 0, got 0"]),
    (["bench", "kv-cache", "--max-len", "1"], ["--max-len must be at least 2", "got 1"]),
    (["bench", "kv-cache", "--contexts", "8190"], ["--contexts 8190", "8222 tokens", "context of 8192"]),
    (["bench", "paged-kv", "--memory-cap-mib", "-1"], ["--memory-cap-mib", "> 0"]),
    (["bench", "paged-kv", "--memory-cap-mib", "1"], ["--memory-cap-mib 1 holds 1 blocks", "needs 14"]),
    (["bench", "paged-kv", "--memory-cap-mib", "64", "--skip-model"], ["drop --skip-model"]),
    (["bench", "profile", "--temperature", "-1"], ["--temperature must be a finite number >= 0, got -1.0"]),
    (["bench", "profile", "--temperature", "1", "--top-p", "1.5"], ["--top-p must be in (0, 1], got 1.5"]),
    (["bench", "profile", "--top-p", "0.9"], ["--top-p 0.9 needs --temperature > 0"]),
    (["bench", "profile", "--temperature", "x"], ["--temperature", "invalid float value"]),
    # bench tp refuses, before any model or worker, a TP size the model cannot split and flags it would not honour
    (["bench", "tp", "--sizes", "1", "5"], ["--sizes 5", "does not divide num_attention_heads=12"]),
    (["bench", "tp", "--real", "--sizes", "2"], ["--sizes 2", "num_attention_heads=9"]),
    (["bench", "tp", "--real", "--sizes", "9"], ["--sizes 9", "does not divide intermediate_size=1536"]),
    (["bench", "tp", "--sizes", "0"], ["--sizes", "integer > 0"]),
    (["bench", "tp", "--sizes", "2", "2"], ["--sizes 2 2", "each size once"]),
    (["bench", "tp", "--prompt-len", "9000"], ["9010 tokens exceed the model's context of 8192"]),
    (["bench", "tp", "--model-only", "--batch", "4", "--real"], ["--model-only skips the measurement", "--batch, --real"]),
    (["bench", "engine-view", "--num-requests", "0"], ["--num-requests", "integer > 0"]),
    (["bench", "engine-view", "--prompt-len", "5", "2"], ["--prompt-len 5 2: MIN is larger than MAX"]),
    (["bench", "engine-view", "--tiny", "--output-len", "400", "500"],
     ["--output-len up to 500 exceed the tiny model's context of 512"]),
    # a --url where nothing answers (port 9, discard: closed here) is the user's mistake, not a traceback
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "1"],
     ["cannot reach a server at http://127.0.0.1:9"]),
    (["bench", "experiment", "servers", "--url", "a=http://127.0.0.1:9", "--url", "b=http://127.0.0.1:9",
      "--out-dir", "{d}/exp"], ["cannot reach a server at http://127.0.0.1:9"]),
    (["bench", "mlperf", "--url", "http://127.0.0.1:9", "--scenario", "Offline", "--out-dir", "{d}/mlperf"],
     ["cannot reach a server at http://127.0.0.1:9"]),
    (["no-such-command"], ["invalid choice", "generate"]),
]


@pytest.mark.parametrize("argv, fragments", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_error_line_before_the_model_loads(argv, fragments, files, no_model, capsys):
    rc, err = run_cli([a.format(d=files) for a in argv], capsys)
    assert_one_error(rc, err, *fragments)
    assert not (files / "out.jsonl").exists()  # nothing half-written


@pytest.mark.parametrize("settings, refused", [
    (dict(student="05", kv_tier_blocks=64), "the KV tier runs on the reference block manager"),
    (dict(student=True, kv_tier_blocks=64), "the KV tier runs on the reference block manager"),
    (dict(student="05", kv_cache_dtype="int8"), "kv_cache_dtype int8 runs chapter 18's quantized attention"),
    (dict(student=True, kv_cache_dtype="fp8"), "kv_cache_dtype fp8 runs chapter 18's quantized attention"),
], ids=["05+tier", "bare+tier", "05+int8", "bare+fp8"])
def test_llm_refuses_a_selection_the_reference_replaces_before_the_model_loads(settings, refused, no_model):
    from nanoserve.llm import LLM

    with pytest.raises(ValueError, match=refused):
        LLM(**settings)


def test_a_real_process_exits_2_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "nanoserve", "memory", "--reserve", "2"], capture_output=True, text=True)
    assert_one_error(out.returncode, out.stderr, "--reserve")


def test_help_and_argument_errors_import_neither_torch_nor_ray():
    """Answered at once: `--help`, a mistyped flag, a benchmark's bad value and `memory` import no torch (seconds
    to import) and no Ray; only the command that needs them does, in its run."""
    code = ("import sys\nfrom nanoserve.cli import main\n"
            "for argv in (['--help'], ['serve', '--help'], ['serve', '--max-num-seqs', '0'], ['chat', '--top-p', 'x'],\n"
            "             ['bench', 'soak', '--duration', 'x'], ['memory'], ['frobnicate']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('imported:', sorted(m for m in ('torch', 'ray', 'uvicorn', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().endswith("imported: []"), (out.stdout[-500:], out.stderr[-500:])
    assert "error: argument --max-num-seqs" in out.stderr and "error: argument --duration" in out.stderr


def test_greedy_takes_the_draw_flags_at_their_off_values():
    """Beside --temperature 0 the draw-shaping flags are refused (the BAD table) unless they say "off": --top-p 1,
    --top-k 0 or -1, no --seed. Refusing one of these would stop a command a user copies with its defaults."""
    for off in [dict(top_p=1.0), dict(top_k=0), dict(top_k=-1), dict(seed=None), dict(top_p=1.0, top_k=-1)]:
        assert checks.sampling_params(dict(temperature=0.0, **off), flags=True).greedy, off
    with pytest.raises(checks.UsageError, match="--seed 0 needs"):  # seed 0 is a seed, not "off"
        checks.sampling_params(dict(temperature=0.0, seed=0), flags=True)


def test_bench_spec_accepts_native_decode_off_on_any_weights_as_llm_does():
    """`--native-decode off` asks for the forward, which every format runs: LLM(native_decode=False) takes it on any
    weights and pool, and so does bench spec (serve and batch refuse only "on")."""
    import argparse

    from nanoserve.bench.spec import check_args
    from nanoserve.kernels.cpu_decode import check_native_decode

    for weights, kv in [("fp32", "auto"), ("int8", "auto"), ("bf16", "fp8"), ("q4", "int8")]:
        check_native_decode(False, weights, None, 1, False, kv)  # LLM's check: not refused
        check_args(argparse.Namespace(weights=weights, kv_cache_dtype=kv, native_decode="off"))  # nor here


def test_docs_quote_commands_the_way_that_runs_from_a_fresh_clone():
    """The README, the chapters, the exercises' READMEs and the notebooks' text quote `.venv/bin/python -m
    nanoserve ...` (the environment `make` builds): a bare `python -m nanoserve` runs the system Python, which has
    no torch."""
    root = Path(__file__).resolve().parents[1]
    texts = {p: p.read_text() for p in [root / "README.md", *root.glob("chapters/*.md"), *root.glob("exercises/*/README.md")]}
    for nb in root.glob("notebooks/*.ipynb"):  # their prose; a code cell's output may print what it likes
        texts[nb] = "".join("".join(c["source"]) + "\n" for c in json.loads(nb.read_text())["cells"]
                            if c["cell_type"] == "markdown")
    bare = re.compile(r"(?<!\.venv/bin/)(?<![\w/.])python3? -m (nanoserve|pytest)\b")
    found = [f"{p.relative_to(root)}:{i}: {line.strip()[:100]}" for p, text in texts.items()
             for i, line in enumerate(text.splitlines(), 1) if bare.search(line)]
    assert not found, "\n".join(found)
    assert len(texts) > 30 and sum(".venv/bin/python -m nanoserve" in t for t in texts.values()) > 15  # it looked


def test_help_shows_the_defaults(capsys):
    for argv, default in [(["batch"], "(default: 2048)"), (["memory"], "(default: 4096)"),
                          (["generate"], "(default: 0.7)"), (["chat"], "(default: 256)"), (["chat"], "(default: 0.0)"),
                          (["serve"], "(default: 8000)"), (["serve"], "(default: 512)")]:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        assert default in capsys.readouterr().out, argv


@pytest.mark.slow
def test_batch_names_line_and_field_and_runs_the_good_lines(smollm2, tokenizer, files, monkeypatch, capsys):
    import nanoserve.model

    monkeypatch.setattr(nanoserve.model, "load_gguf", lambda path=None, *rest: smollm2)  # (path, weights, quantizer)
    real = checks.load_tokenizer  # a file the test names is read for real (its refusals are under test)
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: tokenizer if path is None else real(path))
    lines = [
        json.dumps({"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "id": "a"}),
        json.dumps({"prompt": ""}),
        json.dumps({"prompt": "x", "temperature": -1}),
        "",  # blank lines are skipped, and keep the numbering
        json.dumps({"messages": []}),
        json.dumps({"prompt_token_ids": [1, 10**9]}),
        json.dumps({"prompt": "hi " * 9000, "max_tokens": 4}),
        json.dumps({"prompt": "x", "max_tokens": 0}),
        json.dumps({"prompt": "x", "priority": "high"}),
        "[1, 2]",
        json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stop": "."}),
    ]
    src, dst = files / "mixed.jsonl", files / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc, err = run_cli(["batch", "--input", str(src), "--output", str(dst), "--no-progress", "--num-blocks", "64"], capsys)
    assert rc == 1 and "Traceback" not in err
    expected = {2: '"prompt" must be a non-empty string', 3: '"temperature" must be', 5: '"messages" must be',
                6: '"prompt_token_ids" must be', 7: '"prompt" is 9', 8: '"max_tokens" must be', 9: '"priority" must be',
                10: "expected a JSON object"}
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(expected)
    for n, fragment in expected.items():
        assert any(line.startswith(f"error: {src}:{n}: ") and fragment in line for line in errors), (n, errors)
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    good = [r for r in records if "error" not in r]
    assert [r["line"] for r in good] == [1, 11] and good[0]["id"] == "a"
    assert len(good[0]["token_ids"]) == 3 and 1 <= len(good[1]["token_ids"]) <= 2
