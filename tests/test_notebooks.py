"""Every notebook runs top to bottom (they are committed executed; this proves they still run)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    # Executed in a copy: the committed outputs stay as they are.
    # startup_timeout: a kernel may take well over nbclient's default 60 s to start on a loaded CI machine
    NotebookClient(notebook, timeout=900, startup_timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
