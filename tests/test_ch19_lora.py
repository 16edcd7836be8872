"""Chapter 19: LoRA adapters — PEFT's files read, the batched gather against a per-row reference, the model
against transformers + PEFT (logits and greedy text), mixed batches, every weights format, the slots' LRU."""

import contextlib
import json

import pytest
import torch
from nanoserve.engine.config import engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.lora.adapter import load_adapter
from nanoserve.engine.config import LoRAConfig
from nanoserve.lora.manager import LoRAModelManager
from nanoserve.lora.punica import bgmv, sgmv
from nanoserve.model.quant import BF16Linear, Int8Linear, quantize_model
from nanoserve.sampling import SamplingParams
from tests.lora_reference import TINY, peft_greedy, peft_model, tiny_llama


@pytest.fixture
def adapters(tiny_adapters):
    return tiny_adapters


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the kernels: bgmv and sgmv against a loop over rows ------------------------------------------

def per_row_reference(x, a, b, slots, slices):
    """Row t: for each slice s, B[slot, rows_s, :] · (A[slot, s·R:(s+1)·R] · x[t]) — one row at a time."""
    R, out = b.shape[-1], torch.zeros(x.shape[0], b.shape[1])
    for t, slot in enumerate(slots):
        lo = 0
        for s, n in enumerate(slices):
            out[t, lo:lo + n] = b[slot, lo:lo + n] @ (a[slot, s * R:(s + 1) * R] @ x[t])
            lo += n
    return out


def random_slots(seed=0, slices=(6, 2, 2), R=3, num_slots=4, d_in=5):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(num_slots, len(slices) * R, d_in, generator=g), torch.randn(num_slots, sum(slices), R, generator=g)
    a[0], b[0] = 0, 0  # slot 0: the base model
    return a, b, torch.randn(7, d_in, generator=g), list(slices)


@pytest.mark.exercise("19.1")
def test_sgmv_matches_a_loop_over_rows():
    a, b, x, slices = random_slots()
    segments = [(0, 1, 1), (1, 2, 0), (2, 4, 3), (4, 5, 2), (5, 7, 1)]
    expected = per_row_reference(x, a, b, [1, 0, 3, 3, 2, 1, 1], slices)
    torch.testing.assert_close(punica().sgmv(x, a, b, segments, slices), expected)


@pytest.mark.exercise("19.2")
def test_bgmv_matches_a_loop_over_rows():
    a, b, x, slices = random_slots(1)
    slots = [1, 0, 3, 3, 2, 1, 0]
    got = punica().bgmv(x, a, b, torch.tensor(slots), slices)
    torch.testing.assert_close(got, per_row_reference(x, a, b, slots, slices))
    assert torch.equal(got[1], torch.zeros(10))  # a base row adds nothing


def punica():
    from nanoserve.student import implementation

    return implementation("nanoserve.lora.punica")


# --- the adapter against transformers + PEFT --------------------------------------------------------

@pytest.mark.exercise("19.1")
@pytest.mark.parametrize("name", ["a", "b"])
def test_lora_logits_match_peft(adapters, name):
    ours = tiny_llama()
    manager = LoRAModelManager(ours, LoRAConfig(max_loras=2, max_lora_rank=8), punica=punica())
    manager.add_adapter(name, adapters[name])
    theirs = peft_model(adapters)
    theirs.set_adapter(name)
    ids = torch.tensor(prompt(1, 11))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
        with theirs.disable_adapter():
            base = theirs(ids[None]).logits[0]
        manager.set_step([(name, len(ids))])  # one prefill segment: sgmv
        got = ours.compute_logits(ours(ids))
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the logits: the comparison means something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_merged_adapter_matches_peft(adapters, name):
    """W + scale·B·A in the fused weights (what bench lora compares the gather with) gives PEFT's logits too."""
    from nanoserve.lora.merge import merge_adapter

    merged = tiny_llama()
    merge_adapter(merged, load_adapter(name, adapters[name], TINY, 8))
    theirs = peft_model(adapters)
    theirs.set_adapter(name)
    ids = torch.tensor(prompt(6, 10))
    with torch.no_grad():
        expected = theirs(ids[None]).logits[0]
        base = tiny_llama().compute_logits(tiny_llama()(ids))
        got = merged.compute_logits(merged(ids))
    assert (expected - base).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="only float Linear"):
        merge_adapter(quantize_model(tiny_llama(), "int8"), load_adapter(name, adapters[name], TINY, 8))


