"""Chapter 13 — tool calls through the official `openai` client. A random-weight model with SmolLM2's vocabulary
behind the real server proves the grammar: whatever the weights, tool_choice "required" and a named function
return tool_calls whose arguments validate (jsonschema) against their tool's schema — nested objects, enums,
arrays, patterns, required fields — streamed or not, and the stream reassembles to the same calls. The parser is
checked on hand-written replies, the strict "auto" grammar with xgrammar's own matcher, the follow-up turn against
the hand-written prompt, the 400s by their `param`; the real SmolLM2 makes one realistic call."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import xgrammar as xgr

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.runner import serving
from nanoserve.server.tool_calls import ToolCallParser, message, template_messages
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.structured.compiler import GrammarCache
from nanoserve.structured.tools import Tool, plan
from tests.tiny_model import tiny_llama

VOCAB = 49152
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]},
    "create_user": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"]},
        "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "minItems": 1, "maxItems": 3}},
        "required": ["user", "tags"]},
    "place_order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}},
        "express": {"type": "boolean"}}, "required": ["items"]},
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather in Oslo? Also add the user Ada, 36, a dev, and order two ABC-12."}]


@pytest.fixture(scope="module")
def tiny_url(smollm2_tokenizer):
    engine = LLMEngine(tiny_llama(vocab_size=VOCAB, max_position_embeddings=2048), EngineConfig(cache_config=CacheConfig(num_blocks=512),
                                                                                                scheduler_config=SchedulerConfig(max_num_seqs=8)), smollm2_tokenizer)
    with serving(engine, smollm2_tokenizer, model_name="tiny") as (url, _):
        yield url


def client(url):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")


async def ask(url, stream: bool, **kw) -> tuple[list[dict], str | None, str]:
    """(calls as {name, arguments}, content, finish_reason) of choice 0, streamed or not."""
    args = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, **kw)
    if not stream:
        choice = (await client(url).chat.completions.create(**args)).choices[0]
        calls = [{"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    calls, content, finish = {}, "", None
    async for chunk in await client(url).chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:  # a call begins: its id, type and name come first, its arguments after
                assert part.index not in calls and part.function.arguments == ""
                calls[part.index] = {"id": part.id, "type": part.type, "name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content or None, finish


def check_calls(calls: list[dict], names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function" and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def same_calls(a: list[dict], b: list[dict]) -> bool:
    return [(c["name"], c["arguments"]) for c in a] == [(c["name"], c["arguments"]) for c in b]


# ---- through the openai client, on random weights ---------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 11}])
def test_required_returns_calls_that_validate_streamed_or_not(tiny_url, sampling):
    (calls, content, finish), (streamed, streamed_content, streamed_finish) = asyncio.run(_both(
        tiny_url, tool_choice="required", **sampling))
    check_calls(calls)
    assert content is None and finish == "tool_calls"
    assert same_calls(streamed, calls) and streamed_content is None and streamed_finish == "tool_calls"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_function_is_called_with_arguments_that_validate_streamed_and_not(tiny_url, name):
    choice = {"type": "function", "function": {"name": name}}
    (calls, content, finish), (streamed, _, streamed_finish) = asyncio.run(_both(
        tiny_url, tool_choice=choice, temperature=1.0, seed=5))
    check_calls(calls, names=(name,))
    assert len(calls) == 1 and content is None and finish == streamed_finish == "tool_calls"
    assert same_calls(streamed, calls)  # sent once complete: a cut call would be no call, streamed or not


def test_parallel_tool_calls_false_makes_one_call(tiny_url):
    for seed in range(3):
        calls, _, finish = asyncio.run(ask(tiny_url, False, tool_choice="required", parallel_tool_calls=False,
                                           temperature=1.0, seed=seed))
        check_calls(calls)
        assert len(calls) == 1 and finish == "tool_calls"


async def _both(url, **kw):
    return await ask(url, False, **kw), await ask(url, True, **kw)


def test_none_does_not_offer_the_tools(tiny_url):
    async def main():
        plain = await client(tiny_url).chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0)
        none = await client(tiny_url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                                               max_tokens=4, temperature=0)
        auto = await client(tiny_url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4,
                                                               temperature=0)
        return plain, none, auto

    plain, none, auto = asyncio.run(main())
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens  # auto: tools shown
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


def test_a_follow_up_turn_with_the_calls_and_a_tool_result_renders_and_answers(tiny_url, smollm2_tokenizer):
    async def main():
        first = await client(tiny_url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                                tool_choice="required", max_tokens=400, temperature=0)
        reply = first.choices[0].message
        results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True})} for c in reply.tool_calls]
        then = await client(tiny_url).chat.completions.create(model="tiny", messages=ASK + [reply] + results,
                                                               tools=TOOLS, tool_choice="none", max_tokens=8)
        return reply, then

    reply, then = asyncio.run(main())
    calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in reply.tool_calls]
    expected = smollm2_tokenizer.encode_chat(ASK + [
        {"role": "assistant", "content": f"<tool_call>{json.dumps(calls)}</tool_call>"}] + [
        {"role": "user", "content": '<tool_response>\n{"ok": true}\n</tool_response>'}] * len(calls))
    assert then.usage.prompt_tokens == len(expected)
    assert then.choices[0].finish_reason in ("stop", "length") and isinstance(then.choices[0].message.content, str)


# ---- the pieces, against hand-written expectations -------------------------------------------------------

def test_the_prompt_offers_the_tools_and_writes_calls_and_results_in_the_models_format():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}],
        "tools": TOOLS[:1]})
    turns = template_messages(req)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("You can call functions.") and turns[0]["content"].endswith("\n\nBe brief.")
    assert f"<tools>{json.dumps([{'name': 'get_weather', 'description': 'get weather', 'parameters': SCHEMAS['get_weather']}])}</tools>" \
        in turns[0]["content"]
    assert turns[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]</tool_call>'
    assert turns[3]["content"] == "<tool_response>\n4 degrees\n</tool_response>"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CUT = '{"name": "get_weather", "arguments": {"city": "Os'  # a call cut by max_tokens


@pytest.mark.parametrize("choice, text, finish_reason, content, calls", [
    ("auto", f"Let me look. <tool_call>[{WEATHER}]</tool_call>", "stop", "Let me look. ", [("get_weather", 0)]),
    ("auto", f"<tool_call>{WEATHER}</tool_call>", "stop", None, [("get_weather", 0)]),  # one object, no array
    ("auto", "It is sunny. <tool", "stop", "It is sunny. <tool", []),  # held back, then given back
    ("auto", '<tool_call>[{"name": "no_such_tool", "arguments": {}}]</tool_call>', "stop",
     '<tool_call>[{"name": "no_such_tool", "arguments": {}}]</tool_call>', []),  # not a call of these tools: text
    ("required", f"[{WEATHER}, {WEATHER}]", "stop", None, [("get_weather", 0), ("get_weather", 1)]),
    (NAMED, '{"city": "Oslo", "unit": "celsius"}', "stop", None, [("get_weather", 0)]),
    # cut by max_tokens: the cut call is no call, its text is content, finish_reason "length"
    ("required", f"[{CUT}", "length", f"[{CUT}", []),
    ("required", f"[{WEATHER}, {CUT}", "length", CUT, [("get_weather", 0)]),  # the complete call stays a call
    ("auto", f"Let me look. <tool_call>[{CUT}", "length", f"Let me look. <tool_call>[{CUT}", []),
    (NAMED, '{"city": "Os', "length", '{"city": "Os', []),
])
def test_the_parser_reads_content_and_calls_the_same_at_once_and_character_by_character(
        choice, text, finish_reason, content, calls):
    tools = [Tool(name, schema) for name, schema in SCHEMAS.items()]
    the_plan = plan(tools, choice)
    msg, finish = message(the_plan, text, finish_reason)
    assert msg["content"] == content and finish == ("tool_calls" if calls and finish_reason == "stop" else finish_reason)
    assert [(c["function"]["name"], i) for i, c in enumerate(msg.get("tool_calls", []))] == calls
    for call in msg.get("tool_calls", []):
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    parser, events = ToolCallParser(the_plan), []
    for ch in text:
        events += parser.feed(ch)
    events += parser.finish()
    streamed_content = "".join(e[1] for e in events if e[0] == "content") or None
    streamed_args = {}
    for e in events:
        if e[0] == "arguments":
            streamed_args[e[1]] = streamed_args.get(e[1], "") + e[2]
    assert streamed_content == content
    assert [streamed_args[i] for i in sorted(streamed_args)] == [c["function"]["arguments"] for c in msg.get("tool_calls", [])]


def test_strict_auto_lets_the_model_write_text_or_a_valid_call_and_nothing_else(smollm2_tokenizer):
    tools = [Tool("get_weather", SCHEMAS["get_weather"], strict=True), Tool("free_form", {"type": "object"})]
    grammar = GrammarCache(smollm2_tokenizer, VOCAB).compile(plan(tools, "auto").grammar)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.accept_token(smollm2_tokenizer.eos_token_id)

    assert accepts("It is sunny in Oslo.")
    assert accepts(f"Checking. <tool_call>[{WEATHER}]</tool_call>")
    assert accepts('<tool_call>[{"name": "free_form", "arguments": {"anything": [1, 2]}}]</tool_call>')  # not strict
    assert not accepts('<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')  # no unit
    assert not accepts('<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}]</tool_call>')
    assert not accepts('<tool_call>[{"name": "other", "arguments": {}}]</tool_call>')
    assert not accepts(f"<tool_call>[{WEATHER}]</tool_call> and more text")  # the call ends the reply


# ---- the 400s -------------------------------------------------------------------------------------------------

FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [FN, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties":
      {"a": {"type": "strin"}}}}}]}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [FN, FN]}, "tools"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [FN]}, "tool_choice"),
    ({"tools": [FN], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "4 degrees"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": [FN], "stream": True, "logprobs": True}, "logprobs"),
    ({"tools": [FN], "tool_choice": "required", "stop": "}"}, "stop"),  # a stop would cut the forced call's JSON
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "f"}}, "stop": ["\n"]}, "stop"),
    # any grammar: a stop string or stop token would end the output before the grammar does
    ({"tools": [{"type": "function", "function": {**FN["function"], "strict": True}}], "stop": "}"}, "stop"),  # auto
    ({"response_format": {"type": "json_object"}, "stop": "\n"}, "stop"),
    ({"structured_outputs": {"choice": ["yes", "no"]}, "stop_token_ids": [2]}, "stop_token_ids"),
    ({"structured_outputs": {"choice": ["x" * 300]}}, "structured_outputs"),  # over MAX_CHOICE_NODES trie nodes
])
def test_bad_tools_are_a_400_naming_the_param(tiny_url, body, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tools_on_the_completions_endpoint_are_refused(tiny_url):
    r = httpx.post(f"{tiny_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "tools": [FN]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# ---- the real model, once ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_real_model_calls_the_weather_tool_with_a_realistic_call(smollm2):
    from nanoserve.llm import LLM

    llm = LLM(smollm2, num_blocks=256, max_num_seqs=4)
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                                "parameters": SCHEMAS["get_weather"]}}
    clock = {"type": "function", "function": {"name": "get_time", "description": "Get the time in a timezone",
                                              "parameters": {"type": "object", "properties": {
                                                  "timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}}}
    question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    with serving(llm.engine, llm.tokenizer) as (url, _):
        sync = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = sync.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, tools=[weather, clock],
                                             tool_choice="required", temperature=0, max_tokens=80).choices[0]
        strict = {**weather, "function": {**weather["function"], "strict": True}}
        auto = [sync.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, tools=tools,
                                             temperature=0, max_tokens=40).choices[0] for tools in ([weather, clock], [strict, clock])]
    call = reply.message.tool_calls[0]
    print("required:", call.function.name, call.function.arguments)
    assert reply.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    for name, choice in zip(("auto:", "auto, strict:"), auto):  # the model decides: text, or calls that validate
        print(name, repr(choice.message.content), choice.message.tool_calls)
        assert choice.message.content.startswith("The weather in Paris")  # the chapter's claim: prose, strict or not
        for c in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(c.function.arguments), {"get_weather": weather, "get_time": clock}[
                c.function.name]["function"]["parameters"])
