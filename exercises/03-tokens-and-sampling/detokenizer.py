"""Exercise 03 (3.2) — the incremental detokenizer.

Your version of nanoserve/text/detokenizer.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=03`.
The tokenizer you get has `id_to_bytes` (each token's raw bytes) and `special_ids` (a set).
"""


def utf8_char_len(first_byte: int) -> int:
    """Exercise 3.2. How many bytes the UTF-8 character starting with `first_byte` (0-255) has:
    0xxxxxxx -> 1, 110xxxxx -> 2, 1110xxxx -> 3, 11110xxx -> 4; 0 for a continuation byte
    10xxxxxx (and for 11111xxx, which never starts a character).

    >>> utf8_char_len(0xE4), utf8_char_len(0xBD), utf8_char_len(0xF8)   # '你' starts E4; BD continues; F8 is none
    (3, 0, 0)
    """
    raise NotImplementedError("Exercise 3.2: write utf8_char_len")


def incomplete_tail_len(data: bytes) -> int:
    """Exercise 3.2. How many bytes at the end of `data` must wait for more bytes: find the last start byte
    (not 10xxxxxx) among the last 3 bytes; if `utf8_char_len` announces more bytes than it and the bytes after
    it make, return that count (1, 2 or 3); else 0 (data ends with a complete character, is empty, or its last
    3 bytes are all continuation bytes). Only the length counts: whether the bytes could ever form a valid
    character is not checked. b"\xe0\x80" (overlong) and b"\xf4\x90" (past U+10FFFF) give 2, b"\xf5" gives 1:
    they wait until the bytes their first byte announces have arrived, or until flush() at the end of the
    stream, and then decode to '�' just as in the full decode.

    >>> incomplete_tail_len("a你".encode()[:-1])   # b'a\\xe4\\xbd': E4 announces 3 bytes, 2 are there
    2
    >>> incomplete_tail_len("a你".encode()), incomplete_tail_len(b"\\x80\\x80\\x80")
    (0, 0)
    """
    raise NotImplementedError("Exercise 3.2: write incomplete_tail_len")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """Exercise 3.2. Keep `tokenizer` and `skip_special_tokens`, and start with two attributes
        the tests read: `self.pending = b""` (the bytes of a character that is not complete yet)
        and `self.text = ""` (everything emitted so far)."""
        raise NotImplementedError("Exercise 3.2: write IncrementalDetokenizer.__init__")

    def add(self, token_id: int) -> str:
        """Exercise 3.2. Take one token; return the text it completes (possibly '') and append it to self.text.
        A special token adds nothing when skip_special_tokens. No piece ever holds part of a character that
        a later token could complete: those bytes wait in self.pending (at most 3).
        Invariant: the pieces of add, then flush(), concatenate to exactly
        tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) — invalid bytes included, which
        become '�' just as there.

        ' 你' is the tokens 'Ġ' (20), 'ä½' (E4 BD), 'ł' (A0): add returns ' ', then '' (E4 BD wait), then '你'.
        """
        raise NotImplementedError("Exercise 3.2: write IncrementalDetokenizer.add")

    def flush(self) -> str:
        """Exercise 3.2. The stream is over: decode what is pending (errors="replace"), append it
        to self.text, clear pending and return it."""
        raise NotImplementedError("Exercise 3.2: write IncrementalDetokenizer.flush")
