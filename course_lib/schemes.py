"""The equivalence harness: run a parallel scheme on real ranks, train the single-device reference beside it, and
report both — losses, parameter differences, and every rank's memory and bytes moved.

Each scheme is a rank function ``fn(cfg, train, **options) -> dict`` with ``losses`` (this rank's per-step losses
over the rows it saw, or None when it saw no loss), ``params`` (the full parameters by name on ranks that hold
them, else None), ``memory`` (a :class:`course_lib.memory.MemoryReport` dict of the last step) and ``coords``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from course_lib import comm, launch
from course_lib.memory import model_state_formula, tiny_gpt_activation_bytes
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, count_params, max_param_diff, train_reference
from course_lib.parallel.data import train_data_parallel


@dataclass(frozen=True)
class Scheme:
    name: str
    rank_fn: Callable
    summary: str
    single_rank: bool = False


SCHEMES = {
    "single": Scheme("single", train_data_parallel, "one rank, the whole batch: the baseline", single_rank=True),
    "dp": Scheme("dp", train_data_parallel, "data parallel: replicate the model, split the batch, all-reduce grads"),
}


@dataclass
class SchemeRun:
    """``report`` is the JSON-ready summary; ``result`` the launcher's RunResult (timelines, ledgers);
    ``predicted_memory`` the formula's bytes per rank (:func:`predict_memory`)."""

    report: dict
    result: launch.RunResult
    predicted_memory: list[dict]


def validate(scheme: str, world_size: int, train: TrainConfig) -> Scheme:
    """Reject impossible settings before any rank starts, saying how to fix them."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    spec = SCHEMES[scheme]
    if spec.single_rank and world_size != 1:
        raise ValueError(f"scheme 'single' runs on one rank; pass world size 1, not {world_size}")
    if world_size > train.batch:
        raise ValueError(
            f"world size {world_size} is larger than the global batch of {train.batch} sequences: some ranks would "
            f"get no data. Use a batch of at least {world_size} or fewer ranks."
        )
    if train.batch % world_size:
        raise ValueError(
            f"the global batch of {train.batch} sequences does not split evenly over {world_size} data-parallel "
            f"ranks; use a batch that is a multiple of {world_size}"
        )
    return spec


def predict_memory(scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig) -> list[dict]:
    """Predicted bytes per rank by category, for comparison with what the ranks measured.

    Model states follow :func:`course_lib.memory.model_state_formula` for the trainable parameters, plus the
    frozen parameters' own bytes and one 4-byte step counter per trainable tensor that AdamW keeps; activations
    follow :func:`course_lib.memory.tiny_gpt_activation_bytes` for each rank's share of the batch.
    """
    model = TinyGPT(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = count_params(model, trainable_only=False) - count_params(model)
    element = train.torch_dtype.itemsize
    states = model_state_formula(sum(p.numel() for p in trainable), precision=f"fp{8 * element}")
    row = {
        "params": states["params"] + element * frozen,
        "grads": states["grads"],
        "optimizer": states["optimizer"] + 4 * len(trainable),
        "activations": tiny_gpt_activation_bytes(cfg, train.batch // world_size, element)["total"],
    }
    return [dict(row) for _ in range(world_size)]


def run_scheme(
    scheme: str,
    world_size: int,
    cfg: GPTConfig = GPTConfig(),
    train: TrainConfig = TrainConfig(),
    backend: str = "auto",
    timeout: float = 120.0,
) -> SchemeRun:
    """Train with ``scheme`` on ``world_size`` ranks and compare with :func:`train_reference`."""
    spec = validate(scheme, world_size, train)
    result = launch.run(spec.rank_fn, world_size, cfg, train, backend=backend, timeout=timeout)
    reference = train_reference(cfg, train)
    rank_losses = [r["losses"] for r in result if r["losses"] is not None]
    losses = [sum(step) / len(step) for step in zip(*rank_losses, strict=True)]
    params = next(r["params"] for r in result if r["params"] is not None)
    last = train.steps - 1
    ranks = []
    for rank, (value, records, events) in enumerate(zip(result, result.comm, result.events, strict=True)):
        step_records = [rec for rec in records if rec.tags.get("step") == last]
        stepped = [e for e in events if "step" in e.tags]
        ranks.append(
            {
                "rank": rank,
                "coords": value["coords"],
                "memory": value["memory"],
                "comm": {
                    op: {"calls": s["calls"], "bytes": s["bytes"]} for op, s in comm.summarize(step_records).items()
                },
                "wall_s": max(e.end for e in stepped) - min(e.start for e in stepped),
            }
        )
    report = {
        "scheme": scheme,
        "world_size": world_size,
        "backend": result.backend,
        "dtype": train.dtype,
        "params": count_params(TinyGPT(cfg)),
        "steps": train.steps,
        "losses": losses,
        "reference_losses": reference.losses,
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)),
        "max_abs_param_diff": max_param_diff(params, reference.params),
        "ranks": ranks,
        "wall_s": result.wall_s,
    }
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"{scheme}: losses are not finite: {losses}")
    return SchemeRun(report, result, predict_memory(scheme, world_size, cfg, train))
