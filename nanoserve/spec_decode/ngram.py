"""Chapter 14 — n-gram prompt lookup (vLLM's `ngram` proposer, Saxena's prompt-lookup decoding).

Summaries, rewrites and extractions copy spans of their input. So: take the last n tokens of the
sequence, find where they occurred before (in the prompt or in the output so far) and propose the k
tokens that followed that occurrence. Try the longest n first (a longer match is more specific);
the earliest occurrence wins, as in Hugging Face's prompt lookup: it is usually in the prompt, the text
being copied, and it has the longest continuation (the latest one may be only a token from the end).

    tokens = [the cat sat on the mat . the cat]      min_n = 1, max_n = 3, k = 3
    n = 3: ". the cat" — not seen before
    n = 2: "the cat" at positions 0-1 -> propose what followed: [sat on the]

It costs a scan of the token list and no model at all, which is why it is the first thing to try.
"""


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the first occurrence of the longest suffix that occurred before.

        >>> NgramProposer(1, 3).propose([1, 2, 3, 4, 9, 1, 2], 3)   # "1 2" occurred at 0: 3 4 9 followed
        [3, 4, 9]
        >>> NgramProposer(1, 3).propose([1, 2, 3], 2)                # nothing repeats
        []
        """
        n_tokens = len(token_ids)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[n_tokens - n:]
            # the first start i < n_tokens - n with token_ids[i:i+n] == suffix (not the suffix itself)
            for i in range(n_tokens - n):
                if token_ids[i:i + n] == suffix:
                    return token_ids[i + n:i + n + k]
        return []
