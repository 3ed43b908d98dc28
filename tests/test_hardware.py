"""The modeled clock: the replay against closed forms on hand-written programs, then on real recorded runs."""

import pytest

from course_lib.cluster.clock import collective_time, replay
from course_lib.cluster.profiles import PROFILES
from course_lib.ledgers.comm import CommRecord
from course_lib.ledgers.trace import Compute, Issue, Wait
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TinyGPT, synthetic_tokens
from course_lib.parallel.data import train_data_parallel
from course_lib.runtime import launch

H100 = PROFILES["h100"]
RATE = H100.peak_flops["bf16"] * 0.5  # replay's default efficiency


def record(op, ranks, sent, step=0):
    return CommRecord(op, "world", len(ranks), tuple(ranks), int(sent), float(sent), 0.0, 0.0, tags={"step": step})


def compute(flops, kind="forward", step=0):
    return Compute(kind, 0.0, 0.0, flops=flops, tags={"step": step})


def test_a_collective_alone_takes_its_closed_form_ring_time():
    n, S = 4, 8e6
    sent = 2 * (n - 1) / n * S
    programs = [[Issue(0), Wait(0)] for _ in range(n)]
    records = [[record("all_reduce", range(n), sent)] for _ in range(n)]
    run = replay(programs, records, "h100")
    expected = sent / H100.intra_bandwidth + 2 * (n - 1) * H100.intra_latency_s
    assert run.step_time_s == pytest.approx(expected, rel=1e-12)
    assert all(r.comm_s == pytest.approx(expected, rel=1e-12) for r in run.ranks)
    assert all(r.exposed_comm_s == pytest.approx(expected, rel=1e-12) and r.idle_s == 0 for r in run.ranks)


def test_the_rank_that_computes_less_waits_exactly_the_difference():
    flops = [1e9, 3e9]
    programs = [[compute(f), Issue(0), Wait(0)] for f in flops]
    records = [[record("all_reduce", range(2), 1e6)] for _ in flops]
    run = replay(programs, records, "h100")
    assert run.ranks[0].idle_s == pytest.approx((flops[1] - flops[0]) / RATE, rel=1e-12)
    assert run.ranks[1].idle_s == 0.0
    assert run.ranks[0].compute_s == pytest.approx(flops[0] / RATE, rel=1e-12)
    assert run.ranks[0].bubble_fraction == pytest.approx(run.ranks[0].idle_s / run.ranks[0].step_time_s)


@pytest.mark.parametrize("hardware", sorted(PROFILES))
def test_a_group_that_spans_nodes_pays_the_inter_node_rate(hardware):
    profile = PROFILES[hardware]
    n, sent = 4, 6e6
    programs = [[Issue(0), Wait(0)] for _ in range(n)]
    records = [[record("all_reduce", range(n), sent)] for _ in range(n)]
    inside = replay(programs, records, hardware, gpus_per_node=4).step_time_s
    across = replay(programs, records, hardware, gpus_per_node=2).step_time_s
    assert inside == pytest.approx(
        collective_time("all_reduce", sent, n, profile.intra_bandwidth, profile.intra_latency_s), rel=1e-12
    )
    assert across == pytest.approx(
        collective_time("all_reduce", sent, n, profile.inter_bandwidth, profile.inter_latency_s), rel=1e-12
    )
    # The bandwidth term alone grows by exactly the ratio of the two links.
    latency = 2 * (n - 1)
    ratio = (across - latency * profile.inter_latency_s) / (inside - latency * profile.intra_latency_s)
    assert ratio == pytest.approx(profile.intra_bandwidth / profile.inter_bandwidth, rel=1e-9)


@pytest.mark.parametrize("compute_flops", [1e9, 1e11])
def test_an_async_all_reduce_hides_behind_the_compute_issued_after_it(compute_flops):
    n, sent = 2, 40e6
    comm_time = collective_time("all_reduce", sent, n, H100.intra_bandwidth, H100.intra_latency_s)
    work = compute_flops / RATE
    overlapped = [[Issue(0), compute(compute_flops, "backward"), Wait(0)] for _ in range(n)]
    serial = [[compute(compute_flops, "backward"), Issue(0), Wait(0)] for _ in range(n)]
    records = [[record("all_reduce", range(n), sent)] for _ in range(n)]
    a, b = replay(overlapped, records, "h100"), replay(serial, records, "h100")
    assert a.ranks[0].exposed_comm_s == pytest.approx(max(0.0, comm_time - work), rel=1e-9, abs=1e-15)
    assert a.step_time_s == pytest.approx(max(comm_time, work), rel=1e-12)
    assert b.ranks[0].exposed_comm_s == pytest.approx(comm_time, rel=1e-12)
    assert b.step_time_s == pytest.approx(comm_time + work, rel=1e-12)


