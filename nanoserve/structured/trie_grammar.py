"""Chapter 13 — a choice list needs no grammar compiler: its trie (exercise 13.1's choice.py) is the automaton.

`"structured_outputs": {"choice": ["red", "green", "blue"]}` compiles here, not in xgrammar: the trie of the
choices' bytes is built, and the mask of every trie node — which of the 49,152 tokens walk on down from it, by
`choice_mask` — is computed then, packed to int32 words like xgrammar's rows. Compiling runs in the grammar
cache's pool (compiler.py), so the engine thread only looks masks up; a Python walk over the whole vocabulary per
node is slow (`bench structured` times one beside xgrammar's fill of the same choices), which is why a choice list may have
at most MAX_CHOICE_NODES trie nodes (params.py refuses more: a 400 naming structured_outputs):

    choices "red", "green", "blue"       trie nodes: 1 root + 12 below      masks: 13 x 6 KiB, all at compile time
    output b""     -> mask(root)         looked up
    output b"gr"   -> mask(node g-r)     looked up; the next request asking for these choices finds the same grammar

Keyed by the output's *bytes*, not its tokens: [g][reen] and [gre][en] stand at the same node. The matcher has the
SequenceMatcher's interface (sync / fill / is_terminated), so the engine drives both kinds alike, and its state is
a function of the output tokens alone (a replaced or shortened sequence needs no rollback: it is read again).
"""

from types import ModuleType

import torch

from nanoserve.structured.matcher import GrammarViolation

MAX_CHOICE_NODES = 256  # a choice list's trie nodes (params.py refuses more): each one's mask is computed at compile
_BYTE_WEIGHTS = 1 << torch.arange(8)  # bit j of a byte is worth 2 ** j: token 8k + j is bit j of byte k


def trie_nodes(choices: list[str]) -> list[bytes]:
    """Every node of the choices' trie as its path from the root, b"" first.

        >>> trie_nodes(["no", "not"])
        [b'', b'n', b'no', b'not']
    """
    return sorted({c.encode()[:i] for c in choices for i in range(len(c.encode()) + 1)}, key=lambda p: (len(p), p))


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(vocab,) bool -> (ceil(vocab / 32),) int32, xgrammar's layout (the inverse of bitmask.unpack_bitmask).

        >>> pack_bitmask(torch.tensor([True, False, True, False])).tolist()
        [5]
    """
    words = (allowed.numel() + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.bool)
    padded[:allowed.numel()] = allowed
    as_bytes = (padded.view(-1, 8).long() * _BYTE_WEIGHTS).sum(-1).to(torch.uint8)  # (4 * words,)
    return as_bytes.view(torch.int32)  # little-endian: byte k of a word holds its tokens 8k .. 8k + 7


class ChoiceGrammar:
    """One choice list, compiled: its trie, and the packed mask of every node of it."""

    def __init__(self, choices: list[str], vocab: list[bytes], stop_token_ids: list[int], choice_module: ModuleType):
        self.choices, self.vocab, self.stop_token_ids = choices, vocab, stop_token_ids
        self.choice_module = choice_module  # the learner's exercises/13 choice.py under --student 13
        self.trie = choice_module.build_trie(choices)
        # the output so far -> its packed next-token mask, for every node (path from the root) of the trie
        self.masks: dict[bytes, torch.Tensor] = {
            prefix: pack_bitmask(choice_module.choice_mask(self.trie, prefix, vocab, stop_token_ids))
            for prefix in trie_nodes(choices)}
        self.memory_size_bytes = len(self.masks) * 4 * ((len(vocab) + 31) // 32)  # what the cache's LRU counts

    def mask(self, prefix: bytes) -> torch.Tensor:
        """The packed mask of what may follow the output `prefix` (a node of the trie: the matcher checked)."""
        return self.masks[prefix]

    def leads_on(self, prefix: bytes) -> bool:
        """`prefix` is a path from the trie's root: some choice starts with it."""
        return any(c.encode().startswith(prefix) for c in self.choices)


class ChoiceMatcher:
    """One completion's place in a ChoiceGrammar: the bytes of its output tokens."""

    def __init__(self, grammar: ChoiceGrammar):
        self.grammar = grammar
        self.prefix, self.stopped = b"", False

    def sync(self, output_token_ids: list[int]) -> None:
        """Stand where `output_token_ids` lead. Raises GrammarViolation if they leave the trie: a special token,
        bytes no choice continues with, a stop token before a choice is complete, anything after it."""
        stops = [i for i, t in enumerate(output_token_ids) if t in self.grammar.stop_token_ids]
        text = output_token_ids[:stops[0]] if stops else output_token_ids
        pieces = [self.grammar.vocab[t] if 0 <= t < len(self.grammar.vocab) else b"" for t in text]
        prefix = b"".join(pieces)
        if not all(pieces) or not self.grammar.leads_on(prefix):
            raise GrammarViolation(f"the output {prefix!r} is no start of any of {self.grammar.choices}")
        if stops and (prefix not in [c.encode() for c in self.grammar.choices] or len(output_token_ids) > len(text) + 1):
            raise GrammarViolation(f"the output stopped at {prefix!r}, which is none of {self.grammar.choices}")
        self.prefix, self.stopped = prefix, bool(stops)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next-token mask into bitmask[row]."""
        bitmask[row] = self.grammar.mask(self.prefix)

    @property
    def is_terminated(self) -> bool:
        """A choice is complete and the stop token was accepted."""
        return self.stopped
