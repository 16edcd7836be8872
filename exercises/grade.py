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

The tests run in a child process. A test that kills it (in Triton's interpreter, chapter 07, a tl.load or
tl.store outside its tensor: SIGSEGV at an address the process does not own, SIGABRT when the C library finds its
heap overwritten) is graded as failed, with the signal and, when the crash dump names one, the line of your file,
and a new child runs the tests not run yet. (A test that crashed after others ran in its process is run again
alone first: an earlier test's stray store can corrupt memory and kill a later one.) A child that dies outside
every test (its last test finished, the results stand) is reported on a line of its own.

Exit status: 0 full marks, 1 graded but not full marks yet, 2 a usage error (e.g. no such chapter).
"""

import argparse
import faulthandler
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOWN_PER_EXERCISE = 6  # failures listed under an exercise; -v shows them all, in full


class Results:
    """A pytest plugin (in the child process) that appends to `log`, one JSON line each, every exercise id the
    chapter's tests grade, each graded test's start, its exercise id, outcome and why it failed, and its finish:
    a test that started and never finished took the process down."""

    def __init__(self, log: str, exercise: str | None = None, skip=(), only: str | None = None):
        self.log = open(log, "a", buffering=1)  # line-buffered: what a crash leaves is every line written before it
        self.exercise = exercise  # grade only this one, if given
        self.skip = set(skip)  # tests an earlier child ran (or crashed in)
        self.only = only  # run this test alone, if given
        self.graded = set()  # nodeids whose result is written
        self.stderr = os.dup(2)  # the child's stderr (pytest points fd 2 elsewhere while a test runs)

    def write(self, **record) -> None:
        self.log.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, config, items):
        self.write(found=sorted({item.get_closest_marker("exercise").args[0] for item in items
                                 if item.get_closest_marker("exercise")}))
        keep = [item for item in items if (m := item.get_closest_marker("exercise"))
                and (not self.exercise or m.args[0] == self.exercise) and item.nodeid not in self.skip
                and self.only in (None, item.nodeid)]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.write(start=item.nodeid, exercise=item.get_closest_marker("exercise").args[0])
        # a crash dumps the Python stack (faulthandler) to the child's stderr: armed again for every test, on top
        # of any handler a library put in since (tvm_ffi, which xgrammar loads, puts in one that dumps C frames)
        faulthandler.disable()
        faulthandler.enable(file=self.stderr)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.write(finish=nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        marker = item.get_closest_marker("exercise")
        if marker is None or (report.when != "call" and report.passed):
            return
        if report.when == "call" or item.nodeid not in self.graded:
            self.graded.add(item.nodeid)
            self.write(test=item.nodeid, exercise=marker.args[0], passed=report.passed,
                       **(why(call.excinfo) if call.excinfo else {"error": None}))

    def pytest_collectreport(self, report):
        if report.failed:
            self.write(collect_error=f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")


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
    'collect_errors': [...], 'deaths': [why a child died outside every test, ...], 'exercises': every exercise id
    the chapter grades}.

    The tests run in a child process (run_tests), round after round: a test that kills it is recorded as failed
    (crashed), and the next child runs the tests that neither ran nor crashed. A test that crashed after others ran
    in the same process is first run again alone: a stray store of an earlier test (past a tensor, into memory
    the process owns) can corrupt the heap and kill a later, innocent one."""
    files = sorted(str(p) for p in (ROOT / "tests").glob(f"test_ch{chapter}_*.py"))
    os.environ["NANOSERVE_IMPL"] = "reference" if reference else "student"
    tests, found, collect_errors, deaths = {}, set(), [], []  # tests: nodeid -> {"exercise", "passed", "error", ...}
    alone = None  # a test to run alone in the next child
    while True:
        with tempfile.TemporaryDirectory() as tmp:
            log, stderr_path = Path(tmp) / "results.jsonl", Path(tmp) / "stderr"
            with open(stderr_path, "w") as stderr:
                child = subprocess.run(
                    [sys.executable, "-c", CHILD, json.dumps(
                        dict(files=files, log=str(log), exercise=exercise, skip=sorted(tests), only=alone,
                             verbose=verbose))],
                    cwd=ROOT, stdout=None if verbose else subprocess.DEVNULL, stderr=stderr)
            records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            child_stderr = stderr_path.read_text()  # where faulthandler writes its dump of a crash
        if verbose:
            sys.stderr.write(child_stderr)
        started, finished = {}, set()  # started: nodeid -> exercise id
        for record in records:
            found.update(record.get("found", []))
            if "collect_error" in record and record["collect_error"] not in collect_errors:  # each round collects
                collect_errors.append(record["collect_error"])
            if "start" in record:
                started[record["start"]] = record["exercise"]
            if "finish" in record:
                finished.add(record["finish"])
            if "test" in record:
                tests[record.pop("test")] = record
        crashed = [nodeid for nodeid in started if nodeid not in finished]
        if crashed and crashed[0] != next(iter(started)):  # others ran before it: is the crash its own?
            alone = crashed[0]
            continue
        if crashed:
            tests[crashed[0]] = {"exercise": started[crashed[0]], "passed": False,
                                 **crash(child.returncode, child_stderr)}
        elif child.returncode < 0:  # killed outside every test: while the test files load, or at its exit
            deaths.append(f"the test process died ({died_of(child.returncode)}) "
                          + ("after its last test had finished: the results below stand; a stray store of one of "
                             "the tests can corrupt memory that the process trips over later" if started else
                             "before any test ran, while the test files were loaded"))
        if not crashed and alone is None:
            break
        alone = None
    by_exercise = defaultdict(lambda: [0, 0])
    errors = defaultdict(int)
    failures = []
    for nodeid, test in tests.items():
        by_exercise[test["exercise"]][0] += test["passed"]
        by_exercise[test["exercise"]][1] += 1
        if not test["passed"]:
            errors[test["error"]] += 1
            failures.append({"test": nodeid.removeprefix("tests/"), **test})
    return {"by_exercise": dict(by_exercise), "errors": dict(errors), "failures": failures,
            "collect_errors": collect_errors, "deaths": deaths, "exercises": sorted(found)}


# the child process: pytest with the Results plugin (its arguments, as JSON, in argv[1])
CHILD = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'exercises')!r}]; import grade; "
         "sys.exit(grade.run_tests(**json.loads(sys.argv[1])))")


