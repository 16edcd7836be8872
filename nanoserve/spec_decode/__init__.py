"""Chapter 14 — speculative decoding: propose k tokens cheaply, verify them in one forward pass of the
target model, keep the longest accepted prefix plus one token the target picks itself, roll the rest back.

    proposer.py     the interface, and make_proposer("ngram" | "draft")
    ngram.py        prompt lookup: the k tokens that followed the last match of the last n tokens
    draft.py        a self-speculative draft: the same model cut to its first L layers
    acceptance.py   greedy acceptance and rejection sampling (exact: the output has the target's distribution)
    verify.py       the model runner's side: the k + 1 rows of logits of a sequence -> its new tokens
    rollback.py     the block manager's side: the slots and blocks of rejected tokens go back
    policy.py       when to speculate: off as the batch grows, and per request
"""
