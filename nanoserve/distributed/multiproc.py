"""Chapter 11 — the worker processes of a tensor-parallel engine: ranks 1 .. n−1 (rank 0 is the engine's own).

    LLM(tensor_parallel_size=3)
      └─ start_workers:  spawn rank 1, rank 2 ──▶ each loads ITS slice of the weights, says "loaded"
                         rank 0 loads its slice, waits for every "loaded" (or an error, or a death)
                         all three join one gloo process group (MASTER_ADDR:MASTER_PORT, default a free
                         loopback port; on several machines, rank 0's address)
      engine step:       rank 0 broadcasts the step's integers (copy-on-write pairs included); every rank
                         copies those blocks, then runs its shard of the forward pass, meeting in
                         2 all_reduces per layer; rank 0 gathers logits and samples
      LLM.close():       rank 0 broadcasts SHUTDOWN; the workers leave the group and exit; rank 0 joins them

Faults never hang: a worker that raises sends its traceback down its pipe and exits at once, which
closes its gloo sockets, so rank 0's next collective fails within moments ("Connection closed by peer")
instead of waiting out a timeout; a worker killed outright closes them too. The Executor then calls
`WorkerProcesses.fail`: it names the rank and the cause, kills what is left, and marks the group dead.
The processes talk only through one-way pipes (multiprocessing's Pipe(duplex=False): an os.pipe) and gloo's
TCP sockets: no shared memory.

Several machines (chapter 16): the standard launcher starts one process per node instead of the spawn,

    torchrun --nnodes 3 --nproc-per-node 1 --node-rank R --master-addr HOST0 --master-port 29500 \
        -m nanoserve batch --tensor-parallel-size 3 --input requests.jsonl --output results.jsonl

and `start_workers` sees torchrun's RANK / WORLD_SIZE: rank 0 goes on to run the command as the
engine; every other rank loads its shard, joins the group (env://, torchrun's MASTER_ADDR:MASTER_PORT)
and runs `worker_loop` — the same code as a spawned worker — until rank 0 says SHUTDOWN, then exits.
"""

import datetime
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from nanoserve.distributed.parallel_state import INIT_KV_CACHE, SHUTDOWN, STEP, TPGroup, WorkerError, unpack_step
from nanoserve.distributed.shard import linear_layers_for, load_shard_from_gguf, load_shard_from_state, shard_llama

STARTUP_TIMEOUT_S = 600  # loading a shard of a big GGUF on a busy machine can take minutes
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a backstop only: a dead peer is noticed at once


@dataclass
class ModelSource:
    """What every rank loads its shard from: a GGUF file (each rank reads its slice), or a full model's
    config and state dict as bytes (a model built in memory, as the tests' tiny random ones)."""

    gguf_path: str | None = None  # None and no state: the embedded SmolLM2
    config: object = None
    state: bytes | None = None
    student: bool | str | list[str] = False  # with chapter 11 selected: the learner's parallel layers (exercise 11)

    @classmethod
    def of(cls, model, student=False) -> "ModelSource":
        if model is None or isinstance(model, (str, os.PathLike)):
            return cls(gguf_path=None if model is None else str(model), student=student)
        from nanoserve.distributed.shard import state_bytes

        return cls(config=model.config, state=state_bytes(model), student=student)

    def load(self, tp: TPGroup, code=None):
        """This rank's shard. code: the StudentCode that records whose code runs (rank 0: the run's own, so its
        report names the learner's chapter-11 code; a worker: one of its own, from `student`)."""
        from nanoserve.student import StudentCode

        code = code if code is not None else StudentCode(self.student)
        tp.codec = code.module("nanoserve.distributed.parallel_state")  # exercise 11.5's, or ours
        layers = linear_layers_for(self.student, code)
        if self.state is None:
            return load_shard_from_gguf(self.gguf_path, tp, layers)
        import io

        state = torch.load(io.BytesIO(self.state), weights_only=True)
        return load_shard_from_state(shard_llama(self.config, tp, layers), state)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def join_group(tp: TPGroup, addr: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=tp.rank, world_size=tp.size,
                            timeout=COLLECTIVE_TIMEOUT)


# ---- ranks 1 .. n-1 ------------------------------------------------------------------------------

