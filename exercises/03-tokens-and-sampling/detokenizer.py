"""Exercise 03 (3.2) — the incremental detokenizer.

Your version of nanoserve/text/detokenizer.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=03`.
The tokenizer you get has `id_to_bytes` (each token's raw bytes) and `special_ids` (a set).
"""


def utf8_char_len(first_byte: int) -> int:
    """Exercise 3.2. How many bytes the UTF-8 character starting with `first_byte` has:
    0xxxxxxx -> 1, 110xxxxx -> 2, 1110xxxx -> 3, 11110xxx -> 4; 0 for a continuation byte
    10xxxxxx (and for 11111xxx, which never starts a character)."""
    raise NotImplementedError("Exercise 3.2: read the character length from the first byte's high bits")


def incomplete_tail_len(data: bytes) -> int:
    """Exercise 3.2. How many bytes at the end of `data` are the start of a character still
    waiting for continuation bytes (0, 1, 2 or 3).

    Walk back at most 3 bytes over continuation bytes (10xxxxxx) to the last byte that is not one;
    if the character it starts needs more bytes than are there, they are the incomplete tail.

    >>> incomplete_tail_len("a你".encode()[:-1])   # b'a\\xe4\\xbd'
    2
    """
    raise NotImplementedError("Exercise 3.2: find the last start byte and compare its length to what follows")


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        """Exercise 3.2. Keep `tokenizer` and `skip_special_tokens`, and start with two attributes
        the tests read: `self.pending = b""` (the bytes of a character that is not complete yet)
        and `self.text = ""` (everything emitted so far)."""
        raise NotImplementedError("Exercise 3.2: store the tokenizer and the option; pending bytes and text start empty")

    def add(self, token_id: int) -> str:
        """Exercise 3.2. Take one token; return the text it completes (possibly '') and append it
        to self.text. Skip special tokens when skip_special_tokens. Keep an incomplete character's
        bytes in self.pending; decode the rest with errors="replace" (invalid bytes become '�',
        exactly as the full decode does)."""
        raise NotImplementedError("Exercise 3.2: pending + token bytes; emit all but the incomplete tail")

    def flush(self) -> str:
        """Exercise 3.2. The stream is over: decode what is pending (errors="replace"), append it
        to self.text, clear pending and return it."""
        raise NotImplementedError("Exercise 3.2: decode and emit the pending bytes")
