"""Chapter 09 — `bench serve` against a stand-in OpenAI-compatible server written here (any server must do).

The stand-in streams words on a known schedule (first chunk after TTFT_S, then one chunk every GAP_S, TWO
tokens per chunk), reports `usage` unless asked not to, fails on purpose when the prompt says FAIL, and
counts the requests it has in flight. So the expectations are known: output tokens = max_tokens (from
usage, not the chunk count), TPOT about half the ITL, failures counted, concurrency capped.
"""

import asyncio
import json
import math
import re
import socket
import statistics
import threading
import time

import pytest

TTFT_S, GAP_S = 0.05, 0.01


def stand_in_app(state: dict):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].add(request.headers.get("authorization"))
        content = body["messages"][-1]["content"]
        if "FAIL" in content:
            return JSONResponse({"error": {"message": "asked to fail", "type": "server_error"}}, status_code=500)
        n = body["max_tokens"]  # always n tokens (as if ignore_eos), two per chunk

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            # hold_until k: the first measured streams wait (30 s at most) until k are in flight together, so that a
            # test of the client's concurrency does not depend on k requests arriving within one short stream
            deadline = asyncio.get_running_loop().time() + 30
            while state["max_in_flight"] < state["hold_until"] and not content.startswith("Warm-up") \
                    and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
            try:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': ''}}]})}\n\n"
                await asyncio.sleep(TTFT_S)
                for i in range(0, n, 2):
                    words = " w" * min(2, n - i)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': words}}]})}\n\n"
                    await asyncio.sleep(GAP_S)
                if state["usage"] and body.get("stream_options", {}).get("include_usage"):
                    usage = {"prompt_tokens": 11, "completion_tokens": n, "total_tokens": 11 + n}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                if "CUT" not in content:  # CUT: the stream stops short, as a dropped connection would
                    yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stand_in():
    import uvicorn

    state = {"bodies": [], "auth": set(), "in_flight": 0, "max_in_flight": 0, "usage": True, "hold_until": 0}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(stand_in_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def bench(argv, capsys):
    from nanoserve.cli import main

    rc = main(["bench", "serve", "--no-progress", *argv])
    return rc, capsys.readouterr()


def test_against_stand_in(stand_in, tmp_path, capsys):
    url, state = stand_in
    state.update(max_in_flight=0, bodies=[], auth=set(), hold_until=4)  # 4 in flight once, however slow the machine
    out = tmp_path / "r.json"
    try:
        rc, io = bench(["--url", url, "--api-key", "k1", "--num-prompts", "12", "--request-rate", "inf",
                        "--max-concurrency", "4", "--output-len", "9", "--ignore-eos", "--goodput", "ttft:60000",
                        "e2el:60000", "--result-json", str(out)], capsys)
    finally:
        state["hold_until"] = 0
    assert rc == 0, io.err
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0 and result["model"] == "stand-in"
    assert result["output_lens"] == [9] * 12 and result["total_output_tokens"] == 108  # usage, not 5 chunks each
    assert result["input_lens"] == [11] * 12
    assert result["burstiness"] is None and "--burstiness" not in result["command"]  # inf: no gaps to shape
    assert state["max_in_flight"] == 4  # --max-concurrency held, and reached
    assert state["auth"] == {"Bearer k1"}
    body = state["bodies"][-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["max_tokens"] == 9 and body["temperature"] == 0
    # the schedule: the first chunk sent after TTFT_S, 4 more GAP_S apart (2 tokens each): 5 chunks, 4 gaps.
    # Sends are scheduled, receipts jitter (two chunks may land in one read), so only sums are bounded below.
    assert min(result["ttfts"]) >= TTFT_S
    assert all(len(gaps) == 4 for gaps in result["itls"]) and min(result["e2els"]) >= TTFT_S + 4 * GAP_S
    for ttft, tpot, e2e, gaps in zip(result["ttfts"], result["tpots"], result["e2els"], result["itls"]):
        assert tpot == pytest.approx((e2e - ttft) / 8)
        assert tpot < sum(gaps) / len(gaps)  # 9 tokens over 4 gaps: TPOT is not the chunk gap
    assert result["goodput"] == pytest.approx(12 / result["duration_s"])  # generous SLOs: all meet them
    assert result["ttft_ms"]["p99"] >= result["ttft_ms"]["median"] >= TTFT_S * 1000
    # 8 requests waited in the client for one of the 4 slots
    assert result["client_wait_ms"]["p90"] > 0
    assert "Serving Benchmark Result" in io.out and "Successful requests:" in io.out


def test_the_warm_up_is_none_of_the_measured_prompts(stand_in, tmp_path, capsys):
    """A warm-up that re-sent a measured prompt would leave its blocks in the server's prefix cache: that request
    would then be measured on a cache hit. The warm-ups are prompts of their own, and every measured prompt is
    sent once."""
    from nanoserve.bench.prompts import course_prompts

    url, state = stand_in
    state.update(bodies=[])
    rc, io = bench(["--url", url, "--num-prompts", "5", "--warmup", "2", "--output-len", "3"], capsys)
    assert rc == 0, io.err
    warm, measured = state["bodies"][:2], state["bodies"][2:]
    assert sorted(map(json.dumps, (b["messages"] for b in measured))) == sorted(
        json.dumps(item["messages"]) for item in course_prompts(5, 0))
    assert warm[0]["messages"] != warm[1]["messages"]
    assert not any(b["messages"] == m["messages"] for b in warm for m in measured)


def test_failures_are_counted_and_shown(stand_in, tmp_path, capsys):
    url, _ = stand_in
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello", "output_len": 4}\n{"messages": [{"role": "user", "content": "FAIL now"}]}\n'
                    '{"prompt": "CUT short", "output_len": 4}\n')
    out = tmp_path / "r.json"
    rc, io = bench(["--url", url, "--model", "stand-in", "--dataset", str(data), "--num-prompts", "6",
                    "--warmup", "0", "--goodput", "ttft:60000", "--result-json", str(out)], capsys)
    assert rc == 1  # failures make the run exit non-zero
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (2, 4)
    assert result["errors"][:3] == ["", "HTTP 500: asked to fail", "RuntimeError: the stream ended before data: [DONE]"]
    assert result["goodput"] == pytest.approx(2 / result["duration_s"])  # failed requests never meet an SLO
    assert "failed: HTTP 500: asked to fail" in io.out


def test_without_usage_counts_tokens_with_the_tokenizer(stand_in, tmp_path, capsys):
    """A server that sends no usage (llama.cpp's may not): the text is tokenized, never the chunks counted."""
    from nanoserve.bench.serve import model_tokenizer

    url, state = stand_in
    state["usage"] = False
    try:
        out = tmp_path / "r.json"
        rc, io = bench(["--url", url, "--num-prompts", "2", "--output-len", "7", "--result-json", str(out)], capsys)
    finally:
        state["usage"] = True
    assert rc == 0, io.err
    expected = len(model_tokenizer().encode(" w" * 7))
    assert json.loads(out.read_text())["output_lens"] == [expected, expected]


def test_student_09_measures_and_reports_with_the_learners_rungs(stand_in, tmp_path, capsys, monkeypatch):
    """`bench serve --student 09`: untouched, every rung falls back to the reference with a warning and the run says
    none of the learner's code ran; finished (a copy of the reference in a stand-in exercises folder), the learner's
    arrivals and open loop send the requests and the learner's metrics are the report, each rung's functions called."""
    import shutil

    import nanoserve.student

    url, _ = stand_in
    with pytest.warns(UserWarning) as caught:
        rc, io = bench(["--url", url, "--num-prompts", "1", "--student", "09"], capsys)
    assert [str(w.message).split(" not finished")[0] for w in caught] == [
        "Exercise 9.1, Exercise 9.2, Exercise 9.3", "Exercise 9.4, Exercise 9.5"]
    assert rc == 0 and "none of your code ran" in io.out
    folder = tmp_path / "09-measuring"
    folder.mkdir()
    for module, name in [("metrics", "metrics.py"), ("bench/load", "load.py")]:
        shutil.copy(nanoserve.student.EXERCISES.parent / "nanoserve" / f"{module}.py", folder / name)
    source = folder / "metrics.py"
    source.write_text(source.read_text().replace('"completed": len(ok)', '"completed": len(ok), "by": "student"'))
    monkeypatch.setattr(nanoserve.student, "EXERCISES", tmp_path)
    out = tmp_path / "r.json"
    rc, io = bench(["--url", url, "--num-prompts", "3", "--student", "09", "--result-json", str(out)], capsys)
    result = json.loads(out.read_text())
    assert rc == 0 and result["by"] == "student" and result["student_metrics"] and result["completed"] == 3
    assert re.search(r"yours .*, summarize  from \S*09-measuring/metrics\.py\n", io.out)
    assert re.search(r"yours      arrival_times, open_loop  from \S*09-measuring/load\.py\n", io.out)
    proof = io.out.split("--student: your code served: ")[1].splitlines()[0]
    calls = {name: int(n) for name, n in (item.split(" ×") for item in proof.split(", "))}
    served = {"9.1": "request_latencies", "9.2": "stats", "9.3": "summarize", "9.4": "arrival_times", "9.5": "open_loop"}
    assert all(calls.get(name, 0) >= 1 for name in served.values()), calls  # a function of every rung ran
    assert calls["arrival_times"] == calls["open_loop"] == calls["summarize"] == 1  # one schedule, one run, one report


def test_student_of_another_chapter_is_refused(capsys):
    rc, io = bench(["--url", "http://127.0.0.1:9", "--student", "05"], capsys)
    assert rc == 2 and io.err.strip() == "error: --student 05: bench serve runs chapter 09's exercises only (--student 09)"


@pytest.mark.parametrize("argv, message", [
    (["--url", "localhost:1"], "--url must start with http://"),
    (["--url", "http://x", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--url", "http://x", "--request-rate", "0"], "--request-rate must be > 0"),
    (["--url", "http://x", "--burstiness", "-1"], "--burstiness must be > 0"),
    (["--url", "http://x", "--burstiness", "0.5"], "--burstiness shapes the gaps between arrivals: it needs a finite --request-rate"),
    (["--url", "http://x", "--request-rate", "inf", "--burstiness", "1"], "it needs a finite --request-rate"),
    (["--url", "http://x", "--input-len", "512"], "--input-len is the prompt length of --dataset random, not of --dataset course"),
    (["--url", "http://x", "--dataset", "random", "--input-len", "0"], "--input-len must be >= 1"),
    (["--url", "http://x", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--url", "http://x", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--url", "http://x", "--dataset", "/no/such.jsonl"], "not 'course', 'random' or an existing JSONL file"),
    (["--url", "http://x", "--goodput", "latency:5"], "unknown SLO 'latency'"),
    (["--url", "http://x", "--goodput", "ttft:fast"], "expected NAME:MILLISECONDS"),
])
def test_bad_arguments(argv, message, capsys):
    rc, io = bench(argv, capsys)
    assert rc == 2
    assert io.err.strip().splitlines() == [io.err.strip()] and io.err.startswith("error: ") and message in io.err


def test_the_run_record_names_only_the_flags_the_run_used():
    from nanoserve.bench.serve import command_line, serve_args

    with pytest.raises(ValueError, match="--input-len is the prompt length of --dataset random"):
        serve_args("http://x", input_len=512)  # the programmatic form refuses what the command refuses
    with pytest.raises(ValueError, match="--burstiness .* needs a finite --request-rate"):
        serve_args("http://x", burstiness=0.5)
    plain = command_line(serve_args("http://x"))
    assert "--burstiness" not in plain and "--input-len" not in plain and "--request-rate inf" in plain
    assert "--request-rate 4 --burstiness 1 " in command_line(serve_args("http://x", request_rate=4.0))  # the default
    assert "--burstiness 0.5 " in command_line(serve_args("http://x", request_rate=4.0, burstiness=0.5))
    assert "--input-len 128" in command_line(serve_args("http://x", dataset="random"))
    assert "--input-len 512" in command_line(serve_args("http://x", dataset="random", input_len=512))


def test_unreachable_server_is_a_clean_error(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    rc, io = bench(["--url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2"], capsys)
    assert rc == 2 and io.err.startswith("error: the warm-up request failed: ConnectError")


def test_course_prompts_are_reproducible():
    from nanoserve.bench.prompts import SHARED_SYSTEM_PROMPT, course_prompts

    a, b = course_prompts(200, seed=5), course_prompts(200, seed=5)
    assert a == b and a != course_prompts(200, seed=6)
    kinds = [p["kind"] for p in a]
    assert {"chat", "document", "system"} == set(kinds) and 70 < kinds.count("chat") < 130
    for p in a:
        if p["kind"] == "system":
            assert p["messages"][0] == {"role": "system", "content": SHARED_SYSTEM_PROMPT}
        lo, hi = {"chat": (32, 128), "document": (16, 64), "system": (32, 96)}[p["kind"]]
        assert lo <= p["output_len"] <= hi
    assert {p["kind"] for p in course_prompts(20, kinds=["document"])} == {"document"}
