"""Chapter 19 — LoRA adapters loaded and unloaded while the server runs (vLLM's runtime LoRA updating).

    POST /v1/load_lora_adapter     {"lora_name": "upper", "lora_path": "adapters/upper"}
    POST /v1/unload_lora_adapter   {"lora_name": "upper"}

Registered only with LoRA on (--enable-lora or --lora-modules) and an admin key; the admin key alone opens
them (an API key never does: an adapter path is a file on the server's disk).
A request then names the adapter in its `model` field; GET /v1/models lists it beside the base model. A bad
adapter (no such directory, a rank above --max-lora-rank, a module the model lacks) is a 400 naming
`lora_path`; an unknown name or a name taken, a 404 or 400 naming `lora_name`.

Unloading an adapter that requests are using, as vLLM does it: the unload answers at once and the adapter is
gone for new requests (404 naming `model`, and /v1/models no longer lists it), but the requests already
admitted finish with it — a stream is never cut short, and nothing is freed under it. Its weights leave the
slots and memory when the last of them ends; until then the answer says "draining" with their number, and a
load under the same name is a 400 (the slot still holds the old weights).

    {"object": "lora_adapter", "id": "upper", "status": "unloaded"}                                idle
    {"object": "lora_adapter", "id": "upper", "status": "draining", "num_requests": 2}             in use
"""

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from nanoserve.engine.async_engine import LoRANameTaken, LoRANotLoaded
from nanoserve.server.protocol import APIError, parse_body
from nanoserve.server.versions import check_admin_key


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=128)


def add_lora_routes(app: FastAPI, state, read_body) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        check_admin_key(request, state.config.admin_key)
        req = parse_body(await read_body(request), LoadLoRAAdapterRequest)
        if req.lora_name == state.config.model_name or req.lora_name in state.engine.lora_names:
            raise APIError(400, f"the name {req.lora_name!r} is already taken", "lora_name")
        try:
            await state.engine.add_lora(req.lora_name, req.lora_path)
        except LoRANameTaken as e:  # loaded by a call that raced this one, or unloaded and still draining
            raise APIError(400, str(e), "lora_name") from None
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        return {"object": "lora_adapter", "id": req.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        check_admin_key(request, state.config.admin_key)
        req = parse_body(await read_body(request), UnloadLoRAAdapterRequest)
        if req.lora_name not in state.engine.lora_names:
            raise APIError(404, f"no LoRA adapter {req.lora_name!r} is loaded", "lora_name")
        try:
            num_requests = await state.engine.remove_lora(req.lora_name)
        except LoRANotLoaded as e:  # unloaded by a call that raced this one
            raise APIError(404, str(e), "lora_name") from None
        if num_requests:
            return {"object": "lora_adapter", "id": req.lora_name, "status": "draining", "num_requests": num_requests}
        return {"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}
