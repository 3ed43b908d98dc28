"""The registry of schemes and the equivalence harness: run a scheme on real ranks, train the single-device
reference beside it, and report both — losses, parameter differences, and every rank's memory and bytes moved, each
beside its prediction.

:func:`run_scheme` runs in named phases: :func:`validate` (and :func:`check_cluster`) refuse impossible settings
before any rank starts; :func:`wrap` wraps the scheme's rank function (a swapped component, checkpoints, a fault);
:func:`launch_ranks` runs it and the reference (a run that saves checkpoints and fails ends with what its checkpoint
folder holds); :func:`report_run` compares them; :func:`model_on_cluster` replays the last step on a modeled
cluster. Its settings travel grouped: :class:`LaunchSettings`, :class:`FaultSettings`, :class:`CheckpointSettings`,
:class:`ClusterSettings`.

A scheme lives in its own module of :mod:`course_lib.parallel`, which implements
:class:`course_lib.parallel.interface.Scheme`: a rank function ``fn(cfg, train, **settings) -> dict`` with
``losses`` (this rank's per-step losses over the rows it saw, or None when it saw no loss), ``params`` (the full
parameters by name on ranks that hold them, else None), ``memory`` (a :class:`course_lib.ledgers.memory.MemoryReport`
dict of the last step) and ``coords``; and its checks and predictions. Nothing here depends on which scheme runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.cluster import placement as placing
from course_lib.cluster.clock import ModeledRun, replay
from course_lib.cluster.profiles import HardwareProfile
from course_lib.cluster.settings import ClusterSettings, check_cluster
from course_lib.cluster.topology import Topology
from course_lib.ledgers import comm, trace
from course_lib.ledgers.categories import CATEGORIES
from course_lib.model import precision
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import bytes_text, check_reference_fits
from course_lib.model.gpt import (
    ModelFactory,
    TrainResult,
    build_model,
    check_model,
    count_params,
    max_param_diff,
    rel_param_diff,
    train_reference,
)
from course_lib.parallel import catalog
from course_lib.parallel.interface import Scheme
from course_lib.runtime import checkpoint, checkpoint_plan, host, launch
from course_lib.runtime.faults import Fault, check_fault, injected

# The registry: the modules whose SCHEMES tuples hold the schemes, in the order the demo runs them.
SCHEME_MODULES = ("data", "zero", "fsdp", "tensor", "pipeline", "three_d", "context", "expert")
SCHEMES: dict[str, Scheme] = {
    spec.name: spec
    for module in SCHEME_MODULES
    for spec in importlib.import_module(f"course_lib.parallel.{module}").SCHEMES
}
ALIASES = catalog.ALIASES
catalog.check(SCHEMES)  # the command line parses with the catalog: it must say what the registry says


@dataclass(frozen=True)
class LaunchSettings:
    """How the ranks run: the backend, the device they compute on, the launcher's limits
    (:func:`course_lib.runtime.launch.run`), or one rank in this process (``in_process``)."""

    backend: str = "auto"
    device: str | None = None
    timeout: float = 120.0
    stall_timeout: float = 20.0
    max_ranks: int | None = None
    in_process: bool = False


@dataclass(frozen=True)
class FaultSettings:
    """What goes wrong on purpose: a rank that fails at a step (``fault``), and a component swapped inside every
    rank (``patch`` = (module, "Class.attribute" or "function", replacement): the bug hunts)."""

    fault: Fault | None = None
    patch: tuple[str, str, Callable] | None = None


@dataclass(frozen=True)
class CheckpointSettings:
    """Save into ``directory`` after every ``every``-th step, resume from ``resume``, write in the background
    (``asynchronous``): :func:`course_lib.runtime.checkpoint_plan.plan_for`."""

    directory: str | None = None
    every: int | None = None
    resume: str | None = None
    asynchronous: bool = False


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


def validate(
    scheme: str,
    world_size: int,
    cfg: GPTConfig,
    train: TrainConfig,
    options: dict,
    ranks: LaunchSettings = LaunchSettings(),
) -> Scheme:
    """Reject impossible settings before any rank starts, saying how to fix them, a run too large for this machine's
    memory included (:func:`check_memory`, the ranks as ``ranks`` starts them); returns the scheme's entry."""
    name = ALIASES.get(scheme, scheme)
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES) + sorted(ALIASES)}")
    spec = SCHEMES[name]
    catalog.refuse(spec, world_size, cfg, train, options)
    if options.get("model") is not None:
        check_model(cfg, train, options["model"])
    check_memory(spec, world_size, cfg, train, options, ranks)
    return spec


