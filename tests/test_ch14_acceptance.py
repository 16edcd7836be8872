"""Chapter 14 — the pieces of speculative decoding on their own: the n-gram proposer, greedy acceptance,
rejection sampling (a chi-square test against the target distribution) and the rollback of the block table.

The oracles are hand-computed expectations and, for sampling, the target distribution itself: tokens
drawn through rejection_sample must be indistinguishable from tokens drawn from p directly, and a rule
that is wrong (resampling from p instead of the residual after a rejection) must be caught.
"""

import pytest
import torch

from nanoserve.kv.block_allocator import BlockAllocator
from nanoserve.kv.block_manager import BlockManager
from nanoserve.student import implementation

# the 0.999 quantile of chi-square with 5 degrees of freedom (a 6-token vocabulary): a correct sampler
# exceeds it once in a thousand seeds, a wrong one by orders of magnitude (scipy.stats.chi2.ppf(0.999, 5))
CHI2_999_DF5 = 20.515


def ngram():
    return implementation("nanoserve.spec_decode.ngram")


def acceptance():
    return implementation("nanoserve.spec_decode.acceptance")


@pytest.mark.exercise("14.1")
def test_ngram_proposes_what_followed_the_longest_match():
    p = ngram().NgramProposer(min_n=1, max_n=3)
    # the suffix "4 1 2" (n = 3) occurred at 3: what followed it, although "1 2" occurred earlier, at 0
    assert p.propose([1, 2, 3, 4, 1, 2, 5, 9, 4, 1, 2], 3) == [5, 9, 4]
    assert p.propose([1, 2, 3, 4, 1, 2, 5, 9, 4, 1, 2], 1) == [5]
    # "2 5" occurred at 3 (-> 6 0) and "5" alone earlier at 1 (-> 8 2): the longer match wins
    assert p.propose([7, 5, 8, 2, 5, 6, 0, 2, 5], 2) == [6, 0]
    # of several occurrences of the same n-gram, the first: "1 2" at 0 and at 4
    assert p.propose([1, 2, 7, 8, 1, 2, 9, 3, 1, 2], 2) == [7, 8]
    # the continuation stops at the end of the sequence
    assert p.propose([3, 3], 4) == [3]


@pytest.mark.exercise("14.1")
def test_ngram_min_and_max_n():
    tokens = [9, 1, 2, 8, 5, 2]  # only the 1-gram "2" repeats
    assert ngram().NgramProposer(min_n=1, max_n=4).propose(tokens, 2) == [8, 5]
    assert ngram().NgramProposer(min_n=2, max_n=4).propose(tokens, 2) == []
    assert ngram().NgramProposer(min_n=1, max_n=4).propose([4], 2) == []  # nothing before the suffix
    with pytest.raises(ValueError):
        ngram().NgramProposer(min_n=3, max_n=2)


@pytest.mark.exercise("14.2")
def test_greedy_acceptance():
    accept = acceptance().greedy_accept
    assert accept([7, 8, 9], [7, 8, 4, 2]) == [7, 8, 4]  # rejected at the third: the target's 4 instead
    assert accept([7, 8], [7, 8, 5]) == [7, 8, 5]  # all accepted: the bonus from the last row
    assert accept([1, 8], [7, 8, 5]) == [7]  # rejected at once: a plain decode's token
    with pytest.raises(ValueError):
        accept([1, 2], [1, 2])  # k proposals need k + 1 rows


