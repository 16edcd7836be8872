"""Chapter 17 — the KV connector, in vLLM v1's shape (KVConnectorBase_V1): a scheduler side and a worker side.

The scheduler side works in integers, inside the engine's schedule step; the worker side moves tensors,
inside the forward pass. What joins them is one KVConnectorMetadata per step, carried by the
SchedulerOutput (the scheduler never touches a tensor; the worker never sees a block manager):

    scheduler side (SharedMemoryConnectorScheduler)       worker side (SharedMemoryConnectorWorker)
    get_num_new_matched_tokens(seq, computed)  consumer    bind_connector_metadata(meta)
        how many prompt tokens to load, not compute         start_load_kv()          open the segments
    update_state_after_alloc(seq, table, ...)  consumer    wait_for_layer_load(i)   before layer i: copy its
        where they land: this engine's slots                                         K/V into our slots
    build_connector_meta(scheduler_output)     both        save_kv_layer(i)         after layer i: copy the
        this step's loads and saves                                                  prompt's K/V out
    request_finished(seq)                      both        wait_for_save()          the step's saves done
        producer: the kv_transfer_params to hand back

A request's path (the proxy, proxy.py, drives it over HTTP):

    prefill engine (kv_producer)                          decode engine (kv_consumer)
    kv_transfer_params {"do_remote_decode": true},
    max_tokens 1: the prompt's forward pass saves each
    layer into a shared-memory segment as it goes;
    finishes, its blocks freed; returns
    {"remote_segment", "remote_num_tokens", ...}  ───▶    admitted with those params: its blocks allocated,
                                                          all but the last prompt token loaded layer by layer,
                   ◀─── ZMQ "release <segment>"           the last computed here; samples, streams
"""

import re
import uuid
from dataclasses import dataclass, field

import torch

from nanoserve.engine.config import KVTransferConfig
from nanoserve.disagg.transport import ReleaseSender, StagingArea, nbytes, open_staged, staged_view
from nanoserve.kv.block_manager import slot_mapping

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARAM_KEYS = ("remote_segment", "remote_num_tokens", "remote_control", "remote_shape", "remote_dtype")
# What a client may name: only segments a StagingArea makes, only a producer on this machine (the loopback) —
# never any /dev/shm file, never any endpoint the decode server would push messages to.
SEGMENT_NAME = re.compile(r"nskv_[0-9a-f]{1,64}")
LOOPBACK_TCP = re.compile(r"tcp://(127\.0\.0\.1|localhost|\[::1\]):[0-9]{1,5}")


class KVLoadError(RuntimeError):
    """A request's segment could not be loaded inside the step (gone, or smaller than its shape): that request
    fails alone, and its blocks leave the prefix cache (their K/V were never written)."""


def staged_size(name: str) -> int | None:
    """The bytes of segment `name`, or None if it is gone."""
    try:
        shm = open_staged(name)
    except FileNotFoundError:
        return None
    size = shm.size
    shm.close()
    return size


