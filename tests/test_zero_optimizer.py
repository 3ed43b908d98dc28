"""ZeroRedundancyOptimizer around a student's own model, tested as an outside assignment would (CS336-style): the toy
model with frozen and tied parameters, every rank seeded differently, every way of zeroing gradients, and after
every step the parameters compared with training on one process (float64, rtol 1e-10), in PyTorch's loop
(``backward(); step()``: the step finishes the reduction) and with ``finish_gradient_synchronization()`` called
as well, twice, or between micro-batches (then each call, and the step, reduce what came since), its bytes those of
the formula; sharding the state of an
optimizer whose gradients DataParallel already averaged is bit-identical to not sharding it; the same runs through
PyTorch's own ZeroRedundancyOptimizer; and the hazards (a parameter without gradient, a module moved after the
optimizer was built) are errors that say what to do."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from toy_model import ToyModel, batches, halve_lr_every_step, one_process  # tests/ is on sys.path

from course_lib.ledgers import trace
from course_lib.parallel.data import DataParallel, batch_shard
from course_lib.parallel.zero import ZeroRedundancyOptimizer, bucket_sizes
from course_lib.runtime import launch

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def zero_grad(form: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The ways a student zeroes gradients; "none" never does."""
    if form == "optimizer":
        opt.zero_grad()
    elif form == "module":
        model.zero_grad()  # set_to_none: the .grad a ZeRO-1 built on views would lose
    elif form == "module, in place":
        model.zero_grad(set_to_none=False)


def sharded_run(
    optimizer: str, steps: int, options: dict, form: str, accumulate: int, schedule: bool, finish: str = "never"
):
    """Rank function: seeded by rank, the toy model trained by a ZeroRedundancyOptimizer on this rank's rows;
    ``finish``: when the loop calls finish_gradient_synchronization: "never" (PyTorch's loop), "twice" after the
    last backward, or "between" micro-batches, after every backward but the last (then without no_sync), so that
    the step must reduce what the last backward added."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0 if rank == 0 else 100 + rank)  # the optimizer must broadcast rank 0's weights
    model = ToyModel().double()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = ZeroRedundancyOptimizer(model.named_parameters(), cls, **options, **kwargs)
    scheduler = halve_lr_every_step(opt) if schedule else None
    history = []
    for x, y in batches(steps):
        zero_grad(form, model, opt)
        xs, ys = batch_shard(x, rank, n).chunk(accumulate), batch_shard(y, rank, n).chunk(accumulate)
        for k, (xk, yk) in enumerate(zip(xs, ys, strict=True)):
            with opt.no_sync() if k < accumulate - 1 and finish != "between" else torch.enable_grad():
                (model(xk, yk) / accumulate).backward()
            if finish == "between" and k < accumulate - 1:
                opt.finish_gradient_synchronization()
        for _ in range(2 if finish == "twice" else 0):
            opt.finish_gradient_synchronization()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history, len(opt.buckets)


# id: (ranks, optimizer, options, zeroing, micro-batches, learning-rate schedule, buckets, finish calls)
VARIANTS = {
    "stage1-one-bucket-2": (2, "sgd", {"bucket_mb": None}, "optimizer", 1, False, 1, "never"),
    "stage1-one-bucket-2-finish-twice": (2, "sgd", {"bucket_mb": None}, "optimizer", 1, False, 1, "twice"),
    "stage1-buckets-3-module-zero-grad": (3, "adamw", {"bucket_mb": 0.002}, "module", 1, False, "many", "never"),
    "stage1-no-sync-4-scheduler": (4, "adamw", {"bucket_mb": 0.002}, "module, in place", 2, True, "many", "never"),
    "stage1-after-backward-3": (
        3,
        "adamw",
        {"bucket_mb": 0.0015, "overlap": False},
        "optimizer",
        2,
        False,
        "many",
        "never",
    ),
    "stage1-after-backward-3-finish-between": (
        3,
        "adamw",
        {"bucket_mb": 0.0015, "overlap": False},
        "optimizer",
        2,
        False,
        "many",
        "between",
    ),
    "stage2-buckets-2-module-zero-grad": (
        2,
        "adamw",
        {"stage": 2, "bucket_mb": 0.002},
        "module",
        1,
        False,
        "many",
        "never",
    ),
    "stage2-accumulate-4": (4, "adamw", {"stage": 2, "bucket_mb": None}, "optimizer", 2, False, 1, "never"),
    "stage2-accumulate-4-finish-between": (
        4,
        "adamw",
        {"stage": 2, "bucket_mb": None},
        "optimizer",
        2,
        False,
        1,
        "between",
    ),
    "stage2-never-zeroed-3": (
        3,
        "adamw",
        {"stage": 2, "bucket_mb": 0.002, "overlap": False},
        "none",
        1,
        False,
        "many",
        "never",
    ),
}


STEPS = 3


def world_checks() -> dict:
    """Everything this file runs on a world of n ranks without an error, in one launch per world size: the
    variants of that size, the state-only sharding (2 and 4 ranks), PyTorch's ZeRO (3) and resuming (2)."""
    n = dist.get_world_size()
    out = {}
    for name, (size, optimizer, options, form, accumulate, schedule, _, finish) in VARIANTS.items():
        if size == n:
            with trace.tags(variant=name):
                out[name] = sharded_run(optimizer, STEPS, options, form, accumulate, schedule, finish)
    if n in (2, 4):
        out["state-only"] = after_data_parallel("ours"), after_data_parallel("plain")
    if n == 3:
        out["three-ways"] = (
            after_data_parallel("ours"),
            after_data_parallel("torch"),
            sharded_run("adamw", 3, {}, "optimizer", 1, False)[0],
        )
    if n == 2:
        out["resumed"] = resumed(split=4), resumed(split=2)
    return out


