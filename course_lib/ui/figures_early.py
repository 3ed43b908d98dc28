"""The figures of the early lessons (00, 00b, 03 and 06b), each drawn by one call so the lesson shows its point.

Every function draws on a new figure (or on ``ax`` when given), titles it with what it shows, labels its axes with
units and returns the axes; the lesson calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    """``ax`` itself, or the axes of a new constrained-layout figure of this size."""
    if ax is not None:
        return ax
    return plt.subplots(figsize=figsize, layout="constrained")[1]


def all_reduce_bytes(sizes: Sequence[int], measured: Sequence[float], S: float, ax: Axes | None = None) -> Axes:
    """Bytes one rank sends in an all-reduce of S bytes against the group size: the ledger's counts (dots) on the
    formula 2(n-1)/n · S (line), which approaches 2S."""
    ax = _axes(ax, (6, 3.2))
    ax.plot(sizes, [2 * (n - 1) / n * S / 1e6 for n in sizes], "-", color="gray", label="formula 2(n-1)/n · S")
    ax.plot(sizes, [m / 1e6 for m in measured], "o", markersize=9, label="measured (ledger)")
    ax.axhline(2 * S / 1e6, ls=":", color="black", label="limit 2S")
    ax.set(xlabel="ranks in the group (n)", ylabel="MB sent per rank", xticks=list(sizes), ylim=(0, 2.2 * S / 1e6))
    ax.set_title(f"All-reduce of S = {S / 1e6:.2f} MB: each rank sends under 2S, however many ranks")
    ax.legend(loc="lower right")
    return ax


def collectives_on_machines(times_ms: Mapping[str, Sequence[float]], columns: Sequence[str], message_mb: float,
                            ax: Axes | None = None) -> Axes:
    """One bar per machine for each collective (``columns``), ``times_ms[machine]`` in the columns' order, on a log
    scale: the same operation differs by orders of magnitude between machines and groups."""
    ax = _axes(ax, (10, 4.2))
    width = 0.8 / len(times_ms)
    for i, (name, ms) in enumerate(times_ms.items()):
        ax.bar(np.arange(len(columns)) + (i - (len(times_ms) - 1) / 2) * width, ms, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(columns)), list(columns))
    ax.set(ylabel="time (ms, log scale)", xlabel="collective and group")
    ax.set_title(f"The same collectives on four machines (S = {message_mb:g} MB per GPU): the wiring decides the time")
    ax.legend(ncol=len(times_ms), loc="upper left")
    every = [t for ms in times_ms.values() for t in ms]
    ax.set_ylim(min(every) / 3, 8 * max(every))
    return ax


def algorithm_crossover(sizes: Sequence[float], curves: Mapping[str, Sequence[float]], picked: Sequence[str],
                        crossover: float, ax: Axes | None = None) -> Axes:
    """Each all-reduce algorithm's time (seconds, ``curves``) against the buffer size, the picked one shaded, and
    the size where the pick changes."""
    ax = _axes(ax, (8, 4.2))
    for alg, ts in curves.items():
        ax.loglog(sizes, np.asarray(ts) * 1e3, label=f"{alg} (formula)")
    best = [curves[alg][i] * 1e3 for i, alg in enumerate(picked)]
    ax.loglog(sizes, best, color="black", lw=6, alpha=0.15, label="choose's pick")
    ax.axvline(crossover, color="gray", ls="--", label=f"crossover: {crossover / 1e3:.0f} kB")
    ax.set(xlabel="all-reduce buffer per GPU (bytes)", ylabel="time (ms)")
    ax.set_title("All-reduce over the SuperPOD's 64 GPUs: a tree for small buffers, hierarchical for large")
    ax.legend()
    return ax


def axis_traffic(traffic: Mapping[str, Mapping[str, float]], compute_s: float, ax: Axes | None = None) -> Axes:
    """Seconds each parallel axis's traffic takes per layer and microbatch, one bar per placement (``traffic[where]
    [axis]``), beside the layer's compute: only TP's traffic outgrows the compute when it leaves the node."""
    ax = _axes(ax, (7.5, 3.8))
    axes_names = list(next(iter(traffic.values())))
    width = 0.8 / len(traffic)
    for i, (where, times) in enumerate(traffic.items()):
        ax.bar(np.arange(len(axes_names)) + (i - (len(traffic) - 1) / 2) * width,
               [times[a] * 1e3 for a in axes_names], width, label=where)
    ax.axhline(compute_s * 1e3, color="black", ls="--", label="the layer's compute")
    ax.set_yscale("log")
    ax.set_xticks(range(len(axes_names)), [f"{a} traffic" for a in axes_names])
    ax.set_ylabel("ms per layer and microbatch (log)")
    ax.set_title("Only TP's traffic outgrows the compute when it leaves the node (H100 SuperPOD)")
    ax.legend()
    return ax


def placed_step_times(step_s: Mapping[str, float], tp_across: Mapping[str, bool], ax: Axes | None = None) -> Axes:
    """One bar per (machine and placement) label: the modeled step time, red where the TP groups cross NVLink
    domains."""
    ax = _axes(ax, (8, 3.6))
    ax.barh(list(step_s), [t * 1e6 for t in step_s.values()],
            color=["C3" if tp_across[label] else "C0" for label in step_s])
    ax.invert_yaxis()
    ax.set_xlabel("modeled step time (µs): the same recorded run, compute at the H100's peak")
    ax.set_title("One run, placed several ways: TP across NVLink domains (red) is the slow placement")
    return ax


def step_predictions(steps: Sequence, device_name: str) -> np.ndarray:
    """For each compared model (``calibrate.compare_models``'s results), its measured step beside the roofline's
    and the modeled clock's predictions, in ms."""
    fig, axes = plt.subplots(1, len(steps), figsize=(9.5, 2.8), layout="constrained", squeeze=False)
    for ax, c in zip(axes[0], steps, strict=True):
        ax.barh(["measured", "roofline", "modeled"], [c.measured_s * 1e3, c.roofline_s * 1e3, c.modeled_s * 1e3],
                color=["tab:gray", "tab:orange", "tab:blue"])
        ax.invert_yaxis()
        ax.set_xlabel("one training step (ms)")
        ax.set_title(f"{c.label}: {c.cfg.layers} layers x {c.cfg.d_model}, {c.batch * c.cfg.seq} tokens", fontsize=10)
    fig.suptitle(f"One fp32 step on {device_name}: the wider model lands closer to its predictions", fontsize=11)
    return axes[0]


def bytes_per_step(sent_by_op: Mapping[str, Mapping[str, float]], n: int, psi: int, b: int,
                   ax: Axes | None = None) -> Axes:
    """Bytes one rank sends per step under each scheme, stacked by operation (``sent_by_op[scheme][op]``), beside
    2(n-1)/n · Ψ·b (an all-reduce's) and 3(n-1)/n · Ψ·b (ZeRO-3's)."""
    ax = _axes(ax, (7, 3.4))
    names = list(sent_by_op)
    bottoms = np.zeros(len(names))
    for i, op in enumerate(("all_reduce", "reduce_scatter", "all_gather")):
        heights = np.array([sent_by_op[s].get(op, 0) / 1e3 for s in names])
        ax.bar(names, heights, bottom=bottoms, label=op, color=f"C{i}")
        bottoms += heights
    for multiple, style in ((2, "--"), (3, ":")):
        ax.axhline(multiple * (n - 1) / n * psi * b / 1e3, color="black", ls=style, lw=1,
                   label=f"{multiple}(n-1)/n · Ψ·b")
    ax.set(ylabel="kB sent per rank per step", xlabel="scheme")
    ax.set_title(f"Bytes each rank sends per step, n = {n}: stages 1-2 cost what DP costs, stage 3 half more")
    ax.legend(fontsize=8, loc="upper left")
    return ax
