"""Chapter 11 — a rank's shard of Llama: which heads it holds, the model built from parallel layers,
and its slice of the weights (from a full model in memory, or read straight from the GGUF file).

Heads. Attention is split by whole heads: rank r computes query heads [r·H/n, (r+1)·H/n) and the KV
heads they read, so H % n != 0 is refused first (SmolLM2, 9 / 3 heads, at TP 2: 9 query heads do not split).
With GQA (G = H / Hkv query heads share one KV head) there are then two cases:

    Hkv % n == 0   shard the KV heads: rank r holds Hkv/n of them     SmolLM2 at TP 3: 3 + 1
    n % Hkv == 0   replicate: each KV head lives on n/Hkv ranks        SmolLM2's heads at TP 9: 1 + 1 (3 copies of
                                                                       each; its 1536 MLP features refuse TP 9)
    otherwise      refused (ValueError naming the counts)             6 query / 3 KV heads at TP 2

This is vLLM's rule. Why refuse rather than replicate unevenly: with 6 query / 3 KV heads at TP 2,
rank 0 would hold query heads 0-2, which read KV heads 0 and 1, and rank 1 heads 3-5, reading KV 1 and 2
— KV head 1 on both, the group boundaries no longer align with the ranks, and each rank's attention
would need a head map of its own. Every layer stays simple when the rule holds, and real models are
built for it (Llama-3: 8 KV heads, TP 1/2/4/8).

Memory. Each rank's KV pool holds only its KV heads: KV bytes per token per rank = 2 · L · (Hkv/n) · D · b.
SmolLM2 fp32 at TP 3: 2 · 30 · 1 · 64 · 4 = 15,360 B instead of 46,080 B — the same pool bytes hold 3× the
tokens. With replication (n > Hkv) the saving stops at Hkv: every rank holds one KV head.
"""

import io
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from nanoserve.distributed.linear import MergedColumnParallelLinear
from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import Llama
from nanoserve.model.stacked import STACKED_PARAMS, fused_name


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank
    num_kv_shards: int  # distinct KV slices: tp_size when sharded, Hkv when replicated

    def kv_shard(self, rank: int, tp_size: int) -> int:
        """Which KV slice rank `rank` holds: its own (sharded), or that of its query heads' group (replicated)."""
        return rank * self.num_kv_shards // tp_size


