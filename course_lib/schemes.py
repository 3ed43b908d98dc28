"""The registry of schemes and the equivalence harness: run a scheme on real ranks, train the single-device
reference beside it, and report both — losses, parameter differences, and every rank's memory and bytes moved, each
beside its prediction.

A scheme lives in its own module of :mod:`course_lib.parallel`, which implements
:class:`course_lib.parallel.interface.Scheme`: a rank function ``fn(cfg, train, **settings) -> dict`` with
``losses`` (this rank's per-step losses over the rows it saw, or None when it saw no loss), ``params`` (the full
parameters by name on ranks that hold them, else None), ``memory`` (a :class:`course_lib.memory.MemoryReport` dict
of the last step) and ``coords``; and its checks and predictions. Nothing here depends on which scheme runs.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib import checkpoint, comm, launch, precision
from course_lib import placement as placing
from course_lib.faults import Fault, injected
from course_lib.hardware import ModeledRun, get_profile, replay, resolve_topology
from course_lib.models import (
    GPTConfig,
    ModelFactory,
    TrainConfig,
    TrainResult,
    build_model,
    check_model,
    count_params,
    max_param_diff,
    rel_param_diff,
    train_reference,
)
from course_lib.parallel.interface import Scheme
from course_lib.topology import Topology

# The registry: the modules whose SCHEMES tuples hold the schemes, in the order the demo runs them.
SCHEME_MODULES = ("data", "zero", "fsdp", "tensor", "pipeline", "three_d", "context", "expert")
SCHEMES: dict[str, Scheme] = {
    spec.name: spec
    for module in SCHEME_MODULES
    for spec in importlib.import_module(f"course_lib.parallel.{module}").SCHEMES
}
ALIASES = {"fsdp": "zero3"}


@dataclass
class SchemeRun:
    """``report`` is the JSON-ready summary; ``result`` the launcher's RunResult (timelines, ledgers);
    ``predicted_memory`` and ``predicted_comm`` the formulas' bytes per rank; ``modeled`` the replay on a modeled
    cluster when one was asked for."""

    report: dict
    result: launch.RunResult
    predicted_memory: list[dict]
    predicted_comm: dict
    modeled: ModeledRun | None = None


def validate(scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict) -> Scheme:
    """Reject impossible settings before any rank starts, saying how to fix them; returns the scheme's entry."""
    name = ALIASES.get(scheme, scheme)
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES) + sorted(ALIASES)}")
    spec = SCHEMES[name]
    if cfg.experts and not spec.moe:
        takers = [n for n, s in SCHEMES.items() if s.moe]
        raise ValueError(
            f"scheme {name!r} trains the dense tiny GPT, and this model has {cfg.experts} experts per layer; an MoE "
            f"model runs under {takers} (or set experts=0)"
        )
    if train.precision is not None and train.precision not in spec.precisions:
        takers = [n for n, s in SCHEMES.items() if train.precision in s.precisions]
        raise ValueError(f"precision {train.precision!r} runs under schemes {takers}, not under {name!r}")
    if options.get("model") is not None:
        if "model" not in spec.settings({}):
            takers = [n for n, s in SCHEMES.items() if "model" in s.settings({})]
            raise ValueError(
                f"scheme {name!r} trains the course's tiny GPT only; your own model runs under {takers}. For tensor "
                f"parallelism in your model, place ColumnParallelLinear/RowParallelLinear in it (parallelize_module)."
            )
        check_model(cfg, train, options["model"])
    spec.validate(world_size, cfg, train, spec.settings(options))
    return spec