def run_tests(files: list[str], log: str, exercise: str | None, skip: list[str], only: str | None,
              verbose: bool) -> int:
    """The child's side: the graded tests of `files` but `skip` (or `only` that one), each one's result appended
    to `log`."""
    args = [*files, "-m", "exercise", "-p", "no:cacheprovider", *(["-v"] if verbose else ["-q", "--tb=no"])]
    return pytest.main(args, plugins=[Results(log, exercise, skip, only)])


def died_of(returncode: int) -> str:
    return signal.Signals(-returncode).name if returncode < 0 else f"exit status {returncode}"


def crash(returncode: int, dump: str) -> dict:
    """A test that took its process down: the signal, and the innermost frame in exercises/ that Python's crash
    dump (faulthandler: most recent call first) names — none when the process died later than the stray
    access, in code of Python's or the C library's that met the memory it had overwritten."""
    where = None
    for path, line, name in re.findall(r'File "(.+?)", line (\d+) in (\S+)', dump):
        file = Path(path).resolve()
        if file.is_relative_to(ROOT / "exercises") and file != Path(__file__).resolve():  # the learner's, not ours
            source = linecache.getline(path, int(line)).strip()
            where = f"{file.relative_to(ROOT)}:{line} in {name}: {source}"
            break
    return {"error": died_of(returncode), "where": where,
            "message": ("the test process died here" if where else "the test process died, in none of your lines: "
                        "later than the stray access, in code that met the memory it had overwritten")
                       + ", with no exception to report. Triton's interpreter does not bounds-check tl.load or "
                         "tl.store: a lane past its tensor reads or writes whatever memory lies there, which can "
                         "kill the process (SIGSEGV) or corrupt the heap (SIGABRT). Which lane does your mask let "
                         "through?"}


def report(chapter: str, result: dict, who: str, verbose: bool) -> None:
    print(f"\nChapter {chapter} — grading {who}")
    for error in result["collect_errors"]:
        print(f"  could not load {error}")
    for death in dict.fromkeys(result["deaths"]):  # each distinct one once (every child may die alike)
        times = result["deaths"].count(death)
        print(f"  {death}" + (f" ({times} times)" if times > 1 else ""))
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
