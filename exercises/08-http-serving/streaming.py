"""Exercise 08 — one request's SSE stream: engine outputs in, OpenAI's server-sent events out.

Mirror of nanoserve/server/streaming.py (same names, same signatures). Read chapter 08, section 4
("Streaming without showing a stop string"), then fill in the three functions marked Exercise.
`sse` and `usage` are given (imported from the reference).

Grade it:      make grade CH=08
See it serve:  python -m nanoserve serve --student     (the server streams with YOUR code)
"""

from collections.abc import AsyncIterator

from nanoserve.engine.llm_engine import RequestOutput
from nanoserve.server.protocol import error_body  # noqa: F401 — for 8.3: error_body(message, 500)
from nanoserve.server.streaming import sse, usage  # noqa: F401 — given: one SSE event; a usage dict


def stop_hold_back(text: str, stop: list[str]) -> int:
    """How many characters at the end of `text` could still be the start of a stop string.

        stop_hold_back("Hello.\\nUs", ["\\nUser:"]) == 3      ("\\nUs" may become "\\nUser:")
        stop_hold_back("Hello", ["\\nUser:"]) == 0

    Only *proper* prefixes count (a whole stop string would already have ended the request), and
    with several stop strings the longest tail wins.
    """
    raise NotImplementedError("Exercise 8.1: the longest tail of text that is a proper prefix of a stop string")


async def text_deltas(outputs: AsyncIterator[RequestOutput], stop: list[str]) -> AsyncIterator[tuple[str, RequestOutput]]:
    """(text to send now, the output) per engine output; nothing held back once it is finished.
    Outputs that free no text are skipped, except the last (it carries the finish_reason).

    Each `out.text` is the whole text so far (the engine already cut it before a stop string at the end).
    Keep how many characters you sent; send up to len(out.text) - stop_hold_back(out.text, stop)."""
    raise NotImplementedError("Exercise 8.2: the deltas of the engine's text, holding back what may start a stop string")
    yield  # an async generator, as the reference is


async def openai_stream(outputs: AsyncIterator[RequestOutput], stop: list[str], kind: str, chunk: dict,
                        include_usage: bool = False, logprobs=None) -> AsyncIterator[str]:
    """The SSE lines of one request. kind: "chat" (choices carry a `delta`; the first chunk the role)
    or "completion" (choices carry `text`). chunk: the fields every chunk repeats (id, object, created,
    model). An engine error after the stream began is one `data: {"error": ...}` line, then [DONE].

    chat:        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 first, then one chunk per delta with {"content": delta} and the output's finish_reason
    completion:  {"index": 0, "text": delta, "logprobs": None, "finish_reason": ...}
    include_usage: every chunk has "usage": None, and a last chunk has "choices": [] and "usage": usage(out)
    errors: error_body(str(e), getattr(e, "status", 500)) as one event. Last of all: sse("[DONE]").
    logprobs: None, and every choice's "logprobs" stays None; otherwise a function you call with the
    TokenLogprobs (out.logprobs, a list or None) of the tokens since that completion's last chunk: its result
    is the choice's "logprobs" (the server's graded tests give None; `--student` serves logprobs with it)."""
    raise NotImplementedError("Exercise 8.3: OpenAI chunks as server-sent events, from the deltas")
    yield  # an async generator, as the reference is
