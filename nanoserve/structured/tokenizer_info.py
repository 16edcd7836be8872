"""Chapter 13 — xgrammar's view of our vocabulary, built from the GGUF's tokens (nanoserve/text/tokenizer.py).

A grammar speaks characters (bytes); the model speaks token ids. To say which ids may come next, xgrammar
needs the bytes of every token: `Tokenizer.id_to_bytes` holds them already (chapter 03 undid the byte-level
table 'Ġ' -> b' '), so the vocabulary is handed over as RAW bytes, no downloaded tokenizer involved.

    id 39428  b'{"'      id 1245  b'name'      id 2  <|im_end|>  (EOS: allowed once the grammar accepts)

Special tokens (<|im_start|>, <repo_name>, ...) are given as empty strings: xgrammar then never allows
them (they are control ids, not text); the EOS id is passed as the stop token, allowed exactly when the
output so far is a complete sentence of the grammar. `vocab_size` is the width of the logits (49,152 for
SmolLM2), which may exceed the tokenizer's list on padded vocabularies.
"""

import xgrammar as xgr


def vocab_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """Every token id's bytes, b"" for a special token and for the padding ids past the tokenizer's list."""
    vocab = [b"" if i in tokenizer.special_ids else piece for i, piece in enumerate(tokenizer.id_to_bytes)]
    return vocab + [b""] * ((vocab_size or len(vocab)) - len(vocab))


def build_tokenizer_info(tokenizer, vocab_size: int | None = None) -> "xgr.TokenizerInfo":
    """xgrammar's TokenizerInfo from nanoserve's Tokenizer (its GGUF vocabulary)."""
    vocab = vocab_bytes(tokenizer)
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size or len(vocab),
                             stop_token_ids=[tokenizer.eos_token_id])
