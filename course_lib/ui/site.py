"""``make html``: every lesson executed and written as a static site that a browser reads without a kernel.

``python -m course_lib.ui.site OUT_DIR [--no-execute] [--timeout S] [--notebooks DIR]`` (:func:`build`) takes the
lesson notebooks, ``notebooks/NN*_*.ipynb`` in course order (:func:`lessons`: the order of the course map's table),
runs a copy of each top to bottom with nbclient in the notebooks folder on a fresh ``python3`` kernel of this
environment (nothing is written into ``notebooks/``), checks it and writes ``OUT_DIR/<lesson>.html`` with
nbconvert's HTMLExporter, figures embedded as ``data:`` URIs so that each page stands alone, with links to the
course map and to the previous and next lesson. ``OUT_DIR/index.html`` is the course map, ``notebooks/README.md``,
with every lesson it names linked to its page. ``--no-execute`` renders the notebooks as stored, unchecked, for a
quick look.

Each lesson's kernel is started while the page of the lesson before it is written, so that its start and the
imports of its rank server (torch, a few seconds of CPU) overlap that export instead of following it.

The checks, each failing the build with one ``ValueError`` line naming the lesson and the cell:

* no cell has an error output;
* every code cell that ran has at least one image output per top-level ``plt.show()`` statement in its source
  (a statement of the cell itself, not one inside a ``def``, a loop or an ``if``): the lessons draw each figure
  they expect and end it with ``plt.show()``.

Widgets need a kernel, so a widget output becomes a line of text saying where to use it (the index says so too),
followed by what the widget first showed: the outputs its Output widgets held when the lesson had run (an explorer's
first figure and printed lines, from the widget state nbclient records).
"""

from __future__ import annotations

