"""Chapter 02: the layers, the block and the whole model against transformers; the GGUF loader; memory math."""

import struct

import numpy as np
import pytest
import torch
from transformers.models.llama import modeling_llama

from nanoserve.memory import layer_parameter_counts, parameter_counts
from nanoserve.model import Llama, LlamaConfig
from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, load_gguf, open_gguf, unpermute_qk
from nanoserve.model.layers import SWAP_AB_MAX_TOKENS, Linear
from nanoserve.student import implementation
from tests.hf_reference import additive_causal_mask, hf_config, hf_rope
from tests.test_student import exercises  # noqa: F401  (a fixture: a copy of exercises/ the loader reads)
from tests.tiny_model import write_llama_gguf

layers = implementation("nanoserve.model.layers")
block = implementation("nanoserve.model.block")
llama = implementation("nanoserve.model.llama")
TINY = LlamaConfig.tiny()


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere (norm weights too, so a forgotten `* weight` shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return module


# --- Exercise 2.1: RMSNorm ----------------------------------------------------------------------

@pytest.mark.exercise("2.1")
def test_rmsnorm_by_hand():
    norm = layers.RMSNorm(2, eps=0.0)
    x = torch.tensor([[3.0, 4.0]])  # mean of squares = 12.5
    torch.testing.assert_close(norm(x), x / 12.5 ** 0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, -1.0]))
    torch.testing.assert_close(norm(x), torch.tensor([[6.0, -4.0]]) / 12.5 ** 0.5)


@pytest.mark.exercise("2.1")
def test_rmsnorm_matches_transformers():
    ours = randomize(layers.RMSNorm(64, eps=1e-5))
    theirs = modeling_llama.LlamaRMSNorm(64, eps=1e-5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 64) * 10
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.exercise("2.1")
def test_rmsnorm_takes_its_statistic_in_float32_and_keeps_a_half_model_half():
    # float16 x and weight, one token with a massive activation (section 2: the first token's stream reaches ~946):
    # 1000² overflows float16 (max 65504), so a mean of squares taken in float16 is inf and the row comes out 0
    ours = randomize(layers.RMSNorm(64, eps=1e-5)).half()
    theirs = modeling_llama.LlamaRMSNorm(64, eps=1e-5).half()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).half()
    x[0, 5] = 1000.0
    y = ours(x)
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert torch.isfinite(y).all() and y[0].abs().max() > 1  # the massive row normalised, not zeroed
    torch.testing.assert_close(y, theirs(x), atol=1e-2, rtol=1e-2)  # float16 rounding of the same result


# --- Linear: x · Wᵀ, small batches handed to BLAS with the operands swapped ----------------------

@pytest.mark.parametrize("leading", [(1,), (2,), (SWAP_AB_MAX_TOKENS,), (SWAP_AB_MAX_TOKENS + 1,), (300,), (2, 3)])
def test_linear_is_x_times_w_transposed(leading):
    g = torch.Generator().manual_seed(len(leading) * 1000 + leading[-1])
    ours = Linear(32, 48)
    plain = torch.nn.Linear(32, 48, bias=False)
    plain.load_state_dict(ours.state_dict())  # the same parameters, under the same name
    x = torch.randn(*leading, 32, generator=g)
    expected = torch.einsum("...i,oi->...o", x.double(), ours.weight.double())  # in float64, summed by einsum
    y = ours(x)
    assert y.shape == (*leading, 48) and y.is_contiguous()
    torch.testing.assert_close(y, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, plain(x))


# --- Exercise 2.2: the decoder block ------------------------------------------------------------

