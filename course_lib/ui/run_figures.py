"""The figures of one run, as ``run --plot`` and ``demo --plot`` write them: each title says in words what ran
(the scheme, its ranks, its layout or schedule) and what the figure shows.

* the timeline shows one ordinary step, the one before the last: the last step ran under the memory meter, whose
  bookkeeping makes it several times longer (and the first carries the ranks' start), so a figure of every step
  squeezes the others;
* rank labels name a rank's coordinates on the axes the run has, two axes a line;
* the memory figure says where no formula predicts the activations (a student's model, an MoE, mixed precision).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

from course_lib.ledgers.trace import to_chrome_trace
from course_lib.ui.plots import TEMPORARIES, plot_clocks, plot_comm, plot_memory, plot_timeline, plot_traffic

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun


def file_stem(report: dict) -> str:
    """``zero3_n4``: the files' common stem (an id for file names, not for titles)."""
    return f"{report['scheme']}_n{report['world_size']}"


def run_words(report: dict) -> str:
    """What ran, in words: ``pp on 4 ranks, 1f1b schedule with 4 microbatches`` or ``3d on 8 ranks: TP 2 x PP 2 x
    DP 2`` (the grid's sizes read from the ranks' coordinates)."""
    n = report["world_size"]
    words = f"{report['scheme']} on {n} rank{'s' * (n != 1)}"
    sizes = {axis: len({r["coords"][axis] for r in report["ranks"]}) for axis in report["ranks"][0]["coords"]}
    grid = [f"{axis.upper()} {size}" for axis, size in reversed(sizes.items()) if size > 1]
    if len(grid) > 1:  # a grid of several axes: its shape, innermost first
        words += ": " + " x ".join(grid)
    pipe = report.get("pipeline")
    if pipe:
        chunks = f", {pipe['chunks']} chunks a rank" if pipe["chunks"] > 1 else ""
        words += f", {pipe['schedule']} schedule with {pipe['microbatches']} microbatches{chunks}"
    return words


def rank_labels(report: dict) -> list[str]:
    """``rank 3`` and, below it, its coordinates on the axes some rank is off 0 on, two a line."""
    ranks = report["ranks"]
    axes = [axis for axis in ranks[0]["coords"] if any(r["coords"][axis] for r in ranks)]
    labels = []
    for r in ranks:
        coords = [f"{axis}{r['coords'][axis]}" for axis in axes]
        lines = [" ".join(coords[i : i + 2]) for i in range(0, len(coords), 2)]
        labels.append("\n".join([f"rank {r['rank']}", *lines]))
    return labels


def run_figures(run: SchemeRun) -> dict[str, plt.Figure]:
    """A scheme run's figures by file name: timeline, memory, comm (for a 3D run: bytes by axis on every rank
    beside the prediction) and, when the run was replayed on a modeled cluster, both clocks of its last step."""
    report, stem, words = run.report, file_stem(run.report), run_words(run.report)
    metered = report["steps"] - 1  # every scheme meters the step it reports, the last
    memory = [r["memory"] for r in report["ranks"]]
    temporaries = TEMPORARIES + (", the gathered parameters" if report["scheme"] == "zero3" else "")
    if report["scheme"] == "3d":
        comm = plot_traffic(run.result.comm, run.predicted_comm, title=f"{words}: bytes each rank sent, by axis",
                            labels=rank_labels(report))  # fmt: skip
    else:
        comm = plot_comm(run.result.comm[0], title=f"{words}: bytes rank 0 sent in each step")
    figures = {
        f"{stem}_timeline.png": _timeline(run, words, metered),
        f"{stem}_memory.png": plot_memory(
            memory,
            run.predicted_memory,
            title=f"{words}: what each rank holds",
            temporaries=temporaries,
            labels=rank_labels(report),
        ),  # fmt: skip
        f"{stem}_comm.png": comm,
    }
    if run.modeled is not None:
        figures[f"{stem}_clocks.png"] = plot_clocks(
            run.result.events, run.modeled, title=f"{words}, last step", metered_step=metered
        )
    return figures


def _timeline(run: SchemeRun, words: str, metered: int) -> plt.Figure:
    """The step before the metered one (an ordinary step), or the only step there is, said in the title."""
    if metered == 0:
        return plot_timeline(run.result.events, title=f"{words}: what each rank did", metered_step=metered)
    shown = metered - 1
    events = [[e for e in rank_events if e.tags.get("step") == shown] for rank_events in run.result.events]
    title = (
        f"{words}: what each rank did in step {shown} (step {metered} ran under the memory meter, several times "
        "slower, and is left out)"
    )
    return plot_timeline(events, title=title)


def save_run_figures(run: SchemeRun, folder: str | Path) -> list[str]:
    """Write a scheme run's figures (:func:`run_figures`, PNG) and its Chrome trace (JSON) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, fig in run_figures(run).items():
        fig.savefig(folder / filename, dpi=110)
        plt.close(fig)
        written.append(str(folder / filename))
    trace_file = folder / f"{file_stem(run.report)}_trace.json"
    to_chrome_trace(run.result.events, trace_file)
    written.append(str(trace_file))
    return written
