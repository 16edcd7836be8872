"""Chapter 17 — the proxy in front of a prefill and a decode engine (vLLM's disaggregated-serving example).

    client ──POST /v1/completions──▶ proxy ──(1) the same body, max_tokens 1, stream off,
                                             kv_transfer_params {"do_remote_decode": true}──▶ prefill engine
                                           ◀── its answer: kv_transfer_params {"remote_segment", ...}
                                     proxy ──(2) the client's body + those kv_transfer_params──▶ decode engine
           ◀──────── streamed as the decode engine streams it (the OpenAI API, unchanged) ─────────

The prefill engine's one token is thrown away: the decode engine loads every prompt token but the last,
computes that one itself and samples the first token from it, so its stream is the whole answer.

Failures: an error of either engine reaches the client as that engine's own OpenAI error (status and body);
an engine that cannot be reached is a 502, and a decode engine that dies mid-stream ends the stream with a
`data: {"error": ...}` event and [DONE]. Staged KV the decode engine never admitted (it refused the request,
or was unreachable) is released at once over the producer's control channel; a client that disconnects
mid-stream closes the decode stream, and the decode engine aborts the request and frees its blocks.

    python -m nanoserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.disagg.transport import ReleaseSender

FORWARDED_HEADERS = ("authorization",)


def error_object(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "bad_gateway",
                      "param": param, "code": None}}


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_object(status, message, param), status_code=status)


def prefill_body(body: dict) -> dict:
    """The request the prefill engine gets: one token, no stream, and the ask to stage its prompt's KV."""
    drop = ("stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs", "n")
    return {k: v for k, v in body.items() if k not in drop} | {
        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def build_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=timeout)
    sender = ReleaseSender()
    app.router.on_shutdown.append(client.aclose)
    app.router.on_shutdown.append(sender.close)

    def release(params: dict) -> None:
        sender.release(params["remote_control"], params["remote_segment"])

    async def disaggregated(request: Request, path: str):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            return error(400, "kv_transfer_params is the proxy's to set", "kv_transfer_params")
        if body.get("n", 1) != 1:
            return error(400, "a disaggregated request has one completion (n=1)", "n")
        if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            return error(400, "one prompt per request through the disaggregated proxy", "prompt")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        try:
            first = await client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            return error(502, f"the prefill engine cannot be reached: {e}")
        if first.status_code != 200:  # its own OpenAI error (a bad field, a prompt too long): passed on as it is
            return Response(first.content, first.status_code, media_type="application/json")
        params = first.json().get("kv_transfer_params")
        if params is None:
            return error(502, "the prefill engine returned no kv_transfer_params (is it serving --kv-role prefill?)")
        second = {**body, "kv_transfer_params": params}
        try:
            upstream = await client.send(client.build_request("POST", decode_url + path, json=second,
                                                              headers=headers), stream=True)
        except httpx.HTTPError as e:
            release(params)
            return error(502, f"the decode engine cannot be reached: {e}")
        if upstream.status_code != 200 or not body.get("stream"):
            content = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code != 200:
                release(params)  # refused before admission: nobody will load it
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the decode engine died mid-stream: the status line is long gone, so the
                # error travels in the stream, as the engine's own would (the blank lines end a half-sent event)
                body = json.dumps(error_object(502, f"the decode engine stopped mid-stream: {e}"))
                yield f"\n\ndata: {body}\n\ndata: [DONE]\n\n".encode()
            finally:  # also when the client went away: the decode engine sees its stream closed and aborts
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await disaggregated(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await disaggregated(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        r = await client.get(decode_url + "/v1/models", headers={k: v for k, v in request.headers.items()
                                                                   if k.lower() in FORWARDED_HEADERS})
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        codes = []
        for url in (prefill_url, decode_url):
            try:
                codes.append((await client.get(url + "/health")).status_code)
            except httpx.HTTPError:
                codes.append(None)
        ok = codes == [200, 200]
        return JSONResponse({"prefill": codes[0], "decode": codes[1]}, status_code=200 if ok else 503)

    return app
