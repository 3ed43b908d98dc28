"""Figures of what the ranks did: timeline (Gantt), memory per rank beside the prediction, bytes moved per step
and, in a 3D run, along each axis.

Every function draws on a given matplotlib ``Axes`` (or a new figure) and returns the ``Figure``, so notebooks show
it and the CLI saves it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

from course_lib.ledgers.categories import CATEGORIES
from course_lib.ledgers.comm import CommRecord, summarize
from course_lib.ledgers.trace import Event, with_idle
from course_lib.model.formulas import model_state_formula
from course_lib.runtime import checkpoint

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun

KIND_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight_grad": "#C44E52",
    "recompute": "#64B5CD",
    "optimizer": "#55A868",
    "compute": "#8172B3",
    "comm": "#937860",
    "idle": "#E5E5E5",
}
WALL_CLOCK = "wall clock"
THIN_COMPUTE = 0.02  # on a modeled clock, a compute share below this is too thin to see: the figure says so
# What a memory meter's peak holds beyond the bars, in every scheme: the gradients each layer's backward produces
# for the layer below, and forward outputs that backward does not need (they are freed once used).
TEMPORARIES = "gradients on their way back through backward, outputs not kept for backward"
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
    clock: str = WALL_CLOCK,
    metered_step: int | None = None,
) -> plt.Figure:
    """Per rank a compute lane (an event inside another, such as one block's forward inside the forward pass,
    drawn thinner on top) and, when some rank made a collective, a collectives lane below it.

    On the wall clock a collective's bar runs from its issue to the end of its wait, so it includes waiting for the
    other ranks, and gaps in the compute lane stay blank: the rank was blocked in a wait or ran Python outside the
    spans (batches, bookkeeping). On a modeled clock (``clock="modeled: h100"``) a collective's bar runs while its
    data moves and gaps are idle (the rank waits for a collective); a note says when compute is too thin to see.
    ``metered_step`` is the step that ran under the memory meter, whose bookkeeping slows it on the wall clock: a
    note says so when that step is shown. A figure of several steps marks where each begins."""
    n = len(events_per_rank)
    wall = clock == WALL_CLOCK
    lanes = any(e.kind == "comm" for rank_events in events_per_rank for e in rank_events)
    fig, ax = _axes(ax, (10, 0.75 * n + 1.9))
    origin = min((e.start for rank_events in events_per_rank for e in rank_events), default=0.0)
    extent = max((e.end for rank_events in events_per_rank for e in rank_events), default=0.0) - origin
    factor, unit = time_unit(extent)
    seen = set()
    for rank, rank_events in enumerate(events_per_rank):
        compute = [e for e in rank_events if e.kind != "comm"]
        for e in (compute if wall else with_idle(compute)) + [e for e in rank_events if e.kind == "comm"]:
            nested = e.kind != "comm" and any(o is not e and o.start <= e.start and e.end <= o.end for o in compute)
            if e.kind == "comm":
                top, height = rank + 0.04, 0.34
            else:
                top, height = (rank - 0.40, 0.40) if lanes else (rank - 0.35, 0.70)
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
    steps = _step_spans(events_per_rank)
    if len(steps) > 1:
        _mark_steps(ax, steps, origin, factor, extent)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5 - 0.45 * (len(steps) > 1))  # room for two rows of step labels
    ax.set_xlabel(f"{clock}: time ({unit}) from the first event shown")
    if lanes:
        lanes_line = "upper lane: compute" + (" (blank: waiting, or untraced Python)" if wall else "")
        lanes_line += ", lower lane: collectives"
    else:
        lanes_line = "compute only, no rank made a collective" + (" (blank: untraced Python)" if wall else "")
    lines = [f"{title} ({clock})", lanes_line]
    if wall and metered_step in steps:
        lines.append(_metered_note(steps, metered_step, factor, unit))
    share = _compute_share(events_per_rank, extent)
    if not wall and share < THIN_COMPUTE:
        lines.append(
            f"compute is {share * 100:.2g}% of the ranks' time, too thin to see: they have little to compute between "
            "collectives (a wider model or a larger batch gives them more)"
        )
    ax.set_title("\n".join(textwrap.fill(line, 95) for line in lines), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    kinds = [k for k in KIND_COLORS if k in seen]
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in kinds]
    ax.legend(handles, [_kind_label(k, wall) for k in kinds], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def _mark_steps(ax, steps: dict[int, tuple[float, float]], origin: float, factor: float, extent: float) -> None:
    """A dotted line where each step begins, labelled at the top; a label close to the last one goes a row lower."""
    row, last = 0, None
    for step, (start, _) in steps.items():
        x = (start - origin) * factor
        row = 1 - row if last is not None and x - last < 0.08 * extent * factor else 0
        last = x
        ax.axvline(x, color="0.35", ls=":", lw=0.8, zorder=1)
        ax.annotate(
            f"step {step}",
            (x, 1.0),
            xycoords=ax.get_xaxis_transform(),
            xytext=(2, -2 - 10 * row),
            textcoords="offset points",
            fontsize=8,
            va="top",
            color="0.25",
        )


def _kind_label(kind: str, wall: bool) -> str:
    if kind == "comm":
        return "collective: issued → done,\nwaiting for peers included" if wall else "collective: data moving"
    if kind == "idle":
        return "idle: waiting for\na collective"
    return kind


def _step_spans(events_per_rank: Sequence[Sequence[Event]]) -> dict[int, tuple[float, float]]:
    """(first start, last end) over all ranks of each step the events are tagged with, in step order."""
    spans: dict[int, tuple[float, float]] = {}
    for e in sorted((e for rank_events in events_per_rank for e in rank_events), key=lambda e: e.start):
        step = e.tags.get("step")
        if step is not None:
            start, end = spans.get(step, (e.start, e.end))
            spans[step] = (start, max(end, e.end))
    return dict(sorted(spans.items()))


def _metered_note(steps: dict[int, tuple[float, float]], metered: int, factor: float, unit: str) -> str:
    """What the memory meter did to the wall clock of its step, against the step before it when that is shown."""
    note = f"step {metered} ran under the memory meter, whose bookkeeping slows it"
    if metered - 1 not in steps:
        return note

    def took(step: int) -> str:
        return f"{(steps[step][1] - steps[step][0]) * factor:.3g} {unit}"

    return note + f" ({took(metered)}; step {metered - 1}: {took(metered - 1)})"


def _compute_share(events_per_rank: Sequence[Sequence[Event]], extent: float) -> float:
    """The share of the ranks' time (``extent`` each) that some compute event covers."""
    if not extent:
        return 1.0
    busy = 0.0
    for rank_events in events_per_rank:
        compute = [e for e in rank_events if e.kind != "comm"]
        if compute:
            span = max(e.end for e in compute) - min(e.start for e in compute)
            busy += span - sum(e.duration for e in with_idle(compute) if e.kind == "idle")
    return busy / (extent * len(events_per_rank))


