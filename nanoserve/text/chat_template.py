"""Chapter 03 — the chat template: from a list of messages to the one string the model was trained on.

A chat model never sees "messages". It sees text with role markers that its fine-tuning data
used. SmolLM2 uses ChatML; its GGUF carries the template as Jinja source under
`tokenizer.chat_template`, and for

    [{"role": "user", "content": "hi"}]     with add_generation_prompt=True

it renders

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    hi<|im_end|>
    <|im_start|>assistant
                                  <- the model writes the reply from here

`add_generation_prompt` appends the opening of the assistant's turn, so the most likely next
tokens are the reply rather than another user message. We render with the same Jinja settings
as transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, loop controls),
so both give the same text.
"""

from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def validate_messages(messages) -> None:
    """A chat is a list of {"role": str, "content": str} dicts; anything else is a ValueError."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {m.get(key)!r}")


def _raise_exception(message: str):
    # templates call `raise_exception('...')` to reject a chat they cannot render
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **special_tokens) -> str:
    """Render `messages` with the Jinja `template`; `special_tokens` (bos_token=..., eos_token=...)
    are visible to the template as variables, as transformers passes them."""
    validate_messages(messages)
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
