"""Chapter 19: sleep mode — an idle engine releases its weights (level 1: to a file; level 2: dropped, built again
from the model's file on wake) and its KV pool, and wakes up serving the same greedy text. Its resident memory falls
by at least the bytes of the tensors released (counted here from the model and the config); the prefix cache
forgets the pool's blocks; requests while asleep get 503 with Retry-After through the official openai client;
/sleep, /wake_up and /is_sleeping need the admin key; a bad level is a 400 naming `level`; a sleep with requests
in flight is refused (409) and leaves nothing behind; a level-2 wake takes whatever weights the model file holds now.
Tiny random-weight engines, SmolLM2 once (q4, both levels)."""

import asyncio
import gc
import itertools
import os
import threading
import weakref

import httpx
import openai
import pytest
import torch

from nanoserve.bench.bluegreen import rss_mib
from nanoserve.bench.sleep import sleep_cycles
from nanoserve.engine.config import LoRAConfig, engine_config
from nanoserve.engine.llm_engine import EngineAsleep, LLMEngine, SleepConflict, SleepRefused
from nanoserve.engine.worker import release_memory
from nanoserve.kv.kv_events import BlockRemoved, BlockStored, record_kv_events
from nanoserve.sampling import SamplingParams
from nanoserve.server.runner import serving
from tests.tiny_model import paced_tiny_llama, tiny_llama

ADMIN, CLIENT_KEY = "admin-secret", "client-key"
# 40 tokens: two full blocks of 16 each, which the prefix cache keeps after the first run (a wake that kept them
# over a zeroed pool would read zeros there and change the text)
PROMPTS = [[(7 * i + 5 * j) % 250 + 3 for j in range(40)] for i in range(3)]
_ids = itertools.count()


def greedy(engine, prompts=PROMPTS, lora_names=None, n=8) -> list[list[int]]:
    """Each prompt's greedy tokens, all in one batch, stepping `engine` to the end."""
    ids = [f"r{next(_ids)}" for _ in prompts]
    for rid, prompt, lora in zip(ids, prompts, lora_names or [None] * len(prompts)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora_name=lora)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out.token_ids for out in engine.step() if out.finished}
    return [done[rid] for rid in ids]


def storage_sizes(tensors) -> list[int]:
    """Bytes of each distinct storage behind `tensors` (a tied embedding and LM head counted once)."""
    return list({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def whole_pages(sizes: list[int]) -> int:
    """What freeing storages of these sizes must give back to the OS at least: the OS takes memory back by whole
    pages, and a storage's first and last partial pages may be shared with objects still alive (a norm's 256 bytes
    share a page with others), so each may keep up to two pages."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(max(0, n - 2 * page) for n in sizes)


def pool_sizes(config, num_blocks: int, block_size: int = 16, dtype_bytes: int = 4) -> list[int]:
    """Chapter 04's formula, one tensor per layer for K and one for V (chapter 05's pool): each holds every block's
    tokens for every kv head."""
    one = num_blocks * block_size * config.num_key_value_heads * config.head_dim * dtype_bytes
    return [one] * 2 * config.num_hidden_layers


def updated_tiny_llama():
    """tiny_llama's shapes with other weights: its model file after an in-place weight update."""
    model = tiny_llama()
    torch.manual_seed(1)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)  # the tied LM head with it
    return model


