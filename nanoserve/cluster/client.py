"""Chapter 16 — the ingress's engine: what chapter 08's server talks to when the engines are Ray Serve replicas.

The HTTP app (nanoserve/server/api_server.py) is not forked: `ServerState(ReplicaClient(handle), ...)`
gives it an object with AsyncLLMEngine's interface, so validation, streaming and error shapes are chapter 08's:

    AsyncLLMEngine (one process)              ReplicaClient (a fleet)
    add_request(id, ids, params) -> stream    the same, over `handle.options(stream=True).generate`
    ValueError: prompt too long (-> 400)      the replica answers ("refused", why): the same ValueError
    EngineUnavailable: stopped (-> 503)       no replica took it in time, or Ray failed before it started
    EngineStepError mid-stream (-> error      the replica died mid-stream (RayActorError): EngineStepError
      line in the stream, or 500)               naming it, in one line; Ray Serve starts a replacement
    max_model_len, max_seq_len                one replica's (every replica builds the same engine)
    num_unfinished_requests()                 requests in flight at this ingress

A replica's error reaches the client as one line (`one_line`): Ray's own text of it is the replica's whole
traceback, with file paths, actor ids and pids.

The ingress also computes each prompt's block hashes (chapter 05's chain over its full blocks) once,
and sends them with the request: the prefix-aware router reads them, it never tokenizes.
"""

import asyncio
from collections import deque

from ray.exceptions import RayActorError, RayError

from nanoserve.engine.async_engine import EngineStepError, EngineUnavailable
from nanoserve.kv.prefix_cache import block_hashes

MAX_ROUTED_BLOCKS = 64  # the router only needs the start of the chain: system prompts are the shared part
ROUTED_KEPT = 4096  # the last decisions kept for inspection (bench routing, the notebook): a server runs for months


def routing_hashes(prompt_token_ids: list[int], block_size: int, limit: int = MAX_ROUTED_BLOCKS) -> list[int]:
    """The chain hashes of the prompt's leading full blocks, as the engine's prefix cache names them
    (the last token is always computed, so a block that ends on it is never a hit: leave it out)."""
    usable = min(max(len(prompt_token_ids) - 1, 0) // block_size, limit) * block_size
    return block_hashes(prompt_token_ids[:usable], block_size)


class ReplicaClient:
    def __init__(self, handle, info: dict, first_output_timeout_s: float = 120.0):
        """handle: the LLMReplica deployment's handle; info: one replica's `info()` (limits, block size)."""
        self.handle = handle.options(stream=True)
        self.block_size = info["block_size"]
        self.max_model_len, self.max_seq_len = info["max_model_len"], info["max_seq_len"]  # what the server checks
        self.first_output_timeout_s = first_output_timeout_s
        self.in_flight = 0
        # the router's last ROUTED_KEPT decisions, in order: (request id, replica id), and each one's first routing
        # hash (the prefix it keys on). Bounded: a long-running ingress must not grow with every request it routes.
        self.routed: deque[tuple[str, str]] = deque(maxlen=ROUTED_KEPT)
        self.first_block: dict[str, int | None] = {}
        self._streams: dict = {}  # request id -> its replica's stream, while in flight (abort cancels it)
        self.is_running = False
        # chapter 19: a fleet serves the base model only (serve refuses --lora-modules with replicas)
        self.lora_names: tuple[str, ...] = ()
        self.lora_enabled = False

    def start(self) -> None:
        self.is_running = True

    def shutdown(self, timeout: float | None = None) -> None:
        self.is_running = False

    def num_unfinished_requests(self) -> int:
        return self.in_flight

    async def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params, priority: int = 0,
                          **engine_kwargs):
        """Route the request to a replica; returns its output stream once that replica's engine took it.
        ValueError if the engine refused it (as AsyncLLMEngine.add_request), EngineUnavailable if no replica
        answered within first_output_timeout_s or Ray failed before the request started. engine_kwargs (tenant, slo, speculative) travel to the
        replica's AsyncLLMEngine.add_request as they are."""
        hashes = routing_hashes(prompt_token_ids, self.block_size)
        gen = self.handle.generate.remote(request_id, list(prompt_token_ids), sampling_params, block_hashes=hashes,
                                          priority=priority, **engine_kwargs)
        self.in_flight += 1
        try:
            kind, detail = await asyncio.wait_for(gen.__anext__(), self.first_output_timeout_s)
        except BaseException as e:
            self.in_flight -= 1
            gen.cancel()
            if isinstance(e, TimeoutError):
                raise EngineUnavailable(f"no replica took the request within {self.first_output_timeout_s:g} s") \
                    from None
            if isinstance(e, RayError):
                raise EngineUnavailable(f"the replica failed before the request started: {one_line(e)}") from None
            raise
        if kind != "added":
            self.in_flight -= 1
            if kind == "refused":
                raise ValueError(detail)
            gen.cancel()  # not replica.py's protocol (another version of it?): nothing was routed
            raise EngineUnavailable(f"the replica answered {kind!r}, not 'added' or 'refused'")
        if len(self.routed) == ROUTED_KEPT:  # the oldest decision leaves both records
            self.first_block.pop(self.routed[0][0], None)
        self.routed.append((request_id, detail))
        self.first_block[request_id] = hashes[0] if hashes else None
        self._streams[request_id] = gen
        return self._outputs(request_id, gen, detail)

    def abort(self, request_id: str) -> None:
        """As AsyncLLMEngine.abort (the server's timeouts and disconnects call it): cancel the replica's stream,
        which aborts the request in that replica's engine. An id not in flight (finished) is ignored."""
        gen = self._streams.pop(request_id, None)
        if gen is not None:
            gen.cancel()

    async def _outputs(self, request_id: str, gen, replica_id: str):
        finished = False
        try:
            async for out in gen:
                finished = out.finished
                yield out
        except RayActorError as e:  # the replica's process died: never a hang, a clear error
            finished = True
            raise EngineStepError(f"replica {replica_id} died while serving this request "
                                  f"({type(e).__name__}); Ray Serve is replacing it, retry") from None
        except RayError as e:
            finished = True
            raise EngineStepError(f"replica {replica_id} failed: {one_line(e)}") from None
        finally:
            self.in_flight -= 1
            self._streams.pop(request_id, None)
            if not finished:
                gen.cancel()  # the client went away: the replica's stream is cancelled, which aborts the request


def one_line(error: Exception) -> str:
    """What a client may read of a replica's error: the original exception's type and the first line of its
    message. A RayTaskError's own text is the replica's whole traceback (file paths, actor ids, pids).

        >>> one_line(ValueError("bad things\\n  File \\"/home/x.py\\", line 3"))
        'ValueError: bad things'
    """
    cause = getattr(error, "cause", None) or error
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}"
