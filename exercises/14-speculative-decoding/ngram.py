"""Exercise 14.1 — the n-gram proposer (prompt lookup).

Your version of nanoserve/spec_decode/ngram.py: same class, same methods. Replace the
`raise NotImplementedError` with your code, then run `make grade CH=14 EX=14.1`.
"""


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        """Exercise 14.1. Keep the shortest and the longest suffix length to match (self.min_n, self.max_n);
        raise ValueError unless 1 <= min_n <= max_n."""
        raise NotImplementedError("Exercise 14.1: check and keep min_n and max_n")

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Exercise 14.1. Up to k token ids that may follow `token_ids` (prompt + output so far).

        The suffix: the last n tokens, for n from max_n down to min_n (never the whole sequence: something
        must come before it). The first n whose suffix also occurs earlier in `token_ids` (an occurrence that
        starts before the suffix itself) decides; of its occurrences, the first one (lowest index) wins.
        Return the (at most k) tokens that followed that occurrence; [] if no suffix occurred before.

            propose([1, 2, 3, 4, 1, 2, 5, 9, 4, 1, 2], 3) -> [5, 9, 4]    ("4 1 2" occurred at 3)
            propose([1, 2, 7, 8, 1, 2, 9, 3, 1, 2], 2)    -> [7, 8]       ("1 2" at 0 and 4: the first)
            propose([3, 3], 4)                            -> [3]          (the continuation ends with the list)
        """
        raise NotImplementedError("Exercise 14.1: find the longest earlier match of the suffix, return what followed")
