"""Chapter 08 — the OpenAI-compatible HTTP server: FastAPI routes in front of the AsyncLLMEngine.

One chat request's journey:

    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "Hi"}], "stream": true}
      guard         shutting down? 503 · API key? 401 · rate limit? 429 · queue full? 503   (no work spent yet)
      read body     > max_body_bytes? 413
      pydantic      ChatCompletionRequest, strictly; a wrong field is a 400 naming it
      template      "<|im_start|>system ... <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
      tokenizer     [1, 9690, 198, ...]              the engine only ever sees these ids
      AsyncLLMEngine.add_request                     prompt too long, cannot fit the pool? 400
      steps         one RequestOutput per step the request sampled in
      streaming.py  deltas with stop strings held back -> `data: {chunk}` lines -> `data: [DONE]`

A client that disconnects cancels its handler; the cancellation runs the stream's `finally`,
which aborts the request, and its KV blocks are back in the pool at the next step boundary.
"""

import asyncio
import contextlib
import hmac
import time
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from nanoserve.engine.async_engine import AsyncLLMEngine, EngineStepError
from nanoserve.server.engine_view import add_engine_view
from nanoserve.server.limits import TokenBucketLimiter
from nanoserve.student import StudentCode
from nanoserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, error_body, parse_body)


@dataclass
class ServerConfig:
    model_name: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    metrics_need_key: bool = False
    max_waiting_requests: int | None = None  # None: no bound
    rate_limit: float | None = None  # requests per second per key (or client address); None: off
    rate_burst: int = 10
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1  # what a 503 for a full queue tells the client
    student: bool | str | list[str] = False  # with chapter 08 selected: the learner's exercises/08-http-serving/streaming.py
    metrics_compat: str | None = None  # "vllm": /metrics also under vLLM's names (chapter 16)