P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
Q = torch.tensor([0.05, 0.10, 0.05, 0.30, 0.40, 0.10])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def draw_first_tokens(rule, n: int = 6000, q=Q, seed: int = 0) -> torch.Tensor:
    """Counts of the first emitted token: the proposal drawn from q, then rule(proposal, p rows, q rows, g)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P))
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[rule([d], torch.stack([P, P]), q[None], g)[0]] += 1
    return counts


@pytest.mark.exercise("14.3")
def test_rejection_sampling_preserves_the_target_distribution():
    counts = draw_first_tokens(acceptance().rejection_sample)
    assert chi_square(counts, P) < CHI2_999_DF5


@pytest.mark.exercise("14.3")
def test_a_wrong_rule_is_caught():
    """Resampling from p itself after a rejection (instead of the residual max(0, p - q)) over-weights the
    tokens q proposes too rarely... and the test sees it. So does accepting every proposal (that is q)."""
    def resample_from_p(proposal, p, q, g):
        d = proposal[0]
        if torch.rand((), generator=g) * q[0, d] < p[0, d]:
            return [d]
        return [int(torch.multinomial(p[0], 1, generator=g))]

    assert chi_square(draw_first_tokens(acceptance().rejection_sample, seed=3), P) < CHI2_999_DF5  # the right rule
    assert chi_square(draw_first_tokens(resample_from_p), P) > 10 * CHI2_999_DF5
    assert chi_square(draw_first_tokens(lambda d, p, q, g: d), P) > 10 * CHI2_999_DF5


@pytest.mark.exercise("14.3")
def test_residual_and_the_one_hot_proposal_with_its_bonus():
    r = acceptance().residual(P, Q)
    expected = torch.clamp(P - Q, min=0)
    assert torch.allclose(r, expected / expected.sum())
    # a deterministic proposer (q one-hot at token 0): accepted with probability p(0) = 0.3, the residual is p
    # without token 0; when accepted, the bonus comes from the second row, here P2
    p2 = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(1)
    first, bonus = torch.zeros(6), torch.zeros(6)
    for _ in range(6000):
        out = acceptance().rejection_sample([0], torch.stack([P, p2]), None, g)
        first[out[0]] += 1
        if len(out) == 2:
            assert out[0] == 0
            bonus[out[1]] += 1
    assert chi_square(first, P) < CHI2_999_DF5
    assert chi_square(bonus[3:], p2[3:]) < 13.82  # 2 degrees of freedom, 0.999
    assert bonus[:3].sum() == 0


def rollback():
    return implementation("nanoserve.spec_decode.rollback")


@pytest.mark.exercise("14.4")
def test_rollback_shrinks_the_table_and_frees_the_blocks_of_rejected_slots():
    bm = BlockManager(8, block_size=4, allocator=BlockAllocator(8))
    tokens = [10, 11, 12, 13, 14, 15]  # a sequence of 6 tokens, 5 of them computed (the chapter's example)
    bm.allocate_slots("s", tokens, 5)
    table_before = list(bm.allocate_slots("s", tokens, 6 + 4))  # the 6th + 4 proposals: positions 5..9, 3 blocks
    assert len(table_before) == 3 and bm.get_num_free_blocks() == 5
    freed = rollback().rollback_slots(bm, "s", 7)  # 1 proposal accepted: positions [0, 7) hold real K/V
    assert freed == table_before[2:] and bm.block_table("s") == table_before[:2]
    assert bm.get_num_free_blocks() == 6
    # the sequence grows again from position 7, into its own second block
    assert bm.allocate_slots("s", tokens + [16, 17], 8) == table_before[:2]
    assert rollback().rollback_slots(bm, "s", 8) == []  # nothing past 8 to free
    bm.free("s")
    assert bm.get_num_free_blocks() == 8


@pytest.mark.exercise("14.4")
def test_rollback_never_uncovers_a_cached_block_and_rejected_tokens_are_never_cached():
    allocator = BlockAllocator(8)
    bm = BlockManager(8, block_size=4, allocator=allocator)
    real = [1, 2, 3, 4, 5]
    bm.allocate_slots("s", real, 5)
    table_before = list(bm.allocate_slots("s", real, 5 + 6))  # 6 proposals: positions [5, 11), blocks 1 and 2
    assert len(table_before) == 3 and len(bm.block_hashes["s"]) == 1  # only block 0 (tokens 1 2 3 4) is cached
    assert rollback().rollback_slots(bm, "s", 5) == table_before[2:]  # none accepted: [0, 5) real, 2 blocks
    assert bm.block_table("s") == table_before[:2]
    assert table_before[2] in allocator.free_list and allocator.get_num_free_blocks() == 6  # back in the pool
    assert bm.lookup_prefix([1, 2, 3, 4, 9]) == 4 and bm.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    bm.free("s")
    assert bm.get_num_free_blocks() == 8


@pytest.mark.exercise("14.4")
def test_rollback_refuses_to_uncover_a_cached_block():
    """A registered block must end at or before num_tokens: a cached block holding position num_tokens or later
    would hold a rejected token. Here block 1 (positions 4..7) is registered and only [0, 7) is real."""
    bm = BlockManager(8, block_size=4, allocator=BlockAllocator(8))
    real = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bm.allocate_slots("s", real, 9)  # blocks 0 and 1 full of real tokens: both registered
    with pytest.raises(RuntimeError):
        rollback().rollback_slots(bm, "s", 7)
    table = list(bm.block_table("s"))
    assert len(table) == 3 and bm.get_num_free_blocks() == 5  # refused before anything changed
    assert rollback().rollback_slots(bm, "s", 8) == table[2:] and bm.block_table("s") == table[:2]  # [0, 8): fine


def test_block_manager_shrink_frees_the_tail_and_keeps_cached_blocks():
    """BlockManager.shrink, the one method rollback goes through: the chapter's example, by hand."""
    bm = BlockManager(8, block_size=4, allocator=BlockAllocator(8))
    tokens = [10, 11, 12, 13, 14, 15]
    table = list(bm.allocate_slots("s", tokens, 10))  # 3 blocks, block 0 (10 11 12 13) registered
    assert bm.shrink("s", 2, 7) == table[2:] and bm.block_table("s") == table[:2] and bm.get_num_free_blocks() == 6
    assert bm.num_slots["s"] == 7  # the next allocation grows from position 7
    with pytest.raises(RuntimeError):
        bm.shrink("s", 0, 0)  # block 0 is in the prefix cache
    assert bm.block_table("s") == table[:2]


