"""The figures of the middle lessons (04 tensor, 05 pipeline, 06 3D parallelism), and the small run behind 04's
"your own model" section, so that a lesson's cells show what they teach and not their matplotlib.

Every plotting function draws on a given matplotlib ``Axes`` or a new figure and returns the ``Figure``; its title
says the figure's point. A pipeline schedule chart (:func:`plot_schedule`) says which costs of F, B and W it was
simulated with, so two charts of the same schedule never look alike with different clocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from torch import nn

from course_lib.ledgers import comm
from course_lib.ledgers.trace import Event
from course_lib.parallel.schedule_sim import Simulation
from course_lib.parallel.schedules import stage_owner
from course_lib.parallel.tensor_layers import full_parameters, parallelize_module
from course_lib.runtime import launch
from course_lib.ui.plots import AXIS_COLORS, KIND_COLORS, plot_timeline

SCHEDULE_COLORS = {"F": KIND_COLORS["forward"], "B": KIND_COLORS["backward"], "W": KIND_COLORS["weight_grad"]}
KIND_NAMES = {"F": "F: forward", "B": "B: backward", "W": "W: weight gradient"}
LABEL_POINTS = 7.0  # the largest font of a microbatch's label; a label that would need less than MIN_LABEL_POINTS
MIN_LABEL_POINTS = 4.5  # to fit its box is left out
CHAR_WIDTH = 0.62  # a digit's width, in units of the font size


def schedule_costs(simulation: Simulation) -> dict[str, float]:
    """The cost of a whole stage's F, B and W that ``simulation`` ran with, read from its busy intervals (an action
    of one of v chunks lasts 1/v of it). No "W" where the table does not split the backward: its B is all of it."""
    chunks = 1 + max((a.chunk for intervals in simulation.busy for _, _, a in intervals), default=0)
    costs: dict[str, float] = {}
    for intervals in simulation.busy:
        for start, end, action in intervals:
            costs.setdefault(action.kind, round((end - start) * chunks, 9))
    return {kind: costs[kind] for kind in "FBW" if kind in costs}


def costs_text(simulation: Simulation) -> str:
    """The costs of :func:`schedule_costs` as a chart says them, "F = 1, B = 2 (the whole backward)"."""
    costs = schedule_costs(simulation)
    text = ", ".join(f"{kind} = {cost:g}" for kind, cost in costs.items())
    return text + ("" if "W" in costs else " (the whole backward, W inside B)")


def _label_size(text: str, width_points: float) -> float | None:
    """The font size that fits ``text`` in a box ``width_points`` wide, at most LABEL_POINTS; None if too small."""
    size = min(LABEL_POINTS, 0.9 * width_points / (CHAR_WIDTH * len(text)))
    return size if size >= MIN_LABEL_POINTS else None


def plot_schedule(
    simulation: Simulation, ax=None, title: str = "Pipeline schedule", xmax: float | None = None
) -> plt.Figure:
    """A simulated schedule (:func:`course_lib.parallel.schedule_sim.simulate`): per rank its F, B and W actions,
    each labelled with its microbatch, odd chunks hatched (a V's second leg, stage 2p-1-r; the second chunk when
    interleaving), idle time left blank; the bubble in the title and the costs of F, B and W under the time axis.
    With more than 2 chunks per rank a label also names its chunk ("3.2"). A label that cannot be read in its box
    is left out. ``xmax`` sets the end of the time axis (default: the makespan), to draw several on one clock."""
    p = len(simulation.busy)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * p + 1.6), layout="constrained")
    fig = ax.figure
    xmax = xmax or simulation.makespan
    chunks = 1 + max((a.chunk for intervals in simulation.busy for _, _, a in intervals), default=0)
    axes_points = 0.8 * ax.get_position().width * fig.get_figwidth() * 72  # the legend takes about a fifth
    for rank, intervals in enumerate(simulation.busy):
        for start, end, action in intervals:
            ax.broken_barh(
                [(start, end - start)],
                (rank - 0.4, 0.8),
                facecolors=SCHEDULE_COLORS[action.kind],
                edgecolor="white",
                linewidth=0.8,
                hatch="///" if action.chunk % 2 else None,
            )
            label = f"{action.microbatch}" + (f".{action.chunk}" if chunks > 2 else "")
            size = _label_size(label, (end - start) / xmax * axes_points)
            if size:
                ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=size, color="white")
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, xmax)
    ax.set_xlabel(f"time (units of a stage's forward); costs per stage: {costs_text(simulation)}")
    ax.set_title(f"{title}: bubble {simulation.bubble_fraction:.1%} of the time", fontsize=10)
    kinds = sorted({a.kind for intervals in simulation.busy for _, _, a in intervals}, key="FBW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=SCHEDULE_COLORS[k]) for k in kinds]
    names = [KIND_NAMES[k] for k in kinds]
    if any(a.chunk % 2 for intervals in simulation.busy for _, _, a in intervals):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="0.6", edgecolor="white", hatch="///"))
        v_shaped = any(
            a.chunk == 1 and a.stage == 2 * p - 1 - rank for rank, iv in enumerate(simulation.busy) for _, _, a in iv
        )
        names.append("hatched: the V's second leg, stage 2p-1-r" if v_shaped else "hatched: odd chunks")
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def plot_schedules(panels: Mapping[str, Simulation], xmax: float | None = None) -> plt.Figure:
    """Several simulated schedules (title -> simulation) one above the other on one time axis, ending at ``xmax``
    (default: the longest makespan), so the shorter step shows."""
    xmax = xmax or max(sim.makespan for sim in panels.values())
    p = max(len(sim.busy) for sim in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, (0.6 * p + 1.5) * len(panels)), layout="constrained")
    for ax, (title, sim) in zip(axes, panels.items(), strict=True):
        plot_schedule(sim, ax=ax, title=title, xmax=xmax)
    return fig


def plot_bubble_vs_microbatches(
    ms: Sequence[int],
    formula: Sequence[float],
    points: Mapping[str, Sequence[float]],
    title: str,
    formula_label: str = "(p-1)/(m+p-1)",
) -> plt.Figure:
    """The bubble against the number of microbatches ``ms`` (log scale): the formula as a line, each series of
    ``points`` (label -> bubble per m) as markers."""
    fig, ax = plt.subplots(figsize=(6, 3.2), layout="constrained")
    ax.plot(ms, formula, "-", color="gray", label=formula_label)
    for (label, values), marker in zip(points.items(), "osd^", strict=False):
        ax.plot(ms, values, marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ms), [str(m) for m in ms])
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("bubble (fraction of the step)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_stage_placement(p: int, schedules: Sequence[str] = ("interleaved", "zb-v")) -> plt.Figure:
    """Which rank holds each of the 2p virtual stages when every rank holds two chunks: a loop (interleaved) goes
    round the ranks twice, a V (ZB-V, DualPipeV) goes down and back up, so rank 0 holds both ends."""
    fig, ax = plt.subplots(figsize=(6, 2.6), layout="constrained")
    for schedule, style in zip(schedules, ("s--", "o-", "d:"), strict=False):
        ax.plot(
            range(2 * p),
            [stage_owner(schedule, s, p)[0] for s in range(2 * p)],
            style,
            label=f"{schedule}: rank of stage s",
        )
    ax.set_xlabel("virtual stage s (a microbatch's forward goes left to right)")
    ax.set_ylabel("rank")
    ax.set_yticks(range(p))
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_title(
        f"Two chunks per rank, p={p}: a loop comes back to rank 0 halfway, a V turns on the last rank", fontsize=9
    )
    return fig


def plot_activation_memory(
    measured: Mapping[tuple[int, bool], int],
    formula: Mapping[tuple[int, bool], int],
    degrees: Sequence[int],
    title: str,
) -> plt.Figure:
    """Per TP degree t, the saved activations one rank measured (bars: TP alone, TP + SP) with the formula's count
    as a black tick on each bar; keys of ``measured`` and ``formula`` are (t, sp)."""
    fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    for i, sp in enumerate((False, True)):
        xs = [j + (0.2 if sp else -0.2) for j in range(len(degrees))]
        ax.bar(
            xs,
            [measured[d, sp] / 1e6 for d in degrees],
            0.38,
            color=f"C{i}",
            label=f"{'TP + SP' if sp else 'TP'} measured",
        )
        ax.scatter(
            xs,
            [formula[d, sp] / 1e6 for d in degrees],
            color="black",
            marker="_",
            s=400,
            zorder=3,
            label="formula" if sp else None,
        )
    ax.set_xticks(range(len(degrees)), [f"t = {d}" for d in degrees])
    ax.set_ylabel("saved activations per rank (MB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_timelines(
    panels: Mapping[str, Sequence[Sequence[Event]]], clock: str = "modeled H100", height: float = 2.8
) -> plt.Figure:
    """Several timelines (title -> events per rank, :func:`course_lib.ui.plots.plot_timeline`) one above the
    other on a shared time axis, so the same work on two clocks or placements compares at a glance."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height * len(panels)), layout="constrained", sharex=True)
    for ax, (title, events) in zip(axes, panels.items(), strict=True):
        plot_timeline(events, ax=ax, title=title, clock=clock)
    return fig


