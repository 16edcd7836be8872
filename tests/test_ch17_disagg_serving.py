"""Chapter 17: prefill and decode in two OS processes (`serve --kv-role`), joined by `python -m nanoserve
proxy`, answering the openai client with the float32 oracle's greedy text; nothing left behind after aborts."""

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from nanoserve.llm import LLM
from nanoserve.sampling import SamplingParams

MODEL = "SmolLM2-135M-Instruct"


def start(*args: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", *args, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith(("nanoserve: serving", "nanoserve proxy:")):
            return proc, line.split(" at ")[1].split(" ")[0] if " at " in line else line.split()[2]
    proc.kill()
    raise AssertionError("it did not come up:\n" + "".join(said))


def usage(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("nanoserve:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no nanoserve:kv_cache_usage_perc")


def running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("nanoserve:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no nanoserve:num_requests_running")


def staged(*procs: subprocess.Popen) -> set[str]:
    """The KV segments these processes hold mapped (/proc/PID/maps): theirs alone, not those that tests of other
    files, running at the same time under xdist, stage in the same /dev/shm."""
    names = set()
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                names.update(line.split(maxsplit=5)[5].strip() for line in maps if "/dev/shm/nskv_" in line)
        except FileNotFoundError:  # it has exited
            pass
    return names


def settles(condition, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def disagg():
    engine = ["--weights", "fp32", "--num-blocks", "128", "--warmup-requests", "0", "--shutdown-timeout", "2"]
    procs = []
    try:
        prefill, prefill_url = start("serve", "--kv-role", "prefill", *engine)
        procs.append(prefill)
        decode, decode_url = start("serve", "--kv-role", "decode", *engine)
        procs.append(decode)
        proxy, proxy_url = start("proxy", "--prefill", prefill_url, "--decode", decode_url)
        procs.append(proxy)
        yield proxy_url, prefill_url, decode_url, prefill, decode
    finally:
        held = staged(*procs)  # at a clean shutdown the prefill engine unlinks what it still stages
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert not [name for name in held if os.path.exists(name)], "the prefill engine freed every staged segment"


def test_two_processes_answer_with_the_oracles_greedy_text(disagg, smollm2, smollm2_tokenizer):
    proxy_url = disagg[0]
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none")
    prompts = ["The capital of France is", "Write a haiku about the sea.\n"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(smollm2, tokenizer=smollm2_tokenizer) as oracle:
        *expected, expected_chat = [o.text for o in oracle.generate(
            prompts + [messages], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)]
    for prompt, text in zip(prompts, expected):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert reply.choices[0].text == text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
        assert streamed == text
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected_chat


def test_errors_reach_the_client_and_aborts_leave_no_blocks(disagg):
    proxy_url, prefill_url, decode_url, prefill, decode = disagg
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:  # the prefill engine's own 400, passed on
        client.completions.create(model=MODEL, prompt="x" * 40000, max_tokens=4)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:  # the proxy's own
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, n=2)
    assert e.value.body["param"] == "n"
    for _ in range(3):  # clients that leave mid-stream: the decode engine aborts and frees
        stream = client.completions.create(model=MODEL, prompt="Count to one hundred:", max_tokens=200,
                                           temperature=0, stream=True)
        next(iter(stream))
        stream.close()
    assert settles(lambda: running(decode_url) == 0 and usage(decode_url) == 0 and usage(prefill_url) == 0)
    assert settles(lambda: not staged(prefill, decode)), "every staged segment was released"
