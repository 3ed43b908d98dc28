"""3D parallelism: tensor parallelism inside each pipeline stage, a pipeline across stages, data parallelism (or
ZeRO-1) over replicas of the whole pipeline (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §3, PTD-P).

Each rank sits at (dp, pp, tp) on a :class:`course_lib.mesh.Mesh`. It builds the tensor-parallel model over its TP
group, keeps the layers of its pipeline stage(s), takes its data-parallel share of every global batch and runs the
schedule with its pipeline neighbours. After the schedule: the sequence-parallel gradients are summed over TP, the
tied embedding's gradient between the first and the last stage, and every gradient averaged over DP (or
reduce-scattered to ZeRO-1 shards); then the optimizer steps. Each collective is recorded under its axis.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from course_lib import comm, launch
from course_lib.comm import ring_factor
from course_lib.memory import adamw_state_bytes
from course_lib.mesh import AXES, Mesh, axis_groups, build_mesh, check_sizes, coords_of
from course_lib.models import GPTConfig, TrainConfig, make_optimizer, optimizer_settings
from course_lib.parallel.data import all_reduce_grads, train_loop
from course_lib.parallel.interface import Option, Scheme
from course_lib.parallel.pipeline import (
    CHUNKS,
    MICROBATCHES,
    SCHEDULE,
    PipelineStage,
    PipelineSync,
    activation_peaks,
    build_stages,
    check_pipeline,
    pipeline_report,
    reference_params,
    schedule_runner,
    stage_layout,
)
from course_lib.parallel.schedules import generate
from course_lib.parallel.tensor import (
    TensorParallelGPT,
    check_tensor_parallel,
    collectives_per_step,
    sequence_parallel_grad_bytes,
    sequence_parallel_params,
    shard_shape,
    unshard,
)
from course_lib.parallel.zero import ZeroRedundancyOptimizer, bucket_sizes

ZERO1_BUCKET_MB = 0.1  # ZeRO-1's flat buffers over the data-parallel axis


class GridSync(PipelineSync):
    """What a 3D rank does after its schedule: under SP, sum the sequence-parallel gradients over TP; sum the tied
    embedding's gradient between the first and the last stage; average every gradient over DP, or with ``zero``
    reduce-scatter them to ZeRO-1 slices (whose step all-gathers the updated parameters)."""

    def __init__(self, stages: dict[int, PipelineStage], train: TrainConfig, mesh: Mesh, tied, sp: bool, zero: int):
        held = nn.ModuleList(stages.values())
        if zero:  # ZeRO-1 over the data-parallel axis; the parameters become views into its flat buffers
            trainable = [p for p in held.parameters() if p.requires_grad]
            optimizer = ZeroRedundancyOptimizer(
                trainable,
                torch.optim.AdamW,
                1,
                bucket_mb=ZERO1_BUCKET_MB,
                overlap=False,
                group=mesh.groups["dp"],
                **optimizer_settings(train),
            )
        else:
            optimizer = make_optimizer(held.parameters(), train)
        super().__init__(stages, optimizer, tied, {axis: mesh.coords[axis] for axis in AXES})
        self.mesh, self.sp, self.zero = mesh, sp, zero
        self.sp_params, self.all_params = sequence_parallel_params(held), list(held.parameters())

    def finish_gradients(self) -> None:
        if self.sp:
            all_reduce_grads(self.sp_params, self.mesh.groups["tp"])
        super().finish_gradients()
        if self.zero:
            self.optimizer.finish_gradient_synchronization()
        else:
            all_reduce_grads(self.all_params, self.mesh.groups["dp"], average=True)


def train_3d(
    cfg: GPTConfig,
    train: TrainConfig,
    tp: int = 2,
    pp: int = 2,
    dp: int = 2,
    zero: int = 0,
    sp: bool = False,
    schedule: str = "1f1b",
    microbatches: int = 4,
    chunks: int = 1,
    measure_memory: bool = True,
) -> dict:
    """Rank function: the world is a dp x pp x tp grid; see the module docstring."""
    mesh = build_mesh(dp=dp, pp=pp, tp=tp)
    tied = None  # the 2-rank group of this pipeline's first and last stage (every rank creates every such group)
    for pipeline in axis_groups("pp", mesh.sizes):
        group = comm.new_group([pipeline[0], pipeline[-1]], "embedding") if pp > 1 else None
        if pipeline == mesh.members["pp"]:
            tied = group
    model = TensorParallelGPT(cfg, train.seed, train.torch_dtype, group=mesh.groups["tp"], sp=sp)
    stages = build_stages(model.to(launch.rank_device()), mesh.coords["pp"], pp, chunks)
    strategy = GridSync(stages, train, mesh, tied, sp, zero)
    table = generate(schedule, pp, microbatches, chunks)[mesh.coords["pp"]]
    shape = (train.batch // dp // microbatches, cfg.seq // tp if sp else cfg.seq, cfg.d_model)
    run_batch = schedule_runner(
        table, stages, microbatches, shape, train.torch_dtype, peers=mesh.members["pp"], group=mesh.groups["pp"]
    )
    report = train_loop(
        strategy,
        cfg,
        train,
        measure_memory=measure_memory,
        data_rank=mesh.coords["dp"],
        data_size=dp,
        run_batch=run_batch,
    )
    params = {
        name: unshard(name, p, mesh.groups["tp"], cfg.d_model)
        for s in stages.values()
        for name, p in s.reference_names().items()
    }
    return {**report, "losses": report["losses"] if mesh.coords["pp"] == pp - 1 else None, "params": params}


# ------------------------------------------------------------------------------------------------ checks, formulas
def _axis(name: str, default: int) -> Option:
    return Option(name, f"{name.upper()} size of a grid (default {default})", int)


TP, PP, DP = _axis("tp", 2), _axis("pp", 2), _axis("dp", 2)
ZERO = Option("zero", "ZeRO-1 over the data-parallel axis", int, choices=(0, 1))
SP = Option("sp", "sequence parallel inside the tensor-parallel groups")


def validate(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    check_sizes(world_size, tp=o["tp"], pp=o["pp"], dp=o["dp"])
    check_tensor_parallel(cfg, o["tp"], o["sp"])
    if o["zero"] not in (0, 1):
        raise ValueError(f"a 3D run shards optimizer state with ZeRO-1 at most (zero 0 or 1), not {o['zero']}")
    if train.batch % o["dp"]:
        raise ValueError(f"the batch of {train.batch} sequences does not split over {o['dp']} data-parallel replicas")
    if o["schedule"] == "zb-h1" and o["tp"] > 1:
        raise ValueError(
            "zb-h1 with tensor parallelism: the course's W pass is a second backward over the retained graph, "
            "which would repeat every TP collective of the stage; use gpipe, 1f1b or interleaved, or tp 1"
        )
    check_pipeline(cfg, train.batch // o["dp"], o["pp"], o)


def _trainable_shards(stages: dict[int, PipelineStage], t: int) -> list[tuple[int, ...]]:
    """The shapes of the tensor-parallel shards of the trainable parameters a rank's stages hold."""
    return [shard_shape(name, q, t) for name, q in reference_params(stages) if q.requires_grad]