def test_point_to_point_waits_for_the_send():
    sent = 1e6
    programs = [[compute(2e9), Issue(0), Wait(0)], [Issue(0), Wait(0)]]
    records = [[record("send", (0, 1), sent)], [record("recv", (0, 1), 0)]]
    records[0][0].peer, records[1][0].peer = 1, 0
    run = replay(programs, records, "h100")
    transfer = sent / H100.intra_bandwidth + H100.intra_latency_s
    assert run.ranks[1].idle_s == pytest.approx(2e9 / RATE, rel=1e-12)
    assert run.step_time_s == pytest.approx(2e9 / RATE + transfer, rel=1e-12)


def test_a_collective_one_rank_never_issues_is_a_named_deadlock():
    programs = [[Issue(0), Wait(0)], []]
    records = [[record("all_reduce", range(2), 8)], []]
    with pytest.raises(RuntimeError, match="rank 0 waits for all_reduce on world"):
        replay(programs, records, "h100")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        replay([], [], "tpu")
    with pytest.raises(ValueError, match="efficiency must be in"):
        replay([], [], "h100", efficiency=2)


def forward_flops(cfg):
    """Count one forward's matrix-product FLOPs on this rank (the FLOP counter is on via count_flops)."""
    from course_lib.ledgers import trace

    model = TinyGPT(cfg)
    tokens, targets = synthetic_tokens(0, 2, cfg)
    with trace.span("forward"):
        model.loss(tokens, targets)
    segments = [e for e in trace.program() if isinstance(e, Compute) and e.kind == "forward"]
    span = next(e for e in trace.events() if e.kind == "forward")
    return sum(e.flops for e in segments), sum(e.flops + e.elementwise for e in segments), span.tags["flops"]


def test_counted_flops_are_the_matmul_shapes():
    cfg = GPTConfig()
    counted, with_elementwise, on_the_event = launch.run(forward_flops, 1, cfg, count_flops=True)[0]
    assert on_the_event == with_elementwise > counted, "the timeline's forward event carries its FLOPs"
    b, s, h, a, v, L = 2, cfg.seq, cfg.d_model, cfg.heads, cfg.vocab, cfg.layers
    linears = 2 * b * s * (h * 3 * h + h * h + h * 4 * h + 4 * h * h)  # qkv, proj, fc1, fc2
    attention = 2 * 2 * b * a * s * s * (h // a)  # q k^T and (scores) v
    head = 2 * b * s * h * v
    assert counted == L * (linears + attention) + head


def test_a_recorded_data_parallel_run_replays_and_overlap_hides_comm():
    cfg, train = GPTConfig(layers=2, d_model=128, seq=64), TrainConfig(steps=2, batch=8)
    runs = {
        overlap: launch.run(train_data_parallel, 2, cfg, train, overlap=overlap, count_flops=True)
        for overlap in (False, True)
    }
    after, during = (replay(runs[o].programs, runs[o].comm, "h100") for o in (False, True))
    assert after.step == during.step == 1
    assert during.summary()["exposed_comm_s"] < after.summary()["exposed_comm_s"]
    assert during.step_time_s < after.step_time_s
    same = {k: v for k, v in after.summary().items() if k in ("compute_s", "comm_s")}
    assert during.summary()["compute_s"] == pytest.approx(same["compute_s"], rel=1e-9)
    assert during.summary()["comm_s"] == pytest.approx(same["comm_s"], rel=1e-9)


def test_an_all_to_all_across_nodes_takes_3_2x_longer_on_h800s():
    """DeepSeek-V3 §3.2.2: NVLink 160 GB/s against InfiniBand 50 GB/s. The same recorded all-to-all, uneven as
    routing makes it (rank r sends (r + 1) x 10 MB to the others), on one node and spread over two."""
    h800, n = PROFILES["h800"], 8
    sent = [(r + 1) * 10e6 for r in range(n)]
    programs = [[Issue(0), Wait(0)] for _ in range(n)]
    records = [[record("all_to_all", range(n), sent[r])] for r in range(n)]
    inside = replay(programs, records, "h800", gpus_per_node=8).step_time_s
    across = replay(programs, records, "h800", gpus_per_node=4).step_time_s
    # The busiest sender bounds it; n-1 peers, one latency each; the slowest link of the group.
    assert inside == pytest.approx(80e6 / 160e9 + 7 * 2e-6, rel=1e-12)
    assert across == pytest.approx(80e6 / 50e9 + 7 * 5e-6, rel=1e-12)
    assert collective_time("all_to_all", 80e6, n, h800.inter_bandwidth, h800.inter_latency_s) == across
    assert across / inside == pytest.approx(3.2, rel=0.01)