def split_heads(config: LlamaConfig, tp_size: int) -> HeadSplit:
    """The heads of one rank, or a ValueError that names the head counts (see the module docstring)."""
    H, Hkv, n = config.num_attention_heads, config.num_key_value_heads, tp_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if H % n:
        raise ValueError(f"tensor_parallel_size={n} does not divide num_attention_heads={H} "
                         f"(num_key_value_heads={Hkv}): each rank must hold whole query heads")
    if Hkv % n == 0:
        return HeadSplit(H // n, Hkv // n, n)
    if n % Hkv == 0:
        return HeadSplit(H // n, 1, Hkv)
    raise ValueError(f"tensor_parallel_size={n} cannot split num_key_value_heads={Hkv} (num_attention_heads={H}): "
                     f"the KV heads must divide evenly over the ranks ({Hkv} % {n} != 0), or the ranks evenly over "
                     f"the KV heads to replicate them ({n} % {Hkv} != 0)")


def check_tp_size(config: LlamaConfig, tp_size: int) -> None:
    """A ValueError, naming the counts, unless every layer splits tp_size ways: the heads (split_heads' rule) and
    the MLP's features (gate, up and down hold equal slices). SmolLM2 at TP 9: the heads would, 1536 features not."""
    split_heads(config, tp_size)
    if config.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide intermediate_size={config.intermediate_size}: "
                         "each rank must hold an equal slice of the MLP's features")


def linear_layers_for(student=False, code=None):
    """What builds the shards: the parallel layers (linear.py's ColumnParallelLinear, RowParallelLinear, ...;
    vocab.py's VocabParallelEmbedding, ParallelLMHead) and `split_heads`. The reference's, or with chapter 11
    selected in `student` (True, "11", ["11"], ...) the learner's exercises/11-tensor-parallel/ files where
    finished, rung by rung (a stub left falls back to the reference with a warning, like every exercise).
    code: the StudentCode to ask (and to record it in); default one of its own."""
    from types import SimpleNamespace

    from nanoserve.distributed import linear
    from nanoserve.student import StudentCode

    code = code if code is not None else StudentCode(student)
    vocab = code.module("nanoserve.distributed.vocab")
    return SimpleNamespace(**{**vars(linear), **vars(code.module("nanoserve.distributed.linear"))},
                           VocabParallelEmbedding=vocab.VocabParallelEmbedding, ParallelLMHead=vocab.ParallelLMHead,
                           split_heads=code.module("nanoserve.distributed.shard").split_heads)


def shard_llama(config: LlamaConfig, tp, linear_layers=None) -> Llama:
    """An empty Llama whose Linear layers are rank tp.rank's shards (weights uninitialised: load them next).

    Built on the meta device first, so the full model is never allocated; only the shards are.
    `linear_layers`: what `linear_layers_for` returns (default the reference's; exercise 11 passes the learner's).
    """
    linear_layers = linear_layers or linear_layers_for(False)
    Column, Row = linear_layers.ColumnParallelLinear, linear_layers.RowParallelLinear
    # the fused layers stack slices that the (learner's) ColumnParallelLinear computes; they are the reference's
    from nanoserve.distributed.linear import QKVParallelLinear
    split = linear_layers.split_heads(config, tp.size)
    h, D, kv_shard = config.hidden_size, config.head_dim, split.kv_shard(tp.rank, tp.size)
    with torch.device("meta"), SkipInit():
        model = Llama(config)
    model.embed_tokens = linear_layers.VocabParallelEmbedding(config.vocab_size, h, tp)
    model.lm_head = linear_layers.ParallelLMHead(config.vocab_size, h, tp)
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        attn.num_heads, attn.num_kv_heads = split.num_heads, split.num_kv_heads  # LlamaAttention reads these
        # q, k, v in one weight: this rank's query heads, then its KV heads' k and v (replicated as the rule says)
        attn.qkv_proj = QKVParallelLinear(h, D, config.num_attention_heads, config.num_key_value_heads, tp,
                                          split.num_kv_shards, kv_shard, column=Column)
        attn.o_proj = Row(config.num_attention_heads * D, h, tp)
        mlp.gate_up_proj = MergedColumnParallelLinear(h, [config.intermediate_size] * 2, tp, column=Column)
        mlp.down_proj = Row(config.intermediate_size, h, tp)
    model.to_empty(device="cpu")  # the norms (replicated, tiny) leave the meta device too
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one matrix read both ways, as in Llama
    model.tp_group = tp  # the worker and the model runner ask the model which group it belongs to
    return model.eval()


class SkipInit(TorchFunctionMode):
    """Inside `with SkipInit():`, torch.nn.init's functions return their tensor untouched.

    Why: nn.Embedding initialises with normal_(), which on the meta device goes through torch's Python
    decompositions and imports its compiler: 5 s per process here, for weights that are loaded next anyway.
    A torch-function mode (public: torch.overrides) sees every torch call made in this thread inside the
    `with`, and nothing else: no class of torch's is changed, so other threads build their layers as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":  # normal_, uniform_, kaiming_uniform_, ...
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def sharded_parameters(model: Llama):
    """(name, module) of every weight to load: parallel layers take a slice, the rest (norms) the whole.
    A fused layer (qkv_proj, gate_up_proj) appears under its fused name; its parts load one by one."""
    for name, module in model.named_modules():
        if module._parameters.get("weight") is None:
            continue
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue  # the embedding's weight
        yield name + ".weight", module


@torch.no_grad()
def load_shard_from_state(model: Llama, state: dict[str, torch.Tensor]) -> Llama:
    """Fill a shard from a full state dict (a model in memory: the tests' tiny random models)."""
    for name, module in sharded_parameters(model):
        if isinstance(module, MergedColumnParallelLinear):  # the checkpoint's parts, one by one
            prefix = name.removesuffix(".weight").rpartition(".")[0]
            for i, part in enumerate(STACKED_PARAMS[name.split(".")[-2]]):
                module.weight_loader(state[f"{prefix}.{part}.weight"], i)
        elif hasattr(module, "weight_loader"):
            module.weight_loader(state[name])
        else:
            module.weight.copy_(state[name])
    return model


def state_bytes(model: Llama) -> bytes:
    """A full model's weights as bytes, to hand to worker processes (no tensor, so no shared memory)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getvalue()


def read_gguf_slice(tensor, dim: int | None, offset: int = 0, size: int = 0) -> np.ndarray:
    """Dequantize only rows (dim 0) or columns (dim 1) [offset, offset + size) of a GGUF matrix (out, in).

    Quantized rows are stored one after another, each as in/32 blocks (Q4_1: 20 bytes per 32 weights; the
    K-quants: 256 weights per block), so a slice of rows is a slice of the byte array, and a slice of columns
    that starts and ends on a block boundary is a slice of each row's blocks: nothing outside the slice is
    dequantized. An unquantized matrix (F32, F16) is the same with blocks of one weight.
    """
    from gguf import GGML_QUANT_SIZES, dequantize

    data, qtype = tensor.data, tensor.tensor_type
    if dim == 0:
        data = data[offset:offset + size]
    elif dim == 1:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if offset % block or size % block:
            raise ValueError(f"{tensor.name}: columns {offset}:{offset + size} do not fall on {block}-weight blocks")
        # gguf gives a quantized matrix as bytes (out, in/block · block_bytes) but an F32 / F16 one as floats
        # (out, in): viewed as bytes, both are rows of blocks
        data = data.view(np.uint8).reshape(data.shape[0], -1, block_bytes)[:, offset // block:(offset + size) // block]
        data = data.reshape(data.shape[0], -1)
    return dequantize(np.ascontiguousarray(data), qtype).astype(np.float32)


@torch.no_grad()
def load_shard_from_gguf(path, tp, linear_layers=None) -> Llama:
    """Rank tp.rank's shard, reading only its slice of every matrix from the GGUF file."""
    from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf, our_name, unpermute_qk

    reader = open_gguf(path or embedded_gguf_path())
    config = config_from_gguf(reader)
    model = shard_llama(config, tp, linear_layers)
    modules, loaded = dict(sharded_parameters(model)), {}
    for t in reader.tensors:
        name = our_name(t.name)
        part = fused_name(name.removesuffix(".weight"))  # q/k/v, gate/up: a slice of a fused layer's rows
        if part is not None:
            name, shard_id = part[0] + ".weight", part[1]
        if name not in modules:
            raise ValueError(f"{reader.data.filename}: unexpected tensor {t.name}")
        module = modules[name] if part is not None else modules.pop(name)
        if part is not None:
            offset, size = module.part_slices[shard_id]
            w, target = read_gguf_slice(t, 0, offset, size), module.weight.data[module.part_rows(shard_id)]
            loaded.setdefault(name, set()).add(shard_id)
        else:
            w = read_gguf_slice(t, getattr(module, "shard_dim", None), getattr(module, "shard_offset", 0),
                                getattr(module, "shard_size", 0))
            target = module.weight.data[:w.shape[0]]
            module.weight.data[w.shape[0]:] = 0  # a vocabulary shard's padding rows (to_empty left them unset)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            # llama.cpp's row order, undone per head: this slice holds whole heads (w.shape[0] / D of them)
            w = unpermute_qk(w, w.shape[0] // config.head_dim)
        target.copy_(torch.from_numpy(w).view(target.shape))
    for name, ids in loaded.items():  # a fused layer is loaded once all its parts are
        if len(ids) == len(modules[name].part_slices):
            modules.pop(name)
    if modules:
        raise ValueError(f"{reader.data.filename}: tensors missing for {sorted(modules)}")
    return model


def shard_nbytes(model: nn.Module) -> int:
    """Bytes of the weights this rank holds (a tied matrix counted once)."""
    return sum(p.nbytes for p in model.parameters())
