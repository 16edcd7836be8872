"""Chapter 19's worked examples, computed by the code: an adapter's numbers per projection (adapter.module_shapes on
LlamaConfig), the slots' shapes and bytes (the LoRA layers LoRAModelManager builds, on the meta device: no memory),
section 3's FLOPs and copies, the slots' LRU (lru_slots), the bytes a sleep releases (quant.py's formats, chapter
04's pool) are built here from nanoserve/ and must appear in the chapter word for word; the readings of the measured
tables (the speed table's ratios, the gather's added time and its straight line, the profile's shares, the sleep
table's released column) are recomputed from the tables' own cells."""

import re
from collections import OrderedDict

import torch

from nanoserve.engine.config import LoRAConfig
from nanoserve.kv.paged_attention import num_blocks_for_budget
from nanoserve.kv.rates import LineFit
from nanoserve.lora.adapter import module_shapes
from nanoserve.lora.manager import LoRAModelManager, lru_slots
from nanoserve.memory import kv_bytes_per_token, parameter_counts, weight_bytes
from nanoserve.model import Llama, LlamaConfig
from nanoserve.model import quant
from tests.chapter_text import chapter, command_defaults, notebook_output, says, table_rows

CH = "19"
SMOL = LlamaConfig()
L = SMOL.num_hidden_layers
MiB = 2 ** 20
BASE = weight_bytes(SMOL, "fp32")  # the model's own float32 weights
TOTAL = parameter_counts(SMOL)["total"]  # the decoder's weights and the LM head (tied: the embedding), the norms


def slots(max_loras: int, rank: int) -> LoRAModelManager:
    """The LoRA layers of SmolLM2 as the engine builds them, on the meta device (shapes and bytes, no memory)."""
    with torch.device("meta"):
        return LoRAModelManager(Llama(SMOL), LoRAConfig(max_loras=max_loras, max_lora_rank=rank))


def per_layer_widths(manager: LoRAModelManager, rank: int) -> dict[str, int]:
    """S·in + out of each LoRA layer of decoder layer 0, read from its slots' shapes."""
    widths = {}
    for name, layer in manager.layers.items():
        if name.startswith("layers.0."):
            (_, s_r, n_in), (_, n_out, r) = layer.lora_a.shape, layer.lora_b.shape
            assert r == rank
            widths[name.split(".")[-1]] = s_r // rank * n_in + n_out
    return widths


def adapter_numbers(rank: int) -> int:
    """One adapter on all seven projections: r·(in + out) per projection, every layer."""
    return sum(rank * (i + o) for i, o in module_shapes(SMOL).values()) * L


def test_one_adapters_numbers_and_bytes():
    shapes = module_shapes(SMOL)
    rows = table_rows(CH, r"(q|k|v|o|gate|up|down)_proj.*")
    assert len(rows) == 4
    for names, in_out, a, b, numbers in rows:
        for name in names.split(", "):
            i, o = shapes[name]
            assert [in_out, a, b, numbers] == [f"({i}, {o})", f"(8, {i})", f"({o}, 8)", f"{8 * (i + o):,}"], name
    assert {n for r in rows for n in r[0].split(", ")} == set(shapes)
    mib = {r: adapter_numbers(r) * 4 / MiB for r in (8, 16, 64)}
    share = {r: adapter_numbers(r) * 4 / BASE * 100 for r in (8, 64)}
    says(CH, f"That is {adapter_numbers(8) // L:,} numbers per layer and {adapter_numbers(8) / 1e6:.2f} M for the {L} "
             f"layers: {mib[8]:.1f} MiB in float32, {share[8]:.1f} % of the base model. At\nr = 16 it is {mib[16]:.1f} "
             f"MiB, at r = 64 {mib[64]:.1f} MiB ({share[64]:.1f} %).")
    hundred = 100 * adapter_numbers(8) * 4
    assert hundred < 2 * BASE  # "fit in the memory of two float32 copies of the model"
    says(CH, f"a hundred fine-tunes of SmolLM2 as adapters\n({round(hundred / MiB, -1):.0f} MiB) fit in the memory of "
             f"two float32 copies of the model; at r = 64 a hundred take {100 * adapter_numbers(64) * 4 / 2**30:.1f} GiB")