class ServerState:
    """What the routes share: the engine, the tokenizer, the limits, and whether we are draining."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, config: ServerConfig, stat_logger=None):
        self.engine, self.tokenizer, self.config, self.stat_logger = engine, tokenizer, config, stat_logger
        self.limiter = TokenBucketLimiter(config.rate_limit, config.rate_burst) if config.rate_limit else None
        self.draining = False  # set at shutdown: new requests get 503 while running streams finish
        self.max_model_len = engine.engine.max_model_len
        self.max_seq_len = engine.engine.max_seq_len  # prompt + output, bounded by the context and the KV pool
        # with --student the learner's exercises/08-http-serving/streaming.py writes the SSE stream (if finished)
        self.streaming = StudentCode(config.student).module("nanoserve.server.streaming")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanoserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nanoserve = state
    cfg = state.config

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)  # unknown route (404), wrong method (405)
    async def http_error(_, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return JSONResponse(error_body(str(e.errors()[0]["msg"]), 400), 400)

    def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # compare_digest takes as long for a near miss as for a far one: the key cannot be guessed byte by byte
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(), cfg.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None)

    async def guard(request: Request) -> None:  # async: run on the event loop, not in a thread pool
        """Cheap refusals first, before any tokenizing: draining, auth, rate limit."""
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(cfg.retry_after_s)})
        check_key(request)
        if state.limiter is not None:
            who = request.headers.get("authorization") or (request.client.host if request.client else "?")
            wait = state.limiter.try_acquire(who)
            if wait:
                raise APIError(429, f"rate limit of {cfg.rate_limit:g} requests/s exceeded; retry in {wait:.2f} s",
                               headers={"Retry-After": str(max(1, round(wait + 0.5)))})

    def check_queue() -> None:
        waiting = state.engine.num_unfinished_requests() - state.engine.num_requests_running
        if cfg.max_waiting_requests is not None and waiting >= cfg.max_waiting_requests:
            raise APIError(503, f"the server is busy: {waiting} requests are waiting (max {cfg.max_waiting_requests})",
                           headers={"Retry-After": str(cfg.retry_after_s)})

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {cfg.max_body_bytes}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > cfg.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes")
        return bytes(body)

    def check_model(name: str | None) -> str:
        if name is not None and name != cfg.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {cfg.model_name!r}", "model")
        return cfg.model_name

    def chat_prompt_ids(req) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            return state.tokenizer.encode_chat(messages)
        except (ValueError, TemplateError) as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None

    async def generate(request: Request, req, prompt_ids: list[int], kind: str):
        """Hand the ids to the engine; then stream SSE or answer once."""
        max_tokens = req.requested_max_tokens
        if max_tokens is None:  # as vLLM: whatever the context (here: and the KV pool) leaves
            max_tokens = state.max_seq_len - len(prompt_ids)
            if max_tokens < 1:
                raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, this server holds at most "
                                    f"{state.max_seq_len} per request: no room for a reply", "messages")
        params = req.sampling_params(max_tokens)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            outputs = await state.engine.add_request(request_id, prompt_ids, params)
        except ValueError as e:  # too long for the context, can never fit the KV pool, a bad token id
            raise APIError(400, str(e), "max_tokens" if "max_tokens" in str(e) else None) from None
        base = {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": cfg.model_name}
        if req.stream:
            lines = state.streaming.openai_stream(outputs, params.stop, kind, base, req.include_usage)
            return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            finals = await until_done_or_disconnect(request, outputs)
        except EngineStepError as e:
            raise APIError(500, str(e)) from None
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = [({"index": f.index, "message": {"role": "assistant", "content": f.text}} if kind == "chat"
                    else {"index": f.index, "text": f.text}) | {"logprobs": None, "finish_reason": f.finish_reason}
                   for f in finals]
        body = {**base, "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": choices, "usage": state.streaming.usage(*finals)}
        return JSONResponse(body)

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat_completions(request: Request):
        check_queue()
        req = parse_body(await read_body(request), ChatCompletionRequest)
        check_model(req.model)
        return await generate(request, req, chat_prompt_ids(req), "chat")

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(request: Request):
        check_queue()
        req = parse_body(await read_body(request), CompletionRequest)
        check_model(req.model)
        ids = state.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        return await generate(request, req, ids, "completion")

    @app.get("/v1/models", dependencies=[Depends(guard)])
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "nanoserve", "max_model_len": state.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(guard)])
    async def tokenize(request: Request):
        req = parse_body(await read_body(request), TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, 'give exactly one of "prompt" or "messages"', "prompt")
        ids = state.tokenizer.encode(req.prompt) if req.prompt is not None else chat_prompt_ids(req)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(guard)])
    async def detokenize(request: Request):
        req = parse_body(await read_body(request), DetokenizeRequest)
        check_model(req.model)
        try:
            return {"prompt": state.tokenizer.decode(req.tokens)}
        except ValueError as e:
            raise APIError(400, str(e), "tokens") from None

    @app.get("/health")
    async def health():
        if state.draining or not state.engine.is_running:
            return JSONResponse({"status": "unavailable"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        if cfg.metrics_need_key:
            check_key(request)
        if state.stat_logger is None:
            raise APIError(404, "this server was started without metrics")
        return Response(state.stat_logger.scrape(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_engine_view(app, state, check_key)  # chapter 12: GET /engine, the live page, and its /engine/events
    return app


async def until_done_or_disconnect(request: Request, outputs):
    """The final RequestOutput of each completion, by index (one unless n > 1), or None if the client went
    away first (the request is then aborted)."""

    async def last():
        finals = {}
        async for out in outputs:
            finals[out.index] = out
        return [finals[i] for i in sorted(finals)]

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(last()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (a shutdown past its drain timeout)
        gone.cancel()
        if not work.done():
            work.cancel()  # its `async for` ends with CancelledError; the stream's finally aborts the request
    with contextlib.suppress(asyncio.CancelledError):
        return await work  # an engine error raises here
    return None
