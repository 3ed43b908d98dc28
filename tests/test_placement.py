"""Placing a mesh's axes on a topology's levels (pure Python: mesh coordinates in, GPUs and their groups out)."""

import pytest

from course_lib.cluster import collectives, placement, topology
from course_lib.parallel.mesh import axis_groups, check_sizes, coords_of

SUPERPOD = topology.h100_superpod(nodes=4)  # 4 NVLink domains of 8
CUBE = topology.tpu_v5p((4, 4, 4))


def mesh(**sizes):
    full = check_sizes(sizes_product(sizes), **sizes)
    return full, [coords_of(r, full) for r in range(sizes_product(sizes))]


def sizes_product(sizes):
    out = 1
    for v in sizes.values():
        out *= v
    return out


def placed_groups(full, gpus, axis):
    return [[gpus[r] for r in group] for group in axis_groups(axis, full)]


def test_the_default_placement_is_rank_r_on_gpu_r():
    full, coords = mesh(dp=2, pp=2, cp=2, tp=4)
    assert placement.gpus_for(coords, SUPERPOD, "tp,cp,pp,dp") == list(range(32))
    assert placement.gpus_for(coords, SUPERPOD, "tp") == list(range(32))  # the axes left out follow, in mesh order


def test_tp_inside_a_domain_and_pp_dp_across_leave_gaps_so_no_axis_shares_a_level():
    full, coords = mesh(dp=2, pp=2, tp=4)  # 16 ranks on 32 GPUs
    gpus = placement.gpus_for(coords, SUPERPOD, "tp/pp,dp")
    assert sorted(gpus) == [d * 8 + t for d in range(4) for t in range(4)]  # 4 GPUs of each node
    assert all(SUPERPOD.where(g).fast for g in placed_groups(full, gpus, "tp"))
    for axis in ("pp", "dp"):
        assert all(not SUPERPOD.where(g).fast for g in placed_groups(full, gpus, axis))
        assert {SUPERPOD.where(g).slowest_link for g in placed_groups(full, gpus, axis)} == {SUPERPOD.nic_bandwidth}


def test_tp_across_domains_is_slower_than_inside_and_where_says_why():
    full, coords = mesh(dp=2, pp=2, tp=2)
    good = placement.gpus_for(coords, SUPERPOD, "tp,pp/dp")
    bad = placement.gpus_for(coords, SUPERPOD, "dp/tp,pp")
    good_tp, bad_tp = placed_groups(full, good, "tp")[0], placed_groups(full, bad, "tp")[0]
    assert SUPERPOD.where(good_tp).what == "inside one NVLink domain of 8 GPUs"
    assert SUPERPOD.where(bad_tp).what.startswith("across 2 NVLink domains")
    nbytes = 16e6
    assert (
        collectives.choose(SUPERPOD, "all_reduce", bad_tp, nbytes).time_s
        > 5 * collectives.choose(SUPERPOD, "all_reduce", good_tp, nbytes).time_s
    )  # 450 vs 50 GB/s: 9x on the bandwidth term


def test_on_a_torus_each_level_is_an_axis_and_every_group_a_box_of_neighbours():
    full, coords = mesh(dp=4, pp=4, tp=4)
    gpus = placement.gpus_for(coords, CUBE, "tp/pp/dp")
    for axis, torus_axis in (("tp", 2), ("pp", 1), ("dp", 0)):
        for g in placed_groups(full, gpus, axis):
            assert CUBE.box(g) == {torus_axis: 4}
            assert CUBE.where(g).what == f"on a box of neighbouring chips (a ring of 4 on axis {torus_axis})"
    full, coords = mesh(dp=2, tp=8)
    tp = placed_groups(full, placement.gpus_for(coords, CUBE, "tp/dp"), "tp")[0]
    assert CUBE.box(tp) == {1: 2, 2: 4}  # a ring by a pair: the torus all-reduce runs on it
    assert collectives.choose(CUBE, "all_reduce", tp, 64e6).algorithm == "torus"


def test_a_scattered_expert_group_on_a_torus_pays_more_hops_than_a_box():
    ring = [CUBE.gpu((0, 0, z)) for z in range(4)]
    scattered = [CUBE.gpu((x, 0, z)) for x in (0, 2) for z in (0, 2)]  # every other chip on two rings
    assert CUBE.where(scattered).hops == 4 > CUBE.where(ring).hops == 2 and not CUBE.where(scattered).fast
    small = 1e3  # latency-bound: the hops are the time
    assert (
        collectives.choose(CUBE, "all_to_all", scattered, small).time_s
        > collectives.choose(CUBE, "all_to_all", ring, small).time_s
    )


@pytest.mark.parametrize(
    "text,topo,message",
    [
        ("tp/bogus", SUPERPOD, r"unknown axes \['bogus'\]"),
        ("tp,tp", SUPERPOD, "an axis is placed twice"),
        ("/", SUPERPOD, "no axes"),
        ("dp/pp,tp", topology.h100_superpod(nodes=1), "'dp/pp,tp' needs 32 GPUs and h100-superpod x1 has 8"),
        ("tp/pp/dp", SUPERPOD, "needs 64 GPUs and h100-superpod x4 has 32, in levels NVLink domain \\(8\\)"),
        ("tp,pp,dp", topology.tpu_v5p((2, 2)), "needs 8 GPUs and tpu-v5p 2x2 has 4"),
    ],
)
def test_a_bad_placement_is_one_clear_line(text, topo, message):
    _, coords = mesh(dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match=message) as err:
        placement.gpus_for(coords, topo, text)
    assert "\n" not in str(err.value)


def test_coordinates_that_are_not_a_mesh_are_refused():
    with pytest.raises(ValueError, match="do not tell them apart"):
        placement.gpus_for([{"tp": 0}, {"tp": 0}], SUPERPOD, "tp")
    with pytest.raises(ValueError, match="not axes of"):
        placement.gpus_for([{"stage": 0}], SUPERPOD, "tp")
