"""Topologies and collective algorithms: every formula against the link-level simulation, the picker, the
profiles' sources, and bad input."""

import pytest

from course_lib.cluster import collectives, linksim, topology
from course_lib.cluster.clock import collective_time, link
from course_lib.cluster.profiles import PROFILES as HARDWARE
from course_lib.cluster.topology import FatTree, Torus

SIZES = (1e3, 1e6, 1e9)  # latency-bound to bandwidth-bound
# The formulas assume what the simulation checks: no two messages of a step share a link where the formula says
# they do not, and the counted sharing where it says they do. Both then add the same terms in a different order,
# so they agree to rounding.
EXACT = 1e-9

SUPERPOD = topology.h100_superpod(nodes=4)  # 32 GPUs, rail-optimized, one leaf per rail
TWO_LEVEL = topology.h100_two_level(nodes=2)
ETHERNET = topology.ethernet_2to1(nodes=4)  # two leaves, 2:1 above them
NVL72 = topology.gb200_nvl72(racks=2)
CUBE = topology.tpu_v5p((4, 4, 4))
SLAB = topology.tpu_v5p((2, 4, 4))  # an axis of two: one cable between the pair
AXIS = [CUBE.gpu((x, 1, 2)) for x in range(4)]
PLANE = [CUBE.gpu((x, y, 3)) for x in range(4) for y in range(4)]
BOX = [CUBE.gpu((2, y, z)) for y in (3, 0) for z in range(4)]  # a ring of 4 by a pair across the wrap
LONG = topology.tpu_v5p((4, 8, 8))
RUN = [LONG.gpu((1, y, z)) for y in (7, 0, 1) for z in (6, 7, 0)]  # runs of 3 on two rings of 8, across the wraps

SHAPES = {
    "in a node": (SUPERPOD, list(range(8))),
    "across nodes (rails)": (SUPERPOD, list(range(32))),
    "half of each node": (SUPERPOD, [0, 1, 2, 3, 8, 9, 10, 11]),
    "two-level h100": (TWO_LEVEL, list(range(16))),
    "2:1 fat-tree": (ETHERNET, list(range(32))),
    "two NVL72 racks": (NVL72, list(range(144))),
    "torus axis": (CUBE, AXIS),
    "2D torus": (CUBE, PLANE),
    "3D torus": (CUBE, list(range(64))),
    "2x4x4 torus": (SLAB, list(range(32))),
    "torus box 2x4": (CUBE, BOX),
    "torus runs 3x3": (LONG, RUN),
    "scattered chips": (CUBE, [0, 2, 8, 10, 21, 42, 63]),  # not a box: the all-to-all counted link by link
    "scattered on 4x8x8": (LONG, [LONG.gpu((x, 2 * y, (3 * y + x) % 8)) for x in range(4) for y in range(4)]),
}
CASES = [
    ("all_reduce", "ring", ["in a node", "across nodes (rails)", "2:1 fat-tree", "two NVL72 racks", "torus axis"]),
    ("all_reduce", "ring", ["torus box 2x4"]),
    ("all_gather", "ring", ["across nodes (rails)", "2D torus"]),
    ("reduce_scatter", "ring", ["two-level h100"]),
    ("all_reduce", "tree", ["in a node", "across nodes (rails)", "2:1 fat-tree", "3D torus"]),
    ("broadcast", "tree", ["half of each node", "two NVL72 racks", "2D torus"]),
    ("all_reduce", "hierarchical", ["across nodes (rails)", "half of each node", "2:1 fat-tree", "two NVL72 racks"]),
    ("all_reduce", "torus", ["torus axis", "2D torus", "3D torus", "2x4x4 torus", "torus box 2x4"]),
    ("reduce_scatter", "torus", ["3D torus", "2x4x4 torus"]),
    ("all_gather", "torus", ["2D torus", "2x4x4 torus"]),
    ("all_to_all", "all_to_all", list(SHAPES)),
]


@pytest.mark.parametrize(
    "op,algorithm,shape", [(op, algo, shape) for op, algo, shapes in CASES for shape in shapes], ids=str
)
def test_the_formula_is_the_link_level_simulation(op, algorithm, shape):
    topo, group = SHAPES[shape]
    for nbytes in SIZES:
        formula = collectives.cost(topo, op, algorithm, group, nbytes)
        simulated = linksim.simulate(topo, linksim.steps_for(topo, op, algorithm, group, nbytes))
        assert formula == pytest.approx(simulated, rel=EXACT), (nbytes, formula, simulated)


