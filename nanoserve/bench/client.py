"""Chapter 09 — one streamed request to any OpenAI-compatible server, stamped with the client's clock.

Raw httpx and server-sent events, so nothing sits between the wire and `time.perf_counter()`:

    POST /v1/chat/completions {"stream": true, "stream_options": {"include_usage": true}, ...}
    data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}        no output: not a chunk time
    data: {"choices": [{"delta": {"content": "Hel"}}]}                         chunk_times += [now]
    data: {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]} chunk_times += [now]
    data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}   the token counts
    data: [DONE]                                                                end = now

Output tokens come from `usage`; a server that sends none gets its text counted by `count_tokens`
(the model's own tokenizer), never by chunks: one chunk may carry several tokens, or none.
"""

import json
import time

import httpx

from nanoserve.metrics import RequestRecord


def request_body(item: dict, model: str, endpoint: str, max_tokens: int, ignore_eos: bool) -> dict:
    """The JSON body for one prompt-set item; greedy, so reruns compare the same work."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's (and nanoserve's) extension: exactly max_tokens tokens
    if endpoint == "chat":
        body["messages"] = item["messages"]
    else:  # a completion of the conversation's text, without a chat template
        body["prompt"] = "\n\n".join(m["content"] for m in item["messages"])
    return body


def _error_message(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


async def send(client: httpx.AsyncClient, url: str, body: dict, count_tokens=None,
               on_first=None) -> tuple[RequestRecord, str]:
    """(the request's RequestRecord, its generated text). Never raises for a failed request: the record says so.
    on_first(text), if given, runs as the first chunk with output arrives (bench mlperf's first-token stamp)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    record, text = RequestRecord(start=time.perf_counter()), []
    usage, done = None, False
    try:
        async with client.stream("POST", url.rstrip("/") + path, json=body) as response:
            if response.status_code != 200:
                record.success, record.error = False, _error_message(response.status_code, await response.aread())
                return record, ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"error in stream: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta", {}).get("content") if "messages" in body else choice.get("text")
                    if delta:
                        record.chunk_times.append(time.perf_counter())
                        if on_first is not None and not text:
                            on_first(delta)
                        text.append(delta)
        record.end = time.perf_counter()
        if not done:  # cut off (llama-cpp-python's server drops a stream when a newer request interrupts it)
            raise RuntimeError("the stream ended before data: [DONE]")
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        record.success, record.error = False, f"{type(e).__name__}: {e}"
        return record, "".join(text)
    text = "".join(text)
    if usage:
        record.prompt_tokens, record.output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    elif count_tokens is not None:
        record.output_tokens = count_tokens(text)
    else:
        record.success, record.error = False, "the server sent no usage and no tokenizer was given to count tokens"
    return record, text