def worker_main(rank: int, size: int, addr: str, port: int, source: ModelSource, conn, num_threads: int) -> None:
    """The whole life of one worker process (the target of the spawned Process)."""
    try:
        torch.set_num_threads(num_threads)
        tp = TPGroup(rank, size)
        model = source.load(tp)
        conn.send(("loaded", None))
        join_group(tp, addr, port)
        worker_loop(tp, model)
        dist.destroy_process_group()
        conn.close()
    except BaseException as e:  # noqa: BLE001 — whatever it was, rank 0 must hear of it
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        conn.close()
        os._exit(1)  # at once: closing the gloo sockets tells rank 0, which may be waiting in a collective
    os._exit(0)  # nothing to clean up that the OS does not: skip the interpreter's slow teardown of torch


def worker_loop(tp: TPGroup, model) -> None:
    """Wait for rank 0's commands and do what the Worker in the engine's process does, on this shard."""
    from nanoserve.engine.model_runner import ModelInput
    from nanoserve.engine.worker import Worker
    from nanoserve.kv.paged_attention import AttentionMetadata

    worker = Worker(model)
    while True:
        command, args, payload = tp.receive()
        if command == SHUTDOWN:
            return
        if command == INIT_KV_CACHE:
            worker.init_kv_cache(*args[:2])
        elif command == STEP:
            f = (tp.codec.unpack_step if tp.codec else unpack_step)(args, payload)
            # copy-on-write first, as rank 0 did: this rank's slice of a block a fork still shared
            worker.model_runner.kv_cache.copy_blocks(f["blocks_to_copy"].tolist())
            metadata = AttentionMetadata(f["slot_mapping"], f["block_tables"], f["seq_lens"], f["cu_seqlens_q"])
            batch = ModelInput(f["input_ids"], f["positions"], metadata, f["logits_indices"], sampled_seqs=[])
            worker.model_runner.execute_model_input(batch)  # rank 0 gets the logits through the gather
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown command {command}")


# ---- rank 0 --------------------------------------------------------------------------------------

