"""Chapter 03 — the tokenizer: text <-> token ids, built from the vocabulary inside the GGUF file.

SmolLM2 uses *byte-level BPE* (as GPT-2 did). Three steps turn text into ids:

1. pre-tokenize: cut the text into pieces that BPE never merges across. SmolLM2's pre-tokenizer
   (`tokenizer.ggml.pre = 'smollm'`) first isolates every digit, then applies GPT-2's regex
   (words with their leading space, runs of punctuation, runs of whitespace):
       "a  123 cats!"  ->  "a", "  ", "1", "2", "3", " cats", "!"
2. byte-level: write each piece as UTF-8 bytes, and each byte as one printable character
   (`bytes_to_unicode`: the space byte 0x20 becomes 'Ġ', the newline 0x0A becomes 'Ċ').
   So every string is spellable and there is no "unknown" token.
3. BPE: starting from single bytes, apply the learned merges ('Ġ t' -> 'Ġt', 'Ġt he' -> 'Ġthe',
   ... 48,900 of them, in rank order) until none applies; each final piece is a vocabulary entry.

Special tokens (`<|im_start|>`, `<|im_end|>`, ...; token_type 3 = CONTROL in the GGUF) are
matched whole before any of this, so the chat template's markers become single ids.

We let HF `tokenizers` (Rust) run these steps: it is fast and exact. Decoding we do ourselves,
because streaming needs the raw *bytes* of every token (see `detokenizer.py`): a Chinese
character is 3 bytes and an emoji 4, and byte-level BPE can split them across tokens.
"""

from pathlib import Path

from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from nanoserve.text.chat_template import render_chat_template
from nanoserve.model.gguf_loader import embedded_gguf_path, gguf_metadata, open_gguf

CONTROL = 3  # llama.cpp's token_type for special tokens (1 = NORMAL)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table. Printable Latin-1 bytes map to themselves;
    the other 68 (control bytes, space, 0x7F-0xA0, 0xAD) map to U+0100 onwards, in byte order.

        >>> t = bytes_to_unicode(); t[ord(" ")], t[ord("\\n")], t[ord("a")]
        ('Ġ', 'Ċ', 'a')
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """`tokenizer.ggml.pre = 'smollm'`: split every digit on its own, then GPT-2's byte-level regex.
    (llama.cpp does the same; transformers' GGUF converter drops the digit split, see chapter 03.)"""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )


PRE_TOKENIZERS = {"smollm": smollm_pre_tokenizer}


class Tokenizer:
    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str, chat_template: str,
                 bos_token_id: int, eos_token_id: int):
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)})")
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.chat_template = chat_template
        self.special_ids = {i for i, t in enumerate(token_types) if t == CONTROL}

        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
        self._hf = HFTokenizer(bpe)
        self._hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
        self._hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(self.special_ids)])

        # Every token as raw bytes: undo the byte -> character table (special tokens are plain UTF-8).
        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self.id_to_bytes: list[bytes] = [
            t.encode() if i in self.special_ids else bytes(char_to_byte[c] for c in t) for i, t in enumerate(tokens)
        ]

    @classmethod
    def from_gguf(cls, path: str | Path | None = None) -> "Tokenizer":
        """The tokenizer stored in a GGUF file (default: the embedded SmolLM2-135M-Instruct)."""
        reader = open_gguf(path or embedded_gguf_path())
        model = gguf_metadata(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model = {model!r}: only byte-level BPE ('gpt2') is supported")
        return cls(
            tokens=gguf_metadata(reader, "tokenizer.ggml.tokens"),
            token_types=gguf_metadata(reader, "tokenizer.ggml.token_type"),
            merges=gguf_metadata(reader, "tokenizer.ggml.merges"),
            pre=gguf_metadata(reader, "tokenizer.ggml.pre"),
            chat_template=gguf_metadata(reader, "tokenizer.chat_template"),
            bos_token_id=gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
        )

    def encode(self, text: str) -> list[int]:
        """Text -> ids. No BOS is prepended (the GGUF says add_bos_token = False); special-token
        text such as '<|im_end|>' becomes its single id."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """Ids -> text: concatenate the tokens' bytes, then decode UTF-8 once. Bytes that do not
        form valid UTF-8 (a sequence cut in the middle of a character) become U+FFFD '�'."""
        for i in token_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        data = b"".join(self.id_to_bytes[i] for i in token_ids if not (skip_special_tokens and i in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt,
            bos_token=self.tokens[self.bos_token_id], eos_token=self.tokens[self.eos_token_id],
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Messages -> the prompt ids the engine sees."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))
