"""Chapter 19 — sleep mode over HTTP, vLLM's endpoints: an idle server hands its model's memory back.

    POST /sleep?level=1      (or the body {"level": 1}; default 1) the weights to a file, the KV pool freed
    POST /sleep?level=2      the weights and the pool dropped; a wake builds the model again from its GGUF
    POST /wake_up            the memory back; the server serves again
    GET  /is_sleeping        {"is_sleeping": false, "level": null}

Registered only with an admin key, which alone opens them (an API key never does). While the model sleeps every
generation request gets 503 with Retry-After, in OpenAI's error format; /v1/models, /tokenize and /health answer
as before. /sleep needs an idle server: with requests in flight (or a reload under way, chapter 15) it is refused
with 409 — the engine only sleeps between two steps with nothing running, and a refusal the caller can retry
(after draining the traffic away) leaves nothing half done, where waiting for the requests to end would hold the
call open for as long as they run. Asleep already, or /wake_up while awake: 409. A level other than 1 or 2: 400
naming `level`.
"""

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from nanoserve.engine.async_engine import SleepConflict, SleepRefused
from nanoserve.engine.sleep_mode import SLEEP_LEVELS
from nanoserve.server.protocol import APIError, parse_body
from nanoserve.server.versions import check_admin_key


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    level: int | None = None


class WakeUpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def has_body(request: Request) -> bool:
    return request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers


def no_other_query(request: Request, allowed: tuple[str, ...]) -> None:
    """400 naming the first query parameter the route does not read (vLLM's /wake_up `tags` among them)."""
    for name in request.query_params:
        if name not in allowed:
            raise APIError(400, f"unknown query parameter {name!r}" + (f"; this route reads {allowed[0]!r} only"
                                                                     if allowed else ""), name)


async def sleep_level(request: Request, read_body) -> int:
    """The level asked for, from the query or the JSON body (1 if neither); 400 naming `level` if it is not 1 or 2,
    or if the two disagree."""
    no_other_query(request, ("level",))
    given = [int(text) if text in ("1", "2") else text for text in request.query_params.getlist("level")]
    if has_body(request):
        body = parse_body(await read_body(request), SleepRequest)
        if body.level is not None:
            given.append(body.level)
    if len(set(map(str, given))) > 1:
        raise APIError(400, f"level is given twice, as {given[0]!r} and as {given[1]!r}", "level")
    level = given[0] if given else 1
    if level not in SLEEP_LEVELS:
        raise APIError(400, f"level must be 1 (the weights to a file) or 2 (the weights dropped), got {level!r}",
                       "level")
    return level


def add_sleep_routes(app: FastAPI, state, read_body) -> None:
    def check_idle_server() -> None:
        versions = state.versions
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(state.config.retry_after_s)})
        if versions.reloading or versions.retiring:
            raise APIError(409, "a model reload is under way or an old version is still finishing its requests "
                                "(chapter 15): ask again once it is done")

    @app.post("/sleep")
    async def sleep(request: Request):
        check_admin_key(request, state.config.admin_key)
        level = await sleep_level(request, read_body)
        check_idle_server()
        try:
            done = await state.engine.sleep(level)
        except SleepConflict as e:
            raise APIError(409, str(e)) from None
        except SleepRefused as e:
            raise APIError(400, str(e), e.param) from None
        return {"is_sleeping": True, **done}

    @app.post("/wake_up")
    async def wake_up(request: Request):
        check_admin_key(request, state.config.admin_key)
        no_other_query(request, ())
        if has_body(request):
            parse_body(await read_body(request), WakeUpRequest)
        try:
            done = await state.engine.wake_up()
        except SleepConflict as e:
            raise APIError(409, str(e)) from None
        except Exception as e:  # noqa: BLE001 — the file it wakes from failed it: say why, still asleep
            raise APIError(500, f"waking up failed: {e}; the model is still asleep") from None
        return {"is_sleeping": False, **done}

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request):
        check_admin_key(request, state.config.admin_key)
        no_other_query(request, ())
        return {"is_sleeping": state.engine.is_sleeping(), "level": state.engine.sleep_level or None}