def assert_pool_whole(engine) -> None:
    bm = engine.block_manager
    assert not engine.scheduler.seqs and bm.get_num_free_blocks() == bm.num_blocks, "a request or a block left behind"


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_tensors_bytes_and_wakes_with_the_same_greedy_text(level):
    model, num_blocks = tiny_llama(), 16384  # a 128 MiB pool: the weights of a tiny model are a few hundred KiB
    engine = LLMEngine(model, engine_config(num_blocks=num_blocks), model_loader=tiny_llama)
    engine.sleep(level), engine.wake_up()  # a first cycle: its code paged in, the heap settled
    log = record_kv_events(engine.block_manager)
    before = greedy(engine)
    stats = engine.block_manager.stats
    assert greedy(engine) == before and stats.hit_tokens == 2 * 16 * len(PROMPTS)  # the second run hits the cache
    sizes, pool = storage_sizes([*model.parameters(), *model.buffers()]), pool_sizes(model.config, num_blocks)
    events = log.take()
    cached = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes} - \
        {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    release_memory()
    awake = rss_mib() * 2**20
    done = engine.sleep(level)
    asleep = rss_mib() * 2**20
    assert done == {"level": level, "released_bytes": {"weights": sum(sizes), "kv_cache": sum(pool)}}
    # chapter 16's KV events: every cached block is announced leaving, one BlockRemoved each
    left = log.take()
    assert len(cached) == 2 * len(PROMPTS) and all(isinstance(e, BlockRemoved) for e in left)
    assert sorted(h for e in left for h in e.block_hashes) == sorted(cached)
    released = whole_pages(sizes + pool)
    assert awake - asleep >= released, f"RSS fell by {awake - asleep:.0f} bytes, {released} were released"
    assert model.lm_head.weight.shape == (0,) and len(engine.block_manager.prefix_cache) == 0
    with pytest.raises(EngineAsleep, match="asleep"):
        engine.add_request("late", PROMPTS[0], SamplingParams(max_tokens=1))
    with pytest.raises(SleepConflict, match="already asleep"):
        engine.sleep(level)
    assert engine.wake_up()["level"] == level
    with pytest.raises(SleepConflict, match="awake"):
        engine.wake_up()
    # the tied LM head shares the embedding's storage again, and the text is the text before
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr() != 0
    hits = stats.hit_tokens
    assert greedy(engine) == before and stats.hit_tokens == hits  # nothing was left to hit
    assert_pool_whole(engine)


def test_a_wake_from_a_file_that_now_holds_another_model_fails_and_stays_asleep():
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=32), model_loader=lambda: tiny_llama(hidden_size=32))
    engine.sleep(2)
    with pytest.raises(ValueError, match="does not match"):
        engine.wake_up()
    assert engine.sleep_level == 2
    with pytest.raises(EngineAsleep):
        engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=1))


def test_a_level_2_wake_takes_the_weights_the_model_file_holds_now():
    """Level 2 builds the model again from its file: a file updated in place (the same shapes, other weights) wakes
    the engine with the new weights, whose greedy text a fresh engine on them gives."""
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64), model_loader=updated_tiny_llama)
    before = greedy(engine)
    engine.sleep(2)
    engine.wake_up()
    expected = greedy(LLMEngine(updated_tiny_llama(), engine_config(num_blocks=64)))
    assert expected != before and greedy(engine) == expected
    assert_pool_whole(engine)


def test_what_cannot_sleep_is_refused_naming_why():
    plain = LLMEngine(tiny_llama(), engine_config(num_blocks=32))  # handed in loaded: no file to build it again from
    with pytest.raises(SleepRefused, match="level 2 builds the model again") as e:
        plain.sleep(2)
    assert e.value.param == "level"
    with pytest.raises(SleepRefused, match="level must be 1 or 2") as e:
        plain.sleep(3)
    assert e.value.param == "level" and not plain.sleep_level
    tier = LLMEngine(tiny_llama(), engine_config(num_blocks=32, kv_tier_blocks=8))
    degraded = LLMEngine(tiny_llama(), engine_config(num_blocks=32, degrade_under_load=2), degraded_model=tiny_llama())
    for engine, words in ((tier, "KV tier"), (degraded, "degrade_under_load")):
        with pytest.raises(SleepRefused, match=words) as e:
            engine.sleep(1)
        assert e.value.param is None and not engine.sleep_level
        engine.close()
    # a request in flight, waiting or running: refused, and the engine goes on as if nothing had been asked
    plain.add_request("busy", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in ("waiting", "running"):
        with pytest.raises(SleepConflict, match="in flight"):
            plain.sleep(1)
        plain.step()
    while plain.has_unfinished_requests():
        plain.step()
    assert not plain.sleep_level
    assert_pool_whole(plain)


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_serve_the_same_after_a_sleep(level, tiny_adapters):
    from tests.lora_reference import tiny_llama as lora_base

    engine = LLMEngine(lora_base(), engine_config(num_blocks=64, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8)),
                       model_loader=lora_base)
    for name, path in tiny_adapters.items():
        engine.add_lora(name, path)
    loras = ["a", "b", None]
    before = greedy(engine, lora_names=loras)
    engine.sleep(level)
    engine.wake_up()
    assert greedy(engine, lora_names=loras) == before
    assert_pool_whole(engine)