def test_the_gathers_flops_and_copies():
    manager = slots(4, 16)
    widths = per_layer_widths(manager, 16)
    width = sum(widths.values())
    assert width * 16 * L == adapter_numbers(16)  # the same sum as section 1's r·(in + out)
    proj = 2 * sum(i * o for i, o in module_shapes(SMOL).values()) * L  # the projections' FLOPs per token
    head = 2 * SMOL.vocab_size * SMOL.hidden_size
    flops = 2 * 16 * width * L
    says(CH, f"S·in + out sums to {width:,} over a layer's\nfour projections, so R = 16 adds 2·16·{width:,}·{L} ≈ "
             f"{flops / 1e6:.1f} MFLOP per token to the projections' {proj / 1e6:.0f} MFLOP: {flops / proj:.1%} "
             f"({flops / (proj + head):.1%}\ncounting the {head / 1e6:.0f} MFLOP of the LM head)".replace("%", " %"))
    qkv = manager.layers["layers.0.self_attn.qkv_proj"]
    n_in, n_out = qkv.lora_a.shape[2], qkv.lora_b.shape[1]
    w = widths["qkv_proj"]
    says(CH, f"For `qkv_proj` (in {n_in}, out {n_out}: S·in + out = {w:,}, in·out = {n_in * n_out:,}) at N = 16 tokens")
    says(CH, f"=  16·R·{w:,} / {n_in * n_out:,}\n=  " + ",   ".join(f"{16 * r * w / (n_in * n_out):.2f} at R = {r}"
                                                                  for r in (8, 16, 64)))
    whole = [16 * r * width * L / TOTAL for r in (8, 16, 64)]
    says(CH, f"16·R·{width:,} numbers copied per layer, {L} layers, against the {TOTAL / 1e6:.1f} M numbers of the "
             f"decoder's\nweights and the LM head that a merged model's step reads — that is {whole[0]:.2f}, "
             f"{whole[1]:.2f} and {whole[2]:.2f}")


def test_the_slots_and_their_lru():
    defaults = LoRAConfig()
    manager = slots(defaults.max_loras, defaults.max_lora_rank)
    per_slot = defaults.max_lora_rank * sum(per_layer_widths(manager, defaults.max_lora_rank).values()) * L * 4
    assert manager.slot_bytes() == (defaults.max_loras + 1) * per_slot  # the docstring's formula
    says(CH, f"with `max_loras = {defaults.max_loras}` and `max_lora_rank = {defaults.max_lora_rank}` the slots take "
             f"{manager.slot_bytes() / MiB:.1f} MiB (notebook)")
    assert f"slots of {manager.slot_bytes() / MiB:.1f} MiB" in notebook_output(CH)
    table, lines = OrderedDict(), []
    for step in ({"a"}, {"a", "b"}, {"b", "c"}):
        before = dict(table)
        new = lru_slots(table, step, 2)
        (name, slot), = new.items()
        evicted = [n for n in before if n not in table]
        what = f"{name} evicts {evicted[0]} (LRU, not needed)" if evicted else f"slot {slot} <- {name}"
        lines.append(f"{{{', '.join(sorted(step))}}} {what} {', '.join(table)}")
    says(CH, "max_loras = 2; steps asking {a}, {a, b}, {b, c}: " + " ".join(lines).replace(
        "slot 1 <- a a", "slot 1 <- a slots (LRU first): a"))


