"""`python -m nanoserve COMMAND ...`: one module per command in this folder.

Each module defines `register(subparsers)`, which adds its parser and sets `func` to the
function that runs it with the parsed arguments. A user's mistake is one line `error: …` and
exit status 2 (see checks.py, the checks every command shares).
"""

import importlib
import sys
import warnings

from nanoserve.cli.checks import Parser, UsageError

COMMANDS = ["info", "bench", "serve", "proxy", "chat", "memory", "batch", "generate", "lora_train"]


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="python -m nanoserve", description="nanoserve: an LLM inference server, built chapter by chapter.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each command module imports only argparse-level things at the top (torch, Ray, uvicorn wait in its run), so
    # --help and a mistyped flag are answered in well under a second. bench is the exception: each of its
    # benchmarks is a module that imports torch, so only the one named on the command line is registered.
    words = [a for a in argv if not a.startswith("-")]
    for name in COMMANDS:
        module = importlib.import_module(f"nanoserve.cli.{name}")
        if name == "bench":
            if words[:1] != ["bench"]:
                only = []  # another command (or none yet): no benchmark is needed
            elif words[1:2] and words[1] in module.BENCHMARKS:
                only = words[1:2]  # `bench NAME ...`: that one
            else:
                only = None  # `bench --help`, or a name that is none: all of them, to list
            module.register(sub, only=only)
        else:
            module.register(sub)
    args = parser.parse_args(argv)
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning  # not our source line
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning
