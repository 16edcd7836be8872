"""The README agrees with the course it describes: its chapter table with chapters/, notebooks/, tests/ and
exercises/; its exercises paragraph with the rungs the tests grade; its `--student` paragraph with the exercise
modules (nanoserve/student.py) that the product's code actually asks for; and every exercise file of several rungs is
a ladder in student.RUNGS, so its rungs serve and are graded one by one."""

import ast
import re
from pathlib import Path

from nanoserve import student

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def chapter_files() -> dict[str, Path]:
    return {path.name[:2]: path for path in sorted((ROOT / "chapters").glob("[0-9][0-9]-*.md"))}


def readme_rows() -> dict[str, list[str]]:
    """The README's chapter table: "01" -> its cells."""
    rows = {}
    for line in README.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"\d\d", cells[0]) and "](chapters/" in cells[1]:
            assert cells[0] not in rows, f"two README rows for chapter {cells[0]}"
            rows[cells[0]] = cells
    return rows


def links(cell: str) -> list[str]:
    return re.findall(r"\]\(([^)#]+)", cell)


def paragraph(starts_with: str) -> str:
    start = README.index(starts_with)
    end = README.find("\n\n", start)
    return README[start:end if end >= 0 else None]


def graded_rungs() -> dict[str, list[int]]:
    """Chapter "05" -> the rung numbers its tests grade ([1, 2, ..., 6]), from @pytest.mark.exercise("5.M")."""
    rungs: dict[str, set[int]] = {}
    for test in (ROOT / "tests").glob("test_*.py"):
        for chapter, rung in re.findall(r"mark\.exercise\(\"(\d+)\.(\d+)\"\)", test.read_text()):
            rungs.setdefault(f"{int(chapter):02d}", set()).add(int(rung))
    return {chapter: sorted(numbers) for chapter, numbers in rungs.items()}


def served_chapters() -> set[str]:
    """The chapters with an exercise module that the product asks a StudentCode (or a `modules` function) for:
    a call, other than importlib's import_module, whose first argument is a module of student.STUDENT_FILES."""
    served = set()
    for path in (ROOT / "nanoserve").rglob("*.py"):
        if path.name == "student.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name != "import_module" and node.args[0].value in student.STUDENT_FILES:
                served.add(student.STUDENT_FILES[node.args[0].value][:2])
    return served


def test_one_readme_row_per_chapter_linking_what_exists():
    chapters, rows = chapter_files(), readme_rows()
    assert set(rows) == set(chapters), "README chapter rows vs chapters/NN-*.md"
    for number, cells in rows.items():
        slug = chapters[number].stem
        title = chapters[number].read_text().splitlines()[0].split("—", 1)[-1].split(":")[0].strip()  # before a subtitle
        assert cells[1].lower() == f"[{title}](chapters/{slug}.md)".lower(), \
            f"README row {number}: {cells[1]} vs the chapter's title {title!r}"
        for link in links("|".join(cells)):
            assert (ROOT / link).exists(), f"README row {number} links {link}, which does not exist"
        notebook = ROOT / "notebooks" / f"{slug}.ipynb"
        assert (f"notebooks/{slug}.ipynb" in cells[3]) == notebook.exists(), f"README row {number}: notebook cell"
        tests = any((ROOT / "tests").glob(f"test_ch{number}_*.py"))
        assert (f"test_ch{number}_" in cells[4]) == tests, f"README row {number}: tests cell"
        exercise = ROOT / "exercises" / slug
        assert (f"exercises/{slug}/README.md" in cells[5]) == (exercise / "README.md").exists(), \
            f"README row {number}: exercise cell vs exercises/{slug}/"


def test_exercises_paragraph_names_every_chapters_rungs():
    text = README[README.index("## Exercises"):README.index("A finished exercise serves real requests")]
    rungs = graded_rungs()
    folders = {path.name[:2] for path in (ROOT / "exercises").glob("[0-9][0-9]-*") if path.is_dir()}
    assert set(rungs) == folders == set(student.chapters()), "graded chapters vs exercises/ folders vs student.py"
    for chapter, numbers in rungs.items():
        n = int(chapter)
        assert numbers == list(range(1, len(numbers) + 1)), f"chapter {chapter} grades rungs {numbers}"
        assert f"{chapter} ({n}.1–{n}.{numbers[-1]}:" in text, f"README's exercises paragraph: {n}.1–{n}.{numbers[-1]}"
    for n, last in re.findall(r"\b(\d+)\.1–\1\.(\d+)", text):  # no range the tests do not grade
        assert rungs[f"{int(n):02d}"][-1] == int(last), f"README says {n}.1–{n}.{last}"


def test_student_paragraph_names_where_every_chapter_serves():
    text = paragraph("A finished exercise serves real requests")
    named = set(re.findall(r"\((\d\d)[;)]", text))
    graded_only = set(re.findall(r"Chapter (\d\d)'s exercises are only graded", text))
    served = served_chapters()
    assert named == served, f"README --student paragraph names {sorted(named)}; the code serves {sorted(served)}"
    assert graded_only == set(student.chapters()) - served, "chapters whose exercises serve nowhere"


def stub_rungs(relative: str) -> dict[str, list[str]]:
    """An exercise file's rungs as its stubs label them: "12.1" -> the qualnames whose docstring starts
    "Exercise 12.1" (or whose NotImplementedError names it)."""
    rungs: dict[str, list[str]] = {}

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                label = re.match(r"Exercises? (\d+\.\d+)", ast.get_docstring(child) or "") or re.search(
                    r"NotImplementedError\(\s*f?[\"']Exercise (\d+\.\d+)", ast.unparse(child))
                if label:
                    rungs.setdefault(label.group(1), []).append(prefix + child.name)

    walk(ast.parse((student.EXERCISES / relative).read_text()))
    return rungs


def test_a_file_of_several_rungs_serves_and_grades_them_one_by_one():
    """A learner's finished rung serves beside the reference's unfinished ones, and is graded alone, only where
    student.RUNGS lists the file's rungs: every exercise file whose stubs belong to two rungs or more is
    there, with exactly the functions its stubs label."""
    for module, relative in student.STUDENT_FILES.items():
        labelled = stub_rungs(relative)
        if len(labelled) < 2:
            continue
        assert module in student.RUNGS, f"{relative} holds rungs {sorted(labelled)}: list them in student.RUNGS"
        listed = {rung: sorted(names) for rung, names in student.RUNGS[module].items()}
        assert listed == {rung: sorted(names) for rung, names in labelled.items()}, relative
