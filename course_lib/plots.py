"""Figures of what the ranks did: timeline (Gantt), memory per rank beside the prediction, bytes moved per step.

Every function draws on a given matplotlib ``Axes`` (or a new figure) and returns the ``Figure``, so notebooks show
it and the CLI saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt

from course_lib.comm import CommRecord, summarize
from course_lib.trace import Event, to_chrome_trace, with_idle

KIND_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight_grad": "#C44E52",
    "optimizer": "#55A868",
    "compute": "#8172B3",
    "comm": "#937860",
    "idle": "#E5E5E5",
}
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


def byte_unit(max_bytes: float) -> tuple[float, str]:
    """The decimal unit (divisor, name) that keeps ``max_bytes`` between 1 and 1000."""
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if max_bytes >= scale:
            return scale, name
    return 1.0, "B"


def _axes(ax, size):
    if ax is None:
        fig, ax = plt.subplots(figsize=size, layout="constrained")
    return ax.figure, ax


def plot_timeline(
    events_per_rank: Sequence[Sequence[Event]], ax=None, title: str = "What each rank did (wall clock)"
) -> plt.Figure:
    """One row per rank; each event a bar coloured by kind; gaps drawn as idle; comm drawn over compute."""
    fig, ax = _axes(ax, (10, 0.6 * len(events_per_rank) + 1.6))
    seen = set()
    for rank, rank_events in enumerate(events_per_rank):
        for e in with_idle(rank_events):
            # An event inside another one (a collective issued during backward) is drawn thinner, on top.
            nested = any(o is not e and o.start <= e.start and e.end <= o.end for o in rank_events)
            height = 0.4 if nested else 0.8
            ax.broken_barh(
                [(e.start * 1e3, max(e.duration, 0.0) * 1e3)],
                (rank - height / 2, height),
                facecolors=KIND_COLORS.get(e.kind, "black"),
                edgecolor="white",
                linewidth=0.3,
                zorder=3 if nested else 2,
            )
            seen.add(e.kind)
    ax.set_yticks(range(len(events_per_rank)), [f"rank {r}" for r in range(len(events_per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time since launch (ms)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in KIND_COLORS if k in seen]
    ax.legend(handles, [k for k in KIND_COLORS if k in seen], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def plot_memory(
    measured: Sequence[dict], predicted: Sequence[dict] | None = None, ax=None, title: str = "Memory per rank"
) -> plt.Figure:
    """Per rank, a stacked bar of measured bytes (params, grads, optimizer, activations at their peak) and,
    hatched beside it, the prediction; ``predicted`` has the same keys (``activations`` for the last)."""
    fig, ax = _axes(ax, (max(5, 1.4 * len(measured) + 3), 4))
    bars = [("measured", measured, 0.0)] + ([("predicted", predicted, 0.38)] if predicted else [])
    top = max(sum(_mem_parts(m).values()) for _, rows, _ in bars for m in rows)
    scale, unit = byte_unit(top)
    width = 0.36 if predicted else 0.6
    for label, rows, offset in bars:
        for rank, row in enumerate(rows):
            bottom = 0.0
            for cat, value in _mem_parts(row).items():
                ax.bar(
                    rank + offset - (0.19 if predicted else 0.0),
                    value / scale,
                    width,
                    bottom=bottom,
                    color=MEMORY_COLORS[cat],
                    hatch="//" if label == "predicted" else None,
                    edgecolor="white",
                    label=f"{cat}" if rank == 0 and label == "measured" else None,
                )
                bottom += value / scale
    ax.set_xticks(range(len(measured)), [f"rank {r}" for r in range(len(measured))])
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title + (" — solid: measured, hatched: predicted" if predicted else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _mem_parts(row: dict) -> dict:
    return {
        "params": row.get("params", 0),
        "grads": row.get("grads", 0),
        "optimizer": row.get("optimizer", 0),
        "activations": row.get("activations_peak", row.get("activations", 0)),
    }


def plot_comm(records: Sequence[CommRecord], ax=None, title: str = "Bytes sent per step, by collective") -> plt.Figure:
    """Stacked bars: for each step, the ring bytes this rank sent in each kind of collective."""
    fig, ax = _axes(ax, (7, 3.5))
    by_step = {}
    for step in sorted({r.tags.get("step") for r in records if r.tags.get("step") is not None}):
        by_step[step] = summarize([r for r in records if r.tags.get("step") == step])
    ops = sorted({op for summary in by_step.values() for op in summary})
    if not ops:
        ax.text(0.5, 0.5, "no communication: a single rank talks to nobody", ha="center", transform=ax.transAxes)
    top = max((sum(s["bytes"] for s in summary.values()) for summary in by_step.values()), default=1.0)
    scale, unit = byte_unit(top)
    bottoms = dict.fromkeys(by_step, 0.0)
    for i, op in enumerate(ops):
        heights = [by_step[step].get(op, {"bytes": 0.0})["bytes"] / scale for step in by_step]
        ax.bar(list(by_step), heights, bottom=list(bottoms.values()), label=op, color=f"C{i}")
        for step, h in zip(by_step, heights, strict=True):
            bottoms[step] += h
    ax.set_xlabel("training step")
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_xticks(list(by_step))
    ax.set_title(title)
    if ops:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def save_run_figures(run, folder) -> list[str]:
    """Write a scheme run's timeline, memory and comm figures (PNG) and its Chrome trace (JSON) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{run.report['scheme']}_n{run.report['world_size']}"
    memory = [r["memory"] for r in run.report["ranks"]]
    figures = {
        f"{name}_timeline.png": plot_timeline(run.result.events, title=f"{name}: what each rank did (wall clock)"),
        f"{name}_memory.png": plot_memory(memory, run.predicted_memory, title=f"{name}: memory per rank"),
        f"{name}_comm.png": plot_comm(run.result.comm[0], title=f"{name}: bytes rank 0 sent per step"),
    }
    written = []
    for filename, fig in figures.items():
        fig.savefig(folder / filename, dpi=110)
        plt.close(fig)
        written.append(str(folder / filename))
    to_chrome_trace(run.result.events, folder / f"{name}_trace.json")
    written.append(str(folder / f"{name}_trace.json"))
    return written