def test_the_simulation_sees_sharing_the_ring_formula_assumes_away():
    # Listed alternately across the two leaves, every ring hop crosses the 2:1 spine: the 16 messages leaving a leaf
    # share its uplink of 16 NICs / 2, so each gets half a NIC where the formula assumes a whole one.
    topo, group = ETHERNET, [g for pair in zip(range(16), range(16, 32), strict=True) for g in pair]
    formula = collectives.cost(topo, "all_reduce", "ring", group, 1e9)
    simulated = linksim.simulate(topo, linksim.steps_for(topo, "all_reduce", "ring", group, 1e9))
    latency = 2 * (len(group) - 1) * topo.path(0, 16)[1]  # the same in both: each hop crosses the spine
    assert simulated - latency == pytest.approx(2 * (formula - latency), rel=EXACT)


@pytest.mark.parametrize(
    "topo,src,dst,hops",
    [(SUPERPOD, 0, 1, 2), (SUPERPOD, 0, 8, 2), (SUPERPOD, 0, 9, 4), (ETHERNET, 0, 31, 4), (CUBE, 0, 42, 6)],
    ids=str,
)
def test_a_message_pays_its_hops_and_its_slowest_link(topo, src, dst, hops):
    assert len(topo.route(src, dst)) == hops
    for nbytes in SIZES:
        formula = collectives.cost(topo, "send", "p2p", [src, dst], nbytes)
        simulated = linksim.simulate(topo, linksim.steps_for(topo, "send", "p2p", [src, dst], nbytes))
        assert formula == pytest.approx(simulated, rel=EXACT)
    if isinstance(topo, Torus):
        assert collectives.cost(topo, "send", "p2p", [src, dst], 0.0) == pytest.approx(hops * topo.hop_latency)


def test_torus_routes_go_dimension_by_dimension_the_short_way_round():
    # (0,0,0) -> (3,2,1): x back one (wrap), y forward two (a tie: the positive way), z forward one
    route = CUBE.route(CUBE.gpu((0, 0, 0)), CUBE.gpu((3, 2, 1)))
    assert [CUBE.coords(lk.dst) for lk in route] == [(3, 0, 0), (3, 1, 0), (3, 2, 0), (3, 2, 1)]


def test_the_two_level_topology_is_todays_modeled_clock():
    h100 = HARDWARE["h100"]
    for group in (range(8), range(16)):
        bandwidth, latency, _ = link(h100, group, h100.gpus_per_node)
        n, nbytes = len(group), 1e8
        today = collective_time("all_reduce", 2 * (n - 1) / n * nbytes, n, bandwidth, latency)
        assert collectives.cost(TWO_LEVEL, "all_reduce", "ring", list(group), nbytes) == pytest.approx(today)


def test_the_picker_takes_the_tree_for_tiny_messages_and_ring_or_hierarchical_for_large_ones():
    group = list(range(32))
    tiny = collectives.choose(SUPERPOD, "all_reduce", group, 1024)
    large = collectives.choose(SUPERPOD, "all_reduce", group, 1e9)
    assert tiny.algorithm == "tree" and "latency-bound" in tiny.why
    assert large.algorithm in ("ring", "hierarchical")
    for choice, nbytes in ((tiny, 1024), (large, 1e9)):
        others = [collectives.cost(SUPERPOD, "all_reduce", a, group, nbytes) for a in ("ring", "tree", "hierarchical")]
        assert choice.time_s == min(others)
    assert collectives.choose(CUBE, "all_reduce", list(range(64)), 1e9).algorithm == "torus"
    forced = collectives.choose(SUPERPOD, "all_reduce", group, 1e9, algorithm="ring")
    assert forced.algorithm == "ring" and forced.why.startswith("forced")
    assert forced.time_s > large.time_s  # across nodes a flat ring loses to the hierarchy


def _sim_all_to_all(topo, group, nbytes):
    return linksim.simulate(topo, linksim.all_to_all_steps(group, nbytes))


