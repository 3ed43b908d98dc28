"""`make html` (course_lib.ui.site): tiny lessons executed for real, checked, and written as pages that stand alone."""

import base64
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_lib.ui import site

PLOT = [
    new_code_cell(
        "import matplotlib.pyplot as plt\n\ndef draw():\n    plt.plot([0, 1], [1, 0])\n    plt.show()", id="a-def"
    ),
    new_code_cell("draw()", id="calls-it"),
    new_code_cell("plt.plot([0, 1], [0, 1]); plt.show()", id="draws"),
]
PLAIN = [
    new_code_cell("print(6 * 7)", id="prints"),
    new_code_cell(
        "import ipywidgets\nimport matplotlib.pyplot as plt\n\n\ndef bars(n):\n    plt.bar(range(n), range(n))\n"
        "    plt.show()\n    print(f'drew {n} bars')\n\n\nipywidgets.interactive(bars, n=(0, 9))",
        id="widget",
    ),
]
README = (
    "# Course map\n\n| # | notebook |\n|---|---|\n| 10 | `10_plot.ipynb` |\n| 11 | [the plain one](11_plain.ipynb) |\n"
)


def lessons(tmp_path: Path, readme: str = README, **cells: list) -> Path:
    """A notebooks folder holding the course map and one lesson per keyword (its name) with these cells."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    (folder / "README.md").write_text(readme)
    for name, lesson_cells in cells.items():
        nbformat.write(new_notebook(cells=[new_markdown_cell(f"# Lesson {name}"), *lesson_cells]), folder / name)
    return folder


def png_images(page: str) -> list[bytes]:
    """The PNG images embedded in a page, each checked to be one."""
    images = [base64.b64decode(data) for data in re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', page)]
    assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    return images


def no_kernel(*args, **kwargs):
    raise AssertionError("a kernel was started")


def test_the_site_runs_each_lesson_embeds_its_figures_and_links_every_page(tmp_path, capsys):
    folder = lessons(tmp_path, **{"10_plot.ipynb": PLOT, "11_plain.ipynb": PLAIN})
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    # A cell here takes well under a second: a 60 s limit turns a stuck kernel (seen once in a full run, under load,
    # in the second lesson's kernel) into a failure naming the lesson and the cell, not pytest-timeout's 300 s dump.
    assert site.main([str(tmp_path / "html"), "--notebooks", str(folder), "--timeout", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["10_plot", "11_plain", "total:", "index:"]
    assert lines[0].endswith(" 2 figures") and lines[1].endswith(" 1 figure")  # draw() and the last cell; the widget's
    assert lines[2].startswith("total: 2 lessons in ") and lines[3] == f"index: {tmp_path / 'html' / 'index.html'}"

    plot = (tmp_path / "html" / "10_plot.html").read_text()
    assert len(png_images(plot)) == 2 and 'href="index.html"' in plot
    plain = (tmp_path / "html" / "11_plain.html").read_text()
    assert "42" in plain and site.WIDGET_NOTE in plain and site.WIDGET not in plain
    # The widget's first figure and printed line, as its Output widget held them once the lesson had run (n=4).
    assert len(png_images(plain)) == 1 and "drew 4 bars" in plain
    assert plain.index(site.WIDGET_NOTE) < plain.index("<img") < plain.index("drew 4 bars")

    index = (tmp_path / "html" / "index.html").read_text()
    assert 'href="10_plot.html"' in index and 'href="11_plain.html"' in index and '.ipynb"' not in index
    assert "executed top to bottom with torch" in index and "read-only" in index
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # nothing written into notebooks/


def test_a_plot_that_shows_no_image_fails_the_check_naming_lesson_and_cell():
    cell = new_code_cell("import matplotlib.pyplot as plt\nplt.show()", id="no-figure", execution_count=1)
    with pytest.raises(ValueError) as err:
        site.check(new_notebook(cells=[cell]), "10_empty")
    assert str(err.value) == "10_empty: cell no-figure calls plt.show() 1 time(s) but shows 0 image(s)"


def test_a_cell_that_raises_fails_the_build_in_one_line(tmp_path, capsys):
    cells = [new_code_cell('raise RuntimeError("the lesson broke\\nand more")', id="boom")]
    folder = lessons(tmp_path, "`10_boom.ipynb`", **{"10_boom.ipynb": cells})
    assert site.main([str(tmp_path / "html"), "--notebooks", str(folder)]) == 1
    out = capsys.readouterr()
    assert out.err == "make html: 10_boom: cell boom raised RuntimeError: the lesson broke\n" and out.out == ""


def test_no_execute_renders_the_stored_outputs_without_a_kernel(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(site, "NotebookClient", no_kernel)
    stored = new_code_cell("print('stored')", id="stored", execution_count=1)
    stored.outputs = [
        new_output("stream", name="stdout", text="stored output 42\n"),
        new_output("display_data", data={site.WIDGET: {"model_id": "1"}, "text/plain": "IntSlider(value=3)"}),
    ]
    folder = lessons(tmp_path, "`10_stored.ipynb`", **{"10_stored.ipynb": [stored]})
    assert site.main([str(tmp_path / "html"), "--notebooks", str(folder), "--no-execute"]) == 0
    page = (tmp_path / "html" / "10_stored.html").read_text()
    assert "stored output 42" in page and site.WIDGET_NOTE in page and "IntSlider" not in page
    assert "rendered as stored" in (tmp_path / "html" / "index.html").read_text()


def test_a_lesson_missing_from_the_course_map_is_refused_before_any_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(site, "NotebookClient", no_kernel)
    folder = lessons(tmp_path, "`10_plot.ipynb`", **{"10_plot.ipynb": PLOT, "11_plain.ipynb": PLAIN})
    with pytest.raises(ValueError, match="README.md does not name 11_plain: add each lesson to the course map"):
        site.build(tmp_path / "html", folder)


def test_an_error_output_fails_the_check_even_where_the_kernel_went_on():
    """A cell tagged raises-exception does not stop nbclient; its error output still fails the lesson."""
    cell = new_code_cell("1 / 0", id="tagged", execution_count=1, metadata={"tags": ["raises-exception"]})
    cell.outputs = [new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    with pytest.raises(ValueError, match="^10_x: cell tagged raised ZeroDivisionError: division by zero$"):
        site.check(new_notebook(cells=[cell]), "10_x")


MAP = """# Course map

