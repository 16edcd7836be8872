"""Chapters 09 and 10 — a decode step of up to NATIVE_DECODE_MAX_ROWS (16) sequences' one token each in one C call
(cpu_decode.c, which includes cpu_dot.c's products).

Which path a step takes (nanoserve/engine/model_runner.py decides, per step):

    every row one sequence's one token (a decode, or a prefill chunk of one token), at most max_rows(model) rows
    (up to NATIVE_DECODE_MAX_ROWS where the layers' small steps are cpu_dot.c's, else 1), q4 weights, the model's
    `native_decode` on, a float32 or bf16 PagedKVCache
        -> NativeDecoder.step: the embedding rows in torch, then every layer and the final norm in C;
           NativeDecoder.logits: the LM head in cpu_dot.c's int8 product
    anything else (a step with a longer prefill chunk, decodes beside it included; more rows than max_rows;
    spec-decode verify rows, fp32 / int8 / bf16 weights,
    LoRA, a quantized KV pool, another attention class, tensor parallelism)
        -> the model's forward (eager or compiled), as before

Why: a batch-1 step's products take ~5 ms of its ~16 on the course's 2-core CPU; the rest is Python and op
dispatch around a few KB of arithmetic (`python -m nanoserve bench profile`). llama.cpp runs its whole step
in a little more than the products' time (7-9 ms, chapter 09 section 5). Chapter 09 section 5 has what the C step measured (`bench peers --native-decode`).
Up to max_rows the same holds for a small batch: the rows share each product (each weight block unpacked once per
tile of 8 rows, cpu_dot.c's gemv_rows), and row r of a B-row step is bit for bit its batch-1 step (cpu_decode.c's
invariant). That is a step's invariance, not a request's: a step with a longer prompt chunk in it runs the forward
for every row, which rounds otherwise, and a request's own prompt is prefilled in the forward beside whatever
other prompts share its steps.
The C step computes what the eager q4 integer_dot step computes, in the same order per layer; what differs is
float32 rounding only (the order of a norm's sum, cosf/expf against torch's), and where such a difference moves
an activation across an int8 rounding boundary, the products differ by up to one step of that block's scale (tests/test_ch09_native_decode.py has the tolerance).

The runner falls back to the model's forward for any step this cannot run (`NativeDecoder.why_not` says why);
the settings that rule it out for a whole run (a quantized pool, the Triton backend, a learner's chapter 02, 05
or 10 code, ...) turn the default off and refuse `native_decode=True` before the model loads
(native_decode_blocker).
"""

import ctypes
import functools
from pathlib import Path

import torch

from nanoserve.kernels import cpu_dot
from nanoserve.model.quant import KERNEL_CROSSOVER_TOKENS

SOURCE = Path(__file__).with_name("cpu_decode.c")
# The most one-token rows a native step runs (max_rows below may allow fewer); larger steps take the model's
# forward. Why 16: a step goes native only where the layers would multiply with the same products, cpu_dot.c's,
# which they take up to quant.KERNEL_CROSSOVER_TOKENS rows (chapter 10's crossover, 16; max_rows follows a
# model's own setting). cpu_dot.c's products beat the large-step GEMM a little further than that on the course's
# 2-core AVX2 VM (`python -m nanoserve bench linear --formats fp32 q4 --tokens 1 16 32 64`, default --repeats 3,
# torch's default 2 threads, 2026-12-04, load 0.5-1.0: its "q4 dot" column, every product of the model once,
# 49.3 ms at 16 rows against the fp32 column's 86.6, at 32 rows 97.3 against 115.7, at 64 rows 197.9 against
# 182.1), so both caps could go to 32 there; steps of 17-32 rows have not been timed end to end, and stay on the GEMM.
NATIVE_DECODE_MAX_ROWS = KERNEL_CROSSOVER_TOKENS
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the pool dtypes the C code reads (model_t.kv_bf16)


def max_rows(model) -> int:
    """The most one-token rows a native step of `model` takes. Several only where its q4 layers' own small steps
    are cpu_dot.c's integer products (integer_dot: the default on a CPU without native bf16), up to the layers'
    crossover (LLM's kernel_crossover_tokens) and NATIVE_DECODE_MAX_ROWS: there a native step multiplies as the
    forward would, without the Python between products. Where the layers take torch's int4 kernel on bf16
    activations (a CPU with native bf16), that kernel beats cpu_dot.c's products on batches (chapter 10's Zen 4
    table: 30.3 ms against 54.7 at 8 rows), and a step of several rows has not been timed natively there: one row."""
    proj = model.layers[0].self_attn.qkv_proj
    return max(1, min(NATIVE_DECODE_MAX_ROWS, proj.max_kernel_tokens)) if proj.integer_dot else 1


