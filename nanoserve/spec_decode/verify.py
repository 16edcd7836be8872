"""Chapter 14 — the model runner's side of verification: k + 1 rows of logits -> the sequence's new tokens.

A sequence with k proposals was laid out in the flat batch as k + 1 query tokens (its last real token,
then d_1..d_k), and the runner computed logits for all k + 1 rows (prepare_inputs); every other sampled
sequence has its usual one row:

    A decodes (no proposal), B verifies 3 proposals, C decodes
    logits rows  [a | b0 b1 b2 b3 | c]     (1 + 4 + 1, vocab)
    A, C -> ModelRunner.sample as always (one token each)
    B    -> greedy_accept / rejection_sample -> 1..4 tokens

Row j scores the position after proposal[:j], so it gets the request's logit_bias and penalties as plain
sampling would there (nanoserve.sampling.apply_penalties over prompt + output + proposal[:j]); the target's
probabilities then come from nanoserve.sampling.probabilities, the same transform (temperature, min-p,
top-k, top-p) plain sampling draws from, so the accepted tokens follow the distribution the request asked for.
"""

import torch

from nanoserve.sampling import apply_penalties, make_generator, probabilities


def verify_and_sample(runner, seqs, logits: torch.Tensor, grammar_bitmask=None) -> dict[str, int | list[int]]:
    """{seq_id: token} for the sequences without proposals (runner.sample), {seq_id: [tokens]} for the
    ones with (accepted proposals + the correction or bonus). logits: (sum of 1 + k per seq, vocab).
    runner.spec_acceptance: the acceptance module whose rules decide (the learner's, exercises 14.2 and 14.3).
    grammar_bitmask: chapter 13's masks, for the plain rows (a constrained request never speculates)."""
    acceptance = runner.spec_acceptance
    plain_rows, plain_seqs, spec = [], [], []
    row = 0
    for seq in seqs:
        k = len(seq.spec_token_ids)
        if k:
            spec.append((seq, row))
        else:
            plain_rows.append(row)
            plain_seqs.append(seq)
        row += k + 1
    # (a SampledTokens even with no plain sequence: its `failed` collects the verifications that raise)
    sampled = runner.sample(plain_seqs, logits[plain_rows], grammar_bitmask if plain_seqs else None)
    for seq, row in spec:
        try:
            sampled[seq.seq_id] = verify_one(runner, acceptance, seq, logits[row:row + len(seq.spec_token_ids) + 1])
        except Exception as e:  # noqa: BLE001 — as in ModelRunner.sample: this sequence fails alone
            sampled.failed[seq.seq_id] = e
    return sampled


def verify_one(runner, acceptance, seq, logits: torch.Tensor) -> list[int]:
    """One sequence's accepted proposals + its correction or bonus token, from its k + 1 rows of logits."""
    proposal, params = seq.spec_token_ids, seq.sampling_params
    rows = torch.stack([apply_penalties(r, params, seq.prompt_token_ids, seq.output_token_ids + proposal[:j])
                        for j, r in enumerate(logits.float())])  # (k + 1, vocab)
    if params.greedy:
        return acceptance.greedy_accept(proposal, rows.argmax(-1).tolist())
    if seq.seq_id not in runner.generators:
        runner.generators[seq.seq_id] = make_generator(params)
    target = torch.stack([probabilities(r, params) for r in rows])
    return acceptance.rejection_sample(proposal, target, None, runner.generators[seq.seq_id])