@functools.cache
def world(n: int) -> launch.RunResult:
    return launch.run(world_checks, n)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_step_matches_one_process(variant):
    n, optimizer, options, form, accumulate, schedule, buckets, _ = VARIANTS[variant]
    reference = one_process(optimizer, STEPS, schedule)
    result = [rank[variant] for rank in world(n)]
    for history, made in result:
        assert made == buckets if isinstance(buckets, int) else made > 2
        for step, (mine, theirs) in enumerate(zip(history, reference, strict=True)):
            for name in theirs:
                assert torch.allclose(mine[name], theirs[name], rtol=1e-10, atol=1e-12), (step, name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_ledger_is_the_formula_however_often_finish_is_called(variant):
    """After the broadcast, per step: each flat buffer reduce-scattered once (stage 2, or calls between
    micro-batches: once per micro-batch) and all-gathered once (a rank sends (n-1)/n of its float64 bytes each);
    calling finish_gradient_synchronization twice, or leaving it to the step, sends the same."""
    n, _, options, _, accumulate, _, _, finish = VARIANTS[variant]
    padded = sum(bucket_sizes(ToyModel(), n, options.get("bucket_mb", 25.0)))
    scatters = accumulate if options.get("stage") == 2 or finish == "between" else 1
    for records in world(n).comm:
        mine = [rec for rec in records if rec.tags.get("variant") == variant and rec.tags.get("phase") != "init"]
        moved = {op: sum(rec.tensor_bytes for rec in mine if rec.op == op) for op in ("reduce_scatter", "all_gather")}
        assert {rec.op for rec in mine} == set(moved)
        assert moved == {"reduce_scatter": scatters * STEPS * 8 * padded, "all_gather": STEPS * 8 * padded}


def after_data_parallel(sharded: str, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """DataParallel averages the gradients; then AdamW, or ours / PyTorch's ZeRO sharding only AdamW's state."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = DataParallel(ToyModel().double(), bucket_mb=0.002)
    trainable = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = OPTIMIZERS["adamw"]
    if sharded == "ours":
        opt = ZeroRedundancyOptimizer(trainable, cls, average_gradients=False, bucket_mb=0.002, **kwargs)
    elif sharded == "torch":
        opt = TorchZeRO(trainable, cls, **kwargs)
    else:
        opt = cls(trainable, **kwargs, foreach=False)
    history = []
    for x, y in batches(steps):
        opt.zero_grad()
        model(batch_shard(x, rank, n), batch_shard(y, rank, n)).backward()
        model.finish_gradient_synchronization()
        opt.step()
        history.append({k: v.detach().clone() for k, v in model.module.state_dict().items()})
    return history


@pytest.mark.parametrize("n", [2, 4])
def test_sharding_only_the_state_is_bit_identical_to_not_sharding(n):
    """The slices take the same elementwise AdamW update as the whole tensors: equal to the last bit."""
    for sharded, plain in (rank["state-only"] for rank in world(n)):
        for mine, theirs in zip(sharded, plain, strict=True):
            assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_the_same_as_pytorchs_zero_redundancy_optimizer():
    """PyTorch's version after DDP, ours after DataParallel, and ours reducing the gradients itself: one answer."""
    for ours, theirs, alone in (rank["three-ways"] for rank in world(3)):
        for a, b, c in zip(ours, theirs, alone, strict=True):
            for name in b:
                assert torch.allclose(a[name], b[name], rtol=1e-12, atol=1e-14), name
                assert torch.allclose(c[name], b[name], rtol=1e-10, atol=1e-12), name


def resumed(split: int, steps: int = 4) -> dict[str, torch.Tensor]:
    """Train ``split`` steps, save this rank's optimizer slice and the model, rebuild both, load, train on."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def build(state=None):
        torch.manual_seed(0)
        model = ToyModel().double()
        if state is not None:
            model.load_state_dict(state)
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, bucket_mb=0.002, lr=0.01)

    model, opt = build()
    for step, (x, y) in enumerate(batches(steps)):
        if step == split:
            saved = opt.state_dict()
            model, opt = build(model.state_dict())
            opt.load_state_dict(saved)
        opt.zero_grad()
        model(batch_shard(x, rank, n), batch_shard(y, rank, n)).backward()
        opt.step()
    return model.state_dict()


def test_each_rank_saves_and_loads_its_own_slice_of_the_state():
    for uninterrupted, restarted in (rank["resumed"] for rank in world(2)):
        assert all(torch.equal(uninterrupted[k], restarted[k]) for k in uninterrupted)


class Branchy(ToyModel):
    """A layer that takes no part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(16, 16)


def unused(stage: int) -> None:
    model = Branchy().double()
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_without_gradient_is_an_error_naming_it(stage):
    with pytest.raises(launch.RankError, match=r"extra.bias, extra.weight got no gradient in this step.*freeze"):
        launch.run(unused, 2, stage)


def moved_after_building() -> None:
    model = ToyModel()
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
    model.double()  # new storage for every parameter: the optimizer's buffers no longer hold them
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()


def test_a_module_moved_after_the_optimizer_was_built_is_an_error():
    with pytest.raises(launch.RankError, match=r"fc2.weight no longer lives in ZeroRedundancyOptimizer.s flat buffer"):
        launch.run(moved_after_building, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 3}, "stage 1 or 2, not 3; stage 3 is FullyShardedDataParallel"),
        ({"stage": 2, "average_gradients": False}, "full averaged gradients already exist, so use stage 1"),
        ({"bucket_mb": 0}, "bucket size must be positive or None"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        launch.run_here(lambda: ZeroRedundancyOptimizer(ToyModel().parameters(), torch.optim.SGD, lr=0.1, **options))


def test_parameter_groups_keep_their_settings_and_are_fixed_at_construction():
    def build():
        model = ToyModel()
        groups = [{"params": model.fc1.parameters(), "lr": 0.5}, {"params": [model.embed.weight]}]
        opt = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=0.01, bucket_mb=None)
        with pytest.raises(RuntimeError, match="pass every parameter group then"):
            opt.add_param_group({"params": [model.fc2.weight]})
        return [g["lr"] for g in opt.optim.param_groups], opt.param_groups[1]["betas"], len(opt.buckets)

    assert launch.run_here(build) == [([0.5, 0.01], (0.9, 0.999), 2)]