def test_smollm2_q4_sleeps_and_wakes_at_both_levels():
    """The served format (q4 blocks, their kernel layout, the bf16 copies, an int8 tied embedding), built again from
    the GGUF at level 2."""
    from nanoserve.llm import LLM

    llm = LLM(weights="q4", kv_cache_memory=32 << 20, kv_cache_dtype="bf16")
    prompt, params = "The capital of France is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].text
    model = llm.model
    held = [*model.parameters(), *model.buffers(),
            *(m.large_step_copy for m in model.modules() if getattr(m, "large_step_copy", None) is not None)]
    sizes = storage_sizes(held)
    pool = pool_sizes(model.config, llm.engine.block_manager.num_blocks, dtype_bytes=2)  # bf16
    for level in (1, 2):
        release_memory()
        awake = rss_mib() * 2**20
        done = llm.sleep(level)
        assert done["released_bytes"] == {"weights": sum(sizes), "kv_cache": sum(pool)}
        assert awake - rss_mib() * 2**20 >= whole_pages(sizes + pool)
        llm.wake_up()
        assert llm.generate(prompt, params, use_tqdm=False)[0].text == before, level
    assert_pool_whole(llm.engine)


# ---- over HTTP --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_tokenizer):
    engine = LLMEngine(paced_tiny_llama(0.02), engine_config(num_blocks=64), smollm2_tokenizer,
                       model_loader=lambda: paced_tiny_llama(0.02))
    with serving(engine, smollm2_tokenizer, model_name="tiny", api_key=CLIENT_KEY, admin_key=ADMIN) as (url, srv):
        yield url, srv


def admin_post(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers={"Authorization": f"Bearer {ADMIN}"}, **kw)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=CLIENT_KEY, max_retries=0)


def complete(url: str, **kw):
    return client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)


@pytest.mark.parametrize("level", [1, 2])
def test_while_asleep_requests_get_503_with_retry_after_and_after_wake_the_same_text(server, level, smollm2_tokenizer):
    url, srv = server
    before = complete(url).choices[0].text
    r = admin_post(url, "/sleep", params={"level": level})
    assert r.status_code == 200 and r.json()["is_sleeping"] and r.json()["level"] == level
    state = httpx.get(f"{url}/is_sleeping", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert state == {"is_sleeping": True, "level": level}
    calls = [lambda: complete(url), lambda: complete(url, stream=True),
             lambda: client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=4)]
    for call in calls:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert "asleep" in e.value.body["message"] and e.value.body["code"] == 503
    # what needs no model still answers: the models, the tokenizer, the health check
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "Hi there"},
                           headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == smollm2_tokenizer.encode("Hi there")
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    again = admin_post(url, "/sleep", params={"level": level})
    assert again.status_code == 409 and "already asleep" in again.json()["error"]["message"]
    woke = admin_post(url, "/wake_up")
    assert woke.status_code == 200 and woke.json()["is_sleeping"] is False and woke.json()["wake_s"] > 0
    assert admin_post(url, "/wake_up").status_code == 409  # awake: nothing to wake
    assert complete(url).choices[0].text == before
    assert_pool_whole(srv.state.engine.engine)


def test_sleep_routes_need_the_admin_key(server, smollm2_tokenizer):
    url, _ = server
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):  # no key, a client's key
            r = httpx.request(method, f"{url}{path}", headers=headers)
            assert r.status_code == 401 and "admin key" in r.json()["error"]["message"], (path, headers)
    assert not httpx.get(f"{url}/is_sleeping", headers={"Authorization": f"Bearer {ADMIN}"}).json()["is_sleeping"]
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=16), smollm2_tokenizer)
    with serving(engine, smollm2_tokenizer, model_name="tiny") as (plain, _):  # no admin key: no such route
        assert httpx.post(f"{plain}/sleep").status_code == 404


@pytest.mark.parametrize("params, body, param", [
    ({"level": "3"}, None, "level"), ({"level": "abc"}, None, "level"), ({"level": "0"}, None, "level"),
    (None, {"level": 3}, "level"), (None, {"level": "1"}, "level"), (None, {"level": True}, "level"),
    ({"level": "1"}, {"level": 2}, "level"), ({"level": ["1", "2"]}, None, "level"),
    (None, {"lvl": 1}, "lvl"), ({"mode": "deep"}, None, "mode")])
