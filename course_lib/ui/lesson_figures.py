"""The core lesson's pictures (``notebooks/00_lesson.ipynb``): the decision tree with its leaves' deep-dive
notebooks, the microbatch trade-off of a pipeline, and the table of what each scheme's run sent and kept.

Every figure function returns the ``Figure``; the figures of a single run (memory, timeline, traffic) are in
:mod:`course_lib.ui.plots`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt

from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.formulas import model_state_formula
from course_lib.parallel.schedules import bubble_formula

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun

# The decision tree's leaves: what to reach for, and the notebooks that teach it.
DECISION_LEAVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dp": ("Data parallel (DP)", ("02_data_parallel",)),
    "fsdp": ("FSDP / ZeRO over the GPUs", ("03_zero_fsdp",)),
    "tp": ("TP inside the node (+ DP)", ("04_tensor_parallel",)),
    "3d": ("3D: PP across nodes, TP inside, DP on top", ("05_pipeline_parallel", "06_3d_parallelism")),
}
LEAF_COLORS = {"dp": "#DCEBFA", "fsdp": "#E3F2DA", "tp": "#E3F2DA", "3d": "#FBE3D6"}


def leaf_for(params: float, gpu_mem_bytes: float = 80e9, gpus_per_node: int = 8, precision: str = "mixed") -> str:
    """The decision tree's answer for a dense model of ``params`` parameters: ``"dp"`` when its model states
    (:func:`course_lib.model.formulas.model_state_formula`, 16 bytes per parameter with Adam) fit one GPU,
    ``"node"`` when they fit one node's GPUs (FSDP/ZeRO or TP there), else ``"3d"``."""
    states = sum(model_state_formula(params, precision).values())
    if states <= gpu_mem_bytes:
        return "dp"
    return "node" if states <= gpu_mem_bytes * gpus_per_node else "3d"


def _box(ax, xy: tuple[float, float], text: str, color: str, size: float = 9.5) -> None:
    ax.text(
        *xy,
        text,
        ha="center",
        va="center",
        fontsize=size,
        wrap=True,
        bbox={"boxstyle": "round,pad=0.5", "facecolor": color, "edgecolor": "#555555"},
    )


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], label: str) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "-|>", "color": "#555555", "lw": 1.2})
    mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
    ax.text(
        *mid,
        label,
        ha="center",
        va="center",
        fontsize=9,
        fontweight="bold",
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"},
    )


def plot_decision_tree(
    examples: Mapping[str, float] | None = None,
    gpu_mem_bytes: float = 80e9,
    gpus_per_node: int = 8,
    precision: str = "mixed",
) -> plt.Figure:
    """The lesson's decision tree drawn: fits one GPU? one node? Each leaf names its scheme and the deep-dive
    notebooks that teach it (:data:`DECISION_LEAVES`); ``examples`` ({label: parameters}) are written under the leaf
    that :func:`leaf_for` gives them, with their model states."""
    fig, ax = plt.subplots(figsize=(10.5, 5.6), layout="constrained")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    gib = gpu_mem_bytes / 1e9
    root, node = (0.34, 0.9), (0.62, 0.6)
    leaves = {"dp": (0.12, 0.42), "fsdp": (0.3, 0.14), "tp": (0.62, 0.14), "3d": (0.86, 0.34)}
    _box(ax, root, f"Do the model states (16 B x params)\nfit one GPU ({gib:g} GB)?", "#F2F2F2", 10.5)
    _box(
        ax, node, f"Do they fit one node\n({gpus_per_node} x {gib:g} GB = {gpus_per_node * gib:g} GB)?", "#F2F2F2", 10.5
    )
    _arrow(ax, (root[0] - 0.08, root[1] - 0.07), (leaves["dp"][0], leaves["dp"][1] + 0.09), "yes")
    _arrow(ax, (root[0] + 0.08, root[1] - 0.07), (node[0] - 0.05, node[1] + 0.07), "no")
    _arrow(ax, (node[0] - 0.1, node[1] - 0.07), (leaves["fsdp"][0] + 0.04, leaves["fsdp"][1] + 0.09), "yes")
    _arrow(ax, (node[0], node[1] - 0.07), (leaves["tp"][0], leaves["tp"][1] + 0.09), "yes")
    _arrow(ax, (node[0] + 0.1, node[1] - 0.07), (leaves["3d"][0], leaves["3d"][1] + 0.11), "no")
    under = {key: [] for key in leaves}
    for label, params in (examples or {}).items():
        leaf = leaf_for(params, gpu_mem_bytes, gpus_per_node, precision)
        states = sum(model_state_formula(params, precision).values())
        for key in ("fsdp", "tp") if leaf == "node" else (leaf,):
            under[key].append(f"{label}: {states / 1e9:,.0f} GB")
    for key, (x, y) in leaves.items():
        name, notebooks = DECISION_LEAVES[key]
        text = name.replace(": ", ":\n").replace(", DP", ",\nDP") + "\n" + "\n".join(f"-> {n}" for n in notebooks)
        _box(ax, (x, y), text, LEAF_COLORS[key])
        if under[key]:
            ax.text(x, y - 0.12, "e.g. " + "; ".join(under[key]), ha="center", va="top", fontsize=8.5, style="italic")
    ax.set_title(
        "Which parallelism? Ask where the model states stop fitting (leaves: the notebook to read next)", fontsize=11
    )
    return fig


def plot_microbatch_tradeoff(
    stages: int, global_batch: int, dp: int, micro_sizes: Sequence[int], schedule: str = "1f1b"
) -> plt.Figure:
    """For each microbatch size b, the pipeline's m = global_batch / (dp x b) microbatches: the bubble
    (:func:`course_lib.parallel.schedules.bubble_formula`) on the left axis, the messages each stage boundary carries
    per step (2m: activations forward, gradients back) on the right. Sizes that do not divide the batch are refused."""
    per_replica = global_batch // dp
    if global_batch % dp or any(per_replica % b for b in micro_sizes):
        raise ValueError(f"each microbatch size must divide the {per_replica} sequences of a replica")
    ms = [per_replica // b for b in micro_sizes]
    bubbles = [bubble_formula(schedule, stages, m) for m in ms]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
    ax.plot(micro_sizes, bubbles, "o-", color="#C44E52", label="bubble (left)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(micro_sizes, [str(b) for b in micro_sizes])
    ax.set_xlabel("microbatch size b (sequences)")
    ax.set_ylabel("bubble: idle share of the step")
    ax.set_ylim(0, max(bubbles) * 1.15)
    right = ax.twinx()
    right.plot(micro_sizes, [2 * m for m in ms], "s--", color="#4C72B0", label="messages per boundary (right)")
    right.set_ylabel("messages per stage boundary per step")
    right.set_ylim(0, 2 * max(ms) * 1.15)
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper center", fontsize=8)
    ax.set_title(
        f"{schedule}, p = {stages} stages, {per_replica} sequences per replica: smaller microbatches, "
        f"smaller bubble,\nmore (and smaller) messages and matmuls",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    return fig


def scheme_rows(runs: Mapping[str, SchemeRun]) -> list[dict]:
    """Per run, the busiest rank's bytes sent in the last step, model states (params + grads + optimizer) and
    activations at their peak, all measured; and the largest loss difference from one device."""
    rows = []
    for label, run in runs.items():
        ranks = run.report["ranks"]
        rows.append(
            {
                "scheme": label,
                "sent": max(sum(c["bytes"] for c in r["comm"].values()) for r in ranks),
                "states": max(sum(r["memory"][c] for c in CATEGORIES) for r in ranks),
                "activations": max(r["memory"]["activations_peak"] for r in ranks),
                "loss_diff": run.report["max_abs_loss_diff"],
            }
        )
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """:func:`scheme_rows` as a text table, bytes in kB."""
    lines = [f"{'scheme':<22}{'sent/step (kB)':>15}{'states (kB)':>13}{'activations (kB)':>18}{'loss diff':>11}"]
    for row in rows:
        lines.append(
            f"{row['scheme']:<22}{row['sent'] / 1e3:>15,.1f}{row['states'] / 1e3:>13,.1f}"
            f"{row['activations'] / 1e3:>18,.1f}{row['loss_diff']:>11.1e}"
        )
    return "\n".join(lines)
