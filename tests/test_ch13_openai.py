"""Chapter 13 — the real SmolLM2 behind the real server, asked for JSON through the official openai client:
every constrained output parses and validates with jsonschema — greedy and sampled, alone and 16 at once,
streamed and not — while the same requests without response_format mostly do not (asserted: at most half; the
counts of the run are printed);
json_object, the completions endpoint, vLLM's structured_outputs (choice, regex), and the 400s."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from nanoserve.server.runner import serving
from nanoserve.structured.schemas import SCHEMAS, prompt

MODEL = "SmolLM2-135M-Instruct"
NAMES = list(SCHEMAS)


@pytest.fixture(scope="module")
def url(smollm2):
    from nanoserve.llm import LLM

    llm = LLM(smollm2, num_blocks=512, max_num_seqs=16)
    with serving(llm.engine, llm.tokenizer) as (base, _):
        yield base


def response_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def valid(name, text) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


async def ask(client, name, constrained, stream, **kw):
    extra = {"response_format": response_format(name)} if constrained else {}
    args = dict(model=MODEL, messages=prompt(name), max_tokens=60, **extra, **kw)
    if not stream:
        return (await client.chat.completions.create(**args)).choices[0].message.content
    chunks = await client.chat.completions.create(**args, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_16_at_once_every_constrained_output_validates_free_text_mostly_does_not(url, temperature):
    names = [NAMES[i % len(NAMES)] for i in range(16)]

    async def batches():  # one event loop for the client's connections
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        return [await asyncio.gather(*(ask(client, n, constrained, stream=i % 2 == 1, temperature=temperature, seed=i)
                                       for i, n in enumerate(names))) for constrained in (True, False)]

    constrained, free = asyncio.run(batches())
    ok = [valid(n, t) for n, t in zip(names, constrained)]
    free_ok = [valid(n, t) for n, t in zip(names, free)]
    print(f"temperature {temperature}: response_format {sum(ok)}/16 valid, without {sum(free_ok)}/16")
    assert all(ok), [t for t, good in zip(constrained, ok) if not good]
    assert sum(free_ok) <= 8  # without the grammar the model mostly echoes the schema or wraps it in prose


@pytest.mark.slow
def test_alone_greedy_and_sampled_each_schema_validates(url):
    async def one_by_one():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        return [(name, temperature, await ask(client, name, True, stream=False, temperature=temperature, seed=100 + i))
                for i, name in enumerate(NAMES) for temperature in [0, 1.0]]

    async def free_greedy():  # the same prompts (the schema in them), greedy, without response_format
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        return [await ask(client, name, False, stream=False, temperature=0) for name in NAMES]

    constrained = asyncio.run(one_by_one())
    ok = [valid(name, text) for name, _, text in constrained]
    free_ok = [valid(name, text) for name, text in zip(NAMES, asyncio.run(free_greedy()))]
    greedy_ok = sum(good for (_, temperature, _), good in zip(constrained, ok) if temperature == 0)
    print(f"alone: response_format {sum(ok)}/{len(ok)} valid ({greedy_ok}/{len(NAMES)} greedy), "
          f"without (greedy) {sum(free_ok)}/{len(NAMES)}")
    assert all(ok), [c for c, good in zip(constrained, ok) if not good]
    assert sum(free_ok) <= len(NAMES) // 2  # without the grammar the model mostly does not follow the schema


@pytest.mark.slow
def test_json_object_completions_choice_and_regex(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with the JSON object {"animal": "cat"}.'}],
        max_tokens=40, temperature=0, response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object, never anything else
        assert reply.choices[0].finish_reason == "length" and text.startswith("{") and _object_prefix(text)
    completion = client.completions.create(model=MODEL, prompt="A colour as JSON:", max_tokens=30, temperature=0,
                                           extra_body={"response_format": response_format("array")})
    assert valid("array", completion.choices[0].text)
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    date = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=12, temperature=1.0, seed=3,
                                     stream=True, extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", "".join(c.choices[0].text for c in date))


def _object_prefix(text: str) -> bool:
    import xgrammar as xgr

    from nanoserve.structured.compiler import GrammarCache
    from nanoserve.structured.params import StructuredOutputsParams
    from nanoserve.text.tokenizer import Tokenizer

    grammar = GrammarCache(Tokenizer.from_gguf(), 49152).compile(StructuredOutputsParams(json_object=True))
    return xgr.GrammarMatcher(grammar).accept_string(text)


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     'cannot be compiled: Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema"}}, 'needs a "json_schema" object'),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "("}}, "parenthesis is not closed"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "not both"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_grammars_are_a_400_naming_the_reason(url, extra, message):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra)
    assert message in e.value.body["message"]
