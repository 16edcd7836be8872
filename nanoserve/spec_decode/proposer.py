"""Chapter 14 — a proposer guesses the next tokens of a sequence from what it has seen so far.

    proposer.propose([5, 6, 7, 8, 5, 6], k=2)   -> [7, 8]      (n-gram: "5 6" was followed by "7 8")

Any guess is allowed: verification (acceptance.py) only ever keeps tokens the target model would have
produced itself, so a bad proposer costs speed, never correctness. It may return fewer than k tokens,
or none (nothing to propose: the sequence takes a plain decode step).

Both proposers here are deterministic (q is one-hot at the proposed token): n-gram lookup by nature,
the draft because it proposes its argmax. The engine relies on it: a proposer returns token ids only, and
verify.verify_one calls acceptance.rejection_sample with draft_probs=None (q one-hot). The rule itself takes
any q, but a sampling draft would not plug in as it is: its q would have to travel from propose() to the
verifier, and accepting its samples against a one-hot q would not keep the target's distribution.
"""

import importlib
from typing import Protocol

PROPOSERS = ("ngram", "draft")


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k token ids that may follow `token_ids` (prompt + output so far)."""
        ...


def make_proposer(spec, model=None, modules=importlib.import_module) -> Proposer:
    """The proposer of a SpeculativeConfig (`--speculative METHOD`): "ngram" (no model; prompt_lookup_min/max,
    vLLM's names) or "draft" (the target's first draft_num_layers layers). modules(name) loads a module: the
    engine passes StudentCode.module, so the learner's ngram.py (exercise 14.1) serves where finished."""
    if spec.method == "ngram":
        return modules("nanoserve.spec_decode.ngram").NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft":
        from nanoserve.spec_decode.draft import DraftProposer

        return DraftProposer(model, spec.draft_num_layers)
    raise ValueError(f"speculative must be one of {', '.join(PROPOSERS)}, got {spec.method!r}")