Start with `12_core.ipynb`; its [section 2](12_core.ipynb#2-the-schemes) is the heart of it.

| notebook | sections |
|---|---|
| `12_core.ipynb` | 1, 2 |

| # | notebook | needs |
|---|---|---|
| 12 | `12_core.ipynb` | - |
| 10 | [the first deep dive](10_deep.ipynb) | 12 |
| 11b | `11b_extra.ipynb` (after `10_deep.ipynb`) | 10 |
| 11 | `11_later.ipynb` | 10 |

See also `10_deep.ipynb` and `13_appendix.ipynb`.
"""


def test_pages_follow_the_course_maps_table_with_previous_and_next_links_and_the_index_names_pages(tmp_path):
    """Course order is the order of the map's main table (the table naming most lessons), not the names' order;
    a lesson the map names only outside that table comes last. Every link on the pages and the index resolves."""
    folder = lessons(
        tmp_path,
        MAP,
        **{f"{name}.ipynb": [] for name in ["10_deep", "11_later", "11b_extra", "12_core", "13_appendix"]},
    )
    order = ["12_core", "10_deep", "11b_extra", "11_later", "13_appendix"]
    assert [path.stem for path in site.lessons(folder)] == order
    out = tmp_path / "html"
    assert [path.stem for path in site.build(out, folder, execute=False)] == [*order, "index"]
    for index, name in enumerate(order):
        page = (out / f"{name}.html").read_text()
        previous = re.findall(r'<a href="([^"]+)" rel="prev">', page)
        following = re.findall(r'<a href="([^"]+)" rel="next">', page)
        assert previous == ([f"{order[index - 1]}.html"] * 2 if index else [])  # at the top and at the bottom
        assert following == ([f"{order[index + 1]}.html"] * 2 if index + 1 < len(order) else [])
        assert page.count('<a href="index.html">Course map</a>') == 2
    index = (out / "index.html").read_text()
    hrefs = re.findall(r'href="([^"]+)"', index)
    assert ".ipynb" not in index and {href.split("#")[0] for href in hrefs} == {f"{name}.html" for name in order}
    assert 'href="12_core.html#2-the-schemes"' in index and "<code>11b_extra.html</code></a>" in index
    assert all((out / href.split("#")[0]).is_file() for href in hrefs)


def test_a_widget_shows_what_its_output_widgets_first_held_and_no_state_is_kept():
    """From the widget state nbclient stores: the interact box's Output child holds the first figure and text."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\nfirst figure").decode()
    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_slider", "IPY_MODEL_out"]}},
        "slider": {"model_name": "IntSliderModel", "state": {"value": 3}},
        "out": {
            "model_name": "OutputModel",
            "state": {
                "outputs": [
                    {"output_type": "display_data", "metadata": {}, "data": {"image/png": png, "text/plain": "<Fig>"}},
                    {"output_type": "stream", "name": "stdout", "text": "totals: 1, 2, 3\n"},
                ]
            },
        },
    }
    shown = new_output("display_data", data={site.WIDGET: {"model_id": "box"}, "text/plain": "interactive(...)"})
    cell = new_code_cell("explorer()", id="explorer", execution_count=1, outputs=[shown])
    nb = new_notebook(cells=[cell], metadata={"widgets": {site.WIDGET_STATE: {"state": state}}})
    site._static_widgets(nb)
    assert [output.output_type for output in cell.outputs] == ["display_data", "display_data", "stream"]
    assert cell.outputs[0].data == {"text/plain": site.WIDGET_NOTE}
    assert cell.outputs[1].data["image/png"] == png and cell.outputs[2].text == "totals: 1, 2, 3\n"
    assert "widgets" not in nb.metadata
