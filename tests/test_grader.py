"""`make grade` tells the learner why: each failing graded test with its assertion message, or its
exception and the line of the learner's file it came from; `--json` prints only JSON; a bad chapter is
one error line. Runs the grader on a copy of the repository whose exercise 5.1 is finished but buggy."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the code, tests and exercises, with 5.1 written: one bug that raises, one that is wrong."""
    copy = tmp_path_factory.mktemp("repo")
    for folder in ("nanoserve", "tests", "exercises"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    source = (ROOT / "nanoserve/kv/block_allocator.py").read_text()
    source = source.replace("    def incref(self, block_id: int) -> None:\n",
                            "    def incref(self, block_id: int) -> None:\n        [][block_id]  # the bug\n", 1)
    source = source.replace("self.free_list[block_id] = None",  # a freed block goes to the front: not LRU
                            "self.free_list[block_id] = None; self.free_list.move_to_end(block_id, last=False)")
    assert "the bug" in source and "move_to_end" in source
    (copy / "exercises/05-paged-kv/block_allocator.py").write_text(source)
    return copy


def grade(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "exercises/grade.py"), *args], capture_output=True, text=True,
                          cwd=repo, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})


def test_a_failure_says_which_test_and_why(repo):
    out = grade(repo, "05")
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert any("Exercise 5.1:" in line and "[to do]" in line for line in lines), out.stdout
    assert any("Exercise 5.2: 0/" in line and "not started: Exercise 5.2" in line for line in lines), out.stdout
    assert "✗ test_ch05_block_allocator.py::test_incref_revives_a_free_block" in out.stdout
    # the exception, and the learner's line that raised it
    assert "IndexError: list index out of range" in out.stdout
    assert "at exercises/05-paged-kv/block_allocator.py:" in out.stdout and "in incref: [][block_id]" in out.stdout
    # a wrong answer: the assertion's own message
    assert "AssertionError: assert" in out.stdout
    assert "score: " in lines[-1] and "V=1" in lines[-1]
    assert "Traceback" not in out.stdout + out.stderr


def test_a_slip_in_one_rung_of_a_ladder_fails_that_rung_only(repo):
    """Chapter 01's mask (1.1) with the classic bug, no cache offset, and 1.2 and 1.3 right: only tests of 1.1 fail,
    for 1.3's attention is graded with the reference's mask."""
    source = (ROOT / "nanoserve/model/attention.py").read_text()
    buggy = source.replace("offset = num_keys - num_queries", "offset = 0")
    assert buggy != source
    (repo / "exercises/01-attention/attention.py").write_text(buggy)
    result = json.loads(grade(repo, "01", "--json").stdout)
    (passed_1, total_1), *others = (result["by_exercise"][rung] for rung in ("1.1", "1.2", "1.3"))
    assert 0 < passed_1 < total_1 and all(passed == total for passed, total in others), result["by_exercise"]
    assert {failure["exercise"] for failure in result["failures"]} == {"1.1"}


def test_json_prints_only_json(repo):
    out = grade(repo, "05", "--json")
    result = json.loads(out.stdout)
    stubs = sum(total for exercise, (_, total) in result["by_exercise"].items() if exercise != "5.1")  # 5.2 onwards
    assert result["by_exercise"]["5.2"][0] == 0 and result["errors"]["NotImplementedError"] == stubs
    assert {f["error"] for f in result["failures"] if f["exercise"] == "5.1"} >= {"IndexError", "AssertionError"}


def test_verbose_shows_pytests_own_report(repo):
    out = grade(repo, "05", "-v")
    assert "PASSED" in out.stdout and "FAILED" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["20"], []])
def test_a_bad_chapter_is_one_error_line(repo, args):
    out = grade(repo, *args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "01" in out.stderr


def test_one_exercise_alone(repo):
    out = grade(repo, "--exercise", "5.2", "--json")  # the chapter follows from the exercise
    result = json.loads(out.stdout)
    assert list(result["by_exercise"]) == ["5.2"] and result["exercises"][:2] == ["5.1", "5.2"]


@pytest.mark.parametrize("args, says", [(["05", "--exercise", "5.9"], "its exercises: 5.1, 5.2, 5.3, 5.4, 5.5, 5.6"),
                                         (["05", "--exercise", "6.1"], "not in chapter 05")])
def test_a_bad_exercise_is_one_error_line(repo, args, says):
    out = grade(repo, *args)
    assert out.returncode == 2 and out.stdout == "" and says in out.stderr and out.stderr.count("\n") == 1
