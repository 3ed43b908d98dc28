"""Instructors run the lessons with papermill parameters; nbval (in `make test`) runs them with the defaults."""

from pathlib import Path

import papermill

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def test_parameters_cell_takes_a_world_size(tmp_path):
    out = tmp_path / "00_collectives_n2.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "00_collectives.ipynb"),
        str(out),
        parameters={"world_size": 2},
        progress_bar=False,
        kernel_name="python3",
        cwd=str(NOTEBOOKS),
    )
    text = out.read_text()
    assert "world_size = 2" in text and "'world': 2" in text


def test_every_lesson_has_a_parameters_cell():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
        assert "backend" in tagged[0].source and "world_size" in tagged[0].source, path.name
