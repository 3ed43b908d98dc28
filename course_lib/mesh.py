"""A named-axis grid of ranks (dp, pp, tp) and its process groups (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", §3, "PTD-P").

Ranks are numbered with tp innermost, then pp, then dp: rank = (d * P + p) * T + t. A tensor-parallel group is
therefore T consecutive ranks, which land on one node when T divides the GPUs per node (the fast links are where
TP talks in every layer); pipeline stages and data-parallel replicas sit further apart. Room is left for the
expert and context axes (ep, cp) of later lessons: they slot between pp and tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from course_lib import comm

AXES = ("dp", "pp", "tp")  # outermost first


def check_sizes(world_size: int, **sizes: int) -> dict[str, int]:
    """The sizes of every axis (1 when not given); their product must be the world size."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axis {sorted(unknown)}; the mesh has {list(AXES)}")
    full = {axis: sizes.get(axis, 1) for axis in AXES}
    if any(v < 1 for v in full.values()):
        raise ValueError(f"every axis needs a size of at least 1, got {full}")
    product = math.prod(full.values())
    if product != world_size:
        shown = " x ".join(f"{axis.upper()} {full[axis]}" for axis in AXES)
        model_parallel = full["tp"] * full["pp"]
        hint = (
            f"with TP {full['tp']} x PP {full['pp']}, DP = {world_size // model_parallel}"
            if world_size % model_parallel == 0
            else f"TP x PP = {model_parallel} must divide {world_size}"
        )
        raise ValueError(
            f"{shown} = {product} ranks, but the world has {world_size}: TP x PP x DP must equal the number of "
            f"devices ({hint})."
        )
    return full


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


def axis_groups(axis: str, sizes: dict[str, int]) -> list[list[int]]:
    """Every group of ``axis``: ranks that agree on all other coordinates, in increasing order."""
    world = math.prod(sizes.values())
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        c = coords_of(rank, sizes)
        groups.setdefault(tuple(c[a] for a in AXES if a != axis), []).append(rank)
    return list(groups.values())


def name_of(coords: dict[str, int]) -> str:
    """A readable name such as dp1-pp0-tp1."""
    return "-".join(f"{axis}{coords[axis]}" for axis in AXES)


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


def to_device_mesh(sizes: dict[str, int], device_type: str = "cpu") -> DeviceMesh:
    """The same grid as PyTorch's DeviceMesh (dims named dp, pp, tp), for its parallel APIs."""
    full = check_sizes(dist.get_world_size(), **sizes)
    layout = torch.arange(math.prod(full.values())).view(*(full[a] for a in AXES))
    return DeviceMesh(device_type, layout, mesh_dim_names=AXES)
