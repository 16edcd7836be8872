"""Chapter 03 — the generate loop, without a cache: the simplest thing that produces a reply.

    ids = prompt
    repeat:
        logits = model(ids)[-1]            # the WHOLE sequence again, every step
        next_id = sample(logits, params)   # greedy, or temperature / top-k / top-p
        ids.append(next_id)
        stop?                              # EOS, a stop token, a stop string, max_tokens

Step t runs the model over prompt_len + t tokens although only the last position is new, so
a reply of n tokens costs about n * (prompt_len + n/2) token-forwards. Chapter 04 keeps the
keys and values of past tokens in a cache and makes each step cost one token; it plugs in at
`next_token_logits`, the only place that touches the model.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from nanoserve.kv.naive import NaiveKVCache
from nanoserve.sampling import SamplingParams, make_generator
from nanoserve.text.output_text import add_token_to_output


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the generated ids, including the EOS / stop token that ended them
    text: str  # their text, cut before a stop string, without special tokens
    finish_reason: str  # "stop" or "length"


def next_token_logits(model, token_ids: list[int], cache: NaiveKVCache | None = None) -> torch.Tensor:
    """The logits of the token after `token_ids`. -> (vocab,)

    No cache: run the model over the whole sequence. With a cache (chapter 04): run only the
    tokens it does not hold yet, the whole prompt at the first step (prefill), then the one
    token sampled last (decode), and let them attend to the cached keys and values.
    """
    if cache is None:
        hidden = model(torch.tensor(token_ids))  # (num_tokens, hidden)
    else:
        new_ids = token_ids[cache.num_cached:]  # prefill: the prompt; decode: 1 token
        hidden = model(torch.tensor(new_ids), cache.positions(len(new_ids)), cache)  # (len(new_ids), hidden)
        cache.advance(len(new_ids))
    return model.compute_logits(hidden[-1:])[0]  # (vocab,)


def check_prompt_fits(prompt_len: int, max_model_len: int) -> None:
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len >= max_model_len:
        raise ValueError(
            f"the prompt is {prompt_len} tokens but the model's context is {max_model_len} tokens "
            f"(and at least one new token must fit)"
        )


@torch.inference_mode()
def generate(model, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int, tokenizer=None,
             on_text: Callable[[str], None] | None = None, use_cache: bool = False,
             modules: Callable[[str], ModuleType] = importlib.import_module) -> GenerationOutput:
    """Generate after `prompt_token_ids` until a stop condition. With a `tokenizer` the output has
    text, and `on_text(delta)` is called as text becomes final (for streaming to a terminal).
    `use_cache` keeps past keys and values in a NaiveKVCache (chapter 04), faster: the same logits up to float
    rounding, so the same tokens except at a near-tie.
    `modules(name)` gives the sampler, detokenizer, stop check, cache and the cache's attention: the reference's,
    or with `StudentCode("01,03,04").module` your finished exercises (`generate --student`, nanoserve/student.py)."""
    sampling, stop = modules("nanoserve.sampling"), modules("nanoserve.text.stop")
    max_model_len = model.config.max_position_embeddings
    check_prompt_fits(len(prompt_token_ids), max_model_len)
    cache = None
    if use_cache:  # reserved up front for the longest this request can get
        max_len = min(len(prompt_token_ids) + params.max_tokens, max_model_len)
        naive, attention = modules("nanoserve.kv.naive"), modules("nanoserve.model.attention")
        cache = naive.NaiveKVCache(model.config, max_len, dtype=model.norm.weight.dtype,  # the activations' dtype
                                   attention=attention.scaled_dot_product_attention)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need text: pass a tokenizer")
    generator = make_generator(params)
    detokenizer = None if tokenizer is None else modules("nanoserve.text.detokenizer").IncrementalDetokenizer(tokenizer)
    # While streaming, hold back text that could be the start of a stop string.
    hold_back = max((len(s) for s in params.stop), default=1) - 1
    token_ids: list[int] = []
    text, streamed, finish_reason = "", 0, None

    while finish_reason is None:
        token_id = sampling.sample(next_token_logits(model, prompt_token_ids + token_ids, cache), params, generator)
        token_ids.append(token_id)
        # detokenize (no text for a stop token), check_stop, flush at the finish: the engine's step too
        finish_reason, text = add_token_to_output(token_ids, text, params, eos_token_id, detokenizer, stop,
                                                  context_full=len(prompt_token_ids) + len(token_ids) >= max_model_len)
        if on_text is not None:
            final = len(text) if finish_reason else max(streamed, len(text) - hold_back)
            if final > streamed:
                on_text(text[streamed:final])
                streamed = final

    return GenerationOutput(list(prompt_token_ids), token_ids, text, finish_reason)
