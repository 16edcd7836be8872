"""Chapter 08 — exercise 8.3, AsyncLLMEngine on a tiny random model: the streams carry exactly what the
synchronous LLMEngine produces, abort frees blocks at the next step boundary, a refused or cancelled add leaves
nothing, a failing step fails only its requests, the thread sleeps when idle and is gone after shutdown, and the
keywords a request carries (tenant, cache_salt, ...) reach the engine.
Graded: `make grade CH=08 EX=8.3` runs these against exercises/08-http-serving/async_engine.py (every coroutine
under a timeout: a bridge that loses an output fails instead of hanging)."""

import asyncio
import inspect
import threading
import time

import pytest

from nanoserve.engine.async_engine import EngineStepError, EngineUnavailable
from nanoserve.engine.config import CacheConfig, EngineConfig
from nanoserve.engine.llm_engine import LLMEngine, LoRANotLoaded
from nanoserve.engine.policies.base import SLOTargets
from nanoserve.sampling import SamplingParams
from nanoserve.structured.params import StructuredOutputsParams
from nanoserve.student import implementation
from tests.test_ch08_server import tokenizer  # noqa: F401  (fixture: the real tokenizer, for a grammar)
from tests.tiny_model import tiny_llama

pytestmark = pytest.mark.exercise("8.3")


def AsyncLLMEngine(engine):  # noqa: N802 — the graded class: the learner's under make grade
    return implementation("nanoserve.engine.async_engine").AsyncLLMEngine(engine)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


PROMPTS = [[5 + i, 6, 7 + 2 * i, 8] * (1 + i % 3) for i in range(6)]


def offline(model, prompts, params):
    """The reference: the synchronous engine stepped by hand."""
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=64, block_size=4)))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def assert_pool_whole(engine: LLMEngine):
    assert engine.block_manager.get_num_free_blocks() == engine.block_manager.num_blocks, "blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture
def async_engine(tiny):
    engine = AsyncLLMEngine(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=100, block_size=4))))
    engine.start()
    yield engine
    engine.shutdown()
    assert not engine.is_running


def count_calls(engine, method: str = "step") -> list[int]:
    """Wrap the LLMEngine's `method` so the test can count how often the thread called it."""
    calls, original = [0], getattr(engine.engine, method)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(engine.engine, method, counted)
    return calls


def test_concurrent_streams_equal_the_synchronous_engine(tiny, async_engine):
    expected = offline(tiny, PROMPTS, greedy(12))

    async def one(i):
        seen = [out async for out in async_engine.generate(f"r{i}", PROMPTS[i], greedy(12))]
        # one output per step the request sampled in; the deltas add up to the whole
        assert [t for o in seen for t in o.new_token_ids] == seen[-1].token_ids
        assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
        return seen[-1].token_ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    assert run(main()) == expected
    assert_pool_whole(async_engine.engine)


def test_abort_from_a_coroutine_takes_effect_at_the_next_step_boundary(async_engine):
    steps = count_calls(async_engine)
    state, aborted = {}, threading.Event()
    counted = async_engine.engine.step

    def held():
        # From the 5th step on, the step waits (inside it, as a slow forward pass would) until the coroutine has
        # aborted: the 300 tokens cannot all be done (by ~0.3 s of tiny steps) before a slow event loop reads its
        # third token, whatever the machine's load. (A bounded wait: a broken abort fails the asserts, not hangs.)
        if steps[0] >= 4:
            aborted.wait(60)
        return counted()

    async_engine.engine.step = held

    async def main():
        outputs = await async_engine.add_request("long", [1, 2, 3], greedy(300, ignore_eos=True))
        async for out in outputs:
            if len(out.token_ids) == 3:
                state["steps_at_abort"] = steps[0]
                async_engine.abort("long")  # from this coroutine, while the thread keeps stepping
                aborted.set()
            state["last"] = out
        return state["last"]

    last = run(main())
    assert last.finished and last.finish_reason == "abort"
    # The stream may lag the thread (outputs wait in the queue), so count from the engine's steps, not from the 3
    # tokens this coroutine had read: a lone request samples one token a step, and at most the step that was
    # already running when abort() came still finishes.
    assert steps[0] - state["steps_at_abort"] <= 1
    assert len(last.token_ids) <= state["steps_at_abort"] + 1
    assert_pool_whole(async_engine.engine)


