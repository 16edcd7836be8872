"""Chapter 03 — when does a request finish? The same check serves the generate loop of this
chapter and the engine of chapter 06 (as vLLM's `check_stop` does), called after every new token.

In this order:
1. the new token is EOS (unless ignore_eos) or one of stop_token_ids  -> "stop".
   The token stays in token_ids, but its text is not part of the output.
2. the text now contains a stop string                                -> "stop", and the text
   is cut just before it ("Hello.\nUser:" with stop ["\nUser:"] -> "Hello.").
3. max_tokens new tokens                                              -> "length".
"""

from nanoserve.sampling import SamplingParams


def is_stop_token(token_id: int, params: SamplingParams, eos_token_id: int) -> bool:
    """Does this token end the request? (Its text is then left out of the output.)"""
    return (token_id == eos_token_id and not params.ignore_eos) or token_id in params.stop_token_ids


def find_stop_string(text: str, params: SamplingParams, num_new_chars: int | None = None) -> int | None:
    """Where the first stop string in `text` begins, or None.

    Only the last `num_new_chars` characters are new, so a stop string can only *end* there:
    we search from num_new_chars + len(stop) - 1 characters back, not the whole text every step.
    """
    first = None
    for stop in params.stop:
        start = 0 if num_new_chars is None else max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (first is None or i < first):
            first = i
    return first


def check_stop(token_ids: list[int], text: str, params: SamplingParams, eos_token_id: int,
               num_new_chars: int | None = None) -> tuple[str | None, str]:
    """(finish_reason or None, the output text cut before a stop string).

    token_ids: the *generated* ids so far, the newest last; text: their detokenized text (without
    the text of a stop token); num_new_chars: how much of `text` the newest token added (None: all).
    """
    if is_stop_token(token_ids[-1], params, eos_token_id):
        return "stop", text
    cut = find_stop_string(text, params, num_new_chars)
    if cut is not None:
        return "stop", text[:cut]
    if len(token_ids) >= params.max_tokens:
        return "length", text
    return None, text