@pytest.mark.exercise("2.2")
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_decoder_block_matches_transformers(num_tokens):
    ours = randomize(block.DecoderBlock(TINY, layer_idx=0), seed=num_tokens)
    theirs = modeling_llama.LlamaDecoderLayer(hf_config(TINY), layer_idx=0)
    theirs.load_state_dict(ours.state_dict())
    # uneven gaps: the distances between the tokens are not those of 0..N-1 (a shift of every position would keep
    # them all, and RoPE's scores depend on distances only, chapter 01)
    positions = torch.tensor([0, 2, 3, 7, 8, 20, 21])[:num_tokens]
    x = torch.randn(num_tokens, TINY.hidden_size)

    from nanoserve.model.llama import causal_self_attention
    from nanoserve.model.rope import rope_cos_sin

    cos, sin = rope_cos_sin(positions, TINY.head_dim, TINY.rope_theta)
    out = ours(x, cos, sin, causal_self_attention)
    expected = theirs(x[None], attention_mask=additive_causal_mask(num_tokens),
                      position_embeddings=hf_rope(TINY, positions))
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    if num_tokens > 1:  # (one token attends to itself alone: its output is its v, which RoPE does not rotate)
        # the comparison sees RoPE: the same block at positions 0..N-1, or with no rotation at all, is far off
        for wrong_cos, wrong_sin in (rope_cos_sin(torch.arange(num_tokens), TINY.head_dim, TINY.rope_theta),
                                     (torch.ones_like(cos), torch.zeros_like(sin))):
            assert (ours(x, wrong_cos, wrong_sin, causal_self_attention) - expected[0]).abs().max() > 1e-2


@pytest.mark.exercise("2.2")
def test_decoder_block_adds_to_the_stream():
    # sub-layers whose output projections are zero add nothing: a pre-norm block then returns x exactly
    ours = randomize(block.DecoderBlock(TINY, layer_idx=0))
    with torch.no_grad():
        ours.self_attn.o_proj.weight.zero_()
        ours.mlp.down_proj.weight.zero_()
    from nanoserve.model.llama import causal_self_attention
    from nanoserve.model.rope import rope_cos_sin

    x = torch.randn(5, TINY.hidden_size) * 30  # far from RMS 1: a block that normalises the stream changes it
    cos, sin = rope_cos_sin(torch.arange(5), TINY.head_dim, TINY.rope_theta)
    assert torch.equal(ours(x, cos, sin, causal_self_attention), x)


# --- Exercise 2.3: the whole model -------------------------------------------------------------

def tiny_pair(tie: bool = True):
    """Our tiny model (the learner's Llama under `make grade`) and transformers' LlamaForCausalLM, same weights."""
    config = LlamaConfig.tiny(tie_word_embeddings=tie)
    ours = randomize(llama.Llama(config)).eval()
    theirs = modeling_llama.LlamaForCausalLM(hf_config(config)).eval()
    theirs.load_state_dict({("lm_head." + k[8:] if k.startswith("lm_head.") else "model." + k): v
                            for k, v in ours.state_dict().items()})
    return ours, theirs