@pytest.mark.exercise("19.2")
def test_a_mixed_decode_step_matches_peft_row_by_row(adapters):
    """One decode step's rows use a, the base, b, a: each row of the fused qkv_proj is PEFT's q, k, v of that
    row's adapter (bgmv: every sequence decodes one token)."""
    model = tiny_llama()
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), punica=punica())
    for name in adapters:
        manager.add_adapter(name, adapters[name])
    rows = ["a", None, "b", "a"]
    manager.set_step([(name, 1) for name in rows])
    assert manager.mapping.decode
    x = torch.randn(4, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    theirs = peft_model(adapters)
    attn = theirs.base_model.model.model.layers[0].self_attn
    with torch.no_grad():
        got = manager.layers["layers.0.self_attn.qkv_proj"](x)
        for t, name in enumerate(rows):
            with theirs.disable_adapter() if name is None else contextlib.nullcontext():
                if name is not None:
                    theirs.set_adapter(name)
                expected = torch.cat([p(x[t:t + 1]) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)[0]
            torch.testing.assert_close(got[t], expected, atol=1e-5, rtol=1e-5)


def lora_engine(adapters, max_loras=2, max_num_seqs=8, **kw):
    engine = LLMEngine(tiny_llama(), engine_config(num_blocks=64, max_num_seqs=max_num_seqs,
                                                  lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8)),
                       eos_token_id=-1, **kw)
    for name, path in adapters.items():
        engine.add_lora(name, path)
    return engine


def run(engine, requests: dict[str, tuple[list[int], str | None]], max_tokens=6) -> dict[str, list[int]]:
    for rid, (ids, lora) in requests.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0), lora_name=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def test_mixed_batch_greedy_matches_peft_and_each_alone(adapters):
    """Both adapters and the base in one batch (prefill chunks, then decode steps through the gather): each
    request's greedy tokens are transformers + PEFT's, and what the request gets served alone."""
    requests = {"r-a": (prompt(2, 9), "a"), "r-b": (prompt(3, 5), "b"), "r-base": (prompt(4, 7), None),
                "r-a2": (prompt(5, 6), "a")}
    mixed = run(lora_engine(adapters), requests)
    theirs = peft_model(adapters)
    for rid, (ids, lora) in requests.items():
        assert mixed[rid] == peft_greedy(theirs, ids, lora, 6), rid
        assert run(lora_engine(adapters), {rid: (ids, lora)}) == {rid: mixed[rid]}


@pytest.mark.parametrize("fmt", [Int8Linear.from_float, BF16Linear])
def test_lora_adds_the_same_update_to_int8_and_bf16_weights(adapters, fmt):
    """A LoRA layer around a quantized base: output − base output = the adapter's x·Aᵀ·(scale·B)ᵀ per slice."""
    model = tiny_llama()
    manager = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8))
    adapter = manager.add_adapter("a", adapters["a"])
    layer = manager.layers["layers.1.mlp.gate_up_proj"]
    layer.base_layer = fmt(layer.base_layer.weight.detach())
    x = torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    manager.set_step([("a", 3)])
    with torch.no_grad():
        update = layer(x).float() - layer.base_layer(x).float()
    expected = torch.cat([x @ a.t() @ b.t() for a, b in (adapter.weights["layers.1.mlp.gate_proj"],
                                                           adapter.weights["layers.1.mlp.up_proj"])], dim=-1)
    torch.testing.assert_close(update, expected, atol=2e-2 if fmt is BF16Linear else 1e-5, rtol=1e-2)


# --- PEFT's files: what is refused --------------------------------------------------------------------

def edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_bad_adapters_are_refused_with_the_reason(adapters, tmp_path):
    load = lambda path, rank=8: load_adapter("x", path, TINY, rank)  # noqa: E731
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        load(adapters["b"], rank=4)
    with pytest.raises(ValueError, match=r"target modules \['lm_head'\] are not projections"):
        load(edit_config(adapters["a"], tmp_path / "head", target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="use_dora"):
        load(edit_config(adapters["a"], tmp_path / "dora", use_dora=True))
    with pytest.raises(ValueError, match="A .* and B .* expected"):  # r in the config is not the tensors' rank
        load(edit_config(adapters["a"], tmp_path / "rank", r=2))
    manager = LoRAModelManager(tiny_llama(), LoRAConfig(max_loras=1, max_lora_rank=8, modules=("qkv_proj",)))
    with pytest.raises(ValueError, match="has no LoRA layer"):
        manager.add_adapter("a", adapters["a"])  # it adapts o_proj, gate_up_proj and down_proj too


def test_the_adapter_bytes_are_rank_times_in_plus_out(adapters):
    """r·(in + out) floats per projection: adapter a (rank 4) on all 7 projections of each of 2 tiny layers."""
    adapter = load_adapter("a", adapters["a"], TINY, 8)
    h, q, kv, i = 64, 64, 32, 128
    per_layer = 4 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    assert adapter.nbytes == 2 * per_layer * 4