def plot_clocks(
    wall: Sequence[Sequence[Event]], modeled, title: str = "One step", metered_step: int | None = None
) -> plt.Figure:
    """The same events on the wall clock (this machine) above and on a modeled cluster below
    (``modeled`` is a :class:`course_lib.cluster.clock.ModeledRun`; both show its step). ``metered_step``: the step
    that ran under the memory meter (see :func:`plot_timeline`)."""
    n = len(wall)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.5 * n + 3.8), layout="constrained")

    def step_only(per_rank):
        return [
            [e for e in events if modeled.step is None or e.tags.get("step") == modeled.step] for events in per_rank
        ]

    plot_timeline(step_only(wall), ax=top, title=title, metered_step=metered_step)
    plot_timeline(
        step_only(modeled.events),
        ax=bottom,
        title=title,
        clock=f"modeled: {modeled.hardware}, "
        + (
            f"{modeled.gpus_per_node} GPU{'s' * (modeled.gpus_per_node != 1)} per node"
            if modeled.topology is None
            else f"links of {modeled.topology}"
        ),
    )
    return fig


RANK_COLORS = plt.get_cmap("tab10").colors


def plot_ring_attention(
    blocks: Sequence[Sequence[tuple[int, int, int, str]]], title: str = "Ring attention"
) -> plt.Figure:
    """One panel per ring step: the causal mask in 2n x 2n chunk blocks (query chunk down, key chunk across), each
    block a rank computes at that step in the rank's colour, diagonal (masked) blocks hatched; the upper triangle,
    which no one computes, stays grey. ``blocks`` per rank: :func:`course_lib.parallel.context.ring_blocks`."""
    n = len(blocks)
    chunks = 2 * n
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n + 1.2, 3.1), layout="constrained", squeeze=False)
    for t, ax in enumerate(axes[0]):
        for i in range(chunks):
            for m in range(i + 1, chunks):
                ax.add_patch(plt.Rectangle((m, i), 1, 1, color="0.92"))
        for rank, rank_blocks in enumerate(blocks):
            for step, i, m, kind in rank_blocks:
                if step == t:
                    hatch = "////" if kind == "diagonal" else None
                    ax.add_patch(
                        plt.Rectangle((m, i), 1, 1, facecolor=RANK_COLORS[rank], edgecolor="white", hatch=hatch)
                    )
        ax.set_xlim(0, chunks)
        ax.set_ylim(chunks, 0)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(chunks)], range(chunks), fontsize=7)
        ax.set_yticks([c + 0.5 for c in range(chunks)], range(chunks), fontsize=7)
        ax.set_xlabel("key chunk", fontsize=8)
        ax.set_title(f"ring step {t}", fontsize=9)
    axes[0][0].set_ylabel("query chunk", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r]) for r in range(n)]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="0.3", hatch="////"))
    axes[0][-1].legend(
        handles,
        [f"rank {r}" for r in range(n)] + ["diagonal (masked)"],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    return fig


def plot_checkpoint_timeline(runs: dict[str, SchemeRun], rank: int = 0) -> plt.Figure:
    """One panel per run (``{label: run with checkpoints}``), on rank ``rank``'s wall clock from its first step:
    its training steps and the time training stood still for a checkpoint (copying the state, writing it, or
    waiting for a write still under way) on one lane, and the checkpoint being written on another; the title gives
    the run's total stall. A synchronous save stalls for the whole write; an asynchronous one only to copy, then
    writes beside training (:class:`course_lib.runtime.checkpoint.Saver`)."""
    panels = {}
    for label, run in runs.items():
        steps = _step_spans([run.result.events[rank]])
        zero = min(a for a, _ in steps.values())
        saves = [
            {k: [x - zero for x in v] if isinstance(v, list) else v for k, v in t.items()}
            for t in run.report["checkpoints"]["saves"][rank]
        ]
        panels[label] = ({step: (a - zero, b - zero) for step, (a, b) in steps.items()}, saves)
    end = max(
        max(max(b for _, b in steps.values()), *(t["write"][1] for t in saves)) for steps, saves in panels.values()
    )
    scale, unit = time_unit(end)
    colors = {"step": KIND_COLORS["forward"], "stall": "#C44E52", "write": "#55A868"}
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(9, 1.7 * len(runs) + 0.9), layout="constrained", squeeze=False, sharex=True
    )
    for ax, (label, (steps, saves)) in zip(axes[:, 0], panels.items(), strict=True):
        for step, (a, b) in steps.items():
            ax.broken_barh([(a * scale, (b - a) * scale)], (1.1, 0.8), facecolor=colors["step"], edgecolor="white")
            ax.text((a + b) / 2 * scale, 1.5, str(step), ha="center", va="center", color="white", fontsize=7)
        stalled = 0.0
        for t in saves:
            for a, b in checkpoint.stalls(t):
                ax.broken_barh([(a * scale, (b - a) * scale)], (1.1, 0.8), facecolor=colors["stall"])
                stalled += b - a
            a, b = t["write"]
            ax.broken_barh([(a * scale, (b - a) * scale)], (0.1, 0.8), facecolor=colors["write"], edgecolor="white")
            ax.text(a * scale, 0.02, f"step-{t['step']}", ha="left", va="top", fontsize=7)
        ax.set_yticks([0.5, 1.5], ["checkpoint\nwrite", "training"], fontsize=8)
        ax.set_ylim(-0.4, 2)
        ax.set_title(
            f"{label}: {max(b for _, b in steps.values()) * scale:.3g} {unit} for {len(steps)} steps, "
            f"of which training stood still {stalled * scale:.3g} {unit} for checkpoints",
            fontsize=9,
        )
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].set_xlim(0, end * scale * 1.01)
    axes[-1, 0].set_xlabel(f"wall clock on rank {rank} since its first step ({unit})")
    names = [
        "a training step (its number)",
        "training stalled by a checkpoint",
        "checkpoint being written (its folder)",
    ]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[0, 0].legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def plot_memory(
    measured: Sequence[dict],
    predicted: Sequence[dict] | None = None,
    ax=None,
    title: str = "Memory per rank",
    labels: Sequence[str] | None = None,
    temporaries: str = f"{TEMPORARIES} and, under ZeRO-3, the gathered parameters",
) -> plt.Figure:
    """Per rank (or per ``labels`` entry), a stacked bar of measured bytes (params, grads, optimizer, activations at
    their peak) and, hatched beside it, the prediction; ``predicted`` has the same keys (``activations`` last).
    A black line marks the measured peak: every byte live at the worst moment, including the ``temporaries`` that
    no bar counts (the legend names them)."""
    fig, ax = _axes(ax, (max(6.5, 1.4 * len(measured) + 4), 4.2))
    top = max(max(sum(_mem_parts(m).values()), m.get("peak", 0)) for m in [*measured, *(predicted or [])])
    scale, unit = byte_unit(top)
    width, shift = (0.36, 0.19) if predicted else (0.6, 0.0)
    xs = [rank - shift for rank in range(len(measured))]
    _stacked_bars(ax, xs, [_mem_parts(m) for m in measured], MEMORY_COLORS, width, scale)
    if predicted:
        _stacked_bars(ax, [x + 2 * shift for x in xs], map(_mem_parts, predicted), MEMORY_COLORS, width, scale, "//")
        for x, row in zip(xs, predicted, strict=True):  # no formula for this model's activations: said, not hidden
            if "activations" not in row:
                states = sum(_mem_parts(row).values()) / scale
                ax.text(x + 2 * shift, states, "activations:\nnot\npredicted", ha="center", va="bottom", fontsize=7)
    peak_label = textwrap.fill(
        f"measured peak: all bytes live at the worst moment, temporaries included: {temporaries}", 40
    )
    for rank, (x, row) in enumerate(zip(xs, measured, strict=True)):
        if "peak" in row:
            ax.hlines(
                row["peak"] / scale,
                x - width / 2,
                x + width / 2,
                colors="black",
                linewidth=2,
                zorder=4,
                label=peak_label if rank == 0 else None,
            )
    ax.set_xticks(range(len(measured)), labels or [f"rank {r}" for r in range(len(measured))])
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title + ("\nsolid: measured, hatched: predicted" if predicted else ""), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _stacked_bars(
    ax, xs: Sequence[float], rows: Iterable[dict], colors: dict, width: float, scale: float, hatch: str | None = None
) -> None:
    """At each x, one bar of its row's values stacked in the order of ``colors`` (keys: the row's keys); the
    segments of the first bar without ``hatch`` name the legend's entries."""
    for i, (x, row) in enumerate(zip(xs, rows, strict=True)):
        bottom = 0.0
        for key, color in colors.items():
            value = row.get(key, 0) / scale
            ax.bar(
                x,
                value,
                width,
                bottom=bottom,
                color=color,
                hatch=hatch,
                edgecolor="white",
                label=key if i == 0 and hatch is None else None,
            )
            bottom += value


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
    """Stacked bars: for each step, the ring bytes this rank sent in each kind of collective (a kind that sent
    nothing, such as ``recv``, is named under the legend instead)."""
    fig, ax = _axes(ax, (8, 3.5))
    steps = sorted({r.tags["step"] for r in records if r.tags.get("step") is not None})
    by_step = [
        {op: s["bytes"] for op, s in summarize(r for r in records if r.tags.get("step") == step).items()}
        for step in steps
    ]
    ops = _drawn_keys(ax, by_step)
    if not ops:
        ax.text(0.5, 0.5, "no communication: a single rank talks to nobody", ha="center", transform=ax.transAxes)
        ax.set_yticks([])
    scale, unit = byte_unit(max((sum(row.values()) for row in by_step), default=1.0))
    _stacked_bars(ax, steps, by_step, {op: f"C{i}" for i, op in enumerate(ops)}, 0.8, scale)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_xticks(steps)
    ax.set_title(title)
    if ops:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


