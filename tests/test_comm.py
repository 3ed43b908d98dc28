"""The comm ledger: each collective computes the right thing and records the ring bytes NCCL would count."""

import pytest
import torch
import torch.distributed as dist

from course_lib.ledgers import comm, trace
from course_lib.runtime import launch

ELEMS = 12  # divisible by 2 and 4, so every op splits evenly


def every_collective():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    with trace.tags(step=0):
        t = torch.full((ELEMS,), float(r + 1))
        comm.all_reduce(t)
        out["all_reduce"] = t.tolist()

        full = torch.arange(ELEMS, dtype=torch.float32) * (r + 1)
        shard = torch.empty(ELEMS // n)
        comm.reduce_scatter(shard, full)
        out["reduce_scatter"] = shard.tolist()

    with trace.tags(step=1):
        gathered = torch.empty(ELEMS)
        comm.all_gather(gathered, torch.full((ELEMS // n,), float(r)))
        out["all_gather"] = gathered.tolist()

        b = torch.full((ELEMS,), float(r))
        comm.broadcast(b, src=n - 1)
        out["broadcast"] = b.tolist()

        send = torch.arange(ELEMS, dtype=torch.float32) + 100 * r
        recv = torch.empty(ELEMS)
        comm.all_to_all(recv, send)
        out["all_to_all"] = recv.tolist()

        msg = torch.full((5,), float(r))
        if r == 0:
            comm.send(msg, 1)
        elif r == 1:
            comm.recv(msg, 0)
        out["p2p"] = msg.tolist()

        reply = torch.full((5,), float(r))
        if r == 0:
            comm.irecv(reply, 1).wait()
        elif r == 1:
            comm.isend(reply, 0).wait()
        out["async_p2p"] = reply.tolist()

        ones = torch.ones(ELEMS)
        h = comm.all_reduce(ones, async_op=True)
        h.wait()
        h.wait()  # a second wait is harmless
        out["async_all_reduce"] = ones.tolist()
    return out


@pytest.mark.parametrize(("n", "through_host"), [(2, False), (4, False), (4, True)])
def test_every_collective_computes_and_records_ring_bytes(n, through_host):
    """Also with every tensor sent through host copies (comm.THROUGH_HOST), the path CUDA tensors take over gloo:
    the same results, the same bytes, and every record saying so."""
    fn = (
        launch.with_setting(every_collective, "course_lib.ledgers.comm", "THROUGH_HOST", True)
        if through_host
        else every_collective
    )
    result = launch.run(fn, n)
    S = ELEMS * 4
    chunk = ELEMS // n
    for r, (out, recs) in enumerate(zip(result, result.comm, strict=True)):
        assert out["all_reduce"] == [n * (n + 1) / 2] * ELEMS
        total = [i * n * (n + 1) / 2 for i in range(ELEMS)]
        assert out["reduce_scatter"] == total[r * chunk : (r + 1) * chunk]
        assert out["all_gather"] == [float(src) for src in range(n) for _ in range(chunk)]
        assert out["broadcast"] == [float(n - 1)] * ELEMS
        assert out["all_to_all"] == [float(r * chunk + i + 100 * src) for src in range(n) for i in range(chunk)]
        if r == 1:
            assert out["p2p"] == [0.0] * 5
        if r == 0:
            assert out["async_p2p"] == [1.0] * 5
        assert out["async_all_reduce"] == [float(n)] * ELEMS
        assert all(rec.through_host == through_host for rec in recs)

        sent = {(rec.op, rec.async_op): rec.sent_bytes for rec in recs}
        assert sent[("all_reduce", False)] == 2 * (n - 1) / n * S
        assert sent[("reduce_scatter", False)] == (n - 1) / n * S
        assert sent[("all_gather", False)] == (n - 1) / n * S
        assert sent[("broadcast", False)] == S
        assert sent[("all_to_all", False)] == (n - 1) / n * S
        assert sent[("all_reduce", True)] == 2 * (n - 1) / n * S
        if r == 0:
            assert sent[("send", False)] == 5 * 4
        if r == 1:
            assert sent[("recv", False)] == 0
        assert all(rec.group == "world" and rec.group_size == n for rec in recs)
        assert all(rec.end >= rec.start for rec in recs)

        by_step = comm.summarize(recs, by="step")
        assert by_step[0] == {"calls": 2, "bytes": 2 * (n - 1) / n * S + (n - 1) / n * S, "tensor_bytes": 2 * S}
        assert comm.summarize(recs)["all_reduce"]["calls"] == 2
        comm_events = [e for e in result.events[r] if e.kind == "comm"]
        assert len(comm_events) == len(recs), "every call lands on the timeline"


def subgroups():
    r = dist.get_rank()
    evens = comm.new_group([0, 2], "even")
    odds = comm.new_group([1, 3], "odd")
    mine = evens if r % 2 == 0 else odds
    t = torch.tensor([float(r)])
    comm.all_reduce(t, group=mine)
    uneven_in = torch.arange(r + 3, dtype=torch.float32)  # rank r sends r+3 rows in total
    splits_in = [1] * 3 + [r]  # one row to ranks 0..2, r rows to rank 3
    splits_out = [splits_in_of(src)[r] for src in range(4)]
    recv = torch.empty(sum(splits_out))
    comm.all_to_all(recv, uneven_in, splits_out, splits_in)
    return t.item(), comm.records()


def splits_in_of(src):
    return [1] * 3 + [src]


def test_sub_groups_are_named_and_uneven_all_to_all_counts_rows_sent():
    result = launch.run(subgroups, 4)
    assert [v for v, _ in result] == [2.0, 4.0, 2.0, 4.0]
    for r, (_, recs) in enumerate(result):
        assert recs[0].group == ("even" if r % 2 == 0 else "odd") and recs[0].group_size == 2
        assert recs[0].sent_bytes == 2 * 1 / 2 * 4
        rows = r + 3
        kept = splits_in_of(r)[r]
        assert recs[1].sent_bytes == (rows - kept) * 4


def test_unknown_op_has_no_ring_factor():
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_factor("all_reduce_twice", 4)
