"""Chapter 08 — the OpenAI contract: nothing silently dropped (unsupported fields and unknown fields are
400s naming them), hostile bodies refused before tokenizing, penalties / logit_bias / min_p changing the
logits exactly as defined (hand-computed vectors) and per row, logprobs in OpenAI's shapes that match
transformers' log-softmax, and a seeded request that draws the same whatever shares its batch."""

import json

import httpx
import openai
import pytest
import torch

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampler import SampleRow, sample_rows, token_logprobs
from nanoserve.sampling import SamplingParams, apply_penalties, min_p_filter
from nanoserve.server.protocol import UNSUPPORTED, ChatCompletionRequest, finite_json
from nanoserve.server.runner import serving
from tests.test_ch08_server import HI, assert_openai_error, assert_pool_whole, chat_body
from tests.test_ch08_server import tiny, tokenizer  # noqa: F401  (fixtures: the tiny model, the real tokenizer)


@pytest.fixture
def engine(tiny, tokenizer):
    return LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=16),
                                        scheduler_config=SchedulerConfig(max_num_seqs=8)), tokenizer)


# ---- the sampler, against hand-computed logits ---------------------------------------------------------

def test_penalties_change_the_logits_as_defined():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0, -3.0])
    prompt, output = [1, 3], [0, 0, 4]
    # repetition 2 over prompt and output: positive logits halved, negative ones doubled
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt, output)
    assert torch.allclose(rep, torch.tensor([1.0, -2.0, 0.5, 0.5, -6.0]))
    # frequency 0.5 * count and presence 1 over the generated tokens only (token 1 and 3 are prompt tokens)
    fp = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), prompt, output)
    assert torch.allclose(fp, torch.tensor([2 - 1.0 - 1, -1.0, 0.5, 1.0, -3 - 0.5 - 1]))
    # negative penalties encourage repetition
    neg = apply_penalties(logits, SamplingParams(presence_penalty=-2.0), prompt, output)
    assert torch.allclose(neg, torch.tensor([4.0, -1.0, 0.5, 1.0, -1.0]))
    bias = apply_penalties(logits, SamplingParams(logit_bias={2: 5.0, 0: -100}), prompt, output)
    assert torch.allclose(bias, torch.tensor([-98.0, -1.0, 5.5, 1.0, -3.0]))
    assert apply_penalties(logits, SamplingParams(), prompt, output) is logits  # nothing asked: untouched


def test_min_p_and_logit_bias_decide_the_draw():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])  # probs .644 .237 .087 .032
    assert torch.equal(torch.isinf(min_p_filter(logits, 0.2)), torch.tensor([False, False, True, True]))
    assert torch.equal(torch.isinf(min_p_filter(logits, 0.4)), torch.tensor([False, True, True, True]))
    rows = [SampleRow(0, SamplingParams(temperature=1.0, min_p=0.4), torch.Generator().manual_seed(i), [], [])
            for i in range(20)]
    assert set(sample_rows(logits[None], rows)[0]) == {0}  # min_p 0.4 leaves only the argmax
    greedy_banned = SampleRow(0, SamplingParams(temperature=0, logit_bias={0: -100}), None, [], [])
    assert sample_rows(logits[None], [greedy_banned])[0] == [1]  # -100 bans even the argmax


