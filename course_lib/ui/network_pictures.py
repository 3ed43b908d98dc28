"""Pictures of the machines under the collectives: :func:`draw_topology` draws a :mod:`course_lib.cluster.topology`.

* A :class:`~course_lib.cluster.topology.FatTree` (Leiserson 1985, "Fat-trees: universal networks for hardware-efficient
  supercomputing"): its NVLink domains as boxes of GPU dots above their NVLink switch (an 8-GPU node in a row, a
  72-GPU GB200 NVL72 rack as a compact grid), every GPU's NIC to its leaf switch (coloured by rail when the tree is
  rail-optimized, GPU i of every node on leaf i, as in NVIDIA's DGX SuperPOD), the leaves' uplinks to the spine
  with their oversubscription written on them. The legend gives each link's rate per GPU and direction.
* A :class:`~course_lib.cluster.topology.Torus` (Jouppi et al. 2023, "TPU v4: An Optically Reconfigurable Supercomputer
  for Machine Learning", ISCA): a 2D torus as a grid with its wrap-around links as dashed arcs; a 3D torus as its
  2D layers side by side, each chip also wired to the same place in the layers on either side (wrapping round).
  The title gives the link rate.

``highlight={name: [gpus]}`` colours groups of GPUs (a TP group, an expert-parallel group) and names them in the
legend. Every GPU is one artist, its ``gid`` ``"gpu:<index>"``, so a test can find it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import ceil, sqrt

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Rectangle

from course_lib.cluster.topology import FatTree, Topology, Torus

GPU_FACE = "#D9D9D9"
NVLINK = "#76B900"
NIC = "#4C72B0"
UPLINK = "#555555"
SWITCH_FACE = "#F2F2F2"
HIGHLIGHTS = ("#D62728", "#FF7F0E", "#9467BD", "#17BECF", "#8C564B", "#E377C2")
RAIL_COLORS = plt.get_cmap("viridis")
ROW_GPUS = 16  # a domain of at most this many GPUs is drawn as one row, each GPU wired to its switches
MAX_LEAVES = 16  # more leaves than this are drawn as one bar


def draw_topology(
    topology: Topology,
    ax: Axes | None = None,
    title: str | None = None,
    highlight: Mapping[str, Sequence[int]] | None = None,
) -> plt.Figure:
    """Draw a fat-tree or a torus (module docstring) on ``ax`` (or a new figure) and return the figure."""
    colors = _highlight_colors(topology, highlight or {})
    if isinstance(topology, FatTree):
        fig, ax = _canvas(ax, _fat_tree_size(topology))
        handles = _draw_fat_tree(ax, topology, colors)
        ax.set_title(
            title or f"{topology.name}: {_count(topology.domains, 'NVLink domain')} of {topology.gpus_per_domain} GPUs"
        )
    elif isinstance(topology, Torus):
        fig, ax = _canvas(ax, (12, 4.4) if len(topology.shape) == 3 else (5.5, 5))
        handles = _draw_torus(ax, topology, colors)
        ax.set_title(title or _torus_title(topology))
    else:
        raise ValueError(f"cannot draw {topology.name}: draw_topology knows a FatTree or a Torus")
    handles += [
        Line2D([], [], marker="o", ls="", color=color, markeredgecolor="black", label=name)
        for name, color in _group_colors(highlight or {}).items()
    ]
    ncol = 2 if fig.get_figwidth() > 8 else 1
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=ncol, fontsize=8, frameon=False)
    ax.set_axis_off()
    return fig


def _canvas(ax: Axes | None, size: tuple[float, float]) -> tuple[plt.Figure, Axes]:
    if ax is None:
        fig, ax = plt.subplots(figsize=size, layout="constrained")
    return ax.figure, ax


def _group_colors(highlight: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """A colour per group, or a one-line ValueError when there are more groups than distinct colours."""
    if len(highlight) > len(HIGHLIGHTS):
        raise ValueError(f"{len(highlight)} highlighted groups, but only {len(HIGHLIGHTS)} colours; highlight fewer")
    return dict(zip(highlight, HIGHLIGHTS, strict=False))


def _highlight_colors(topology: Topology, highlight: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """Each highlighted GPU's colour, or a one-line ValueError for a GPU outside the topology or in two groups."""
    colors: dict[int, str] = {}
    for name, color in _group_colors(highlight).items():
        for gpu in topology.check_group(highlight[name]):
            if gpu in colors:
                raise ValueError(f"GPU {gpu} is in two highlighted groups; give each GPU one group")
            colors[gpu] = color
    return colors


