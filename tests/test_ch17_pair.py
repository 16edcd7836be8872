"""Chapter 17: `serve --disaggregated` starts the prefill engine, the decode engine and the proxy as one command.
It answers the openai client with the float32 oracle's greedy text; SIGTERM, or an engine that dies, leaves no
process, port or shared-memory segment of the pair behind; every flag of `serve` is forwarded to both engines or
refused with one `error:` line, before any process starts."""

import glob
import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from nanoserve.cli import main, pair
from nanoserve.llm import LLM
from nanoserve.sampling import SamplingParams
from tests.test_ch17_disagg_serving import settles
from tests.test_cli_errors import assert_one_error

MODEL = "SmolLM2-135M-Instruct"
ENGINE = ["--weights", "fp32", "--threads", "1", "--num-blocks", "128", "--shutdown-timeout", "2"]


def test_every_serve_flag_is_forwarded_owned_or_refused():
    dests = [a.dest for a in pair.flags(pair.serve_parser())]
    groups = [set(pair.FORWARDED), set(pair.OWN), set(pair.REFUSED)]
    assert sorted(set().union(*groups)) == sorted(dests), "a flag of serve the pair neither forwards nor refuses"
    assert sum(map(len, groups)) == len(set(dests)), "a flag in two groups"


def test_forwarded_flags_reach_each_engine_as_given(monkeypatch):
    """The engine's command line, read back by serve's own parser, holds the flags the pair was given."""
    parser = pair.serve_parser()
    given = ["--disaggregated", "--model", "m.gguf", "--served-model-name", "tiny", "--api-key", "k",
             "--request-timeout", "2.5", "--metrics-need-key", "--max-num-seqs", "8", "--max-num-batched-tokens",
             "256", "--no-prefix-caching", "--student", "--weights", "int8", "--kv-cache-dtype", "bf16",
             "--scheduling-policy", "fcfs", "--threads", "3", "--log-level", "info", "--port", "9",
             "--integer-dot", "off"]
    args = parser.parse_args(given)
    for role in pair.ROLES:
        argv = pair.engine_command(args, parser, role)
        assert argv[:4] == [sys.executable, "-m", "nanoserve", "serve"] and "k" not in argv  # the key: not in `ps`
        engine = parser.parse_args(argv[4:])
        assert (engine.kv_role, engine.host, engine.port) == (role, "127.0.0.1", 0)
        for dest in set(pair.FORWARDED) - {"api_key"}:
            assert getattr(engine, dest) == getattr(args, dest), dest
    monkeypatch.setenv("NANOSERVE_API_KEY", "stale")
    assert pair.engine_env(args)["NANOSERVE_API_KEY"] == "k"
    assert "NANOSERVE_API_KEY" not in pair.engine_env(parser.parse_args(["--disaggregated"]))


