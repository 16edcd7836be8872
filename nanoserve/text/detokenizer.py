"""Chapter 03 — the incremental detokenizer: stream text while tokens arrive, one at a time.

Decoding each new token on its own is wrong for byte-level BPE: '你' is the 3 bytes E4 BD A0,
and SmolLM2 spells it as two tokens, 'ä½' (E4 BD) and 'ł' (A0). After the first token we hold
an incomplete character; printing it would show '�', and the next token could not repair it.

So we keep the bytes that do not yet form a whole character and emit only complete text:

    token      bytes        pending         emitted
    'Ġ'        20           -               ' '
    'ä½'       E4 BD        E4 BD           ''        (E4 starts a 3-byte character)
    'ł'        A0           -               '你'

UTF-8 tells from the first byte how long a character is: 0xxxxxxx = 1 byte, 110xxxxx = 2,
1110xxxx = 3, 11110xxx = 4; continuation bytes are 10xxxxxx. The pieces returned by `add`,
followed by `flush()`, concatenate to exactly `tokenizer.decode(all_ids, skip_special_tokens=s)`
with the detokenizer's own `s` (it skips special tokens by default, as vLLM does; `decode` keeps
them by default, as transformers does) — invalid bytes included, which both turn into U+FFFD
the same way.
"""


def utf8_char_len(first_byte: int) -> int:
    """How many bytes the UTF-8 character that starts with `first_byte` has (0: not a start byte)."""
    if first_byte < 0x80:
        return 1
    if first_byte >= 0xF0:
        return 4 if first_byte < 0xF8 else 0
    if first_byte >= 0xE0:
        return 3
    if first_byte >= 0xC0:
        return 2
    return 0  # 10xxxxxx: a continuation byte


def incomplete_tail_len(data: bytes) -> int:
    """How many bytes at the end of `data` are the start of a character still waiting for its
    continuation bytes (0, 1, 2 or 3). Only the length the start byte announces counts, not whether
    the bytes can form a valid character: b"\xe0\x80" waits (2) until a third byte or flush(), and
    then becomes '��' as in the full decode.

        >>> incomplete_tail_len("a你".encode()[:-1])   # 'a', E4 BD
        2
    """
    # A character is at most 4 bytes, so an unfinished one starts within the last 3.
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the start of the last character
            return back if utf8_char_len(byte) > back else 0
    return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pending = b""  # bytes of a character that is not complete yet
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Take one token; return the text it completes (possibly '')."""
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        data = self.pending + self.tokenizer.id_to_bytes[token_id]
        keep = incomplete_tail_len(data)
        self.pending = data[len(data) - keep:]
        new_text = data[: len(data) - keep].decode("utf-8", errors="replace")
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """The stream is over: emit what is still pending (an unfinished character becomes '�')."""
        new_text = self.pending.decode("utf-8", errors="replace")
        self.pending = b""
        self.text += new_text
        return new_text
