"""Chapter 08 — the OpenAI-compatible HTTP server: FastAPI routes in front of the AsyncLLMEngine.

One chat request's journey:

    POST /v1/chat/completions  {"messages": [{"role": "user", "content": "Hi"}], "stream": true}
      guard         shutting down? 503 · API key? 401 · rate limit? 429 · queue full? 503   (no work spent yet)
      read body     > max_body_bytes? 413 · not Content-Type: application/json? 415
      JSON          NaN, Infinity, a lone surrogate ("\\ud800")? 400 naming the field
      pydantic      ChatCompletionRequest, strictly; a wrong field is a 400 naming it
      template      "<|im_start|>system ... <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
      tokenizer     [1, 9690, 198, ...]              the engine only ever sees these ids
      SamplingParams  no room for a reply? n × max_tokens past the bound? 400 (request_params.to_sampling_params)
      quota         the tenant's tokens/minute cannot cover prompt + n × max_tokens? 429 (reserved, refunded at the end)
      AsyncLLMEngine.add_request                     prompt too long, cannot fit the pool? 400
      steps         one RequestOutput per step the request sampled in
      streaming.py  deltas with stop strings held back -> `data: {chunk}` lines -> `data: [DONE]`

A client that disconnects cancels its handler; the cancellation runs the stream's `finally`,
which aborts the request, and its KV blocks are back in the pool at the next step boundary.
"""

import asyncio
import contextlib
import functools
import hmac
import sys
import time
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi import responses
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from nanoserve.engine.async_engine import (AsyncLLMEngine, EngineAsleep, EngineStepError, EngineUnavailable,
                                           LoRANotLoaded)
from nanoserve.server.engine_view import add_engine_view
from nanoserve.server.limits import Reservation, Tenant, TenantLimits, prefix_cache_salt
from nanoserve.server import tool_calls
from nanoserve.server.logprobs import chat_logprobs, completion_logprobs, echo_logprobs
from nanoserve.server.lora_routes import add_lora_routes
from nanoserve.server.sleep_routes import add_sleep_routes
from nanoserve.server.versions import EngineVersions, add_admin_routes
from nanoserve.structured.compiler import StructuredOutputError
from nanoserve.student import StudentCode
from nanoserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       RequestTimeout, TokenizeRequest, error_body, finite_json, parse_body)