def _patched(rank_fn: Callable, patch: tuple[str, str, Callable], *args, **kwargs):
    """In this rank's process only, replace one component, then run the scheme's rank function."""
    module_name, path, replacement = patch
    owner = importlib.import_module(module_name)
    *outer, attribute = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    setattr(owner, attribute, replacement)
    return rank_fn(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def reference_run(cfg: GPTConfig, train: TrainConfig, model: ModelFactory | None = None) -> TrainResult:
    """:func:`course_lib.models.train_reference` for this configuration (and model factory), trained once per
    process and kept (treat the result as read-only). With local ranks it trains in a child of the rank server,
    which has torch's optimizer machinery imported already (importing it here would cost the first run two seconds);
    under torchrun, on rank 0 alone, which sends it to the others (the scheme's run has set up their process
    group)."""
    if not launch.under_torchrun():
        return launch.run(train_reference, 1, cfg, train, model=model)[0]
    result = [train_reference(cfg, train, model=model) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def run_scheme(
    scheme: str,
    world_size: int,
    cfg: GPTConfig = GPTConfig(),
    train: TrainConfig = TrainConfig(),
    backend: str = "auto",
    device: str | None = None,
    timeout: float = 120.0,
    hardware: str | None = None,
    gpus_per_node: int | None = None,
    topology: Topology | str | None = None,
    algorithm: str | None = None,
    placement: str | None = None,
    patch: tuple[str, str, Callable] | None = None,
    stall_timeout: float = 20.0,
    max_ranks: int | None = None,
    in_process: bool = False,
    fault: Fault | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: str | None = None,
    checkpoint_async: bool = False,
    **options,
) -> SchemeRun:
    """Train with ``scheme`` on ``world_size`` ranks and compare with :func:`train_reference`, the ranks computing
    on ``device`` (``cpu`` or ``cuda``; default: CUDA under NCCL, else the CPU, as
    :func:`course_lib.launch.compute_device` says: gloo ranks on ``cuda`` share the GPUs there are); with ``hardware``
    (a profile of :mod:`course_lib.hardware`), also replay the last step on that modeled cluster; with ``topology``
    too (a :class:`course_lib.topology.Topology` or a profile such as ``"h100-superpod"`` or ``"tpu-v5p:4x4x4"``),
    time its collectives on that topology's links, with ``algorithm`` forced where it can run
    (:func:`course_lib.hardware.replay`), the mesh's axes on the topology's levels as ``placement`` says (such as
    ``"tp/pp,dp"``, :mod:`course_lib.placement`; default: rank r on GPU r). ``patch`` =
    (module, "Class.attribute" or "function", replacement) swaps one component inside every rank (bug hunts).
    ``timeout``, ``stall_timeout`` and ``max_ranks`` go to :func:`course_lib.launch.run`; ``in_process`` runs a
    one-rank scheme and its reference in this process (:func:`course_lib.launch.run_here`), starting nothing.
    ``model``, for the schemes that take one (a setting of their rank function), is a factory of the student's own
    module (:func:`course_lib.models.build_model`), trained in place of the tiny GPT and by the reference.
    ``fault`` (:class:`course_lib.faults.Fault`) makes one rank fail at a step on purpose, in every scheme alike;
    the run then ends in a :class:`course_lib.launch.RankError` naming the rank and the step.

    ``checkpoint_dir`` and ``checkpoint_every`` K save the training state as ``checkpoint_dir/step-<n>`` after every
    K-th step; ``resume`` (a checkpoint folder, or a folder of them: the newest) loads one before the first step,
    saved by any checkpointing scheme on any number of ranks (:mod:`course_lib.checkpoint`), and trains the steps
    left. The report's ``losses`` and ``reference_losses`` are then those of the steps that ran, from
    ``first_step``; the parameters are compared at the end, as always. ``checkpoint_async`` writes each checkpoint
    in the background while training goes on (:class:`course_lib.checkpoint.Saver`); the report's
    ``checkpoints["saves"]`` holds each rank's timings of its saves, on the run's clock."""
    spec = validate(scheme, world_size, cfg, train, options)
    settings = spec.settings(options)
    profile = get_profile(hardware) if hardware is not None else None
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, not {gpus_per_node}")
    if (topology is not None or algorithm is not None) and profile is None:
        raise ValueError(
            "a topology gives the modeled clock its links; its compute comes from a hardware profile: "
            "add hardware (e.g. h100)"
        )
    if (algorithm is not None or placement is not None) and topology is None:
        what = "an algorithm is forced" if algorithm is not None else "a placement puts the mesh's axes"
        raise ValueError(f"{what} on a topology's links; add a topology (e.g. h100-superpod)")
    if placement is not None:
        placing.parse(placement)
    if topology is not None:
        if gpus_per_node is not None:
            raise ValueError("the topology says which GPUs share a node; drop gpus_per_node")
        topology, _ = resolve_topology(topology, world_size, algorithm)
    rank_fn = functools.partial(_patched, spec.train, patch) if patch else spec.train
    plan = checkpoint.plan_for(
        spec.name,
        spec.checkpoint,
        world_size,
        cfg,
        train,
        options.get("model"),
        checkpoint_dir,
        checkpoint_every,
        resume,
        checkpoint_async,
    )
    start = plan.start if plan is not None else 0
    if plan is not None and train.precision is not None:
        raise ValueError(
            "checkpoints hold fp32 AdamW state per parameter, not a mixed-precision run's master weights and loss "
            "scale: drop the checkpoint settings, or precision"
        )
    if plan is not None:
        rank_fn = checkpoint.planned(rank_fn, plan)
    if fault is not None:
        if in_process:
            raise ValueError("a fault is injected into launched ranks, not into this process; drop in_process")
        fault.check(world_size, train.steps)
        if fault.step < start:
            raise ValueError(
                f"cannot fail at step {fault.step}: the resumed run trains steps {start} to {train.steps - 1}"
            )
        if fault.phase == "checkpoint" and (plan is None or not plan.due(fault.step)):
            raise ValueError(
                f"a fault in the checkpoint phase fires in a step that saves one, and step {fault.step} does not: "
                f"pass checkpoint_every=K with (step + 1) divisible by K"
            )
        if fault.phase == "checkpoint" and fault.kind == "hang" and checkpoint_async:
            raise ValueError(
                "a hang in the checkpoint phase of an asynchronous checkpoint would stop only the thread that writes "
                "it, not the rank; hang a synchronous checkpoint, or another phase"
            )
        rank_fn = injected(rank_fn, fault)
    if in_process:
        if world_size != 1:
            raise ValueError(f"in_process runs one rank, not {world_size}; use the launcher for more")
        placed = torch.device(launch.compute_device("gloo", device))
        result = launch.run_here(rank_fn, cfg, train, count_flops=profile is not None, device=placed, **options)
        reference = train_reference(cfg, train, model=options.get("model"))
    else:
        result = launch.run(
            rank_fn,
            world_size,
            cfg,
            train,
            backend=backend,
            timeout=timeout,
            stall_timeout=stall_timeout,
            max_ranks=max_ranks,
            count_flops=profile is not None,
            device=device,
            **options,
        )
        reference = reference_run(cfg, train, options.get("model"))
    rank_losses = [r["losses"] for r in result if r["losses"] is not None]
    losses = [sum(step) / len(step) for step in zip(*rank_losses, strict=True)]
    params = {}  # the union of what the ranks hold (a pipeline rank holds only its stages)
    for value in result:
        params |= value["params"] or {}
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
                "comm_by_axis": {axis: s["bytes"] for axis, s in comm.summarize(step_records, by="group").items()},
                "wall_s": max(e.end for e in stepped) - min(e.start for e in stepped),
            }
        )
    report = {
        "scheme": spec.name,
        "world_size": world_size,
        "backend": result.backend,
        "device": result.device,
        "dtype": train.dtype,
        "options": {k: f"{v.__module__}.{v.__qualname__}" if callable(v) else v for k, v in options.items()},
        "params": count_params(build_model(cfg, train, options.get("model"))),
        "steps": train.steps,
        "first_step": start,
        "losses": losses,
        "reference_losses": list(reference.losses[start:]),
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, reference.losses[start:], strict=True)),
        "max_abs_param_diff": max_param_diff(params, reference.params),
        "rel_param_diff": rel_param_diff(params, reference.params),
        "ranks": ranks,
        "wall_s": result.wall_s,
    }
    if plan is not None and plan.resume is not None:
        saved = checkpoint.read_meta(plan.resume)
        report["resumed_from"] = {"path": plan.resume, "scheme": saved["scheme"], "world_size": saved["world_size"]}
    if plan is not None and plan.directory is not None:
        report["checkpoints"] = {
            "directory": plan.directory,
            "every": plan.every,
            "asynchronous": plan.asynchronous,
            "saves": [value.get("checkpoint_saves", []) for value in result],
        }
    if train.precision is not None:
        full = precision.full_precision(train)
        fp32 = (
            train_reference(cfg, full, model=options.get("model"))
            if in_process
            else reference_run(cfg, full, options.get("model"))
        )
        report["precision"] = precision.summary(train, result[0], losses, fp32.losses[start:])
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"{scheme}: losses are not finite: {losses}")
    if spec.describe is not None:
        report |= spec.describe(world_size, cfg, train, settings)
    gpus = placing.gpus_for([r["coords"] for r in report["ranks"]], topology, placement) if placement else None
    modeled = (
        replay(result.programs, result.comm, profile, gpus_per_node, topology=topology, algorithm=algorithm, gpus=gpus)
        if profile is not None
        else None
    )
    if modeled is not None:
        report["modeled"] = modeled.summary()
        if "bubble_fraction" in report:  # the modeled clock's bubble replaces the plan's
            report["bubble_fraction"] = report["modeled"]["bubble_fraction"]
        for rank, numbers in zip(report["ranks"], modeled.per_rank(), strict=True):
            rank["modeled"] = {k: v for k, v in numbers.items() if k != "rank"}
    predicted_comm = spec.predict_comm(world_size, cfg, train, settings)
    if spec.routed_comm is not None:
        routed = spec.routed_comm(list(result), cfg, train, settings)
        predicted_comm = [
            {key: row.get(key, 0.0) + extra.get(key, 0.0) for key in row | extra}
            for row, extra in zip(predicted_comm, routed, strict=True)
        ]
    return SchemeRun(report, result, spec.predict_memory(world_size, cfg, train, settings), predicted_comm, modeled)
