"""Checks of what a user typed, shared by every command. A bad value is ONE line on stderr,
`error: …`, and exit status 2 — found before the model loads wherever it can be:

- argument types (`positive_int`, `fraction`, `input_file`, `output_file`, ...) fail while argparse
  reads the command line, so nothing has loaded yet;
- `UsageError`, raised by a command once it knows more (the prompt's length after tokenizing,
  sampling values), is turned into the same line by `nanoserve.cli.main`.
"""

import argparse
import os
from pathlib import Path


class UsageError(ValueError):
    """A mistake in the command's input: printed as `error: <message>`, exit status 2, no traceback."""


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless there is none (None, False) or the text says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if _no_default(action.default) or action.default == argparse.SUPPRESS or "default" in text \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".strip()


def _no_default(value) -> bool:
    return value is None or value is False  # (not `in (None, False)`: 0 == False)


class Parser(argparse.ArgumentParser):
    """`--help` shows every option's default; a bad argument is one line `error: …` (exit 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        # argparse prints nothing for an option without help text, not even its default
        if not kwargs.get("help") and not _no_default(kwargs.get("default")):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _number(kind, text: str, ok, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, lambda v: v > 0, "an integer > 0")


# an auto|on|off flag (--integer-dot, --native-decode) as LLM's keyword takes it: None lets the engine decide
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def add_pool_size_args(p) -> None:
    """--num-blocks and --kv-cache-mib: two ways to size one KV pool, so a command takes one of them. argparse refuses
    the pair, in either order and whatever the values, with one `error:` line; --kv-cache-mib's default applies only
    where neither is given."""
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, default=None,
                      help="KV pool size in blocks (default: from --kv-cache-mib; not with it)")
    size.add_argument("--kv-cache-mib", type=positive_int, default=1024,
                      help="KV pool bytes, in MiB, where --num-blocks is not given (not with it)")


def non_negative_int(text: str) -> int:
    return _number(int, text, lambda v: v >= 0, "an integer >= 0")


def count_or_all(text: str) -> int:
    """A count of items to take, 0 for none, or -1 for all of them."""
    return _number(int, text, lambda v: v >= -1, "-1 (all), 0 (none) or a count")


def positive_float(text: str) -> float:
    return _number(float, text, lambda v: v > 0, "a number > 0")


def fraction(text: str) -> float:
    return _number(float, text, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def input_file(text: str) -> str:
    """A file that exists and can be read."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: is not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot be read (permission denied)")
    return text


def output_file(text: str) -> str:
    """A file that can be written: not a folder, in a folder that exists and is writable."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: cannot be written (permission denied)")
    return text


def new_file(text: str) -> str:
    """An output_file that does not exist yet: nothing of the user's is taken over (chapter 18's tier file)."""
    if Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: exists; name a new file (it is removed at exit)")
    return output_file(text)


def tier_blocks(text: str) -> int:
    """0 (no tier) or at least 2 slots: a load takes at most half the tier (tiered_block_manager._tier_run)."""
    return _number(int, text, lambda v: v == 0 or v >= 2, "0 or an integer >= 2")


def chapters(text: str) -> str:
    """--student's chapter list ("05,06"), checked against the chapters that have exercises."""
    from nanoserve.student import parse_selection

    try:
        parse_selection(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# each draw-shaping flag's values that mean "not asked" (seed 0 is a seed: only an absent one is off)
OFF = {"top_p": (1.0,), "top_k": (0, -1), "seed": (None,)}


def sampling_params(fields: dict, flags: bool = False):
    """SamplingParams(**fields), or a UsageError naming the bad value as the user wrote it:
    `"temperature" must be a number >= 0, got -1` (a JSON field), `--top-p must be ...` (flags=True). Flags
    also refuse --top-p, --top-k or --seed beside temperature 0 (greedy: they would change nothing; a JSON
    request may carry them, as OpenAI's API allows)."""
    from nanoserve.sampling import SamplingParams

    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        message = str(e)
        name = message.split(" ")[0]
        if name in fields:  # SamplingParams' messages start with the field's name
            message = ("--" + name.replace("_", "-") if flags else f'"{name}"') + message[len(name):]
        raise UsageError(message) from None
    if flags and params.greedy:  # a flag that shapes a draw has nothing to shape: refused, not ignored
        unused = [f"--{k.replace('_', '-')} {v}" for k, v in fields.items() if k in OFF and v not in OFF[k]]
        if unused:
            raise UsageError(f"{', '.join(unused)} need{'s' * (len(unused) == 1)} --temperature > 0 (temperature 0 "
                             f"is greedy: an argmax, nothing is drawn)")
    return params


def load_tokenizer(gguf: str | None):
    """The tokenizer of a GGUF file (None: the embedded model's), a UsageError if the file is not one."""
    from nanoserve.text.tokenizer import Tokenizer

    try:
        return Tokenizer.from_gguf(gguf)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None


def context_length(gguf: str | None) -> int:
    """The model's context (max_position_embeddings), read from the GGUF's metadata without its weights."""
    from nanoserve.model.gguf_loader import config_from_gguf, embedded_gguf_path, open_gguf

    try:
        return config_from_gguf(open_gguf(gguf or embedded_gguf_path())).max_position_embeddings
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None


def check_fits(num_prompt_tokens: int, max_tokens: int, context: int, what: str = "the prompt") -> None:
    if num_prompt_tokens + max_tokens > context:
        raise UsageError(f"{what} is {num_prompt_tokens} tokens; with max_tokens={max_tokens} that exceeds "
                         f"the model's context of {context} tokens")


def attention_backend(text: str) -> str:
    """--attention-backend: a known name that can run here (a GGUF loads on the CPU, where Triton needs its
    interpreter): refused while the command line is read, before the model loads."""
    from nanoserve.kernels.backend import resolve_attention_backend

    try:
        return resolve_attention_backend(text, "cpu")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def weight_format(text: str) -> str:
    """--weights: fp32, int8, q4 or bf16 (chapter 10), refused while the command line is read."""
    from nanoserve.model.quant import check_weight_format

    try:
        return check_weight_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
