"""The modeled clock on a topology: each collective timed by collectives.choose on the group's GPUs.

One real run (sequence-parallel TP on 4 ranks, FLOPs counted) is recorded once and replayed several ways; the
replays are pure Python. Hand-written one-collective programs pin down how the ledger's bytes become the buffer
``choose`` times."""

from dataclasses import replace

import pytest

from course_lib.cluster import collectives, placement, topology
from course_lib.cluster.clock import replay
from course_lib.cluster.profiles import PROFILES
from course_lib.harness import run_scheme
from course_lib.ledgers.comm import CommRecord
from course_lib.ledgers.trace import Issue, Wait
from course_lib.model.config import GPTConfig, TrainConfig

H100 = PROFILES["h100"]
SUPERPOD = topology.h100_superpod(nodes=4)
CUBE = topology.tpu_v5p((4, 4, 4))


@pytest.fixture(scope="module")
def sp_run():
    """``sp`` (TP 4 with sequence parallelism), one step, replayed by run_scheme on the H100 SuperPOD, its TP axis
    placed on the first level (an NVLink domain), as by default."""
    return run_scheme(
        "sp", 4, GPTConfig(), TrainConfig(steps=1), hardware="h100", topology="h100-superpod", placement="tp"
    )


def test_run_scheme_times_every_collective_of_the_step_on_the_topology_and_reports_the_algorithms(sp_run):
    modeled = sp_run.report["modeled"]
    assert modeled["topology"] == "h100-superpod x4"
    assert modeled["algorithms"] == sp_run.modeled.algorithms
    step_records = [rec for rec in sp_run.result.comm[0] if rec.tags.get("step") == sp_run.modeled.step]
    assert sum(n for used in modeled["algorithms"].values() for n in used.values()) == len(step_records)
    assert {op: set(used) for op, used in modeled["algorithms"].items()} == {
        "all_gather": {"ring"},  # one algorithm on a fat-tree
        "reduce_scatter": {"ring"},
        "all_reduce": {"tree"},  # small, latency-bound
    }


@pytest.mark.parametrize("per_node", [2, 4])
def test_the_ring_on_the_two_level_topology_is_todays_clock(sp_run, per_node):
    """The bridge: today's clock is the ring on two_level(profile); nodes of 2 put the TP ring across nodes."""
    profile = replace(H100, gpus_per_node=per_node)
    programs, records = sp_run.result.programs, sp_run.result.comm
    today = replay(programs, records, profile)
    bridge = replay(programs, records, profile, topology=topology.two_level(profile, 2), algorithm="ring")
    assert bridge.step_time_s == pytest.approx(today.step_time_s, rel=1e-9)
    for new, old in zip(bridge.ranks, today.ranks, strict=True):
        assert new.comm_s == pytest.approx(old.comm_s, rel=1e-9)
        assert new.compute_s == pytest.approx(old.compute_s, rel=1e-12)
    assert set(bridge.algorithms["all_reduce"]) == {"ring"}
    picked = replay(programs, records, profile, topology=topology.two_level(profile, 2))
    # Small all-reduces: across nodes the hierarchical one moves most bytes over NVLink; in a node the tree wins.
    best = "hierarchical" if per_node == 2 else "tree"
    assert picked.algorithms["all_reduce"] == {best: bridge.algorithms["all_reduce"]["ring"]}
    assert picked.step_time_s < bridge.step_time_s


def test_tensor_parallelism_spread_over_nodes_is_slower_and_the_links_say_why(sp_run):
    programs, records = sp_run.result.programs, sp_run.result.comm
    coords = [rank["coords"] for rank in sp_run.report["ranks"]]
    assert placement.gpus_for(coords, SUPERPOD, "/tp") == [0, 8, 16, 24]  # TP on the second level: across nodes
    packed = replay(programs, records, "h100", topology=SUPERPOD, gpus=[0, 1, 2, 3])
    spread = replay(programs, records, "h100", topology=SUPERPOD, gpus=[0, 8, 16, 24])  # GPU 0 of four nodes
    assert sp_run.report["modeled"]["placement"]["world"]["what"] == "inside one NVLink domain of 8 GPUs"
    assert spread.placement["world"].what == "across 4 NVLink domains (1 of the group in each), under one leaf switch"
    assert spread.placement["world"].slowest_link == SUPERPOD.nic_bandwidth
    assert packed.step_time_s == pytest.approx(sp_run.modeled.step_time_s, rel=1e-12)  # the default placement
    assert spread.step_time_s > 2 * packed.step_time_s
    assert spread.summary()["compute_s"] == pytest.approx(packed.summary()["compute_s"], rel=1e-12)
    assert {t.slowest_link for t in packed.collectives} == {SUPERPOD.nvlink_bandwidth}
    assert {t.slowest_link for t in spread.collectives} == {SUPERPOD.nic_bandwidth}
    assert spread.algorithms == packed.algorithms  # the same algorithms: the links, not the choice, cost the time
    for a, b in zip(packed.collectives, spread.collectives, strict=True):
        assert b.time_s > a.time_s and a.op == b.op


def test_a_forced_algorithm_runs_where_it_can_and_is_named_where_it_cannot(sp_run):
    programs, records = sp_run.result.programs, sp_run.result.comm
    ring = replay(programs, records, "h100", topology=SUPERPOD, algorithm="ring")
    assert {op: set(used) for op, used in ring.algorithms.items()} == {op: {"ring"} for op in ring.algorithms}
    assert all(t.why.startswith("forced") for t in ring.collectives)
    with pytest.raises(ValueError, match="the hierarchical algorithm can run none of this run's collectives"):
        replay(programs, records, "h100", topology=SUPERPOD, algorithm="hierarchical")


