"""Chapter 19 — LoRA adapters loaded and unloaded while the server runs (vLLM's runtime LoRA updating).

    POST /v1/load_lora_adapter     {"lora_name": "upper", "lora_path": "adapters/upper"}
    POST /v1/unload_lora_adapter   {"lora_name": "upper"}

Behind the admin key alone (an API key never opens them: an adapter path is a file on the server's disk).
A request then names the adapter in its `model` field; GET /v1/models lists it beside the base model. A bad
adapter (no such directory, a rank above --max-lora-rank, a module the model lacks) is a 400 naming
`lora_path`; an unknown name or one still serving requests, a 404 or 400 naming `lora_name`.
"""

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

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
            await state.engine.remove_lora(req.lora_name)
        except ValueError as e:  # still in use by a request
            raise APIError(400, str(e), "lora_name") from None
        return {"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}
