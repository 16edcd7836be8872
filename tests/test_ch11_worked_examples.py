"""Chapter 11's worked examples, computed by the code: the column/row split of a 2 × 4 matrix (RowParallelLinear's
shards), the heads per rank (split_heads), the KV bytes and blocks per rank, the integers a step broadcasts
(pack_step), the all-reduces of a decode step (counted on a shard of `bench tp`'s model in one process), the GPU cost
model's table (cost_model.tp_decode_step) and the pipeline bubble are built here from nanoserve/ and must appear in
the chapter word for word. The ratios drawn from the measured table are recomputed from it, and the figures the
chapter quotes from the notebook must be what the committed notebook printed."""

import re
from types import SimpleNamespace

import pytest
import torch

from nanoserve.bench.tp import smollm2_sized
from nanoserve.distributed.cost_model import H100_NVLINK, H100_PCIE, tp_decode_step
from nanoserve.distributed.linear import RowParallelLinear
from nanoserve.distributed.parallel_state import HEADER_LEN, TPGroup, pack_step
from nanoserve.distributed.shard import shard_llama, split_heads
from nanoserve.kv.paged_attention import AttentionMetadata
from nanoserve.memory import kv_bytes_per_token, parameter_counts
from nanoserve.model import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS
from tests.chapter_text import chapter, notebook_output, says, table_rows

CH = "11"
SMOL = LlamaConfig()


class CountingGroup(TPGroup):
    """Rank `rank` of a group of `size` in one process: each all-reduce is counted (and is the identity)."""

    def all_reduce(self, x):
        self.num_all_reduces += 1
        self.all_reduce_bytes += x.numel() * x.element_size()
        return x


def test_tp_makes_the_70b_fit():
    big = parameter_counts(KNOWN_CONFIGS["llama-3-70b"])["total"] * 2
    says(CH, f"Llama-3-70B\n({big / 1e9:.0f} GB in bf16) fits on two 80 GB GPUs")
    assert big < 2 * 80e9


def test_the_row_parallel_worked_example():
    W, x = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]), torch.ones(4)
    partials = []
    for r in range(2):
        layer = RowParallelLinear(4, 2, CountingGroup(r, 2))
        cols = slice(layer.shard_offset, layer.shard_offset + layer.shard_size)
        partials.append(x[cols] @ W[:, cols].T)
    total = partials[0] + partials[1]
    assert torch.equal(total, W @ x)
    fmt = lambda t: "[" + ", ".join(f"{v:.0f}" for v in t.tolist()) + "]"  # noqa: E731
    says(CH, f"x_0 · W_0ᵀ = {fmt(partials[0])}")
    says(CH, f"x_1 · W_1ᵀ = {fmt(partials[1])} sum {fmt(total)} = x · Wᵀ")
    says(CH, f"gate, up: column-parallel ({SMOL.intermediate_size}/n features each)")


def test_gathering_logits():
    """What rank 0 receives per sampled token: the other ranks' slices of the logits row, or their (max, argmax)."""
    V = SMOL.vocab_size
    row = V * 4
    says(CH, f"rank 0 receives (n − 1)/n of the {V} × 4 = {row:,} B row: {row // 2:,} B at TP 2, {row * 2 // 3:,} B\n"
             f"at TP 3")
    pair = 2 * torch.tensor([0.5, 2.0]).argmax().element_size()  # the max and the index in one int64 tensor
    says(CH, f"(max, argmax) instead, as one tensor of two {pair // 2}-byte values (a collective sends one dtype, and "
             f"torch's argmax gives an int64), {pair} bytes, and rank 0 would receive (n − 1) · {pair} B: {2 * pair} B "
             f"at TP 3")
    llama = KNOWN_CONFIGS["llama-3-8b"]
    whole = 64 * llama.vocab_size * 2
    says(CH, f"for Llama-3 at\nB = 64 and TP 8, {whole * 7 / 8 / 1e6:.1f} MB of the 64 × {llama.vocab_size:,} × 2 = "
             f"{whole / 1e6:.1f} MB")


def test_the_notebooks_partial_sums():
    out = notebook_output(CH)
    alone = float(re.search(r"partial 0 alone vs whole, max \|diff\|: ([\d.]+)", out)[1])
    summed = float(re.search(r"partial 0 \+ partial 1 vs whole, max \|diff\|: ([\d.e-]+)", out)[1])
    says(CH, f"differs from\nthe whole MLP's output by up to {alone:.0f} — it is half of a sum — and the two added "
             f"together match it to {summed:.0e}".replace("e-0", "e-"))