def _one(op, ranks, tensor_bytes, sent_bytes, peer=None):
    return CommRecord(
        op, "g", len(ranks), tuple(ranks), int(tensor_bytes), float(sent_bytes), 0.0, 0.0, peer=peer, tags={"step": 0}
    )


def _alone(records_per_rank, topo, gpus=None):
    programs = [[Issue(0), Wait(0)] for _ in records_per_rank]
    return replay(programs, records_per_rank, "h100", topology=topo, gpus=gpus)


S, N = 6e6, 4


@pytest.mark.parametrize(
    "op,sent",
    [
        ("all_reduce", 2 * (N - 1) / N * S),  # S: the tensor reduced
        ("reduce_scatter", (N - 1) / N * S),  # S: the full input
        ("all_gather", (N - 1) / N * S),  # S: the full output
        ("all_to_all", (N - 1) / N * S),  # S: the input, a 1/n share to each rank
        ("broadcast", S),
    ],
)
@pytest.mark.parametrize("topo,gpus", [(SUPERPOD, [0, 1, 8, 9]), (CUBE, [CUBE.gpu((x, 1, 2)) for x in range(4)])])
def test_the_ledgers_bytes_are_the_buffer_choose_times(op, sent, topo, gpus):
    run = _alone([[_one(op, range(N), S, sent)] for _ in range(N)], topo, gpus)
    (timed,) = run.collectives
    expected = collectives.choose(topo, op, gpus, S)
    assert (timed.nbytes, timed.algorithm, timed.gpus) == (S, expected.algorithm, tuple(gpus))
    assert run.step_time_s == pytest.approx(expected.time_s, rel=1e-12)


def test_an_uneven_all_to_all_is_timed_by_its_busiest_sender():
    sent = [(r + 1) * 1e6 for r in range(N)]
    run = _alone([[_one("all_to_all", range(N), 9e6, sent[r])] for r in range(N)], SUPERPOD, [0, 8, 16, 24])
    busiest = max(sent) * N / (N - 1)  # the even buffer that sends as many bytes to the others
    assert run.step_time_s == pytest.approx(collectives.all_to_all(SUPERPOD, [0, 8, 16, 24], busiest), rel=1e-12)


def test_a_message_pays_its_route_and_a_barrier_is_an_empty_all_reduce():
    a, b = CUBE.gpu((0, 0, 0)), CUBE.gpu((2, 1, 0))  # three hops
    send = [[_one("recv", range(2), S, 0, peer=1)], [_one("send", range(2), S, S, peer=0)]]  # rank 1 sends
    assert _alone(send, CUBE, [a, b]).step_time_s == pytest.approx(
        3 * CUBE.hop_latency + S / CUBE.link_bandwidth, rel=1e-12
    )
    barrier = _alone([[_one("barrier", range(N), 0, 0)] for _ in range(N)], SUPERPOD)
    assert barrier.algorithms == {"all_reduce": {"tree": 1}}
    assert barrier.step_time_s == pytest.approx(collectives.tree(SUPERPOD, range(N), 0.0), rel=1e-12)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"topology": "tpu-v5p:2x1x1"}, "4 ranks do not fit tpu-v5p 2x1x1, which has 2 GPUs"),
        ({"topology": "nope"}, "unknown topology 'nope'"),
        ({"topology": "h100-superpod:two"}, "bad size 'two' in topology 'h100-superpod:two'"),
        ({"topology": SUPERPOD, "gpus": [0, 1, 2]}, "gpus places 3 ranks, not the run's 4"),
        ({"topology": SUPERPOD, "gpus": [0, 1, 1, 2]}, "lists a rank twice"),
        ({"topology": SUPERPOD, "gpus": [0, 1, 2, 99]}, r"ranks \[99\] do not fit"),
        ({"topology": SUPERPOD, "algorithm": "bogus"}, "unknown algorithm 'bogus'"),
        ({"topology": SUPERPOD, "gpus_per_node": 2}, "drop gpus_per_node"),
        ({"topology": SUPERPOD, "algorithm": "torus"}, "the torus algorithm runs on a Torus"),
        ({"topology": CUBE, "algorithm": "hierarchical"}, "the hierarchical algorithm runs on a FatTree"),
        ({"gpus": [0, 1, 2, 3]}, "give a topology too"),
    ],
)
def test_bad_settings_are_one_line_before_replaying(kwargs, message):
    programs = [[Issue(0), Wait(0)] for _ in range(N)]
    records = [[_one("all_to_all", range(N), S, S * 3 / 4)] for _ in range(N)]
    with pytest.raises(ValueError, match=message) as err:
        replay(programs, records, "h100", **kwargs)
    assert "\n" not in str(err.value)


def test_the_command_line_passes_the_topology_through_and_prints_the_algorithms(sp_run, monkeypatch, capsys):
    from course_lib import cli, harness

    given = {}

    def recorded(*args, **kwargs):
        given.update(kwargs)
        return sp_run

    monkeypatch.setattr(harness, "run_scheme", recorded)
    argv = ["run", "sp", "--steps", "1", "--hardware", "h100", "--topology", "h100-superpod", "--algorithm", "ring"]
    assert cli.main([*argv, "--placement", "tp"]) == 0
    assert (given["hardware"], given["topology"], given["algorithm"]) == ("h100", "h100-superpod", "ring")
    assert given["placement"] == "tp"
    out = capsys.readouterr().out
    assert "    world groups: inside one NVLink domain of 8 GPUs; slowest link 450 GB/s, up to 2 hops" in out
    assert "modeled on h100's compute, h100-superpod x4's links, last step:" in out
    for op, used in sp_run.modeled.algorithms.items():
        assert f"    {op}: " + ", ".join(f"{a} x{n}" for a, n in used.items()) in out
