"""The demo's one picture of every scheme side by side: what one rank holds (model states by category and the peak of
its activations) and what it sends in a step, one bar per scheme, each measured on the run's own ranks."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

from course_lib.ledgers.memory import CATEGORIES
from course_lib.ui.plots import MEMORY_COLORS, byte_unit


def busiest_rank(report: dict) -> dict:
    """The rank that holds the most (model states plus its activations' peak): the one that must fit its device."""
    return max(report["ranks"], key=lambda r: sum(r["memory"][k] for k in CATEGORIES) + r["memory"]["activations_peak"])


def plot_scheme_summary(reports: Sequence[dict], title: str | None = None) -> plt.Figure:
    """Left: the busiest rank's memory per scheme, stacked by category (parameters, gradients, optimizer state, the
    activations' peak); right: the bytes that rank sent in the last step. A scheme that trained another model than
    the first report's (an MoE) is hatched and named in the legend, since its bars are not the same model split."""
    names = [f"{r['scheme']}\n{r['world_size']} rank{'s' * (r['world_size'] != 1)}" for r in reports]
    busiest = [busiest_rank(r) for r in reports]
    other = [r["params"] != reports[0]["params"] for r in reports]
    held = [sum(b["memory"][k] for k in CATEGORIES) + b["memory"]["activations_peak"] for b in busiest]
    sent = [sum(c["bytes"] for c in b["comm"].values()) for b in busiest]
    fig, (mem_ax, comm_ax) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    scale, unit = byte_unit(max(held))
    bottoms = [0.0] * len(reports)
    for category in (*CATEGORIES, "activations"):
        key = "activations_peak" if category == "activations" else category
        heights = [b["memory"][key] / scale for b in busiest]
        mem_ax.bar(names, heights, bottom=bottoms, color=MEMORY_COLORS[category], label=category, edgecolor="white")
        bottoms = [a + h for a, h in zip(bottoms, heights, strict=True)]
    for x, is_other in enumerate(other):
        if is_other:
            mem_ax.bar(x, bottoms[x], fill=False, hatch="//", edgecolor="black", linewidth=0,
                       label=f"{reports[x]['scheme']}: an MoE, {reports[x]['params']:,} parameters")  # fmt: skip
    mem_ax.set_ylabel(f"busiest rank's memory ({unit})")
    mem_ax.set_title("What one rank holds", fontsize=10)
    mem_ax.legend(fontsize=8)
    sent_scale, sent_unit = byte_unit(max(max(sent), 1))
    for name, nbytes, is_other in zip(names, sent, other, strict=True):
        comm_ax.bar(name, nbytes / sent_scale, color="#937860", hatch="//" if is_other else None, edgecolor="white")
    comm_ax.set_ylabel(f"bytes sent by that rank in the last step ({sent_unit})")
    comm_ax.set_title("What it sends in a step", fontsize=10)
    for ax in (mem_ax, comm_ax):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    first = reports[0]
    fig.suptitle(
        title
        or f"Every scheme on the tiny GPT ({first['params']:,} parameters): splitting the model cuts what a rank "
        "holds, and every split is paid for in bytes sent",
        fontsize=11,
    )
    return fig