@dataclass
class KVLayout:
    """What a staged segment holds per token; both engines must agree (the same model and pool dtype)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a DTYPE_NAMES key

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)


@dataclass
class ReqToSave:
    request_id: str
    segment: str
    slots: list[int]  # the producer's pool slots of prompt positions [0, len(slots))


@dataclass
class ReqToLoad:
    request_id: str
    segment: str
    control: str  # the producer's endpoint, told "release <segment>" once loaded
    num_remote_tokens: int  # the segment holds positions [0, num_remote_tokens)
    start: int  # load positions [start, start + len(slots)) of the segment ...
    slots: list[int]  # ... into these slots of our pool


@dataclass
class KVConnectorMetadata:
    saves: list[ReqToSave] = field(default_factory=list)
    loads: list[ReqToLoad] = field(default_factory=list)


class SharedMemoryConnectorScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int, layout: KVLayout, control_endpoint: str | None,
                 receive=None):
        """control_endpoint: the producer's own (its StagingArea's); receive: the module of
        num_tokens_to_receive / receive_slots (nanoserve/disagg/receive.py, or the learner's, exercise 17.1)."""
        from nanoserve.disagg import receive as reference

        self.config, self.block_size, self.layout = config, block_size, layout
        self.control_endpoint = control_endpoint
        self.receive = receive or reference
        self.sender = ReleaseSender()
        self.to_load: dict[str, ReqToLoad] = {}  # consumer: allocated this step, loaded in its forward pass
        self.loaded: set[str] = set()  # consumer: never load twice (a preempted request recomputes)
        self.saved: dict[str, tuple[str, int]] = {}  # producer: seq_id -> (segment, tokens), until it finishes
        self.num_lost = 0  # consumer: requests whose segment was gone (they recomputed their prompt)

    # ---- at the engine's door ------------------------------------------------------------------
    def check_params(self, params: dict | None) -> None:
        """ValueError for kv_transfer_params this engine cannot honour (the server answers 400)."""
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if self.config.is_producer:
            if params != {"do_remote_decode": True}:
                raise ValueError('kv_transfer_params: a prefill engine takes {"do_remote_decode": true}')
            return
        missing = [k for k in PARAM_KEYS if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {', '.join(missing)} (a prefill engine's answer carries them)")
        segment, control, n = params["remote_segment"], params["remote_control"], params["remote_num_tokens"]
        if not isinstance(segment, str) or not SEGMENT_NAME.fullmatch(segment):
            raise ValueError(f"kv_transfer_params: remote_segment {segment!r} is not a staged segment's name (nskv_…)")
        if not isinstance(control, str) or not LOOPBACK_TCP.fullmatch(control):
            raise ValueError(f"kv_transfer_params: remote_control {control!r} is not a loopback tcp endpoint "
                             "(tcp://127.0.0.1:PORT)")
        shape = params["remote_shape"]
        if not isinstance(n, int) or n < 1 or not isinstance(shape, list) or shape != list(self.layout.shape(n)):
            raise ValueError(f"kv_transfer_params: remote_shape {shape} is not this engine's KV "
                             f"layout for {n} tokens, {list(self.layout.shape(n)) if isinstance(n, int) else '?'}")
        if params["remote_dtype"] != self.layout.dtype:
            raise ValueError(f"kv_transfer_params: remote_dtype {params['remote_dtype']!r} is not this engine's KV "
                             f"pool dtype {self.layout.dtype!r}")
        size, needed = staged_size(segment), nbytes(tuple(shape), DTYPE_NAMES[self.layout.dtype])
        if size is not None and size < needed:  # gone is not an error: the prompt is then computed here
            raise ValueError(f"kv_transfer_params: segment {segment} holds {size} B, remote_shape needs {needed} B")

    # ---- consumer: admission -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> int:
        """How many prompt tokens after the local prefix hit come from the producer (0: compute them all)."""
        params = seq.kv_transfer_params
        if self.config.is_producer or params is None or seq.seq_id in self.loaded:
            return 0
        if staged_size(params["remote_segment"]) is None:  # the producer freed it (its timeout runs from the
            self.loaded.add(seq.seq_id)  # segment's creation) or died: then the prompt is computed here
            self.num_lost += 1
            return 0
        n = self.receive.num_tokens_to_receive(seq.num_prompt_tokens, params["remote_num_tokens"],
                                               num_computed_tokens)
        if n == 0:  # a local prefix hit covers all it holds: it will never be loaded, free it now
            self.sender.release(params["remote_control"], params["remote_segment"])
            self.loaded.add(seq.seq_id)
        return n

    def update_state_after_alloc(self, seq, block_table: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The blocks are allocated: record where the received tokens land (this engine's slots)."""
        if num_external_tokens == 0:
            return
        params = seq.kv_transfer_params
        slots = self.receive.receive_slots(block_table, num_computed_tokens, num_external_tokens, self.block_size)
        self.to_load[seq.seq_id] = ReqToLoad(seq.seq_id, params["remote_segment"], params["remote_control"],
                                             params["remote_num_tokens"], num_computed_tokens, slots)

    # ---- every step ----------------------------------------------------------------------------
    def build_connector_meta(self, out) -> KVConnectorMetadata:
        """This step's loads (consumer: admitted this step) and saves (producer: prompts finishing this step)."""
        meta = KVConnectorMetadata(loads=list(self.to_load.values()))
        self.loaded.update(self.to_load)
        self.to_load.clear()
        if not self.config.is_producer:
            return meta
        for seq in out.scheduled_seqs:
            params = seq.kv_transfer_params
            if params and seq.num_output_tokens == 0 and out.samples(seq) and seq.seq_id not in self.saved:
                n = seq.num_prompt_tokens
                segment = f"nskv_{uuid.uuid4().hex[:20]}"
                self.saved[seq.seq_id] = (segment, n)
                meta.saves.append(ReqToSave(seq.seq_id, segment,
                                            slot_mapping(out.block_tables[seq.seq_id], 0, n, self.block_size)))
        return meta

    def request_finished(self, seq) -> dict | None:
        """The request left the engine. Producer: the params that let a consumer load its prompt (None if it
        ended before its prompt was saved); an aborted request's segment is freed at once. Consumer: a
        segment never loaded (aborted while waiting) is released."""
        self.loaded.discard(seq.seq_id)
        params = seq.kv_transfer_params
        if params is None:
            return None
        if not self.config.is_producer:
            self.to_load.pop(seq.seq_id, None)
            if seq.status.finish_reason == "abort" and seq.num_computed_tokens == 0:
                self.sender.release(params["remote_control"], params["remote_segment"])
            return None
        if seq.seq_id not in self.saved:
            return None
        segment, n = self.saved.pop(seq.seq_id)
        if seq.status.finish_reason == "abort":
            self.sender.release(self.control_endpoint, segment)
            return None
        return {"remote_segment": segment, "remote_num_tokens": n, "remote_control": self.control_endpoint,
                "remote_shape": list(self.layout.shape(n)), "remote_dtype": self.layout.dtype}

    def close(self) -> None:
        self.sender.close()


class SharedMemoryConnectorWorker:
    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.staging = (StagingArea(config.kv_control_endpoint, config.kv_release_timeout_s)
                        if config.is_producer else None)
        self.sender = ReleaseSender()
        self.kv_cache = None
        self.meta = KVConnectorMetadata()
        self.saving: list[tuple[ReqToSave, torch.Tensor]] = []  # this step's (request, segment view)
        self.loading: list[tuple[ReqToLoad, object, torch.Tensor]] = []  # (request, segment, view)
        self.failed: dict[str, KVLoadError] = {}  # this step's requests whose segment could not be opened
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []  # one pre- and one post-hook per decoder layer

    @property
    def control_endpoint(self) -> str | None:
        return self.staging.endpoint if self.staging is not None else None

    def register_kv_caches(self, kv_cache, layers) -> None:
        """The pool to read and write, and a hook around each decoder layer: load before it, save after it."""
        assert not self.hooks, "register_kv_caches once per connector"
        self.kv_cache = kv_cache
        for i, layer in enumerate(layers):  # the handles, so close() takes the hooks off a model that outlives us
            self.hooks.append(layer.register_forward_pre_hook(lambda module, args, i=i: self.wait_for_layer_load(i)))
            self.hooks.append(layer.register_forward_hook(lambda module, args, output, i=i: self.save_kv_layer(i)))

    def bind_connector_metadata(self, meta: KVConnectorMetadata | None) -> None:
        self.meta = meta or KVConnectorMetadata()
        self.failed = {}
        c, dtype = self.kv_cache, self.kv_cache.k_cache[0].dtype
        for req in self.meta.saves:  # the segments the layers fill as the forward pass goes
            shape = (len(c.k_cache), 2, c.num_kv_heads, len(req.slots), c.head_dim)
            self.saving.append((req, self.staging.create(req.segment, shape, dtype)))

    def start_load_kv(self) -> None:
        """Open this step's segments. (On a GPU the copies would be queued on a side stream here.) A segment
        gone since admission (the producer's timeout) or too small fails its request alone (`failed`)."""
        c = self.kv_cache
        for req in self.meta.loads:
            shape = (len(c.k_cache), 2, c.num_kv_heads, req.num_remote_tokens, c.head_dim)
            try:
                shm = open_staged(req.segment)
            except FileNotFoundError:
                self.failed[req.request_id] = KVLoadError(f"KV segment {req.segment} was freed before it loaded")
                self.sender.release(req.control, req.segment)
                continue
            if shm.size < nbytes(shape, c.k_cache[0].dtype):
                shm.close()
                self.failed[req.request_id] = KVLoadError(f"KV segment {req.segment} is smaller than {shape}")
                self.sender.release(req.control, req.segment)
                continue
            self.loading.append((req, shm, staged_view(shm, shape, c.k_cache[0].dtype)))

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer `layer` runs: its K/V of every loading request are in our slots."""
        if not self.loading:
            return
        for req, _, view in self.loading:
            self.kv_cache_write(layer, req.slots, view[layer, :, :, req.start:req.start + len(req.slots)])
        if layer == len(self.kv_cache.k_cache) - 1:
            self.finish_loads()

    def kv_cache_write(self, layer: int, slots: list[int], kv: torch.Tensor) -> None:
        """kv (2, Hkv, n, D) -> layer `layer`'s K and V pools at `slots` (n,)."""
        c = self.kv_cache
        Hkv, D, device = c.num_kv_heads, c.head_dim, c.k_cache[layer].device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        c.k_cache[layer].view(Hkv, -1, D).index_copy_(1, index, kv[0].to(device))
        c.v_cache[layer].view(Hkv, -1, D).index_copy_(1, index, kv[1].to(device))

    def finish_loads(self) -> None:
        """Every layer loaded (or the step failed): close our handles and tell each producer to free its
        segment. Popped one by one so that no view of a segment outlives the handle's close."""
        while self.loading:
            req, shm, view = self.loading.pop()
            del view
            shm.close()
            self.sender.release(req.control, req.segment)

    def save_kv_layer(self, layer: int) -> None:
        """After layer `layer` wrote this step's K/V: copy each saving request's prompt K/V of it out."""
        if not self.saving:
            return
        c = self.kv_cache
        Hkv, D = c.num_kv_heads, c.head_dim
        for req, view in self.saving:
            slots = torch.tensor(req.slots, dtype=torch.long, device=c.k_cache[layer].device)
            view[layer, 0] = c.k_cache[layer].view(Hkv, -1, D).index_select(1, slots).cpu()
            view[layer, 1] = c.v_cache[layer].view(Hkv, -1, D).index_select(1, slots).cpu()

    def wait_for_save(self) -> None:
        """The step's saves are complete (the copies above are synchronous on the CPU; a GPU would sync its
        side stream here). Drop our views: the segment is the StagingArea's until a consumer releases it."""
        self.saving = []

    def clear_connector_metadata(self) -> None:
        self.finish_loads()  # nothing when every layer ran; after a failed step, the handles still open
        self.meta = KVConnectorMetadata()

    def close(self) -> None:
        try:
            self.finish_loads()
        finally:  # the hooks come off even if a segment fails to close
            for hook in self.hooks:
                hook.remove()
            self.hooks = []
        self.saving = []
        if self.staging is not None:
            self.staging.close()
        self.sender.close()
