"""Chapter 08 — AsyncLLMEngine: the engine loop in its own thread, one async stream per request.

    engine = AsyncLLMEngine(LLMEngine(model, config, tokenizer))
    engine.start()
    async for out in engine.generate("req-1", prompt_token_ids, SamplingParams(max_tokens=16)):
        print(out.new_text, end="")        # a RequestOutput per step the request took part in
    engine.shutdown()

Why a thread: a step is one forward pass (tens to hundreds of milliseconds of torch work, or, for a q4 model's
steps of one-token rows (up to 16), one call into chapter 09's C step, kernels/cpu_decode.c). Run on the server's asyncio event loop,
it would freeze every connection for that long: no new request accepted, no token sent. So the loop that calls
`step()` lives in a thread of its own, and the two worlds meet at two thread-safe points:

    event loop  ──add / abort──▶  inbox (a list under a lock)  ──drained at each step boundary──▶  LLMEngine
    event loop  ◀──RequestOutput── each request's asyncio.Queue ◀──call_soon_threadsafe──  engine thread

(the `added` future that tells add_request the engine took the request comes back the second way too).
Only the engine thread ever steps the LLMEngine or changes its state, so the engine needs no lock: the event
loop only reads single values (the context length, the vocabulary, the sleep level, which the engine thread
checks again) and compiles grammars in chapter 13's cache, which has a lock of its own. An abort is an inbox
entry too: it takes effect at the next step boundary, and its KV blocks are free then.
When nothing is left to do the thread sleeps on an Event (no spinning); an add or an abort wakes it.
A step that raises fails the requests that were in it (their streams raise) and the loop goes on; a
sequence whose own draw raises fails alone (LLMEngine gives its output an `error`), the batch goes on.

Exercise 8.3 (exercises/08-http-serving/async_engine.py) writes the bridge: add_request, _outputs, abort,
_drain_inbox and _emit; `serve --student 08` runs the learner's class.
"""

import asyncio
import threading
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass

# the server reads the LoRA errors and the sleep mode's here (chapter 19)
from nanoserve.engine.llm_engine import (EngineAsleep, LLMEngine, LoRANameTaken, LoRANotLoaded,  # noqa: F401
                                         RequestOutput, SleepConflict, SleepRefused)
from nanoserve.sampling import SamplingParams


class EngineStepError(RuntimeError):
    """A step failed while this request was part of it; the request is aborted."""


