"""Grade a chapter's exercises: `make grade CH=05` (or `python exercises/grade.py 05`).

Runs the chapter's graded tests (those marked `@pytest.mark.exercise("5.1")`) against YOUR
code in exercises/05-*/ — the same tests that check the reference implementation — and prints
one line per exercise and a total `score: P/N` (tests passed / graded tests).

    python exercises/grade.py 05               # your code
    python exercises/grade.py 05 --reference   # the reference (should score full marks)
"""

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Results:
    """A pytest plugin that remembers, per graded test, its exercise id, outcome and error type."""

    def __init__(self):
        self.tests = {}  # nodeid -> (exercise id, passed, error type name or None)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        marker = item.get_closest_marker("exercise")
        if marker is None or (report.when != "call" and report.passed):
            return
        error = type(call.excinfo.value).__name__ if call.excinfo else None
        if report.when == "call" or item.nodeid not in self.tests:
            self.tests[item.nodeid] = (marker.args[0], report.passed, error)


def grade(chapter: str, reference: bool = False) -> dict:
    """Run the graded tests; return {'by_exercise': {id: [passed, total]}, 'errors': {type: count}, ...}."""
    files = sorted(str(p) for p in (ROOT / "tests").glob(f"test_ch{chapter}_*.py"))
    if not files:
        raise SystemExit(f"no tests found for chapter {chapter!r} (looked for tests/test_ch{chapter}_*.py)")
    os.environ["NANOSERVE_IMPL"] = "reference" if reference else "student"
    results = Results()
    pytest.main([*files, "-m", "exercise", "-q", "-p", "no:cacheprovider", "--no-header", "-rN", "--tb=no"],
                plugins=[results])
    by_exercise = defaultdict(lambda: [0, 0])
    errors = defaultdict(int)
    for exercise, passed, error in results.tests.values():
        by_exercise[exercise][0] += passed
        by_exercise[exercise][1] += 1
        if not passed:
            errors[error] += 1
    return {"by_exercise": dict(by_exercise), "errors": dict(errors)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", help="two digits, e.g. 05")
    parser.add_argument("--reference", action="store_true", help="grade the reference implementation instead")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line (for the course's CI)")
    args = parser.parse_args(argv)
    chapter = args.chapter.zfill(2)
    result = grade(chapter, args.reference)
    if args.json:
        print(json.dumps(result))
    who = "reference" if args.reference else "your code in " + ", ".join(
        p.name for p in sorted((ROOT / "exercises").glob(f"{chapter}-*")))
    print(f"\nChapter {chapter} — grading {who}")
    passed = total = 0
    for exercise, (ok, n) in sorted(result["by_exercise"].items()):
        mark = "done" if ok == n else "to do"
        print(f"  Exercise {exercise}: {ok}/{n} tests pass  [{mark}]")
        passed, total = passed + ok, total + n
    if result["errors"]:
        print("  failures by error: " + ", ".join(f"{k} × {v}" for k, v in sorted(result["errors"].items(), key=str)))
    print(f"score: {passed}/{total}")
    return 0 if total and passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
