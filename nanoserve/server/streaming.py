"""Chapter 08 — one request's stream: engine outputs in, OpenAI's server-sent events out.

The engine hands us a RequestOutput per step, each carrying the text so far. The client wants
*deltas*, as SSE lines in OpenAI's chunk format, and never the start of a stop string:

    engine text so far        stop=["\\nUser:"]   sent        held back
    "Hello"                                      "Hello"     ""
    "Hello.\\nUs"                                 "."         "\\nUs"     (could become "\\nUser:")
    "Hello.\\nUser:" finished, cut to "Hello."    ""          -          (it did: never shown)

so the stream reads

    data: {"object": "chat.completion.chunk", "choices": [{"delta": {"role": "assistant", "content": ""}, ...}]}
    data: {... "choices": [{"delta": {"content": "Hello"}, "finish_reason": null}]}
    data: {... "choices": [{"delta": {"content": "."}, "finish_reason": null}]}
    data: {... "choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}
    data: [DONE]

Holding back only while the tail could still grow into a stop string keeps the sent text a prefix
of the final text at every step, so the deltas concatenate to exactly the non-streamed answer.
Exercise 8.2 (exercises/08-http-serving/streaming.py) writes stop_hold_back, text_deltas and openai_stream.
"""

from collections.abc import AsyncIterator

from nanoserve.engine.llm_engine import RequestOutput
from nanoserve.server.protocol import error_body, finite_json


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` (strict JSON, never NaN or Infinity) and a blank line."""
    return f"data: {data if isinstance(data, str) else finite_json(data)}\n\n"


def usage(*outs: RequestOutput) -> dict:
    """OpenAI's usage of one request from the final output of each of its completions (n of them)."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def stop_hold_back(text: str, stop: list[str]) -> int:
    """How many characters at the end of `text` could still be the start of a stop string.

        >>> stop_hold_back("Hello.\\nUs", ["\\nUser:"]), stop_hold_back("Hello", ["\\nUser:"])
        (3, 0)
    """
    longest = 0
    for s in stop:
        # a proper prefix only: a whole stop string would already have finished the request
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


async def text_deltas(outputs: AsyncIterator[RequestOutput], stop: list[str]) -> AsyncIterator[tuple[str, RequestOutput]]:
    """(text to send now, the output) per engine output; nothing held back once it is finished.
    Outputs that free no text are skipped, except the last (it carries the finish_reason).
    With n > 1 the outputs of the completions interleave: each has its own text (out.index)."""
    sent = {}  # index -> characters sent
    async for out in outputs:
        done = out.finish_reason is not None  # this completion's end (`finished`: the whole request's)
        end = len(out.text) if done else len(out.text) - stop_hold_back(out.text, stop)
        delta = out.text[sent.get(out.index, 0):end]
        sent[out.index] = max(sent.get(out.index, 0), end)
        if delta or done:
            yield delta, out


async def openai_stream(outputs: AsyncIterator[RequestOutput], stop: list[str], kind: str, chunk: dict,
                        include_usage: bool = False, logprobs=None) -> AsyncIterator[str]:
    """The SSE lines of one request. kind: "chat" (choices carry a `delta`; the first chunk the role)
    or "completion" (choices carry `text`). chunk: the fields every chunk repeats (id, object, created,
    model). An engine error after the stream began is one `data: {"error": ...}` line, then [DONE]
    (its code: the exception's `status` if it has one — 408 for a timeout — else 500).
    logprobs: None (every choice's "logprobs" is null), or a function from the TokenLogprobs of the tokens
    a chunk carries (out.logprobs of the outputs since that completion's last chunk) to its "logprobs"."""

    def event(choices: list[dict], **extra) -> str:
        return sse({**chunk, "choices": choices, **({"usage": None} if include_usage else {}), **extra})

    pending: dict[int, list] = {}  # index -> TokenLogprobs of tokens whose text has not been sent yet

    async def noting_logprobs():
        async for out in outputs:
            pending.setdefault(out.index, []).extend(out.logprobs or [])
            yield out

    def choice(text: str | None, finish_reason: str | None, role: bool = False, index: int = 0) -> dict:
        lp = None if logprobs is None or role else logprobs(pending.pop(index, []))
        if kind == "chat":
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    if kind == "chat":
        yield event([choice("", None, role=True)])
    finals = {}  # index -> the last output of each completion (n > 1: one chunk's choice carries its index)
    try:
        async for delta, out in text_deltas(noting_logprobs() if logprobs is not None else outputs, stop):
            if kind == "chat" and out.index not in finals and out.index != 0:
                yield event([choice("", None, role=True, index=out.index)])
            finals[out.index] = out
            yield event([choice(delta, out.finish_reason, index=out.index)])
        if include_usage:
            yield event([], usage=usage(*finals.values()))
    except Exception as e:  # noqa: BLE001 — the status line is long gone: the error travels in the stream
        yield sse(error_body(str(e), getattr(e, "status", 500), getattr(e, "param", None)))
    yield sse("[DONE]")