@pytest.mark.exercise("2.3")
@pytest.mark.parametrize("tie", [True, False])
def test_tiny_model_matches_transformers(tie):
    ours, theirs = tiny_pair(tie)
    ids = torch.randint(0, TINY.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
        hidden = ours(ids)
        assert hidden.shape == (11, TINY.hidden_size)  # forward gives hidden states; the LM head is compute_logits'
        torch.testing.assert_close(ours.compute_logits(hidden), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("2.3")
def test_tiny_model_hands_every_layer_to_the_callers_attn():
    # the engine passes its own `attn` (the KV cache's); a forward that falls back to the no-cache attention
    # regardless would pass every test that passes none, and serve wrong tokens. This `attn` records each call
    # and computes the same causal attention, so the output is still transformers'.
    from nanoserve.model.llama import causal_self_attention  # the reference's, not the learner's file

    calls = []

    def recording_attn(layer_idx, q, k, v):
        calls.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return causal_self_attention(layer_idx, q, k, v)

    ours, theirs = tiny_pair()
    ids = torch.randint(0, TINY.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([0, 2, 3, 7, 8, 20])
    with torch.no_grad():
        expected = theirs(ids[None], position_ids=positions[None]).logits[0]
        got = ours.compute_logits(ours(ids, positions, attn=recording_attn))
    q_shape = (6, TINY.num_attention_heads, TINY.head_dim)
    kv_shape = (6, TINY.num_key_value_heads, TINY.head_dim)
    assert calls == [(i, q_shape, kv_shape, kv_shape) for i in range(TINY.num_hidden_layers)]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("2.3")
def test_tiny_model_takes_positions():
    # positions with gaps (not 0..N-1, not a uniform shift): RoPE must use them, not the list order
    ours, theirs = tiny_pair()
    ids = torch.randint(0, TINY.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([0, 2, 3, 7, 8, 20])
    with torch.no_grad():
        expected = theirs(ids[None], position_ids=positions[None]).logits[0]
        got = ours.compute_logits(ours(ids, positions))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, ours.compute_logits(ours(ids)), atol=1e-3)  # the positions mattered


@pytest.mark.exercise("2.3")
def test_tiny_model_in_bf16_stays_bf16_and_as_close_as_transformers_bf16():
    # a bf16 model (--weights bf16 serves one): rope_cos_sin's tables are float32, and on bf16 q and k they would
    # promote them to float32 next to a bf16 v; in the embedding's dtype they keep the model bf16, as transformers'.
    # bf16 rounds every product (8 bits of mantissa): the float32 pair is the reference, and ours in bf16 must be
    # within twice the error of transformers' own bf16 model
    _, reference = tiny_pair()
    ours, theirs = (m.to(torch.bfloat16) for m in tiny_pair())
    ids = torch.randint(0, TINY.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([0, 1, 4, 5, 6, 10, 11, 12, 30])
    with torch.no_grad():
        expected = reference(ids[None], position_ids=positions[None]).logits[0]
        theirs_error = (theirs(ids[None], position_ids=positions[None]).logits[0].float() - expected).abs().max()
        hidden = ours(ids, positions)
        got = ours.compute_logits(hidden)
    assert hidden.dtype == got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() <= 2 * theirs_error


@pytest.mark.exercise("2.3")
def test_tiny_model_refuses_a_batch_axis_and_positions_past_the_context():
    ours, _ = tiny_pair()
    with pytest.raises(ValueError, match=r"1, 4\b"):  # the shape, as (1, 4) or torch.Size([1, 4])
        ours(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=str(TINY.max_position_embeddings)):
        ours(torch.tensor([1, 2]), torch.tensor([0, TINY.max_position_embeddings]))


PARITY_PROMPTS = {
    "english": "The quick brown fox jumps over the lazy dog because",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "chinese": "人工智能正在改变世界，它的未来",
    "emoji": "I love pizza 🍕 and rockets 🚀🚀 so",
    "chat": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY_PROMPTS)
def test_smollm2_logits_match_transformers(name, smollm2, hf_model, hf_tokenizer):
    ids = hf_tokenizer(PARITY_PROMPTS[name], add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
        ours = smollm2.compute_logits(smollm2(torch.tensor(ids)))
    assert ours.shape == expected.shape == (len(ids), 49152)
    assert (ours - expected).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


# --- the GGUF loader ----------------------------------------------------------------------------

def test_embedded_config_is_smollm2():
    config = config_from_gguf(open_gguf(embedded_gguf_path()))
    assert config == LlamaConfig(rms_norm_eps=config.rms_norm_eps)  # the defaults are SmolLM2's
    assert abs(config.rms_norm_eps - 1e-5) < 1e-9
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.rope_theta, config.tie_word_embeddings) == (30, 576, 9, 3, 64, 1e5, True)


def test_unpermute_undoes_llama_cpp_permutation():
    # llama.cpp's convert script, written out: per head, rows [first half | second half] become interleaved pairs.
    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)  # 2 heads of head_dim 6
    permuted = llama_cpp_permute(w, 2)
    assert permuted[:, 0].tolist() == [0, 9, 3, 12, 6, 15, 18, 27, 21, 30, 24, 33]  # x0, x3, x1, x4, ... per head
    assert np.array_equal(unpermute_qk(permuted, 2), w)


def decode_by_hand(raw: np.ndarray, kind: str) -> np.ndarray:
    """A tensor's bytes -> float32 weights, from the block formats' definition (ggml's block_q4_1, block_q8_0) in
    numpy alone: neither gguf.dequantize, which the loader and transformers both call, nor the loader's code."""
    if kind == "Q4_1":  # 20 bytes per 32 weights: scale d (float16), minimum m (float16), 16 bytes of nibbles
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (num_blocks, 1)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1)  # byte j: low nibble w[j], high w[j+16]
        return d * q.astype(np.float32) + m  # (num_blocks, 32)
    assert kind == "Q8_0"  # 34 bytes per 32 weights: scale d (float16), 32 int8
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_name, ours", [
    ("token_embd.weight", "embed_tokens.weight"),  # Q8_0: the embedding, and the tied LM head
    ("blk.0.ffn_down.weight", "layers.0.mlp.down_proj.weight"),  # Q4_1 from here on
    ("blk.11.ffn_gate.weight", "layers.11.mlp.gate_proj.weight"),  # half of the fused gate_up_proj
    ("blk.29.attn_v.weight", "layers.29.self_attn.v_proj.weight"),  # a third of the fused qkv_proj
    ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight"),  # rows un-permuted as well
])
def test_gguf_blocks_decode_by_hand_to_the_loaded_weights(gguf_name, ours, smollm2):
    """The loader's float32 weights are the file's bytes decoded as the formats define them. The parity test with
    transformers cannot show this: transformers dequantizes with the same gguf.dequantize as load_gguf."""
    path = embedded_gguf_path()
    t = next(t for t in open_gguf(path).tensors if t.name == gguf_name)
    raw = np.fromfile(path, dtype=np.uint8, count=int(t.n_bytes), offset=int(t.data_offset))  # the bytes on disk
    out_features, in_features = reversed(t.shape.tolist())  # GGUF lists [in, out]
    w = decode_by_hand(raw, t.tensor_type.name).reshape(out_features, in_features)
    if gguf_name.endswith("attn_k.weight"):  # checked against llama.cpp's permutation below
        w = unpermute_qk(w, smollm2.config.num_key_value_heads)
    assert torch.equal(smollm2.state_dict()[ours], torch.from_numpy(w))