def test_each_row_is_sampled_alone_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.9, seed=1, presence_penalty=1.5),
              SamplingParams(temperature=0, repetition_penalty=1.8),
              SamplingParams(temperature=1.2, seed=2, logit_bias={3: 10.0}, logprobs=3),
              SamplingParams(temperature=0.7, seed=3, min_p=0.1, frequency_penalty=-1),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=4, top_k=5, top_p=0.8)]
    history = [([1, 2], [3, 3]), ([4], [5, 6]), ([7], []), ([8, 9], [9, 9, 9]), ([1], [2]), ([], [10])]

    def row(i, at):
        return SampleRow(at, params[i], torch.Generator().manual_seed(params[i].seed or 0), *history[i])

    together, together_lp = sample_rows(logits, [row(i, i) for i in range(6)])
    for i in range(6):
        alone, alone_lp = sample_rows(logits[i:i + 1], [row(i, 0)])
        assert alone == [together[i]] and alone_lp == [together_lp[i]]
    # the logprobs are the raw model's: log-softmax of the row, before the bias that made token 3 likely
    raw = torch.log_softmax(logits[2], -1)
    assert together_lp[2].logprob == pytest.approx(float(raw[together[2]]))
    assert [t for t, _ in together_lp[2].top] == raw.topk(3).indices.tolist()
    assert together_lp[0] is None  # not asked for


def test_finite_json_writes_a_non_finite_float_as_null():
    """The encoder of every body and stream chunk: what Python's json would write as -Infinity or NaN is null,
    at any depth, and a body without one is written as json.dumps writes it."""
    def strict(text):  # a parser that refuses NaN, Infinity and -Infinity, as JSON does
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))

    body = {"logprob": float("-inf"), "top": [1.5, float("nan")], "pair": (float("inf"), 2), "deep": {"x": [0.5]}}
    assert strict(finite_json(body)) == {"logprob": None, "top": [1.5, None], "pair": [None, 2], "deep": {"x": [0.5]}}
    assert finite_json({"x": [0.5, "a"]}, separators=(",", ":")) == '{"x":[0.5,"a"]}'


def test_token_logprobs_rank_and_top():
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), -1)
    (entry,) = token_logprobs(lp, [2], 2)
    assert entry.rank == 3 and [t for t, _ in entry.top] == [1, 3]
    assert entry.logprob == pytest.approx(float(lp[0, 2]))


# ---- the request bodies --------------------------------------------------------------------------------

def test_unsupported_and_unknown_fields_are_refused_by_name(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        with httpx.Client(base_url=url) as http:
            for name in UNSUPPORTED:
                if name == "suffix":
                    continue
                # tools and tool_choice are chat's (chapter 13): the completions endpoint refuses them by name
                endpoint, body = (("/v1/completions", {"prompt": "a", name: [1]}) if name in ChatCompletionRequest.model_fields
                                  else ("/v1/chat/completions", chat_body(**{name: [1]})))
                error = assert_openai_error(http.post(endpoint, json=body), 400)
                assert error["message"].startswith(f"`{name}` is not supported by this server") and \
                    error["param"] == name
            error = assert_openai_error(http.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), 400)
            assert error["param"] == "suffix"
            for body in (chat_body(frobnicate=True), chat_body(logprobs_count=2)):
                error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
                assert error["message"] == f"Unrecognized request argument supplied: {list(body)[-1]}"
            # null means "not asked", as OpenAI's SDKs send it; store: true is refused, store: false fine
            assert http.post("/v1/chat/completions", json=chat_body(tools=None)).status_code == 200
            assert_openai_error(http.post("/v1/chat/completions", json=chat_body(store=True)), 400)
            extensions = dict(top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[2],
                              presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": -100}, user="u",
                              metadata={"k": "v"}, store=False, seed=3, temperature=0.7)
            r = http.post("/v1/chat/completions", json=chat_body(**extensions))
            assert r.status_code == 200, r.text
            # max_completion_tokens, OpenAI's newer name for max_tokens: alone, or beside an equal max_tokens;
            # two different bounds are refused, not one of them dropped
            body = chat_body(max_completion_tokens=2, ignore_eos=True)
            del body["max_tokens"]
            assert http.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 2
            r = http.post("/v1/chat/completions", json=chat_body(max_completion_tokens=4, ignore_eos=True)).json()
            assert r["usage"]["completion_tokens"] == 4
            error = assert_openai_error(http.post("/v1/chat/completions", json=chat_body(max_completion_tokens=2)), 400)
            assert error["param"] == "max_completion_tokens" and "max_tokens=4 and max_completion_tokens=2" in error["message"]
            # a developer message renders as the system one
            dev = http.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."}] + HI})
            sys = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}] + HI})
            assert dev.json()["tokens"] == sys.json()["tokens"]
            # the completions endpoint's default max_tokens is OpenAI's 16; chat's is what the context leaves
            done = http.post("/v1/completions", json={"prompt": "a", "temperature": 0, "ignore_eos": True}).json()
            assert done["usage"]["completion_tokens"] == 16
    assert_pool_whole(engine)


