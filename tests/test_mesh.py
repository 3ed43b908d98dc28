"""The rank grid: coordinates, groups per axis with TP innermost and CP next to it, joint groups (dp-cp), clear
errors, and PyTorch's DeviceMesh agreeing."""

import pytest
import torch
import torch.distributed as dist

from course_lib.ledgers import comm
from course_lib.parallel.mesh import (
    axis_groups,
    build_mesh,
    check_sizes,
    coords_of,
    joint_group,
    name_of,
    rank_of,
    to_device_mesh,
)
from course_lib.runtime import launch

SIZES = {"dp": 2, "pp": 2, "cp": 1, "tp": 2}
GRID_4D = {"dp": 2, "pp": 1, "cp": 2, "tp": 2}


def test_tensor_parallel_groups_are_consecutive_ranks():
    assert axis_groups("tp", SIZES) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups("pp", SIZES) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups("dp", SIZES) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        assert rank_of(coords_of(rank, SIZES), SIZES) == rank
    assert name_of(coords_of(5, SIZES)) == "dp1-pp0-cp0-tp1"


def test_context_parallel_groups_sit_between_tensor_and_pipeline():
    """rank = ((d P + p) C + c) T + t: a CP group strides over the T ranks of a TP group; dp-cp joins them."""
    assert axis_groups("tp", GRID_4D) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups("cp", GRID_4D) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups("dp", GRID_4D) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups(("dp", "cp"), GRID_4D) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coords_of(6, GRID_4D) == {"dp": 1, "pp": 0, "cp": 1, "tp": 0}
    assert all(rank_of(coords_of(r, GRID_4D), GRID_4D) == r for r in range(8))


def test_sizes_that_do_not_multiply_to_the_world_are_refused():
    with pytest.raises(ValueError, match="DP 1 x PP 2 x TP 2 = 4 ranks, but the world has 8"):
        check_sizes(8, tp=2, pp=2)
    with pytest.raises(ValueError, match="unknown axis \\['ep'\\]"):
        check_sizes(8, ep=2)
    with pytest.raises(ValueError, match="DP 1 x CP 4 x TP 4 = 16 ranks.*TP x CP = 16 must divide 8"):
        check_sizes(8, tp=4, cp=4)
    assert check_sizes(8, tp=2, pp=2, dp=2) == SIZES


def groups_and_a_sum():
    mesh = build_mesh(**SIZES)
    out = {}
    for axis in ("dp", "pp", "tp"):
        x = torch.tensor([dist.get_rank() * 1.0])
        comm.all_reduce(x, group=mesh.groups[axis])
        out[axis] = (mesh.members[axis], x.item())
    device_mesh = to_device_mesh(SIZES)
    theirs = {axis: dist.get_process_group_ranks(device_mesh.get_group(axis)) for axis in ("dp", "pp", "tp")}
    return mesh.name, mesh.coords, out, theirs, [r.group for r in comm.records()]


def joint_groups_and_a_sum():
    mesh = build_mesh(**GRID_4D)
    out = {}
    for axes in (("dp", "cp"), ("pp", "cp"), ("pp", "tp")):
        group, members, name = joint_group(mesh, axes)
        x = torch.tensor([dist.get_rank() * 1.0])
        comm.all_reduce(x, group=group)
        out[axes] = (members, name, x.item())
    return out, [(r.group, r.ranks) for r in comm.records()]


def test_a_joint_group_spans_the_axes_longer_than_one_rank_under_their_joined_name():
    for rank, (out, records) in enumerate(launch.run(joint_groups_and_a_sum, 8)):
        dp_cp = next(g for g in axis_groups(("dp", "cp"), GRID_4D) if rank in g)
        assert out[("dp", "cp")] == (dp_cp, "dp-cp", sum(dp_cp))
        cp = next(g for g in axis_groups("cp", GRID_4D) if rank in g)
        assert out[("pp", "cp")] == (cp, "cp", sum(cp)), "pp has one rank: the joint group is cp's own"
        tp = next(g for g in axis_groups("tp", GRID_4D) if rank in g)
        assert out[("pp", "tp")] == (tp, "tp", sum(tp))
        assert records == [("dp-cp", tuple(dp_cp)), ("cp", tuple(cp)), ("tp", tuple(tp))]


def test_every_rank_gets_its_groups_and_pytorch_agrees():
    for rank, (name, coords, out, theirs, groups) in enumerate(launch.run(groups_and_a_sum, 8)):
        assert name == name_of(coords_of(rank, SIZES)) and coords == coords_of(rank, SIZES)
        for axis, (members, total) in out.items():
            assert rank in members and total == sum(members)
            assert theirs[axis] == members, "DeviceMesh builds the same groups"
        assert groups == ["dp", "pp", "tp"], "the ledger names each collective's axis"