def test_missing_gguf_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.gguf"):
        load_gguf(tmp_path / "nothere.gguf")


def test_not_a_gguf_names_the_file(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ValueError, match=r"weights\.gguf.*not a GGUF file"):
        load_gguf(path)


def test_truncated_gguf_names_the_file(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as f:
        path.write_bytes(f.read(1 << 20))  # the header and the first tensors only
    with pytest.raises(ValueError, match=r"truncated\.gguf.*corrupt or truncated"):
        load_gguf(path)


def test_corrupt_header_names_the_file(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\xff" * 64)  # absurd tensor and key counts
    with pytest.raises(ValueError, match=r"corrupt\.gguf"):
        load_gguf(path)



def test_a_tiny_gguf_loads_as_written(tmp_path):
    """The tiny GGUF the tests below alter: written as llama.cpp's converter lays one out, it loads, weights and all
    (Q and K put back in HF's row order)."""
    config = LlamaConfig.tiny(tie_word_embeddings=False, rms_norm_eps=2.0 ** -17)  # an eps the file's float32 holds
    written = write_llama_gguf(tmp_path / "tiny.gguf", config)
    model = load_gguf(tmp_path / "tiny.gguf")
    assert model.config == config
    state = model.state_dict()
    assert torch.equal(state["layers.1.mlp.up_proj.weight"], torch.from_numpy(written["blk.1.ffn_up.weight"]))
    assert torch.equal(state["layers.0.self_attn.k_proj.weight"], torch.from_numpy(
        unpermute_qk(written["blk.0.attn_k.weight"], config.num_key_value_heads)))


@pytest.mark.parametrize("keys, tensors, feature", [
    ({}, {"rope_freqs.weight": np.ones(8, np.float32)}, r"per-frequency RoPE scaling \(the rope_freqs\.weight tensor\)"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {},
     r"RoPE scaling \(llama\.rope\.scaling\.type 'linear', llama\.rope\.scaling\.factor 4\.0\)"),
    ({"llama.rope.scaling.type": "yarn"}, {}, r"RoPE scaling \(llama\.rope\.scaling\.type 'yarn'\)"),
    ({"llama.rope.dimension_count": 8}, {}, r"RoPE over 8 dimensions per head \(llama\.rope\.dimension_count\)"),
    ({"llama.attention.key_length": 32}, {}, r"keys of 32 dimensions per head.*= 16"),
    ({"llama.attention.sliding_window": 64}, {}, r"sliding-window attention \(llama\.attention\.sliding_window 64\)"),
    ({}, {"blk.0.attn_q.bias": np.zeros(64, np.float32)}, r"a tensor nanoserve's Llama does not have \(blk\.0\.attn_q\.bias\)"),
])
def test_a_gguf_needing_what_llamaconfig_cannot_say_is_refused_naming_the_file_and_the_feature(tmp_path, keys,
                                                                                             tensors, feature):
    """Section 1: a Llama-family file that needs RoPE scaling, another head or rotary size, a sliding window or a
    tensor the model does not have would load and run wrong, or fail on a bare KeyError: the config is refused,
    before any weight is read, with the file's name and the feature."""
    path = tmp_path / "other.gguf"
    write_llama_gguf(path, LlamaConfig.tiny(), keys=keys, tensors=tensors)
    for read in (lambda: config_from_gguf(open_gguf(path)), lambda: load_gguf(path)):
        with pytest.raises(ValueError, match=rf"other\.gguf: this model needs {feature}.*does not implement"):
            read()


def test_a_gguf_saying_what_llamaconfig_assumes_loads(tmp_path):
    """Keys that agree with LlamaConfig (no scaling, head and rotary size hidden / heads) are no reason to refuse."""
    path, config = tmp_path / "explicit.gguf", LlamaConfig.tiny(tie_word_embeddings=False, rms_norm_eps=2.0 ** -17)
    write_llama_gguf(path, config, keys={"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 1.0,
                                         "llama.rope.dimension_count": 16, "llama.attention.key_length": 16})
    assert config_from_gguf(open_gguf(path)) == config



LINEAR_NOT_NN_LINEAR = '''class Linear(nn.Module):
    """The learner's Linear as a plain module holding the weight: the same product, not an nn.Linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
'''


def test_a_learners_own_linear_serves_the_files_q4_blocks_or_is_refused(tmp_path, exercises):
    """--student 02 with a layers.py that mirrors the reference's whole module: block.py's projections are the
    learner's Linear class, not the reference's. Quantized, they still serve the file's weights (the same logits as
    the reference's q4 model); a Linear that is not an nn.Linear would keep a float32 weight, never loaded from the
    file's Q4_1 blocks, so every quantized format refuses it, naming the layer and its class."""
    from gguf import GGMLQuantizationType

    from nanoserve.student import StudentCode

    path = tmp_path / "tiny-q4.gguf"
    write_llama_gguf(path, LlamaConfig.tiny(), GGMLQuantizationType.Q4_1)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    layers_py = exercises("nanoserve.model.layers")  # the reference's files, copied whole into the learner's
    exercises("nanoserve.model.block")
    exercises("nanoserve.model.llama")
    fp32 = load_gguf(path, modules=StudentCode("02").module)
    assert {f"{type(m).__module__}.{type(m).__name__}" for name, m in fp32.named_modules() if name.endswith("_proj")} \
        == {"student_nanoserve_model_layers.Linear"}  # the learner's class, not nanoserve.model.layers.Linear
    for weights in ("q4", "int8"):
        ours, reference = load_gguf(path, weights, modules=StudentCode("02").module), load_gguf(path, weights)
        assert {type(m).__name__ for name, m in ours.named_modules() if name.endswith("_proj")} == \
            {"Q4Linear" if weights == "q4" else "Int8Linear"}
        with torch.no_grad():
            assert torch.equal(ours.compute_logits(ours(ids)), reference.compute_logits(reference(ids)))
    source = layers_py.read_text()
    start, end = source.index("class Linear(nn.Linear):"), source.index("class RMSNorm(")
    layers_py.write_text(source[:start] + LINEAR_NOT_NN_LINEAR + "\n\n" + source[end:])
    for weights in ("q4", "int8", "bf16"):
        with pytest.raises(ValueError, match=rf"weights='{weights}' swaps each decoder layer that is a torch\.nn\.Linear; "
                                             r"layers\.0\.self_attn\.qkv_proj, layers\.0\.self_attn\.o_proj and 6 more "
                                             r"\(student_nanoserve_model_layers\.Linear\) is not one"):
            load_gguf(path, weights, modules=StudentCode("02").module)


# --- memory math --------------------------------------------------------------------------------

def test_parameter_count_by_hand():
    # SmolLM2: attention 2·576·576 + 2·576·192, MLP 3·576·1536, two norms; 30 of them, embedding, final norm.
    per_layer = layer_parameter_counts(LlamaConfig())
    assert per_layer == {"attention": 884_736, "mlp": 2_654_208, "norms": 1_152}
    assert parameter_counts(LlamaConfig())["total"] == 30 * 3_540_096 + 49152 * 576 + 576 == 134_515_008


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_matches_the_module(tie):
    config = LlamaConfig.tiny(tie_word_embeddings=tie)
    model = Llama(config)
    assert parameter_counts(config)["total"] == sum(p.numel() for p in model.parameters())  # tied: counted once


@pytest.mark.slow
def test_parameter_count_matches_smollm2(smollm2):
    assert parameter_counts(smollm2.config)["total"] == sum(p.numel() for p in smollm2.parameters())
