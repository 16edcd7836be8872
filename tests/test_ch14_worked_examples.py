"""Chapter 14's worked examples, computed by the code: the rollback of a verified step (rollback_slots on a
BlockManager), the model of section 5 (bench/spec.py's expected_length and best_k) with its worked numbers, the
engine's defaults (the draft's layers and window, the batch-size policy) and chapter 09's decode figures are built
here from nanoserve/ and must appear in the chapter word for word; the model's numbers drawn from the measured table
are recomputed from that table."""

import re

from nanoserve.bench.spec import best_k, expected_length
from nanoserve.engine.config import SpeculativeConfig
from nanoserve.kv.block_manager import BlockManager, cdiv
from nanoserve.memory import parameter_counts, weight_bytes
from nanoserve.model import LlamaConfig
from nanoserve.spec_decode.draft import DraftProposer
from nanoserve.spec_decode.policy import DEFAULT_DISABLE_BY_BATCH_SIZE
from nanoserve.spec_decode.rollback import rollback_slots
from tests.chapter_text import chapter, says
from tests.tiny_model import tiny_llama

CH = "14"
SMOL = LlamaConfig()


def test_decode_leaves_the_compute_idle():
    says(CH, f"reads all {weight_bytes(SMOL, 'fp32') / 1e6:.0f} MB of float32 weights to do "
             f"{2 * parameter_counts(SMOL)['total'] / 1e6:.0f} M FLOPs")
    b1 = re.search(r"decode B=1 +([\d.]+) +\d+% +\d+% +\d+% +\d+% +\d+% +\d+% +([\d.]+) /", chapter("09"))
    b64 = float(re.search(r"decode B=64 +([\d.]+)", chapter("09"))[1])
    says(CH, f"put a batch-1 decode step of SmolLM2 at {float(b1[1]):.0f} ms, {float(b1[2]) / float(b1[1]):.0%} of the "
             f"*bandwidth* roofline".replace("%", " %"))
    says(CH, f"The same chapter measured batch 64 at {b64 / 64:.1f} ms per token")


def test_rollback_in_a_paged_cache():
    bm = BlockManager(9, 4, enable_prefix_caching=False)
    bm.allocator.allocate(9)
    for b in (3, 8, 5, 0, 1, 2, 4, 6, 7):  # a pool whose free list starts 3, 8, 5: the chapter's blocks
        bm.allocator.free(b)
    tokens = list(range(6))
    bm.allocate_slots("s", tokens, 6)  # 6 tokens, 5 computed
    table = list(bm.allocate_slots("s", tokens + [0] * 4, 6 + 4))  # verifying 4 proposals: positions 5..9
    says(CH, f"the step computes positions 5..9 (the 6th token, d_1..d_4): the table covers 10 positions: {table}")
    accepted = 1
    real = 6 + accepted
    freed = rollback_slots(bm, "s", real)
    says(CH, f"{accepted} accepted -> positions [0, {real}) real (6 tokens + d_1): cdiv({real}, 4) = {cdiv(real, 4)} blocks -> "
             f"{bm.block_table('s')}; block {freed[0]} back in the pool")
    says(CH, f"the correction is the {real + 1}th token, at position {real}: the next step writes it over d_2's K/V")


def test_the_model_of_section_5():
    def speedup(a, c, k):
        return expected_length(a, k) / (1 + k * c)

    says(CH, f"with α = 0.5, at most {1 / (1 - 0.5):.0f} tokens a step; with α = 0.8, at most {1 / (1 - 0.8):.0f}")
    assert best_k(0.5, 0.25) == 1
    says(CH, f"Worked: α = 0.5, c = 0.25 gives S(1) = {expected_length(0.5, 1):g} / 1.25 = {speedup(0.5, 0.25, 1):.2f},\n"
             f"S(2) = {expected_length(0.5, 2):g} / 1.5 = {speedup(0.5, 0.25, 2):.2f}, so k = {best_k(0.5, 0.25)} is best")
    k = best_k(0.8, 0.05)
    best = speedup(0.8, 0.05, k)
    worst_neighbour = min(speedup(0.8, 0.05, k - 1), speedup(0.8, 0.05, k + 1))
    assert 1 - worst_neighbour / best < 0.005
    says(CH, f"α = 0.8, c = 0.05 gives k = {k} (S = {expected_length(0.8, k):.2f} / {1 + k * 0.05:g} = {best:.2f}, and\n"
             f"k = {k - 1} or {k + 1} within 0.5 %")


