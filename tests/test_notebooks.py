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
    assert "[ranks 0,1]" in text  # section 4's %ranks started world_size ranks: the all-reduce's collapsed block


def test_every_lesson_has_a_parameters_cell():
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
        assert "backend" in tagged[0].source and "world_size" in tagged[0].source, path.name


def test_the_one_sitting_route_points_at_sections_that_exist_and_takes_about_half_an_hour():
    import re

    import nbformat

    text = (NOTEBOOKS / "README.md").read_text()
    route = text.split("## One sitting", 1)[1].split("\n\n", 2)[2]
    rows = re.findall(r"^\| `(\w+\.ipynb)` \| ([\d, ]+) \| (\d+) \|", route, flags=re.M)
    assert len(rows) >= 5
    for name, sections, _ in rows:
        headers = {
            line.split(".")[0][3:]
            for cell in nbformat.read(NOTEBOOKS / name, as_version=4).cells
            if cell.cell_type == "markdown"
            for line in cell.source.splitlines()
            if re.match(r"## \d+\. ", line)
        }
        assert {s.strip() for s in sections.split(",")} <= headers, (name, sections, sorted(headers))
    assert 25 <= sum(int(minutes) for *_, minutes in rows) <= 35
