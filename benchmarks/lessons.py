"""Each lesson's Run All time beside its reading time: the numbers the course map's times are made from.

Every lesson (``course_lib.ui.site.lessons``: the course map's order) is run top to bottom in a copy, as ``make
html`` runs it (``course_lib.ui.site.run_lesson``: a fresh kernel in the notebooks folder, the same checks; nothing
is written into ``notebooks/``). One Markdown table row per lesson, then the total:

* Run All: from the first cell's start to the last cell's end, by the timestamps nbclient records in each cell;
  with kernel: the same plus the start of a fresh kernel (what nbval and ``make html`` pay per lesson);
* words: the prose, every markdown cell's words (link targets and HTML tags left out);
* code: lines of code a student sees (not blank); checks: lines in check cells, collapsed by default (cell
  metadata ``"jupyter": {"source_hidden": true}``) and not counted as read;
* reading: words at 150 per minute plus the code shown at 10 lines per minute; time: reading plus Run All.

    .venv/bin/python benchmarks/lessons.py [--only 03_zero_fsdp 05_pipeline_parallel] [--no-execute]

``--no-execute`` counts without running anything (a second's work, for the words and code alone).
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import nbformat

from course_lib.ui import site

WORDS_PER_MINUTE = 150
CODE_LINES_PER_MINUTE = 10


@dataclass(frozen=True)
class Lesson:
    """One lesson measured; the run times are None where it was not run."""

    name: str
    words: int
    code_lines: int
    check_lines: int
    run_all_s: float | None = None
    with_kernel_s: float | None = None

    @property
    def reading_min(self) -> float:
        return self.words / WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE

    @property
    def minutes(self) -> float:
        return self.reading_min + (self.run_all_s or 0) / 60


def prose_words(nb) -> int:
    """Words in the markdown cells: link targets, HTML tags and bare punctuation are not words."""
    text = " ".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
    text = re.sub(r"\]\([^)]*\)|<[^>]+>", " ", text)
    return sum(bool(re.search(r"\w", token)) for token in text.split())


def hidden(cell) -> bool:
    """A check cell: its input collapsed by default in JupyterLab."""
    return bool(cell.metadata.get("jupyter", {}).get("source_hidden"))


def code_lines(nb, checks: bool = False) -> int:
    """Non-blank lines in the code cells a student sees (``checks=False``) or in the collapsed check cells."""
    cells = [cell for cell in nb.cells if cell.cell_type == "code" and hidden(cell) == checks]
    return sum(bool(line.strip()) for cell in cells for line in cell.source.splitlines())


def run_all_seconds(nb) -> float:
    """From the first cell's start to the last cell's reply, by the timestamps nbclient wrote into the cells."""
    stamps = [cell.metadata.get("execution", {}) for cell in nb.cells if cell.cell_type == "code"]
    stamps = [stamp for stamp in stamps if "iopub.execute_input" in stamp and "shell.execute_reply" in stamp]
    if not stamps:
        return 0.0
    first, last = (
        datetime.fromisoformat(stamps[i][key]) for i, key in ((0, "iopub.execute_input"), (-1, "shell.execute_reply"))
    )
    return (last - first).total_seconds()


def measure(path: Path, execute: bool = True, timeout: float = 300) -> Lesson:
    """Count one lesson's prose and code and, if ``execute``, run a copy of it top to bottom and time it."""
    nb = nbformat.read(path, as_version=4)
    counts = dict(name=path.stem, words=prose_words(nb), code_lines=code_lines(nb), check_lines=code_lines(nb, True))
    if not execute:
        return Lesson(**counts)
    start = time.perf_counter()
    site.run_lesson(nb, path.parent, path.stem, timeout)
    return Lesson(**counts, run_all_s=run_all_seconds(nb), with_kernel_s=time.perf_counter() - start)


HEADER = (
    "| lesson | Run All (s) | with kernel (s) | words | code lines | check lines | reading (min) | time (min) |\n"
    "|---|--:|--:|--:|--:|--:|--:|--:|"
)


def row(lesson: Lesson) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return (
        f"| {lesson.name} | {seconds(lesson.run_all_s)} | {seconds(lesson.with_kernel_s)} | {lesson.words} | "
        f"{lesson.code_lines} | {lesson.check_lines} | {lesson.reading_min:.0f} | {lesson.minutes:.0f} |"
    )


def total(lessons: list[Lesson]) -> Lesson:
    """The sum of every column (run times None if none was run)."""

    def summed(values: list[float | None]) -> float | None:
        return None if all(value is None for value in values) else sum(value or 0 for value in values)

    return Lesson(
        name="total",
        words=sum(lesson.words for lesson in lessons),
        code_lines=sum(lesson.code_lines for lesson in lessons),
        check_lines=sum(lesson.check_lines for lesson in lessons),
        run_all_s=summed([lesson.run_all_s for lesson in lessons]),
        with_kernel_s=summed([lesson.with_kernel_s for lesson in lessons]),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", type=Path, default=site.NOTEBOOKS, help="the lessons' folder")
    parser.add_argument("--only", nargs="+", metavar="LESSON", help="these lessons only (names without .ipynb)")
    parser.add_argument("--no-execute", action="store_true", help="count words and code, run nothing")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each cell may run (default 300)")
    args = parser.parse_args(argv)
    paths = site.lessons(args.notebooks.resolve())
    if args.only:
        unknown = set(args.only) - {path.stem for path in paths}
        if unknown:
            parser.error(f"no lesson named {', '.join(sorted(unknown))}")
        paths = [path for path in paths if path.stem in args.only]
    print(HEADER, flush=True)
    measured = []
    for path in paths:
        measured.append(measure(path, not args.no_execute, args.timeout))
        print(row(measured[-1]), flush=True)
    print(row(total(measured)).replace("| total |", "| **total** |"))


if __name__ == "__main__":
    main()