def test_a_bad_level_is_a_400_naming_it(server, params, body, param):
    url, _ = server
    r = admin_post(url, "/sleep", params=params, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert not httpx.get(f"{url}/is_sleeping", headers={"Authorization": f"Bearer {ADMIN}"}).json()["is_sleeping"]


def test_wake_up_refuses_what_it_does_not_read(server):
    url, _ = server
    r = admin_post(url, "/wake_up", params={"tags": "weights"})  # vLLM's partial wake is not built
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"


def test_level_2_needs_a_model_file_to_build_again(smollm2_tokenizer):
    def engine(*_):
        return LLMEngine(tiny_llama(), engine_config(num_blocks=16), smollm2_tokenizer)  # handed in: no model loader

    # `loader`: chapter 15's reload builds its next version with it (asleep, it is refused)
    with serving(engine(), smollm2_tokenizer, model_name="tiny", admin_key=ADMIN, loader=engine) as (url, srv):
        r = admin_post(url, "/sleep", json={"level": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "level" and "level 1" in r.json()["error"]["message"]
        assert admin_post(url, "/sleep", json={"level": 1}).status_code == 200
        assert admin_post(url, "/admin/reload", json={}).status_code == 409  # asleep: wake it first
        assert admin_post(url, "/wake_up").status_code == 200


def test_a_sleep_with_requests_in_flight_is_refused_and_leaves_nothing_behind(server, monkeypatch):
    url, srv = server
    # The stream's second step waits (60 s at most) until the sleep has been asked of the engine: the 40 tokens
    # cannot all be done before the /sleep request gets there, however slow the machine.
    async_engine, engine = srv.state.engine, srv.state.engine.engine
    asked, steps, step, sleep = threading.Event(), [0], engine.step, async_engine.sleep

    def held():
        steps[0] += 1
        if steps[0] >= 2:
            asked.wait(60)
        return step()

    async def asking(*args, **kwargs):
        asked.set()
        return await sleep(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held)
    monkeypatch.setattr(async_engine, "sleep", asking)

    async def main():
        stream_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=CLIENT_KEY, max_retries=0)
        stream = await stream_client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, stream=True,
                                                        temperature=0, extra_body={"ignore_eos": True})
        chunks = [await anext(stream)]  # in flight now
        async with httpx.AsyncClient() as http:
            refused = await http.post(f"{url}/sleep", headers={"Authorization": f"Bearer {ADMIN}"})
        chunks += [chunk async for chunk in stream]
        return refused, chunks

    try:
        refused, chunks = asyncio.run(main())
    finally:
        asked.set()
    assert refused.status_code == 409 and "in flight" in refused.json()["error"]["message"]
    assert chunks[-1].choices[0].finish_reason == "length"  # the request ran to its end
    assert admin_post(url, "/sleep").status_code == 200 and admin_post(url, "/wake_up").status_code == 200
    assert_pool_whole(srv.state.engine.engine)


def test_the_bench_measures_both_levels(smollm2_tokenizer):
    """`bench experiment sleep`'s loop, on the tiny model: its figures are the engine's own counts; once its server
    has stopped the engine is freed (the next format measured in the process must not find it in memory)."""
    model = tiny_llama()
    weights, config = sum(storage_sizes([*model.parameters(), *model.buffers()])), model.config
    engines = [LLMEngine(model, engine_config(num_blocks=64), smollm2_tokenizer, model_loader=tiny_llama)]
    del model
    freed = weakref.ref(engines[0])
    rows = sleep_cycles(engines.pop(), smollm2_tokenizer, max_tokens=4, prompt=PROMPTS[0])
    for level in (1, 2):
        row = rows[level]
        assert row["same_text"] and row["wake_s"] >= row["engine_wake_s"] > 0
        assert row["released_weights_mib"] == weights / 2**20
        assert row["released_kv_cache_mib"] == sum(pool_sizes(config, 64)) / 2**20
    gc.collect()
    assert freed() is None, "the stopped server still holds the engine"


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_bench_sleep_serves_each_format_on_serves_own_kv_dtype(weights):
    """`bench experiment sleep` asks serve's own flag handling which KV pool goes with each --weights (every other
    flag at serve's default): an explicit --weights keeps the model's pool, q4 included."""
    from nanoserve.bench.sleep import served_kv_dtype

    assert served_kv_dtype(weights) == "auto"
