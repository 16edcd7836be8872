"""Chapter 10's worked examples, computed by the code: the bytes each format reads per token (memory.weight_bytes),
the memory plan with smaller weights, the int8 example row (quantize_int8), the Q4_1 block arithmetic, the
embedding's and layers' bytes, the crossover constants, the held-out text's length and the benchmarks' defaults are
built here from nanoserve/ and must appear in the chapter word for word. The ratios the chapter draws from its timed
tables are recomputed from those tables (within what their printed rounding allows), and the figures it quotes from
the notebook (the per-layer errors, the memory held, the held-out pass on a CPU without AMX) must be what the
committed notebook printed."""

import re

import torch

from nanoserve.bench import degrade, quality
from nanoserve.cli import main
from nanoserve.memory import GiB, format_bytes, memory_plan, parameter_counts, weight_bytes
from nanoserve.model import LlamaConfig
from nanoserve.model.known_configs import KNOWN_CONFIGS
from nanoserve.model.quant import KERNEL_CROSSOVER_TOKENS, QUANT_MAX_TOKENS, quantize_int8
from tests.chapter_text import chapter, command_defaults, notebook_output, says, table_rows

CH = "10"
SMOL = LlamaConfig()
MB = 1e6


def number(cell: str) -> float:
    """'**10.6 (3.0×)**', '24.8 tok/s (40.3 ms)', '1,287' -> the first number."""
    return float(re.search(r"[\d,]+\.?\d*", cell)[0].replace(",", ""))


def ratio_in_cell(cell: str) -> float:
    """'17.4 (1.8×)' -> 1.8."""
    return float(re.search(r"\(([\d.]+)×", cell)[1])


def rounds_to(quoted: float, a: float, b: float, digits: int, shown: int = 1) -> bool:
    """quoted (printed with `digits` decimals) is a / b for some a, b that print (with `shown` decimals) as given."""
    e = 0.5 * 10 ** -shown
    return (a - e) / (b + e) - 0.5 * 10 ** -digits <= quoted <= (a + e) / (b - e) + 0.5 * 10 ** -digits


def linear_weights(config) -> int:
    """The decoder's Linear weights (the norms left out)."""
    return parameter_counts(config)["all_layers"] - 2 * config.hidden_size * config.num_hidden_layers


def test_decode_reads_bytes():
    fp32 = weight_bytes(SMOL, "fp32")
    says(CH, f"SmolLM2-135M in float32 is **{fp32 / MB:.0f} MB per token**: at a memory bandwidth of B GB/s the roofline\n"
             f"is B / {fp32 / 1e9:.3f} tokens/s")
    bandwidth = float(re.search(r"read bandwidth ([\d.]+) GB/s", chapter("09"))[1])  # chapter 09's profile run
    says(CH, f"measured one core's read bandwidth at {bandwidth} GB/s on the AMX machine, shared at load 6–12 (chapter 09,\n"
             f"section 4), a roofline of ~{bandwidth / (fp32 / 1e9):.0f} tok/s")
    says("09", "One run, 2026-12-01, on the AMX machine (section 4) at load 6–12")  # the run that measured it
    n = parameter_counts(SMOL)["total"]
    rows = {r[0]: r for r in table_rows(CH, "fp32|int8|q4") if len(r) == 4 and "MB" in r[2]}
    assert len(rows) == 3
    for fmt, (_, per_weight, reads, _) in rows.items():
        assert per_weight.split(" (")[0] == f"{weight_bytes(SMOL, fmt) / n:.3f}", fmt
        assert reads == f"{weight_bytes(SMOL, fmt) / MB:.1f} MB", fmt
    layers = linear_weights(SMOL) * (0.5 + 4 / 32) / linear_weights(SMOL)
    says(CH, f"| q4 | {weight_bytes(SMOL, 'q4') / n:.3f} (layers {layers:.3f}, LM head int8) |")


