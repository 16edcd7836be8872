"""Chapter 08 — the OpenAI request bodies as pydantic models, and OpenAI's error format.

A body is validated *strictly* (a "0.5" string is not a temperature, `true` is not a max_tokens),
unknown fields are ignored as OpenAI's API ignores them, and a failure becomes a 400 that names the
field — not FastAPI's default 422:

    {"error": {"message": "temperature: Input should be greater than or equal to 0",
               "type": "BadRequestError", "param": "temperature", "code": 400}}
"""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanoserve.sampling import SamplingParams

_STRICT = ConfigDict(extra="ignore", strict=True)


class APIError(Exception):
    """An error the client gets as HTTP `status` with OpenAI's error body."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
             429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "APIError"), "param": param, "code": status}}


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        """OpenAI's list-of-parts form joins its text parts."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's names; top_k and ignore_eos are vLLM's extensions)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)  # completions of the prompt (parallel sampling, chapter 06)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    # chapter 15's extension: this request's own SLO targets (the slo scheduling policy reads them)
    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)

    def slo_targets(self):
        """The request's SLOTargets, or None when it asks none (the tenant's or the server's then apply)."""
        from nanoserve.engine.policies import SLOTargets

        if self.ttft_slo_ms is None and self.tpot_slo_ms is None:
            return None
        return SLOTargets(self.ttft_slo_ms, self.tpot_slo_ms)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                  max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                                  n=self.n)
        except ValueError as e:  # what the models cannot say, SamplingParams does (an empty stop string)
            raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]  # a string, or token ids (OpenAI accepts both)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


_UNION_TAGS = {"str", "int", "float", "bool"}  # pydantic names the branch of a union it tried


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes -> a validated request, or APIError(400) naming what is wrong."""
    try:
        obj = json.loads(body)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        path = ""
        for part in first["loc"]:  # ('messages', 0, 'role') -> messages[0].role; stop at a union's branch tag
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in _UNION_TAGS or "[" in part:
                break
            else:
                path += f".{part}" if path else part
        raise APIError(400, f"{path or 'body'}: {first['msg']}", path or None) from None