def test_where_the_kv_heads_go():
    H, Hkv = SMOL.num_attention_heads, SMOL.num_key_value_heads
    says(CH, f"| | SmolLM2 ({H} query / {Hkv} KV heads) | per rank |")
    s3, s9 = split_heads(SMOL, 3), split_heads(SMOL, 9)
    says(CH, f"| TP 3 | {s3.num_heads} query heads, {s3.num_kv_heads} KV head |")
    says(CH, f"| TP 9 | {s9.num_heads} query head, {s9.num_kv_heads} KV head ({9 // Hkv} copies of each) |")
    with pytest.raises(ValueError) as refused:
        split_heads(SMOL, 2)
    says(CH, f"`ValueError: {str(refused.value).split(':')[0]}`")
    # the uneven case: 6 query heads over 3 KV heads (G = 2) at TP 2
    G = 6 // 3
    rank0, rank1 = sorted({h // G for h in range(0, 3)}), sorted({h // G for h in range(3, 6)})
    says(CH, f"rank 0 would hold query heads\n0–2, reading KV heads {rank0[0]} and {rank0[1]}, and rank 1 heads 3–5, "
             f"reading KV heads {rank1[0]} and {rank1[1]}")
    assert set(rank0) & set(rank1) == {1}  # "KV head 1 is computed and cached twice"


def test_the_memory_math_per_rank():
    s3 = split_heads(SMOL, 3)
    per_rank = 2 * SMOL.num_hidden_layers * s3.num_kv_heads * SMOL.head_dim * 4
    whole = kv_bytes_per_token(SMOL, "fp32")
    says(CH, f"SmolLM2 fp32, TP 3: 2 · {SMOL.num_hidden_layers} · {s3.num_kv_heads} · {SMOL.head_dim} · 4 = {per_rank:,} B "
             f"(TP 1: {whole:,} B)")
    says(CH, f"1 GiB is {2**30 // (whole * 16)} blocks of 16 tokens at TP 1\nand {2**30 // (per_rank * 16)} at TP 3")
    out = notebook_output(CH)
    shard = float(re.search(r"rank 0's shard: \(\d+, \d+\) qkv, ([\d.]+) MiB", out)[1])
    whole_mib = parameter_counts(SMOL)["total"] * 4 / 2**20
    assert f"whole model: {whole_mib:.1f} MiB in fp32" in out
    says(CH, f"every rank of SmolLM2 at TP 3 holds {shard:.0f} MiB of fp32 weights instead of {whole_mib:.0f} MiB")
    norms = (2 * SMOL.num_hidden_layers + 1) * SMOL.hidden_size
    says(CH, f"the norms, {norms / parameter_counts(SMOL)['total']:.2%} of the weights, are replicated".replace("%", " %"))


def step_batch(tables, seq_lens, q_lens, sampled):
    """What the model runner hands pack_step: the flat batch's integers (values do not matter, only counts)."""
    n = sum(q_lens)
    return SimpleNamespace(attn_metadata=AttentionMetadata.build(tables, seq_lens, q_lens, 16), input_ids=torch.zeros(n, dtype=torch.long),
                           positions=torch.zeros(n, dtype=torch.long), logits_indices=torch.zeros(sampled, dtype=torch.long))


def test_the_step_broadcast():
    says(CH, f"the step\ntravels as one header of {HEADER_LEN} integers and one flat int64 tensor")
    out = notebook_output(CH)
    prefill = pack_step(step_batch([[0, 1, 2]], [37], [37], 1))[1].numel()
    decode = pack_step(step_batch([[0, 1, 2]], [38], [1], 1))[1].numel()
    assert f"STEP: 37 tokens, 1 seqs, tables 3 wide, 1 sampled -> {prefill} integers = {prefill * 8} bytes" in out
    assert f"STEP: 1 tokens, 1 seqs, tables 3 wide, 1 sampled -> {decode} integers = {decode * 8} bytes" in out
    says(CH, f"a 37-token chat prompt's prefill is a payload of {prefill} integers ({prefill * 8} bytes), each decode "
             f"step of it\n{decode} integers ({decode * 8} bytes), each after an {HEADER_LEN}-integer header "
             f"({HEADER_LEN * 8} bytes)")
    blocks = 4
    eight = pack_step(step_batch([list(range(blocks))] * 8, [50] * 8, [1] * 8, 8))[1].numel()
    assert eight == 8 * 3 + 8 * blocks + 8 + 9 + 8
    says(CH, "a decode step of 8 sequences is 8·3 + 8·blocks + 8 + 9 + 8 integers")


def test_the_all_reduces_of_a_decode_step():
    config = smollm2_sized()
    says(CH, f"a SmolLM2-sized model (random weights, {config.num_attention_heads} query /\n{config.num_key_value_heads} "
             f"KV heads")
    group = CountingGroup(0, 2)
    model = shard_llama(config, group)
    with torch.inference_mode():
        model(torch.arange(8), torch.arange(8))  # 8 sequences' tokens, as one decode step
    n, total = group.num_all_reduces, group.all_reduce_bytes
    one = config.hidden_size * 4
    says(CH, f"Every TP > 1 step does {n} all-reduces (2 per layer + the embedding): two fp32 hidden vectors per layer "
             f"and token,\n2 × {config.hidden_size} × 4 = {2 * one:,} B, and 8 tokens × {n} × {one:,} B = {total:,} B per "
             f"step")
    says(CH, f"the data per call are small,\n8 × {one:,} = {8 * one:,} B")
    rows = table_rows(CH, "[ABC]")  # three runs: TP, step, time / TP 1, all_reduce, share
    assert [(r[0], r[1]) for r in rows] == [(run, tp) for run in "ABC" for tp in "123"]
    for run in "ABC":
        ms = {r[1]: r for r in rows if r[0] == run}
        base = float(ms["1"][2].split()[0])
        for tp in ("2", "3"):
            step, waiting = float(ms[tp][2].split()[0]), float(ms[tp][4].split()[0])
            assert ms[tp][3] == f"{step / base:.2f}" and ms[tp][5] == f"{waiting / step:.0%}".replace("%", " %"), (run, tp)
    out = notebook_output(CH)
    tokens = 3 + 1  # the notebook's 3-token prefill and one decode
    assert f"2 steps (a 3-token prefill, a decode): {2 * n} all-reduces" in out and f"{tokens * n * one:,} bytes" in out


def test_the_gpu_cost_model_table():
    rows, model = [], None
    for row in table_rows(CH, r"Llama-3-8B|Llama-3-70B|"):
        if len(row) == 7 and row[2].isdigit():
            model = row[0] or model
            rows.append((model, *row[1:]))
    assert len(rows) == 12
    for name, b, tp, read, nvlink, pcie, fits in rows:
        config = KNOWN_CONFIGS[name.lower()]
        nv, pc = (tp_decode_step(config, int(tp), int(b), 4096, hw) for hw in (H100_NVLINK, H100_PCIE))
        assert read == f"{nv.weight_bytes / 1e9:.1f} GB", (name, b, tp)
        digits = len(nvlink.strip("()").split()[0].split(".")[1])
        shown = f"{nv.step_s * 1e3:.{digits}f} ms"
        if nv.fits:
            assert (nvlink, pcie, fits) == (shown, f"{pc.step_s * 1e3:.{digits}f} ms", "yes"), (name, b, tp)
        else:
            assert nvlink == f"({shown})" and pcie == "—" and fits.startswith("**no**"), (name, b, tp)
            if "KV" in fits:
                assert fits == f"**no** (KV: {nv.kv_bytes * int(tp) / min(int(tp), config.num_key_value_heads) / 1e9:.0f} GB)"
    small = KNOWN_CONFIGS["llama-3-8b"]
    message = 64 * small.hidden_size * 2
    says(CH, f"(Llama-3-8B at B = 64: 64 × {small.hidden_size} × 2 = {message // 1024} KiB per all-reduce) — it is the "
             f"**latency**, paid 2 L = {2 * small.num_hidden_layers} times\nper step")
    steps = {hw.name: {tp: tp_decode_step(small, tp, 1, 4096, hw).step_s for tp in (1, 2, 4, 8)} for hw in (H100_NVLINK, H100_PCIE)}
    best_nv, best_pc = (min(s, key=s.get) for s in steps.values())
    nv = steps[H100_NVLINK.name]
    says(CH, f"For the 8B at batch 1, TP pays up to {best_nv} GPUs on NVLink ({nv[1] * 1e3:.1f} → {nv[best_nv] * 1e3:.1f} ms) "
             f"and only to {best_pc} on\nPCIe")
    big = KNOWN_CONFIGS["llama-3-70b"]
    fit = {b: min(tp for tp in (1, 2, 4, 8) if tp_decode_step(big, tp, b, 4096, H100_NVLINK).fits) for b in (1, 64)}
    says(CH, f"({fit[1]} GPUs at batch 1, {fit[64]} at\nbatch 64 with 4096-token contexts)")


def test_the_pipeline_bubble():
    bubble = lambda p, m: (p - 1) / (m + p - 1)  # noqa: E731
    says(CH, f"p = 4 stages, m = 1 micro-batch: {bubble(4, 1):.0%} idle; m = 12: {bubble(4, 12):.0%}".replace("%", " %"))
    assert "(p − 1) / (m + p − 1)" in chapter(CH)