class EngineUnavailable(RuntimeError):
    """The engine cannot take a request now (stopped, or none of a fleet's replicas answered): try again later.
    A server answers 503 with Retry-After."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput, or an exception that ends the stream
    added: asyncio.Future  # resolved once the engine took the request (or refused it)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, stat_logger=None, thread_name: str = "nanoserve-engine"):
        """stat_logger: optional, `stat_logger.record(engine, outputs, scheduler_output)` runs in the engine
        thread after every step and every batch of aborts (the server's Prometheus metrics). thread_name: the
        engine thread's (chapter 15's blue-green update names each version's thread, so a test can see it go)."""
        self.engine = engine
        self.thread_name = thread_name
        self.stat_logger = stat_logger
        self._lock = threading.Lock()  # guards the inbox and the stream table
        # (request_id, prompt ids, params, priority, the engine's other add_request kwargs: tenant, speculative, ...)
        self._inbox_adds: list[tuple[str, list[int], SamplingParams, int, dict]] = []
        self._inbox_aborts: list[str] = []
        self._inbox_calls: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, str, tuple]] = []  # chapter 19
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # snapshots the engine thread publishes at every step boundary (read by the server without a lock), in
        # requests: an n > 1 request's completions are as many sequences in the scheduler's queues but one request
        self.num_requests_running = 0  # requests with a completion in the running set
        self._num_scheduled_waiting = 0  # requests in the scheduler with none (see num_requests_waiting)
        self.lora_names: tuple[str, ...] = tuple(getattr(engine, "lora_ids", ()))  # chapter 19: adapters loaded
        self.lora_enabled = getattr(getattr(engine, "config", None), "lora_config", None) is not None
        # chapter 12: snapshots for the live page, nearly off while nobody watches (--student 12: the learner's feed)
        self.event_feed = engine.student.module("nanoserve.engine.event_feed").EventFeed()

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread after its current step; requests still in flight are aborted."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        """The model's context: prompt + output tokens may not exceed it."""
        return self.engine.max_model_len

    @property
    def max_seq_len(self) -> int:
        """The longest sequence this engine can hold (its context, or less if the KV pool is smaller)."""
        return self.engine.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: token ids are in [0, vocab_size)."""
        return self.engine.vocab_size

    def set_stat_logger(self, stat_logger) -> None:
        """Record the steps from now on to `stat_logger` (None: to nobody); chapter 15's blue-green switch hands
        the server's logger to the version that takes over. One assignment: the engine thread reads it per step."""
        self.stat_logger = stat_logger

    # ---- the event loop's side -----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                          priority: int = 0, tenant: str | None = None, slo=None,
                          speculative: bool = True, cache_salt: str | None = None,
                          lora_name: str | None = None, kv_transfer_params: dict | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Hand a request to the engine; returns its output stream once the engine took it (at the next
        step boundary). Raises what LLMEngine.add_request raises (ValueError: prompt too long, ...),
        so a server can answer 400 before it starts streaming."""
        if not self.is_running:
            raise EngineUnavailable("the engine loop is not running (start() it, or it was shut down)")
        self.engine.check_awake()  # chapter 19 (the engine thread checks again: a sleep may come first)
        grammar = None  # chapter 13: compiled in a pool thread, not the engine's, and handed over with the request
        if sampling_params.structured is not None:
            grammar = await self.engine.structured.cache.compile_async(sampling_params.structured)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._inbox_adds.append((request_id, list(prompt_token_ids), sampling_params, priority,
                                     {"tenant": tenant, "slo": slo, "speculative": speculative, "grammar": grammar,
                                      "cache_salt": cache_salt, "lora_name": lora_name,
                                      "kv_transfer_params": kv_transfer_params}))
        self._wakeup.set()
        try:
            await stream.added
        except asyncio.CancelledError:  # the caller went away before the engine saw the request
            self.abort(request_id)
            raise
        return self._outputs(request_id, stream.queue)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       priority: int = 0, tenant: str | None = None, slo=None,
                       speculative: bool = True) -> AsyncIterator[RequestOutput]:
        """add_request and its stream in one: `async for out in engine.generate(...)`. `tenant` and `slo`
        (SLOTargets): chapter 15's scheduling policies read them; speculative: chapter 14's opt-out."""
        async for out in await self.add_request(request_id, prompt_token_ids, sampling_params, priority, tenant, slo,
                                                speculative):
            yield out

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The request's outputs, one per step it got a token in; the last one has finished=True.
        Leaving early (break, an exception, a cancelled task: a client that disconnected) aborts it."""
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # chapter 19: LoRA adapters loaded and unloaded at run time, by the engine thread between two steps
    async def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter (LLMEngine.add_lora; its ValueError raises here)."""
        await self._call("add_lora", name, path)

    async def remove_lora(self, name: str) -> int:
        """Unload an adapter (LLMEngine.remove_lora): refused to new requests at once, freed when the requests
        still using it end; returns how many there are."""
        return await self._call("remove_lora", name)

    # chapter 19: sleep mode, by the engine thread between two steps
    async def sleep(self, level: int = 1) -> dict:
        """Release the weights and the KV pool (LLMEngine.sleep: its SleepConflict and SleepRefused raise here)."""
        return await self._call("sleep", level)

    async def wake_up(self) -> dict:
        return await self._call("wake_up")

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level the engine sleeps at (a snapshot: the engine thread changes it)."""
        return self.engine.sleep_level

    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    async def _call(self, method: str, *args):
        """LLMEngine.method(*args) on the engine thread, before the adds that came in with it; its result."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running (start() it, or it was shut down)")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            self._inbox_calls.append((loop, done, method, args))
        self._wakeup.set()
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread or coroutine; it takes effect at the next step boundary,
        when its KV blocks go back to the pool. Unknown or finished ids are ignored."""
        with self._lock:
            self._inbox_aborts.append(request_id)
        self._wakeup.set()

    async def watch(self, keepalive: float = 1.0) -> AsyncIterator[dict | None]:
        """The engine's snapshots (chapter 12) while this runs: the latest one each time, never a backlog (the
        first with the last steps' records, EventFeed.with_history); None after `keepalive` seconds without
        one (so a server can ping its client). Ends with the engine."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        sub = self.event_feed.subscribe(lambda: _post(loop, ready.set))
        self._wakeup.set()  # an idle engine sends the current state now
        first = True  # the first snapshot carries the recent steps: a page opened mid-run has a timeline at once
        try:
            while self.is_running and not self._stopping:
                ready.clear()
                snap = sub.take()
                if snap is None:
                    try:
                        await asyncio.wait_for(ready.wait(), keepalive)
                        continue
                    except TimeoutError:
                        pass
                elif first:
                    snap, first = self.event_feed.with_history(snap), False
                yield snap
        finally:
            self.event_feed.unsubscribe(sub)

    def num_unfinished_requests(self) -> int:
        """Requests the server handed over that have not finished (queued in the inbox included)."""
        with self._lock:
            return len(self._streams)

    @property
    def num_requests_waiting(self) -> int:
        """Requests handed over that have no completion running yet: still in the inbox, or in the scheduler's
        waiting queue (preempted ones too). An n > 1 request counts once. What --max-waiting-requests bounds."""
        with self._lock:
            return len(self._inbox_adds) + self._num_scheduled_waiting

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wakeup.clear()  # before draining: an add that lands after this sets it again
            busy = self.engine.has_unfinished_requests()
            self._run_calls()
            self._drain_inbox()
            self._publish()  # the adds just left the inbox: num_requests_waiting counts them in the scheduler now
            if not self.engine.has_unfinished_requests():
                if busy:  # the inbox's aborts ended the last requests: no step will tell a viewer, so say it here
                    self.event_feed.changed()
                self._wakeup.wait(self.event_feed.flush(self.engine))  # a viewer gets the idle state too
                continue
            self.engine.last_scheduler_output = None
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 — a bad step must not take the server down
                self._fail_step(e)
                continue
            self.event_feed.record(self.engine, self.engine.last_scheduler_output, outputs, time.perf_counter() - t0)
            self._publish()
            self._emit(outputs, self.engine.last_scheduler_output)
        self._run_calls()
        self._drain_inbox()
        # shutting down: nothing keeps its blocks
        aborted = [self.engine.abort_request(seq_id) for seq_id in list(self.engine.scheduler.seqs)]
        self._emit([out for out in aborted if out is not None])  # None: a completion aborted with its request
        with self._lock:
            leftovers = list(self._streams)
        for request_id in leftovers:  # never entered the engine
            self._end(request_id, RuntimeError("the engine shut down"))

    def _run_calls(self) -> None:
        """The engine methods awaited through _call (chapter 19: adapters, sleep mode), in order."""
        with self._lock:
            calls, self._inbox_calls = self._inbox_calls, []
        for loop, done, method, args in calls:
            result = error = None
            try:
                result = getattr(self.engine, method)(*args)
            except Exception as e:  # noqa: BLE001 — the caller's mistake (a bad adapter): its await raises it
                error = e
            self.lora_names = tuple(self.engine.lora_ids)
            _post(loop, _resolve, done, error, result)

    def _drain_inbox(self) -> None:
        with self._lock:
            adds, self._inbox_adds = self._inbox_adds, []
            aborts, self._inbox_aborts = self._inbox_aborts, []
        for request_id, prompt_token_ids, params, priority, extra in adds:
            stream = self._streams[request_id]
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, priority, **extra)
            except Exception as e:  # noqa: BLE001 — refused: the caller's add_request raises it
                with self._lock:
                    del self._streams[request_id]
                _post(stream.loop, _resolve, stream.added, e)
                continue
            _post(stream.loop, _resolve, stream.added, None)
        aborted = [self.engine.abort_request(request_id) for request_id in aborts]
        self._emit([out for out in aborted if out is not None])

    def _record(self, outputs: list[RequestOutput], scheduler_output=None) -> None:
        """Count a step's outputs (or a batch of aborts') in the metrics, if there is a stat logger."""
        if self.stat_logger is not None and (outputs or scheduler_output is not None):
            try:
                self.stat_logger.record(self.engine, outputs, scheduler_output)
            except Exception as e:  # noqa: BLE001 — a metrics bug must not stop the serving
                warnings.warn(f"stat logger failed: {e!r}")

    def _emit(self, outputs: list[RequestOutput], scheduler_output=None) -> None:
        """Count the outputs in the metrics, then hand each to its request's stream (the last one, finished,
        also takes the stream out of the table)."""
        self._record(outputs, scheduler_output)
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
            if stream is not None:  # failed alone (its draw, or chapter 13's grammar): its stream raises, no one else's
                item = out if getattr(out, "error", None) is None else \
                    EngineStepError(f"request {out.request_id!r} failed in an engine step: {out.error}")
                _post(stream.loop, stream.queue.put_nowait, item)

    def _end(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            _post(stream.loop, _resolve, stream.added, None)
            _post(stream.loop, stream.queue.put_nowait, error)

    def _fail_step(self, error: Exception) -> None:
        """The requests of the failed step are aborted (blocks freed) and their streams raise."""
        planned = self.engine.last_scheduler_output
        # schedule() itself failed: no plan to blame, so every request is suspect
        seqs = planned.scheduled_seqs if planned is not None else list(self.engine.scheduler.seqs.values())
        victims = dict.fromkeys(s.request_id for s in seqs)  # n > 1: a completion's failure fails its request
        for request_id in victims:
            self.engine.abort_request(request_id)
            self._end(request_id, EngineStepError(f"request {request_id!r} failed in an engine step: {error!r}"))
        self.event_feed.changed()  # no step record tells a viewer of these aborts
        self._publish()

    def _publish(self) -> None:
        scheduler = self.engine.scheduler
        running = {seq.request_id for seq in scheduler.running}
        # a request some of whose completions were preempted still has a seat: it is not waiting
        waiting = {seq.request_id for seq in scheduler.waiting} - running
        self.num_requests_running, self._num_scheduled_waiting = len(running), len(waiting)


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run `callback(*args)` on the request's event loop, from the engine thread."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # that loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():  # the waiting coroutine was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