import argparse
import ast
import html
import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import mistune
import nbformat
from IPython.core.inputtransformer2 import TransformerManager
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from nbconvert import HTMLExporter

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = "[0-9][0-9]*_*.ipynb"
IMAGES = ("image/png", "image/svg+xml", "image/jpeg")
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
_IPYTHON = TransformerManager()  # IPython's own translation of magics into Python
WIDGET_NOTE = (
    "[An interactive widget, shown below as it was first drawn: its controls need a running kernel. Open this lesson "
    "with `make lab` to use them.]"
)
NAV = (
    '<nav class="lesson-nav" style="margin: 1rem 2rem; font-family: sans-serif; display: flex; gap: 2rem">{links}</nav>'
)
INDEX = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.45; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 0.3rem 0.5rem; vertical-align: top; text-align: left; }}
code {{ background: #f3f3f3; padding: 0 0.2rem; }}
.made {{ color: #555; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p class="made">{made}</p>
{course_map}
</body>
</html>
"""


@dataclass(frozen=True)
class Page:
    """One lesson written: its name, seconds taken (executing and exporting; ``running`` of them executing) and
    number of images (a widget's first figure included)."""

    name: str
    seconds: float
    figures: int
    running: float = 0.0


def _named(name: str) -> re.Pattern:
    """``name.ipynb`` as a whole file name (not the end of ``x10_a.ipynb``)."""
    return re.compile(rf"(?<![\w.-]){re.escape(name)}\.ipynb")


def _course_map(notebooks_dir: Path, names: list[str]) -> str:
    """notebooks/README.md, refused before any lesson runs if it does not name every lesson."""
    readme = Path(notebooks_dir) / "README.md"
    if not readme.is_file():
        raise ValueError(f"no course map at {readme}: the index is made from it")
    text = readme.read_text()
    missing = [name for name in names if not _named(name).search(text)]
    if missing:
        raise ValueError(f"{readme} does not name {', '.join(missing)}: add each lesson to the course map")
    return text


def _map_order(course_map: str, names: list[str]) -> list[str]:
    """``names`` in the order the course map's table lists them (of its Markdown tables, the one naming the most
    lessons; a row's first mention of a lesson counts), then any it leaves out, by name."""
    tables, table = [], []
    for line in [*course_map.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            table.append(line)
        elif table:
            tables.append(table)
            table = []

    def place(name: str, rows: list[str]) -> tuple[int, int] | None:
        found = [(row, m.start()) for row, line in enumerate(rows) for m in [_named(name).search(line)] if m]
        return found[0] if found else None

    rows = max(tables, key=lambda rows: sum(place(name, rows) is not None for name in names), default=[])
    places = {name: place(name, rows) for name in names}
    return sorted(names, key=lambda name: (places[name] is None, places[name] or (0, 0), name))


def lessons(notebooks_dir: Path) -> list[Path]:
    """The lesson notebooks (``NN*_*.ipynb``) in course order: the order of the course map's table
    (notebooks/README.md, which must name every lesson), those it leaves out of its table last, by name."""
    found = {path.stem: path for path in Path(notebooks_dir).glob(LESSONS)}
    if not found:
        raise ValueError(f"no lesson notebooks ({LESSONS}) in {notebooks_dir}")
    return [found[name] for name in _map_order(_course_map(notebooks_dir, sorted(found)), sorted(found))]


def _linked(markdown: str, names: list[str]) -> str:
    """The course map for the site: links to ``X.ipynb`` (with or without a ``#section``) point at ``X.html``, each
    lesson's `X.ipynb` is a link to its page, and every lesson is called by its page's name, ``X.html``."""
    markdown = re.sub(r"\]\(([^)\s]+?)\.ipynb(#[^)\s]*)?\)", r"](\1.html\2)", markdown)
    for name in names:
        markdown = re.sub(rf"(?<!\[)`{re.escape(name)}\.ipynb`(?!\])", f"[`{name}.ipynb`]({name}.html)", markdown)
        markdown = _named(name).sub(f"{name}.html", markdown)
    return markdown


def _shown_figures(source: str) -> int:
    """How many top-level ``plt.show()`` statements a code cell has (IPython magics allowed)."""
    tree = ast.parse(_IPYTHON.transform_cell(source))
    return sum(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and ast.unparse(node.value) == "plt.show()"
        for node in tree.body
    )


def _images(cell) -> int:
    return sum(any(kind in output.get("data", {}) for kind in IMAGES) for output in cell.get("outputs", []))


def _raised(where: str, ename: str, evalue: str) -> ValueError:
    return ValueError(f"{where} raised {ename}: {(evalue.strip().splitlines() or [''])[0]}")


def check(nb, name: str) -> None:
    """Raise one ``ValueError`` line for the first cell with an error output or a figure it did not draw."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        where = f"{name}: cell {cell.get('id', index)}"
        for output in cell.outputs:
            if output.output_type == "error":
                raise _raised(where, output.ename, output.evalue)
        expected = _shown_figures(cell.source) if cell.get("execution_count") is not None else 0
        if _images(cell) < expected:
            raise ValueError(f"{where} calls plt.show() {expected} time(s) but shows {_images(cell)} image(s)")


def _client(nb, notebooks_dir: Path, timeout: float, km: KernelManager | None = None) -> NotebookClient:
    """nbclient set up for a lesson: this environment's ``python3`` kernel, started in ``notebooks_dir`` (or
    ``km``'s, already started), killed as soon as the last cell has returned."""
    return NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebooks_dir)}},
        extra_arguments=["--log-level=ERROR"],  # no kernel start-up warnings between the report's lines
        shutdown_kernel="immediate",
    )  # keeps nbclient's widget state (its output widgets need it); export() reads it, then drops it


def start_kernel(notebooks_dir: Path) -> KernelManager:
    """A lesson's kernel, started now in ``notebooks_dir`` for :func:`run_lesson`: it boots, and its rank server
    imports torch, while this process does something else (writes the previous page). Shut it down if unused."""
    client = _client(nbformat.v4.new_notebook(), notebooks_dir, timeout=1)
    client.km = client.create_kernel_manager()
    client.start_new_kernel()
    return client.km


def run_lesson(nb, notebooks_dir: Path, name: str, timeout: float, km: KernelManager | None = None) -> None:
    """Run ``nb`` in place, top to bottom, in ``notebooks_dir`` on a fresh ``python3`` kernel (``km``'s, from
    :func:`start_kernel`, or one started now), then :func:`check`.

    The kernel is killed with its process group once the last cell has returned (``shutdown_kernel="immediate"``):
    the outputs are complete by then, and its rank server (course_lib.runtime.forkserver) goes with it. A graceful
    shutdown took ~2.4 s more for a one-cell notebook, whose kernel quit while that server was still starting.
    """
    client = _client(nb, notebooks_dir, timeout, km)
    running = {"cell": None}
    client.on_cell_start = lambda cell, cell_index: running.update(cell=cell.get("id", cell_index))
    try:
        client.execute(cleanup_kc=True)  # shut the kernel down even where it came from start_kernel()
    except CellExecutionError as err:
        raise _raised(f"{name}: cell {running['cell']}", err.ename, err.evalue) from None
    except CellTimeoutError:
        raise ValueError(
            f"{name}: cell {running['cell']} ran past the {timeout:g} s limit a cell has (--timeout)"
        ) from None
    except DeadKernelError:
        raise ValueError(f"{name}: the kernel died in cell {running['cell']} (out of memory?)") from None
    check(nb, name)


def _first_drawn(model_id: str, state: dict) -> list[dict]:
    """The outputs held by the Output widgets in widget ``model_id`` and its children, depth first: what the widget
    showed once the lesson had run (an explorer draws its first figure into one)."""
    model = state.get(model_id, {})
    shown = list(model.get("state", {}).get("outputs", [])) if model.get("model_name") == "OutputModel" else []
    for child in model.get("state", {}).get("children", []):
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            shown += _first_drawn(child.removeprefix("IPY_MODEL_"), state)
    return [output for output in shown if WIDGET not in output.get("data", {})]


def _static_widgets(nb) -> None:
    """Replace every widget output with :data:`WIDGET_NOTE` and what the widget first showed (its figures and
    printed lines, from the widget state nbclient stored), then drop that state (no kernel, no CDN)."""
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        outputs = []
        for output in cell.get("outputs", []):
            if WIDGET not in output.get("data", {}):
                outputs.append(output)
                continue
            outputs.append(nbformat.v4.new_output("display_data", data={"text/plain": WIDGET_NOTE}))
            outputs += [nbformat.from_dict(shown) for shown in _first_drawn(output["data"][WIDGET]["model_id"], state)]
        if cell.cell_type == "code":
            cell.outputs = outputs


def _nav(previous: str | None, following: str | None) -> str:
    """Links to the previous lesson, the course map and the next lesson (``rel="prev"`` and ``rel="next"``)."""
    links = [
        f'<a href="{previous}.html" rel="prev">&larr; {previous}</a>' if previous else "",
        '<a href="index.html">Course map</a>',
        f'<a href="{following}.html" rel="next">{following} &rarr;</a>' if following else "",
    ]
    return NAV.format(links="".join(f"<span>{link}</span>" for link in links))


def export(nb, path: Path, previous: str | None = None, following: str | None = None) -> None:
    """Write ``nb`` as a standalone HTML page, with links to the course map and to the ``previous`` and
    ``following`` lessons' pages (names without ``.html``; None for none) at its top and its bottom."""
    _static_widgets(nb)
    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(
        nb, resources={"metadata": {"name": path.stem}}
    )
    nav = _nav(previous, following)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)
    path.write_text(re.sub(r"(</body>)", lambda m: nav + m.group(1), body, count=1), encoding="utf-8")


def write_index(out_dir: Path, course_map: str, names: list[str], executed: bool) -> Path:
    """``out_dir/index.html``: a title, how the pages were made, and the course map linked to the pages."""
    how = (
        f"executed top to bottom with torch {importlib.metadata.version('torch')} on CPU ranks (gloo) on a machine "
        f"with {os.cpu_count()} CPU cores"
        if executed
        else "rendered as stored, without running them"
    )
    made = (
        f"Made by <code>make html</code> on {date.today().isoformat()}: every lesson {how}. These pages are "
        "read-only: nothing on them runs, and an interactive widget shows what it first drew, without its controls. "
        "To change a cell and run it, or move a widget's controls, open the notebooks with <code>make lab</code>."
    )
    title = "Training across many devices: the course"
    page = INDEX.format(title=html.escape(title), made=made, course_map=mistune.html(_linked(course_map, names)))
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def build(
    out_dir: Path | str,
    notebooks_dir: Path | str = NOTEBOOKS,
    execute: bool = True,
    timeout: float = 300,
    on_page: Callable[[Page], None] | None = None,
) -> list[Path]:
    """Execute (unless ``execute=False``), check and export every lesson into ``out_dir``, then write the
    index; returns the lesson pages in course order, then the index. ``timeout`` is per cell, in seconds;
    ``on_page`` hears of each page as it is written. The next lesson's kernel starts before a page is written."""
    out_dir, notebooks_dir = Path(out_dir), Path(notebooks_dir).resolve()
    paths = lessons(notebooks_dir)
    names = [path.stem for path in paths]
    course_map = _course_map(notebooks_dir, names)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages, kernel = [], start_kernel(notebooks_dir) if execute else None
    try:
        for index, path in enumerate(paths):
            start = time.perf_counter()
            nb = nbformat.read(path, as_version=4)
            if kernel is not None:
                km, kernel = kernel, None
                run_lesson(nb, notebooks_dir, path.stem, timeout, km)
                kernel = start_kernel(notebooks_dir) if index + 1 < len(paths) else None
            running = time.perf_counter() - start
            pages.append(out_dir / f"{path.stem}.html")
            following = names[index + 1] if index + 1 < len(names) else None
            export(nb, pages[-1], names[index - 1] if index else None, following)
            if on_page is not None:
                seconds = time.perf_counter() - start
                on_page(Page(path.stem, seconds, sum(_images(cell) for cell in nb.cells), running if execute else 0))
    finally:
        if kernel is not None:
            kernel.shutdown_kernel(now=True)
    return [*pages, write_index(out_dir, course_map, names, execute)]


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--timeout must be a positive number of seconds, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.ui.site OUT_DIR [--no-execute] [--timeout S] [--notebooks DIR]``: a line per lesson
    (name, seconds, of them running its cells, figures), then the total and the index; exit 1 with one line if a
    lesson fails its checks."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.ui.site", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for index.html and one page per lesson")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the lessons' folder (default notebooks/)")
    parser.add_argument("--no-execute", action="store_true", help="render the notebooks as stored, unchecked")
    parser.add_argument("--timeout", type=_seconds, default=300, help="seconds each cell may run (default 300)")
    args = parser.parse_args(argv)

    def report(page: Page) -> None:
        print(
            f"{page.name:<26} {page.seconds:6.1f} s (running {page.running:5.1f} s)  "
            f"{page.figures:2d} figure{'' if page.figures == 1 else 's'}",
            flush=True,
        )

    start = time.perf_counter()
    try:
        pages = build(args.out_dir, args.notebooks, not args.no_execute, args.timeout, on_page=report)
    except ValueError as err:
        print(f"make html: {err}", file=sys.stderr)
        return 1
    print(f"total: {len(pages) - 1} lessons in {time.perf_counter() - start:.0f} s")
    print(f"index: {pages[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
