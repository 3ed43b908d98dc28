"""Figures of what the ranks did: timeline (Gantt), memory per rank beside the prediction, bytes moved per step.

Every function draws on a given matplotlib ``Axes`` (or a new figure) and returns the ``Figure``, so notebooks show
it and the CLI saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt

from course_lib.comm import CommRecord, summarize
from course_lib.memory import CATEGORIES, model_state_formula
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


def time_unit(max_seconds: float) -> tuple[float, str]:
    """The (multiplier, name) of seconds, milliseconds or microseconds that suits ``max_seconds``."""
    for factor, name in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if max_seconds * factor >= 1:
            return factor, name
    return 1e9, "ns"


def plot_timeline(
    events_per_rank: Sequence[Sequence[Event]],
    ax=None,
    title: str = "What each rank did",
    clock: str = "wall clock",
) -> plt.Figure:
    """Two lanes per rank, as a profiler shows streams: compute above (gaps drawn as idle; an event inside
    another, such as one block's forward inside the forward pass, drawn thinner on top) and collectives below.
    On the wall clock a collective runs from its issue to its wait; on a modeled clock (``clock="modeled: h100"``)
    from when its data starts to move to when it is done."""
    fig, ax = _axes(ax, (10, 0.75 * len(events_per_rank) + 1.6))
    origin = min((e.start for rank_events in events_per_rank for e in rank_events), default=0.0)
    extent = max((e.end for rank_events in events_per_rank for e in rank_events), default=0.0) - origin
    factor, unit = time_unit(extent)
    seen = set()
    for rank, rank_events in enumerate(events_per_rank):
        compute = [e for e in rank_events if e.kind != "comm"]
        for e in with_idle(compute) + [e for e in rank_events if e.kind == "comm"]:
            nested = e.kind != "comm" and any(o is not e and o.start <= e.start and e.end <= o.end for o in compute)
            top, height = (rank + 0.04, 0.34) if e.kind == "comm" else (rank - 0.40, 0.40)
            if nested:
                top, height = top + 0.1, height - 0.2
            ax.broken_barh(
                [((e.start - origin) * factor, max(e.duration, 0.0) * factor)],
                (top, height),
                facecolors=KIND_COLORS.get(e.kind, "black"),
                edgecolor="white",
                linewidth=0.3,
                zorder=3 if nested else 2,
            )
            seen.add(e.kind)
    ax.set_yticks(range(len(events_per_rank)), [f"rank {r}" for r in range(len(events_per_rank))])
    ax.set_ylim(len(events_per_rank) - 0.5, -0.5)
    ax.set_xlabel(f"{clock}: time ({unit}) from the first event shown")
    ax.set_title(f"{title} ({clock})\nupper lane: compute, lower lane: collectives", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in KIND_COLORS if k in seen]
    ax.legend(handles, [k for k in KIND_COLORS if k in seen], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def plot_clocks(wall: Sequence[Sequence[Event]], modeled, title: str = "One step") -> plt.Figure:
    """The same events on the wall clock (this machine) above and on a modeled cluster below
    (``modeled`` is a :class:`course_lib.hardware.ModeledRun`; both show its step)."""
    n = len(wall)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.5 * n + 3.2), layout="constrained")

    def step_only(per_rank):
        return [
            [e for e in events if modeled.step is None or e.tags.get("step") == modeled.step] for events in per_rank
        ]

    plot_timeline(step_only(wall), ax=top, title=title)
    plot_timeline(
        step_only(modeled.events),
        ax=bottom,
        title=title,
        clock=f"modeled: {modeled.hardware}, {modeled.gpus_per_node} GPU{'s' * (modeled.gpus_per_node != 1)} per node",
    )
    return fig


SCHEDULE_COLORS = {"F": KIND_COLORS["forward"], "B": KIND_COLORS["backward"], "W": KIND_COLORS["weight_grad"]}


def plot_schedule(simulation, ax=None, title: str = "Pipeline schedule") -> plt.Figure:
    """A simulated schedule (:func:`course_lib.parallel.schedules.simulate`): per rank its F, B and W actions,
    each labelled with its microbatch (and chunk), idle time left blank; the bubble fraction in the title."""
    p = len(simulation.busy)
    fig, ax = _axes(ax, (10, 0.55 * p + 1.6))
    for rank, intervals in enumerate(simulation.busy):
        for start, end, action in intervals:
            ax.broken_barh(
                [(start, end - start)],
                (rank - 0.4, 0.8),
                facecolors=SCHEDULE_COLORS[action.kind],
                edgecolor="white",
                linewidth=0.8,
            )
            label = f"{action.microbatch}" + (f".{action.chunk}" if action.chunk else "")
            ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, simulation.makespan)
    ax.set_xlabel("time (units of one forward)")
    ax.set_title(f"{title}: bubble {simulation.bubble_fraction:.1%} of the time", fontsize=10)
    kinds = sorted({a.kind for intervals in simulation.busy for _, _, a in intervals}, key="FBW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=SCHEDULE_COLORS[k]) for k in kinds]
    names = {"F": "F: forward", "B": "B: backward", "W": "W: weight gradient"}
    ax.legend(handles, [names[k] for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def plot_memory(
    measured: Sequence[dict],
    predicted: Sequence[dict] | None = None,
    ax=None,
    title: str = "Memory per rank",
    labels: Sequence[str] | None = None,
) -> plt.Figure:
    """Per rank (or per ``labels`` entry), a stacked bar of measured bytes (params, grads, optimizer, activations at
    their peak) and, hatched beside it, the prediction; ``predicted`` has the same keys (``activations`` last).
    A black line marks the measured peak: all of it live at once, plus temporaries (a layer's output, a gradient
    bucket, a gathered unit)."""
    fig, ax = _axes(ax, (max(5, 1.4 * len(measured) + 3), 4))
    bars = [("measured", measured, 0.0)] + ([("predicted", predicted, 0.38)] if predicted else [])
    top = max(max(sum(_mem_parts(m).values()), m.get("peak", 0)) for _, rows, _ in bars for m in rows)
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
    for rank, row in enumerate(measured):
        if "peak" in row:  # everything live at the worst moment, temporaries included
            x = rank - (0.19 if predicted else 0.0)
            ax.hlines(
                row["peak"] / scale,
                x - width / 2,
                x + width / 2,
                colors="black",
                linewidth=2,
                label="measured peak" if rank == 0 else None,
                zorder=4,
            )
    ax.set_xticks(range(len(measured)), labels or [f"rank {r}" for r in range(len(measured))])
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


ZERO_STAGES = {0: "DP (baseline)", 1: "ZeRO-1\nP_os", 2: "ZeRO-2\nP_os+g", 3: "ZeRO-3\nP_os+g+p"}


def plot_zero_memory(
    params: float, dp: int, precision: str = "mixed", gpu_bytes: float | None = 80e9, ax=None
) -> plt.Figure:
    """Model-state memory per device for each ZeRO stage (Rajbhandari et al. 2020, Figure 1), stacked by category,
    with one GPU's memory as a dotted line."""
    fig, ax = _axes(ax, (7, 3.8))
    rows = {stage: model_state_formula(params, precision, zero=stage, dp=dp) for stage in ZERO_STAGES}
    scale, unit = byte_unit(max(sum(r.values()) for r in rows.values()))
    for x, row in enumerate(rows.values()):
        bottom = 0.0
        for cat in CATEGORIES:
            ax.bar(x, row[cat] / scale, 0.6, bottom=bottom, color=MEMORY_COLORS[cat], label=cat if x == 0 else None)
            bottom += row[cat] / scale
        ax.text(x, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=9)
    if gpu_bytes:
        ax.axhline(gpu_bytes / scale, color="black", ls=":", label=f"one GPU ({gpu_bytes / 1e9:.0f} GB)")
    ax.set_xticks(range(len(rows)), list(ZERO_STAGES.values()))
    ax.set_ylabel(f"model states per device ({unit})")
    ax.set_title(f"{params / 1e9:g}B parameters, {precision} Adam, {dp} data-parallel devices")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return fig


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
        f"{name}_timeline.png": plot_timeline(run.result.events, title=f"{name}: what each rank did"),
        f"{name}_memory.png": plot_memory(memory, run.predicted_memory, title=f"{name}: memory per rank"),
        f"{name}_comm.png": plot_comm(run.result.comm[0], title=f"{name}: bytes rank 0 sent per step"),
    }
    if run.modeled is not None:
        figures[f"{name}_clocks.png"] = plot_clocks(run.result.events, run.modeled, title=f"{name}: last step")
    written = []
    for filename, fig in figures.items():
        fig.savefig(folder / filename, dpi=110)
        plt.close(fig)
        written.append(str(folder / filename))
    to_chrome_trace(run.result.events, folder / f"{name}_trace.json")
    written.append(str(folder / f"{name}_trace.json"))
    return written