def _gpu(ax: Axes, gpu: int, x: float, y: float, colors: Mapping[int, str], size: float) -> None:
    """One GPU: one marker, its gid ``gpu:<index>``, grey unless highlighted."""
    (dot,) = ax.plot(
        [x], [y], "o", ms=size, color=colors.get(gpu, GPU_FACE), markeredgecolor="black", mew=0.6, zorder=4
    )
    dot.set_gid(f"gpu:{gpu}")


def _rate(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


# ---------------------------------------------------------------------------------------------------- fat-tree


def _domain_grid(gpus: int) -> tuple[int, int]:
    """(columns, rows) of a domain's GPU dots: one row for a node, a compact grid (12 x 6 for 72) for a rack."""
    cols = gpus if gpus <= ROW_GPUS else ceil(sqrt(2 * gpus))
    return cols, ceil(gpus / cols)


def _width(topo: FatTree) -> int:
    """The drawing's width in GPU spacings: the domains side by side, one spacing apart."""
    return topo.domains * (_domain_grid(topo.gpus_per_domain)[0] + 1) - 1


def _fat_tree_size(topo: FatTree) -> tuple[float, float]:
    """Inches: wide enough for a row of nodes, narrower for one rack."""
    return min(12.0, max(7.5, 0.17 * _width(topo) + 4)), 5.2


def _draw_fat_tree(ax: Axes, topo: FatTree, colors: Mapping[int, str]) -> list:
    cols, rows = _domain_grid(topo.gpus_per_domain)
    width = _width(topo)
    y_leaf, y_spine = rows + 7, rows + 13
    size = max(3.0, min(9.0, 520 / width / max(1, rows) ** 0.5))
    gpu_xy = {}
    for d in range(topo.domains):
        gpu_xy.update(_draw_domain(ax, topo, d, d * (cols + 1), cols, rows, colors, size))
    leaves = sorted({topo.leaf(g) for g in range(topo.n_gpus)})
    leaf_x = {leaf: (i + 0.5) * width / len(leaves) - 0.5 for i, leaf in enumerate(leaves)}
    _draw_nics(ax, topo, gpu_xy, leaf_x, y_leaf, rows)
    _draw_leaves_and_spine(ax, topo, leaf_x, y_leaf, y_spine, width)
    ax.set_xlim(-1.5, width + 0.5)
    ax.set_ylim(-2.2, y_spine + 1.6)
    rails = " (colour: rail = GPU index in its node)" if topo.rail_optimized and rows == 1 else ""
    return [
        Line2D([], [], color=NVLINK, lw=2, label=f"NVLink {_rate(topo.nvlink_bandwidth)} per GPU each way"),
        Line2D([], [], color=NIC, lw=1.5, label=f"NIC {_rate(topo.nic_bandwidth)} per GPU each way{rails}"),
        Line2D(
            [],
            [],
            color=UPLINK,
            lw=2.5,
            label=f"leaf uplink {_rate(topo.uplink_bandwidth)} each way = "
            f"{_count(topo.hosts_per_leaf, 'NIC')} x {_rate(topo.nic_bandwidth)} / {topo.oversubscription:g} "
            f"({_ratio(topo)})",
        ),
    ]


def _ratio(topo: FatTree) -> str:
    return "full bisection, 1:1" if topo.oversubscription == 1 else f"{topo.oversubscription:g}:1 oversubscribed"


def _draw_domain(
    ax: Axes, topo: FatTree, d: int, x0: float, cols: int, rows: int, colors: Mapping[int, str], size: float
) -> dict[int, tuple[float, float]]:
    """A domain's box, its NVLink switch under its GPUs, and (for a row of GPUs) each GPU's NVLink to it."""
    kind = "node" if topo.gpus_per_domain <= ROW_GPUS else "rack"
    ax.add_patch(Rectangle((x0 - 0.45, -0.7), cols - 0.1, rows + 1.2, fc="white", ec=NVLINK, lw=1.5, zorder=1))
    ax.add_patch(Rectangle((x0, -0.5), cols - 1, 0.45, fc=NVLINK, ec="none", alpha=0.35, zorder=2))
    ax.text(x0 + (cols - 1) / 2, -0.28, "NVLink switch", ha="center", va="center", fontsize=6, zorder=3)
    first = d * topo.gpus_per_domain
    ax.text(
        x0 + (cols - 1) / 2,
        -1.0,
        f"{kind} {d}: GPUs {first}-{first + topo.gpus_per_domain - 1}",
        ha="center",
        va="top",
        fontsize=7,
    )
    xy = {}
    for i in range(topo.gpus_per_domain):
        x, y = x0 + i % cols, rows - i // cols
        xy[first + i] = (x, y)
        _gpu(ax, first + i, x, y, colors, size)
        if rows == 1:
            ax.plot([x, x], [y, -0.05], color=NVLINK, lw=1.2, zorder=2)
    return xy


def _draw_nics(
    ax: Axes,
    topo: FatTree,
    gpu_xy: Mapping[int, tuple[float, float]],
    leaf_x: Mapping[tuple, float],
    y_leaf: float,
    rows: int,
) -> None:
    """A line per NIC from its GPU to its leaf; a rack's NICs, too many to draw apart, as one band per leaf."""
    if rows == 1:
        for g, (x, y) in gpu_xy.items():
            rail = g % topo.gpus_per_domain
            color = RAIL_COLORS(rail / max(1, topo.gpus_per_domain - 1)) if topo.rail_optimized else NIC
            ax.plot([x, leaf_x[topo.leaf(g)]], [y, y_leaf - 0.4], color=color, lw=0.8, alpha=0.7, zorder=1)
    else:
        for d in range(topo.domains):
            xs = [gpu_xy[g][0] for g in range(d * topo.gpus_per_domain, (d + 1) * topo.gpus_per_domain)]
            ax.add_patch(
                Rectangle(
                    (min(xs), rows + 0.5),
                    max(xs) - min(xs),
                    y_leaf - rows - 0.9,
                    fc=NIC,
                    alpha=0.12,
                    ec="none",
                    zorder=0,
                )
            )
            ax.text(
                (min(xs) + max(xs)) / 2,
                (rows + y_leaf) / 2,
                f"{topo.gpus_per_domain} NICs, one per GPU, GPU i to leaf i",
                ha="center",
                va="center",
                fontsize=7,
                color=NIC,
            )


def _draw_leaves_and_spine(
    ax: Axes, topo: FatTree, leaf_x: Mapping[tuple, float], y_leaf: float, y_spine: float, width: float
) -> None:
    """Every leaf (one long bar if there are too many to draw apart), the spine, and the uplinks between them."""
    spine_w = width * 0.5
    ax.add_patch(Rectangle((width / 2 - spine_w / 2 - 0.5, y_spine), spine_w, 1.0, fc=SWITCH_FACE, ec="black"))
    ax.text(
        width / 2 - 0.5, y_spine + 0.5, "spine (drawn as one non-blocking switch)", ha="center", va="center", fontsize=8
    )
    many = len(leaf_x) > MAX_LEAVES
    if many:
        ax.add_patch(Rectangle((-0.5, y_leaf - 0.4), width, 0.8, fc=SWITCH_FACE, ec="black"))
        ax.text(
            width / 2 - 0.5, y_leaf, f"{len(leaf_x)} leaf switches, one per rail", ha="center", va="center", fontsize=8
        )
    step = width / len(leaf_x)
    for i, (leaf, x) in enumerate(leaf_x.items()):
        if not many:
            w = min(step * 0.8, 6.0)
            ax.add_patch(Rectangle((x - w / 2, y_leaf - 0.4), w, 0.8, fc=SWITCH_FACE, ec="black", zorder=2))
            ax.text(x, y_leaf, _leaf_name(topo, leaf), ha="center", va="center", fontsize=6, zorder=3)
        if not many or i in (0, len(leaf_x) - 1):
            top = (width / 2 - 0.5 + (x - width / 2) * 0.5, y_spine)
            ax.plot([x, top[0]], [y_leaf + 0.4, top[1]], color=UPLINK, lw=2.5, zorder=1)
            ax.text(
                (x + top[0]) / 2,
                (y_leaf + y_spine) / 2 + 0.2,
                f"{topo.oversubscription:g}:1",
                fontsize=7,
                ha="center",
                va="center",
                bbox={"fc": "white", "ec": "none", "pad": 0.5},
                zorder=3,
            )


def _leaf_name(topo: FatTree, leaf: tuple) -> str:
    _, rail, unit = leaf
    return f"leaf rail {rail}" if topo.rail_optimized else f"leaf {unit}"


# ---------------------------------------------------------------------------------------------------- torus

TORUS_GAP = 2.2  # data units between the layers of a 3D torus


def _torus_title(topo: Torus) -> str:
    links = sum(2 if k > 2 else 1 for k in topo.shape if k > 1)
    return (
        f"{topo.name}: {len(topo.shape)}D torus, {links} links per chip\n{_rate(topo.link_bandwidth)} per link each way"
    )


def _draw_torus(ax: Axes, topo: Torus, colors: Mapping[int, str]) -> list:
    """A 2D torus as a grid (a ring as one row); a 3D torus as its layers along axis 0, side by side."""
    if len(topo.shape) > 3:
        raise ValueError(f"cannot draw {topo.name}: draw_topology draws tori of 1, 2 or 3 axes")
    shape = (1,) * (3 - len(topo.shape)) + tuple(topo.shape)  # (layers, rows, columns)
    layers, rows, cols = shape
    size = 12 if rows * cols <= 16 else 8
    for layer in range(layers):
        x0 = layer * (cols + TORUS_GAP)
        _draw_layer(ax, topo, shape, layer, x0, colors, size)
        if layers > 1:
            ax.text(x0 + (cols - 1) / 2, 1.3, f"layer x = {layer}", ha="center", fontsize=9)
    if layers > 1:
        _draw_layer_links(ax, layers, rows, cols)
    _draw_axis_names(ax, "xyz"[: len(topo.shape)], rows)
    ax.set_xlim(-1.4, layers * (cols + TORUS_GAP) - TORUS_GAP + 0.6)
    ax.set_ylim(-rows - (1.6 if layers > 1 else 0.6), 1.7)
    ax.set_aspect("equal")
    handles = [
        Line2D([], [], color=NIC, lw=1.5, label=f"link to a neighbour, {_rate(topo.link_bandwidth)} each way"),
        Line2D([], [], color=NIC, lw=1.2, ls="--", label="wrap-around link (last chip of a ring to its first)"),
    ]
    if layers > 1:
        handles.append(
            Line2D(
                [],
                [],
                color=UPLINK,
                lw=1.2,
                ls=":",
                label="each chip to the same place in the layers either side (x +/- 1, wrapping round)",
            )
        )
    return handles


def _draw_layer(
    ax: Axes, topo: Torus, shape: tuple[int, int, int], layer: int, x0: float, colors: Mapping[int, str], size: float
) -> None:
    """One layer: chips on a grid (row r at y = -r), links to right and lower neighbours, wrap-around arcs."""
    _, rows, cols = shape
    for r in range(rows):
        for c in range(cols):
            gpu = topo.gpu((layer, r, c)[3 - len(topo.shape) :])
            _gpu(ax, gpu, x0 + c, -r, colors, size)
            if size >= 12:
                ax.text(x0 + c, -r, str(gpu), ha="center", va="center", fontsize=6, zorder=5)
            if c + 1 < cols:
                ax.plot([x0 + c, x0 + c + 1], [-r, -r], color=NIC, lw=1.5, zorder=2)
            if r + 1 < rows:
                ax.plot([x0 + c, x0 + c], [-r, -r - 1], color=NIC, lw=1.5, zorder=2)
    for r in range(rows if cols > 2 else 0):  # a ring of two has one cable, already drawn
        _arc(ax, (x0 + cols - 1, -r), (x0, -r), rad=0.12)
    for c in range(cols if rows > 2 else 0):
        _arc(ax, (x0 + c, -(rows - 1)), (x0 + c, 0), rad=0.12)


def _draw_axis_names(ax: Axes, names: str, rows: int) -> None:
    """Arrows naming the axes the columns (the last axis) and the rows run along, beside the first layer."""
    arrow = {"arrowstyle": "->", "color": "black", "lw": 1}
    ax.annotate("", xy=(1, 0.75), xytext=(0, 0.75), arrowprops=arrow)
    ax.text(0.5, 0.85, names[-1], ha="center", va="bottom", fontsize=9, style="italic")
    if rows > 1:
        ax.annotate("", xy=(-0.75, -1), xytext=(-0.75, 0), arrowprops=arrow)
        ax.text(-0.9, -0.5, names[-2], ha="right", va="center", fontsize=9, style="italic")


def _arc(ax: Axes, start: tuple[float, float], end: tuple[float, float], rad: float) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            connectionstyle=f"arc3,rad={rad}",
            arrowstyle="-",
            color=NIC,
            lw=1.0,
            ls="--",
            alpha=0.8,
            zorder=1,
            gid="wrap",
        )
    )


def _draw_layer_links(ax: Axes, layers: int, rows: int, cols: int) -> None:
    """Between neighbouring layers, and from the last layer round to the first: the links along axis 0."""
    y = -(rows - 1) / 2
    for layer in range(layers - 1):
        x = layer * (cols + TORUS_GAP) + cols - 1
        ax.annotate(
            "",
            xy=(x + TORUS_GAP - 0.4, y),
            xytext=(x + 0.4, y),
            arrowprops={"arrowstyle": "<->", "color": UPLINK, "ls": ":", "lw": 1.5},
        )
    if layers > 2:
        last = (layers - 1) * (cols + TORUS_GAP) + (cols - 1) / 2
        ax.add_patch(
            FancyArrowPatch(
                ((cols - 1) / 2, -rows + 0.4),
                (last, -rows + 0.4),
                connectionstyle="arc3,rad=0.12",
                arrowstyle="<->",
                mutation_scale=10,
                color=UPLINK,
                ls=":",
                lw=1.5,
                gid="wrap-layers",
            )
        )