def check_memory(
    spec: Scheme, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict, ranks: LaunchSettings
) -> None:
    """Refuse a run this machine's available memory (:func:`course_lib.runtime.host.available_memory`) cannot
    hold, by the course's own formulas, each process counted with the launcher's ``RANK_MEMORY_BYTES`` for itself:
    first the one-device reference, the whole model and batch in one process (the tiny GPT's bytes by
    :func:`course_lib.model.formulas.tiny_gpt_memory`, without building it; a student's model was built by
    :func:`course_lib.model.gpt.check_model` already); then, for ranks on this machine's CPU, every rank's
    ``predict_memory`` together (its model built, which the reference's check has shown fits)."""
    available = host.available_memory()
    if available is None:
        return  # nothing to compare with: the launcher's own limits still hold
    margin, model = host.RANK_MEMORY_BYTES, options.get("model")
    shape = "your model" if model is not None else f"{cfg.layers} layers x {cfg.d_model} wide"
    have = f"more than the {bytes_text(available)} this machine has available"
    if model is None:
        check_reference_fits(cfg, train, available)
    if launch.under_torchrun() or ranks.in_process:
        return  # torchrun's ranks are spread over its nodes; one in process is the reference's size
    if launch.compute_device(launch.resolve_backend(ranks.backend, world_size), ranks.device) != "cpu":
        return  # the ranks' states are on the GPUs
    rows = spec.predict_memory(world_size, cfg, train, spec.settings(options))
    per_rank = [sum(row.get(k, 0) for k in (*CATEGORIES, "activations")) + margin for row in rows]
    if sum(per_rank) > available:
        raise ValueError(
            f"{world_size} ranks would need about {bytes_text(sum(per_rank))} ({bytes_text(max(per_rank))} on the "
            f"busiest rank by the course's memory formula: {shape}), {have}; use fewer layers or ranks, or a narrower "
            "model"
        )


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
def reference_run(
    cfg: GPTConfig, train: TrainConfig, model: ModelFactory | None = None, timeout: float = 120.0
) -> TrainResult:
    """:func:`course_lib.model.gpt.train_reference` for this configuration (and model factory), trained once per
    process and kept (treat the result as read-only). With local ranks it trains in a child of the rank server,
    which has torch's optimizer machinery imported already (importing it here would cost the first run two seconds),
    within the run's own ``timeout`` (a long run's reference takes as long as its ranks, on a slow machine more);
    under torchrun, on rank 0 alone, which sends it to the others (the scheme's run has set up their process
    group)."""
    if not launch.under_torchrun():
        return launch.run(train_reference, 1, cfg, train, model=model, timeout=timeout)[0]
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
    :func:`course_lib.runtime.launch.compute_device` says: gloo ranks on ``cuda`` share the GPUs there are); with
    ``hardware`` (a profile of :mod:`course_lib.cluster.profiles`), also replay the last step on that modeled cluster;
    with ``topology`` too (a :class:`course_lib.cluster.topology.Topology` or a profile such as ``"h100-superpod"`` or
    ``"tpu-v5p:4x4x4"``), time its collectives on that topology's links, with ``algorithm`` forced where it can run
    (:func:`course_lib.cluster.clock.replay`), the mesh's axes on the topology's levels as ``placement`` says (such as
    ``"tp/pp,dp"``, :mod:`course_lib.cluster.placement`; default: rank r on GPU r). ``patch`` =
    (module, "Class.attribute" or "function", replacement) swaps one component inside every rank (bug hunts).
    ``timeout``, ``stall_timeout`` and ``max_ranks`` go to :func:`course_lib.runtime.launch.run`; ``in_process`` runs a
    one-rank scheme and its reference in this process (:func:`course_lib.runtime.launch.run_here`), starting nothing.
    ``model``, for the schemes that take one (a setting of their rank function), is a factory of the student's own
    module (:func:`course_lib.model.gpt.build_model`), trained in place of the tiny GPT and by the reference.
    ``fault`` (:class:`course_lib.runtime.faults.Fault`) makes one rank fail at a step on purpose, in every scheme
    alike; the run then ends in a :class:`course_lib.runtime.launch.RankError` naming the rank and the step.

    ``checkpoint_dir`` and ``checkpoint_every`` K save the training state as ``checkpoint_dir/step-<n>`` after every
    K-th step; ``resume`` (a checkpoint folder, or a folder of them: the newest) loads one before the first step,
    saved by any checkpointing scheme on any number of ranks (:mod:`course_lib.runtime.checkpoint`), and trains the
    steps left. The report's ``losses`` and ``reference_losses`` are then those of the steps that ran, from
    ``first_step``; the parameters are compared at the end, as always. ``checkpoint_async`` writes each checkpoint
    in the background while training goes on (:class:`course_lib.runtime.checkpoint.Saver`); the report's
    ``checkpoints["saves"]`` holds each rank's timings of its saves, on the run's clock."""
    ranks = LaunchSettings(backend, device, timeout, stall_timeout, max_ranks, in_process)
    faults = FaultSettings(fault, patch)
    saving = CheckpointSettings(checkpoint_dir, checkpoint_every, resume, checkpoint_async)
    cluster = ClusterSettings(hardware, gpus_per_node, topology, algorithm, placement)
    spec = validate(scheme, world_size, cfg, train, options, ranks)
    profile, resolved = check_cluster(cluster, world_size, spec.axes)
    rank_fn, plan = wrap(spec, world_size, cfg, train, options, faults, saving, ranks.in_process)
    with _checkpoints_listed_on_failure(plan):
        result, reference = launch_ranks(rank_fn, world_size, cfg, train, ranks, profile is not None, options)
    report = report_run(spec, world_size, cfg, train, result, reference, plan, options, ranks)
    if not all(map(math.isfinite, report["losses"])):
        first = report["first_step"] + next(i for i, x in enumerate(report["losses"]) if not math.isfinite(x))
        raise ValueError(
            f"{scheme}: the loss is not finite from step {first} on ({report['losses']}): the training diverged; "
            "try a smaller learning rate, or look in the model for a log of 0 or a division by 0"
        )
    settings = spec.settings(options)
    if spec.describe is not None:
        report |= spec.describe(world_size, cfg, train, settings)
    if "pipeline" in report:  # the plan's bubble beside the one this run measured on its own clock
        report["pipeline"]["measured_bubble_fraction"] = trace.bubble_fraction(result.events, train.steps - 1)
    modeled = model_on_cluster(report, result, cluster, profile, resolved)
    comm_bytes = predicted_comm(spec, world_size, cfg, train, settings, result)
    return SchemeRun(report, result, spec.predict_memory(world_size, cfg, train, settings), comm_bytes, modeled)


def wrap(
    spec: Scheme,
    world_size: int,
    cfg: GPTConfig,
    train: TrainConfig,
    options: dict,
    faults: FaultSettings,
    saving: CheckpointSettings,
    in_process: bool,
) -> tuple[Callable, checkpoint_plan.CheckpointPlan | None]:
    """The scheme's rank function with what this run adds, innermost first: the swapped component, the checkpoint
    plan (:func:`course_lib.runtime.checkpoint.planned`), the fault (:func:`course_lib.runtime.faults.injected`);
    and the plan."""
    rank_fn = functools.partial(_patched, spec.train, faults.patch) if faults.patch else spec.train
    plan = checkpoint_plan.plan_for(
        spec.name,
        spec.checkpoint,
        world_size,
        cfg,
        train,
        options.get("model"),
        saving.directory,
        saving.every,
        saving.resume,
        saving.asynchronous,
    )
    if plan is not None:
        rank_fn = checkpoint.planned(rank_fn, plan)
    if faults.fault is not None:
        check_fault(faults.fault, world_size, train.steps, plan, saving.asynchronous, in_process)
        rank_fn = injected(rank_fn, faults.fault)
    return rank_fn, plan


@contextlib.contextmanager
def _checkpoints_listed_on_failure(plan: checkpoint_plan.CheckpointPlan | None) -> Iterator[None]:
    """A :class:`course_lib.runtime.launch.RankError` of a run that saves checkpoints ends with what its checkpoint
    folder holds: the complete checkpoints, and the save in flight when the run failed
    (:func:`course_lib.runtime.checkpoint_plan.survey`)."""
    if plan is None or plan.directory is None:
        yield
        return
    before = checkpoint_plan.unfinished(plan.directory)
    try:
        yield
    except launch.RankError as error:
        error.args = (f"{error}\n{checkpoint_plan.survey(plan.directory, before)}",)
        raise


def launch_ranks(
    rank_fn: Callable,
    world_size: int,
    cfg: GPTConfig,
    train: TrainConfig,
    ranks: LaunchSettings,
    count_flops: bool,
    options: dict,
) -> tuple[launch.RunResult, TrainResult]:
    """Run ``rank_fn`` on ``world_size`` launched ranks (or one in this process) and train the reference beside
    it: the ranks' result and the reference's."""
    if ranks.in_process:
        if world_size != 1:
            raise ValueError(f"in_process runs one rank, not {world_size}; use the launcher for more")
        placed = torch.device(launch.compute_device("gloo", ranks.device))
        result = launch.run_here(rank_fn, cfg, train, count_flops=count_flops, device=placed, **options)
        return result, train_reference(cfg, train, model=options.get("model"))
    result = launch.run(
        rank_fn,
        world_size,
        cfg,
        train,
        backend=ranks.backend,
        timeout=ranks.timeout,
        stall_timeout=ranks.stall_timeout,
        max_ranks=ranks.max_ranks,
        count_flops=count_flops,
        device=ranks.device,
        **options,
    )
    return result, reference_run(cfg, train, options.get("model"), ranks.timeout)


def report_run(
    spec: Scheme,
    world_size: int,
    cfg: GPTConfig,
    train: TrainConfig,
    result: launch.RunResult,
    reference: TrainResult,
    plan: checkpoint_plan.CheckpointPlan | None,
    options: dict,
    ranks: LaunchSettings,
) -> dict:
    """The JSON-ready report: the run's losses and parameters beside the reference's, every rank's memory and
    bytes moved in the last step, the checkpoints and the precision when the run had them, and the ``verdict``
    (:func:`course_lib.model.precision.one_device_verdict`)."""
    start = plan.start if plan is not None else 0
    rank_losses = [r["losses"] for r in result if r["losses"] is not None]
    losses = [sum(step) / len(step) for step in zip(*rank_losses, strict=True)]
    params = {}  # the union of what the ranks hold (a pipeline rank holds only its stages)
    for value in result:
        params |= value["params"] or {}
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
        "ranks": _rank_rows(result, train.steps - 1),
        "wall_s": result.wall_s,
    }
    report |= _checkpoint_notes(plan, result)
    if train.precision is not None:
        full = precision.full_precision(train)
        fp32 = (
            train_reference(cfg, full, model=options.get("model"))
            if ranks.in_process
            else reference_run(cfg, full, options.get("model"), ranks.timeout)
        )
        report["precision"] = precision.summary(train, result[0], losses, fp32.losses[start:])
        report["precision"]["rel_param_diff_vs_fp32"] = rel_param_diff(reference.params, fp32.params)
    report["verdict"] = precision.one_device_verdict(report, train)
    return report


def _rank_rows(result: launch.RunResult, last: int) -> list[dict]:
    """Each rank's coordinates, memory, and the bytes it moved and the wall time it took in step ``last``."""
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
    return ranks


