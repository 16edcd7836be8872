"""Exercise 03 (3.3) — when does a request finish?

Your version of nanoserve/text/stop.py: same names, same signatures. Replace each
`raise NotImplementedError` with your code, then run `make grade CH=03`.
The loop calls `check_stop` after every new token; the conditions, in order of precedence:
a stop token (EOS unless ignore_eos, or one of params.stop_token_ids), then a stop string, then
max_tokens.
"""

from nanoserve.sampling import SamplingParams


def is_stop_token(token_id: int, params: SamplingParams, eos_token_id: int) -> bool:
    """Exercise 3.3. Does this token end the request? True for `eos_token_id` (unless
    params.ignore_eos) and for any id in params.stop_token_ids.

    >>> is_stop_token(2, SamplingParams(), 2), is_stop_token(2, SamplingParams(ignore_eos=True), 2)
    (True, False)
    """
    raise NotImplementedError("Exercise 3.3: write is_stop_token")


def find_stop_string(text: str, params: SamplingParams, num_new_chars: int | None = None) -> int | None:
    """Exercise 3.3. Where the earliest stop string of params.stop begins in `text`, or None.

    Only the last `num_new_chars` characters of `text` are new (None: all of it is). A stop string
    that lies wholly in the old text was already found a step earlier, so it must NOT be found
    again; one that ends in the new text must be found even if it starts in the old text.

    >>> find_stop_string("abc STOP", SamplingParams(stop=["STOP"]), num_new_chars=1)
    4
    >>> find_stop_string("STOP abcdef", SamplingParams(stop=["STOP"]), num_new_chars=1) is None
    True
    """
    raise NotImplementedError("Exercise 3.3: write find_stop_string")


def check_stop(token_ids: list[int], text: str, params: SamplingParams, eos_token_id: int,
               num_new_chars: int | None = None) -> tuple[str | None, str]:
    """Exercise 3.3. (finish_reason or None, the output text), after the newest token.

    token_ids: the generated ids so far, newest last; text: their text (without a stop token's);
    num_new_chars: how much of `text` the newest token added (None: all).
    - the newest token is a stop token                    -> ("stop", text)
    - a stop string is in the text                        -> ("stop", text cut just before it)
    - len(token_ids) reached params.max_tokens            -> ("length", text)
    - otherwise                                           -> (None, text)
    A stop string wins over max_tokens (the text is cut either way).

    >>> check_stop([5, 9], "Hello.\\nUser: more", SamplingParams(stop=["\\nUser:"]), 2)
    ('stop', 'Hello.')
    """
    raise NotImplementedError("Exercise 3.3: write check_stop")
