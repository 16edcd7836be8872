"""`python -m nanoserve COMMAND ...`: one module per command in this folder.

Each module defines `register(subparsers)`, which adds its parser and sets `func` to the
function that runs it with the parsed arguments. A user's mistake is one line `error: …` and
exit status 2 (see checks.py, the checks every command shares).
"""

import importlib
import sys
import warnings

from nanoserve.cli.checks import Parser, UsageError

COMMANDS = ["info", "bench", "serve", "chat", "memory", "batch", "generate"]


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m nanoserve", description="nanoserve: an LLM inference server, built chapter by chapter.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"nanoserve.cli.{name}").register(sub)
    args = parser.parse_args(argv)
    formatwarning, warnings.formatwarning = warnings.formatwarning, _one_line_warning  # not our source line
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning
