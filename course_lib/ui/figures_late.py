"""Figures of the late lessons (07 experts and long context, 08 fault tolerance): an MoE router's load per expert
against its capacity, a router's balance over training, and goodput against the checkpoint interval.

Every function draws a new figure and returns it, so a notebook shows it with ``plt.show()`` and a script saves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from course_lib.model.config import GPTConfig
from course_lib.model.gpt import within_capacity

ROUTED, KEPT = "#DD8452", "#4C72B0"


def plot_expert_load(counts: Sequence, cfg: GPTConfig, capacity: int) -> Figure:
    """One panel per MoE layer: the assignments each expert was routed (orange) and kept within ``capacity``
    (blue, :func:`course_lib.model.gpt.within_capacity`), from ``counts[layer][source rank][expert]`` (a step of
    the expert-parallel run's router counts), with the capacity as a dashed line and the dropped share in the
    panel's title."""
    fig, axes = plt.subplots(1, len(counts), figsize=(10, 3.2), layout="constrained", sharey=True, squeeze=False)
    for layer, ax in enumerate(axes[0]):
        routed = torch.as_tensor(counts[layer])
        kept = within_capacity(routed, cfg)
        experts = range(routed.shape[-1])
        ax.bar(experts, routed.sum(0), color=ROUTED, label="routed")
        ax.bar(experts, kept.sum(0), color=KEPT, label="kept")
        ax.axhline(capacity, color="black", ls="--", lw=1, label=f"capacity {capacity}")
        dropped, total = int((routed - kept).sum()), int(routed.sum())
        ax.set_title(f"layer {layer}: {dropped} of {total} assignments dropped", fontsize=9)
        ax.set_xlabel("expert")
    axes[0, 0].set_ylabel("token assignments (last step)")
    axes[0, -1].legend(fontsize=8)
    fig.suptitle("The router's load is uneven: capacity drops what an expert cannot take", fontsize=10)
    return fig


def plot_router_balance(loads: Mapping[float, Sequence[float]], experts: int, top_k: int) -> Figure:
    """The busiest expert's load over the mean at each training step, one line per balancing-loss weight
    ``alpha`` (the keys of ``loads``), and the level ``experts / top_k`` where every token goes to the same
    ``top_k`` experts (a collapsed router)."""
    fig, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
    for alpha, load in loads.items():
        ax.plot(load, label=f"alpha = {alpha}")
    collapsed = experts / top_k
    ax.axhline(collapsed, color="0.5", ls=":", lw=1)
    ax.text(0, collapsed + 0.04, f"collapsed: every token to the same {top_k} of {experts} experts", fontsize=8,
            va="bottom", ha="left")  # fmt: skip
    ax.set_ylim(top=collapsed + 0.35)
    ax.set_xlabel("training step")
    ax.set_ylabel("busiest expert / mean load")
    ax.set_title("Without enough balancing loss the router collapses onto a few experts", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def plot_goodput_curve(
    intervals_s: np.ndarray,
    expected: np.ndarray,
    probes_s: Sequence[float],
    simulated: Sequence,
    daly_s: float,
    title: str,
) -> Figure:
    """Daly's expected goodput against the checkpoint interval (minutes, log scale), the simulated runs at
    ``probes_s`` as points with two standard errors (each a
    :class:`course_lib.planner.goodput.SimulatedGoodput`), and Daly's interval ``daly_s`` marked."""
    fig, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
    ax.plot(np.asarray(intervals_s) / 60, expected, label="Daly's expected goodput")
    runs = simulated[0].runs if simulated else 0
    ax.errorbar([t / 60 for t in probes_s], [s.mean for s in simulated], yerr=[2 * s.stderr for s in simulated],
                fmt="o", color="black", label=f"simulated failures ({runs} runs, 2 standard errors)")  # fmt: skip
    ax.axvline(daly_s / 60, color="0.5", ls=":", lw=1, label=f"Daly's interval, {daly_s / 60:.1f} min")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes of work)")
    ax.set_ylabel("goodput (useful fraction)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    return fig
