"""Chapter 13 — tool calls are structured outputs: OpenAI's `tools` + `tool_choice` become a grammar, and the
text the model writes becomes `tool_calls` again.

SmolLM2-Instruct learnt function calling (Argilla's APIGen data) in one format: the tools listed as JSON in the
system prompt between <tools></tools>, the calls written as one JSON array between tags,

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

and a tool's result handed back as a user turn between <tool_response></tool_response> (the server's
tool_calls.py renders both). What each `tool_choice` asks of the sampler, and how the text is read back:

    tool_choice                   grammar                                         the text is
    "none"                        none (the tools are not even shown)             content
    "auto", no tool strict        none: the model may write anything              content, and any <tool_call>[...]
                                                                                  </tool_call> that parses: calls
    "auto", a tool strict         a structural tag: free text, but once the       the same
                                  model writes <tool_call>, the calls' schema
                                  until </tool_call>, then only EOS
    "required"                    the calls array: minItems 1, each item anyOf    the array: calls
                                  the tools' {name, arguments}
    {"type": "function",          that tool's parameters schema                   that tool's arguments
     "function": {"name": X}}

`arguments` is the key SmolLM2 was taught (vLLM's generic schema names it `parameters`): the grammar asks for what
the prompt shows. "auto" can guarantee a call's form only when a tool is strict, and never *that* the model calls;
"required" and a named function guarantee both.
"""

import re
from dataclasses import dataclass, field

import jsonschema

from nanoserve.structured.params import StructuredOutputsParams

BEGIN, END = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolsError(ValueError):
    """A request's tools or tool_choice cannot be served; `param` names the field (OpenAI's error body)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict = field(default_factory=lambda: dict(NO_PARAMETERS))
    description: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice come to: `mode` ("none", "auto", "required", "named"), the
    tools shown to the model, the one a named choice calls, and the grammar (None: the model writes freely)."""

    mode: str
    tools: tuple[Tool, ...]
    named: str | None = None
    grammar: StructuredOutputsParams | None = None
    max_calls: int | None = None  # parallel_tool_calls false: 1

    @property
    def offered(self) -> bool:
        """The model is shown the tools and its text is read for calls."""
        return self.mode != "none"


def check_tool(i: int, tool: Tool) -> None:
    """A tool's name and its parameters' schema (a JSON schema for an object). Raises ToolsError."""
    where = f"tools[{i}].function"
    if not NAME.match(tool.name):
        raise ToolsError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {tool.name!r}", f"{where}.name")
    try:
        jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
    except jsonschema.SchemaError as e:
        raise ToolsError(f"{where}.parameters is not a valid JSON schema: {e.message}", f"{where}.parameters") from None
    if tool.parameters.get("type", "object") != "object":
        raise ToolsError(f"{where}.parameters must describe an object (the arguments), got type "
                         f"{tool.parameters['type']!r}", f"{where}.parameters")


def calls_schema(tools, max_calls: int | None = None, strict_only: bool = False) -> dict:
    """The JSON schema of a calls array: each item one tool's {"name": its name, "arguments": its parameters}.
    strict_only: the parameters of a tool that is not strict are any object (its name is still exact)."""
    items = [{"type": "object", "properties": {
        "name": {"const": t.name},
        "arguments": t.parameters if t.strict or not strict_only else {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return schema | ({"maxItems": max_calls} if max_calls else {})


def plan(tools: list[Tool] | None, tool_choice, parallel_tool_calls: bool | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools). tool_choice: None (OpenAI's default: "auto" with tools),
    "none" | "auto" | "required", or {"type": "function", "function": {"name": ...}}. Raises ToolsError."""
    if not tools:
        if tool_choice is not None:
            raise ToolsError("tool_choice is only allowed when tools are given", "tool_choice")
        if tools is not None:
            raise ToolsError("tools must hold at least one tool", "tools")
        return None
    for i, tool in enumerate(tools):
        check_tool(i, tool)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolsError(f"two tools share the name {next(n for n in names if names.count(n) > 1)!r}", "tools")
    tools = tuple(tools)
    max_calls = 1 if parallel_tool_calls is False else None
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto") and not any(t.strict for t in tools):
        return ToolPlan(choice, tools, max_calls=max_calls)
    if choice == "auto":  # free text, but a call, once begun, follows the strict tools' schemas
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": [BEGIN], "stop_after_first": True,
            "tags": [{"type": "tag", "begin": BEGIN, "end": END, "content": {
                "type": "json_schema", "json_schema": calls_schema(tools, max_calls, strict_only=True),
                "max_whitespace_cnt": 1}}]}}  # bounded: a small model must not loop on spaces
        return ToolPlan("auto", tools, grammar=StructuredOutputsParams(structural_tag=tag), max_calls=max_calls)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, grammar=StructuredOutputsParams(json=calls_schema(tools, max_calls)),
                        max_calls=max_calls)
    name = choice["function"]["name"]
    named = next((t for t in tools if t.name == name), None)
    if named is None:
        raise ToolsError(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"({', '.join(names)})", "tool_choice")
    return ToolPlan("named", tools, named=name, grammar=StructuredOutputsParams(json=named.parameters))
