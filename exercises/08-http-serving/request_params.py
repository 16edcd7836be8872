"""Exercise 8.1 — a validated request becomes the engine's SamplingParams, or a 400 that names the field.

Mirror of nanoserve/server/request_params.py (same name, same signature). Read chapter 08, section 3
("Errors") and section 10 ("What compatible means"), and README.md's design questions for 8.1.

What you have: `req` is a ChatCompletionRequest or a CompletionRequest (nanoserve/server/protocol.py) that
pydantic has already checked field by field — types strictly, ranges, unknown fields refused. Its fields carry
OpenAI's names (temperature, top_p, n, stop, seed, logit_bias with *string* keys as JSON has them, ...) and
vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids). Four helpers on it are given:

    req.requested_max_tokens    the client's max_tokens (chat: max_completion_tokens or max_tokens), or the
                                endpoint's own default; None when the endpoint leaves it to the server;
                                raises its own APIError when chat's two bounds disagree
    req.num_logprobs            the top logprobs to return per token (None: none); raises its own APIError
    req.num_prompt_logprobs     the same for every prompt token (completions with echo), None otherwise
    req.structured_params()     the grammar the output must follow, or None; raises its own APIError

Grade it:      make grade CH=08 EX=8.1
See it serve:  python -m nanoserve serve --student 08
"""

from nanoserve.sampling import SamplingParams  # noqa: F401 — what you return
from nanoserve.server.protocol import APIError, ChatCompletionRequest  # noqa: F401 — APIError(400, message, param)


def to_sampling_params(req, num_prompt_tokens: int, max_seq_len: int, max_request_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a validated request, or APIError(400, message, param).

    num_prompt_tokens: the prompt's length in tokens; max_seq_len: the most tokens (prompt + output) one request
    may hold on this server (its context and its KV pool); max_request_tokens: the most generated tokens one
    request may ask for, all its completions together.

    What must hold:
      - max_tokens: the client's if it gave one, else the endpoint's default; where the endpoint has none (chat),
        all the room the prompt leaves. A prompt that leaves no room (whatever max_tokens is) is a 400 whose
        message gives both numbers and whose param is the field that holds the prompt ("messages" for chat,
        "prompt" for completions);
      - a request whose completions together may generate more than max_request_tokens is a 400, param "n" —
        or, when its max_tokens alone is past that bound, the field that holds it ("max_tokens", or chat's
        "max_completion_tokens" when the client gave that one);
      - every sampling field reaches SamplingParams with its value (logit_bias keyed by int token ids), along
        with the logprobs, the prompt logprobs and the grammar the helpers give;
      - whatever SamplingParams refuses (ValueError: an empty stop string, ...) is a 400, never a 500, and its
        param is the field SamplingParams' message names first.

        chat, no max_tokens, 37-token prompt, max_seq_len 2048    -> SamplingParams(max_tokens=2011, ...)
        n 16, max_tokens 8192, max_request_tokens 65 536          -> APIError(400, ..., "n")
        n 1, max_tokens 10**9, max_request_tokens 65 536          -> APIError(400, ..., "max_tokens")
        stop [""]                                                 -> APIError(400, "stop must be ...", "stop")
    """
    raise NotImplementedError("Exercise 8.1: a validated request -> SamplingParams, or a 400 naming the field")