@pytest.mark.parametrize("flags, fragments", [
    (["--replicas", "2"], ["--replicas", "fleet"]),
    (["--kv-role", "prefill"], ["--kv-role"]),
    (["--kv-control-port", "5555"], ["--kv-control-port"]),
    (["--enable-lora"], ["--enable-lora"]),
    (["--kv-tier-blocks", "8"], ["--kv-tier-blocks"]),
    (["--preemption-mode", "swap"], ["--preemption-mode"]),
    (["--kv-cache-dtype", "int8"], ["--kv-cache-dtype int8"]),
    (["--rate-limit", "5"], ["--rate-limit"]),
    (["--compile-mode", "buckets"], ["--compile-mode"]),
    (["--speculative", "ngram"], ["--speculative"]),
    (["--kv-events-endpoint", "tcp://127.0.0.1:5557"], ["--kv-events-endpoint"]),
    (["--admin-key", "a"], ["--admin-key"]),
    (["--port", "70000"], ["--port"]),
    (["--num-speculative-tokens", "2"], ["--num-speculative-tokens"]),
])
def test_a_flag_the_pair_cannot_honour_is_one_error_line_and_starts_nothing(flags, fragments, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for a command line that is wrong")

    monkeypatch.setattr(pair.subprocess, "Popen", refuse)
    monkeypatch.delenv("NANOSERVE_ADMIN_KEY", raising=False)
    rc = main(["serve", "--disaggregated", *flags])
    assert_one_error(rc, capsys.readouterr().err, *fragments)


def test_the_interference_experiments_systems_hold_two_threads_in_all():
    """bench experiment disagg-interference: each system, read back by serve's parser, holds 2 torch threads."""
    from nanoserve.bench.interference import systems

    parser = pair.serve_parser()
    found = {}
    for name, flags in systems([256, 512], num_blocks=64).items():
        args = parser.parse_args(flags)
        engines = 2 if args.disaggregated else 1
        found[name] = (engines * args.threads, args.weights, args.num_blocks, args.max_num_batched_tokens)
    assert found == {"colocated, budget 256": (2, "fp32", 64, 256), "colocated, budget 512": (2, "fp32", 64, 512),
                     "disaggregated, 1 + 1 threads": (2, "fp32", 64, 2048)}


def test_the_interference_summary_by_hand():
    from nanoserve.bench.interference import summary
    from nanoserve.metrics import RequestRecord

    streams = [RequestRecord(start=0.0, chunk_times=[1.0, 1.1, 1.3], end=1.3, output_tokens=3),
               RequestRecord(start=1.3, chunk_times=[1.5, 2.5], end=2.5, output_tokens=2),
               RequestRecord(start=2.5, success=False, error="HTTP 503")]
    longs = [RequestRecord(start=0.5, chunk_times=[2.5, 2.6], end=2.6, output_tokens=2),
             RequestRecord(start=1.0, chunk_times=[4.0], end=4.0, output_tokens=1)]
    x = summary({"streams": streams, "longs": longs, "seconds": 4.0})
    # gaps 100, 200, 1000 ms; TTFTs 2000, 3000 ms; (3 + 2 + 2 + 1) tokens in 4 s; one failure
    assert x["stream_itl_ms"]["median"] == pytest.approx(200)
    assert x["stream_itl_ms"]["p99"] == pytest.approx(200 + 0.98 * 800)  # rank 0.99 * 2 = 1.98
    assert x["long_ttfts_ms"] == pytest.approx([2000, 3000]) and x["long_ttft_ms"]["median"] == pytest.approx(2500)
    assert x["output_throughput"] == pytest.approx(2.0)
    assert (x["failed"], x["errors"], x["stream_requests"]) == (1, ["HTTP 503"], 3)


# ---- the pair itself, on SmolLM2 ----------------------------------------------------------------------------------

def start_pair(*flags: str) -> tuple[subprocess.Popen, str, dict[str, int], dict[str, str]]:
    """`serve --disaggregated` on a free port: (process, proxy URL, {role: engine pid}, {role: engine URL})."""
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--disaggregated", *ENGINE, "--port", "0",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("nanoserve: serving"):
            engines = re.findall(r"(prefill|decode) engine pid (\d+) at (\S+?)[,;]", line)
            assert len(engines) == 2, line
            return (proc, line.split(" at ")[1].split()[0], {role: int(pid) for role, pid, _ in engines},
                    {role: url for role, _, url in engines})
    proc.kill()
    raise AssertionError("the pair did not come up:\n" + "".join(said) + proc.stderr.read())


def sessions_alive(sids) -> list[int]:
    """Processes still in the engines' sessions (each engine leads its own: its resource tracker is in it too)."""
    alive = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        if int(fields[3]) in sids:
            alive.append(int(stat.split("/")[2]))
    return alive


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


def stage_a_segment(prefill_url: str) -> str:
    """What the proxy's first half does, without the second: the prefill engine keeps the prompt's KV staged in a
    /dev/shm segment until a decode engine releases it (or its 60 s timeout): only a graceful stop frees it now."""
    reply = httpx.post(prefill_url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "A staged prompt", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    segment = "/dev/shm/" + reply.json()["kv_transfer_params"]["remote_segment"]
    assert os.path.exists(segment)
    return segment


def assert_nothing_left(proc, proxy_url: str, pids: dict, urls: dict, segment: str) -> None:
    assert settles(lambda: not sessions_alive(set(pids.values()))), "a process of the pair is left"
    for url in [proxy_url, *urls.values()]:
        assert refuses_connections(url), f"{url} still answers"
    assert not os.path.exists(segment), "the staged KV segment is left in /dev/shm"


def test_the_pair_answers_with_the_oracles_greedy_text_and_sigterm_leaves_nothing(smollm2, smollm2_tokenizer):
    proc, url, pids, urls = start_pair()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        prompts = ["The capital of France is", "Write a haiku about the sea.\n"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        with LLM(smollm2, tokenizer=smollm2_tokenizer) as oracle:
            *expected, expected_chat = [o.text for o in oracle.generate(
                prompts + [messages], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)]
        for prompt, text in zip(prompts, expected):
            assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text == text
            assert "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)) == text
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        assert chat.choices[0].message.content == expected_chat
        segment = stage_a_segment(urls["prefill"])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.rstrip().endswith("nanoserve: stopped") and "error" not in err, (out, err)
    assert_nothing_left(proc, url, pids, urls, segment)


def test_an_engine_that_dies_stops_the_pair_with_one_error_line():
    proc, url, pids, urls = start_pair()
    try:
        segment = stage_a_segment(urls["prefill"])
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = iter(client.completions.create(model=MODEL, prompt="Count to one thousand:", max_tokens=2000,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        os.kill(pids["decode"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="decode engine"):  # the stream ends in an error event, not silence
            for _ in stream:
                pass
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [err.rstrip().splitlines()[-1]], err  # one error line, the last
    assert f"decode engine (pid {pids['decode']}) was killed by SIGKILL" in errors[0]
    assert_nothing_left(proc, url, pids, urls, segment)
