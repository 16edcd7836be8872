"""Chapter 15 — blue-green model update: load a shadow engine, warm it, switch at a request boundary, retire the old.

The server holds one *current* version (an AsyncLLMEngine and its name); every request picks its version once,
when it enters, and stays on it to its last token. A reload builds the next version beside the current one:

    blue   nanoserve-fp32-1  serving ─────────────────────┬─ in-flight requests finish ─┐ thread stopped, dropped
    green  nanoserve-q4-2         load (a thread) · warm-up ┴─ switch: new requests ─────────────────────────────▶
                                  N requests, not counted  (one assignment, between two requests)

    versions = EngineVersions(AsyncLLMEngine(engine), "fp32", loader, warmup_prompt_ids=[1, 9690, 198])
    versions.current.name                        # 'nanoserve-fp32-1'
    with versions.lease() as served:             # a request's one choice of version
        outputs = await served.engine.add_request(...)
    await versions.reload(weights="q4")          # -> {"version": "nanoserve-q4-2", "previous": ..., ...}

Why it cannot drop a request: the switch is one assignment on the event loop, and a request holds a *lease* on
its version from the moment it picks it until the engine took it (AsyncLLMEngine.add_request returned); from then
on the engine's own count of unfinished requests covers it. The old version retires only when both are zero, so
no request ever meets a stopped engine. A failed load (a bad file, another model) or a failed warm-up (a step
that raises, a request that ends without a token) leaves the current version serving; the error says why.

The price: while both are loaded the process holds two sets of weights and two KV pools (peak memory about
doubles). A GPU server rarely has that headroom: it swaps weights in place into the same buffers (vLLM's
sleep / wake-up and its weight-update hooks for RL trainers), or drains one replica behind a router while the
others serve, and reloads it (chapter 16).
"""

import asyncio
import contextlib
import hmac
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from nanoserve.engine.async_engine import AsyncLLMEngine
from nanoserve.engine.worker import release_memory
from nanoserve.sampling import SamplingParams
from nanoserve.server.protocol import APIError, parse_body


def version_name(weights: str, n: int) -> str:
    """What `system_fingerprint` and /v1/models say: `nanoserve-<weights>-<n>`, n counting the versions served.

        >>> version_name("q4", 2)
        'nanoserve-q4-2'
    """
    return f"nanoserve-{weights}-{n}"


@dataclass(eq=False)
class ModelVersion:
    name: str
    weights: str
    engine: AsyncLLMEngine
    model_file: str | None = None  # the GGUF it was loaded from (None: the one the server started with)
    leases: int = 0  # requests that picked this version and are not in its engine yet


