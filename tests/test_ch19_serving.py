"""Chapter 19: adapters behind the server — through the official openai client, both adapters and the base in
flight at once each return transformers + PEFT's greedy text; /v1/models lists them; adapters load and unload at
run time behind the admin key; bad ones get a 4xx naming the parameter, and the server keeps serving."""

import asyncio
import shutil

import httpx
import openai
import pytest

from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.config import LoRAConfig
from nanoserve.server.runner import serving
from tests.lora_reference import peft_greedy, peft_model, tiny_llama

MODEL, ADMIN = "tiny", "admin-secret"
PROMPTS = {"a": [5, 17, 99, 3, 42, 7], "b": [8, 1, 200, 31], None: [64, 65, 66, 9, 12]}


@pytest.fixture(scope="module")
def server(tiny_adapters, smollm2_tokenizer):
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)),
                       smollm2_tokenizer)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    with serving(engine, smollm2_tokenizer, model_name=MODEL, admin_key=ADMIN) as (url, _):
        yield url


def complete(client, model, prompt):
    return client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_two_adapters_and_the_base_in_flight_match_peft(server, tiny_adapters, smollm2_tokenizer):
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none")

    async def main():
        return await asyncio.gather(*(complete(client, lora or MODEL, ids) for lora, ids in PROMPTS.items()))

    replies = asyncio.run(main())
    theirs = peft_model(tiny_adapters)
    for (lora, ids), reply in zip(PROMPTS.items(), replies):
        assert reply.model == (lora or MODEL)
        assert reply.choices[0].text == smollm2_tokenizer.decode(peft_greedy(theirs, ids, lora, 6)), lora


def test_models_lists_the_base_and_each_adapter(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "a", "b"}
    assert cards["a"].parent == MODEL and client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "c", [1, 2, 3])
    assert e.value.body["param"] == "model"


def test_load_and_unload_at_run_time(server, tiny_adapters, tmp_path):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    copy = shutil.copytree(tiny_adapters["a"], tmp_path / "a-again")
    load = lambda body, headers=admin: httpx.post(f"{server}/v1/load_lora_adapter", json=body, headers=headers)  # noqa
    unload = lambda body: httpx.post(f"{server}/v1/unload_lora_adapter", json=body, headers=admin)  # noqa
    assert load({"lora_name": "c", "lora_path": str(copy)}, {}).status_code == 401  # the admin key alone opens it
    assert load({"lora_name": "c", "lora_path": str(copy)}).status_code == 200
    assert complete(client, "c", PROMPTS["a"]).choices[0].text == complete(client, "a", PROMPTS["a"]).choices[0].text
    assert unload({"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "c", PROMPTS["a"])
    # the refusals, each naming its parameter
    for body, status, param, words in [
        ({"lora_name": "d", "lora_path": str(tmp_path / "nowhere")}, 400, "lora_path", "not a PEFT adapter"),
        ({"lora_name": "a", "lora_path": str(copy)}, 400, "lora_name", "already taken"),
        ({"lora_name": MODEL, "lora_path": str(copy)}, 400, "lora_name", "already taken"),
    ]:
        r = load(body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param) and words in r.json()["error"]["message"]
    r = unload({"lora_name": "nope"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "lora_name")
    assert complete(client, MODEL, PROMPTS[None]).choices[0].finish_reason == "length"  # still serving
