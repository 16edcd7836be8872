"""Chapter 19: adapters behind the server — through the official openai client, both adapters and the base in
flight at once each return transformers + PEFT's greedy text; /v1/models lists them; adapters load and unload at
run time behind the admin key; bad ones get a 4xx naming the parameter, and the server keeps serving."""

import asyncio
import json
import shutil
import time

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
    too_wide, foreign = (shutil.copytree(tiny_adapters["a"], tmp_path / n) for n in ("r16", "lm-head"))
    (too_wide / "adapter_config.json").write_text(
        json.dumps(json.loads((copy / "adapter_config.json").read_text()) | {"r": 16}))  # the server's max rank: 8
    (foreign / "adapter_config.json").write_text(
        json.dumps(json.loads((copy / "adapter_config.json").read_text()) | {"target_modules": ["q_proj", "lm_head"]}))
    # the refusals, each naming its parameter
    for body, status, param, words in [
        ({"lora_name": "d", "lora_path": str(too_wide)}, 400, "lora_path", "above max_lora_rank=8"),
        ({"lora_name": "d", "lora_path": str(foreign)}, 400, "lora_path", "not projections of this model"),
        ({"lora_name": "d", "lora_path": str(tmp_path / "nowhere")}, 400, "lora_path", "not a PEFT adapter"),
        ({"lora_name": "a", "lora_path": str(copy)}, 400, "lora_name", "already taken"),
        ({"lora_name": MODEL, "lora_path": str(copy)}, 400, "lora_name", "already taken"),
    ]:
        r = load(body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param) and words in r.json()["error"]["message"]
    r = unload({"lora_name": "nope"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "lora_name")
    assert complete(client, MODEL, PROMPTS[None]).choices[0].finish_reason == "length"  # still serving


def test_no_adapter_routes_with_lora_off(smollm2_tokenizer):
    """An admin key but no LoRA layers: the adapter routes do not exist (404, as any unknown path)."""
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=16), smollm2_tokenizer)
    with serving(engine, smollm2_tokenizer, model_name=MODEL, admin_key=ADMIN) as (url, _):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404


def test_unloading_an_adapter_in_use_lets_its_streams_finish(tiny_adapters, smollm2_tokenizer):
    """vLLM's rule, through the openai client: POST /v1/unload_lora_adapter while a stream under `a` is running
    answers at once ("draining"), `a` is then a 404 for new requests, and the stream runs to its last token with
    a's weights (PEFT's greedy text for a, whole); a load under the name waits until it ends. Its weights leave
    the slots and memory when its last request ends — finished, or aborted by a client that hung up (b)."""
    from tests.tiny_model import PacedLlama

    model = PacedLlama(tiny_llama().config).eval()
    model.load_state_dict(tiny_llama().state_dict())
    model.delay_s = 0.1  # a step of 0.1 s: a 30-token stream lasts 3 s
    engine = LLMEngine(model, engine_config(num_blocks=64, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)),
                       smollm2_tokenizer)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    manager = engine.executor.workers[0].lora_manager
    held = lambda name: name in manager.paths or name in manager.cpu or name in manager.slots  # noqa: E731
    admin = {"Authorization": f"Bearer {ADMIN}"}
    theirs = peft_model(tiny_adapters)
    expected = smollm2_tokenizer.decode(peft_greedy(theirs, PROMPTS["a"], "a", 30))
    assert expected != smollm2_tokenizer.decode(peft_greedy(theirs, PROMPTS["a"], None, 30))  # a's weights matter
    with serving(engine, smollm2_tokenizer, model_name=MODEL, admin_key=ADMIN) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        unload = lambda name: httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=admin)  # noqa
        load = lambda name: httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,  # noqa: E731
                                       json={"lora_name": name, "lora_path": str(tiny_adapters[name])})
        stream = client.completions.create(model="a", prompt=PROMPTS["a"], max_tokens=30, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text  # running now
        r = unload("a")
        assert r.status_code == 200 and r.json() == {"object": "lora_adapter", "id": "a", "status": "draining",
                                                     "num_requests": 1}
        with pytest.raises(openai.NotFoundError) as e:  # gone for new requests at once
            complete(client, "a", PROMPTS["a"])
        assert e.value.body["param"] == "model" and "a" not in {m.id for m in client.models.list().data}
        r = load("a")  # its slot still holds the old weights
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lora_name") and "still run" in r.text
        assert held("a")  # nothing freed under the running stream
        text += "".join(c.choices[0].text for c in chunks)
        assert text == expected  # every token with a's weights
        assert not held("a")  # the last request ended: freed
        assert load("a").status_code == 200 and complete(client, "a", PROMPTS["a"]).choices[0].text == \
            smollm2_tokenizer.decode(peft_greedy(theirs, PROMPTS["a"], "a", 6))
        # b: its stream's client hangs up while b drains; the abort ends b's last request, b is freed
        stream = client.completions.create(model="b", prompt=PROMPTS["b"], max_tokens=30, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        assert unload("b").json()["status"] == "draining"
        stream.close()
        deadline = time.monotonic() + 60  # the server sees the hang-up, the engine aborts at its next step boundary
        while held("b") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not held("b") and engine.lora_draining == set()
        assert complete(client, MODEL, PROMPTS[None]).choices[0].finish_reason == "length"  # still serving