HOSTILE = [
    (b"[" * 5000 + b"]" * 5000, None),                                       # deep nesting, not an object
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),              # deep nesting inside
    (json.dumps(chat_body(metadata={"a": "b"}, x=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]])).encode(),
     None),
    (json.dumps(chat_body(logit_bias={str(i): 1 for i in range(10_000)})).encode(), "logit_bias"),
    (json.dumps(chat_body(logit_bias={"49152": 1})).encode(), None),           # outside the vocabulary
    (json.dumps(chat_body(logit_bias={"x": 1})).encode(), "logit_bias"),
    (json.dumps(chat_body(logit_bias={"1": 101})).encode(), "logit_bias"),
    (json.dumps(chat_body(stop=[str(i) for i in range(100)])).encode(), "stop"),
    (json.dumps(chat_body(stop="x" * 100_000)).encode(), "stop"),
    (json.dumps(chat_body(logprobs=True, top_logprobs=500)).encode(), "top_logprobs"),
    (json.dumps(chat_body(top_logprobs=2)).encode(), "top_logprobs"),         # without logprobs: true
    (json.dumps(chat_body(n=16, max_tokens=5000)).encode(), None),              # n * max_tokens beyond any bound
    (json.dumps(chat_body(n=1000)).encode(), "n"),
    (json.dumps(chat_body(presence_penalty=3)).encode(), "presence_penalty"),
    (json.dumps(chat_body(repetition_penalty=0)).encode(), "repetition_penalty"),
]


