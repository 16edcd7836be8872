"""Chapter 13 — tool calls on the chat endpoint: the prompt that offers the tools, and the reply read back as
OpenAI's `tool_calls` (the grammar side is nanoserve/structured/tools.py).

The way in. SmolLM2's chat template knows only {role, content}, so the turns are written the way the model
learnt function calling (APIGen) before the template renders them:

    the tools          a system turn: the tools as JSON between <tools></tools>, and the format to call them in
                       (ahead of the client's own system message, if any)
    assistant calls    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>
    a tool's result    a user turn: <tool_response>\\n{"temp": 21}\\n</tool_response>

The way out. ToolCallParser reads the text as it grows; each call gets an id ("call_" + 24 hex digits) and
OpenAI's shape: a non-streamed choice carries message.tool_calls (content null unless the model wrote text
before its calls) and finish_reason "tool_calls"; a stream sends, per call,

    data: {... "delta": {"tool_calls": [{"index": 0, "id": "call_...", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]}}
    data: {... "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}}
    ...
    data: {... "delta": {}, "finish_reason": "tool_calls"}

A call is sent once its JSON is complete (a call of "required" or "auto" needs its name before its first chunk; a
named function's arguments are held until they parse). A call cut by max_tokens is no call, the same streamed or
not: the completion ends with finish_reason "length", the calls completed before the cut as tool_calls, and the
cut text (from the call's "{", or the array's "[" when no call completed) as content.
"""

import json
import uuid
from collections.abc import AsyncIterator

from nanoserve.server.protocol import APIError, error_body
from nanoserve.server.streaming import sse, stop_hold_back, text_deltas, usage
from nanoserve.structured.tools import BEGIN, END, ToolPlan


def system_prompt(plan: ToolPlan) -> str:
    """The system turn that offers the tools, in the format SmolLM2 learnt."""
    tools = [{"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters}
             for t in plan.tools]
    return ("You can call functions. These are the tools you have, as JSON:\n"
            f"<tools>{json.dumps(tools, ensure_ascii=False)}</tools>\n"
            "To call one or more of them, answer with nothing but\n"
            f'{BEGIN}[{{"name": "a_function", "arguments": {{"an_argument": "a value"}}}}]{END}\n'
            "with the arguments the question gives. If no tool fits, answer in plain text.")


def template_messages(req) -> list[dict]:
    """The request's messages as the chat template's {role, content} turns (tools offered, calls and results
    written in the model's format). Raises APIError(400) for a call whose arguments are not a JSON object."""
    turns = []
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            turns.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        elif m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}]")}
                     for j, c in enumerate(m.tool_calls)]
            turns.append({"role": "assistant", "content": m.text() + BEGIN + json.dumps(calls, ensure_ascii=False) + END})
        else:
            turns.append({"role": m.template_role, "content": m.text()})
    plan = getattr(req, "tool_plan", None)
    if plan is not None and plan.offered:
        if turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": system_prompt(plan) + "\n\n" + turns[0]["content"]}
        else:
            turns.insert(0, {"role": "system", "content": system_prompt(plan)})
    return turns


def _arguments(text: str, where: str) -> dict:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}.function.arguments is not valid JSON: {e}", f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return arguments