class Layer(ctypes.Structure):  # cpu_decode.c's layer_t
    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "norm2", "qkv", "o", "gate_up", "down", "k", "v")]


class Model(ctypes.Structure):  # cpu_decode.c's model_t
    _fields_ = [*((name, ctypes.c_int64) for name in ("hidden", "inter", "heads", "kv_heads", "head_dim", "layers",
                                                       "num_blocks", "block_size", "kv_bf16")),
                ("eps", ctypes.c_float), ("inv_freq", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("layer", ctypes.POINTER(Layer))]


@functools.cache
def library() -> ctypes.CDLL | None:
    """cpu_decode.c built for this CPU (with its AVX2 branch) and loaded, or None (the reason: build_error())."""
    if not cpu_dot.simd():  # the plain-C products are slower than torch's kernels: no point in a native step
        return None
    lib = cpu_dot.build(cpu_dot.CFLAGS, SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_scratch_bytes.argtypes = [ptr, i64, i64, ctypes.c_int]
    lib.decode_scratch_bytes.restype = i64
    lib.decode_step.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.decode_step.restype = None
    return lib


def available() -> bool:
    return library() is not None


def build_error() -> str:
    if not cpu_dot.simd():
        return "kernels/cpu_dot.c has no AVX2 branch here (or does not build)"
    return cpu_dot.build_error(cpu_dot.CFLAGS, SOURCE)


def default_native_decode(weights: str, integer_dot: bool | None) -> bool:
    """Whether a model loaded with these weights runs its steps of one-token rows (up to max_rows(model) of them) in
    kernels/cpu_decode.c by default: q4 weights, unless torch's kernels were asked for (integer_dot=False), where the C
    step builds (it needs cpu_dot.c's AVX2 branch). On a CPU whose default small-step kernel is torch's (native bf16:
    the course's Zen 4 and AMX machines) max_rows is 1: a batch-1 step then rounds its activations to int8, as
    llama.cpp does, and every larger step keeps torch's kernels; chapter 09 section 5 has the measurement that made it the default. The rest of the run's
    settings can still rule it out (native_decode_blocker)."""
    return weights == "q4" and integer_dot is not False and available()


# a learner's code the native step bypasses: chapter 02's blocks, chapter 05's attention, chapter 10's quantizer
NATIVE_BYPASSES = {"02": "your chapter 02 blocks", "05": "your chapter 05 attention", "10": "your chapter 10 quantizer"}


def native_decode_blocker(weights: str, integer_dot: bool | None, tensor_parallel_size: int = 1, lora: bool = False,
                          kv_cache_dtype: str | None = "auto", attention_backend: str | None = None,
                          student: frozenset = frozenset()) -> str:
    """Why the native step cannot run with these settings (a reason in words), or '' where it can.

    One check for all three places that decide: check_native_decode (native_decode=True refused), LLM's
    default (native_decode=None: off where this names a reason) and serve's banner. student: the chapters
    --student selects (student.parse_selection)."""
    if weights != "q4":
        return f"it runs q4 weights' steps of one-token rows in C, not {weights!r} weights"
    if integer_dot is False:
        return "it computes with cpu_dot.c's integer products; integer_dot=False asks for torch's kernels"
    if tensor_parallel_size > 1 or lora:
        return "it runs one whole q4 model in one process: not with tensor parallelism or LoRA"
    if kv_cache_dtype not in (None, "auto", "fp32", "bf16"):
        return f"it reads a float32 or bf16 KV pool, not kv_cache_dtype {kv_cache_dtype!r} (chapter 18's codes)"
    if attention_backend == "triton":
        return "it reads the pool as chapter 05's torch attention does, not with the triton attention backend"
    yours = [NATIVE_BYPASSES[ch] for ch in sorted(student) if ch in NATIVE_BYPASSES]
    if yours:
        return f"{' and '.join(yours)} (--student) run in the model's forward, which it replaces"
    if not available():
        return f"kernels/cpu_decode.c does not build here: {build_error()}"
    return ""


def check_native_decode(native_decode: bool, *args, **kwargs) -> None:
    """ValueError where an explicit native_decode=True cannot be honoured (native_decode_blocker's arguments)."""
    reason = native_decode and native_decode_blocker(*args, **kwargs)
    if reason:
        raise ValueError(f"native_decode=True, but {reason}")


def why_not_model(model) -> str:
    """'' where this model's layers are what the C step reads, else why not (the Llama itself, not a compiled
    wrapper). Checked once per model: q4 layers taking the integer products, plain RMSNorms, head dims of 32s."""
    from nanoserve.model.block import DecoderBlock, LlamaAttention
    from nanoserve.model.layers import MLP, RMSNorm
    from nanoserve.model.llama import Llama
    from nanoserve.model.quant import Int8Linear, Q4Linear

    if not available():
        return f"kernels/cpu_decode.c does not build here: {build_error()}"
    if getattr(model, "weight_format", "fp32") != "q4":
        return f"weights {getattr(model, 'weight_format', 'fp32')!r}: the native step runs q4 weights only"
    if not isinstance(model, Llama) or type(model).forward is not Llama.forward:
        return "not the reference Llama's forward (a learner's model, or one that does more than its layers)"
    c = model.config
    for i, block in enumerate(model.layers):
        if (type(block), type(block.self_attn), type(block.mlp)) != (DecoderBlock, LlamaAttention, MLP):
            return f"layer {i}: not the reference block (a learner's chapter 02 code runs in the model's forward)"
        layers = (block.self_attn.qkv_proj, block.self_attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj)
        if not all(type(m) is Q4Linear for m in layers):  # a LoRA wrapper, a learner's layer, another format
            return f"layer {i}: a product that is not a plain Q4Linear"
        if not all(type(n) is RMSNorm for n in (block.input_layernorm, block.post_attention_layernorm)):
            return f"layer {i}: a norm that is not the reference RMSNorm"
        if block.self_attn.num_heads != c.num_attention_heads or block.self_attn.num_kv_heads != c.num_key_value_heads:
            return f"layer {i}: a tensor-parallel shard"
    if type(model.norm) is not RMSNorm:
        return "the final norm is not the reference RMSNorm"
    if not isinstance(model.lm_head, Int8Linear) or model.lm_head.in_features % cpu_dot.QK:
        return "the LM head is not int8 rows of a multiple of 32"
    if c.head_dim % 2 or (c.num_attention_heads * c.head_dim) % cpu_dot.QK:
        return f"head_dim {c.head_dim}: the attention output must come in blocks of {cpu_dot.QK}"
    return ""


class NativeDecoder:
    """One model's C decode step over one KV pool: the pointers gathered once, a scratch buffer grown as needed.

    step(ids (B,), positions (B,), block_tables (B, >= blocks), seq_lens (B,), slots (B,)) -> hidden (B, hidden),
    B <= NATIVE_DECODE_MAX_ROWS one-token rows of different sequences (the runner passes at most max_rows):
    what model(ids, positions, attn) returns for
    that step, with each row's K/V stored; row r bit for bit what step() returns for row r alone.
    logits(hidden (N, hidden)) -> (N, vocab): the LM head in cpu_dot.c's int8 product, whatever the model's layers
    take for their small steps (integer_dot): a native step is integer products throughout, as llama.cpp's.
    """

    def __init__(self, model, kv_cache):
        c = model.config
        self.model, self.kv_cache = model, kv_cache
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        self.layers = (Layer * c.num_hidden_layers)()
        for i, (block, k, v) in enumerate(zip(model.layers, kv_cache.k_cache, kv_cache.v_cache)):
            a, mlp = block.self_attn, block.mlp
            self.layers[i] = Layer(*(_ptr(t) for t in (block.input_layernorm.weight, block.post_attention_layernorm.weight,
                                                        a.qkv_proj.blocks, a.o_proj.blocks, mlp.gate_up_proj.blocks,
                                                        mlp.down_proj.blocks, k, v)))
        self.desc = Model(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.num_hidden_layers, kv_cache.num_blocks, kv_cache.block_size,
                          POOL_DTYPES[kv_cache.k_cache[0].dtype], model.norm.eps, _ptr(self.inv_freq),
                          _ptr(model.norm.weight), self.layers)
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.max_rows = max_rows(model)  # the most rows of a step it takes (the runner asks)

    @staticmethod
    def why_not(model, kv_cache) -> str:
        """'' where NativeDecoder(model, kv_cache) can run its steps, else why not. kv_cache is chapter 05's
        PagedKVCache (the model runner checks its class: the kernels know nothing of kv/); here its tensors."""
        reason = why_not_model(model)
        if reason:
            return reason
        if kv_cache.k_cache[0].device.type != "cpu":
            return "the KV pool is not on the CPU"
        if kv_cache.k_cache[0].dtype not in POOL_DTYPES:
            return f"a {kv_cache.k_cache[0].dtype} KV pool (the native step reads float32 and bf16 pools)"
        if any(b.input_layernorm.eps != model.norm.eps or b.post_attention_layernorm.eps != model.norm.eps
               for b in model.layers):
            return "the norms' eps differ"
        return ""

    def step(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        """B one-token rows, one per sequence (B <= NATIVE_DECODE_MAX_ROWS): ids, positions, seq_lens, slots (B,) and
        block_tables (B, max_blocks), the step's metadata as the runner has it. Returns hidden (B, hidden)."""
        lib = library()
        rows = ids.shape[0]
        if not 1 <= rows <= NATIVE_DECODE_MAX_ROWS:
            raise ValueError(f"native decode: {rows} rows, it runs 1 to {NATIVE_DECODE_MAX_ROWS}")
        x = self.model.embed_tokens(ids).float().contiguous()  # (B, hidden): fresh rows, the C code's in and out
        positions, seq_lens, slots = (_int64(t, rows) for t in (positions, seq_lens, slots))
        table = _int64(block_tables, rows, 2)
        if int(positions.max()) >= self.model.config.max_position_embeddings:  # what Llama.forward refuses, here too
            raise ValueError(f"position {int(positions.max())} is beyond the model's context of "
                             f"{self.model.config.max_position_embeddings} tokens")
        if int(positions.min()) < 0:  # the C attention would write scores[-1]
            raise ValueError(f"native decode: negative positions {positions.tolist()}")
        if not torch.equal(positions, seq_lens - 1):
            raise ValueError(f"native decode: a one-token row is its sequence's last position, got positions "
                             f"{positions.tolist()} of lengths {seq_lens.tolist()}")
        bs = self.kv_cache.block_size
        if table.shape[1] * bs < int(seq_lens.max()):
            raise ValueError(f"native decode: a block table of {table.shape[1]} blocks for {int(seq_lens.max())} tokens")
        used = table[torch.arange(table.shape[1]) < (seq_lens[:, None] + bs - 1) // bs]  # the blocks the C code reads
        if int(used.min()) < 0 or int(used.max()) >= self.kv_cache.num_blocks:
            raise ValueError(f"native decode: block ids {used.tolist()} outside the pool's {self.kv_cache.num_blocks}")
        pool_slots = self.kv_cache.num_blocks * self.kv_cache.block_size
        if int(slots.min()) < 0 or int(slots.max()) >= pool_slots or len(set(slots.tolist())) < rows:
            raise ValueError(f"native decode: slots {slots.tolist()} outside the pool or shared")  # written unchecked
        # not checked (the runner's precondition, one sequence a row, CoW before the step): that no row reads
        # another's slot, which would need every row's read positions mapped through its table each step
        threads = torch.get_num_threads()
        need = lib.decode_scratch_bytes(ctypes.byref(self.desc), rows, int(seq_lens.max()), threads)
        if self.scratch.numel() < need:  # grown, never per step: doubled, so a growing sequence reallocates rarely
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.uint8)
        lib.decode_step(ctypes.byref(self.desc), x.data_ptr(), rows, positions.data_ptr(), table.data_ptr(),
                        table.stride(0), seq_lens.data_ptr(), slots.data_ptr(), _aligned(self.scratch), threads)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        return cpu_dot.int8_matmul(hidden, head.qweight, head.scale_f32)


def _ptr(t: torch.Tensor) -> int:
    """The address the C code reads: refuse a tensor whose memory is not one dense block."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"native decode reads contiguous CPU tensors, got one of shape {tuple(t.shape)}")
    return t.data_ptr()


def _int64(t: torch.Tensor, rows: int, dims: int = 1) -> torch.Tensor:
    """t as the C code reads it: int64 on the CPU, rows in memory order (a (rows,) vector, or a (rows, n) table
    whose rows may be padded apart: its stride(0) is passed along, its last dimension must be dense)."""
    if t.dim() != dims or t.shape[0] != rows:
        raise ValueError(f"native decode: expected {rows} rows of {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype != torch.int64 or t.device.type != "cpu" or t.stride(-1) != 1:
        t = t.to("cpu", torch.int64).contiguous()
    return t


def _aligned(buf: torch.Tensor) -> int:
    """The scratch's address rounded up to 64 bytes (decode_scratch_bytes leaves the room)."""
    return (buf.data_ptr() + 63) // 64 * 64