def test_leaving_a_stream_early_aborts_the_request(async_engine):
    async def main():
        async for out in async_engine.generate("quitter", [1, 2, 3], greedy(300, ignore_eos=True)):
            if len(out.token_ids) == 2:
                break  # the generator's finally aborts, as a cancelled HTTP handler does

    run(main())
    deadline, core = time.monotonic() + 60, async_engine.engine
    # the abort lands at the engine's next step boundary: wait for what the asserts check, not a fixed time
    while (async_engine.num_unfinished_requests() or core.scheduler.running or core.scheduler.waiting or
           core.block_manager.get_num_free_blocks() != core.block_manager.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert async_engine.num_unfinished_requests() == 0
    assert_pool_whole(async_engine.engine)


def test_a_refused_request_raises_in_add_request_and_leaves_nothing(async_engine):
    async def main():
        with pytest.raises(ValueError, match="can never fit"):
            await async_engine.add_request("huge", [1] * 300, greedy(150))  # 450 tokens > 100 blocks of 4
        with pytest.raises(ValueError, match="context"):
            await async_engine.add_request("long", [1] * 500, greedy(20))

    run(main())
    assert async_engine.num_unfinished_requests() == 0
    assert_pool_whole(async_engine.engine)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(async_engine):
    executor = async_engine.engine.executor
    real = executor.execute_model

    def flaky(scheduler_output):
        if any(s.seq_id == "doomed" for s in scheduler_output.scheduled_seqs):
            raise RuntimeError("simulated kernel failure")
        return real(scheduler_output)

    executor.execute_model = flaky

    async def main():
        with pytest.raises(EngineStepError, match="doomed.*simulated kernel failure"):
            async for _ in async_engine.generate("doomed", [1, 2, 3], greedy(5)):
                pass
        # the same engine keeps serving
        return [out async for out in async_engine.generate("fine", [4, 5, 6], greedy(5))][-1]

    assert run(main()).finish_reason == "length"
    assert async_engine.is_running
    assert_pool_whole(async_engine.engine)


def test_n_completions_stream_with_their_index_and_a_failing_completion_fails_the_request(async_engine):
    """n=3: one stream carries every completion (by index) and ends after the last; when a step fails with
    only a forked completion in it ("par#2": completion 0 already stopped), the request's stream raises and
    every block comes back."""
    executor = async_engine.engine.executor
    real = executor.execute_model
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, n=3)
    sync = LLMEngine(async_engine.engine.executor.workers[0].model, EngineConfig(cache_config=CacheConfig(num_blocks=100, block_size=4)))
    sync.add_request("probe", [1, 2, 3, 4, 5], params)
    done = {}
    while sync.has_unfinished_requests():
        done.update({o.index: o.token_ids for o in sync.step() if o.finish_reason})
    # a stop id that ends completion 0 at its first token and no other completion early
    stop = done[0][0]
    assert all(stop not in done[i] for i in (1, 2)), done
    stopping = SamplingParams(**{**params.__dict__, "stop_token_ids": [stop]})

    def flaky(scheduler_output):
        if any(s.seq_id == "par#2" for s in scheduler_output.scheduled_seqs):
            raise RuntimeError("simulated kernel failure")
        return real(scheduler_output)

    async def main():
        outs = [out async for out in async_engine.generate("ok", [1, 2, 3, 4, 5], params)]
        executor.execute_model = flaky
        with pytest.raises(EngineStepError, match="par.*simulated kernel failure"):
            async for _ in async_engine.generate("par", [1, 2, 3, 4, 5], stopping):
                pass
        return outs

    outs = run(main())  # a stream nobody ends would hang: fail instead
    assert sorted(o.index for o in outs if o.finish_reason) == [0, 1, 2] and outs[-1].finished
    assert sum(o.finished for o in outs) == 1 and all(len(o.token_ids) == 4 for o in outs if o.finish_reason)
    assert_pool_whole(async_engine.engine)


