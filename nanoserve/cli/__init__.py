"""`python -m nanoserve COMMAND ...`: one module per command in this folder.

Each module defines `register(subparsers)`, which adds its parser and sets `func` to the
function that runs it with the parsed arguments.
"""

import argparse
import importlib
import sys

COMMANDS = ["info", "bench", "serve", "memory", "batch", "generate"]


def weight_formats(names: list[str]) -> list[str] | None:
    """`--weights` names checked before any model loads (chapter 10); None after printing the one error line."""
    from nanoserve.model.quant import check_weight_format

    try:
        return [check_weight_format(name) for name in names]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve", description="nanoserve: an LLM inference server, built chapter by chapter.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"nanoserve.cli.{name}").register(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0
