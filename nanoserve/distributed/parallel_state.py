"""Chapter 11 — one rank's view of the tensor-parallel group (vLLM: `get_tp_group()`; here a shard carries its own).

Every rank runs the same Python code on its shard; ranks meet only in the collectives below. At
TP = 1 (the default group: one process, no torch.distributed) each of them is a no-op, so the model,
the worker and the model runner are the same code with and without tensor parallelism.

    all_reduce(x)        the sum of x over the ranks, on every rank    RowParallelLinear, VocabParallelEmbedding
    gather(x)            rank 0 gets every rank's x, side by side      ParallelLMHead: logits for rank 0 to sample
    broadcast_command    rank 0 sends a command and integers           Executor, ModelRunner (on rank 0)
    receive              ranks > 0 wait for the next command           multiproc.worker_loop

A step travels as integers only (`pack_step`): token ids, positions, slot mapping, block tables,
sequence lengths, query starts, the rows to sample, and the blocks to copy before the step writes
(copy-on-write after a fork: every rank holds its slice of every block, so every rank copies) — a few
hundred bytes. No Sequence, no SamplingParams, no activation crosses the wire: the other ranks need to know *what* to compute, not *why*; rank 0,
which owns the requests, alone samples. That is why the scheduler deals in integers only.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# the first integer of every message rank 0 broadcasts
STEP, INIT_KV_CACHE, SHUTDOWN = 1, 2, 3
HEADER_LEN = 8  # [command, payload length, *arguments], zero-padded: one fixed-size broadcast announces the rest
# the integer tensors of one step, in the order they are packed (block_tables is 2-d)
STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "logits_indices",
               "blocks_to_copy")


class WorkerError(RuntimeError):
    """A tensor-parallel rank died or raised: the group is shut down, its in-flight requests fail."""


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    workers: object = None  # on rank 0 of a live group: the multiproc.WorkerProcesses that started the others
    # rank 0's time inside all_reduce (waiting for the slowest rank included) and its bytes: `bench tp` reads them
    all_reduce_seconds: float = 0.0
    all_reduce_bytes: int = 0
    num_all_reduces: int = 0
    error: str | None = None  # set when the group was shut down after a fault: every later step raises it
    codec: object = None  # what packs and unpacks a step (pack_step, unpack_step): this module, or exercise 11.5's

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the sum."""
        if self.size == 1:
            return x
        t = time.perf_counter()
        dist.all_reduce(x)
        self.all_reduce_seconds += time.perf_counter() - t
        self.all_reduce_bytes += x.nbytes
        self.num_all_reduces += 1
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets torch.cat of every rank's x along the last dim; the other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast_command(self, command: int, *args: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: a header (command, payload length, args), then the payload (int64), to every rank."""
        if self.size == 1:
            return
        if self.error:
            raise WorkerError(f"the tensor-parallel group is shut down: {self.error}")
        n = 0 if payload is None else payload.numel()
        header = torch.tensor([command, n, *args] + [0] * (HEADER_LEN - 2 - len(args)), dtype=torch.long)
        dist.broadcast(header, src=0)
        if n:
            dist.broadcast(payload, src=0)

    def receive(self) -> tuple[int, list[int], torch.Tensor | None]:
        """Ranks > 0: block until rank 0's next (command, args, payload)."""
        header = torch.empty(HEADER_LEN, dtype=torch.long)
        dist.broadcast(header, src=0)
        command, n, *args = header.tolist()
        payload = None
        if n:
            payload = torch.empty(n, dtype=torch.long)
            dist.broadcast(payload, src=0)
        return command, args, payload

    def broadcast_step(self, batch, blocks_to_copy=()) -> None:
        """Rank 0: send this step's model input (a ModelInput) and its copy-on-write pairs (src, dst) to
        the other ranks; a no-op at TP = 1."""
        if self.size > 1:
            shape, payload = (self.codec.pack_step if self.codec else pack_step)(batch, blocks_to_copy)
            self.broadcast_command(STEP, *shape, payload=payload)


def pack_step(batch, blocks_to_copy=()) -> tuple[tuple[int, ...], torch.Tensor]:
    """A ModelInput's integers and the step's (src, dst) block copies: their sizes (num_tokens, num_seqs,
    max_blocks, num_sampled, num_copies) and one flat int64 tensor. 3 sequences, 5 tokens, tables 2 blocks
    wide, 2 rows sampled, 1 copy: 5·3 + 6 + 3 + 4 + 2 + 2 = 32 integers, 256 bytes."""
    m = batch.attn_metadata
    num_seqs, max_blocks = m.block_tables.shape
    copies = torch.tensor(list(blocks_to_copy), dtype=torch.long).view(-1, 2)  # (num_copies, 2)
    sizes = (batch.input_ids.numel(), num_seqs, max_blocks, batch.logits_indices.numel(), len(copies))
    parts = [batch.input_ids, batch.positions, m.slot_mapping, m.block_tables, m.seq_lens, m.cu_seqlens_q,
             batch.logits_indices, copies]
    return sizes, torch.cat([p.flatten() for p in parts])


def unpack_step(sizes: list[int], payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of pack_step: {name: tensor} for the names in STEP_FIELDS (blocks_to_copy: (num_copies, 2))."""
    num_tokens, num_seqs, max_blocks, num_sampled, num_copies = sizes[:5]
    lengths = [num_tokens] * 3 + [num_seqs * max_blocks, num_seqs, num_seqs + 1, num_sampled, 2 * num_copies]
    fields = dict(zip(STEP_FIELDS, payload.split(lengths)))
    fields["block_tables"] = fields["block_tables"].view(num_seqs, max_blocks)
    fields["blocks_to_copy"] = fields["blocks_to_copy"].view(num_copies, 2)
    return fields


def get_tp_group(model) -> TPGroup:
    """The group a model's shard belongs to (`shard.shard_llama` sets it); TP = 1 for a whole model."""
    return getattr(model, "tp_group", None) or TPGroup()
