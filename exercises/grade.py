"""Grade a chapter's exercises: `make grade CH=05` (or `python exercises/grade.py 05`).

Runs the chapter's graded tests (those marked `@pytest.mark.exercise("5.1")`) against YOUR
code in exercises/05-*/ — the same tests that check the reference implementation — and prints
one line per exercise, why each failing test failed (its assertion, or the exception and the
line of your file it came from), and a total `score: P/N` (tests passed / graded tests).

    python exercises/grade.py 05               # your code         (make grade CH=05)
    python exercises/grade.py 05 -v            # with pytest's full output (make grade CH=05 V=1)
    python exercises/grade.py 05 --reference   # the reference (should score full marks)
    python exercises/grade.py 05 --json        # only the result, as one JSON line
    python exercises/grade.py 06 --exercise 6.2  # one exercise (one rung of a ladder) only (make grade EX=6.2)

Exit status: 0 full marks, 1 graded but not full marks yet, 2 a usage error (e.g. no such chapter).
"""

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOWN_PER_EXERCISE = 6  # failures listed under an exercise; -v shows them all, in full


class Results:
    """A pytest plugin that remembers, per graded test, its exercise id, outcome and why it failed."""

    def __init__(self, exercise: str | None = None):
        self.exercise = exercise  # grade only this one, if given
        self.found = set()  # every exercise id the chapter's tests grade
        self.tests = {}  # nodeid -> {"exercise", "passed", "error", "message", "where"}
        self.collect_errors = []  # files that could not even be imported

    def pytest_collection_modifyitems(self, config, items):
        self.found = {item.get_closest_marker("exercise").args[0] for item in items
                      if item.get_closest_marker("exercise")}
        if self.exercise:
            keep = [item for item in items if (m := item.get_closest_marker("exercise")) and m.args[0] == self.exercise]
            config.hook.pytest_deselected(items=[item for item in items if item not in keep])
            items[:] = keep

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        marker = item.get_closest_marker("exercise")
        if marker is None or (report.when != "call" and report.passed):
            return
        if report.when == "call" or item.nodeid not in self.tests:
            self.tests[item.nodeid] = {"exercise": marker.args[0], "passed": report.passed,
                                       **(why(call.excinfo) if call.excinfo else {"error": None})}

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")


def why(excinfo) -> dict:
    """The error type, its message (an assertion's first lines) and the line of the learner's file it came from."""
    error = excinfo.value
    lines = str(error).strip().splitlines()
    message = " / ".join(line.strip() for line in lines[:3])[:240]
    where = None
    for frame in traceback.extract_tb(excinfo.tb):  # the innermost frame inside exercises/ wins
        if Path(frame.filename).resolve().is_relative_to(ROOT / "exercises"):
            where = f"{Path(frame.filename).resolve().relative_to(ROOT)}:{frame.lineno} in {frame.name}: {frame.line}"
    return {"error": type(error).__name__, "message": message, "where": where}


def grade(chapter: str, reference: bool = False, verbose: bool = False, exercise: str | None = None) -> dict:
    """Run the graded tests (of one `exercise` only, if given); return {'by_exercise': {id: [passed, total]},
    'errors': {type: count}, 'failures': [{'test', 'exercise', 'error', 'message', 'where'}],
    'collect_errors': [...], 'exercises': every exercise id the chapter grades}."""
    files = sorted(str(p) for p in (ROOT / "tests").glob(f"test_ch{chapter}_*.py"))
    os.environ["NANOSERVE_IMPL"] = "reference" if reference else "student"
    results = Results(exercise)
    args = [*files, "-m", "exercise", "-p", "no:cacheprovider"]
    if verbose:
        pytest.main([*args, "-v"], plugins=[results])
    else:  # pytest's own report stays out of the way (and out of --json's output)
        with contextlib.redirect_stdout(io.StringIO()):
            pytest.main([*args, "-q", "--tb=no"], plugins=[results])
    by_exercise = defaultdict(lambda: [0, 0])
    errors = defaultdict(int)
    failures = []
    for nodeid, test in results.tests.items():
        by_exercise[test["exercise"]][0] += test["passed"]
        by_exercise[test["exercise"]][1] += 1
        if not test["passed"]:
            errors[test["error"]] += 1
            failures.append({"test": nodeid.removeprefix("tests/"), **test})
    return {"by_exercise": dict(by_exercise), "errors": dict(errors), "failures": failures,
            "collect_errors": results.collect_errors, "exercises": sorted(results.found)}


def report(chapter: str, result: dict, who: str, verbose: bool) -> None:
    print(f"\nChapter {chapter} — grading {who}")
    for error in result["collect_errors"]:
        print(f"  could not load {error}")
    for exercise, (ok, n) in sorted(result["by_exercise"].items()):
        failures = [f for f in result["failures"] if f["exercise"] == exercise]
        stubs = [f for f in failures if f["error"] == "NotImplementedError"]
        if ok == n:
            status = "done"
        elif len(stubs) == n:
            status = f"not started: {stubs[0]['message']}"
        else:
            status = "to do"
        print(f"  Exercise {exercise}: {ok}/{n} tests pass  [{status}]")
        if len(stubs) == n:
            continue
        shown = failures if verbose else failures[:SHOWN_PER_EXERCISE]
        for f in shown:
            print(f"      ✗ {f['test']}\n          {f['error']}: {f['message']}")
            if f["where"]:
                print(f"          at {f['where']}")
        if len(failures) > len(shown):
            print(f"      … and {len(failures) - len(shown)} more (make grade CH={chapter} V=1 shows them all)")


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from nanoserve.student import chapters

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", nargs="?", help=f"two digits, one of {', '.join(chapters())} "
                                                   "(may be left out when --exercise names one)")
    parser.add_argument("--exercise", metavar="N.M", help="grade this exercise only, e.g. 6.2 (make grade EX=6.2)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's full output too")
    parser.add_argument("--reference", action="store_true", help="grade the reference implementation instead")
    parser.add_argument("--json", action="store_true", help="print only the result, as one JSON line")
    parser.error = lambda message: parser.exit(2, f"error: {message} (see {parser.prog} --help)\n")
    args = parser.parse_args(argv)
    if not args.chapter and args.exercise:
        args.chapter = args.exercise.split(".")[0]
    chapter = (args.chapter or "").zfill(2)
    if chapter not in chapters():
        problem = f"chapter {args.chapter!r} has no exercises" if args.chapter else "which chapter? (make grade CH=05)"
        print(f"error: {problem}; chapters with exercises: {', '.join(chapters())}", file=sys.stderr)
        return 2
    if args.exercise and args.exercise.split(".")[0].zfill(2) != chapter:
        print(f"error: exercise {args.exercise} is not in chapter {chapter}", file=sys.stderr)
        return 2
    result = grade(chapter, args.reference, args.verbose and not args.json, args.exercise)
    if args.exercise and not result["by_exercise"]:
        print(f"error: chapter {chapter} has no exercise {args.exercise}; its exercises: "
              f"{', '.join(result['exercises'])}", file=sys.stderr)
        return 2
    passed = sum(ok for ok, _ in result["by_exercise"].values())
    total = sum(n for _, n in result["by_exercise"].values())
    if args.json:
        print(json.dumps(result))
    else:
        who = "reference" if args.reference else "your code in " + ", ".join(
            p.name for p in sorted((ROOT / "exercises").glob(f"{chapter}-*")))
        report(chapter, result, who, args.verbose)
        hint = "" if passed == total else f"   (make grade CH={chapter} V=1 shows pytest's full output)"
        print(f"score: {passed}/{total}{hint}")
    return 0 if total and passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