def _zero1_padded(shapes: list[tuple[int, ...]], dtype: torch.dtype, dp: int) -> list[int]:
    """Padded sizes of ZeRO-1's flat buffers over a rank's trainable shards."""
    shards = nn.ParameterList(torch.empty(shape, dtype=dtype, device="meta") for shape in shapes)
    return bucket_sizes(shards, dp, ZERO1_BUCKET_MB)


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """A rank holds its tensor-parallel shard of each tensor of its stages with AdamW's states for them, or with
    ``zero`` 1 ZeRO-1's padded flat buffers (Pad elements in k buffers): full parameters (views into the buffers)
    and gradients, 2e Pad/dp of AdamW moments and a 4-byte step counter per buffer; and the activation peak of its
    pipeline table for microbatches of b/(d m) sequences, as one rank of its tensor-parallel group keeps them."""
    sizes = check_sizes(world_size, tp=o["tp"], pp=o["pp"], dp=o["dp"])
    e, t, d = train.torch_dtype.itemsize, o["tp"], o["dp"]
    micro = train.batch // (d * o["microbatches"])
    peaks = activation_peaks(cfg, train, o["pp"], o, micro, tp=t, sp=o["sp"])
    by_stage = []
    for stages, peak in zip(stage_layout(cfg, train, o["pp"], o["chunks"]), peaks, strict=True):
        shapes = _trainable_shards(stages, t)
        frozen = sum(q.numel() for _, q in reference_params(stages) if not q.requires_grad)
        if o["zero"]:
            pad = _zero1_padded(shapes, train.torch_dtype, d)
            states = {"params": e * (sum(pad) + frozen), "grads": e * sum(math.prod(shape) for shape in shapes)}
            states["optimizer"] = 2 * e * sum(pad) // d + 4 * len(pad)
        else:
            states = adamw_state_bytes(e, sum(math.prod(shape) for shape in shapes), frozen, len(shapes))
        by_stage.append(states | {"activations": peak})
    return [dict(by_stage[coords_of(rank, sizes)["pp"]]) for rank in range(world_size)]


