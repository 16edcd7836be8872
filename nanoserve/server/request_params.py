"""Chapter 08 — a validated request becomes the engine's SamplingParams (exercise 8.1).

pydantic has already checked each field on its own (types, strictly; ranges; unknown fields refused, in
protocol.py). What is left needs the request as a whole and the server's limits:

    {"messages": [...], "n": 4}                                      prompt of 37 tokens, max_seq_len 2048
      max_tokens    not given: chat may use what the context (and the KV pool) leaves -> 2048 - 37 = 2011
      the work      n * max_tokens = 4 * 2011 = 8044 generated tokens <= max_request_tokens (65 536)
      logprobs      chat's logprobs: true + top_logprobs: 2 -> 2   (top_logprobs alone is a 400)
                    (completions with echo: logprobs N also scores the prompt -> prompt_logprobs N)
      the grammar   response_format / structured_outputs -> StructuredOutputsParams (chapter 13)
      -> SamplingParams(temperature=..., max_tokens=2011, n=4, logit_bias={int id: bias}, ...)

and every refusal is APIError(400, message, param): OpenAI's error body names the field (`param`) the client
has to change. What SamplingParams itself refuses (an empty stop string) is a 400 too, never a 500.
"""

from nanoserve.sampling import SamplingParams
from nanoserve.server.protocol import APIError, ChatCompletionRequest


def to_sampling_params(req, num_prompt_tokens: int, max_seq_len: int, max_request_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a validated request (a ChatCompletionRequest or CompletionRequest).

    max_seq_len: the most tokens (prompt + output) one request may hold here; max_request_tokens: the most
    generated tokens (n × max_tokens) one request may ask for. Raises APIError(400, ..., param).

        chat, no max_tokens, 37-token prompt, max_seq_len 2048   -> max_tokens 2011
        completions, no max_tokens                               -> max_tokens 16 (OpenAI's default)
        n 16, max_tokens 8192, max_request_tokens 65 536         -> 400, param "n"
        n 1, max_tokens 10**9                                    -> 400, param "max_tokens" (alone too many)
    """
    if num_prompt_tokens >= max_seq_len:  # whatever max_tokens says, the prompt is what has to change
        where = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise APIError(400, f"the prompt has {num_prompt_tokens} tokens, this server holds at most "
                            f"{max_seq_len} per request: no room for a reply", where)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:  # as vLLM: whatever the context (here: and the KV pool) leaves
        max_tokens = max_seq_len - num_prompt_tokens
    if req.n * max_tokens > max_request_tokens:  # n completions of max_tokens each: the work asked for
        # the field to change: max_tokens when it alone is past the bound, else n
        param = "n" if max_tokens <= max_request_tokens else \
            "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"n * max_tokens = {req.n} * {max_tokens} exceeds this server's bound of "
                            f"{max_request_tokens} generated tokens per request", param)
    structured, logprobs = req.structured_params(), req.num_logprobs  # each raises its own 400
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos, n=req.n,
                              stop_token_ids=req.stop_token_ids, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              min_p=req.min_p, logprobs=logprobs, prompt_logprobs=req.num_prompt_logprobs,
                              logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                              structured=structured)
    except ValueError as e:  # what the models cannot say, SamplingParams does: its message starts with the field
        raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None