def _checkpoint_notes(plan: checkpoint_plan.CheckpointPlan | None, result: launch.RunResult) -> dict:
    """The report's ``resumed_from`` (with the checkpoints of later steps the resume skipped, unfinished or damaged,
    each with why) and ``checkpoints`` entries, when the run resumed or saved."""
    notes: dict = {}
    if plan is not None and plan.resume is not None:
        saved = checkpoint_plan.read_meta(plan.resume)
        notes["resumed_from"] = {
            "path": plan.resume,
            "scheme": saved["scheme"],
            "world_size": saved["world_size"],
            "skipped": list(plan.skipped),
        }
    if plan is not None and plan.directory is not None:
        notes["checkpoints"] = {
            "directory": plan.directory,
            "every": plan.every,
            "asynchronous": plan.asynchronous,
            "saves": [value.get("checkpoint_saves", []) for value in result],
        }
    return notes


def model_on_cluster(
    report: dict,
    result: launch.RunResult,
    cluster: ClusterSettings,
    profile: HardwareProfile | None,
    topology: Topology | None,
) -> ModeledRun | None:
    """Replay the run's last step on the modeled cluster (:func:`course_lib.cluster.clock.replay`), the mesh's axes
    placed as ``cluster.placement`` says, and add its numbers to ``report`` (its bubble replaces the plan's); None
    without a hardware profile."""
    if profile is None:
        return None
    coords = [r["coords"] for r in report["ranks"]]
    gpus = placing.gpus_for(coords, topology, cluster.placement) if cluster.placement else None
    modeled = replay(
        result.programs,
        result.comm,
        profile,
        cluster.gpus_per_node,
        topology=topology,
        algorithm=cluster.algorithm,
        gpus=gpus,
    )
    report["modeled"] = modeled.summary()
    if "bubble_fraction" in report:  # the modeled clock's bubble replaces the plan's
        report["bubble_fraction"] = report["modeled"]["bubble_fraction"]
    for rank, numbers in zip(report["ranks"], modeled.per_rank(), strict=True):
        rank["modeled"] = {k: v for k, v in numbers.items() if k != "rank"}
    return modeled


def predicted_comm(
    spec: Scheme, world_size: int, cfg: GPTConfig, train: TrainConfig, settings: dict, result: launch.RunResult
) -> list[dict]:
    """The formulas' bytes per rank, plus, for a scheme whose traffic depends on the routing (MoE), what the run's
    routing sent."""
    predicted = spec.predict_comm(world_size, cfg, train, settings)
    if spec.routed_comm is None:
        return predicted
    routed = spec.routed_comm(list(result), cfg, train, settings)
    return [
        {key: row.get(key, 0.0) + extra.get(key, 0.0) for key in row | extra}
        for row, extra in zip(predicted, routed, strict=True)
    ]
