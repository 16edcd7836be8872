"""Chapter 08 — log probabilities in OpenAI's two response shapes.

The engine gives one TokenLogprob per generated token (nanoserve/engine/sampler.py): the token, log p of
it under the model's raw float32 logits (before penalties, temperature or filters, as OpenAI reports it
and as vLLM's default `raw_logprobs`), its rank, and the k most likely tokens. The two endpoints dress
it differently:

    chat ("logprobs": true, "top_logprobs": 2)
      {"content": [{"token": " Paris", "logprob": -0.31, "bytes": [32, 80, 97, 114, 105, 115],
                    "top_logprobs": [{"token": " Paris", "logprob": -0.31, "bytes": [...]}, {...}]}, ...],
       "refusal": null}
    completions ("logprobs": 2)
      {"tokens": [" Paris", ...], "token_logprobs": [-0.31, ...],
       "top_logprobs": [{" Paris": -0.31, " Lyon": -2.7}, ...], "text_offset": [0, ...]}

A token's text is its own bytes decoded alone, so a token that holds half of a UTF-8 character reads
as '�' there; the chat shape's `bytes` carries the exact bytes (OpenAI's reason for the field).
"""


def chat_logprobs(tokenizer, entries: list) -> dict:
    """The chat choice's `logprobs` of these TokenLogprobs."""

    def one(token_id: int, logprob: float) -> dict:
        raw = tokenizer.id_to_bytes[token_id]
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(tokenizer, entries: list, offset: int = 0) -> dict:
    """The completion choice's `logprobs` of these TokenLogprobs; `offset`: where their text starts in
    the choice's text (text_offset counts characters from there)."""

    def text(token_id: int) -> str:
        return tokenizer.id_to_bytes[token_id].decode("utf-8", errors="replace")

    tokens, offsets, position = [], [], offset
    for e in entries:
        tokens.append(text(e.token_id))
        offsets.append(position)
        position += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}
