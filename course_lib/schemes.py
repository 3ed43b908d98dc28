"""The equivalence harness: run a parallel scheme on real ranks, train the single-device reference beside it, and
report both — losses, parameter differences, and every rank's memory and bytes moved, each beside its prediction.

Each scheme is a rank function ``fn(cfg, train, **options) -> dict`` with ``losses`` (this rank's per-step losses
over the rows it saw, or None when it saw no loss), ``params`` (the full parameters by name on ranks that hold
them, else None), ``memory`` (a :class:`course_lib.memory.MemoryReport` dict of the last step) and ``coords``.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib import comm, launch
from course_lib.comm import ring_factor
from course_lib.hardware import ModeledRun, get_profile, replay
from course_lib.memory import tiny_gpt_activation_bytes
from course_lib.mesh import check_sizes, coords_of
from course_lib.models import (
    GPTConfig,
    TinyGPT,
    TrainConfig,
    TrainResult,
    count_params,
    max_param_diff,
    rel_param_diff,
    train_reference,
)
from course_lib.parallel.data import split_into_buckets, train_data_parallel
from course_lib.parallel.pipeline import PipelineStage, split_layers, train_pipeline
from course_lib.parallel.schedules import bubble_formula, default_costs, simulate
from course_lib.parallel.schedules import generate as generate_schedule
from course_lib.parallel.schedules import validate as validate_schedule
from course_lib.parallel.tensor import (
    check_tensor_parallel,
    collectives_per_step,
    sequence_parallel_grad_bytes,
    sharding,
    train_tensor_parallel,
)
from course_lib.parallel.three_d import ZERO1_BUCKET_BYTES, train_3d
from course_lib.parallel.zero import FlatShard, flat_sizes, train_zero


@dataclass(frozen=True)
class Scheme:
    name: str
    rank_fn: Callable
    summary: str
    options: tuple[str, ...] = ()
    fixed: dict = field(default_factory=dict)
    single_rank: bool = False
    splits_batch: bool = True  # data parallel: each rank takes its share of the batch


_DP_OPTIONS = ("bucket_mb", "overlap", "grad_accum")
SCHEMES = {
    "single": Scheme("single", train_data_parallel, "one rank, the whole batch: the baseline", single_rank=True),
    "dp": Scheme("dp", train_data_parallel, "replicate the model, split the batch, all-reduce gradients", _DP_OPTIONS),
    "zero1": Scheme("zero1", train_zero, "ZeRO-1: shard the optimizer state", _DP_OPTIONS, {"stage": 1}),
    "zero2": Scheme("zero2", train_zero, "ZeRO-2: shard optimizer state and gradients", _DP_OPTIONS, {"stage": 2}),
    "zero3": Scheme(
        "zero3",
        train_zero,
        "ZeRO-3 / FSDP: shard parameters too, gather each block when it runs",
        ("overlap", "grad_accum", "reshard_after_forward"),
        {"stage": 3},
    ),
    "tp": Scheme(
        "tp",
        train_tensor_parallel,
        "Megatron tensor parallel: split every layer's matmuls",
        (),
        {"sp": False},
        splits_batch=False,
    ),
    "sp": Scheme(
        "sp",
        train_tensor_parallel,
        "tensor + sequence parallel: shard the rest along the sequence",
        (),
        {"sp": True},
        splits_batch=False,
    ),
    "pp": Scheme(
        "pp",
        train_pipeline,
        "pipeline parallel: split the layers into stages, stream microbatches through them",
        ("schedule", "microbatches", "chunks"),
        splits_batch=False,
    ),
}
SCHEMES["3d"] = Scheme(
    "3d",
    train_3d,
    "tensor parallel inside stages, pipeline across them, data parallel (or ZeRO-1) on top",
    ("tp", "pp", "dp", "zero", "sp", "schedule", "microbatches", "chunks"),
    splits_batch=False,
)
PIPELINE_DEFAULTS = {"schedule": "1f1b", "microbatches": 4, "chunks": 1}
GRID_DEFAULTS = {"tp": 2, "pp": 2, "dp": 2, "zero": 0, "sp": False} | PIPELINE_DEFAULTS
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
    """Reject impossible settings before any rank starts, saying how to fix them."""
    scheme = ALIASES.get(scheme, scheme)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES) + sorted(ALIASES)}")
    spec = SCHEMES[scheme]
    unknown = set(options) - set(spec.options)
    if unknown:
        raise ValueError(f"scheme {scheme!r} takes no option(s) {sorted(unknown)}; it takes {list(spec.options)}")
    if spec.single_rank and world_size != 1:
        raise ValueError(f"scheme 'single' runs on one rank; pass world size 1, not {world_size}")
    bucket_mb = options.get("bucket_mb", 0.1)
    if bucket_mb is not None and bucket_mb <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_mb} MB; try 0.1 (or 25, PyTorch DDP's default)")
    accum = options.get("grad_accum", 1)
    if accum < 1:
        raise ValueError(f"grad_accum must be at least 1, got {accum}")
    if spec.name == "3d":
        o = GRID_DEFAULTS | options
        check_sizes(world_size, tp=o["tp"], pp=o["pp"], dp=o["dp"])
        check_tensor_parallel(cfg, o["tp"], o["sp"])
        if o["zero"] not in (0, 1):
            raise ValueError(f"a 3D run shards optimizer state with ZeRO-1 at most (zero 0 or 1), not {o['zero']}")
        if train.batch % o["dp"]:
            raise ValueError(
                f"the batch of {train.batch} sequences does not split over {o['dp']} data-parallel replicas"
            )
        if o["schedule"] == "zb-h1" and o["tp"] > 1:
            raise ValueError(
                "zb-h1 with tensor parallelism: the course's W pass is a second backward over the retained graph, "
                "which would repeat every TP collective of the stage; use gpipe, 1f1b or interleaved, or tp 1"
            )
        _check_pipeline(cfg, train.batch // o["dp"], o["pp"], o)
        return spec
    if spec.name == "pp":
        _check_pipeline(cfg, train.batch, world_size, PIPELINE_DEFAULTS | options)
        return spec
    if not spec.splits_batch:
        check_tensor_parallel(cfg, world_size, spec.fixed.get("sp", False))
        return spec
    if world_size > train.batch:
        raise ValueError(
            f"world size {world_size} is larger than the global batch of {train.batch} sequences: some ranks would "
            f"get no data. Use a batch of at least {world_size} or fewer ranks."
        )
    if train.batch % (world_size * accum):
        raise ValueError(
            f"the global batch of {train.batch} sequences does not split evenly over {world_size} data-parallel "
            f"ranks x {accum} micro-batches; use a batch that is a multiple of {world_size * accum}"
        )
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


def _check_pipeline(cfg: GPTConfig, batch: int, stages: int, o: dict) -> None:
    validate_schedule(o["schedule"], stages, o["microbatches"], o["chunks"])
    split_layers(cfg.layers, stages * o["chunks"])
    if batch % o["microbatches"]:
        raise ValueError(f"the batch of {batch} sequences does not split into {o['microbatches']} equal microbatches")


def _layout(
    scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict
) -> tuple[TinyGPT, list[int]]:
    model = TinyGPT(cfg, dtype=train.torch_dtype)  # bucket boundaries depend on the element size
    if not scheme.startswith("zero"):
        return model, []
    stage = SCHEMES[scheme].fixed["stage"]
    return model, flat_sizes(model, world_size, stage, int(options.get("bucket_mb", 0.1) * 1e6))


def predict_memory(
    scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict
) -> list[dict] | None:
    """Predicted bytes per rank by category, for comparison with what the ranks measured.

    With e bytes per element, P trainable and F frozen parameters and T trainable tensors: DP keeps eP + eF of
    parameters, eP of gradients and 2eP + 4T of AdamW state (two moments, a 4-byte step counter per tensor). ZeRO,
    whose flat buffers are padded to a multiple of n (Pad elements in k buffers), shards over n ranks the optimizer
    state (stage 1: 2e Pad/n + 4k), then the gradients (stage 2: e Pad/n), then the parameters (stage 3: e Pad/n;
    frozen parameters stay whole). TP divides the split matrices (and the vocabulary) by t and keeps LayerNorms and
    row-parallel biases whole. Activations follow :func:`course_lib.memory.tiny_gpt_activation_bytes` for one
    micro-batch of this rank's share of the batch. Pipelines and 3D grids are predicted rank by rank
    (:func:`_predict_pipeline_memory`).
    """
    spec = SCHEMES[scheme]
    if spec.name == "3d":
        o = GRID_DEFAULTS | options
        sizes = check_sizes(world_size, tp=o["tp"], pp=o["pp"], dp=o["dp"])
        by_stage = _predict_pipeline_memory(cfg, train, o["pp"], o, tp=o["tp"], sp=o["sp"], dp=o["dp"], zero=o["zero"])
        return [dict(by_stage[coords_of(rank, sizes)["pp"]]) for rank in range(world_size)]
    if spec.name == "pp":
        return _predict_pipeline_memory(cfg, train, world_size, PIPELINE_DEFAULTS | options)
    model, sizes = _layout(scheme, world_size, cfg, train, options)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    F = count_params(model, trainable_only=False) - count_params(model)  # frozen
    e, n = train.torch_dtype.itemsize, world_size
    if sizes:
        stage, pad = spec.fixed["stage"], sum(sizes)
        row = {
            "params": e * (pad // n if stage >= 3 else pad) + e * F,
            "grads": e * (pad // n if stage >= 2 else pad),
            "optimizer": 2 * e * pad // n + 4 * len(sizes),
        }
    else:
        t = 1 if spec.splits_batch else n
        held = sum(p.numel() // t if sharding(name) else p.numel() for name, p in trainable)
        row = _states(e, held, F, len(trainable))
    if spec.splits_batch:
        micro = train.batch // (world_size * options.get("grad_accum", 1))
        row["activations"] = tiny_gpt_activation_bytes(cfg, micro, e)["total"]
    else:
        row["activations"] = tiny_gpt_activation_bytes(cfg, train.batch, e, tp=n, sp=spec.fixed["sp"])["total"]
    return [dict(row) for _ in range(world_size)]


def _states(e: int, trainable: int, frozen: int, tensors: int) -> dict:
    """Model-state bytes of a rank that holds its parameters whole: AdamW's two moments per trainable element and a
    4-byte step counter per trainable tensor."""
    return {"params": e * (trainable + frozen), "grads": e * trainable, "optimizer": 2 * e * trainable + 4 * tensors}


def _pipeline_plan(p: int, o: dict) -> dict:
    """The schedule's plan with equal F and B costs (and W = F when it splits the backward), beside the formula."""
    costs = default_costs(o["schedule"])
    plan = simulate(generate_schedule(o["schedule"], p, o["microbatches"], o["chunks"]), costs)
    return {
        **o,
        "planned_bubble_fraction": plan.bubble_fraction,
        "formula_bubble_fraction": bubble_formula(o["schedule"], p, o["microbatches"], o["chunks"], costs),
        "peak_inflight": plan.peak_inflight,
    }


