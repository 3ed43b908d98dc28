"""Placing a mesh's axes on a topology's levels, and saying where each axis's groups land.

The lecture's placement rule: the chattiest axis on the fastest links. Tensor parallelism all-reduces activations
in every layer, so TP goes inside an NVLink domain (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", §3.3: "tensor model parallelism within a multi-GPU server"); context
and expert parallelism next (ring attention's K/V every layer, the MoE all-to-alls); pipeline stages send one
activation per microbatch and go across domains; data parallelism talks once per step and goes on top. Llama 3
orders its ranks TP, CP, PP, DP, innermost first (Grattafiori et al. 2024, §3.3.2), as :mod:`course_lib.parallel.mesh`
numbers ranks.

A topology's levels (:meth:`course_lib.cluster.topology.Topology.levels`), innermost first: an NVLink domain, then the
domains, on a fat-tree; the torus axes, fastest-varying first, on a torus. A placement lists, per level, the mesh
axes it holds, innermost first, written ``"tp,cp/pp,dp"`` (``/``: start at the next level). Rank r then runs
on the GPU whose index is its coordinates read as a mixed-radix number, the axes after a ``/`` starting at the
first level boundary the axes before them have not reached, so they never share a level with them. An axis
larger than its level spans the next ones too (TP 8 on a 4x4x4 torus: a ring of 4 by a pair). The default
placement, every axis on the first level in the mesh's order, overflowing into the next, is rank r on GPU r.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from course_lib.cluster.topology import Topology

ORDER = ("tp", "cp", "ep", "pp", "dp")  # the mesh's axes, innermost (chattiest) first


def parse(placement: str | Sequence[Sequence[str]]) -> list[list[str]]:
    """``"tp/pp,dp"`` (or ``[["tp"], ["pp", "dp"]]``) as levels of axes, or a one-line ValueError."""
    levels = (
        [[a.strip() for a in level.split(",") if a.strip()] for level in placement.split("/")]
        if isinstance(placement, str)
        else [list(level) for level in placement]
    )
    axes = [a for level in levels for a in level]
    unknown = sorted(set(axes) - set(ORDER))
    if unknown or not axes:
        raise ValueError(
            f"bad placement {placement!r}: {'unknown axes ' + str(unknown) if unknown else 'no axes'}; list mesh axes "
            f"of {list(ORDER)} innermost first, a '/' before each next level, e.g. 'tp/pp,dp'"
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"bad placement {placement!r}: an axis is placed twice; name each axis once")
    return levels


def gpus_for(
    coords: Sequence[dict[str, int]], topology: Topology, placement: str | Sequence[Sequence[str]]
) -> list[int]:
    """Each rank's GPU (``coords``: every rank's coordinates on the mesh's axes, as a scheme reports them) when
    the axes sit on the topology's levels as ``placement`` says; axes it leaves out go after the last level it
    names, in the mesh's order. ValueError when the topology cannot hold them or the coordinates are not a mesh."""
    levels = parse(placement)
    sizes = {axis: max(c.get(axis, 0) for c in coords) + 1 for c in coords for axis in c}
    if set(sizes) - set(ORDER) or not sizes:
        raise ValueError(f"the ranks report coordinates {sorted(sizes)}, not axes of {list(ORDER)}; nothing to place")
    named = {a for level in levels for a in level}
    levels[-1] += [a for a in ORDER if a in sizes and a not in named]
    bounds = list(itertools.accumulate((k for _, k in topology.levels()), operator.mul))  # where levels end
    stride, strides = 1, {}
    for i, level in enumerate(levels):
        if i:  # the next level starts at the first level boundary not yet used
            stride = next((b for b in bounds if b >= stride), stride)
        for a in level:
            strides[a] = stride
            stride *= sizes.get(a, 1)
    if stride > topology.n_gpus:
        names = ", ".join(f"{name} ({k})" for name, k in topology.levels())
        raise ValueError(
            f"placement {placement!r} needs {stride} GPUs and {topology.name} has {topology.n_gpus}, in levels "
            f"{names}: put more axes on one level (fewer '/') or use a bigger topology"
        )
    gpus = [sum(c.get(a, 0) * strides[a] for a in sizes) for c in coords]
    if len(set(gpus)) != len(gpus):
        raise ValueError("the ranks' coordinates do not tell them apart; place a run whose ranks report a mesh")
    return gpus
