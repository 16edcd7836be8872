"""Chapter 13 — a token mask for a fixed choice list, by hand (exercise 13.1); the engine serves every choice list
with it (trie_grammar.py).

The grammar `"yes" | "no" | "maybe"` is a trie over the choices' bytes; the output so far is a path from
its root. A token may come next when *all* of its bytes walk on down the trie from there — one token is
several grammar steps, which is the whole difficulty of constrained decoding — and EOS may come next when
the path ends at a complete choice:

    choices "yes", "no", "not"       output so far b"n"        node: {o: {END, t: {END}}}
    token b"o"   -> allowed (n-o)     b"ot" -> allowed (n-o-t)  b"ope" -> not (no 'p' under n-o)
    token b"yes" -> not               EOS   -> not (b"n" is no choice)

Every token whose bytes stay inside the trie counts, not only the ids the tokenizer itself would pick: the
model may spell "not" as [n][ot] or [no][t], and xgrammar's mask allows both, so this one must too.
"""

import torch

END = "end"  # the key that marks a complete choice in a trie node


def build_trie(choices: list[str]) -> dict:
    """The choices' UTF-8 bytes as nested dicts {byte: child}; END in a node: a choice ends there.

        >>> build_trie(["no", "n"])
        {110: {111: {'end': True}, 'end': True}}
    """
    root: dict = {}
    for choice in choices:
        node = root
        for byte in choice.encode():
            node = node.setdefault(byte, {})
        node[END] = True
    return root


def choice_mask(trie: dict, prefix: bytes, vocab: list[bytes], stop_token_ids: list[int]) -> torch.Tensor:
    """(len(vocab),) bool: which tokens may follow the output `prefix`. vocab[t] is token t's bytes (b"" for
    a special token, never allowed); a stop token is allowed exactly when `prefix` is a complete choice."""
    mask = torch.zeros(len(vocab), dtype=torch.bool)
    node = trie
    for byte in prefix:
        node = node.get(byte)
        if node is None:  # the output already left the grammar: nothing may follow
            return mask
    for token_id, piece in enumerate(vocab):
        if not piece or piece[0] not in node:
            continue
        walk = node
        for byte in piece:
            walk = walk.get(byte)
            if walk is None:
                break
        mask[token_id] = walk is not None
    if END in node:
        mask[stop_token_ids] = True
    return mask