class EngineVersions:
    def __init__(self, engine: AsyncLLMEngine, weights: str = "fp32", loader=None, warmup_prompt_ids=(1, 2, 3),
                 warmup_requests: int = 4, warmup_max_tokens: int = 4, warmup_timeout_s: float = 300.0):
        """loader(weights, model_file) -> LLMEngine, run in a thread: the next version's engine (None: this
        server cannot reload). weights / model_file: the reload's, None for the current ones."""
        self.current = ModelVersion(version_name(weights, 1), weights, engine)
        self.loader = loader
        self.warmup_prompt_ids = list(warmup_prompt_ids)
        self.warmup_requests, self.warmup_max_tokens, self.warmup_timeout_s = \
            warmup_requests, warmup_max_tokens, warmup_timeout_s
        self.retiring: list[ModelVersion] = []  # switched away from, in-flight requests still finishing
        self.shadow: ModelVersion | None = None  # loaded, warming up, not serving yet
        self.served = 1  # versions that have served (the n of the next name is this + 1)
        self.reloading = False
        self._tasks: set[asyncio.Task] = set()  # the retirements under way (a reference, or asyncio may drop them)

    @contextlib.contextmanager
    def lease(self):
        """The version a request is served by, held until the block ends (put add_request inside it)."""
        version = self.current
        version.leases += 1
        try:
            yield version
        finally:
            version.leases -= 1

    def num_unfinished_requests(self) -> int:
        """In every loaded version: the drain at shutdown waits for the retiring ones too."""
        return sum(v.engine.num_unfinished_requests() + v.leases for v in (self.current, *self.retiring))

    def shutdown(self) -> None:
        for version in (*self.retiring, *([self.shadow] if self.shadow else []), self.current):
            version.engine.shutdown()

    async def reload(self, weights: str | None = None, model_file: str | None = None,
                     warmup_requests: int | None = None) -> dict:
        """Load, warm and switch to the next version; returns what happened, or raises APIError (the current
        version still serving). A field not given is the current version's: `{}` (and SIGHUP) reloads the
        file and format the server runs now, not those it started with. 501 no loader, 409 a reload under way
        (or the model asleep, chapter 19), 400 a load refused (a bad file or format, another model), 500 a load
        or warm-up that failed."""
        if self.loader is None:
            raise APIError(501, "this server cannot reload its model (it was started without a loader)")
        if self.reloading:
            raise APIError(409, f"a reload is already under way; {self.current.name} is serving")
        if self.current.engine.is_sleeping():  # chapter 19: a reload would load a second model beside it
            raise APIError(409, f"{self.current.name} is asleep: wake it up (POST /wake_up) before a reload")
        self.reloading = True
        try:
            return await self._reload(weights or self.current.weights, model_file or self.current.model_file,
                                      self.warmup_requests if warmup_requests is None else warmup_requests)
        finally:
            self.reloading = False

    async def _reload(self, weights: str, model_file: str | None, warmup_requests: int) -> dict:
        old, name = self.current, version_name(weights, self.served + 1)
        still = f"{old.name} is still serving"
        t0 = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self.loader, weights, model_file)
        except (ValueError, OSError) as e:  # a format that does not exist, a missing or broken file
            raise APIError(400, f"loading {name} failed: {e}; {still}", "weights") from None
        except Exception as e:  # noqa: BLE001 — whatever went wrong, the old version must keep serving
            raise APIError(500, f"loading {name} failed: {e!r}; {still}") from None
        mismatch = self._mismatch(old.engine, engine)
        if mismatch:
            raise APIError(400, f"{name} is not the same model: {mismatch}; {still}", "model_file")
        load_s = time.perf_counter() - t0
        # the shadow records no metrics while it warms up: the server's counters are about its clients
        shadow = ModelVersion(name, weights, AsyncLLMEngine(engine, None, thread_name=f"nanoserve-engine-{name}"),
                              model_file)
        del engine
        self.shadow = shadow
        shadow.engine.start()
        t1 = time.perf_counter()
        try:
            await asyncio.wait_for(self._warm_up(shadow, warmup_requests), self.warmup_timeout_s)
        except Exception as e:  # noqa: BLE001 — a step that raised, a request without tokens, a timeout
            await asyncio.to_thread(shadow.engine.shutdown)
            why = f"no answer within {self.warmup_timeout_s:g} s" if isinstance(e, TimeoutError) else str(e)
            raise APIError(500, f"warming up {name} failed: {why}; {still}") from None
        finally:
            self.shadow = None
        shadow.engine.set_stat_logger(old.engine.stat_logger)
        # the switch: one assignment on the event loop, between two requests; the next lease() is green's
        self.current, self.served = shadow, self.served + 1
        self.retiring.append(old)
        task = asyncio.create_task(self._retire(old))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return {"version": name, "previous": old.name, "weights": weights, "model_file": model_file,
                "load_s": round(load_s, 3),
                "warmup_requests": warmup_requests, "warmup_s": round(time.perf_counter() - t1, 3)}

    @staticmethod
    def _mismatch(old, new) -> str | None:
        """Why `new` (an LLMEngine) cannot take over from `old` (the serving AsyncLLMEngine; None: it can): the
        tokenizer and the server's length checks were made for the old one's vocabulary and limits."""
        for what in ("vocab_size", "max_model_len", "max_seq_len"):
            a, b = getattr(old, what), getattr(new, what)
            if a != b:
                return f"{what} {b} where the serving version has {a}"
        return None

    async def _warm_up(self, version: ModelVersion, n: int) -> None:
        """n greedy requests through the shadow at once; each must finish with its tokens."""
        params = SamplingParams(temperature=0, max_tokens=self.warmup_max_tokens, ignore_eos=True)

        async def one(i: int) -> None:
            last = None
            async for last in version.engine.generate(f"warmup-{version.name}-{i}", self.warmup_prompt_ids, params):
                pass
            if last is None or last.finish_reason != "length" or len(last.token_ids) != params.max_tokens:
                raise RuntimeError(f"warm-up request {i} ended without its {params.max_tokens} tokens "
                                   f"({last and last.finish_reason})")

        await asyncio.gather(*(one(i) for i in range(n)))

    async def _retire(self, version: ModelVersion) -> None:
        """Once nothing is left in flight on it: stop its thread, drop it; its weights and KV pool go with it."""
        while version.leases or version.engine.num_unfinished_requests():
            await asyncio.sleep(0.02)
        await asyncio.to_thread(version.engine.shutdown)
        self.retiring.remove(version)
        del version
        release_memory()


class ReloadRequest(BaseModel):
    """POST /admin/reload's body; every field optional: `{}` reloads the same file in the same format."""

    model_config = ConfigDict(extra="forbid", strict=True)
    weights: str | None = None  # "fp32", "int8", "q4" (chapter 10): the loader refuses any other
    model_file: str | None = None  # another GGUF of the same model (default: the one the server runs now)
    warmup_requests: int | None = Field(None, ge=0, le=64)


def check_admin_key(request: Request, admin_key: str) -> None:
    """401 unless the request carries 'Authorization: Bearer <admin key>' (compared in constant time)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if not (hmac.compare_digest(given.encode(), admin_key.encode()) and scheme.lower() == "bearer"):
        raise APIError(401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'")


def add_admin_routes(app: FastAPI, state, read_body) -> None:
    """POST /admin/reload, behind the admin key alone: an API key (a tenant's) never opens it, and the admin
    key opens nothing else. Answers the reload's summary, or an OpenAI-format error (the old version serving)."""
    @app.post("/admin/reload")
    async def reload(request: Request):
        check_admin_key(request, state.config.admin_key)
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(state.config.retry_after_s)})
        req = parse_body(await read_body(request), ReloadRequest)
        return await state.versions.reload(req.weights, req.model_file, req.warmup_requests)
