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


def _sections(name: str) -> dict[str, str]:
    """``{"2": "Microbatches: GPipe", ...}``: a lesson's numbered ``## N. Title`` sections."""
    import re

    import nbformat

    cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
    lines = (line for c in cells if c.cell_type == "markdown" for line in c.source.splitlines())
    found = (re.match(r"## (\d+)\. (.+)", line) for line in lines)
    return {m[1]: m[2] for m in found if m}


def _reading_minutes(name: str) -> int:
    """Prose at 150 words a minute plus the code a student sees (folded check cells left out) at 10 lines a minute."""
    import nbformat

    cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
    words = sum(len(c.source.split()) for c in cells if c.cell_type == "markdown")
    shown = sum(
        len(c.source.splitlines())
        for c in cells
        if c.cell_type == "code" and not c.metadata.get("jupyter", {}).get("source_hidden")
    )
    return round(words / 150 + shown / 10)


def test_the_one_sitting_route_is_the_core_lesson_section_by_section():
    """The short route names the core lesson's sections as they are titled, and each pointer into a deep dive
    (``X.ipynb`` §N) names a section that exists."""
    import re

    text = (NOTEBOOKS / "README.md").read_text()
    route = text.split("## One sitting", 1)[1].split("\n## ", 1)[0]
    core = _sections("00_lesson.ipynb")
    rows = re.findall(r"^\| (\d+)\. ([^|]+?) \|", route, flags=re.M)
    assert len(rows) >= 5 and {n for n, _ in rows} <= set(core)
    for number, title in rows:
        assert core[number].startswith(title), (number, title, core[number])
    pointers = re.findall(r"`(\w+\.ipynb)` §(\d+)|§(\d+) of the same notebook", route)
    assert pointers
    last = None
    for name, number, same in pointers:
        last = name or last
        assert (number or same) in _sections(last), (last, number or same)


def test_the_course_map_states_each_lessons_measured_reading_time():
    """Every lesson's time in the map is measured from the notebook as it is, not guessed."""
    import re

    text = (NOTEBOOKS / "README.md").read_text()
    stated = re.findall(r"^\| [\w-]+ \| `(\w+\.ipynb)` \| .*? \| (\d+) min \|", text, flags=re.M)
    assert {name for name, _ in stated} == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    for name, minutes in stated:
        assert int(minutes) == _reading_minutes(name), (name, minutes, _reading_minutes(name))