def plot_axis_time_by_placement(rows: Mapping[str, Mapping[str, float]], title: str) -> plt.Figure:
    """Per placement (label -> seconds in each axis's collectives), grouped bars of the tp, pp and dp time in
    microseconds."""
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    for i, axis in enumerate(("tp", "pp", "dp")):
        ax.bar(
            [x + 0.27 * (i - 1) for x in range(len(rows))],
            [by_axis.get(axis, 0) * 1e6 for by_axis in rows.values()],
            0.27,
            color=AXIS_COLORS[axis],
            label=axis,
        )
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("modeled time (µs)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_published_vs_estimated(
    names: Sequence[str], published: Sequence[float], estimated: Sequence[float], title: str
) -> plt.Figure:
    """Per published run (``names``), its TFLOP/s per GPU beside the planner's estimate."""
    # The slanted labels take height in proportion to the longest: the bars keep about 3 inches whatever they say.
    height = 3 + 0.055 * max(map(len, names), default=0)
    fig, ax = plt.subplots(figsize=(max(9, 0.36 * len(names)), height), layout="constrained")
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], published, 0.4, label="published")
    ax.bar([x + 0.2 for x in xs], estimated, 0.4, label="planner's estimate")
    ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig


def train_own_model(
    make_model: Callable[[], nn.Module], plan: Mapping[str, str], steps: int = 3, lr: float = 0.1
) -> dict:
    """A rank function (or one process, with an empty ``plan``): build ``make_model()`` from seed 0 in float64,
    split it in place with ``parallelize_module(model, plan)`` over all ranks, and take ``steps`` SGD steps on one
    full batch (regress y from x). Returns per step the loss, this rank's collectives by (pass, op) and the whole
    parameters (:func:`full_parameters`), with the model's repr, whether the split was in place, and this rank's
    own parameter shapes."""
    device = launch.rank_device()
    torch.manual_seed(0)  # the same model on every rank...
    model = make_model().to(device, torch.float64)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    gen = torch.Generator().manual_seed(1)  # ...and the same batch
    x, y = torch.randn(2, 32, first.in_features, generator=gen, dtype=torch.float64).to(device).unbind(0)
    in_place = parallelize_module(model, dict(plan)) is model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = {"in_place": in_place, "model": repr(model), "losses": [], "collectives": [], "params": []}
    for _ in range(steps):
        before = len(comm.records())
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["collectives"].append(Counter((rec.tags["direction"], rec.op) for rec in comm.records()[before:]))
        out["params"].append(full_parameters(model))
    out["shapes"] = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return out


def compare_own_model(ranks: Sequence[dict], one: dict) -> list[float]:
    """Print each step's loss on rank 0 and on one process, the largest difference of any whole parameter on any
    rank, and rank 0's collectives; return those differences, one per step."""
    names = list(one["params"][0])
    diffs = [
        max((rank["params"][i][k] - one["params"][i][k]).abs().max().item() for rank in ranks for k in names)
        for i in range(len(one["losses"]))
    ]
    print(
        f"{'step':>4}{f'loss, {len(ranks)} TP ranks':>20}{'loss, one process':>20}{'max |param diff|':>18}   "
        "collectives of rank 0"
    )
    for i, diff in enumerate(diffs):
        made = ", ".join(f"{n} {op} ({d})" for (d, op), n in ranks[0]["collectives"][i].items())
        print(f"{i:>4}{ranks[0]['losses'][i]:>20.12f}{one['losses'][i]:>20.12f}{diff:>18.1e}   {made}")
    return diffs
