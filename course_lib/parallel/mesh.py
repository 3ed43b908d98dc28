"""A named-axis grid of ranks (dp, pp, cp, tp) and its process groups (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §3, "PTD-P"; the context-parallel axis of Llama 3,
Grattafiori et al. 2024, §3.3.2).

Ranks are numbered with tp innermost, then cp, then pp, then dp: rank = ((d * P + p) * C + c) * T + t. The axes
are ordered by how much they talk: a tensor-parallel group (T consecutive ranks) all-reduces activations in every
layer, so it lands on one node when T divides the GPUs per node; a context-parallel group (C x T consecutive ranks
hold its T groups) passes K/V blocks in every layer, so it comes next, as in Megatron-LM's default order
(tp-cp-ep-dp-pp, innermost first); pipeline stages and data-parallel replicas talk once per microbatch or per step
and sit further apart. (Megatron puts pp outermost and dp inside it; the course keeps dp outermost, as its 3D lesson
always had: a replica is then a block of consecutive ranks.) An axis of size 1 still has its groups, of one rank
each, so code that reads ``mesh.groups["cp"]`` needs no special case. The expert axis (ep) of a mixture-of-experts
model is folded into dp, as Megatron-core folds it (ep just inside dp in its order): :func:`fold_experts` adds the
groups of ep consecutive data-parallel ranks, ``ep``, and the expert-data-parallel groups of the ranks that hold the
same experts, ``edp``, without changing the numbering. :func:`joint_group` builds a group over several axes at once,
such as Megatron's dp-cp group over which context-parallel gradients are averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from course_lib.ledgers import comm
from course_lib.parallel.checks import AXES, check_sizes


def coords_of(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """Where a rank sits on each axis (tp innermost)."""
    coords = {}
    for axis in reversed(AXES):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return {axis: coords[axis] for axis in AXES}


def rank_of(coords: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * sizes[axis] + coords[axis]
    return rank


def axis_groups(axis: str | tuple[str, ...], sizes: dict[str, int]) -> list[list[int]]:
    """Every group of ``axis`` (or of several axes at once): ranks that agree on all other coordinates, in
    increasing order."""
    axes = (axis,) if isinstance(axis, str) else axis
    world = math.prod(sizes.values())
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        c = coords_of(rank, sizes)
        groups.setdefault(tuple(c[a] for a in AXES if a not in axes), []).append(rank)
    return list(groups.values())


def name_of(coords: dict[str, int]) -> str:
    """A readable name such as dp1-pp0-cp0-tp1 (the axes ``coords`` has, outermost first)."""
    return "-".join(f"{axis}{coords[axis]}" for axis in AXES if axis in coords)


@dataclass
class Mesh:
    """This rank's place in the grid and its process group along each axis (its ledger names them by axis)."""

    sizes: dict[str, int]
    rank: int
    coords: dict[str, int]
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return name_of(self.coords)


def build_mesh(**sizes: int) -> Mesh:
    """Create the process groups of every axis (every rank must call this, with the same sizes)."""
    full = check_sizes(dist.get_world_size(), **sizes)
    rank = dist.get_rank()
    mesh = Mesh(full, rank, coords_of(rank, full))
    for axis in AXES:
        for ranks in axis_groups(axis, full):  # every rank creates every group, in the same order
            group = comm.new_group(ranks, axis)
            if rank in ranks:
                mesh.groups[axis], mesh.members[axis] = group, ranks
    return mesh


def joint_axes(sizes: dict[str, int], axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``axes`` longer than one rank (or the first of them if none is): what a joint group spans."""
    return tuple(axis for axis in axes if sizes[axis] > 1) or axes[:1]


def joint_group(mesh: Mesh, axes: tuple[str, ...]) -> tuple[dist.ProcessGroup, list[int], str]:
    """This rank's group over several axes at once, such as Megatron's dp-cp group (every rank must call it, with
    the same axes): its process group, its members and its ledger name, the names of the axes it spans joined
    (``dp-cp``); when only one of them is longer than one rank, that axis's own group under its own name."""
    spanned = joint_axes(mesh.sizes, axes)
    if len(spanned) == 1:
        return mesh.groups[spanned[0]], mesh.members[spanned[0]], spanned[0]
    name, mine = "-".join(spanned), None
    for ranks in axis_groups(spanned, mesh.sizes):
        group = comm.new_group(ranks, name)
        if mesh.rank in ranks:
            mine = group, ranks, name
    return mine


def expert_groups(sizes: dict[str, int], ep: int) -> dict[str, list[list[int]]]:
    """The expert axes folded into dp (Megatron-core's "MoE parallel folding"; DeepSeek-V3, §3.2): ``ep``, groups
    of ep consecutive data-parallel ranks (same pp, cp, tp; dp coordinates g ep .. g ep + ep - 1), over which an
    MoE layer's experts are split; and ``edp``, the expert-data-parallel groups of the dp/ep ranks that hold the same
    experts (dp coordinates j, j + ep, j + 2 ep, ...)."""
    if ep < 1 or sizes["dp"] % ep:
        raise ValueError(f"EP {ep} is carved out of DP {sizes['dp']}: it must be at least 1 and divide it")
    groups: dict[str, dict[tuple, list[int]]] = {"ep": {}, "edp": {}}
    for rank in range(math.prod(sizes.values())):
        c = coords_of(rank, sizes)
        rest = tuple(c[a] for a in AXES if a != "dp")
        groups["ep"].setdefault((*rest, c["dp"] // ep), []).append(rank)
        groups["edp"].setdefault((*rest, c["dp"] % ep), []).append(rank)
    return {axis: list(by.values()) for axis, by in groups.items()}


def fold_experts(mesh: Mesh, ep: int) -> None:
    """Create the groups of :func:`expert_groups` (every rank must call it, with the same ``ep``) and add this rank's
    to ``mesh.groups`` and ``mesh.members`` under ``ep`` and ``edp``, the names its ledger records them by."""
    for axis, groups in expert_groups(mesh.sizes, ep).items():
        for ranks in groups:
            group = comm.new_group(ranks, axis)
            if mesh.rank in ranks:
                mesh.groups[axis], mesh.members[axis] = group, ranks


def to_device_mesh(sizes: dict[str, int], device_type: str = "cpu") -> DeviceMesh:
    """The same grid as PyTorch's DeviceMesh (dims named as :data:`AXES`), for its parallel APIs."""
    full = check_sizes(dist.get_world_size(), **sizes)
    layout = torch.arange(math.prod(full.values())).view(*(full[a] for a in AXES))
    return DeviceMesh(device_type, layout, mesh_dim_names=AXES)
