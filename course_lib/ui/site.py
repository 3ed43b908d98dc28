"""``make html``: every lesson executed and written as a static site that a browser reads without a kernel.

``python -m course_lib.ui.site OUT_DIR [--no-execute] [--timeout S] [--notebooks DIR]`` (:func:`build`) takes the
lesson notebooks, ``notebooks/NN*_*.ipynb`` in course order (sorted by name), runs a copy of each top to bottom with
nbclient in the notebooks folder on this environment's ``python3`` kernel (nothing is written into ``notebooks/``),
checks it and writes ``OUT_DIR/<lesson>.html`` with nbconvert's HTMLExporter, figures embedded as ``data:`` URIs
so that each page stands alone. ``OUT_DIR/index.html`` is the course map, ``notebooks/README.md``, with every lesson
it names linked to its page. ``--no-execute`` renders the notebooks as stored, unchecked, for a quick look.

The checks, each failing the build with one ``ValueError`` line naming the lesson and the cell:

* no cell has an error output;
* every code cell that ran has at least one image output per top-level ``plt.show()`` statement in its source
  (a statement of the cell itself, not one inside a ``def``, a loop or an ``if``): the lessons draw each figure
  they expect and end it with ``plt.show()``.

Widgets need a kernel, so a widget output becomes a line of text saying where to use it (the index says so too).
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
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from nbconvert import HTMLExporter

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
LESSONS = "[0-9][0-9]*_*.ipynb"
IMAGES = ("image/png", "image/svg+xml", "image/jpeg")
WIDGET = "application/vnd.jupyter.widget-view+json"
_IPYTHON = TransformerManager()  # IPython's own translation of magics into Python
WIDGET_NOTE = "[An interactive widget: it needs a running kernel. Open this lesson with `make lab` to use it.]"
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
    """One lesson written: its name, seconds taken (executing and exporting) and number of images."""

    name: str
    seconds: float
    figures: int


def lessons(notebooks_dir: Path) -> list[Path]:
    """The lesson notebooks in course order (by name: ``00_collectives`` before ``00b_hardware``)."""
    found = sorted(Path(notebooks_dir).glob(LESSONS))
    if not found:
        raise ValueError(f"no lesson notebooks ({LESSONS}) in {notebooks_dir}")
    return found


def _course_map(notebooks_dir: Path, names: list[str]) -> str:
    """notebooks/README.md, refused before any lesson runs if it does not name every lesson."""
    readme = Path(notebooks_dir) / "README.md"
    if not readme.is_file():
        raise ValueError(f"no course map at {readme}: the index is made from it")
    text = readme.read_text()
    missing = [name for name in names if f"{name}.ipynb" not in text]
    if missing:
        raise ValueError(f"{readme} does not name {', '.join(missing)}: add each lesson to the course map")
    return text


def _linked(markdown: str, names: list[str]) -> str:
    """The course map with ``X.ipynb`` links turned into ``X.html`` and each lesson's `X.ipynb` linked to its page."""
    markdown = re.sub(r"\]\(([^)\s]+)\.ipynb\)", r"](\1.html)", markdown)
    for name in names:
        markdown = re.sub(rf"(?<!\[)`{re.escape(name)}\.ipynb`(?!\])", f"[`{name}.ipynb`]({name}.html)", markdown)
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


def run_lesson(nb, notebooks_dir: Path, name: str, timeout: float) -> None:
    """Run ``nb`` in place, top to bottom, in ``notebooks_dir`` on a fresh ``python3`` kernel, then :func:`check`.

    The kernel is killed with its process group once the last cell has returned (``shutdown_kernel="immediate"``):
    the outputs are complete by then, and its rank server (course_lib.runtime.forkserver) goes with it. A graceful
    shutdown took ~2.4 s more for a one-cell notebook, whose kernel quit while that server was still starting.
    """
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebooks_dir)}},
        extra_arguments=["--log-level=ERROR"],  # no kernel start-up warnings between the report's lines
        shutdown_kernel="immediate",
    )  # keeps nbclient's widget state (its output widgets need it); export() drops it
    running = {"cell": None}
    client.on_cell_start = lambda cell, cell_index: running.update(cell=cell.get("id", cell_index))
    try:
        client.execute()
    except CellExecutionError as err:
        raise _raised(f"{name}: cell {running['cell']}", err.ename, err.evalue) from None
    except CellTimeoutError:
        raise ValueError(
            f"{name}: cell {running['cell']} ran past the {timeout:g} s limit a cell has (--timeout)"
        ) from None
    except DeadKernelError:
        raise ValueError(f"{name}: the kernel died in cell {running['cell']} (out of memory?)") from None
    check(nb, name)


def _static_widgets(nb) -> None:
    """Replace every widget output with :data:`WIDGET_NOTE` and drop stored widget state (no kernel, no CDN)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if WIDGET in output.get("data", {}):
                output["data"] = {"text/plain": WIDGET_NOTE}


def export(nb, path: Path) -> None:
    """Write ``nb`` as a standalone HTML page, with a link back to the course map."""
    _static_widgets(nb)
    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(
        nb, resources={"metadata": {"name": path.stem}}
    )
    back = '<p style="margin: 1rem 2rem; font-family: sans-serif"><a href="index.html">&larr; Course map</a></p>'
    path.write_text(re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + back, body, count=1), encoding="utf-8")


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
        "read-only: nothing on them runs, and interactive widgets show as a line of text. To change a cell and run "
        "it, open the notebooks with <code>make lab</code>."
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
    ``on_page`` hears of each page as it is written."""
    out_dir, notebooks_dir = Path(out_dir), Path(notebooks_dir).resolve()
    paths = lessons(notebooks_dir)
    names = [path.stem for path in paths]
    course_map = _course_map(notebooks_dir, names)
    out_dir.mkdir(parents=True, exist_ok=True)
    pages = []
    for path in paths:
        start = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        if execute:
            run_lesson(nb, notebooks_dir, path.stem, timeout)
        pages.append(out_dir / f"{path.stem}.html")
        export(nb, pages[-1])
        if on_page is not None:
            on_page(Page(path.stem, time.perf_counter() - start, sum(_images(cell) for cell in nb.cells)))
    return [*pages, write_index(out_dir, course_map, names, execute)]


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"--timeout must be a positive number of seconds, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.ui.site OUT_DIR [--no-execute] [--timeout S] [--notebooks DIR]``: a line per lesson
    (name, seconds, figures), then the index; exit 1 with one line if a lesson fails its checks."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.ui.site", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for index.html and one page per lesson")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="the lessons' folder (default notebooks/)")
    parser.add_argument("--no-execute", action="store_true", help="render the notebooks as stored, unchecked")
    parser.add_argument("--timeout", type=_seconds, default=300, help="seconds each cell may run (default 300)")
    args = parser.parse_args(argv)

    def report(page: Page) -> None:
        print(
            f"{page.name:<26} {page.seconds:6.1f} s  {page.figures:2d} figure{'' if page.figures == 1 else 's'}",
            flush=True,
        )

    try:
        pages = build(args.out_dir, args.notebooks, not args.no_execute, args.timeout, on_page=report)
    except ValueError as err:
        print(f"make html: {err}", file=sys.stderr)
        return 1
    print(f"index: {pages[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