class JSONResponse(responses.JSONResponse):
    """Every body strict JSON (finite_json): a non-finite float is null, never a 500 from the encoder."""

    def render(self, content) -> bytes:
        return finite_json(content, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class ServerConfig:
    model_name: str = "SmolLM2-135M-Instruct"
    api_key: str | None = None
    metrics_need_key: bool = False
    max_waiting_requests: int | None = None  # None: no bound
    rate_limit: float | None = None  # requests per second per key (or client address); None: off
    rate_burst: int = 10
    max_body_bytes: int = 1 << 20
    max_request_tokens: int = 1 << 16  # n * max_tokens may not exceed it (one request cannot ask for hours of work)
    default_max_tokens: int | None = None  # chat's max_tokens when the client gives none; None: what the context leaves
    api_keys: dict[str, Tenant] | None = None  # --api-keys FILE: key -> tenant (its limits and priority)
    request_timeout: float | None = None  # seconds from arrival to the last token; None: none
    body_timeout: float = 30.0  # seconds a client may take to send its body
    retry_after_s: int = 1  # what a 503 for a full queue tells the client
    student: bool | str | list[str] = False  # with chapter 08 selected: the learner's exercises/08-http-serving/
    metrics_compat: str | None = None  # "vllm": /metrics also under vLLM's names (chapter 16)
    # chapter 15's blue-green update: POST /admin/reload exists only with an admin key (never an API key's);
    # `weights` names the first version (nanoserve-<weights>-1), warmup_requests: a shadow's warm-up
    admin_key: str | None = None
    weights: str = "fp32"
    warmup_requests: int = 4
    engine_view: bool = True  # chapter 12's GET /engine and /engine/events (a fleet, chapter 16, has no one engine)


class ServerState:
    """What the routes share: the engine, the tokenizer, the limits, and whether we are draining.
    `loader(weights, model_file) -> LLMEngine`: how a reload builds the next version (chapter 15; None: none)."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, config: ServerConfig, stat_logger=None,
                 student: StudentCode | None = None, loader=None):
        self.tokenizer, self.config, self.stat_logger = tokenizer, config, stat_logger
        # with --student 08 the learner's exercises/08-http-serving/ files where finished (8.1, 8.2, 8.4; 8.3 is
        # the AsyncLLMEngine handed in: runner.server_state builds it from the same StudentCode)
        self.student = student if student is not None else StudentCode(config.student)
        self.request_params = self.student.module("nanoserve.server.request_params")
        self.streaming = self.student.module("nanoserve.server.streaming")
        self.limits = self.student.module("nanoserve.server.limits")
        if "08" in self.student.chapters:
            print(self.student.describe("the server runs", idle=False), file=sys.stderr)
        warmup = tokenizer.encode_chat([{"role": "user", "content": "Hello"}]) if loader is not None else ()
        # chapter 15: the version serving new requests (state.engine) and those still finishing
        self.versions = EngineVersions(engine, config.weights, loader, warmup, config.warmup_requests)
        self.limiter = self.limits.TokenBucketLimiter(config.rate_limit, config.rate_burst) if config.rate_limit else None
        self.tenants = TenantLimits(config.api_keys or {})
        self.draining = False  # set at shutdown: new requests get 503 while running streams finish
        self.max_model_len = engine.max_model_len
        self.max_seq_len = engine.max_seq_len  # prompt + output, bounded by the context and the KV pool

    @property
    def engine(self) -> AsyncLLMEngine:
        """The current version's engine: the one a request arriving now is served by."""
        return self.versions.current.engine

    def close(self) -> None:
        """Stop every version's engine thread, then let the engines go. FastAPI keeps each route function — a
        closure over this state — in a cache for the life of the process, so a state that held its engines after
        its server stopped would keep every model served in this process in memory (each round of a benchmark,
        each server a notebook started)."""
        self.versions.shutdown()
        self.versions = None

    def count(self, tenant: str | None, outcome: str, tokens: int = 0) -> None:
        """A tenant's request (outcome) or tokens, in the metrics (nothing without tenants or metrics)."""
        if tenant is None or self.stat_logger is None:
            return
        if outcome:
            self.stat_logger.tenant_requests.labels(self.config.model_name, tenant, outcome).inc()
        if tokens:
            self.stat_logger.tenant_tokens.labels(self.config.model_name, tenant).inc(tokens)

    def spend(self, reservation: Reservation, tokens: int) -> None:
        """A request used `tokens` (its prompt, its generated tokens): paid from its quota reservation, counted."""
        reservation.spend(tokens)
        self.count(reservation.tenant, "", tokens)

    async def metered(self, request_id: str, outputs, reservation: Reservation, deadline: float | None,
                      timeout: float | None, engine: AsyncLLMEngine | None = None, stream: bool = False):
        """The engine's outputs, each generated token paid from the tenant's reservation (what is left of it goes
        back when the request ends, chapter 08's quotas); past `deadline` (the event
        loop's clock) a RequestTimeout; a request the scheduling policy refused (chapter 15, --slo-reject)
        an APIError 503 with Retry-After, counted in slo_rejections_total{stream} (not a failure: the 5xx alert
        leaves it out) — in a stream, an error event then [DONE]. Leaving early aborts the request on
        `engine` (the version it runs on; default the current one) — explicitly: closing `outputs` would
        not if it never started (a deadline already past, a client gone before the first token)."""
        engine, tenant = engine or self.engine, reservation.tenant
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while True:
                left = None if deadline is None else deadline - loop.time()
                try:
                    if left is not None and left <= 0:
                        raise TimeoutError
                    out = await asyncio.wait_for(anext(outputs), left)
                except StopAsyncIteration:
                    finished = True
                    return
                except TimeoutError:
                    self.count(tenant, "timed_out")
                    raise RequestTimeout(timeout) from None
                if getattr(out, "reject_reason", None):
                    if self.stat_logger is not None:
                        self.stat_logger.slo_rejections.labels(self.config.model_name, str(stream).lower()).inc()
                    raise APIError(503, out.reject_reason, "ttft_slo_ms",
                                   headers={"Retry-After": str(self.config.retry_after_s)})
                self.spend(reservation, len(out.new_token_ids))
                yield out
        finally:
            reservation.close()
            if not finished:
                engine.abort(request_id)  # at the next step boundary; a finished id is ignored
            await outputs.aclose()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="nanoserve", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=JSONResponse)
    app.state.nanoserve = state
    cfg = state.config

    @app.middleware("http")
    async def count_responses(request: Request, call_next):  # chapter 15's 5xx-rate alert reads this
        response = await call_next(request)
        if state.stat_logger is not None:
            state.stat_logger.record_response(response.status_code)
        return response

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)  # unknown route (404), wrong method (405)
    async def http_error(_, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return JSONResponse(error_body(str(e.errors()[0]["msg"]), 400), 400)

    keys = [(k.encode(), None) for k in [cfg.api_key] if k] + [(k.encode(), t) for k, t in (cfg.api_keys or {}).items()]

    def check_key(request: Request) -> Tenant | None:
        """The tenant of the request's verified key (None: the single --api-key, or no keys at all)."""
        if not keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found, given = False, key.encode()
        for known, tenant in keys:
            # compare_digest takes as long for a near miss as for a far one: the key cannot be guessed byte by byte
            if hmac.compare_digest(given, known) and scheme.lower() == "bearer":
                found, who = True, tenant
        if not found:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None)
        return who

    async def guard(request: Request) -> None:  # async: run on the event loop, not in a thread pool
        """Cheap refusals first, before any tokenizing: draining, auth, rate limit. The tenant of the
        verified key (or None) lands in request.state.tenant."""
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(cfg.retry_after_s)})
        tenant = check_key(request)
        request.state.tenant, request.state.priority = (tenant.name, tenant.priority) if tenant else (None, 0)
        request.state.operator = tenant is not None and tenant.is_operator
        if state.limiter is not None:
            # a verified key's tenant, or the client's address: never an unverified header, which anyone can vary
            who = (f"tenant:{tenant.name}" if tenant else "key") if keys else \
                (request.client.host if request.client else "?")
            wait = state.limiter.try_acquire(who)
            if wait:
                raise state.limits.too_many_requests(wait, f"rate limit of {cfg.rate_limit:g} requests/s exceeded")
        if tenant is not None:
            wait, why = state.tenants.admit(tenant.name)
            if wait:
                state.count(tenant.name, "rate_limited")
                raise state.limits.too_many_requests(wait, why)
        request.state.arrival = asyncio.get_running_loop().time()

    def check_queue() -> None:
        # the decision is exercise 8.4's; with no bound (always so for chapter 16's fleets, whose queues are not
        # here) there is nothing to count
        waiting = 0 if cfg.max_waiting_requests is None else state.engine.num_requests_waiting
        state.limits.check_queue(waiting, cfg.max_waiting_requests, cfg.retry_after_s)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {cfg.max_body_bytes}")
        # JSON only when it says so: a text/plain (or form) POST is a "simple" request a browser sends cross-site
        # without asking first (no CORS preflight); application/json is not
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the request body must be sent as Content-Type: application/json, "
                                f"got {media_type[:64] or 'none'!r}")
        body = bytearray()
        try:  # a body trickling in byte by byte holds a connection, not the server: cut it at body_timeout
            async with asyncio.timeout(cfg.body_timeout):
                async for part in request.stream():
                    body += part
                    if len(body) > cfg.max_body_bytes:
                        raise APIError(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes")
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {cfg.body_timeout:g} s") from None
        return bytes(body)

    def check_model(name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (chapter 19), None for the base model; 404 for anything else."""
        if name is None or name == cfg.model_name:
            return None
        if name in state.engine.lora_names:
            return name
        served = ", ".join(repr(n) for n in (cfg.model_name, *state.engine.lora_names))
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served}", "model")

    def chat_prompt_ids(req) -> list[int]:
        messages = tool_calls.template_messages(req)  # chapter 13: tools offered, calls and their results
        try:
            return state.tokenizer.encode_chat(messages)
        except (ValueError, TemplateError) as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", "messages") from None

    async def generate(request: Request, req, prompt_ids: list[int], kind: str):
        """Hand the ids to the engine; then stream SSE or answer once."""
        if req.requested_max_tokens is None and cfg.default_max_tokens is not None:  # chat without max_tokens
            room = state.max_seq_len - len(prompt_ids)
            if room >= 1:  # (no room at all: to_sampling_params' 400 says so)
                req.max_tokens = min(cfg.default_max_tokens, room)
        params = state.request_params.to_sampling_params(req, len(prompt_ids), state.max_seq_len,
                                                         cfg.max_request_tokens)  # exercise 8.1
        tools = getattr(req, "tool_plan", None)  # chapter 13: the reply is read for tool calls when offered
        tools = tools if tools is not None and tools.offered else None
        if tools is not None and req.stream and params.logprobs is not None:
            raise APIError(400, "logprobs with tools in a stream is not supported by this server", "logprobs")
        lora_name = check_model(req.model)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        tenant = request.state.tenant
        # what it may cost, taken from the tenant's quota now (429 if not there), the unused part refunded at the end
        try:
            reservation = state.tenants.reserve(tenant, len(prompt_ids) + params.n * params.max_tokens)
        except APIError:  # the quota's 429 is a rate-limited request in the tenant's metrics, as admission's is
            state.count(tenant, "rate_limited")
            raise
        try:
            with state.versions.lease() as served:  # chapter 15: this request's version, to its last token
                outputs = await served.engine.add_request(request_id, prompt_ids, params, request.state.priority,
                                                          tenant=tenant, slo=req.slo_targets(),
                                                          speculative=req.speculative,
                                                          cache_salt=prefix_cache_salt(tenant, req.cache_salt),
                                                          lora_name=lora_name,
                                                          kv_transfer_params=req.kv_transfer_params)
        except BaseException as e:
            reservation.close()  # refused: nothing was spent
            if isinstance(e, LoRANotLoaded):  # chapter 19: unloaded since check_model let it through
                raise APIError(404, str(e), "model") from None
            if isinstance(e, StructuredOutputError):  # chapter 13: the grammar does not compile, or is too large
                raise APIError(400, str(e), "tools" if tools is not None else "response_format") from None
            if isinstance(e, ValueError):  # too long for the context, can never fit the KV pool, a bad token id
                named = [f for f in ("kv_transfer_params", "logit_bias", "stop_token_ids", "max_tokens", "ttft_slo_ms",
                                     "tpot_slo_ms")
                         if f in str(e)]  # the field named
                raise APIError(400, str(e), named[0] if named else None) from None
            # stopped, a fleet whose replicas did not answer, or a model asleep (chapter 19): come back
            if isinstance(e, (EngineUnavailable, EngineAsleep)):
                raise APIError(503, str(e), headers={"Retry-After": str(cfg.retry_after_s)}) from None
            raise
        state.count(tenant, "admitted")
        state.spend(reservation, len(prompt_ids))
        timeout = min((t for t in (cfg.request_timeout, req.timeout) if t is not None), default=None)
        deadline = None if timeout is None else request.state.arrival + timeout
        outputs = state.metered(request_id, outputs, reservation, deadline, timeout, served.engine, req.stream)
        base = {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": lora_name or cfg.model_name, "system_fingerprint": served.name}
        shape = None
        if params.logprobs is not None:  # the choice's `logprobs` in the endpoint's own shape
            shape = functools.partial(chat_logprobs if kind == "chat" else completion_logprobs, state.tokenizer)
        if req.stream:
            if tools is not None:  # chapter 13: content and tool_calls deltas
                lines = tool_calls.openai_tool_stream(outputs, tools, params.stop, base, req.include_usage)
            else:
                lines = state.streaming.openai_stream(outputs, params.stop, kind, base, req.include_usage, logprobs=shape)
            # the abort after the response also covers a client gone before the stream began (nothing to close)
            return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(abort_async, served.engine, request_id, reservation))
        try:
            finals = await until_done_or_disconnect(request, outputs)
        except EngineStepError as e:
            raise APIError(500, str(e)) from None
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = [({"index": f.index, "message": {"role": "assistant", "content": f.text}} if kind == "chat"
                    else {"index": f.index, "text": f.text})
                   | {"logprobs": shape and shape(f.logprobs), "finish_reason": f.finish_reason}
                   for f in finals]
        for choice, f in zip(choices, finals) if tools is not None else ():  # chapter 13: calls -> tool_calls
            choice["message"], choice["finish_reason"] = tool_calls.message(tools, f.text, f.finish_reason)
        usage = state.streaming.usage(*finals)
        if kind == "completion" and req.echo:
            usage = echo_choices(req, prompt_ids, finals, choices, usage)
        transfer = {"kv_transfer_params": finals[0].kv_transfer_params} if finals[0].kv_transfer_params else {}
        return {**base, "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": choices, "usage": usage} | transfer  # chapter 17: a prefill engine's answer to the proxy

    def echo_choices(req, prompt_ids: list[int], finals: list, choices: list, usage: dict) -> dict:
        """Completions with echo (chapter 08): each choice's text starts with the prompt's, its logprobs with
        the prompt's (RequestOutput.prompt_logprobs); with max_tokens 0 (score_only) the one token generated
        is dropped. Returns the usage to report (no completion tokens when nothing was asked for)."""
        prompt_text = req.prompt if isinstance(req.prompt, str) else state.tokenizer.decode(prompt_ids)
        for choice, f in zip(choices, finals):
            generated, entries = ("", []) if req.score_only else (f.text, f.logprobs or [])
            choice["text"] = prompt_text + generated
            if req.score_only:
                choice["finish_reason"] = "length"  # as OpenAI's: max_tokens 0 reached at once
            if req.logprobs is not None:
                choice["logprobs"] = echo_logprobs(state.tokenizer, prompt_ids, f.prompt_logprobs or [None], entries)
        if not req.score_only:
            return usage
        return usage | {"completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

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
        prompts = req.prompts
        if len(prompts) == 1:
            return await generate(request, req, encode_prompt(prompts[0]), "completion")
        if req.stream:
            raise APIError(400, "a list of prompts with `stream` is not supported by this server: stream one "
                                "request per prompt", "prompt")
        work = len(prompts) * req.n * req.requested_max_tokens  # the batch is one request: its work is bounded once
        if work > cfg.max_request_tokens:
            raise APIError(400, f"{len(prompts)} prompts * n * max_tokens = {len(prompts)} * {req.n} * "
                                f"{req.requested_max_tokens} exceeds this server's bound of {cfg.max_request_tokens} "
                                f"generated tokens per request", "prompt")
        return await batch(request, req, prompts)

    def encode_prompt(prompt: str | list[int]) -> list[int]:
        return state.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    async def batch(request: Request, req: CompletionRequest, prompts: list) -> dict | Response:
        """OpenAI's legacy batch: each prompt its own engine request (they run side by side), answered together;
        the choices of prompt i are indices i*n ... i*n + n-1 and the usage is the sum. One refused prompt
        refuses the batch, and the others are aborted (the task group cancels them)."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(generate(request, req.model_copy(update={"prompt": p}), encode_prompt(p),
                                                    "completion")) for p in prompts]
        except BaseExceptionGroup as e:
            raise e.exceptions[0] from None
        answers = [t.result() for t in tasks]
        if any(isinstance(a, Response) for a in answers):
            return Response(status_code=499)  # the client is gone
        choices = [c | {"index": i * req.n + c["index"]} for i, a in enumerate(answers) for c in a["choices"]]
        usage = {k: sum(a["usage"][k] for a in answers) for k in answers[0]["usage"]}
        return answers[0] | {"choices": choices, "usage": usage}

    def model_card(lora_name: str | None = None) -> dict:
        card = {"id": lora_name or cfg.model_name, "object": "model", "created": 0, "owned_by": "nanoserve",
                "max_model_len": state.max_model_len, "default_max_tokens": cfg.default_max_tokens,
                "version": state.versions.current.name}  # chapter 15's reloads
        return card if lora_name is None else card | {"parent": cfg.model_name}  # chapter 19: an adapter's base

    @app.get("/v1/models", dependencies=[Depends(guard)])
    async def models():
        return {"object": "list", "data": [model_card(), *(model_card(n) for n in state.engine.lora_names)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(guard)])  # client.models.retrieve(name)
    async def model(model_id: str):
        return model_card(check_model(model_id))  # an unknown id: 404 in OpenAI's error format, param "model"

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

    def operator_only(request: Request) -> None:
        """The routes that show the whole server (/metrics, chapter 16's /replicas): with tenants an operator's key
        (role "operator" in the keys file: they count every tenant's requests and tokens, and the prefix cache's
        hits), else the API key if there is one. 401 without a valid key, 403 with a tenant's."""
        tenant = check_key(request)
        if cfg.api_keys and not (tenant is not None and tenant.is_operator):
            raise APIError(403, "this key is a tenant's: this route needs an operator key (role = \"operator\")")

    app.state.operator_only = operator_only  # for routes added beside these (chapter 16's /replicas)

    async def viewer(request: Request) -> tuple[str | None, str | None]:
        """/engine/events (chapter 12): (the tenant whose stream limit it counts against, the tenant whose requests
        it shows); (None, None) for an operator, or a server without tenants (its one key, if any, is checked)."""
        await guard(request)  # a stream is a request: the key, the rate limit, the tenant's admission
        tenant = request.state.tenant
        return (None, None) if tenant is None or request.state.operator else (tenant, tenant)

    @app.get("/metrics")
    async def metrics(request: Request):
        if cfg.api_keys or cfg.metrics_need_key:
            operator_only(request)
        if state.stat_logger is None:
            raise APIError(404, "this server was started without metrics")
        return Response(state.stat_logger.scrape(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if cfg.engine_view:
        add_engine_view(app, state, viewer)  # chapter 12: GET /engine, the live page, and its /engine/events
    if cfg.admin_key:  # chapter 15; without an admin key there is no admin route at all (404, as any unknown path)
        add_admin_routes(app, state, read_body)
        add_sleep_routes(app, state, read_body)  # chapter 19: POST /sleep, /wake_up, GET /is_sleeping
        if state.engine.lora_enabled:  # chapter 19: only where the engine has LoRA layers to load into
            add_lora_routes(app, state, read_body)
    return app


async def abort_async(engine: AsyncLLMEngine, request_id: str, reservation: Reservation) -> None:
    engine.abort(request_id)  # ignored if it finished
    reservation.close()  # a no-op once the stream closed it


async def until_done_or_disconnect(request: Request, outputs):
    """The final RequestOutput of each completion, by index (one unless n > 1), or None if the client went
    away first (the request is then aborted). Each final's `logprobs` holds those of all its tokens, its
    `prompt_logprobs` those of the prompt (echo; None when not asked)."""

    async def last():
        finals, logprobs, prompt_logprobs = {}, {}, {}
        async for out in outputs:
            finals[out.index] = out
            logprobs.setdefault(out.index, []).extend(out.logprobs or [])
            if getattr(out, "prompt_logprobs", None) is not None:  # echo: on the first output only
                prompt_logprobs[out.index] = out.prompt_logprobs
        for i, out in finals.items():
            out.logprobs = logprobs[i]
            out.prompt_logprobs = prompt_logprobs.get(i)
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