AXIS_COLORS = {
    "tp": "#4C72B0",
    "cp": "#C44E52",
    "pp": "#55A868",
    "embedding": "#8172B3",
    "dp": "#DD8452",
    "dp-cp": "#937860",
}


def plot_traffic(
    records_per_rank: Sequence[Sequence[CommRecord]],
    predicted: Sequence[dict] | None = None,
    step: int | None = None,
    ax=None,
    title: str = "Bytes each rank sent, by axis",
    labels: Sequence[str] | None = None,
) -> plt.Figure:
    """Per rank (named by ``labels``, default "rank r"), the ring bytes it sent in ``step`` (default: the last one
    recorded) stacked by process group: in a 3D run the axes tp, pp, embedding and dp. ``predicted`` (bytes by axis
    per rank, such as :func:`course_lib.parallel.three_d.predict_axis_traffic`) is drawn hatched beside each bar."""
    if step is None:
        step = max(r.tags["step"] for records in records_per_rank for r in records if "step" in r.tags)
    measured = [
        {axis: s["bytes"] for axis, s in summarize((r for r in rs if r.tags.get("step") == step), "group").items()}
        for rs in records_per_rank
    ]
    n = len(measured)
    fig, ax = _axes(ax, (max(7, 0.8 * n + 4), 4))
    axes = _drawn_keys(ax, [*measured, *(predicted or [])])
    colors = {axis: AXIS_COLORS.get(axis, f"C{i}") for i, axis in enumerate(axes)}
    scale, unit = byte_unit(max(sum(row.values()) for row in [*measured, *(predicted or [])]))
    width, shift = (0.36, 0.19) if predicted else (0.6, 0.0)
    _stacked_bars(ax, [r - shift for r in range(n)], measured, colors, width, scale)
    if predicted:
        _stacked_bars(ax, [r + shift for r in range(n)], predicted, colors, width, scale, "//")
    ax.set_xticks(range(n), labels or [f"rank {r}" for r in range(n)])
    ax.set_ylabel(f"bytes sent ({unit})")
    ax.set_title(f"{title}, step {step}" + ("\nsolid: measured (the ledger), hatched: predicted" if predicted else ""))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _drawn_keys(ax, rows: Sequence[dict]) -> list[str]:
    """The keys of ``rows`` (in order of appearance) that sent bytes in some row; a note under the legend names
    the others, which sent 0 bytes."""
    totals: dict = {}
    for row in rows:
        for key, value in row.items():
            totals[key] = totals.get(key, 0.0) + value
    silent = [key for key, total in totals.items() if not total]
    if silent:
        why = " (a message is counted once, by its sender)" if "recv" in silent else ""
        note = textwrap.fill(f"not drawn, 0 bytes sent: {', '.join(silent)}{why}", 30)
        ax.text(1.02, 0.0, note, transform=ax.transAxes, fontsize=8, va="bottom")
    return [key for key, total in totals.items() if total]
