"""Exercise 8.2 — one request's SSE stream: engine outputs in, OpenAI's server-sent events out, stop strings
held back, n > 1 completions interleaved.

Mirror of nanoserve/server/streaming.py (same names, same signatures). Read chapter 08, section 4
("Streaming without showing a stop string"), and README.md's design questions for 8.2; then write the three
functions below (one rung: the tests of 8.2 grade them together). `sse` and `usage` are given.

A RequestOutput (nanoserve/engine/llm_engine.py) carries: index (which of the n completions), text (that
completion's whole text so far, already cut before a stop string once it stopped), finish_reason (that
completion's end: "stop", "length", "abort" or None), finished (the whole *request's* end: its last output),
token_ids, prompt_token_ids, logprobs.

Grade it:      make grade CH=08 EX=8.2
See it serve:  python -m nanoserve serve --student 08     (the server streams with YOUR code)
"""

from collections.abc import AsyncIterator

from nanoserve.engine.llm_engine import RequestOutput
from nanoserve.server.protocol import error_body  # noqa: F401 — error_body(message, 500)
from nanoserve.server.streaming import sse, usage  # noqa: F401 — given: one SSE event; a usage dict


def stop_hold_back(text: str, stop: list[str]) -> int:
    """How many characters at the end of `text` could still be the start of a stop string.

        stop_hold_back("Hello.\\nUs", ["\\nUser:"]) == 3      ("\\nUs" may become "\\nUser:")
        stop_hold_back("Hello", ["\\nUser:"]) == 0

    Only *proper* prefixes count (a whole stop string would already have ended the request), and
    with several stop strings the longest tail wins.
    """
    raise NotImplementedError("Exercise 8.2: the longest tail of text that is a proper prefix of a stop string")


async def text_deltas(outputs: AsyncIterator[RequestOutput], stop: list[str]) -> AsyncIterator[tuple[str, RequestOutput]]:
    """(text to send now, the output) per engine output.

    What must hold, for each completion (out.index) on its own:
      - the deltas it is sent concatenate to exactly its final text, and every prefix of them is a prefix of
        that final text: nothing of a stop string is ever sent, not even its first character;
      - nothing is held back from a completion once *it* has ended, whether or not the request has (with n > 1
        one completion may end while the others go on);
      - an output that frees no text is skipped, except the one that ends the completion (it carries the
        finish_reason)."""
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
    include_usage: every chunk has "usage": None, and a last chunk has "choices": [] and
                 "usage": usage(last_0, last_1, ...), the last output of every completion (n of them)
    errors: error_body(str(e), getattr(e, "status", 500), getattr(e, "param", None)) as one event.
    Last of all: sse("[DONE]").
    logprobs: None, and every choice's "logprobs" stays None; otherwise a function you call with the
    TokenLogprobs (out.logprobs, a list or None) of the tokens since that completion's last chunk: its result
    is the choice's "logprobs" (the server's graded tests give None; `--student` serves logprobs with it).
    n > 1: each chunk's choice carries its completion's index; in chat, each completion's first chunk is its role
    chunk; the usage counts the prompt once and the tokens of every completion."""
    raise NotImplementedError("Exercise 8.2: OpenAI chunks as server-sent events, from the deltas")
    yield  # an async generator, as the reference is
