"""The tiny random-weight Llama the engine-level tests serve (fast, and the real code paths end to end)."""

import time

import numpy as np
import torch

from nanoserve.model import Llama, LlamaConfig


def tiny_llama(model_class=Llama, **config) -> Llama:
    """LlamaConfig.tiny(**config) with seeded weights and HF's embedding init (std 0.02): with N(0, 1)
    embeddings the tied LM head just repeats the last token, so greedy outputs would not vary."""
    torch.manual_seed(0)
    model = model_class(LlamaConfig.tiny(**config)).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
    return model


class PacedLlama(Llama):
    """The tiny model with a forward pass of at least `delay_s` seconds, as a real model's step on a CPU: chapter
    16's fleet tests need a stream that lasts (to kill its replica mid-way) and a burst that keeps replicas busy."""
    delay_s = 0.0

    def forward(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return super().forward(*args, **kwargs)


def paced_tiny_llama(delay_s: float, **config) -> PacedLlama:
    """tiny_llama(**config) (the same weights) whose every step takes at least delay_s."""
    model = tiny_llama(PacedLlama, **config)
    model.delay_s = delay_s
    return model


def write_llama_gguf(path, config, dtype=np.float32, keys=None, tensors=None):
    """A tiny Llama as a GGUF, written with the gguf package as llama.cpp's converter lays it out: random matrices in
    `dtype` (np.float32, np.float16, or GGMLQuantizationType.Q4_1: blocks made by the gguf package's quantizer), the
    norms float32. keys: more metadata, {key: str, float (float32) or int (uint32)}; tensors: more tensors,
    {GGUF name: array}. Returns the matrices by GGUF name, as float32 (for Q4_1: before quantizing)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    h, D, H, Hkv, I = (config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
                       config.intermediate_size)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (config.vocab_size, h), "output.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_q.weight": (H * D, h), f"blk.{i}.attn_k.weight": (Hkv * D, h),
                       f"blk.{i}.attn_v.weight": (Hkv * D, h), f"blk.{i}.attn_output.weight": (h, H * D),
                       f"blk.{i}.ffn_gate.weight": (I, h), f"blk.{i}.ffn_up.weight": (I, h),
                       f"blk.{i}.ffn_down.weight": (h, I)})
    matrices = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(h)
    w.add_feed_forward_length(I)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    for key, value in (keys or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(key, value)
    for name, m in matrices.items():
        if dtype == GGMLQuantizationType.Q4_1:
            matrices[name] = m.astype(np.float32)
            w.add_tensor(name, quantize(matrices[name], dtype), raw_dtype=dtype)
        else:
            w.add_tensor(name, m.astype(dtype))
            matrices[name] = m.astype(dtype).astype(np.float32)
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(config.num_hidden_layers)
                                          for n in ("attn", "ffn")]:
        w.add_tensor(name, rng.standard_normal(h).astype(np.float32))
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return matrices
