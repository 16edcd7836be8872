"""Chapter 08 — log probabilities in OpenAI's two response shapes.

The engine gives one TokenLogprob per generated token (nanoserve/engine/sampler.py): the token, log p of
it under the model's raw float32 logits (before penalties, temperature or filters: vLLM's default
`raw_logprobs`; under a response_format, over the tokens the grammar allows), its rank, and the k most likely
tokens (fewer when the grammar allows fewer: a forbidden token has probability 0 and is never listed). The
two endpoints dress it differently:

    chat ("logprobs": true, "top_logprobs": 2)
      {"content": [{"token": " Paris", "logprob": -0.31, "bytes": [32, 80, 97, 114, 105, 115],
                    "top_logprobs": [{"token": " Paris", "logprob": -0.31, "bytes": [...]}, {...}]}, ...],
       "refusal": null}
    completions ("logprobs": 2)
      {"tokens": [" Paris", ...], "token_logprobs": [-0.31, ...],
       "top_logprobs": [{" Paris": -0.31, " Lyon": -2.7}, ...], "text_offset": [0, ...]}

With "echo": true the completions shape starts with the prompt's tokens (the prompt logprobs, chapter 08's
perplexity use case): the first has no logprob (nothing precedes it), so its token_logprobs and top_logprobs
entries are null, as OpenAI's and vLLM's.

    completions ("prompt": "The cat", "echo": true, "logprobs": 1, "max_tokens": 1)
      {"tokens": ["The", " cat", " sat"], "token_logprobs": [null, -9.1, -2.3],
       "top_logprobs": [null, {",": -3.2}, {" sat": -2.3}], "text_offset": [0, 3, 7]}

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



def echo_logprobs(tokenizer, prompt_token_ids: list[int], prompt_entries: list, entries: list) -> dict:
    """The completion choice's `logprobs` with echo: the prompt's tokens — the first without a logprob, then
    prompt_entries[1:] (RequestOutput.prompt_logprobs) — followed by the generated tokens' `entries`;
    text_offset runs on over both, as the choice's text is the prompt's followed by the completion's."""
    first = tokenizer.id_to_bytes[prompt_token_ids[0]].decode("utf-8", errors="replace")
    rest = completion_logprobs(tokenizer, prompt_entries[1:] + entries, len(first))
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}