def test_the_measured_speed_load_and_memory():
    rows = {int(r[0].split()[1]): r[1:] for r in table_rows(CH, r"rank \d+") if len(r) == 6}
    assert list(rows) == [8, 16, 64]
    speed = {}
    for rank, (merged, *cells) in rows.items():
        merged = float(merged)
        rates = [float(c.split()[0]) for c in cells]
        assert cells == [f"{x} ({x / merged:.2f}×)" for x in rates], rank
        assert max(rates) / min(rates) < 1.03, rank  # "1 to 8 adapters run at one speed within the noise"
        speed[rank] = merged, rates[0]
    tokens, steps = 16 * 64, 64  # 16 requests x 64 new tokens, one prefill and 63 decode steps
    per_step = tokens // steps
    merged_ms = {r: per_step / m * 1e3 for r, (m, _) in speed.items()}
    added = {r: per_step / a * 1e3 - merged_ms[r] for r, (_, a) in speed.items()}
    says(CH, f"Over a merged step of about {round(sum(merged_ms.values()) / 3, -1):.0f} ms, the gather adds "
             f"{added[8]:.0f}, {added[16]:.0f} and {added[64]:.0f} ms at ranks 8, 16 and 64\n(from the rates: "
             f"{tokens:,} tokens in {steps} steps): " + ", ".join(f"{added[r] / merged_ms[r]:.2f}" for r in (8, 16))
         + f" and {added[64] / merged_ms[64]:.2f} of the step")
    line = LineFit()
    for r, ms in added.items():
        line.add(r, ms)
    intercept, slope = line.fit()
    lora_layers = len(slots(1, 8).layers)
    says(CH, f"gives {slope:.1f} ms per unit of rank plus {intercept:.1f} ms that does not depend on it: the gathers' "
             f"small calls, several per LoRA\nlayer and {lora_layers} LoRA layers")
    width = adapter_numbers(1) // L
    flops = [r * width * L / TOTAL * 100 for r in (8, 16, 64)]  # the gather's FLOPs over a merged step's
    copies = {r: 16 * r * width * L / TOTAL for r in (8, 16, 64)}
    says(CH, f"the FLOPs predict {flops[0]:.1f}, {flops[1]:.1f} and {flops[2]:.1f} % of the step; the numbers copied "
             f"predict {copies[8]:.2f}, {copies[16]:.2f}\nand {copies[64]:.2f}")
    times = {r: added[r] / merged_ms[r] / copies[r] for r in copies}
    says(CH, f"the measured cost {min(times.values()):.1f}–{max(times.values()):.1f} times the copies' share "
             f"({times[64]:.2f} at rank 64)")

    load = {int(r[0]): r[1:] for r in table_rows(CH, r"8|16|64") if len(r) == 4}
    assert list(load) == [8, 16, 64]
    for rank, (memory, disk, slot) in load.items():
        assert memory == f"{adapter_numbers(rank) * 4 / MiB:.2f} MiB", rank
    disk = {r: float(c[1].split()[0]) for r, c in load.items()}
    says(CH, f"({disk[8]:.2f} to {disk[64]:.2f} ms for {adapter_numbers(64) // adapter_numbers(8)} times the bytes")
    assert abs(float(load[64][2].split()[0]) / disk[64] - 1) < 0.05  # "at rank 64 the two cost the same"

    per_slot = {r: slots(1, r).slot_bytes() // 2 for r in (8, 16, 64)}
    assert all(per_slot[r] == r * width * L * 4 for r in per_slot)  # R·(S·in + out) floats per layer, per slot
    table = {int(r[0].split()[1]): r[1:] for r in table_rows(CH, r"`max_loras` \d") if len(r) == 4}
    assert list(table) == [1, 2, 4, 8]
    for m, cells in table.items():
        assert cells == [f"{(m + 1) * per_slot[r] / MiB:.2f} MiB" for r in (8, 16, 64)], m
    assert 9 * per_slot[64] > BASE
    says(CH, f"the slots of `max_loras` 8 at rank 64 take {9 * per_slot[64] / MiB:.2f} MiB,\nmore than the "
             f"{BASE / MiB:.2f} MiB of the model's own float32 weights")

    profile = {m[0]: [int(x) for x in m[1:]] for m in re.findall(
        r"(decode B=1|decode B=16|prefill B=16|prefill B=1) +[\d.]+ +(\d+)% +(\d+)% +(\d+)% +(\d+)% +(\d+)% +(\d+)% +(\d+)%",
        chapter(CH))}
    assert len(profile) == 4 and all(abs(sum(p) - 100) <= 3 for p in profile.values())  # 7 shares, each rounded
    lora = {step: p[4] for step, p in profile.items()}  # the LoRA column
    says(CH, f"At one sequence the gathers take {lora['decode B=1']} % of a\ndecode step; at 16 they take "
             f"{lora['decode B=16']} %, nearly half, where `bench lora` above put rank 16 at "
             f"{rows[16][1].split()[1].strip('()')} a merged model")
    assert all(round(lora[s], -1) == 10 for s in ("prefill B=1", "prefill B=16"))  # "is a tenth"


def released_bytes(large_step_bytes: int) -> dict[str, int]:
    """What a default `serve` (q4 weights, a bf16 pool) releases asleep, by chapter 10's formats (quant.py)."""
    c = SMOL
    decoder = sum(i * o for i, o in module_shapes(c).values()) * L  # the decoder's Linear weights
    bf16 = torch.finfo(torch.bfloat16).bits // 8
    per_weight = {"blocks": quant.Q4_1_BLOCK_BYTES / quant.Q4_GROUP_SIZE, "int4": 4 / 8,
                  "scales": 2 * bf16 / quant.Q4_GROUP_SIZE, "large step": large_step_bytes}
    embedding = c.vocab_size * c.hidden_size  # int8, one bf16 scale per row, shared with the LM head
    norms = (2 * L + 1) * c.hidden_size * 4
    return {"per weight": sum(per_weight.values()), "decoder": int(decoder * sum(per_weight.values())),
            "embedding": embedding, "scales": c.vocab_size * bf16, "head": embedding * large_step_bytes,
            "norms": norms, "per_weight_parts": per_weight}


def test_the_bytes_a_sleep_releases():
    assert quant.LARGE_STEP_DTYPE in (torch.bfloat16, torch.float32)
    bf16, f32 = released_bytes(2), released_bytes(4)
    decoder = sum(i * o for i, o in module_shapes(SMOL).values()) * L
    parts = bf16["per_weight_parts"]
    says(CH, f"SmolLM2 has {TOTAL:,} weights, {BASE:,} bytes in\nfloat32")
    says(CH, f"the file's blocks ({quant.Q4_1_BLOCK_BYTES} bytes per {quant.Q4_GROUP_SIZE} weights:\n"
             f"{parts['blocks']:g}), the packed int4 copy ({parts['int4']:g}), the bf16 scales and zeros "
             f"({parts['scales']:g})")
    says(CH, f"So the {decoder:,} decoder weights take {bf16['per weight']:g} or {f32['per weight']:g} bytes each, "
             f"{bf16['decoder']:,} or {f32['decoder']:,} bytes")
    totals = {}
    for name, b in (("bf16", bf16), ("fp32", f32)):
        totals[name] = sum(b[k] for k in ("decoder", "embedding", "scales", "head", "norms"))
    says(CH, f"the int8 embedding shared with the LM head ({bf16['embedding']:,} plus {bf16['scales']:,} of scales), "
             f"the LM head's copy ({bf16['head']:,}\nin bf16, {f32['head']:,} in float32) and the float32 norms "
             f"({bf16['norms']:,}): {totals['bf16']:,} or {totals['fp32']:,} bytes in all")
    from nanoserve.cli import serve

    mib = command_defaults(serve, "serve").kv_cache_mib
    per_token = kv_bytes_per_token(SMOL, "fp32")
    blocks = num_blocks_for_budget(SMOL, mib * MiB, 16)
    pool = blocks * 16 * per_token
    assert num_blocks_for_budget(SMOL, mib * MiB, 16, torch.bfloat16) == 2 * blocks
    says(CH, f"The default pool is {mib // 1024} GiB: {per_token:,} bytes per token in float32\n(chapter 04), "
             f"{16 * per_token:,} per block of 16, so {blocks:,} blocks of {pool:,} bytes; the bf16 pool that q4 is "
             f"served with holds {2 * blocks:,} blocks in the same bytes")
    says(CH, f"A default `serve` asleep gives back {totals['bf16'] + pool:,} bytes ({(totals['bf16'] + pool) / 2**30:.2f} "
             f"GiB) of\ntensors with bf16 copies, {totals['fp32'] + pool:,} ({(totals['fp32'] + pool) / 2**30:.2f} GiB) "
             f"with float32 ones")
    says(CH, f"On that VM q4's\nlarge-step copy is float32:\n{totals['fp32'] / MiB:.1f} MiB of weights")

    rows = [r for r in table_rows(CH, "fp32|q4") if len(r) == 5]
    assert [(r[0], r[1]) for r in rows] == [("fp32", "1"), ("fp32", "2"), ("q4", "1"), ("q4", "2")]
    weights = {"fp32": BASE, "q4": totals["fp32"]}  # the machine measured has no bf16 instructions
    for name, level, drop, released, wake in rows:
        assert released == f"{weights[name] / MiB:.1f} + {pool / MiB:,.1f} MiB", (name, level)
        assert abs(float(drop.split()[0].replace(",", "")) * MiB / (weights[name] + pool) - 1) < 0.01, (name, level)
    wakes = {(r[0], r[1]): float(r[4].split()[0]) for r in rows}
    level1 = [wakes[w, "1"] for w in ("fp32", "q4")]
    says(CH, f"level 1 wakes in {min(level1):.1f}–{max(level1):.1f} s")
    level2 = [wakes[w, "2"] for w in ("fp32", "q4")]
    says(CH, f"level 2 in {min(level2):.1f}–{max(level2):.1f} s")