def test_hostile_bodies_are_cheap_400s(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny", max_body_bytes=1 << 20, max_request_tokens=4096) as (url, _):
        with httpx.Client(base_url=url) as http:
            for body, param in HOSTILE:
                r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
                error = assert_openai_error(r, 400)
                if param is not None:
                    assert error["param"] == param, (body[:80], error)
            assert http.post("/v1/chat/completions", json=chat_body(n=2)).status_code == 200  # n=2 is fine
    assert_pool_whole(engine)


# ---- logprobs, seeds --------------------------------------------------------------------------------------

def test_logprobs_shapes_streamed_and_not(engine, tokenizer):
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        kw = dict(model="tiny", messages=HI, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
        content = reply.choices[0].logprobs.content
        assert len(content) == 5 and "".join(c.token for c in content) == reply.choices[0].message.content
        for c in content:  # greedy: the sampled token is the most likely one
            assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
            assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.logprob <= 0
            assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        streamed = [e for chunk in client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw)
                    for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
        assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
        assert client.chat.completions.create(**kw).choices[0].logprobs is None  # not asked: null
        done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
        lp = done.choices[0].logprobs
        assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 4
        assert lp.text_offset[0] == 0 and all(len(top) == 2 for top in lp.top_logprobs)
        assert all(top[t] == pytest.approx(v) for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert_pool_whole(engine)


def test_a_seed_draws_the_same_alone_and_in_a_batch_of_8_on_the_float32_engine(engine, tokenizer, tiny):
    """On the float32 engine (the tiny model, float32 weights and KV pool) a row's logits alone and in a batch
    differ at most in their last bits, and the seeded draw is the same. The q4 engine `serve` runs by default
    computes a step of one-token rows, up to cpu_decode.max_rows (16 without native bf16, 1 with it), on another
    path than a wider step's or one with a prefill chunk (the native C step, int8 activations), so there the same
    seed may draw another text (chapter 10, section 5): this is float32's claim."""
    import asyncio

    assert {p.dtype for p in tiny.parameters()} == {torch.float32} and engine.precision_names[0] == "fp32"
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True, "presence_penalty": 0.3}
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        alone = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        async def batch():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                others = [http.post("/v1/completions", json={**body, "seed": s, "prompt": f"Story {s}:"})
                          for s in range(7)]
                return await asyncio.gather(http.post("/v1/completions", json=body), *others)

        replies = asyncio.run(batch())
        assert replies[0].json()["choices"][0]["text"] == alone
        assert len({r.json()["choices"][0]["text"] for r in replies}) > 1  # the others did draw other things
    assert_pool_whole(engine)


@pytest.mark.slow
def test_logprobs_match_transformers_through_the_openai_client(smollm2, hf_model, hf_tokenizer):
    from nanoserve.llm import LLM

    llm = LLM(smollm2, num_blocks=128, max_num_seqs=4)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with serving(llm.engine, llm.tokenizer, model_name="smol") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for prompt in prompts:
            done = client.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0, logprobs=5)
            ids = llm.tokenizer.encode(prompt)
            lp = done.choices[0].logprobs
            for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
                with torch.no_grad():  # transformers' log-softmax of the next-token logits, greedy step by step
                    row = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
                best = row.topk(5)
                assert abs(token_lp - float(best.values[0])) < 2e-3  # greedy: the best token's logprob
                assert list(top)[:3] == [llm.tokenizer.decode([t]) for t in best.indices[:3].tolist()]
                assert max(abs(a - float(b)) for a, b in zip(top.values(), best.values)) < 2e-3
                ids.append(int(best.indices[0]))


def test_n_completions_count_their_prompt_once_in_the_metrics(engine, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Once upon", "n": 3, "max_tokens": 2,
                                                       "temperature": 0.8, "seed": 1, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("Once upon"))
        values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
                  for s in f.samples}
        assert values["nanoserve:prompt_tokens_total"] == len(tokenizer.encode("Once upon"))
        assert values["nanoserve:generation_tokens_total"] == 3 * 2


# ---- prompt logprobs (echo): the perplexity use case ----------------------------------------------------