class ToolCallParser:
    """The model's text -> content and calls, fed as it grows (a stream) or at once (a final answer):
    `feed(delta)` and `finish()` return events, each one of

        ("content", text)            text of the reply itself
        ("call", index, name)        call `index` begins
        ("arguments", index, text)   a fragment of its arguments (JSON text; the fragments concatenate)

    "named": the whole text is the named function's arguments, passed on at finish() if it is one complete JSON
    object, else handed back as content (cut by max_tokens). "required": the whole
    text is the calls array; a call is passed on once its JSON object is complete. "auto": content, until
    <tool_call> (held back while the text could still become it), then the array as in "required". In "auto"
    without a strict tool nothing guarantees the form: a section that does not parse as calls of these tools
    (or holds more than max_calls) is handed back as content, from where the parsing stopped; so is a call cut
    by max_tokens in any mode (the whole section when no call completed before it).
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.names = {t.name for t in plan.tools}
        self.buffer = ""  # text not passed on yet (inside the calls: all of the section)
        self.in_calls = plan.mode in ("required", "named")  # inside the calls (or the named arguments)
        self.pos = 0  # inside the calls: parsed up to here in `buffer`
        self.opened = self.closed = False  # the array's "[" / "]" was read
        self.single = False  # "auto": one call object without the array around it
        self.failed = False  # "auto" without a strict tool: the section is no calls; the rest is content
        self.num_calls = 0

    def feed(self, delta: str) -> list[tuple]:
        self.buffer += delta
        if self.plan.mode == "named":  # held: only finish() knows whether the arguments are complete
            return []
        events = []
        if not self.in_calls:
            at = self.buffer.find(BEGIN)
            cut = at if at >= 0 else len(self.buffer) - stop_hold_back(self.buffer, [BEGIN])
            if cut:
                events.append(("content", self.buffer[:cut]))
            if at < 0:
                self.buffer = self.buffer[cut:]
                return events
            self.buffer, self.in_calls = self.buffer[at + len(BEGIN):], True
        return events + self._calls()

    def finish(self) -> list[tuple]:
        """The events left at the end of the text: held-back text, or a section that never became calls."""
        if self.plan.mode == "named":
            text, self.buffer = self.buffer, ""
            try:
                complete = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:  # cut by max_tokens
                complete = False
            if complete:
                self.num_calls = 1
                return [("call", 0, self.plan.named), ("arguments", 0, text)]
            return [("content", text)] if text else []
        rest = self.buffer
        if self.in_calls:
            rest = self.buffer[self.pos:].strip()
            if not self.num_calls:  # nothing became a call (cut, or no calls of these tools): the section is text
                rest = (BEGIN if self.plan.mode == "auto" else "") + self.buffer
            elif self.closed and rest.startswith(END):
                rest = rest[len(END):]
            elif self.plan.mode == "required" and self.closed:
                rest = ""
        self.buffer, self.pos = "", 0
        return [("content", rest)] if rest.strip() else []

    def _calls(self) -> list[tuple]:
        """Pass on each call whose JSON object is complete; stop at the first thing that is not one."""
        events, text, decoder = [], self.buffer, json.JSONDecoder()
        while not (self.failed or self.closed):
            pos = len(text) - len(text[self.pos:].lstrip())
            if pos >= len(text):
                break
            if not self.opened:
                self.opened, self.single = True, text[pos] == "{"  # "{": accepted where nothing constrains
                self.failed = text[pos] not in "[{" or (self.single and self.plan.grammar is not None)
                self.pos = pos if self.single else pos + 1
                continue
            if text[pos] in ",]":
                self.closed, self.pos = text[pos] == "]", pos + 1
                continue
            try:
                call, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # not complete yet (or never: finish() says)
            if not self._is_call(call):
                self.failed = True
                break
            events += [("call", self.num_calls, call["name"]),
                       ("arguments", self.num_calls, json.dumps(call["arguments"], ensure_ascii=False))]
            self.num_calls += 1
            self.pos, self.closed = end, self.single
        return events

    def _is_call(self, call) -> bool:
        return (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] in self.names
                and isinstance(call["arguments"], dict)
                and (self.plan.max_calls is None or self.num_calls < self.plan.max_calls))


def _deltas(events: list[tuple], ids: dict[int, str]) -> list[dict]:
    """Parser events -> OpenAI chat deltas; ids: call index -> its id (filled as calls begin)."""
    deltas = []
    for event in events:
        if event[0] == "content":
            deltas.append({"content": event[1]})
        elif event[0] == "call":
            ids[event[1]] = f"call_{uuid.uuid4().hex[:24]}"
            deltas.append({"tool_calls": [{"index": event[1], "id": ids[event[1]], "type": "function",
                                           "function": {"name": event[2], "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
    return deltas


def message(plan: ToolPlan, text: str, finish_reason: str) -> tuple[dict, str]:
    """A finished completion's (message, finish_reason): its calls as tool_calls, the rest as content."""
    parser = ToolCallParser(plan)
    content, calls, ids = "", {}, {}
    for delta in _deltas(parser.feed(text) + parser.finish(), ids):
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": ids[part["index"]], "type": "function",
                                                    "function": {"name": part["function"].get("name"), "arguments": ""}})
            call["function"]["arguments"] += part["function"]["arguments"]
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return ({"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]},
            "tool_calls" if finish_reason == "stop" else finish_reason)


async def openai_tool_stream(outputs: AsyncIterator, plan: ToolPlan, stop: list[str], chunk: dict,
                             include_usage: bool = False) -> AsyncIterator[str]:
    """The SSE lines of a chat request with tools offered (streaming.openai_stream's shape, deltas from the
    parser): the role, then content and tool_calls deltas, then the finish_reason ("tool_calls" when it called)."""

    def event(choices: list[dict], **extra) -> str:
        return sse({**chunk, "choices": choices, **({"usage": None} if include_usage else {}), **extra})

    def choice(index: int, delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    parsers, ids, finals = {0: ToolCallParser(plan)}, {0: {}}, {}
    yield event([choice(0, {"role": "assistant", "content": ""})])  # at once, as streaming.openai_stream does
    try:
        async for delta, out in text_deltas(outputs, stop):
            i = out.index
            if i not in parsers:
                parsers[i], ids[i] = ToolCallParser(plan), {}
                yield event([choice(i, {"role": "assistant", "content": ""})])
            finals[i] = out
            done = out.finish_reason is not None
            for d in _deltas(parsers[i].feed(delta) + (parsers[i].finish() if done else []), ids[i]):
                yield event([choice(i, d)])
            if done:
                reason = "tool_calls" if ids[i] and out.finish_reason == "stop" else out.finish_reason
                yield event([choice(i, {}, reason)])
        if include_usage:
            yield event([], usage=usage(*finals.values()))
    except Exception as e:  # noqa: BLE001 — the status line is long gone: the error travels in the stream
        yield sse(error_body(str(e), getattr(e, "status", 500), getattr(e, "param", None)))
    yield sse("[DONE]")
