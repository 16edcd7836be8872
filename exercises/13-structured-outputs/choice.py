"""Exercise 13.1 — a token mask for a fixed choice list, by hand.

This file mirrors nanoserve/structured/choice.py; once it is finished, `--student 13` compiles every choice list
(`"structured_outputs": {"choice": [...]}`) with your `build_trie` and asks your `choice_mask` for the mask of each
trie node an output reaches (nanoserve/structured/trie_grammar.py keeps each mask for the next request). The grader
compares your mask, token for token, with the one xgrammar computes for the grammar `"yes" | "no" | ...` over
SmolLM2's 49,152 tokens.

Run `make grade CH=13` to grade it.
"""

import torch

END = "end"  # the key that marks a complete choice in a trie node


def build_trie(choices: list[str]) -> dict:
    """The choices' UTF-8 bytes as nested dicts {byte (int): child node}; a node holding the key END (value
    True) is where a choice ends (it may have children too: "no" and "not").

        >>> build_trie(["no", "n"])
        {110: {111: {'end': True}, 'end': True}}
    """
    raise NotImplementedError("Exercise 13.1: build_trie — the choices' bytes as a trie of dicts")


def choice_mask(trie: dict, prefix: bytes, vocab: list[bytes], stop_token_ids: list[int]) -> torch.Tensor:
    """(len(vocab),) bool: True for each token that may follow the output `prefix` (bytes generated so far).

    Token t (its bytes vocab[t]) is allowed when prefix + vocab[t] is still a path in the trie — every one
    of its bytes, not only the first. A token with empty bytes (a special token) is never allowed. The
    stop tokens are allowed exactly when `prefix` itself is a complete choice. A prefix that already left
    the trie allows nothing.

        choices "yes", "no", "not"; prefix b"n":  b"o" yes, b"ot" yes, b"ope" no, b"yes" no, EOS no
    """
    raise NotImplementedError("Exercise 13.1: choice_mask — walk each token's bytes down the trie")
