"""Practice: wrap a model of your own for data parallelism, and let the course check your training loop.

You write a rank function ``train_fn(model, batches) -> dict[str, Tensor]``. ``model`` is this rank's copy of your
model, built with a *different seed on every rank* (on a real cluster nothing makes the copies equal unless your
wrapper copies rank 0's weights); ``batches`` are the global (tokens, targets) of every step, the same on every
rank; it trains and returns the trained parameters by name (``model.state_dict()``, or FSDP's ``full_params()``).

:func:`check_training` runs your function on one rank, where any correct data-parallel loop is plain training (the
reference), and on n ranks, in float64; it compares every rank's parameters with the reference and with each
other, and counts the rows each rank's model saw, then says what is wrong and what usually causes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import ModelFactory, check_model, max_param_diff, synthetic_tokens
from course_lib.runtime import launch

TOLERANCE = 1e-10  # float64: a correct data-parallel loop matches one process to ~1e-15
TrainFn = Callable[[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Verdict:
    correct: bool
    message: str

    def __str__(self) -> str:
        return ("correct: " if self.correct else "not yet: ") + self.message


def _rank(train_fn: TrainFn, model: ModelFactory, steps: int, batch: int) -> tuple[dict, int]:
    """On each rank: build the model from this rank's own seed, count the rows it sees, run the student's loop."""
    rank = dist.get_rank()
    torch.manual_seed(0 if rank == 0 else 1000 + rank)
    module = model().double()
    rows = []
    module.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0] if args else 0))
    batches = [synthetic_tokens(step, batch, GPTConfig()) for step in range(steps)]
    params = train_fn(module, batches)
    if not isinstance(params, dict):
        raise TypeError(f"train_fn must return the trained parameters by name (a dict), not {type(params).__name__}")
    return {name: p.detach().cpu().clone() for name, p in params.items()}, sum(rows)


def check_training(
    train_fn: TrainFn, model: ModelFactory, world_size: int = 2, steps: int = 3, batch: int = 8, backend: str = "auto"
) -> Verdict:
    """Run ``train_fn`` on one rank and on ``world_size`` ranks and judge the second against the first."""
    name = type(check_model(GPTConfig(), TrainConfig(batch=batch), model)).__name__
    if batch % world_size:
        raise ValueError(f"a batch of {batch} does not split over {world_size} ranks; use a multiple of {world_size}")
    ((reference, _),) = launch.run(_rank, 1, train_fn, model, steps, batch, backend=backend)
    ranks = launch.run(_rank, world_size, train_fn, model, steps, batch, backend=backend)
    for rank, (params, _) in enumerate(ranks):
        if params.keys() != reference.keys():
            return Verdict(False, f"rank {rank} returned parameters {sorted(params)}, one rank {sorted(reference)}")
    apart = max(max_param_diff(params, ranks[0][0]) for params, _ in ranks)
    off = max(max_param_diff(params, reference) for params, _ in ranks)
    share, seen = steps * batch // world_size, [rows for _, rows in ranks]
    if apart > TOLERANCE:
        return Verdict(
            False,
            f"after {steps} steps the {world_size} ranks hold different parameters (up to {apart:.1e} apart): their "
            f"copies started from different weights or took different steps. Wrap the model: DataParallel copies "
            f"rank 0's weights at construction, and every backward averages the gradients over the ranks.",
        )
    if off > TOLERANCE:
        return Verdict(
            False,
            f"the ranks agree with each other but not with one process ({off:.1e} apart after {steps} steps): the "
            f"gradients were summed rather than averaged, reduced twice, or the ranks' rows do not add up to the "
            f"batch (they saw {seen} rows in all; each should see {share}).",
        )
    if any(rows != share for rows in seen):
        return Verdict(
            False,
            f"every rank matches one process ({off:.1e}), but the ranks saw {seen} rows over {steps} steps, not "
            f"{share} each: that is not data parallelism yet. Each rank should forward only its share of every "
            f"batch (batch_shard(tokens, rank, n)); the averaged gradients then equal the whole batch's.",
        )
    return Verdict(
        True,
        f"on {world_size} ranks your loop trains your {name} exactly as one process does "
        f"({steps} steps, largest parameter difference {off:.1e}), each rank working on its {batch // world_size} "
        f"rows of every batch.",
    )
