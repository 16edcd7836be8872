"""What a chapter says and what its committed notebook printed, for the tests that hold both to the code
(tests/test_chNN_worked_examples.py): a worked example in the text must be what the code computes, and a
figure the text quotes from the notebook must be what the notebook printed.

Whitespace is normalised (every run of spaces and line breaks becomes one space), so a quoted phrase may wrap.
"""

import json
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def normalise(text: str) -> str:
    return " ".join(text.split())


@cache
def chapter(number: str) -> str:
    """The text of chapters/NN-*.md, whitespace normalised."""
    (path,) = (ROOT / "chapters").glob(f"{number}-*.md")
    return normalise(path.read_text())


@cache
def notebook_output(number: str) -> str:
    """Everything the committed notebooks/NN-*.ipynb printed (stdout and text results), whitespace normalised."""
    (path,) = (ROOT / "notebooks").glob(f"{number}-*.ipynb")
    texts = []
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    return normalise("\n".join(texts))


@cache
def notebook_lines(number: str) -> tuple[str, ...]:
    """The lines the committed notebooks/NN-*.ipynb printed, cell by cell, each whitespace normalised. A cell's
    stdout is joined before it is split (the kernel may cut one print's output into several chunks), then its
    stderr and its text results."""
    (path,) = (ROOT / "notebooks").glob(f"{number}-*.ipynb")
    lines = []
    for cell in json.loads(path.read_text())["cells"]:
        outputs = cell.get("outputs", [])
        streams = ["".join("".join(o["text"]) for o in outputs if o.get("name") == name)
                   for name in ("stdout", "stderr")]
        results = ["".join(o.get("data", {}).get("text/plain", "")) for o in outputs]
        for text in (*streams, *results):
            lines += [normalise(line) for line in text.splitlines() if line.strip()]
    return tuple(lines)


def says(number: str, phrase: str) -> None:
    """Assert that chapter NN says `phrase` (computed by the caller from the code), word for word."""
    assert normalise(phrase) in chapter(number), f"chapter {number} does not say: {phrase!r}"


def table_rows(number: str, first_cell: str) -> list[list[str]]:
    """The rows of chapter NN's markdown tables (indented too) whose first cell matches the regex `first_cell`."""
    (path,) = (ROOT / "chapters").glob(f"{number}-*.md")
    rows = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("|"):  # a table may sit indented in a list item
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if cells and re.fullmatch(first_cell, cells[0]):
                rows.append(cells)
    return rows


def word(n: int) -> str:
    """A small count as the chapters write it in prose: 3 -> 'three'."""
    return ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
            "seventeen eighteen nineteen twenty").split()[n]


def command_defaults(module, command: str, *argv: str):
    """The arguments a CLI command (a module with `register(sub)`) gets when `argv` alone is given: its defaults."""
    import argparse

    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers())
    return parser.parse_args([command, *argv])