@functools.lru_cache(maxsize=8)
def _pipeline_stages(cfg: GPTConfig, train: TrainConfig, p: int, chunks: int) -> list[dict[int, PipelineStage]]:
    model = TinyGPT(cfg, dtype=train.torch_dtype)
    ranges = split_layers(cfg.layers, p * chunks)
    return [
        {c: PipelineStage(model, c * p + r, p * chunks, ranges[c * p + r]) for c in range(chunks)} for r in range(p)
    ]


def _predict_pipeline_memory(
    cfg: GPTConfig,
    train: TrainConfig,
    p: int,
    o: dict,
    tp: int | None = None,
    sp: bool = False,
    dp: int = 1,
    zero: int = 0,
) -> list[dict]:
    """Per pipeline rank: the states of the stages it holds, and the peak of the activations its table keeps
    alive — a microbatch's, on a stage, from its F to its last backward pass (B, or W when the table splits them).

    In a 3D grid (``tp`` given) a rank holds its tensor-parallel shard of each tensor, sees ``1/dp`` of the batch,
    and with ``zero`` 1 keeps ZeRO-1's padded flat buffers of its shards: full parameters and gradients, 2e Pad/dp
    of AdamW moments and a 4-byte step counter per buffer."""
    e, m = train.torch_dtype.itemsize, o["microbatches"]
    micro = train.batch // (dp * m)
    acts = tiny_gpt_activation_bytes(cfg, micro, e, tp=tp, sp=sp)
    first_bytes = (8 if tp is None else 9) * micro * cfg.seq  # input token ids (and the vocabulary-parallel mask)
    stage_bytes = {True: first_bytes, False: acts["outside_layers"] - first_bytes}
    tables = generate_schedule(o["schedule"], p, m, o["chunks"])
    rows = []
    for r, stages in enumerate(_pipeline_stages(cfg, train, p, o["chunks"])):
        held = {id(q): (name, q) for s in stages.values() for name, q in s.reference_names().items()}.values()
        trainable = [(name, q) for name, q in held if q.requires_grad]
        shapes = [_shard_shape(name, q, tp or 1) for name, q in trainable]
        n_train = sum(math.prod(shape) for shape in shapes)
        frozen = sum(q.numel() for _, q in held if not q.requires_grad)
        per_mb = {
            c: len(s.layers) * acts["per_layer"]
            + (stage_bytes[True] if s.first else 0)
            + (stage_bytes[False] if s.last else 0)
            for c, s in stages.items()
        }
        split = any(a.kind == "W" for a in tables[r])
        live = peak = 0
        for a in tables[r]:
            if a.kind == "F":
                live += per_mb[a.chunk]
            elif a.kind == ("W" if split else "B"):
                live -= per_mb[a.chunk]
            peak = max(peak, live)
        if zero:
            pad = [FlatShard(b, dp, 0).padded for b in _zero1_buckets(shapes, train.torch_dtype)]
            states = {"params": e * (sum(pad) + frozen), "grads": e * sum(pad)}
            states["optimizer"] = 2 * e * sum(pad) // dp + 4 * len(pad)
        else:
            states = _states(e, n_train, frozen, len(trainable))
        rows.append(states | {"activations": peak})
    return rows