def test_the_measured_table_and_the_model():
    """Section 7's reading of its table, recomputed from the table's own cells with section 5's model."""
    rows, speedups = {}, {}  # (kind, name) -> α, E measured, E(α,k), r_k, c, E/r_k, best k; and the request speedup
    for kind, table in re.findall(r"(grounded|chat) prompts \(\d\), outputs identical(.*?)(?=\w+ prompts \(|load:)", chapter(CH)):
        for name, k, speedup, cells, ratio, best in re.findall(
                r"(ngram|draft) k=(\d) +[\d.]+ +([\d.]+)x +([\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+) +([\d.]+)x +(\d|off)",
                table):
            rows[kind, f"{name} k={k}"] = [float(x) for x in cells.split()] + [float(ratio), best]
            speedups[kind, f"{name} k={k}"] = float(speedup)
    assert len(rows) == 12
    for (kind, name), (alpha, e_meas, e_model, r_k, c, ratio, best) in rows.items():
        k = int(name[-1])
        assert abs(expected_length(alpha, k) - e_model) <= 0.02, (kind, name)  # α printed rounded to 0.01
        # the printed cells are rounded to 0.01: a ratio of two of them lands within about 0.012 of the printed one
        assert abs((r_k - 1) / k - c) <= 0.008 and abs(e_meas / r_k - ratio) <= 0.012, (kind, name)
        assert best == (str(best_k(alpha, c)) if alpha > c else "off"), (kind, name)
        assert e_meas <= e_model  # "the measured length is a little below E(α, k)", at every k
    grounded = {name: cells for (kind, name), cells in rows.items() if kind == "grounded"}
    chat = {name: cells for (kind, name), cells in rows.items() if kind == "chat"}
    alpha = grounded["ngram k=4"][0]
    says(CH, f"α = {alpha} at\nk = 4, so E({alpha}, 4) = (1 − {alpha}⁵) / (1 − {alpha}) ≈ {expected_length(alpha, 4):.2f}")
    says(CH, "E / r_k (measured E over r_k) gives " + ", ".join(f"{grounded[f'ngram k={k}'][5]:.2f}×" for k in (2, 4))
         + f" and {grounded['ngram k=8'][5]:.2f}×")
    says(CH, "So c = (r_k − 1) / k is not one number: it varies with k, "
         + ", ".join(f"{grounded[f'ngram k={k}'][4]:.2f}" for k in (2, 4, 8)))
    ngram_c = [cells[4] for (kind, name), cells in rows.items() if name.startswith("ngram")]
    says(CH, f"an n-gram step's extra verified rows at c = {min(ngram_c):.2f}–{max(ngram_c):.2f} of a whole decode step, "
             "a c that\nvaries with k")
    # the step costs' shape: 4 proposals hardly dearer than 2, 8 much dearer than 4
    r = {k: grounded[f"ngram k={k}"][3] for k in (2, 4, 8)}
    assert r[4] - r[2] < 0.1 < r[8] - r[4]
    # the products alone: 5 rows hardly more than 3, 9 rows about three times 5
    one, three, five, nine = map(float, re.search(
        r"took ([\d.]+), ([\d.]+),\s+([\d.]+) and ([\d.]+) ms for 1, 3, 5 and 9 rows", chapter(CH)).groups())
    assert five / three < 1.1 and round(nine / five) == 3 and three / one > 1.5
    says(CH, "5 rows costing hardly more than 3 and 9 rows three times as much")
    # the bound per measured k, and the best of the measured E / r_k
    bound = ", ".join(f"{grounded[f'ngram k={k}'][2] / grounded[f'ngram k={k}'][3]:.2f}" for k in (2, 4))
    says(CH, f"E(α, k) / r_k =\n{bound} and {grounded['ngram k=8'][2] / grounded['ngram k=8'][3]:.2f} for grounded "
             "n-gram at k = 2, 4, 8")
    best_name = max((n for n in grounded if n.startswith("ngram")), key=lambda n: grounded[n][5])
    says(CH, f"the best the decode steps did is {grounded[best_name][5]:.2f}×, at k = {best_name[-1]}. The whole "
             f"requests ran at {speedups['grounded', best_name]:.2f}× there")
    chat_speedups = [speedups["chat", f"ngram k={k}"] for k in (2, 4, 8)]
    assert max(chat_speedups) < 1 and all(chat[f"ngram k={k}"][5] < 1 for k in (2, 4, 8))
    says(CH, f"lost at every k, {min(chat_speedups):.2f}–{max(chat_speedups):.2f}×: its E / r_k is "
             + ", ".join(f"{chat[f'ngram k={k}'][5]:.2f}×" for k in (2, 4)) + f" and {chat['ngram k=8'][5]:.2f}×")


def test_the_engines_defaults():
    draft = DraftProposer(tiny_llama(num_hidden_layers=SMOL.num_hidden_layers))  # the draft's defaults, on a 30-layer model
    says(CH, f"the draft: {draft.num_layers} of {SMOL.num_hidden_layers} layers")
    says(CH, f"{draft.window} tokens per proposal, without any cache")
    says(CH, f"`speculative_disable_by_batch_size` (vLLM's name), by default {DEFAULT_DISABLE_BY_BATCH_SIZE}: speculate "
             f"only while a sequence runs alone")
    assert DEFAULT_DISABLE_BY_BATCH_SIZE == 2 and SpeculativeConfig().disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    alpha, accepted, tested = re.search(r"α = ([\d.]+), (\d+)\s*of (\d+) tested proposals accepted", chapter(CH)).groups()
    assert f"{int(accepted) / int(tested):.2f}" == alpha
