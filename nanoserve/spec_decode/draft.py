"""Chapter 14 — a self-speculative draft: the target model cut to its first L layers (LayerSkip-style).

    ids -> embed -> block 0 .. block L-1 -> norm -> lm_head      (the target's own modules, shared)

No second model to load and no weights copied: the draft *is* the first L blocks of the target, read
out early through the target's final norm and LM head. It is weaker than a trained draft (LayerSkip
trains the model so that early exits are good; ours is not trained for it, so acceptance is what the
chapter measures). Its cost is below.

Its KV: the draft recomputes a short window of the last `window` tokens for each proposal, with plain
causal attention and no cache at all. Why not a paged cache of its own: that cache would need its own
blocks, its own slot mapping and its own rollback whenever the target rejects, for a model of a few
layers; the window keeps the draft stateless, so there is nothing to roll back and nothing to
leak. The price: each proposed token is a forward of the L layers over the window and the proposed tokens
before it, up to (window + k) * L / num_layers target-tokens of compute (and a read of the L layers' weights
and the LM head), k of them per step. That is not cheap: chapter 14's section 7 measured a step that drafts
and verifies k tokens with 7 of 30 layers at 4.04-4.05 plain decode steps for k = 2, 6.68-6.72 for k = 4 and
12.80-12.85 for k = 8 on the course's CPU (`python -m nanoserve bench spec --threads 1`, its r_k column).
"""

import torch

from nanoserve.model.llama import causal_self_attention
from nanoserve.model.rope import rope_cos_sin


class DraftProposer:
    def __init__(self, model, num_layers: int | None = None, window: int = 64):
        total = model.config.num_hidden_layers
        num_layers = num_layers or max(1, total // 4)
        if not 1 <= num_layers < total:
            raise ValueError(f"the draft needs 1 <= layers < {total} (the target's), got {num_layers}")
        if window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.model, self.num_layers, self.window = model, num_layers, window
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def logits(self, token_ids: list[int], start: int) -> torch.Tensor:
        """The draft's next-token logits (vocab,) after `token_ids`, the window's tokens at positions start.."""
        m = self.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        x = m.embed_tokens(ids)  # (W, hidden)
        cos, sin = (t.to(x.dtype) for t in rope_cos_sin(positions, m.config.head_dim, m.config.rope_theta))
        for block in m.layers[:self.num_layers]:
            x = block(x, cos, sin, causal_self_attention)
        return m.compute_logits(m.norm(x[-1:]))[0].float().cpu()  # only the last row: (vocab,)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """k greedy tokens of the draft (q one-hot), each one a forward of the window plus the ones before it."""
        start = max(0, len(token_ids) - self.window)
        window, proposal = list(token_ids[start:]), []
        for _ in range(k):
            token = int(self.logits(window + proposal, start).argmax())
            proposal.append(token)
        return proposal
