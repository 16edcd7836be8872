"""Chapter 12 — the engine, live in the browser: GET /engine (a static page) and GET /engine/events (SSE).

    GET /engine                    engine.html: the page (no data in it, so no key needed)
    GET /engine/static/engine.js   its hand-written script; engine.css its style (shipped in the package)
    GET /engine/events             text/event-stream, one `data: {snapshot}` per engine snapshot
                                   (nanoserve/engine/snapshot.py), `: ping` while nothing happens;
                                   needs the API key when the server has one, like /v1/*

The stream reads AsyncLLMEngine.watch(): at most ~20 snapshots a second, and a client that reads
slowly just gets the latest one next (nothing queues up for it). Nobody connected: the engine builds
nothing. At shutdown the stream ends, so an open page never holds up the drain; the page reconnects.
"""

from importlib.resources import files

from fastapi import Depends, FastAPI
from fastapi.responses import Response, StreamingResponse

from nanoserve.server.protocol import APIError, finite_json

STATIC = files("nanoserve.server") / "static"
MEDIA_TYPES = {"engine.js": "text/javascript; charset=utf-8", "engine.css": "text/css; charset=utf-8"}


def add_engine_view(app: FastAPI, state, check_key) -> None:
    @app.get("/engine")
    async def page():
        return Response((STATIC / "engine.html").read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/engine/static/{name}")
    async def static(name: str):
        if name not in MEDIA_TYPES:  # a fixed list: no path ever reaches the file system from a URL
            raise APIError(404, f"no static file {name!r}")
        return Response((STATIC / name).read_bytes(), media_type=MEDIA_TYPES[name],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/engine/events", dependencies=[Depends(check_key)])
    async def events():
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})

        async def lines():
            yield ": nanoserve engine events\n\n"
            async for snap in state.engine.watch(keepalive=1.0):
                if state.draining:
                    return
                yield ": ping\n\n" if snap is None else f"data: {finite_json(snap, separators=(',', ':'))}\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
