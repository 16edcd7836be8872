"""Every rung that `--student NN` can serve is shown serving by a test, and that test checks the run's report.

Read from the sources, not run: a module *serves* when the product loads it through `student.module("…")`
(the engine, the server, the routers, …); its rungs are the exercise ids of its pristine stub ("Exercise 5.4").
A *serving test* of chapter NN is a test function that selects NN for `--student` (`student="NN"`, `["NN", …]`,
`True`, or `--student NN` / a bare `--student` on a command line); it *names* a rung when one of its strings is
one of the rung's functions as the report counts their calls ("BlockManager.allocate_slots", "slot_mapping") or
the rung's id (a test parametrized over rung ids looks the names up in `student.RUNGS`). A class's bare name does
not count: a test that shows the rung falling back names it too.

GAPS holds the rungs no serving test names today. The test fails on a new gap (a rung that serves with no test
showing it) and on a listed gap that a test now covers (strike it from GAPS).
"""

import ast
import re
from pathlib import Path

from nanoserve import student
from nanoserve.student import STUDENT_FILES, unfinished

ROOT = Path(__file__).resolve().parent.parent

GAPS: dict[str, set[str]] = {}


def serving_modules() -> set[str]:
    """The exercise modules the product loads through student.module(...)."""
    loaded = set()
    for path in (ROOT / "nanoserve").rglob("*.py"):
        if path.name != "student.py":
            loaded |= set(re.findall(r'(?:module|load)\(\s*"(nanoserve\.[\w.]+)"', path.read_text()))
    return loaded & set(STUDENT_FILES)


def rungs(modules: set[str]) -> dict[str, dict[str, set[str]]]:
    """chapter -> exercise id ("5.4") -> the names the report prints for its functions."""
    found: dict[str, dict[str, set[str]]] = {}
    for module in modules:
        path = student.EXERCISES / STUDENT_FILES[module]
        for exercise, qualnames in unfinished(path).items():
            names = {q for q in qualnames if q != "module"}
            chapter = found.setdefault(STUDENT_FILES[module][:2], {})
            chapter.setdefault(exercise.removeprefix("Exercise "), set()).update(names)
    return found


def serving_tests() -> list[tuple[str, str, set[str]]]:
    """(test file, test function source, the test's string constants) of every test function."""
    tests = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                strings = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
                tests.append((path.name, ast.get_source_segment(source, node), strings))
    return tests


def selects(source: str, chapter: str) -> bool:
    n = str(int(chapter))
    return any(re.search(pattern, source) for pattern in (
        r"student\s*=\s*True",
        rf"student\s*=\s*[\"'][\d,\s]*\b0?{n}\b",
        rf"student\s*=\s*\[[^\]]*[\"']0?{n}[\"']",
        rf"--student[\"',\s]+[\d,]*\b0?{n}\b",
        r"[\"']--student[\"']\s*(\]|,\s*[\"']--)",  # --student with no value: every chapter
    ))


def names_rung(strings: set[str], exercise: str, names: set[str]) -> bool:
    words = {w for s in strings for w in re.findall(r"[\w.]+", s)}
    return exercise in strings or bool(words & names)


def test_every_serving_rung_is_shown_serving_and_named_by_a_test():
    tests = serving_tests()
    gaps: dict[str, set[str]] = {}
    for chapter, ladder in rungs(serving_modules()).items():
        chapter_tests = [strings for _, source, strings in tests if selects(source, chapter)]
        for exercise, names in ladder.items():
            if not any(names_rung(strings, exercise, names) for strings in chapter_tests):
                gaps.setdefault(chapter, set()).add(exercise)
    new = {ch: sorted(ex - GAPS.get(ch, set())) for ch, ex in gaps.items() if ex - GAPS.get(ch, set())}
    closed = {ch: sorted(ex - gaps.get(ch, set())) for ch, ex in GAPS.items() if ex - gaps.get(ch, set())}
    assert not new, f"rungs that serve with no test showing them serve and naming them in the report: {new}"
    assert not closed, f"covered now: strike them from GAPS: {closed}"


def test_the_check_sees_a_serving_test_and_a_gap():
    """The reading itself, on chapter 05 (covered rung by rung) and on a made-up test that names nothing."""
    ladder = rungs(serving_modules())["05"]
    assert set(ladder) == {"5.1", "5.2", "5.3", "5.4", "5.5", "5.6"} and "BlockManager.allocate_slots" in ladder["5.4"]
    assert selects('serve(tiny, student="05")', "05") and selects('["batch", "--student", "05,06"]', "06")
    assert not selects('serve(tiny, student="15")', "05") and not selects("student=False", "05")
    assert names_rung({'calls["BlockManager.allocate_slots"] > 0'}, "5.4", ladder["5.4"])
    assert not names_rung({"tokens == expected"}, "5.4", ladder["5.4"])
