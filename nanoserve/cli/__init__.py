"""`python -m nanoserve COMMAND ...`: one module per command in this folder.

Each module defines `register(subparsers)`, which adds its parser and sets `func` to the
function that runs it with the parsed arguments.
"""

import argparse
import importlib
import sys

COMMANDS = ["info", "bench", "serve", "memory", "batch", "generate", "chat"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one `error: ...` line and exit status 2 (no usage dump)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m nanoserve", description="nanoserve: an LLM inference server, built chapter by chapter.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"nanoserve.cli.{name}").register(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0
