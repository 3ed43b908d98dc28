"""PyTorch's own DDP, FSDP2 (``fully_shard``), tensor parallelism (``parallelize_module``, with and without
sequence parallelism) and pipelining (``torch.distributed.pipelining``) train the tiny GPT (tied and frozen
parameters) as the single-device reference does, and as our DP, ZeRO-3, TP/SP and pipeline do; PyTorch's
differentiable all-to-all carries our expert parallelism's tokens to the same result; its context parallelism
shards a sequence as ours does, and (on two or more GPUs) trains as ours: the bridge from the course to
production."""

import functools

import pytest
import torch

from course_lib.harness import run_scheme
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TrainResult, rel_param_diff, train_reference
from course_lib.parallel.context import local_positions
from course_lib.parallel.pipeline import train_pipeline
from course_lib.parallel.production import (
    TORCH_ALL_TO_ALL,
    torch_head_tail_positions,
    train_ddp,
    train_dtensor_tp,
    train_fsdp2,
    train_torch_context_parallel,
    train_torch_pipelining,
)
from course_lib.parallel.tensor import train_tensor_parallel
from course_lib.runtime import launch

TRAIN = TrainConfig(steps=3)
# (PyTorch's rank function, its options, our scheme that does the same, that scheme's options)
VARIANTS = [
    (train_ddp, {}, "dp", {}),
    (train_fsdp2, {}, "zero3", {}),
    (train_fsdp2, {"reshard_after_forward": False}, "zero3", {"reshard_after_forward": False}),
]
IDS = ["ddp-vs-dp", "fsdp2-vs-zero3", "fsdp2-vs-zero3-no-reshard"]


@functools.cache
def reference() -> TrainResult:
    return train_reference(GPTConfig(), TRAIN)


# Each comparison once in the default set, on 4 ranks, but the no-reshard one on 2 (the same code on either); the
# other world size of each is in the slow set.
DEFAULT_N = {"ddp-vs-dp": 4, "fsdp2-vs-zero3": 4, "fsdp2-vs-zero3-no-reshard": 2}


@pytest.mark.parametrize(
    ("fn", "options", "scheme", "scheme_options", "n"),
    [
        pytest.param(*variant, n, id=f"{name}-{n}", marks=[pytest.mark.slow] * (n != DEFAULT_N[name]))
        for n in (2, 4)
        for variant, name in zip(VARIANTS, IDS, strict=True)
    ],
)
def test_pytorch_matches_one_device_and_our_scheme(fn, options, scheme, scheme_options, n):
    result = launch.run(fn, n, GPTConfig(), TRAIN, **options)
    losses = [sum(step) / n for step in zip(*(r["losses"] for r in result), strict=True)]
    ours = run_scheme(scheme, n, train=TRAIN, **scheme_options).report["losses"]
    for mine, theirs, single in zip(ours, losses, reference().losses, strict=True):
        assert abs(theirs - single) <= 1e-5
        assert abs(theirs - mine) <= 1e-5
    for r in result:
        assert rel_param_diff(r["params"], reference().params) <= 1e-5


@functools.cache
def our_tensor_parallel_losses(n: int, sp: bool) -> list[float]:
    """Our TP (or TP + SP) on n ranks, shared by the DTensor options that compare with it."""
    return launch.run(train_tensor_parallel, n, GPTConfig(), TRAIN, sp=sp)[0]["losses"]


# Default set: TP on 2 ranks, both SP options on 4 (they compare with the same run of ours); the rest is slow.
DTENSOR_DEFAULT_N = {"tp": 2, "tp-sp": 4, "tp-sp-reduce-grads": 2}


@pytest.mark.parametrize(
    ("n", "options"),
    [
        pytest.param(n, options, id=f"{n}-{name}", marks=[pytest.mark.slow] * (n != DTENSOR_DEFAULT_N[name]))
        for n in (2, 4)
        for options, name in (
            ({}, "tp"),
            ({"sp": True}, "tp-sp"),
            ({"sp": True, "reduce_grads": True}, "tp-sp-reduce-grads"),
        )
    ],
)
def test_dtensor_tensor_parallel_matches_one_device_and_ours(n, options):
    result = launch.run(train_dtensor_tp, n, GPTConfig(), TRAIN, **options)
    ours = our_tensor_parallel_losses(n, options.get("sp", False))
    for r in result:  # every rank sees the whole batch, so every rank has the loss
        for theirs, mine, single in zip(r["losses"], ours, reference().losses, strict=True):
            assert abs(theirs - single) <= 1e-5
            assert abs(theirs - mine) <= 1e-5
        assert rel_param_diff(r["params"], reference().params) <= 1e-5


