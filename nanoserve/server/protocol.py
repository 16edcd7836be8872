"""Chapter 08 — the OpenAI request bodies as pydantic models, and OpenAI's error format.

A body is validated *strictly* (a "0.5" string is not a temperature, `true` is not a max_tokens).
Nothing is silently dropped: a field OpenAI defines that nanoserve does not implement is a 400 naming it
("`tools` is not supported by this server"), a field OpenAI does not define either is OpenAI's own 400
("Unrecognized request argument supplied: X"), and every failure is a 400 that names the field — not
FastAPI's default 422:

    {"error": {"message": "temperature: Input should be greater than or equal to 0",
               "type": "BadRequestError", "param": "temperature", "code": 400}}
"""

import json
import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.sampling import MIN_REPETITION_PENALTY, SEED_MAX, SEED_MIN
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.structured.tools import NO_PARAMETERS, Tool, ToolPlan, ToolsError, plan

_STRICT = ConfigDict(extra="forbid", strict=True)

# Fields of OpenAI's chat and completions requests that nanoserve does not implement: a 400 naming the field,
# never a silent drop (a client would believe it got what it asked for). null counts as not asked. Another
# feature that implements one removes its entry here and adds the field to the request model below.
UNSUPPORTED = {
    "tools": "tool calling on chat completions only", "tool_choice": "tool calling on chat completions only",
    "parallel_tool_calls": "tool calling on chat completions only",
    "functions": "function calling (the deprecated form of tools)", "function_call": "function calling",
    "audio": "audio output", "modalities": "audio output",
    "prediction": "predicted outputs", "web_search_options": "web search", "reasoning_effort": "reasoning models",
    "verbosity": "reasoning models", "service_tier": "service tiers", "suffix": "insertion (completions' suffix)",
}
# the most a request may ask for, checked before any tokenizing (chapter 08, "the attacks the limits stop")
MAX_STOP, MAX_STOP_CHARS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, MAX_N, MAX_DEPTH = 4, 256, 1024, 20, 16, 32
MAX_PROMPTS = 16  # a completions batch: prompts in one request (n completions of each)


