"""The course's own check of its exercises (README.md, "Exercises"), for every chapter that has one:

- the reference scores full marks on the graded tests (every chapter's graded tests are ordinary tests of this
  suite, run on the reference; through the grader's `--reference` flag for one chapter here);
- the pristine stubs score zero, and every failure is a NotImplementedError (not an import error);
- each stub mirrors its reference module: same public names, same signatures;
- a learner's code that kills the test process (SIGSEGV, SIGABRT) fails one test, named with the signal and the
  line, and the grader goes on with the others; a process that dies after its last test is reported as that.
"""

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.student import STUDENT_FILES, load_student

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted({path.split("-")[0] for path in STUDENT_FILES.values()})


def run_grader(chapter: str, *flags: str, root: Path = ROOT) -> dict:
    out = subprocess.run([sys.executable, str(root / "exercises/grade.py"), chapter, "--json", *flags],
                         capture_output=True, text=True, cwd=root)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"grader printed no result:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_the_grader_gives_the_reference_full_marks():
    """`grade.py 06 --reference`: chapter 06's ladder, each rung graded alone, on the reference. (The other
    chapters' graded tests run on the reference in this suite already: a graded test asks `implementation()`,
    which is the reference unless NANOSERVE_IMPL=student.)"""
    result = run_grader("06", "--reference")
    assert result["by_exercise"], "no graded tests"
    assert result["errors"] == {}, result
    assert all(passed == total for passed, total in result["by_exercise"].values()), result


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_score_zero_with_not_implemented(chapter):
    result = run_grader(chapter)
    assert result["by_exercise"], "no graded tests"
    assert all(passed == 0 for passed, _ in result["by_exercise"].values()), result
    assert set(result["errors"]) == {"NotImplementedError"}, result


def course_with_a_crashing_stub(tmp_path: Path, before_raise: list[str]) -> tuple[Path, int]:
    """A copy of the course whose stub of 1.1 runs `before_raise` (lines of its body) and then raises
    NotImplementedError as stubs do; returns the copy's root and the index of the stub's first inserted line."""
    for folder in ("nanoserve", "tests", "exercises"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    stub = tmp_path / "exercises/01-attention/attention.py"
    lines = stub.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "Exercise 1.1" in line and "NotImplementedError" in line)
    lines[at:at] = ["    " + line for line in before_raise]
    stub.write_text("\n".join(lines) + "\n")
    return tmp_path, at


@pytest.mark.parametrize("crash_on_call, crash, signal", [(1, "ctypes.string_at(0)", "SIGSEGV"),
                                                         (2, "ctypes.string_at(0)", "SIGSEGV"),
                                                         (1, "os.abort()", "SIGABRT")])
def test_the_grader_survives_a_crash_and_names_the_line(crash_on_call, crash, signal, tmp_path):
    """A stub of 1.1 that crashes on its n-th call (reading address 0: SIGSEGV, as an unmasked tl.load past a
    tensor can in Triton's interpreter; os.abort(): SIGABRT, as the C library does when it finds its heap
    overwritten by a stray store), and otherwise raises NotImplementedError; each graded test of 1.1 calls it
    once. Call 1: the first test crashes, and is graded so, with the signal and the line; the others still run.
    Call 2: the second test crashes after the first ran in the same process; run again alone, it raises like a
    stub, and that is its grade (a crash after others ran may be theirs: a stray store corrupts the heap)."""
    root, at = course_with_a_crashing_stub(tmp_path, [
        'import ctypes, os, pathlib',
        'with pathlib.Path(__file__).with_name("calls").open("a+") as calls:',
        '    calls.write(".")',
        '    calls.seek(0)',
        f'    if len(calls.read()) == {crash_on_call}:',
        f'        {crash}  # the process dies of {signal}'])
    result = run_grader("01", "--exercise", "1.1", root=root)
    passed, total = result["by_exercise"]["1.1"]
    assert passed == 0 and total >= 3 and result["collect_errors"] == result["deaths"] == []
    if crash_on_call == 2:
        assert result["errors"] == {"NotImplementedError": total}, result
        return
    assert result["errors"] == {signal: 1, "NotImplementedError": total - 1}, result
    [crashed] = [f for f in result["failures"] if f["error"] == signal]
    assert crashed["test"].startswith("test_ch01_") and "bounds-check" in crashed["message"]
    assert crashed["where"] == (f"exercises/01-attention/attention.py:{at + 6} in causal_mask: {crash}  "
                                f"# the process dies of {signal}")


def test_the_grader_reports_a_death_after_the_last_test_as_one(tmp_path):
    """A stub that arms an abort for the process's exit (as heap corruption can kill it only as it winds down,
    after its last test): every test keeps its grade, and the report says the process died after its last test,
    with the signal, once, not that anything "could not load"."""
    root, _ = course_with_a_crashing_stub(tmp_path, ["import atexit, os", "atexit.register(os.abort)"])
    out = subprocess.run([sys.executable, str(root / "exercises/grade.py"), "01", "--exercise", "1.1"],
                         capture_output=True, text=True, cwd=root).stdout
    lines = out.splitlines()
    assert "could not load" not in out and [line.strip() for line in lines if "died" in line] == [
        "the test process died (SIGABRT) after its last test had finished: the results below stand; a stray store "
        "of one of the tests can corrupt memory that the process trips over later"], out
    [graded] = [line for line in lines if "Exercise 1.1:" in line]
    assert "[not started: Exercise 1.1" in graded and lines[-1].startswith("score: 0/"), out


def test_a_crash_outside_the_learners_lines_says_so():
    """faulthandler's dump of a process that died in pytest's code, after the stray access: no line of the
    learner's file to name, and the message does not point at one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grade", ROOT / "exercises/grade.py")
    grade = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grade)
    dump = ('Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n'
            f'  File "{ROOT}/.venv/lib/python3.12/site-packages/_pytest/nodes.py", line 480 in _repr_failure_py\n')
    result = grade.crash(-6, dump)
    assert result["error"] == "SIGABRT" and result["where"] is None
    assert "in none of your lines" in result["message"] and "died here" not in result["message"]


def public_api(module) -> dict[str, str]:
    """name -> signature for the functions and classes (and their public methods) a module defines."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            api[name] = str(inspect.signature(obj))
        elif inspect.isclass(obj):
            api[name] = "class"
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and (attr == "__init__" or not attr.startswith("_")):
                    api[f"{name}.{attr}"] = str(inspect.signature(member))
    return api


@pytest.mark.parametrize("module", sorted(STUDENT_FILES))
def test_stub_mirrors_reference_api(module):
    import importlib

    stub, reference = public_api(load_student(module)), public_api(importlib.import_module(module))
    assert stub, f"{STUDENT_FILES[module]} defines nothing"
    for name, signature in stub.items():
        assert name in reference, f"{STUDENT_FILES[module]} defines {name}, which {module} does not"
        assert signature == reference[name], f"{name}: stub {signature} != reference {reference[name]}"