class WorkerProcesses:
    """Rank 0's handle on ranks 1 .. n−1: their processes and the pipes they report on."""

    def __init__(self, tp: TPGroup, procs: list, conns: list):
        self.tp, self.procs, self.conns = tp, procs, conns
        self.closed = False
        self.saved_num_threads = torch.get_num_threads()

    def wait_loaded(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Until every worker said "loaded"; a WorkerError as soon as one reports an error or dies."""
        pending = set(range(1, self.tp.size))
        deadline = time.monotonic() + timeout
        while pending:
            handles = [h for r in pending for h in (self.conns[r - 1], self.procs[r - 1].sentinel)]
            if not wait(handles, timeout=max(0.0, deadline - time.monotonic())):
                raise WorkerError(f"tensor-parallel ranks {sorted(pending)} not loaded after {timeout} s")
            for rank in sorted(pending):
                conn, p = self.conns[rank - 1], self.procs[rank - 1]
                if conn.poll():  # a message (or EOF) first: a worker that failed reports, then exits
                    kind, text = self._recv(conn, rank)
                    if kind != "loaded":  # an error, or EOF
                        raise WorkerError(f"tensor-parallel rank {rank} failed to start: {text}")
                    pending.discard(rank)
                elif not p.is_alive():
                    raise WorkerError(f"tensor-parallel rank {rank} (pid {p.pid}) {exit_story(p)} before it was loaded")

    def _recv(self, conn, rank: int) -> tuple[str, str | None]:
        """("loaded" | "error" | "eof", text): what the worker said, or that its pipe closed unsaid."""
        try:
            return conn.recv()
        except EOFError:
            return "eof", f"closed its pipe without a word ({exit_story(self.procs[rank - 1])})"

    def diagnose(self, wait_s: float = 5.0) -> str:
        """What happened to the workers: each one's error message, or how it exited."""
        deadline = time.monotonic() + wait_s
        stories = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            # a worker that raised reports first and exits next; give it a moment to do both
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            kind, text = self._recv(conn, rank) if conn.poll() else (None, None)
            if kind == "error":
                stories.append(f"rank {rank} (pid {p.pid}) raised {text.splitlines()[0]}")
            elif not p.is_alive():
                stories.append(f"rank {rank} (pid {p.pid}) {exit_story(p)}")
        return "; ".join(stories) or "no worker reported an error"

    def fail(self, exc: BaseException) -> WorkerError:
        """After a fault in a step: find out which rank failed, end them all, mark the group dead."""
        if self.closed:  # failed (or closed) before: the group stays dead
            return WorkerError(f"the tensor-parallel group is shut down: {self.tp.error}")
        reason = self.diagnose()
        self.tp.error = f"{reason} (rank 0 saw {type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        self._end(graceful=False)
        return WorkerError(f"tensor-parallel step failed: {self.tp.error}")

    def shutdown(self) -> None:
        """Tell the workers to leave, wait for them, leave the group; idempotent."""
        if self.closed:
            return
        graceful = self.tp.error is None
        if graceful:
            try:
                self.tp.broadcast_command(SHUTDOWN)
            except RuntimeError:  # a worker died since the last step: end it the hard way
                graceful = False
        self._end(graceful)

    def _end(self, graceful: bool) -> None:
        for p in self.procs:
            p.join(timeout=10 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.saved_num_threads)
        self.tp.error = self.tp.error or "closed"
        self.closed = True


def exit_story(p) -> str:
    code = p.exitcode
    if code is None:
        return "is still running"
    if code < 0:
        import signal

        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (torch.distributed.run) started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_torchrun(source: ModelSource, tp_size: int, rank: int, world_size: int):
    """The ranks torchrun started, one per node: rank 0 returns (WorkerProcesses with no local process,
    its model); any other rank serves rank 0's steps here and exits the process when told to stop."""
    if world_size != tp_size:
        raise ValueError(f"torchrun started {world_size} ranks but the tensor-parallel size is {tp_size}: "
                         "give --nnodes x --nproc-per-node = --tensor-parallel-size")
    tp = TPGroup(rank, tp_size)
    model = source.load(tp)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    if rank != 0:
        worker_loop(tp, model)
        dist.destroy_process_group()
        os._exit(0)  # this rank's command ends here: rank 0 alone runs it
    tp.workers = WorkerProcesses(tp, [], [])  # the other ranks live on other nodes: nothing to spawn or join
    return tp.workers, model


def start_workers(model, tp_size: int, student=False, code=None):
    """Start ranks 1 .. tp_size−1, load rank 0's shard here, join the group: (WorkerProcesses, rank 0's model).

    model: None (the embedded GGUF), a GGUF path, or a full Llama in memory. code: the run's StudentCode, which
    builds rank 0's shard (and so reports it); default one of its own from `student`. Raises ValueError before any
    process starts if the model cannot be split tp_size ways, WorkerError if a worker fails to start.
    """
    from nanoserve.distributed.shard import check_tp_size

    source = ModelSource.of(model, student)
    if source.config is not None:
        check_tp_size(source.config, tp_size)  # refuse before spawning anything
    else:
        from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf

        check_tp_size(config_from_gguf(open_gguf(source.gguf_path or embedded_gguf_path())), tp_size)
    if dist.is_initialized():
        raise RuntimeError("this process already drives a tensor-parallel group: close that LLM first")
    launched = torchrun_rank()
    if launched is not None:  # chapter 16: torchrun started one rank per node, each runs this
        return join_torchrun(source, tp_size, *launched)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or free_port(addr))
    num_threads = max(1, torch.get_num_threads() // tp_size)  # the ranks share this machine's cores
    ctx = torch.multiprocessing.get_context("spawn")
    tp = TPGroup(0, tp_size)
    procs, conns = [], []
    for rank in range(1, tp_size):
        receive, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main, args=(rank, tp_size, addr, port, source, send, num_threads),
                        name=f"nanoserve-tp-rank{rank}", daemon=True)
        p.start()
        send.close()  # the child holds its end: when it dies, our recv sees EOF
        procs.append(p)
        conns.append(receive)
    workers = tp.workers = WorkerProcesses(tp, procs, conns)
    torch.set_num_threads(num_threads)  # rank 0 too: n ranks share the cores
    try:
        model = source.load(tp, code)
        workers.wait_loaded()
        join_group(tp, addr, port)
    except BaseException:
        workers._end(graceful=False)
        raise
    return workers, model