def test_the_idle_thread_sleeps_and_shutdown_aborts_what_is_left(tiny):
    engine = AsyncLLMEngine(LLMEngine(tiny, EngineConfig(cache_config=CacheConfig(num_blocks=100, block_size=4))))
    steps = count_calls(engine)
    # the loop asks whether there is work once per turn: a thread that sleeps asks once and waits, one that spins
    # (an Event that never blocks, or one set again on every turn) asks thousands of times while nothing arrives
    turns = count_calls(engine, "has_unfinished_requests")
    counted = engine.engine.step

    def held():
        # From the 3rd step on, a step waits (as a slow forward pass would) until shutdown() has asked the loop to
        # stop: the 300 tokens cannot all be done before the shutdown thread runs, however loaded the machine.
        # (A bounded wait: a shutdown that never comes fails the asserts, not hangs.)
        deadline = time.monotonic() + 60
        while steps[0] >= 2 and not engine._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
        return counted()

    engine.start()
    time.sleep(0.2)  # the window the loop may spin in, not a limit on anything
    assert steps[0] == 0  # no request, no step
    assert turns[0] <= 2, f"{turns[0]} turns of the loop with nothing to do: it spins instead of sleeping"
    engine.engine.step = held
    got = []

    async def main():
        outputs = await engine.add_request("cut", [1, 2, 3], greedy(300, ignore_eos=True))
        async for out in outputs:
            if len(out.token_ids) == 2:
                threading.Thread(target=engine.shutdown).start()
            got.append(out)

    run(main())
    assert got[-1].finish_reason == "abort"
    deadline = time.monotonic() + 60
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.is_running and not any(t.name == "nanoserve-engine" for t in threading.enumerate())
    assert_pool_whole(engine.engine)

    async def after():
        with pytest.raises(EngineUnavailable, match="not running"):  # the server's 503, not a 500
            await engine.add_request("late", [1, 2], greedy(2))

    run(after())


def test_adds_wait_for_the_step_boundary_and_each_stream_gets_only_its_own(tiny, async_engine):
    """Requests added while a step runs join at the next boundary (the engine thread alone adds them); each
    stream carries exactly its request's outputs, in order, as the synchronous engine makes them."""
    expected = offline(tiny, PROMPTS[:3], greedy(6))
    real_step, seen_steps = async_engine.engine.step, []

    def step():
        seen_steps.append(threading.current_thread().name)
        time.sleep(0.01)  # a slow step: the adds below land while it runs
        return real_step()

    async_engine.engine.step = step

    async def one(i, delay):
        await asyncio.sleep(delay)
        outs = [out async for out in async_engine.generate(f"s{i}", PROMPTS[i], greedy(6))]
        assert {o.request_id for o in outs} == {f"s{i}"}
        return outs[-1].token_ids

    async def main():
        return await asyncio.gather(one(0, 0), one(1, 0.005), one(2, 0.02))

    assert run(main()) == expected
    assert set(seen_steps) == {"nanoserve-engine"}  # only the engine thread ever stepped the engine
    assert_pool_whole(async_engine.engine)