def predict_axis_traffic(cfg: GPTConfig, train: TrainConfig, o: dict, rank: int) -> dict:
    """Bytes one rank of a 3D grid sends per step along each axis (``o``: the run's settings).

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
    stages = stage_layout(cfg, train, p, o["chunks"])[c["pp"]]
    first, last = any(s.first for s in stages.values()), any(s.last for s in stages.values())
    layers = sorted(i for s in stages.values() for i in s.layers)
    step = collectives_per_step(cfg, micro, e, o["sp"], layers, first, last)
    tp_bytes = m * sum(ring_factor(op, t) * nbytes for *_, op, nbytes in step)
    if o["sp"]:
        tp_bytes += ring_factor("all_reduce", t) * sequence_parallel_grad_bytes(cfg, e, len(layers), last)
    seq = cfg.seq // t if o["sp"] else cfg.seq
    table = generate(o["schedule"], p, m, o["chunks"])[c["pp"]]
    out = {"tp": tp_bytes}
    if p > 1:
        out["pp"] = float(sum(a.kind.startswith("SEND") for a in table) * e * micro * seq * cfg.d_model)
    if p > 1 and (first or last):
        out["embedding"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model // t
    shapes = _trainable_shards(stages, t)
    if o["zero"]:  # reduce-scatter and all-gather of this rank's tensor-parallel shards, in padded buckets
        numel = sum(_zero1_padded(shapes, train.torch_dtype, d))
    else:
        numel = sum(math.prod(shape) for shape in shapes)
    out["dp"] = ring_factor("all_reduce", d) * e * numel
    return out


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank's bytes by axis (:func:`predict_axis_traffic`)."""
    return [predict_axis_traffic(cfg, train, o, rank) for rank in range(world_size)]


def describe(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> dict:
    return pipeline_report(o["pp"], o)


SCHEMES = (
    Scheme(
        "3d",
        "tensor parallel inside stages, pipeline across them, data parallel (or ZeRO-1) on top",
        train_3d,
        validate,
        predict_memory,
        predict_comm,
        (TP, PP, DP, ZERO, SP, SCHEDULE, MICROBATCHES, CHUNKS),
        axes=("tp", "pp", "dp"),
        describe=describe,
        layers_needed=lambda world_size, o: o["pp"] * o["chunks"],
    ),
)
