"""Chapter 09 — a system under test (SUT) for MLPerf's LoadGen: nanoserve in-process, or any OpenAI server.

LoadGen owns the clock. It calls `issue_queries([QuerySample(id, index), ...])` from its own thread when
its scenario says a query is due, and the SUT answers each sample twice, as the Llama benchmarks'
reference SUTs do:

    LoadGen                           SUT (an asyncio loop in a thread of its own)
    issue_queries([(id 7, index 3)])  ──▶ generate(sample 3) ... first token out
                                      ◀── FirstTokenComplete([(7, ids[:1])])          stamps TTFT
                                      ... last token out
                                      ◀── QuerySamplesComplete([(7, ids, n_tokens)])  stamps the end; TPOT =
                                                                                     (end - first) / (n - 1)

The response data are the output token ids as int32 bytes: in accuracy mode LoadGen writes them to
mlperf_log_accuracy.json in hex, and the score is computed from that log alone. Every sample is completed,
whatever happens: a request that fails or is aborted still gets its FirstTokenComplete (if no token came)
and its QuerySamplesComplete, with the tokens it got, and is counted in `failures`. A dropped sample would
leave LoadGen waiting for ever; a silently shortened one would flatter the latency figures.

Two ways to generate: `engine_generator` (nanoserve's AsyncLLMEngine in this process: the ids are the
engine's own) and `openai_generator` (streamed /v1/completions to any OpenAI-compatible server, the prompt
sent as token ids so every server sees the same tokens; n_tokens is the server's `usage`, and the ids are
its text re-encoded by the model's tokenizer, since OpenAI's stream carries text).

Every query is computed from its first token. LoadGen issues each of the 64 samples many times (460 queries
in a Server try), and a prefix cache would answer a repeat's prompt from the blocks its last issue left: a
TTFT of one decode step, which MLPerf's thousands of distinct samples never give. So each query carries a
`cache_salt` of its own (vLLM's field, nanoserve's too): it shares no block with any other query. A server
that does not know the field must be started without its prompt cache (llama-server: --no-cache-prompt
--cache-ram 0).
"""

import array
import asyncio
import itertools
import threading
from dataclasses import dataclass

import mlperf_loadgen as lg
import numpy as np


@dataclass
class Completion:
    token_ids: list[int]  # what LoadGen's accuracy log will hold
    n_tokens: int  # what LoadGen divides by for TPOT
    error: str | None = None  # a failed or aborted request: completed to LoadGen all the same


def _respond(complete, query_id: int, token_ids: list[int], n_tokens: int) -> None:
    data = array.array("B", np.asarray(token_ids, dtype=np.int32).tobytes())  # alive until LoadGen copied it
    address, length = data.buffer_info()
    complete([lg.QuerySampleResponse(query_id, address, length, n_tokens)])


class SUT:
    """LoadGen's callbacks over `generate(sample, on_first) -> Completion` (an async function), with
    `samples` the query sample library's items by index (generate may be set after, once the system is up).
    Use `with SUT(...) as sut:` and pass `sut.handle` to LoadGen."""

    def __init__(self, samples, generate):
        self.samples, self.generate = samples, generate
        self.outputs: dict[int, list[list[int]]] = {}  # sample index -> the ids reported, once per issue
        self.failures: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mlperf-sut", daemon=True)
        self._thread.start()
        self._in_flight: set = set()
        self.handle = lg.ConstructSUT(self.issue_queries, self.flush_queries)

    def issue_queries(self, query_samples) -> None:  # LoadGen's thread: hand each sample to the loop
        for qs in query_samples:
            future = asyncio.run_coroutine_threadsafe(self._answer(qs.id, qs.index), self.loop)
            self._in_flight.add(future)
            future.add_done_callback(self._in_flight.discard)

    def flush_queries(self) -> None:  # nothing is held back waiting for a batch to fill
        pass

    async def _answer(self, query_id: int, index: int) -> None:
        first_sent = False

        def on_first(token_ids: list[int]) -> None:
            nonlocal first_sent
            if not first_sent:
                first_sent = True
                _respond(lg.FirstTokenComplete, query_id, token_ids[:1], 1)

        try:
            done = await self.generate(self.samples[index], on_first)
        except Exception as e:  # noqa: BLE001 -- whatever went wrong, LoadGen still gets the sample back
            done = Completion([], 0, f"{type(e).__name__}: {e}")
        if done.error is not None:
            self.failures.append(f"sample {index}: {done.error}")
        on_first(done.token_ids)  # no token came (a failure): the first-token stamp is the end's
        self.outputs.setdefault(index, []).append(done.token_ids)
        _respond(lg.QuerySamplesComplete, query_id, done.token_ids, done.n_tokens)

    def __enter__(self) -> "SUT":
        return self

    def __exit__(self, *exc) -> None:
        lg.DestroySUT(self.handle)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def engine_generator(engine):
    """generate() over a started AsyncLLMEngine: greedy, each sample's max_tokens, stopping at EOS."""
    from nanoserve.sampling import SamplingParams

    ids = itertools.count()

    async def generate(sample: dict, on_first) -> Completion:
        params = SamplingParams(temperature=0, max_tokens=sample["max_tokens"])
        request_id, out = f"mlperf-{next(ids)}", None
        stream = await engine.add_request(request_id, sample["prompt_token_ids"], params, cache_salt=request_id)
        async for out in stream:
            if out.token_ids:
                on_first(out.token_ids)
        if out.finish_reason == "abort":
            return Completion(out.token_ids, len(out.token_ids), out.reject_reason or "aborted by the engine")
        return Completion(out.token_ids, len(out.token_ids))

    return generate


def openai_generator(client, url: str, model: str, tokenizer):
    """generate() over any OpenAI-compatible server (an httpx.AsyncClient), via bench serve's streaming client."""
    from nanoserve.bench.client import send

    ids = itertools.count()

    async def generate(sample: dict, on_first) -> Completion:
        body = {"model": model, "prompt": sample["prompt_token_ids"], "max_tokens": sample["max_tokens"],
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "cache_salt": f"mlperf-{next(ids)}"}
        record, text = await send(client, url, body, lambda t: len(tokenizer.encode(t)),
                                  on_first=lambda delta: on_first(tokenizer.encode(delta)))
        token_ids = tokenizer.encode(text)
        return Completion(token_ids, record.output_tokens or len(token_ids), None if record.success else record.error)

    return generate