PIPELINE_CFG, PIPELINE_TRAIN = GPTConfig(layers=4), TrainConfig(steps=2)  # 4 layers: a layer for every stage


@functools.cache
def pipeline_reference() -> TrainResult:
    return train_reference(PIPELINE_CFG, PIPELINE_TRAIN)


@pytest.mark.parametrize(
    ("n", "schedule", "chunks"),
    [
        pytest.param(2, "gpipe", 1, id="gpipe-2", marks=pytest.mark.slow),  # each schedule once on 2 or 4 ranks
        pytest.param(4, "gpipe", 1, id="gpipe-4"),
        pytest.param(2, "1f1b", 1, id="1f1b-2"),
        pytest.param(4, "1f1b", 1, id="1f1b-4", marks=pytest.mark.slow),
        pytest.param(2, "interleaved", 2, id="interleaved-2x2"),
    ],
)
def test_torch_pipelining_matches_one_device_and_ours(n, schedule, chunks):
    options = {"schedule": schedule, "microbatches": 4, "chunks": chunks}
    result = launch.run(train_torch_pipelining, n, PIPELINE_CFG, PIPELINE_TRAIN, **options)
    ours = launch.run(train_pipeline, n, PIPELINE_CFG, PIPELINE_TRAIN, measure_memory=False, **options)
    assert [r["losses"] is not None for r in result] == [r == n - 1 for r in range(n)]  # the last stage's rank
    for theirs, mine, single in zip(result[-1]["losses"], ours[-1]["losses"], pipeline_reference().losses, strict=True):
        assert abs(theirs - single) <= 1e-5
        assert abs(theirs - mine) <= 1e-5
    params = {name: p for r in result for name, p in r["params"].items()}  # the union of the stages
    assert rel_param_diff(params, pipeline_reference().params) <= 1e-5
    assert not any(result.comm)  # PyTorch's transfers bypass our ledger
    forwards = [e for e in result.events[0] if e.kind == "forward" and e.tags.get("step") == 0]
    assert len(forwards) == 4 * chunks  # one span per microbatch and chunk, tagged for the benchmarks


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])  # 4 ranks: 2 experts each
def test_pytorchs_all_to_all_carries_our_expert_parallelism_to_the_same_result(n):
    cfg, train = GPTConfig(experts=8, top_k=2, capacity_factor=1.0), TrainConfig(steps=2, dtype="float64")
    theirs = run_scheme("ep", n, cfg, train, patch=TORCH_ALL_TO_ALL)
    ours = run_scheme("ep", n, cfg, train)
    assert theirs.report["losses"] == ours.report["losses"]
    assert theirs.report["max_abs_param_diff"] == ours.report["max_abs_param_diff"] <= 1e-12
    for mine, patched in zip(ours.report["ranks"], theirs.report["ranks"], strict=True):
        assert mine["comm"]["all_to_all"]["bytes"] > 0
        assert "all_to_all" not in patched["comm"]  # PyTorch's collective bypassed our ledger: the patch took


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_pytorchs_context_parallel_shards_a_sequence_as_ours(n):
    theirs = launch.run(torch_head_tail_positions, n, 32)
    assert [t.tolist() for t in theirs] == [local_positions(32, rank, n).tolist() for rank in range(n)]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="PyTorch's context_parallel runs only on its CUDA attention kernels (flash, efficient, cuDNN); it needs "
    "two or more GPUs, and this machine has " + str(torch.cuda.device_count()),
)
def test_pytorchs_context_parallel_trains_as_ours_and_one_device():
    cfg, train = GPTConfig(), TrainConfig(steps=2)
    result = launch.run(train_torch_context_parallel, 2, cfg, train, backend="nccl")
    ours = run_scheme("cp", 2, cfg, train, backend="nccl").report
    single = train_reference(cfg, train)
    for theirs, mine, one in zip(result[0]["losses"], ours["losses"], single.losses, strict=True):
        assert abs(theirs - one) <= 1e-5 * one and abs(theirs - mine) <= 1e-5 * one
    assert rel_param_diff(result[0]["params"], single.params) <= 1e-4
