"""DataParallel around a student's own model, tested as an outside assignment would (CS336-style): a toy model with
frozen and tied parameters, every rank seeded differently before it builds the model, and after every step the
parameters compared with training the same model on one process on the whole batch. Used as PyTorch's DDP is
(``loss.backward(); opt.step()``, nothing more), and with ``finish_gradient_synchronization()`` called as well, which
must change nothing and send nothing."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from toy_model import ToyModel, batches, make_optimizer, one_process  # tests/ is on sys.path

from course_lib.ledgers import trace
from course_lib.parallel.data import DataParallel, batch_shard
from course_lib.runtime import launch


def data_parallel_run(optimizer: str, steps: int, ddp_kwargs: dict, accumulate: int = 1, finish_calls: int = 0):
    """Rank function: seeded by rank, wrapped, trained on this rank's rows (``finish_calls`` calls of
    finish_gradient_synchronization after the last backward of a step; 0: as with PyTorch's DDP); the parameters
    after every step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0 if rank == 0 else 100 + rank)  # the wrapper must broadcast rank 0's weights
    model = DataParallel(ToyModel().double(), **ddp_kwargs)
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    history = []
    for x, y in batches(steps):
        xs, ys = batch_shard(x, rank, n).chunk(accumulate), batch_shard(y, rank, n).chunk(accumulate)
        for k, (xk, yk) in enumerate(zip(xs, ys, strict=True)):
            with model.no_sync() if k < accumulate - 1 else torch.enable_grad():
                (model(xk, yk) / accumulate).backward()
        for _ in range(finish_calls):
            model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in model.module.state_dict().items()})
    return history, len(model.buckets)


STEPS = 3
# id: (ranks, optimizer, wrapper options, micro-batches, buckets, calls of finish_gradient_synchronization per step)
VARIANTS = {
    "one-bucket-2": (2, "sgd", {"bucket_mb": None}, 1, 1, 0),  # one unbounded bucket
    "one-bucket-2-finish-twice": (2, "sgd", {"bucket_mb": None}, 1, 1, 2),
    "buckets-3": (3, "adamw", {"bucket_mb": 0.002}, 1, "several", 0),  # 2 kB: several buckets
    "buckets-3-finish": (3, "adamw", {"bucket_mb": 0.002}, 1, "several", 1),
    "per-parameter-4": (4, "adamw", {"per_parameter": True}, 2, 4, 0),  # one per trainable tensor, accumulating
    "per-parameter-4-finish-twice": (4, "adamw", {"per_parameter": True}, 2, 4, 2),
    "after-backward-2": (2, "adamw", {"bucket_mb": 0.002, "overlap": False}, 1, "several", 0),
    "after-backward-2-accumulate-finish": (2, "adamw", {"bucket_mb": 0.002, "overlap": False}, 2, "several", 1),
}


def world_checks() -> dict:
    """The variants of this world size in one launch, each under its own tag (and, on 2 ranks, ours against
    PyTorch's DDP and the branchy model with find_unused_parameters)."""
    n = dist.get_world_size()
    out = {}
    for name, (size, optimizer, ddp_kwargs, accumulate, _, finish_calls) in VARIANTS.items():
        if size == n:
            with trace.tags(variant=name):
                out[name] = data_parallel_run(optimizer, STEPS, ddp_kwargs, accumulate, finish_calls)
    if n == 2:
        out["ddp"] = ours_and_ddp()
        out["find-unused"] = branchy_run(True)
    return out


@functools.cache
def world(n: int) -> launch.RunResult:
    return launch.run(world_checks, n)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_step_matches_one_process(variant):
    n, optimizer, _, _, buckets, _ = VARIANTS[variant]
    reference = one_process(optimizer, STEPS)
    result = [rank[variant] for rank in world(n)]
    for history, made in result:
        assert made == buckets if isinstance(buckets, int) else made > 1
        for step, (mine, theirs) in enumerate(zip(history, reference, strict=True)):
            for name in theirs:
                assert torch.allclose(mine[name], theirs[name], rtol=1e-10, atol=1e-12), (step, name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_step_all_reduces_every_gradient_once_however_often_finish_is_called(variant):
    """The ledger after the broadcast: one all-reduce per bucket and step, of the trainable parameters' gradients
    once (a rank sends 2(n-1)/n of those bytes), the same with finish_gradient_synchronization called once, twice or
    never, and with no_sync accumulation; the all-reduces that start after backward are tagged grad_sync."""
    n, _, options, _, _, _ = VARIANTS[variant]
    trainable = sum(p.numel() for p in ToyModel().parameters() if p.requires_grad)
    for records, (_, buckets) in zip(world(n).comm, (rank[variant] for rank in world(n)), strict=True):
        mine = [rec for rec in records if rec.tags.get("variant") == variant and rec.tags.get("phase") != "init"]
        assert [rec.op for rec in mine] == ["all_reduce"] * STEPS * buckets
        assert sum(rec.tensor_bytes for rec in mine) == STEPS * 8 * trainable
        after_backward = {rec.tags.get("phase") for rec in mine} == {"grad_sync"}
        assert after_backward == (options.get("overlap") is False), {rec.tags.get("phase") for rec in mine}


def ours_and_ddp() -> tuple[dict, dict]:
    """Rank function: the same training loop, PyTorch's (no call after backward), through our DataParallel and
    PyTorch's DistributedDataParallel."""

    def run(kind: str):
        torch.manual_seed(0)
        model = ToyModel().double()
        if kind == "ours":
            wrapped = DataParallel(model, bucket_mb=0.002)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
        opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=0.01)
        rank, n = dist.get_rank(), dist.get_world_size()
        for x, y in batches(3):
            out = wrapped(batch_shard(x, rank, n), batch_shard(y, rank, n))
            out.backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    return run("ours"), run("torch")


def test_the_same_as_pytorchs_ddp():
    for ours, theirs in (rank["ddp"] for rank in world(2)):
        for name in theirs:
            assert torch.allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-14), name


class Branchy(ToyModel):
    """A parameter that takes part only on odd steps: the hazard PyTorch's DDP refuses loudly."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(16, 16)
        self.use_extra = False

    def forward(self, tokens, targets):
        loss = super().forward(tokens, targets)
        return loss + self.extra.weight.sum() * 0.0 if self.use_extra else loss


def branchy_run(find_unused: bool):
    """PyTorch's loop: the error, if any, must come out of backward itself (raised from autograd's final callback)."""
    torch.manual_seed(0)
    model = DataParallel(Branchy().double(), bucket_mb=0.002, find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    return float(model.module.extra.weight.grad.abs().sum())


def test_a_parameter_without_gradient_is_an_error_naming_it():
    with pytest.raises(launch.RankError, match=r"extra.bias, extra.weight got no gradient in this step") as error:
        launch.run(branchy_run, 2, False)
    assert "in branchy_run\n    model(x, y).backward()\n" in str(error.value)  # raised by backward, not swallowed
    assert [rank["find-unused"] for rank in world(2)] == [0.0, 0.0]  # counted as zero


def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket size must be positive or None"):
        launch.run_here(lambda: DataParallel(ToyModel(), bucket_mb=0))
