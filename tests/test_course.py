"""The README agrees with the course it describes: its chapter table with chapters/, notebooks/, tests/ and
exercises/; its exercises paragraph with the rungs the tests grade; its `--student` paragraph with the exercise
modules (nanoserve/student.py) that the product's code actually asks for."""

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