def test_all_to_all_is_slower_on_a_torus_than_on_a_full_bisection_fat_tree():
    # The same 64 chips with the same bandwidth leaving each chip: six torus links, or one NIC six times as fast
    # on a non-blocking fat-tree. On the torus messages cross up to 6 links, sharing each with many others.
    flat = FatTree(
        name="64 x 1 GPU, non-blocking",
        domains=64,
        gpus_per_domain=1,
        nvlink_bandwidth=1.0,  # no NVLink: one GPU per domain
        nvlink_latency=0.0,
        nic_bandwidth=6 * CUBE.link_bandwidth,
        nic_latency=CUBE.hop_latency,
        spine_latency=0.0,
        domains_per_leaf=8,
    )
    group = list(range(64))
    on_torus, on_tree = _sim_all_to_all(CUBE, group, 1e9), _sim_all_to_all(flat, group, 1e9)
    assert on_torus == pytest.approx(collectives.all_to_all(CUBE, group, 1e9), rel=EXACT)
    assert on_tree == pytest.approx(collectives.all_to_all(flat, group, 1e9), rel=EXACT)
    assert on_torus > 4 * on_tree  # 48 messages on the busiest torus link vs 63 on a 6x faster NIC: 4.6x


def test_two_to_one_oversubscription_doubles_a_bisection_bound_all_to_all():
    # One node per leaf: every message leaving a node also leaves its leaf, so at 1:1 the uplink carries exactly
    # what the NICs inject and at 2:1 it is the bottleneck at half that rate. The latency (6 us of ~30 ms) is why
    # the ratio is 2 to 1e-3 and not exactly.
    def cluster(ratio):
        return FatTree(
            name=f"{ratio}:1",
            domains=4,
            gpus_per_domain=8,
            nvlink_bandwidth=450e9,
            nvlink_latency=1e-6,
            nic_bandwidth=50e9,
            nic_latency=2.5e-6,
            spine_latency=0.5e-6,
            domains_per_leaf=1,
            oversubscription=ratio,
        )

    group = list(range(32))
    full, half = _sim_all_to_all(cluster(1), group, 1e9), _sim_all_to_all(cluster(2), group, 1e9)
    assert half / full == pytest.approx(2, rel=1e-3)
    assert half == pytest.approx(collectives.all_to_all(cluster(2), group, 1e9), rel=EXACT)


@pytest.mark.parametrize("name", sorted(topology.PROFILES))
def test_every_profile_cites_each_of_its_figures(name):
    topo = topology.get_topology(name)
    assert topo.figures and set(topo.figures) == set(topo.sources)
    assert all(isinstance(s, str) and len(s) > 20 for s in topo.sources.values())
    assert all(getattr(topo, key) == value for key, value in topo.figures.items())  # the figures are the model's


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: Torus(name="t", shape=(4, 4, 4), n_gpus=60, link_bandwidth=1.0, hop_latency=0.0), "64 chips, not 60"),
        (lambda: collectives.cost(SUPERPOD, "all_reduce", "ring", [0, 99], 1e6), "do not fit"),
        (lambda: collectives.choose(CUBE, "all_reduce", [0, 64], 1e6), "do not fit"),
        (lambda: collectives.cost(SUPERPOD, "all_reduce", "bogus", [0, 1], 1e6), "unknown algorithm 'bogus'"),
        (lambda: collectives.cost(SUPERPOD, "all_reduce", "torus", [0, 1], 1e6), "needs a Torus"),
        (lambda: collectives.cost(CUBE, "all_reduce", "torus", [0, 1, 5], 1e6), "not the 4 of its extents"),
        (lambda: collectives.cost(CUBE, "all_reduce", "torus", [0, 1, 2, 4, 5, 6], 1e6), "neither the whole ring"),
        (lambda: collectives.cost(LONG, "all_reduce", "torus", RUN, 1e6), "needs whole rings \\(or pairs\\)"),
        (lambda: collectives.cost(SUPERPOD, "all_reduce", "hierarchical", [0, 1, 8], 1e6), "same number of ranks"),
        (lambda: collectives.cost(SUPERPOD, "all_to_all", "ring", [0, 1], 1e6), "for all_to_all choose one of"),
        (lambda: collectives.cost(SUPERPOD, "gossip", "ring", [0, 1], 1e6), "unknown collective"),
        (lambda: topology.get_topology("dragonfly"), "unknown topology"),
        (
            lambda: FatTree(**{**SUPERPOD.figures, "name": "f", "domains": 5, "domains_per_leaf": 2}),
            "do not fill leaves",
        ),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)