def _zero1_buckets(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """ZeRO-1's buckets over a 3D rank's trainable shards (in backward order: the reverse of the model's)."""
    shards = [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]
    return split_into_buckets(list(reversed(shards)), ZERO1_BUCKET_BYTES)


def predict_comm(scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict) -> list[dict]:
    """Predicted bytes each rank sends per step, by collective (ring accounting, see :mod:`course_lib.comm`).

    DP: all-reduce of every gradient, 2(n-1)/n x eP. ZeRO-1/2: reduce-scatter of the gradients and all-gather of
    the updated parameters, (n-1)/n x e Pad each (stage 2 reduce-scatters every micro-batch). ZeRO-3: two
    all-gathers (forward and backward, or one without resharding after forward) and one reduce-scatter per
    micro-batch. TP and SP: :func:`course_lib.parallel.tensor.collectives_per_step`. PP: each rank sends one
    activation (F) or gradient (B) of (b/m) x s x h elements per transfer in its table, and the first and last
    ranks all-reduce the tied embedding's gradient (V x h elements).
    """
    if SCHEMES[scheme].name == "3d":
        return [predict_axis_traffic(cfg, train, GRID_DEFAULTS | options, rank) for rank in range(world_size)]
    if SCHEMES[scheme].name == "pp":
        return _predict_pipeline_comm(cfg, train, world_size, PIPELINE_DEFAULTS | options)
    return [_predict_symmetric_comm(scheme, world_size, cfg, train, options)] * world_size


def predict_axis_traffic(cfg: GPTConfig, train: TrainConfig, o: dict, rank: int) -> dict:
    """Bytes one rank of a 3D grid sends per step along each axis (for 3D runs the predictions are by axis).

    tp: its stage's tensor-parallel collectives (:func:`collectives_per_step` restricted to its layers, plus the
    embedding on the first stage and the head and loss on the last) for each of the m microbatches of b/(d m)
    sequences, and under SP the sum of its sequence-parallel gradients. pp: one message of (b/(d m)) x s (/t under
    SP) x h elements per transfer in its table. embedding: the tied embedding's gradient shard (V/t x h) summed
    between the first and last stage. dp: all-reduce of every gradient it holds (ZeRO-1: reduce-scatter plus
    all-gather of its padded buckets).
    """
    sizes = check_sizes(o["tp"] * o["pp"] * o["dp"], tp=o["tp"], pp=o["pp"], dp=o["dp"])
    c, t, p, d = coords_of(rank, sizes), o["tp"], o["pp"], o["dp"]
    e, m = train.torch_dtype.itemsize, o["microbatches"]
    micro = train.batch // (d * m)
    stages = _pipeline_stages(cfg, train, p, o["chunks"])[c["pp"]]
    first, last = any(s.first for s in stages.values()), any(s.last for s in stages.values())
    layers = sorted(i for s in stages.values() for i in s.layers)
    step = collectives_per_step(cfg, micro, e, o["sp"], layers, first, last)
    tp_bytes = m * sum(ring_factor(op, t) * nbytes for *_, op, nbytes in step)
    if o["sp"]:
        tp_bytes += ring_factor("all_reduce", t) * sequence_parallel_grad_bytes(cfg, e, len(layers), last)
    seq = cfg.seq // t if o["sp"] else cfg.seq
    table = generate_schedule(o["schedule"], p, m, o["chunks"])[c["pp"]]
    out = {"tp": tp_bytes}
    if p > 1:
        out["pp"] = float(sum(a.kind.startswith("SEND") for a in table) * e * micro * seq * cfg.d_model)
    if p > 1 and (first or last):
        out["embedding"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model // t
    held = [(name, q) for s in stages.values() for name, q in s.reference_names().items() if q.requires_grad]
    shapes = [_shard_shape(name, q, t) for name, q in held]
    if o["zero"]:  # reduce-scatter and all-gather of this rank's tensor-parallel shards, in padded buckets
        numel = sum(FlatShard(b, d, 0).padded for b in _zero1_buckets(shapes, train.torch_dtype))
    else:
        numel = sum(math.prod(shape) for shape in shapes)
    out["dp"] = ring_factor("all_reduce", d) * e * numel
    return out


def _shard_shape(name: str, param, t: int) -> tuple[int, ...]:
    """The shape of a tensor-parallel rank's shard of parameter ``name``."""
    shape = list(param.shape)
    split = sharding(name)
    if split in ("rows", "heads"):
        shape[0] //= t
    elif split == "columns":
        shape[1] //= t
    return tuple(shape)


def _predict_pipeline_comm(cfg: GPTConfig, train: TrainConfig, p: int, o: dict) -> list[dict]:
    e, m = train.torch_dtype.itemsize, o["microbatches"]
    message = e * (train.batch // m) * cfg.seq * cfg.d_model
    rows = []
    for r, table in enumerate(generate_schedule(o["schedule"], p, m, o["chunks"])):
        sends = sum(a.kind.startswith("SEND") for a in table)
        row = {"send": float(sends * message), "recv": 0.0} if sends else {}
        if p > 1 and r in (0, p - 1):
            row["all_reduce"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model
        rows.append(row)
    return rows


def _predict_symmetric_comm(scheme: str, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict) -> dict:
    model, sizes = _layout(scheme, world_size, cfg, train, options)
    e, n, k = train.torch_dtype.itemsize, world_size, options.get("grad_accum", 1)
    spec = SCHEMES[scheme]
    if not spec.splits_batch:
        out: dict = {}
        for *_, op, nbytes in collectives_per_step(cfg, train.batch, e, spec.fixed["sp"]):
            out[op] = out.get(op, 0.0) + ring_factor(op, n) * nbytes
        if spec.fixed["sp"]:
            out["all_reduce"] += ring_factor("all_reduce", n) * sequence_parallel_grad_bytes(cfg, e, cfg.layers)
        return out
    if n == 1:
        return {}  # one data-parallel rank has nothing to synchronise
    if not sizes:
        return {"all_reduce": ring_factor("all_reduce", n) * e * count_params(model)}
    stage, S = spec.fixed["stage"], e * sum(sizes)
    part = ring_factor("all_gather", n) * S
    if stage == 3:
        gathers = 1 if options.get("reshard_after_forward", True) is False else 2
        return {"all_gather": gathers * k * part, "reduce_scatter": k * part}
    return {"reduce_scatter": (k if stage == 2 else 1) * part, "all_gather": part}


@functools.lru_cache(maxsize=32)
def reference_run(cfg: GPTConfig, train: TrainConfig) -> TrainResult:
    """:func:`course_lib.models.train_reference` for this configuration, trained once per process and kept (treat
    the result as read-only). With local ranks it trains in a child of the rank server, which has torch's
    optimizer machinery imported already (importing it here would cost the first run two seconds); under torchrun,
    on rank 0 alone, which sends it to the others (the scheme's run has set up their process group)."""
    if not launch.under_torchrun():
        return launch.run(train_reference, 1, cfg, train)[0]
    result = [train_reference(cfg, train) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def run_scheme(
    scheme: str,
    world_size: int,
    cfg: GPTConfig = GPTConfig(),
    train: TrainConfig = TrainConfig(),
    backend: str = "auto",
    timeout: float = 120.0,
    hardware: str | None = None,
    gpus_per_node: int | None = None,
    patch: tuple[str, str, Callable] | None = None,
    stall_timeout: float = 20.0,
    max_ranks: int | None = None,
    in_process: bool = False,
    **options,
) -> SchemeRun:
    """Train with ``scheme`` on ``world_size`` ranks and compare with :func:`train_reference`; with ``hardware``
    (a profile of :mod:`course_lib.hardware`), also replay the last step on that modeled cluster. ``patch`` =
    (module, "Class.attribute" or "function", replacement) swaps one component inside every rank (bug hunts).
    ``timeout``, ``stall_timeout`` and ``max_ranks`` go to :func:`course_lib.launch.run`; ``in_process`` runs a
    one-rank scheme and its reference in this process (:func:`course_lib.launch.run_here`), starting nothing."""
    spec = validate(scheme, world_size, cfg, train, options)
    profile = get_profile(hardware) if hardware is not None else None
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, not {gpus_per_node}")
    rank_fn = functools.partial(_patched, spec.rank_fn, patch) if patch else spec.rank_fn
    if in_process:
        if world_size != 1:
            raise ValueError(f"in_process runs one rank, not {world_size}; use the launcher for more")
        result = launch.run_here(rank_fn, cfg, train, count_flops=profile is not None, **spec.fixed, **options)
        reference = train_reference(cfg, train)
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
            **spec.fixed,
            **options,
        )
        reference = reference_run(cfg, train)
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
        "dtype": train.dtype,
        "options": options,
        "params": count_params(TinyGPT(cfg)),
        "steps": train.steps,
        "losses": losses,
        "reference_losses": list(reference.losses),
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)),
        "max_abs_param_diff": max_param_diff(params, reference.params),
        "rel_param_diff": rel_param_diff(params, reference.params),
        "ranks": ranks,
        "wall_s": result.wall_s,
    }
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"{scheme}: losses are not finite: {losses}")
    if spec.name in ("pp", "3d"):
        o = (PIPELINE_DEFAULTS if spec.name == "pp" else GRID_DEFAULTS) | options
        report["pipeline"] = _pipeline_plan(o.get("pp", world_size), {k: o[k] for k in PIPELINE_DEFAULTS})
        report["bubble_fraction"] = report["pipeline"]["planned_bubble_fraction"]
    modeled = replay(result.programs, result.comm, profile, gpus_per_node) if profile is not None else None
    if modeled is not None:
        report["modeled"] = modeled.summary()
        if spec.name in ("pp", "3d"):
            report["bubble_fraction"] = report["modeled"]["bubble_fraction"]
        for rank, numbers in zip(report["ranks"], modeled.per_rank(), strict=True):
            rank["modeled"] = {k: v for k, v in numbers.items() if k != "rank"}
    return SchemeRun(
        report,
        result,
        predict_memory(spec.name, world_size, cfg, train, options),
        predict_comm(spec.name, world_size, cfg, train, options),
        modeled,
    )