class APIError(Exception):
    """An error the client gets as HTTP `status` with OpenAI's error body."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
             429: "RateLimitError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


class RequestTimeout(APIError):
    """408: the request ran past its timeout (it is aborted)."""

    def __init__(self, seconds: float):
        super().__init__(408, f"the request did not finish within its timeout of {seconds:g} s", "timeout")


def finite_json(obj, **dumps_kw) -> str:
    """`obj` as strict JSON: json.dumps writes a non-finite float as NaN / Infinity / -Infinity, which are not
    JSON (strict parsers, and OpenAI's clients in other languages, reject the whole body). The last line of
    defence of every response body and stream chunk: no path should produce one (the logprobs leave out a
    token of probability 0), and if one does it is written as null.

        >>> finite_json({"logprob": float("-inf"), "top": [1.5, float("nan")]})
        '{"logprob": null, "top": [1.5, null]}'
    """
    try:
        return json.dumps(obj, allow_nan=False, **dumps_kw)
    except ValueError:  # a non-finite float somewhere: rebuild with each one as None
        def finite(x):
            if isinstance(x, float):
                return x if math.isfinite(x) else None
            if isinstance(x, dict):
                return {k: finite(v) for k, v in x.items()}
            return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x

        return json.dumps(finite(obj), allow_nan=False, **dumps_kw)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": APIError.TYPES.get(status, "APIError"), "param": param, "code": status}}


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """Chapter 13: the function a tool call names, and its arguments."""

    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """Chapter 13: a call an earlier assistant turn made, sent back with the conversation."""

    model_config = _STRICT
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]  # "developer": OpenAI's new name for "system"
    content: str | list[TextPart] | None  # null only for an assistant turn that made tool calls (chapter 13)
    name: str | None = None  # OpenAI's participant name: accepted, and (as in vLLM's templates) not rendered
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)  # chapter 13: an assistant's calls
    tool_call_id: str | None = None  # chapter 13: a tool message answers this call
    refusal: None = None  # OpenAI's client sends it back with an assistant message; nanoserve never refuses

    @field_validator("content")
    @classmethod
    def _null_for_an_assistant_only(cls, content, info):
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return content

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        """An image, audio or file part is refused as what it is, not as "not a valid string"."""
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") not in (None, "text"):
                raise PydanticCustomError("text_only", "this server serves a text model: a content part of type "
                                          "{kind} is not supported (only text)", {"kind": repr(part.get("type"))})
        return content

    def text(self) -> str:
        """OpenAI's list-of-parts form joins its text parts; no content (a tool-calling turn) is ""."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None  # chapter 13: with tool_choice "auto", a call's arguments follow the schema


class ToolDefinition(BaseModel):
    """Chapter 13: one entry of `tools`, a function the model may call."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    """Chapter 13: `tool_choice` naming the one function the reply must call."""

    model_config = _STRICT
    type: Literal["function"]
    function: dict[Literal["name"], str] = Field(min_length=1)  # {"name": "get_weather"}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's name / schema / strict (the schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # `schema` is a BaseModel attribute: renamed, same field on the wire
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """Chapter 13: {"type": "text"} (free text), {"type": "json_object"}, or {"type": "json_schema", ...}."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of json (a schema), regex, choice, grammar (EBNF)."""

    model_config = _STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    """The fields both endpoints share: OpenAI's names, and vLLM's sampling extensions that nanoserve
    implements (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # a signed 64-bit int, as OpenAI's (and vLLM's)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # completions of the prompt (parallel sampling, chapter 06)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # harmless metadata: accepted, not used
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None  # nothing is stored here: `store: true` is refused
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; prefix caching is automatic (chapter 05)
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=2)
    # vLLM's: the prefix cache is keyed by it (chapter 08's tenants): requests that give the same salt share
    # cached prefixes, and only they; with --api-keys a request without one shares with its own tenant only
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # nanoserve's extension: seconds from arrival to the last token (the server's --request-timeout caps it)
    timeout: float | None = Field(None, gt=0)
    speculative: bool = True  # nanoserve's extension (chapter 14): false = never speculate for this request
    # vLLM's extension (chapter 17): {"do_remote_decode": true} to a prefill engine; its answer's
    # kv_transfer_params to a decode engine (the proxy, nanoserve/disagg/proxy.py, passes them on)
    kv_transfer_params: dict | None = None
    response_format: ResponseFormat | None = None  # chapter 13
    structured_outputs: StructuredOutputsFields | None = None  # chapter 13, vLLM's extension

    # chapter 15's extension: this request's own SLO targets (the slo scheduling policy reads them)
    ttft_slo_ms: float | None = Field(None, gt=0)
    tpot_slo_ms: float | None = Field(None, gt=0)

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit() or len(key) > 9:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

    def slo_targets(self):
        """The request's SLOTargets, or None when it asks none (the tenant's or the server's then apply)."""
        from nanoserve.engine.policies import SLOTargets

        if self.ttft_slo_ms is None and self.tpot_slo_ms is None:
            return None
        return SLOTargets(self.ttft_slo_ms, self.tpot_slo_ms)

    def structured_params(self) -> StructuredOutputsParams | None:
        """response_format / structured_outputs -> the grammar the output must follow (None: free text)."""
        fmt, ext = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and ext is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        try:
            if ext is not None:
                return StructuredOutputsParams(json=ext.json_, regex=ext.regex, choice=ext.choice, grammar=ext.grammar)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None:
                raise APIError(400, 'response_format of type "json_schema" needs a "json_schema" object',
                               "response_format.json_schema")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        except ValueError as e:
            raise APIError(400, str(e), "response_format" if ext is None else "structured_outputs") from None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Completions with echo: the top logprobs of every prompt token (chapter 08); chat has none."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # chapter 13: tool calling (nanoserve/structured/tools.py, nanoserve/server/tool_calls.py)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @cached_property
    def tool_plan(self) -> ToolPlan | None:
        """What tools + tool_choice ask of the model (None: no tools). Raises APIError(400) naming the param."""
        tools = None if self.tools is None else [
            Tool(t.function.name, NO_PARAMETERS if t.function.parameters is None else t.function.parameters,
                 t.function.description, bool(t.function.strict)) for t in self.tools]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        try:
            return plan(tools, choice, self.parallel_tool_calls)
        except ToolsError as e:
            raise APIError(400, str(e), e.param) from None

    def structured_params(self) -> StructuredOutputsParams | None:
        """The tools' grammar when tools are offered (response_format then has no place), else the format's."""
        tools = self.tool_plan
        if tools is None or not tools.offered:
            return super().structured_params()
        if self.structured_outputs is not None or (self.response_format is not None and self.response_format.type != "text"):
            raise APIError(400, 'tools (unless tool_choice is "none") and response_format or structured_outputs '
                                "cannot be combined: both constrain the reply", "response_format")
        return tools.grammar

    @property
    def requested_max_tokens(self) -> int | None:
        if None not in (self.max_completion_tokens, self.max_tokens) and self.max_completion_tokens != self.max_tokens:
            # two bounds for one reply: taking either would silently drop the other
            raise APIError(400, f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens}"
                                " disagree: give one (max_completion_tokens is OpenAI's newer name for max_tokens)",
                           "max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    # a string or token ids (OpenAI accepts both), or a batch of either: one choice per prompt (n per prompt)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI allows 5; vLLM, as here, 20
    echo: bool = False  # the prompt's text, and with logprobs its tokens' logprobs, before the completion's
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _batch(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
            if not all(prompt):
                raise ValueError("a prompt of the batch is empty")
        return prompt

    @property
    def prompts(self) -> list:
        """The batch: each prompt (a string or token ids) on its own; one for a single prompt."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return self.prompt if batch else [self.prompt]

    @property
    def score_only(self) -> bool:
        """echo + max_tokens 0: the prompt (and its logprobs) back, nothing generated (OpenAI's legacy way to
        score a text; vLLM's too, which generates one token and drops it, as here)."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (it scores the prompt only)", "max_tokens")
        return self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        if self.score_only:
            return 1
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    @property
    def num_logprobs(self) -> int | None:
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server", "best_of")
        if self.echo and self.stream:
            raise APIError(400, "`echo` with `stream` is not supported by this server", "echo")
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


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


def nesting_depth(obj, limit: int) -> int:
    """How deep lists and objects nest in `obj` (a scalar: 0), counting no further than limit + 1.
    Iterative, so a hostile body cannot make it recurse."""
    depth, level = 0, [obj]
    while level and depth <= limit:
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
    return depth if not level else limit + 1


def first_bad_value(obj) -> tuple[str, str] | None:
    """(path, what is wrong) of the first value no request may carry, or None. Python's json reads two things
    that are not data: a lone surrogate ("\\ud800" is valid JSON, but no UTF-8 text: the tokenizer, and any
    reply quoting it, would fail on it) and a number that is not finite (NaN, Infinity, 1e400: not JSON at all,
    and a NaN inside a step poisons a whole batch). Keys are checked too. Iterative (the depth is bounded first).

        >>> first_bad_value({"messages": [{"role": "user", "content": "hi \\ud800"}]})
        ('messages[0].content', 'a lone surrogate is not valid Unicode text')
    """
    stack = [("", obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str) and not _encodable(x):
            return path or "body", "a lone surrogate is not valid Unicode text"
        if isinstance(x, float) and not math.isfinite(x):
            return path or "body", f"{x} is not a finite number"
        if isinstance(x, dict):
            for key, value in reversed(x.items()):
                if not _encodable(key):
                    return path or "body", "a key with a lone surrogate is not valid Unicode text"
                stack.append((f"{path}.{key}" if path else key, value))
        elif isinstance(x, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(x)))]
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes -> a validated request, or APIError(400) naming what is wrong: a field OpenAI defines that
    nanoserve does not implement (UNSUPPORTED), a field nobody defines, or a bad value."""
    try:
        obj = json.loads(body)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # thousands of nested [ or {: the C parser gives up before we do
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    if nesting_depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    bad = first_bad_value(obj)
    if bad is not None:
        raise APIError(400, f"{bad[0]}: {bad[1]}", None if bad[0] == "body" else bad[0])
    for name, value in list(obj.items()):
        if name in UNSUPPORTED and name not in model.model_fields:
            if value is not None:
                raise APIError(400, f"`{name}` is not supported by this server ({UNSUPPORTED[name]})", name)
            del obj[name]  # null: not asked for
        elif name not in model.model_fields:  # OpenAI's own words for a field it does not know
            raise APIError(400, f"Unrecognized request argument supplied: {name}", name)
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
