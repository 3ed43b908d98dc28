"""The planner on a topology: its layout follows the wiring, for reasons it states (issue 22).

Compute and memory are the H100 profile's throughout, so only the links differ: an H100 SuperPOD (8-GPU NVLink
nodes, 50 GB/s NICs), GB200 NVL72 racks (72 GPUs in one NVLink domain) and a TPU v5p torus (100 GB/s links to
neighbouring chips)."""

import pytest

from course_lib.cli import main
from course_lib.cluster.network import Network
from course_lib.cluster.profiles import PROFILES
from course_lib.cluster.topology import for_gpus, gb200_nvl72
from course_lib.model.config import Layout
from course_lib.parallel.mesh import axis_groups
from course_lib.planner.evaluate import evaluate_layout
from course_lib.planner.layouts import groups
from course_lib.planner.search import plan

WIRINGS = ("h100-superpod", "gb200-nvl72", "tpu-v5p")


def sizes(c):
    return {axis: getattr(c, axis) for axis in ("tp", "pp", "dp", "cp", "ep", "zero")}


def layout_of(c):
    """The degrees, ZeRO stage and schedule of a plan, as a layout to evaluate elsewhere."""
    return Layout(**sizes(c), schedule=c.schedule, sp=True)


@pytest.fixture(scope="module")
def dense():
    """Llama 3 70B on 2,304 GPUs: 288 SuperPOD nodes, 32 NVL72 racks, a 16x12x12 torus."""
    return {wiring: plan("llama3-70b", 2304, topology=wiring) for wiring in WIRINGS}


def test_an_nvl72_rack_holds_a_whole_replica_on_nvlink_where_a_superpod_node_cannot(dense):
    pod, rack = dense["h100-superpod"], dense["gb200-nvl72"]
    assert pod.tp <= 8 < pod.tp * pod.pp and pod.placement["pp"]["spans_nodes"]  # stages cross the 50 GB/s NICs
    assert rack.tp * rack.pp == 72 and not rack.placement["pp"]["spans_nodes"]  # TP x PP fills one rack
    assert rack.placement["pp"]["where"] == "inside one NVLink domain of 72 GPUs"
    assert sizes(rack) != sizes(pod) and rack.step_time_s < pod.step_time_s
    assert f"On one NVLink domain: TP {rack.tp}, PP {rack.pp}; across domains: DP {rack.dp}." in " ".join(rack.reasons)
    # Each choice is the better one on its own wiring, the other's layout slower there.
    for mine, other, wiring in ((pod, rack, "h100-superpod"), (rack, pod, "gb200-nvl72")):
        theirs = evaluate_layout("llama3-70b", 2304, layout_of(other), topology=wiring)
        assert theirs.step_time_s > mine.step_time_s


def test_a_torus_keeps_tp_on_neighbouring_chips_and_pays_for_its_slower_links(dense):
    pod, torus = dense["h100-superpod"], dense["tpu-v5p"]
    assert torus.topology == "tpu-v5p 16x12x12"
    assert torus.placement["tp"]["where"].startswith("on a box of neighbouring chips")
    assert torus.placement["dp"]["where"] == "on 64 scattered chips, not a box of neighbours"
    # the same TP all-reduces over 100 GB/s torus links (a run of 4, its ring closing 3 hops back) vs 450 GB/s NVLink
    assert torus.tp == pod.tp and torus.time["tp_comm_s"] > 3 * pod.time["tp_comm_s"]
    assert "a 16x12x12 torus, every chip on 100 GB/s links" in " ".join(torus.reasons)


def test_moe_expert_parallelism_stays_on_nvlink_with_less_tp_in_a_rack():
    """DeepSeek-V3 on 1,152 GPUs: on the SuperPOD its EP group of 8 spans 2 nodes with TP 4 (node-limited routing
    sends a token over InfiniBand once per node); a rack holds EP 8 with TP 2 on NVLink. The rack's layout on the
    SuperPOD spreads EP over 4 nodes."""
    pod = plan("deepseek-v3", 1152, topology="h100-superpod")
    rack = plan("deepseek-v3", 1152, topology="gb200-nvl72")
    assert pod.ep == rack.ep == 8 and pod.tp == 4 > rack.tp == 2
    assert pod.placement["ep"]["where"].startswith("across 2 NVLink domains")
    assert not rack.placement["ep"]["spans_nodes"]
    spread = evaluate_layout("deepseek-v3", 1152, layout_of(rack), topology="h100-superpod")
    assert spread.placement["ep"]["where"].startswith("across 4 NVLink domains")
    assert spread.time["ep_comm_s"] > 7 * rack.time["ep_comm_s"]
    assert rack.step_time_s < pod.step_time_s < spread.step_time_s


def test_the_slowest_group_of_an_axis_sets_its_time():
    """EP groups of 48 on two 72-GPU racks: rank 0's group is inside rack 0, the next straddles both racks."""
    net = Network(PROFILES["h100"], 72, gb200_nvl72(racks=2))
    ep = groups(1, 1, 144, 1, 48)["ep"]
    assert [g[0] for g in ep] == [0, 48, 96]
    alone = net.time("all_to_all", ep[:1], 1e8)
    assert net.time("all_to_all", ep, 1e8) > 5 * alone
    assert net.where(ep)["where"] == "across 2 NVLink domains (24 of the group in each), through the spine"


def test_the_planners_groups_are_the_meshs():
    g, mesh = groups(2, 3, 4, 2, 4), {"dp": 4, "pp": 3, "cp": 2, "tp": 2}
    for axis in ("tp", "cp", "pp", "dp"):
        assert [list(x) for x in g[axis]] == axis_groups(axis, mesh)
    stages = axis_groups(("dp", "cp", "tp"), mesh)
    assert [list(x) for x in g["ep"]] == [s[i : i + 4] for s in stages for i in range(0, 16, 4)]
    assert [list(x) for x in g["edp"]] == [s[i::4] for s in stages for i in range(4)]


def test_a_topology_is_sized_to_the_gpus():
    assert for_gpus("tpu-v5p", 576).shape == (12, 12, 4)  # cube-like, sides of 4s, the shortest ring fastest
    assert for_gpus("gb200-nvl72", 576).n_gpus == 576 and for_gpus("h100-superpod", 576).domains == 72
    assert for_gpus("tpu-v5p:4x4x8", 64).n_gpus == 128  # a given size is kept (and refused by the plan)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"gpus": 100, "topology": "gb200-nvl72"}, "100 GPUs are not whole racks of 72 on gb200-nvl72"),
        ({"gpus": 64, "topology": "tpu-v5p:4x4x8"}, "tpu-v5p 4x4x8 has 128 GPUs, not the plan's 64"),
        ({"gpus": 64, "topology": "tpu-v5p", "gpus_per_node": 4}, "drop gpus_per_node"),
        ({"gpus": 64, "topology": "fat-torus"}, "unknown topology 'fat-torus'"),
    ],
)
def test_bad_topologies_are_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        plan("llama3-70b", **kwargs)
    assert "\n" not in str(err.value)


def test_the_command_line_plans_on_a_topology_and_says_where_each_group_sits(capsys):
    assert main(["plan", "--preset", "llama3-70b", "--gpus", "2304", "--topology", "gb200-nvl72"]) == 0
    out = capsys.readouterr().out
    assert "on 2304 GPUs (gb200-nvl72 x32's links, h100's compute, 80 GB each)" in out
    assert "The pipeline of 9 sits inside one NVLink domain of 72 GPUs (900 GB/s per GPU, up to 2 hops)." in out
