"""Chapter 03 — what one new token does to a request's output text: the step that chapter 03's generate loop and
chapter 06's engine both take after every token, so a fix to it reaches both.

    new id ──incremental detokenizer──▶ text + its piece ──check_stop──▶ (finish reason, text cut before a stop string)
            (a stop token adds no text)                       at the finish: + the bytes the detokenizer still holds
"""

import nanoserve.text.stop as reference_stop
from nanoserve.sampling import SamplingParams


def add_token_to_output(token_ids: list[int], text: str, params: SamplingParams, eos_token_id: int, detokenizer=None,
                        stop=reference_stop, context_full: bool = False) -> tuple[str | None, str]:
    """(finish_reason or None, the output text) once the newest of `token_ids` (the generated ids, newest last) is
    added to `text`, the output text before it.

    detokenizer: the request's IncrementalDetokenizer (None: ids only, the text stays ""); stop: the module whose
    is_stop_token and check_stop decide (chapter 03's, or the learner's under `--student 03`); context_full: the
    sequence fills the model's context, so it ends with "length" if nothing else ends it.
    """
    token_id = token_ids[-1]
    new_text = ""
    if detokenizer is not None and not stop.is_stop_token(token_id, params, eos_token_id):
        new_text = detokenizer.add(token_id)  # a stop token's text is not part of the output
    reason, text = stop.check_stop(token_ids, text + new_text, params, eos_token_id, len(new_text))
    if reason is None and context_full:
        reason = "length"
    if reason is not None and detokenizer is not None and len(text) == len(detokenizer.text):
        text += detokenizer.flush()  # not cut at a stop string: an unfinished character's bytes become '�'
    return reason, text
