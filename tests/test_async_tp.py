"""Async TP: sequence parallelism's all-gathers and reduce-scatters beside the linears taken apart into ring steps
that overlap the matmuls. Equal to one device and to plain SP, its ring messages on the ledger exactly as predicted
(the ring collectives' bytes), every message in flight during a matmul, and less exposed communication on the
modeled clock."""

from collections import Counter

import pytest
import torch

from course_lib.harness import run_scheme
from course_lib.ledgers.comm import CommRecord
from course_lib.ledgers.memory import CATEGORIES
from course_lib.ledgers.trace import Compute, Issue, Wait
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.tensor import async_tp_messages, collectives_per_step, sequence_parallel_grad_bytes
from course_lib.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear

CFG = GPTConfig(frozen_pos=False)  # a trained position embedding: its gradient is summed over the shards too
FLOAT64 = TrainConfig(steps=2, dtype="float64")


@pytest.fixture(scope="module")
def on_two():
    """SP on 2 ranks in float64, with and without async TP, their FLOPs counted (the programs' compute)."""
    return {
        name: run_scheme("sp", 2, CFG, FLOAT64, hardware="h100", async_tp=name == "async")
        for name in ("async", "plain")
    }


def assert_ledger_and_memory_as_predicted(run) -> None:
    for rank, predicted in zip(run.report["ranks"], run.predicted_memory, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == run.predicted_comm[rank["rank"]]
        assert all(rank["memory"][c] == predicted[c] for c in CATEGORIES)
        assert rank["memory"]["activations_peak"] == predicted["activations"]


def test_async_tp_trains_as_one_device_and_as_plain_sp(on_two):
    run, plain = on_two["async"], on_two["plain"]
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    assert max(abs(a - b) for a, b in zip(run.report["losses"], plain.report["losses"], strict=True)) <= 1e-10
    mine, theirs = run.result[0]["params"], plain.result[0]["params"]
    assert max((mine[name] - theirs[name]).abs().max().item() for name in theirs) <= 1e-10
    assert_ledger_and_memory_as_predicted(run)


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])  # float64: 1e-10
def test_async_tp_on_four_ranks(dtype):
    run = run_scheme("sp", 4, CFG, TrainConfig(steps=2, dtype=dtype), async_tp=True)
    if dtype == "float64":
        assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    else:
        assert run.report["max_abs_loss_diff"] <= 1e-5 and run.report["rel_param_diff"] <= 1e-5
    assert_ledger_and_memory_as_predicted(run)


def test_each_collective_beside_a_linear_becomes_t_minus_1_ring_messages_of_the_same_bytes(on_two):
    run, plain, t, e = on_two["async"], on_two["plain"], 2, 8
    records = [r for r in run.result.comm[0] if r.tags.get("step") == 0]
    seen = Counter((r.tags.get("layer"), r.tags.get("direction"), r.op, r.tensor_bytes) for r in records)
    sp_sum = [(None, None, "all_reduce", sequence_parallel_grad_bytes(CFG, e, CFG.layers))]
    assert seen == Counter(async_tp_messages(collectives_per_step(CFG, 8, e, sp=True), t) + sp_sum)
    # Per layer: the 4 collectives forward and 6 backward are (t-1) sends of one chunk each, S/t; nothing else.
    S = e * 8 * CFG.seq * CFG.d_model
    layer0 = Counter(
        (r.tags["direction"], r.op, r.tensor_bytes, r.async_op) for r in records if r.tags.get("layer") == 0
    )
    assert layer0 == {
        ("forward", "send", S // t, True): 4 * (t - 1),
        ("forward", "recv", S // t, True): 4 * (t - 1),
        ("backward", "send", S // t, True): 6 * (t - 1),
        ("backward", "recv", S // t, True): 6 * (t - 1),
    }
    # The same bytes as plain SP's ring all-gathers and reduce-scatters, in every step, on every rank.
    for mine, theirs in zip(run.report["ranks"], plain.report["ranks"], strict=True):
        assert sum(c["bytes"] for c in mine["comm"].values()) == sum(c["bytes"] for c in theirs["comm"].values())


def matmul_between_issue_and_wait(program: list, records: list[CommRecord]) -> list[bool]:
    """For every ring message of a layer: whether the rank ran a matmul between issuing it and waiting for it."""
    issued_at, out = {}, []
    for i, entry in enumerate(program):
        if isinstance(entry, Issue):
            issued_at[entry.record] = i
        elif isinstance(entry, Wait) and isinstance(records[entry.record].tags.get("layer"), int):
            between = program[issued_at[entry.record] : i]
            out.append(any(isinstance(c, Compute) and c.flops > 0 for c in between))
    return out


def test_every_ring_message_of_a_layer_travels_during_a_matmul(on_two):
    run = on_two["async"]
    for program, records in zip(run.result.programs, run.result.comm, strict=True):
        overlapped = matmul_between_issue_and_wait(program, records)
        assert len(overlapped) == 2 * 10 * CFG.layers * FLOAT64.steps and all(overlapped)
    # Plain SP blocks in every collective: nothing runs between its issue and its wait.
    plain = on_two["plain"]
    assert not any(matmul_between_issue_and_wait(plain.result.programs[0], plain.result.comm[0]))


def test_the_modeled_clock_hides_part_of_the_communication():
    wide, train = GPTConfig(layers=1, d_model=512, seq=128), TrainConfig(steps=1, batch=8)
    modeled = {
        name: run_scheme("sp", 2, wide, train, hardware="h100", async_tp=name == "async").report["modeled"]
        for name in ("async", "plain")
    }
    assert modeled["async"]["exposed_comm_s"] < 0.9 * modeled["plain"]["exposed_comm_s"]
    assert modeled["async"]["step_time_s"] < modeled["plain"]["step_time_s"]
    assert modeled["async"]["compute_s"] == pytest.approx(modeled["plain"]["compute_s"], rel=1e-2)


def test_async_tp_needs_sequence_parallelism():
    for layer in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(ValueError, match="async TP overlaps sequence parallelism's all-gathers"):
            layer(torch.ones(4, 4), None, async_tp=True)
    with pytest.raises(ValueError, match="scheme 'tp' takes no option\\(s\\) \\['async_tp'\\]"):
        run_scheme("tp", 2, async_tp=True)
    with pytest.raises(ValueError, match="does not divide the sequence length \\(sequence parallel\\) = 30"):
        run_scheme("sp", 4, GPTConfig(seq=30), async_tp=True)
