"""Exercise 8.3 — the AsyncLLMEngine bridge: the engine steps in a thread of its own, each request gets an
async stream of its outputs.

Mirror of nanoserve/engine/async_engine.py. Read chapter 08, sections 2 and 5, and README.md's design
questions for 8.3. Your class inherits the reference, so everything you do not write is given — the thread's
loop itself too, which only calls your methods between steps:

    def _run(self):                                    # the engine thread
        while not self._stopping:
            self._wakeup.clear()
            self._run_calls()                          # (chapter 19's awaited engine calls: given)
            self._drain_inbox()                        # yours: the adds and aborts that came in meanwhile
            self._publish()                            # (the snapshot num_requests_waiting reads: given)
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(...)                 # idle: sleep until an add or an abort sets it
                continue
            outputs = self.engine.step()               # (a step that raises fails its requests: given)
            self._publish()                            # (given, as above; the event feed records the step too)
            self._emit(outputs, scheduler_output)      # yours: each output to its request's stream
        ...                                            # shutting down: every request aborted, streams ended

What you have (set up by the reference's __init__):

    self.engine                 the LLMEngine: add_request(id, ids, params, priority, **extra) raises ValueError
                                for a request it refuses; abort_request(id) -> the final output, or None
    self._lock                  a threading.Lock: guards the three below
    self._inbox_adds            list of (request_id, prompt ids, params, priority, extra kwargs for add_request)
    self._inbox_aborts          list of request ids
    self._streams               request_id -> _Stream(loop, queue, added) while the request is in flight
    self._wakeup                a threading.Event the engine thread sleeps on
    self._record(outputs, so)   count outputs in the metrics (call it first in _emit)
    _Stream(loop, asyncio.Queue(), loop.create_future())      one request's stream
    _post(loop, callback, *args)    run callback(*args) on that event loop, from the engine thread
    _resolve(future, error)         resolve `added` (error None: taken), from the event loop; idempotent

Grade it:      make grade CH=08 EX=8.3
See it serve:  python -m nanoserve serve --student 08
"""

import asyncio  # noqa: F401
from collections.abc import AsyncIterator

from nanoserve.engine.async_engine import AsyncLLMEngine as ReferenceAsyncLLMEngine
from nanoserve.engine.async_engine import EngineStepError, EngineUnavailable, _post, _resolve, _Stream  # noqa: F401
from nanoserve.engine.llm_engine import RequestOutput
from nanoserve.sampling import SamplingParams


class AsyncLLMEngine(ReferenceAsyncLLMEngine):
    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                          priority: int = 0, tenant: str | None = None, slo=None,
                          speculative: bool = True, cache_salt: str | None = None, lora_name: str | None = None,
                          kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Exercise 8.3 (the event loop's side): hand a request to the engine thread and return its output stream
        (`self._outputs(...)`) once the engine has taken it.

        What must hold:
          - only the engine thread touches self.engine: this coroutine reaches it through the inbox alone, and
            wakes the thread; a request the engine refuses raises the engine's exception *here* (so a server can
            still answer 400), and leaves nothing in the stream table;
          - two requests in flight never share an id (ValueError); an engine that is not running raises
            EngineUnavailable (a RuntimeError the server answers with 503 and Retry-After: come back later; a
            plain RuntimeError would be a 500);
          - a caller cancelled while waiting (a client gone before the step boundary) leaves no request behind;
          - chapter 13: a request with `sampling_params.structured` has its grammar compiled first, off the engine
            thread: `grammar = await self.engine.structured.cache.compile_async(sampling_params.structured)`;
          - `tenant`, `slo`, `speculative`, `cache_salt`, `lora_name` (chapter 19), `kv_transfer_params` (chapter 17)
            and that `grammar` (None without one) reach
            LLMEngine.add_request as keyword arguments.
        """
        raise NotImplementedError("Exercise 8.3: hand the request to the engine thread through the inbox")

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Exercise 8.3: the request's stream — each RequestOutput its queue receives, until the one with
        `finished`; an exception in the queue (a failed step, a shutdown) is raised to the reader.
        A reader that leaves early (break, an exception, a cancelled task: a client that hung up) aborts the
        request; one that read to the end, or got the engine's exception, does not need to."""
        raise NotImplementedError("Exercise 8.3: the request's outputs, from its queue; leaving early aborts it")
        yield  # an async generator, as the reference is

    def abort(self, request_id: str) -> None:
        """Exercise 8.3: abort a request, from any thread or coroutine. It takes effect at the next step boundary
        (the engine thread frees its KV blocks then), so a disconnect frees its blocks within one step.
        Unknown and finished ids are ignored."""
        raise NotImplementedError("Exercise 8.3: an abort goes through the inbox too")

    def _drain_inbox(self) -> None:
        """Exercise 8.3 (the engine thread, between two steps): take everything the inbox holds — under the lock,
        for as short as possible — then add each request to the engine (its `added` future resolved, with the
        engine's exception if it refused the request, which then leaves the stream table), then abort each
        aborted id; the final outputs of the aborts go to their streams (`_emit`)."""
        raise NotImplementedError("Exercise 8.3: drain the inbox at the step boundary")

    def _emit(self, outputs: list[RequestOutput], scheduler_output=None) -> None:
        """Exercise 8.3 (the engine thread): count `outputs` in the metrics, then put each into its request's
        queue — on that request's event loop, never from this thread directly (asyncio is not thread-safe).
        A finished output is the stream's last: the request leaves the stream table with it. Outputs of requests
        with no stream (aborted meanwhile) are dropped. An output with `error` set (that request failed alone: its
        own draw raised, chapter 08 section 13, or its grammar failed, chapter 13) goes into the queue as
        EngineStepError(out.error), so its reader raises."""
        raise NotImplementedError("Exercise 8.3: each output to its request's queue, on its event loop")
