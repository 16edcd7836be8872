"""Chapter 08 — the real SmolLM2 (float32 weights) behind the real server, called with the official openai client
(sync and async): 16 concurrent streams give the offline LLM's greedy text, streamed == non-streamed (equalities
of float32; on q4 a repeat may pick another near-tie token: test_ch08_contract's q4 test), include_usage, stop
strings never leak; and `python -m nanoserve serve` itself, answering the curl line and the openai snippet it
prints, then exiting 0 on SIGTERM."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from nanoserve.server.runner import serving

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hi.", "What is 2+2?", "Name a fruit.",
             "Who wrote Hamlet?", "What is water made of?", "Name a planet.", "Count to three.", "Name an animal.",
             "What day comes after Monday?", "Spell cat.", "What is the opposite of hot?", "Name a city in Japan.",
             "What colour is the sky?", "Give me a number."]


@pytest.fixture(scope="module")
def served(smollm2):
    """(base URL, the LLM whose engine the server runs) — one real-model server for this module."""
    from nanoserve.llm import LLM

    llm = LLM(smollm2, num_blocks=256, max_num_seqs=16)
    with serving(llm.engine, llm.tokenizer) as (url, _):
        yield url, llm


def chat(question):
    return [{"role": "user", "content": question}]


@pytest.mark.slow
def test_16_concurrent_streams_equal_the_offline_llm(served, smollm2):
    from nanoserve.llm import LLM
    from nanoserve.sampling import SamplingParams

    url, server_llm = served
    offline = LLM(smollm2, num_blocks=256).generate([chat(q) for q in QUESTIONS],
                                                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")

    async def one(question):
        stream = await client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=8,
                                                      temperature=0, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def main():
        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    got = asyncio.run(main())
    assert [text for text, _ in got] == [o.text for o in offline]
    assert [finish for _, finish in got] == [o.finish_reason for o in offline]
    blocks = server_llm.engine.block_manager
    assert blocks.get_num_free_blocks() == blocks.num_blocks


@pytest.mark.slow
def test_streamed_equals_non_streamed_with_usage(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    kw = dict(model=MODEL, messages=chat("Tell me about the sea."), max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


@pytest.mark.slow
def test_stop_strings_never_leak_into_the_stream(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    kw = dict(model=MODEL, prompt="The river wound slowly through the", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    stop = " " + words[3]  # several characters, so usually spread over more than one token
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True)]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    assert "".join(pieces) == cut.text and stop not in cut.text
    sent = ""
    for piece in pieces:  # at no point did the client see a character the answer does not keep
        sent += piece
        assert cut.text.startswith(sent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_command_answers_what_it_prints_and_exits_0_on_sigterm():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--num-blocks", "64", "--max-num-seqs", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        printed = []
        while not any(line.startswith("print(") for line in printed):  # the snippet's last line
            line = proc.stdout.readline()
            assert line, f"serve exited early: {proc.stderr.read()}"
            printed.append(line.rstrip("\n"))
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        curl = next(line for line in printed if line.startswith("curl "))
        assert f"127.0.0.1:{port}" in curl and '"max_tokens": 64' in curl  # seconds, not the whole context
        assert any("max_tokens=64" in line for line in printed) and any("--default-max-tokens" in line for line in printed)
        reply = subprocess.run(curl + " --max-time 120", shell=True, capture_output=True, text=True, timeout=150)
        assert reply.returncode == 0 and '"role":"assistant"' in reply.stdout.replace(" ", ""), reply.stdout
        start = printed.index(next(line for line in printed if line.startswith("from openai")))
        snippet = "\n".join(printed[start:])
        assert len(snippet.splitlines()) == 5
        out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=150)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
    assert re.search(r"stopped", proc.stdout.read())