def test_a_duplicate_id_is_refused_and_a_cancelled_add_leaves_nothing(async_engine):
    real_step = async_engine.engine.step

    def slow():  # 300 tokens would take 3 s or more: only an abort ends these requests within the second below
        time.sleep(0.01)
        return real_step()

    async_engine.engine.step = slow

    async def main():
        first = await async_engine.add_request("same", [1, 2, 3], greedy(300, ignore_eos=True))
        with pytest.raises(ValueError, match="same"):
            await async_engine.add_request("same", [4, 5], greedy(2))
        async for _ in first:  # read one output, then leave: the stream's end aborts the request
            break
        await first.aclose()
        # a caller cancelled while its add waits for the step boundary (a client gone that early)
        task = asyncio.ensure_future(async_engine.add_request("gone", [1, 2, 3], greedy(300, ignore_eos=True)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    deadline = time.monotonic() + 60  # the aborts land at the next step boundaries: wait for them, generously
    while (async_engine.num_unfinished_requests() or async_engine.engine.has_unfinished_requests()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_engine.num_unfinished_requests() == 0
    assert_pool_whole(async_engine.engine)


def test_the_request_keywords_reach_the_engine(tokenizer):
    """What the server knows of a request besides its ids, params and priority reaches LLMEngine.add_request as
    keyword arguments: a bridge that dropped cache_salt would let one tenant's request hit another's cached prefix
    (chapter 08, section 11), one that dropped the tenant would hide who sent it from the fair policy (chapter 15),
    one that dropped slo, lora_name or kv_transfer_params would serve without what the client asked for. What
    reached the engine is read from the engine's own signature, whether passed by position or by name; what it did
    with it, from the prefix cache's hits and the engine's refusals."""
    model = tiny_llama(vocab_size=49152, max_position_embeddings=256)  # the real tokenizer's ids, for a grammar
    engine = AsyncLLMEngine(LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=100, block_size=4)),
                                      tokenizer))
    signature, original, received = inspect.signature(engine.engine.add_request), engine.engine.add_request, {}

    def recorded(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        received[arguments.arguments["request_id"]] = arguments.arguments
        return original(*args, **kwargs)

    engine.engine.add_request = recorded
    prompt, stats = list(range(1000, 1016)), engine.engine.block_manager.stats  # 16 tokens: 4 full blocks of 4

    async def served(request_id, params=None, **kw) -> int:
        """The prefix-cache hits the request got: blocks of the prompt found cached, not computed."""
        hits = stats.hit_blocks
        async for _ in await engine.add_request(request_id, prompt, params or greedy(2), **kw):
            pass
        return stats.hit_blocks - hits

    async def main():
        assert await served("a", priority=2, tenant="a", cache_salt="a", speculative=False) == 0
        assert await served("b", tenant="b", cache_salt="b") == 0  # another salt: nothing of a's prefix
        assert await served("a again", tenant="a", cache_salt="a") > 0  # the same salt: a's own prefix
        json_mode = greedy(8, structured=StructuredOutputsParams(json_object=True))
        await served("grammar", json_mode)
        # what this engine cannot honour it refuses, and the refusal reaches the caller: an SLO on a policy that
        # does not read one, an adapter not loaded, KV transfer without a connector
        for kw, error in [({"slo": SLOTargets(ttft_ms=100)}, ValueError), ({"lora_name": "absent"}, LoRANotLoaded),
                          ({"kv_transfer_params": {"do_remote_decode": True}}, ValueError)]:
            with pytest.raises(error):
                await engine.add_request(f"refused {next(iter(kw))}", prompt, greedy(2), **kw)

    engine.start()
    try:
        run(main())
    finally:
        engine.shutdown()
    given = {"a": dict(priority=2, tenant="a", cache_salt="a", speculative=False, grammar=None),
             "b": dict(priority=0, tenant="b", cache_salt="b", speculative=True),
             "refused slo": dict(slo=SLOTargets(ttft_ms=100)), "refused lora_name": dict(lora_name="absent"),
             "refused kv_transfer_params": dict(kv_transfer_params={"do_remote_decode": True})}
    for request_id, kw in given.items():
        assert {k: received[request_id][k] for k in kw} == kw, request_id
    assert received["grammar"]["grammar"] is not None  # compiled off the engine thread and handed over
    assert_pool_whole(engine.engine)