def reference_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """Plain torch, no cache, no engine: log-softmax of the float32 logits of every prompt position.
    Row p scores prompt[p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model.compute_logits(model(torch.tensor(prompt))).float(), -1)


def test_prompt_logprobs_across_chunks_and_past_a_cached_prefix(tiny):
    prompt = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_prompt_logprobs(tiny, prompt)
    other = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)

    def run(prompt_logprobs: int | None, caching: bool = True):
        # a 16-token budget: the 45-token prompt spans 3 chunks, sharing steps with the other request
        engine = LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=32, block_size=8, enable_prefix_caching=caching),
                                              scheduler_config=SchedulerConfig(max_num_batched_tokens=16)))
        engine.add_request("warm", prompt[:40], SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():  # leaves 5 full blocks (40 tokens) of the prompt in the prefix cache
            engine.step()
        # what a lookup of the echo prompt would skip, were it not scoring its prompt: 40 / 8 = 5 blocks
        assert engine.block_manager.lookup_prefix(prompt) == (5 * 8 if caching else 0)
        engine.add_request("echo", prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=1,
                                                          prompt_logprobs=prompt_logprobs))
        engine.add_request("other", prompt[:30], other)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert_pool_whole(engine)
        return outs, engine.block_manager.stats

    outs, stats = run(prompt_logprobs=3)
    scored = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(scored) == 1 and [o.request_id for o in outs if o.prompt_logprobs] == ["echo"]  # once, with its first token
    entries = scored[0]
    assert len(entries) == len(prompt) and entries[0] is None
    for p, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[p] and abs(e.logprob - float(ref[p - 1, prompt[p]])) < 1e-4
        assert [t for t, _ in e.top] == ref[p - 1].topk(3).indices.tolist()
        x = ref[p - 1, prompt[p]]  # its rank, up to ties within float32 noise (the tiny model's logits are flat)
        assert int((ref[p - 1] > x + 1e-4).sum()) + 1 <= e.rank <= int((ref[p - 1] > x - 1e-4).sum()) + 1
    # the echo request looked nothing up (its 45 positions all computed); "other" still hit the cache
    assert stats.hit_blocks == 3
    # batch invariance: the same steps without prompt logprobs (prefix caching off in both runs, or the echo
    # request would hit the cache in one of them) draw bit for bit the same tokens and logprobs, its own included
    drawn = lambda outs: [(o.request_id, o.new_token_ids, o.logprobs) for o in outs]  # noqa: E731
    assert drawn(run(prompt_logprobs=3, caching=False)[0]) == drawn(run(prompt_logprobs=None, caching=False)[0])


def test_echo_in_openai_shapes(engine, tokenizer, tiny):
    prompt = "The cat sat on the mat."
    ids = tokenizer.encode(prompt)
    ref = reference_prompt_logprobs(tiny, ids)
    with serving(engine, tokenizer, model_name="tiny") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        kw = dict(model="tiny", prompt=prompt, temperature=0, echo=True)
        done = client.completions.create(max_tokens=2, logprobs=2, extra_body={"ignore_eos": True}, **kw)
        plain = client.completions.create(max_tokens=2, logprobs=2, extra_body={"ignore_eos": True},
                                          **{**kw, "echo": False})
        choice, lp = done.choices[0], done.choices[0].logprobs
        assert choice.text == prompt + plain.choices[0].text
        assert lp.tokens == [tokenizer.decode([t]) for t in ids] + plain.choices[0].logprobs.tokens
        assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) < 1e-4
            assert list(lp.top_logprobs[p]) == [tokenizer.decode([t]) for t in ref[p - 1].topk(2).indices.tolist()]
        assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
        assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 2
        # max_tokens 0: score only, the prompt back with its logprobs, nothing generated
        scored = client.completions.create(max_tokens=0, logprobs=0, **kw)
        assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
        assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-5)
        assert scored.usage.completion_tokens == 0 and scored.usage.total_tokens == len(ids)
        # echo without logprobs: the text only; n > 1: every choice starts with the prompt
        texts = client.completions.create(max_tokens=2, n=2, **kw).choices
        assert all(c.text.startswith(prompt) and c.logprobs is None for c in texts)
        for body, param in [({"prompt": prompt, "max_tokens": 0}, "max_tokens"),
                            ({"prompt": prompt, "echo": True, "stream": True}, "echo")]:
            assert assert_openai_error(httpx.post(f"{url}/v1/completions", json=body), 400)["param"] == param
    assert_pool_whole(engine)


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_through_the_openai_client(smollm2, hf_model, hf_tokenizer):
    from nanoserve.llm import LLM

    prefix = "Perplexity measures how surprised a language model is by a text: the lower, the better."
    texts = [prefix + " The capital of France is Paris.", prefix + " def fibonacci(n): return n"]
    # a 16-token budget: every prompt spans several chunks; the second one starts with the first's cached prefix
    llm = LLM(smollm2, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    with serving(llm.engine, llm.tokenizer, model_name="smol") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        client.completions.create(model="smol", prompt=prefix, max_tokens=1)  # the prefix is now cached
        for text in texts:
            lp = client.completions.create(model="smol", prompt=text, max_tokens=0, echo=True, logprobs=5).choices[0].logprobs
            ids = hf_tokenizer(text)["input_ids"]
            assert ids == llm.tokenizer.encode(text) and len(lp.token_logprobs) == len(ids)
            with torch.no_grad():  # transformers' log-softmax of each prompt position's logits
                rows = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
            assert lp.token_logprobs[0] is None
            diffs = [abs(lp.token_logprobs[p] - float(rows[p - 1, ids[p]])) for p in range(1, len(ids))]
            assert max(diffs) < 2e-3
            for p in range(1, len(ids)):
                best = rows[p - 1].topk(5)
                assert list(lp.top_logprobs[p])[:3] == [llm.tokenizer.decode([t]) for t in best.indices[:3].tolist()]
                assert max(abs(a - float(b)) for a, b in zip(lp.top_logprobs[p].values(), best.values)) < 2e-3
        stats = llm.engine.block_manager.stats
        assert stats.hit_blocks == 0  # the echo requests looked nothing up ...
        client.completions.create(model="smol", prompt=texts[0], max_tokens=1)
        assert stats.hit_blocks >= len(llm.tokenizer.encode(prefix)) // 16  # ... though the prefix was cached
    assert llm.engine.block_manager.get_num_free_blocks() == llm.engine.block_manager.num_blocks


@torch.inference_mode()
def test_on_q4_and_a_bf16_pool_a_repeat_past_its_cached_prefix_is_the_eager_pick_or_a_near_tie_of_it():
    """What holds on `serve`'s default format instead of equality: q4 weights on a bf16 KV pool, the tiny model
    set up as LLM sets up a GGUF's (a large-step copy with the crossover at 16; the native one-token step where it
    builds). The same greedy prompt of 24 tokens twice: cold, its prefill is one 24-token step (past the crossover:
    the GEMM on the large-step copy); repeated, 20 of its tokens are a prefix-cache hit and the prefill is a
    4-token step on the small-step kernel (torch's, or cpu_dot.c's int8 activations). Other products, other
    roundings, so the two answers need not be equal. Each token of each is the eager model's top pick over the same
    prefix (one forward, no cache: float32 attention, the layers' own paths), or within a near-tie of it: chapter
    09's margin on a bf16 pool, 2 % of the row's largest |logit|. The check can fail: an answer that starts with
    the eager model's least likely token does."""
    from nanoserve.kernels.cpu_decode import default_native_decode
    from nanoserve.llm import LLM
    from nanoserve.model.layers import Linear
    from nanoserve.model.quant import quantize_model, set_kernel_crossover
    from tests.test_ch09_native_decode import MARGIN
    from tests.test_ch10_quant import q4_1_blocks
    from tests.tiny_model import tiny_llama

    model = tiny_llama(vocab_size=49152, max_position_embeddings=1024)  # test_ch08_server's tiny, fresh to quantize
    blocks = {name: q4_1_blocks(m.weight.detach().numpy()) for name, m in model.named_modules()
              if isinstance(m, Linear) and name != "lm_head"}
    quantize_model(model, "q4", blocks)  # the default small-step kernel of this CPU, as load_gguf's
    set_kernel_crossover(model)
    model.native_decode = default_native_decode("q4", None)
    llm = LLM(model, num_blocks=64, block_size=4, kv_cache_dtype="bf16")
    prompt = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answers = [llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].token_ids for _ in range(2)]
    assert llm.engine.block_manager.stats.hit_blocks == 5  # the repeat found 20 of its 24 prompt tokens cached

    def off_the_eager_pick(out):  # per token, how far below the eager top pick it is, over the near-tie margin
        logits = model.compute_logits(model(torch.tensor(prompt + out)))[len(prompt) - 1:-1]  # row i predicts out[i]
        gap = logits.max(-1).values - logits[torch.arange(len(out)), torch.tensor(out)]
        return (gap / (MARGIN["bf16"] * logits.abs().max(-1).values)).tolist()

    print("cold:  ", answers[0], "\nrepeat:", answers[1])  # equal or not: the CPU's kernels decide (-s shows)
    for out in answers:
        assert max(off_the_eager_pick(out)) <= 1, f"a token off the eager pick by more than a near-tie: {out}"
    worst = int(model.compute_logits(model(torch.tensor(prompt)))[-1].argmin())  # the eager pick's opposite
    assert off_the_eager_pick([worst] + answers[0][1:])[0] > 1