def test_the_memory_plan_with_smaller_weights(capsys):
    assert main(["memory", "--model", "llama-3-8b", "--device-gb", "24", "--seq-len", "4096", "--weights", "int8", "q4"]) == 0
    out = capsys.readouterr().out
    bf16 = (re.search(r"− weights \(bf16\) +[\d,]+ B +([\d.]+ GiB)", out)[1], re.search(
        r"= left for the KV cache +[\d,]+ B +([\d.]+ GiB)", out)[1], re.search(r"concurrent sequences of 4096 tokens: (\d+)", out)[1])
    assert table_rows(CH, "bf16")[0][1:] == list(bf16)
    for fmt in ("int8", "q4"):
        weights, left, seqs, more = re.search(rf"^  {fmt} +([\d.]+ GiB) +([\d.]+ GiB) +(\d+) +\+(\d+)", out, re.M).groups()
        (row,) = [r for r in table_rows(CH, fmt) if len(r) == 4 and "GiB" in r[1]]
        assert row[1:] == [weights, left, f"{seqs} (+{more})"], fmt


def test_what_llm_holds_beside_the_plan():
    """The Llama-3-8B rows as LLM would hold them: the bf16 large-step copy of every quantized matrix (the decoder's
    and the untied LM head; the embedding is a lookup and keeps none), and for q4 the file's blocks (0.625 B per
    decoder weight) beside the kernel's integers; the KV budget is the `memory` plan's with those bytes added."""
    config = KNOWN_CONFIGS["llama-3-8b"]
    decoder, head = linear_weights(config), config.vocab_size * config.hidden_size
    copy, blocks = 2 * (decoder + head), decoder * (0.5 + 4 / 32)
    says(CH, f"({decoder:,} + {head:,}) × 2 B = {format_bytes(copy)}")
    says(CH, f"0.625 bytes per weight more, {format_bytes(blocks)}")
    # the untied embedding table inside memory.weight_bytes: held, a row of it read per token
    assert not config.tie_word_embeddings
    says(CH, f"{format_bytes(2 * head)} of the bf16 row, {format_bytes(head + 2 * config.vocab_size)} of the int8 and q4 rows")
    plan = memory_plan(config, 24 * GiB, 4096)
    as_held = {"int8 + the bf16 copy (`LLM`'s default)": weight_bytes(config, "int8") + copy,
            "q4 + the file's blocks + the bf16 copy (`LLM`'s default)": weight_bytes(config, "q4") + blocks + copy,
            'int8, `large_step_weights="dequantize"`': weight_bytes(config, "int8"),
            'q4 + the file\'s blocks, `large_step_weights="dequantize"`': weight_bytes(config, "q4") + blocks}
    for name, nbytes in as_held.items():
        left = plan.kv_budget + plan.weights - nbytes
        (row,) = table_rows(CH, re.escape(name))
        assert row[1:] == [format_bytes(nbytes), format_bytes(left).replace("-", "−"),
                           str(max(0, int(left // plan.kv_per_sequence)))], name
    printed = {w: re.search(rf"{w}: held ([\d.]+) MB \+ the large-step copy \(torch.bfloat16\) ([\d.]+) MB = "
                            rf"([\d.]+) MB", notebook_output(CH)).groups() for w in ("int8", "q4")}
    copy_smol = 2 * (linear_weights(SMOL) + SMOL.vocab_size * SMOL.hidden_size)  # tied: the head's copy is made once
    assert printed["int8"][1] == printed["q4"][1] == f"{copy_smol / MB:.1f}"
    held, with_copy = printed["q4"][0], printed["q4"][2]
    says(CH, f"q4 reads {weight_bytes(SMOL, 'q4') / MB:.1f} MB per decode step and holds {held} MB, {with_copy} MB with "
             f"`LLM`'s bf16 copy")
    says(CH, f"SmolLM2\n+{copy_smol / MB:.1f} MB beside the {held} MB q4 holds — {with_copy} MB, "
             f"{float(with_copy) / (weight_bytes(SMOL, 'bf16') / MB):.1f}× the bf16 format's {weight_bytes(SMOL, 'bf16') / MB:.0f} MB "
             f"though less than float32's\n{weight_bytes(SMOL, 'fp32') / MB:.0f} MB")
    says(CH, f"for SmolLM2 {held} MB more (`bench weights`' \"held in memory\"")  # the degraded q4 copy, section 7


def test_int8_per_row():
    q, s = quantize_int8(torch.tensor([[0.5, -1.27, 0.01]]))
    says(CH, f"the row `[0.5, −1.27, 0.01]` gets `s = 1.27 / 127 = {1.27 / 127:g}`,\n`{s.item()}` in bf16, and "
             f"`q = [{', '.join(str(v).replace('-', '−') for v in q[0].tolist())}]`")
    assert s.dtype == torch.bfloat16
    out, inp = SMOL.intermediate_size, SMOL.hidden_size
    says(CH, f"(`{out} × {inp}` → {out * inp:,} + {out * 2:,} bytes)")


def test_q4_1_blocks_and_the_tied_head():
    says(CH, f"→ {20 * 8} bits / 32 = {20 * 8 // 32} bits per weight")
    says(CH, f"the price is {2 + 2} bytes of `d, m` per 32 weights ({4 * 8 // 32} bit per weight)")
    head = SMOL.vocab_size * SMOL.hidden_size
    says(CH, f"re-quantizes it per row (int8, {(head + 2 * SMOL.vocab_size) / MB:.0f} MB)")
    q4_layers = linear_weights(SMOL) * (0.5 + 4 / 32)
    says(CH, f"at {head * 4 / MB:.0f} MB it would be read per decoded token **more bytes than all {SMOL.num_hidden_layers} "
             f"q4 layers\ntogether** ({q4_layers / MB:.0f} MB)")
    int8_head = head + 2 * SMOL.vocab_size
    says(CH, f"it\nwould add {(head * 4 - int8_head) / MB:.0f} MB to every decoded token's {weight_bytes(SMOL, 'q4') / MB:.0f}")
    says(CH, f"a decode step still reads only q4's {weight_bytes(SMOL, 'q4') / MB:.0f} MB")


def test_the_crossover_constants():
    says(CH, f"up to `KERNEL_CROSSOVER_TOKENS = {KERNEL_CROSSOVER_TOKENS}` tokens, on the copy beyond")
    says(CH, f"switches above `QUANT_MAX_TOKENS = {QUANT_MAX_TOKENS}` tokens")
    says(CH, f"runs a step wider than {KERNEL_CROSSOVER_TOKENS} tokens on the large-step copy")
    layers = 4 * SMOL.num_hidden_layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    says(CH, f"All {layers} Linear layers once (q/k/v and gate/up fused, the LM head included)")
    says(CH, f"the {layers}\nproducts above were {7 * SMOL.num_hidden_layers + 1} before")


def test_the_formats_table_and_its_crossover():
    both = [r for r in table_rows(CH, r"\d+") if len(r) == 6 and r[5] in ("q4", "bf16", "fp32", "q4→bf16")]
    assert len(both) == 9
    rows, avx2 = both[:5], both[5:]  # the AMX machine's table, then the AVX2 machine's (q4→fp32: its large step)
    names = ["fp32", "bf16", "q4", "q4→fp32"]
    assert [r[5] for r in avx2] == [names[min(range(4), key=lambda i: number(r[1 + i]))] for r in avx2]
    slower = [number(r[2]) / number(r[1]) for r in avx2 if int(r[0]) >= 128]
    says(CH, f"The bf16 GEMM is {min(slower):.1f}–{max(slower):.1f}× slower than float32 from 128 rows on")
    sixteen = next(r for r in avx2 if r[0] == "16")
    assert abs(number(sixteen[3]) / number(sixteen[1]) - 1) < 0.02  # "ties float32 at 16"
    names = ["fp32", "bf16", "q4", "q4→bf16"]
    fastest = [names[min(range(4), key=lambda i: number(r[1 + i]))] for r in rows]
    assert [r[5] for r in rows] == fastest
    cross = next(i for i, f in enumerate(fastest) if f != "q4")
    says(CH, f"in this run they cross between {rows[cross - 1][0]} and {rows[cross][0]} rows, and at 16 the bf16 GEMM is "
             f"ahead (by how much, a run\nat that load does not say)")  # one repeat at load ~20: the order, not the margin
    assert rows[2][0] == "16" and rows[2][5] == "bf16"  # the row the default's 16-token step falls in
    # the AVX-512 BF16 machine's table (7 columns: q4 dot added): its fastest column, and where its crossover falls
    avx512 = [r for r in table_rows(CH, r"\d+") if len(r) == 7]
    assert [r[0] for r in avx512] == ["1", "8", "16", "32", "64"]
    names = ["fp32", "bf16", "q4", "q4 dot", "q4→bf16"]
    fastest = [names[min(range(5), key=lambda i: number(r[1 + i]))] for r in avx512]
    assert [r[6] for r in avx512] == fastest
    cross = next(i for i, f in enumerate(fastest) if f != "q4")
    sixteen, after = avx512[2], avx512[cross]
    says(CH, f"There the kernel is ahead up to 16 rows — at 16 by {number(sixteen[2]) / number(sixteen[3]) - 1:.0%}".replace("%", " %"))
    says(CH, f"and the GEMM from {after[0]} (by {number(after[3]) / number(after[2]):.2f}×):\nthey cross between "
             f"{avx512[cross - 1][0]} and {after[0]} rows")
    # the dequantization over the GEMM it feeds, from the quiet best-of-3 table (the AMX one gives only the order)
    extra = [(number(r[5]) - number(r[2])) / number(r[2]) for r in avx512]
    assert extra[0] == max(extra) and extra[-1] == min(extra)  # "most at 1 row, least at 64"
    says(CH, f"Dequantizing per call costs {min(extra):.1f}–{max(extra):.1f}× the GEMM it feeds (the AVX-512 table's")


def test_the_quality_table_and_the_notebook(smollm2_tokenizer):
    args = command_defaults(quality, "quality")
    says(CH, f"{len(quality.CHAT_PROMPTS)} chat prompts × {args.max_tokens} greedy tokens through the engine")
    heldout = len(smollm2_tokenizer.encode(quality.HELDOUT.read_text()))
    says(CH, f"[`heldout.txt`](../nanoserve/bench/heldout.txt) ({heldout} tokens, written for this repository")
    rows = {r[0]: r for r in table_rows(CH, "fp32|int8|q4") if len(r) == 7 and r[2].endswith("/12")}
    ppl = {k: float(r[4]) for k, r in rows.items()}
    says(CH, f"+{ppl['int8'] / ppl['fp32'] - 1:.1%} for int8, −{1 - ppl['q4'] / ppl['fp32']:.1%} for q4".replace("%", " %"))
    out = notebook_output(CH)
    printed = {w: re.search(rf"{w} +[\d.]+% +\d+/4 +([\d.]+) +([\d.]+) +([\d.]+)%", out).groups() for w in ("fp32", "int8", "q4")}
    assert printed["fp32"][0] == rows["fp32"][4]  # float32's perplexity is the same on either CPU
    says(CH, f"the same\nheld-out pass gives int8 {' / '.join(printed['int8'])} % and q4 {' / '.join(printed['q4'])} % "
             f"(perplexity / max |Δlogit| /\ntop-1)")
    # "On a CPU without AMX (AVX-512 BF16: ... prints `avx512_bf16`)": torch's AVX512 alone would fit AMX too
    says(CH, "bf16 instructions: avx512_bf16")
    assert re.search(r"CPU: AVX512 +bf16 instructions: avx512_bf16 ", out)
    q4, fp32head = rows["q4"], re.search(r"greedy agreement ([\d.]+) %, (\d+)/12 prompts identical, perplexity ([\d.]+),\n?"
                                          r" ?max \|Δlogit\| ([\d.]+), top-1 = fp32 on \*\*([\d.]+) %", chapter(CH)).groups()
    says(CH, f"q4's top-1 agreement goes from\n{q4[6]} to {fp32head[4]} % and its greedy agreement from "
             f"{number(q4[1]):.0f} % to {float(fp32head[0]):.0f} %, and its largest logit error falls from {q4[5]} to "
             f"{float(fp32head[3]):.2f}")
    int8 = rows["int8"]
    says(CH, f"(bounds at most the measured {q4[2]}, {number(q4[1]):.0f} % and {int8[2]}, {number(int8[1]):.0f} % at "
             f"{args.max_tokens}\ntokens, section 6's 2026-12-01 run against that code's float32;")
    int8_mean, int8_max, q4_mean = (float(re.search(rf"{w}: +mean ([\d.]+), max ([\d.]+)", out)[i])
                                    for w, i in (("int8", 1), ("int8", 2), ("q4", 1)))
    says(CH, f"(the notebook's per-layer plot: int8 mean {int8_mean:.1%}, max {int8_max:.1%}; q4 mean "
             f"{q4_mean:.1%})".replace("%", " %"))


def test_the_memory_table_is_the_notebooks():
    out = notebook_output(CH)
    n = parameter_counts(SMOL)["total"]
    for fmt in ("fp32", "int8", "q4"):
        (row,) = [r for r in table_rows(CH, fmt) if len(r) == 4 and "MB" in r[3]]
        read, per_weight, held = re.search(rf"{fmt} +([\d.]+) MB +([\d.]+) +([\d.]+) MB", out).groups()
        assert (read, per_weight) == (f"{weight_bytes(SMOL, fmt) / MB:.1f}", f"{weight_bytes(SMOL, fmt) / n:.3f}")
        assert row[1:] == [f"{read} MB", per_weight, row[3]] and row[3].startswith(f"{held} MB"), fmt


def test_the_speed_tables_ratios():
    products = [r for r in table_rows(CH, r"1|16|64|256") if len(r) == 6 and "(" in r[2]]
    assert len(products) == 4
    for r in products:
        fp32 = number(r[1])
        for cell in r[2:]:
            if "×" in cell:
                assert rounds_to(ratio_in_cell(cell), fp32, number(cell), 2 if "0." in cell.split("(")[1] else 1), (r[0], cell)
    one = {r[0]: r for r in products}["1"]
    slow8, slow4 = (float(x) for x in re.search(r"take ([\d.]+) ms \(int8\) and ([\d.]+) ms \(q4\)", chapter(CH)).groups())
    says(CH, f"{slow8 / number(one[2]):.1f}× and {slow4 / number(one[4]):.0f}× slower than with bf16")
    engine = {r[0]: r for r in table_rows(CH, r"batch-1 decode|batch-16 decode step|batch-64 decode step|prefill, 512 tokens.*|"
                                                r"chapter 06's 16 requests.*")}
    assert len(engine) == 5
    for name, (_, fp32, int8, q4, r8, r4) in engine.items():
        step = "step" in name  # a time: smaller is better
        for value, ratio in ((int8, r8), (q4, r4)):
            a, b = (number(fp32), number(value)) if step else (number(value), number(fp32))
            assert rounds_to(number(ratio), a, b, 2), (name, ratio)
    decode = engine["batch-1 decode"]
    assert f"({1000 / number(decode[1]):.1f} ms)" in decode[1]
    fp32_ms, q4_ms = number(one[1]), number(one[4])  # the products alone, at 1 token
    for fmt, ms in (("fp32", fp32_ms), ("q4", q4_ms)):
        gbs = weight_bytes(SMOL, fmt) / (ms / 1e3) / 1e9
        says(CH, f"{weight_bytes(SMOL, fmt) / MB:.1f} MB in {ms} ms, {gbs:.1f} GB/s")
    says(CH, f"at 1 token\nfloat32's products stream their {weight_bytes(SMOL, 'fp32') / MB:.1f} MB in {fp32_ms} ms")
    says(CH, f"q4 reads {weight_bytes(SMOL, 'fp32') / weight_bytes(SMOL, 'q4'):.1f}× fewer bytes ({weight_bytes(SMOL, 'q4') / MB:.1f} MB")
    says(CH, f"At 1 token q4 reads {weight_bytes(SMOL, 'fp32') / weight_bytes(SMOL, 'q4'):.1f}× fewer bytes than float32 "
             f"but runs the\nproducts only {ratio_in_cell(one[4]):.1f}× faster (the product table), and a whole decode step "
             f"{number(decode[5]):.2f}× (through the model's forward")


def test_batch_invariance_as_the_notebook_printed_it():
    """Section 5's list: the float32 Linear gives every row of 16 other bits alone, at every product shape; the int8
    and int4 kernels none; the batched decode attention other bits beside other sequences, the same alone."""
    out = notebook_output(CH)
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert re.search(rf"{name} +16 +0 +0 ", out), name  # fp32, int8, q4 rows of 16 that differ
    says(CH, "all 16 of 16 rows differ alone from inside a batch of\n16, at every product shape of the model")
    verdicts = re.findall(r"attention, 20 tokens beside (\[[\d, ]*\]) +same bits as alone: (True|False)", out)
    assert verdicts == [("[]", "True"), ("[40]", "False"), ("[40, 7, 33]", "False"), ("[20, 20, 20]", "False")]


def test_the_degrade_bursts():
    d = command_defaults(degrade, "degrade")
    says(CH, f"{d.requests} chat requests at once, {d.max_num_seqs} running, {d.max_tokens} greedy tokens each; degrading "
             f"with ≥ {d.threshold} waiting, back at ≤ {d.threshold // 2}")
    says(CH, "24 chat requests at once, 4 running, 16 greedy tokens each; the degrading\nengine switches to q4 with ≥ 8 "
             f"waiting and back at ≤ {8 // 2}")
    tables = {}
    for row in table_rows(CH, r"fp32|fp32 \+ degrade|q4"):
        if len(row) == 7 and row[1].endswith(" s"):  # | system | TTFT p50 | TTFT p99 | ...
            tables.setdefault(row[0], []).append(row)
    # the runs recorded had a bare q4 engine, not serve's q4: the chapter quotes no q4-alone row
    assert set(tables) == {"fp32", "fp32 + degrade"} and [len(t) for t in tables.values()] == [2, 2]
    for i in (0, 1):  # the loaded run, then the default one
        fp32, mixed = tables["fp32"][i], tables["fp32 + degrade"][i]
        assert rounds_to(ratio_in_cell(mixed[2]), number(fp32[2]), number(mixed[2]), 2, 1 + i), mixed  # p99: shorter (1, then 2 decimals)
        assert rounds_to(ratio_in_cell(mixed[3]), number(mixed[3]), number(fp32[3]), 2), mixed  # tok/s
        identical, total = (int(x) for x in mixed[6].split("/"))
        says(CH, f"{identical} of {total} requests")
        # every request runs max_tokens tokens (EOS ignored), so `seats` requests start together, in waves; the
        # mode of each wave by the rule the chapter states (switch at >= threshold waiting, back at <= threshold // 2)
        seats, threshold = ((4, 8), (d.max_num_seqs, d.threshold))[i]
        degraded, waits = False, []
        for start in range(0, total, seats):
            waiting = total - start - seats
            degraded = waiting >= threshold or (degraded and waiting > threshold // 2)
            waits.append((waiting, degraded))
        on_q4 = seats * sum(degraded for _, degraded in waits)
        assert mixed[4] == f"{100 * on_q4 / total:.1f} %", mixed  # the share of tokens on q4
        q4_waits = [str(w) for w, degraded in waits if degraded]
        says(CH, f"start with {', '.join(q4_waits[:-1])} and {q4_waits[-1]} waiting")
        says(CH, f"{on_q4} requests ran wholly on q4")
        says(CH, f"{total - on_q4} wholly in float32")
        says(CH, f"so at least {identical - (total - on_q4)} of them ran wholly on q4")