def test_the_counters_and_the_model_of_section_5_by_hand():
    """4 verified proposals of k = 4: three kept all four tokens, one kept 1 and was cut short by a rejection.
    Tested tokens: 13 accepted + 1 rejected (the 2 after the rejection were never tested), so α = 13/14;
    tokens emitted per verifying step: (13 accepted + 4 corrections/bonuses) / 4 = 4.25."""
    from types import SimpleNamespace

    from nanoserve.bench.spec import Measured, best_k, expected_length
    from nanoserve.spec_decode.policy import SpecDecodeStats

    s = SpecDecodeStats(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=13, num_rejections=1)
    assert s.alpha == 13 / 14 and s.mean_accepted_length == 4.25 and s.acceptance_rate == 13 / 16
    assert SpecDecodeStats().alpha == 0.0 and SpecDecodeStats().mean_accepted_length == 0.0
    assert expected_length(0.5, 2) == 1 + 0.5 + 0.25 and expected_length(0.0, 4) == 1 and expected_length(1.0, 4) == 5
    assert expected_length(13 / 14, 4) == pytest.approx(sum((13 / 14) ** j for j in range(5)))
    # section 5's worked examples: α = 0.5, c = 0.25 -> S(1) = 1.20 > S(2) = 1.17; α = 0.8, c = 0.05 -> k = 8
    assert best_k(0.5, 0.25) == 1 and best_k(0.8, 0.05) == 8
    assert best_k(0.0, 0.39) == 0  # nothing accepted: every k loses to no speculation
    # and bench spec's row says so: "off" in the best-k column (α = 0, a verify of 2 costing 1.78 decode steps)
    stats = SpecDecodeStats(num_drafts=3, num_draft_tokens=6, num_accepted_tokens=0, num_rejections=3)
    base, spec = Measured(None), Measured(SimpleNamespace(spec_stats=stats), k=2)
    for m, steps in ((base, {1: [1.0]}), (spec, {3: [1.78]})):
        m.add([[0] * 10], 1.0)
        m.steps.update(steps)
    assert spec.row("ngram k=2", base).split()[-1] == "off"
