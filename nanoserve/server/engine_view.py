"""Chapter 12 — the engine, live in the browser: GET /engine (a static page) and GET /engine/events (SSE).

    GET /engine                    engine.html: the page (no data in it, so no key needed); sent with a
                                   Content-Security-Policy (its own script and style only; images its own or
                                   data: URLs, for the page's empty icon) and
                                   X-Frame-Options: DENY (no other site can frame it)
    GET /engine/static/engine.js   its hand-written script; engine.css its style (shipped in the package)
    GET /engine/events             text/event-stream, one `data: {snapshot}` per engine snapshot
                                   (nanoserve/engine/snapshot.py), `: ping` while nothing happens;
                                   needs the API key when the server has one, like /v1/*

The stream reads AsyncLLMEngine.watch(): at most ~20 snapshots a second, and a client that reads
slowly just gets the latest one next (nothing queues up for it). Nobody connected: the engine builds
nothing. At shutdown the stream ends, so an open page never holds up the drain; the page reconnects.

With tenants (--api-keys, chapter 08) a stream is a request like any other: it passes the tenant's rate limit,
a tenant holds at most MAX_EVENT_STREAMS open at once (429 past that), and it sees its own requests only
(tenant_view): every block held only by other tenants' requests is "other", shared or not (a shared one of
another tenant would tell it that tenant's requests share a prefix); a free or cached block stays "free" or
"cached", everyone's like the pool's usage (not whose or what); and the prefix cache's figures are not there (they would
tell it that another tenant sent the same prompt). The engine's load stays whole: the step records, the latency p50s and
the pool's usage are everyone's. An operator key (`role = "operator"` in the keys file) sees
everything.
"""

from importlib.resources import files

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from nanoserve.engine.snapshot import encode_pool
from nanoserve.server.protocol import APIError, error_body, finite_json

STATIC = files("nanoserve.server") / "static"
MEDIA_TYPES = {"engine.js": "text/javascript; charset=utf-8", "engine.css": "text/css; charset=utf-8"}
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                           "frame-ancestors 'none'; base-uri 'none'; form-action 'none'", "X-Frame-Options": "DENY"}
MAX_EVENT_STREAMS = 2  # open /engine/events streams per tenant


def tenant_view(snap: dict, tenant: str) -> dict:
    """What `tenant` may see of a snapshot: its own requests; the pool as its own requests hold it (every block held
    only by others is "other", shared or not; free and cached blocks stay as they are); no prefix figures.

        >>> snap = {"running": [{"id": "a1"}, {"id": "b1"}], "waiting": [], "finished": [{"id": "b0"}],
        ...         "preempted": ["b1"], "aborted": [], "prefix": {"hit_tokens": 32},
        ...         "tenants": {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "b0": "b"},
        ...         "pool": {"owners": ["free", "a1", "b1", "shared:2", "shared:3"], "blocks": [0, 1, 2, 3, 4, 3],
        ...                  "shared": {3: ["a1", "a2"], 4: ["a1", "b1", "b2"], 5: ["b1", "b2"]}}}
        >>> view = tenant_view(snap, "a")
        >>> view["running"], view["finished"], view["preempted"], view["prefix"]
        ([{'id': 'a1'}], [], [], {'hidden': True, 'hit_tokens': 0})
        >>> [view["pool"]["owners"][i] for i in view["pool"]["blocks"]], "shared" in view["pool"]
        (['free', 'a1', 'other', 'shared:2', 'a1', 'other'], False)

    Block 5, b's two requests sharing a prompt, is "other" like b's own blocks; block 4 (a cache_salt that a and b
    both sent) is a1's alone here: another tenant's share of it is not a's to see.
    """
    owner = snap["tenants"]
    mine = lambda i: owner.get(i) == tenant  # noqa: E731
    shared = snap["pool"].get("shared", {})

    def seen(block: int, o: str) -> str:
        if o in ("free", "cached") or mine(o):
            return o
        own = [i for i in shared.get(block, ()) if mine(i)]  # its requests' share of a shared block: a prefix hit, a fork
        return "other" if not own else own[0] if len(own) == 1 else f"shared:{len(own)}"

    names = snap["pool"]["owners"]
    pool = {k: v for k, v in snap["pool"].items() if k != "shared"}  # the other tenants' ids stay in the engine
    return {**snap, "running": [s for s in snap["running"] if mine(s["id"])],
            "waiting": [s for s in snap["waiting"] if mine(s["id"])],
            "finished": [s for s in snap["finished"] if mine(s["id"])],
            "preempted": [i for i in snap["preempted"] if mine(i)], "aborted": [i for i in snap["aborted"] if mine(i)],
            "prefix": {"hidden": True} | {k: 0 for k in snap["prefix"]},
            "pool": pool | encode_pool([seen(b, names[i]) for b, i in enumerate(snap["pool"]["blocks"])]),
            "tenants": {i: t for i, t in owner.items() if t == tenant}}


def hold_stream(open_streams: dict[str, int], who: str | None):
    """Count one more stream of `who` (None: nobody's, nothing counted); returns its release, which counts it
    once however often it is called.

        >>> streams = {}
        >>> release = hold_stream(streams, "a"); streams
        {'a': 1}
        >>> release(); release(); streams
        {'a': 0}
    """
    if who is None:
        return lambda: None
    open_streams[who] = open_streams.get(who, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            open_streams[who] -= 1

    return release


def add_engine_view(app: FastAPI, state, viewer) -> None:
    """viewer(request) -> (who, scope): passes the request's key and limits (raises APIError otherwise); `who` is
    the tenant whose streams count (None: nobody's), `scope` the tenant whose view it gets (None: everything)."""
    open_streams: dict[str, int] = {}

    @app.get("/engine")
    async def page():
        return Response((STATIC / "engine.html").read_bytes(), media_type="text/html; charset=utf-8",
                        headers=PAGE_HEADERS)

    @app.get("/engine/static/{name}")
    async def static(name: str):
        if name not in MEDIA_TYPES:  # a fixed list: no path ever reaches the file system from a URL
            raise APIError(404, f"no static file {name!r}")
        return Response((STATIC / name).read_bytes(), media_type=MEDIA_TYPES[name],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/engine/events")
    async def events(request: Request, seen=Depends(viewer)):
        who, scope = seen
        if state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
        if who is not None and open_streams.get(who, 0) >= MAX_EVENT_STREAMS:
            raise APIError(429, f"tenant {who!r} already has {MAX_EVENT_STREAMS} engine event streams open",
                           headers={"Retry-After": "1"})
        release = hold_stream(open_streams, who)  # no await since the check: streams opened at once cannot all pass

        async def lines():
            try:
                yield ": nanoserve engine events\n\n"
                async for snap in state.engine.watch(keepalive=1.0):
                    if state.draining:
                        return
                    if snap is not None and scope is not None:
                        snap = tenant_view(snap, scope)
                    yield ": ping\n\n" if snap is None else f"data: {finite_json(snap, separators=(',', ':'))}\n\n"
            finally:
                release()

        # released when the stream ends, and again after the response (a no-op then): a client gone before the
        # stream began never ran its `finally`
        return StreamingResponse(lines(), media_type="text/event-stream", background=BackgroundTask(release),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
