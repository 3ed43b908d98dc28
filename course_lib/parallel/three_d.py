"""3D and 4D parallelism: tensor parallelism inside each pipeline stage, context parallelism beside it, a pipeline
across stages, data parallelism (or ZeRO-1) over replicas of the whole pipeline (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §3, PTD-P; context parallelism as in Llama
3, Grattafiori et al. 2024, §3.3.2, with ring attention, Liu et al. 2023, §3).

Each rank sits at (dp, pp, cp, tp) on a :class:`course_lib.mesh.Mesh`. It builds the tensor-parallel model over its
TP group, keeps the layers of its pipeline stage(s), takes its data-parallel share of every global batch and, of
each sequence, its context-parallel chunks (r and 2C-1-r of 2C, :mod:`course_lib.parallel.context`), and runs the
schedule with its pipeline neighbours. Inside a stage CP composes with TP as in Megatron-LM: a rank holds its TP
shard of the heads and its CP chunks of the tokens, and each of its heads attends over the CP group by ring
attention (or all-gather); everything else in a layer is token-wise and runs on its own tokens, with TP's
collectives over the TP group (under SP, TP further splits the rank's tokens). Pipeline messages carry a rank's
tokens only: (b/(d m), s/C, h). After the schedule: the sequence-parallel gradients are summed over TP, the tied
embedding's gradient between the first and the last stage, and every gradient averaged over DP x CP jointly, in
Megatron's dp-cp group (each CP rank's loss is the mean over its own tokens, all equally many, and ring attention's
backward already returned every K/V gradient to its owner, so the CP ranks' gradients average to the replica's,
exactly as DP replicas' do), or reduce-scattered over that group to ZeRO-1 shards; then the optimizer steps. Each
collective is recorded under its axis (``dp-cp`` for the joint group, when both axes are longer than one rank).

One scheme rather than a separate ``4d``: CP is one more axis of the same grid, with the same stage, schedule and
gradient code; ``cp 1`` (the default) is the 3D scheme unchanged, with the one-device attention.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from course_lib import comm, launch
from course_lib.comm import ring_factor
from course_lib.memory import adamw_state_bytes
from course_lib.mesh import AXES, Mesh, axis_groups, build_mesh, check_sizes, coords_of, joint_axes, joint_group
from course_lib.models import GPTConfig, TrainConfig, make_optimizer, optimizer_settings
from course_lib.parallel.context import (
    KV,
    TensorContextParallelGPT,
    check_context_parallel,
    kv_traffic,
    sequence_shard,
)
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


GRAD_AXES = ("dp", "cp")  # the axes over which gradients are averaged: Megatron's dp-cp group


class GridSync(PipelineSync):
    """What a grid rank does after its schedule: under SP, sum the sequence-parallel gradients over TP; sum the tied
    embedding's gradient between the first and the last stage; average every gradient over DP x CP (the dp-cp
    group ``grads``), or with ``zero`` reduce-scatter them to ZeRO-1 slices over it (whose step all-gathers the
    updated parameters)."""

    def __init__(
        self, stages: dict[int, PipelineStage], train: TrainConfig, mesh: Mesh, tied, grads, sp: bool, zero: int
    ):
        held = nn.ModuleList(stages.values())
        if zero:  # ZeRO-1 over the dp-cp group; the parameters become views into its flat buffers
            trainable = [p for p in held.parameters() if p.requires_grad]
            optimizer = ZeroRedundancyOptimizer(
                trainable,
                torch.optim.AdamW,
                1,
                bucket_mb=ZERO1_BUCKET_MB,
                overlap=False,
                group=grads,
                **optimizer_settings(train),
            )
        else:
            optimizer = make_optimizer(held.parameters(), train)
        super().__init__(stages, optimizer, tied, {axis: mesh.coords[axis] for axis in AXES})
        self.mesh, self.grads, self.sp, self.zero = mesh, grads, sp, zero
        self.sp_params, self.all_params = sequence_parallel_params(held), list(held.parameters())

    def finish_gradients(self) -> None:
        if self.sp:
            all_reduce_grads(self.sp_params, self.mesh.groups["tp"])
        super().finish_gradients()
        if self.zero:
            self.optimizer.finish_gradient_synchronization()
        else:
            all_reduce_grads(self.all_params, self.grads, average=True)


def tied_embedding_group(mesh: Mesh) -> comm.Group:
    """This rank's 2-rank group of its pipeline's first and last stage (every rank creates every such group)."""
    tied = None
    for pipeline in axis_groups("pp", mesh.sizes):
        group = comm.new_group([pipeline[0], pipeline[-1]], "embedding") if mesh.sizes["pp"] > 1 else None
        if pipeline == mesh.members["pp"]:
            tied = group
    return tied


def grid_model(cfg: GPTConfig, train: TrainConfig, mesh: Mesh, sp: bool, kv: str) -> TensorParallelGPT:
    """The tensor-parallel GPT over the rank's TP group; with a CP group longer than one rank, its heads attend
    over that group (one CP rank keeps the one-device attention)."""
    if mesh.sizes["cp"] == 1:
        return TensorParallelGPT(cfg, train.seed, train.torch_dtype, group=mesh.groups["tp"], sp=sp)
    return TensorContextParallelGPT(
        cfg, train.seed, train.torch_dtype, mesh.groups["tp"], sp, cp_group=mesh.groups["cp"], kv=kv
    )


def train_3d(
    cfg: GPTConfig,
    train: TrainConfig,
    tp: int = 2,
    cp: int = 1,
    pp: int = 2,
    dp: int = 2,
    kv: str = "ring",
    zero: int = 0,
    sp: bool = False,
    schedule: str = "1f1b",
    microbatches: int = 4,
    chunks: int = 1,
    measure_memory: bool = True,
) -> dict:
    """Rank function: the world is a dp x pp x cp x tp grid; see the module docstring."""
    mesh = build_mesh(dp=dp, pp=pp, cp=cp, tp=tp)
    tied = tied_embedding_group(mesh)
    grads, *_ = joint_group(mesh, GRAD_AXES)
    model = grid_model(cfg, train, mesh, sp, kv)
    stages = build_stages(model.to(launch.rank_device()), mesh.coords["pp"], pp, chunks)
    strategy = GridSync(stages, train, mesh, tied, grads, sp, zero)
    table = generate(schedule, pp, microbatches, chunks)[mesh.coords["pp"]]
    run_schedule = schedule_runner(
        table,
        stages,
        microbatches,
        (train.batch // dp // microbatches, _tokens_per_rank(cfg, tp, cp, sp), cfg.d_model),
        train.torch_dtype,
        peers=mesh.members["pp"],
        group=mesh.groups["pp"],
    )

    def run_batch(tokens: torch.Tensor, targets: torch.Tensor) -> float:  # this rank's CP chunks of each sequence
        c = mesh.coords["cp"]
        return run_schedule(sequence_shard(tokens, c, cp), sequence_shard(targets, c, cp))

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


def _tokens_per_rank(cfg: GPTConfig, tp: int, cp: int, sp: bool) -> int:
    """Tokens of each sequence a rank's activations cover between layers: s/C, and /T under SP."""
    return cfg.seq // cp // (tp if sp else 1)


# ------------------------------------------------------------------------------------------------ checks, formulas
def _axis(name: str, default: int) -> Option:
    return Option(name, f"{name.upper()} size of a grid (default {default})", int)


TP, CP, PP, DP = _axis("tp", 2), _axis("cp", 1), _axis("pp", 2), _axis("dp", 2)
ZERO = Option("zero", "ZeRO-1 over the data-parallel (x context-parallel) ranks", int, choices=(0, 1))
SP = Option("sp", "sequence parallel inside the tensor-parallel groups")


def grid_sizes(world_size: int, o: dict) -> dict[str, int]:
    """The grid's axis sizes from the settings (:func:`course_lib.mesh.check_sizes`: their product must be the
    world size)."""
    return check_sizes(world_size, tp=o["tp"], cp=o["cp"], pp=o["pp"], dp=o["dp"])


def validate(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    grid_sizes(world_size, o)
    check_context_parallel(cfg, o["cp"], o["kv"])
    check_tensor_parallel(cfg, o["tp"], False)
    if o["sp"] and _tokens_per_rank(cfg, 1, o["cp"], False) % o["tp"]:
        raise ValueError(
            f"sequence parallelism splits each rank's {cfg.seq // o['cp']} tokens of a sequence (its share of "
            f"{cfg.seq} over CP {o['cp']}) over TP {o['tp']}, which does not divide them; use a sequence length "
            f"that is a multiple of {o['cp'] * o['tp']} (and of {2 * o['cp']}), or drop sp"
        )
    if o["zero"] not in (0, 1):
        raise ValueError(f"a 3D run shards optimizer state with ZeRO-1 at most (zero 0 or 1), not {o['zero']}")
    if train.batch % o["dp"]:
        raise ValueError(f"the batch of {train.batch} sequences does not split over {o['dp']} data-parallel replicas")
    if o["schedule"] == "zb-h1" and (o["tp"] > 1 or o["cp"] > 1):
        raise ValueError(
            "zb-h1 with tensor or context parallelism: the course's W pass is a second backward over the retained "
            "graph, which would repeat every TP collective and ring step of the stage; use gpipe, 1f1b or "
            "interleaved, or tp 1 and cp 1"
        )
    check_pipeline(cfg, train.batch // o["dp"], o["pp"], o)


def _trainable_shards(stages: dict[int, PipelineStage], t: int) -> list[tuple[int, ...]]:
    """The shapes of the tensor-parallel shards of the trainable parameters a rank's stages hold, in the order its
    optimizer takes them (:class:`GridSync`: the stages' parameters), which decides ZeRO-1's buckets."""
    order = {id(q): i for i, q in enumerate(nn.ModuleList(stages.values()).parameters())}
    named = sorted(reference_params(stages), key=lambda item: order[id(item[1])])
    return [shard_shape(name, q, t) for name, q in named if q.requires_grad]


def _zero1_padded(shapes: list[tuple[int, ...]], dtype: torch.dtype, dp: int) -> list[int]:
    """Padded sizes of ZeRO-1's flat buffers over a rank's trainable shards."""
    shards = nn.ParameterList(torch.empty(shape, dtype=dtype, device="meta") for shape in shapes)
    return bucket_sizes(shards, dp, ZERO1_BUCKET_MB)


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """A rank holds its tensor-parallel shard of each tensor of its stages with AdamW's states for them, or with
    ``zero`` 1 ZeRO-1's padded flat buffers over the n = d c ranks of its dp-cp group (Pad elements in k buffers):
    full parameters (views into the buffers) and gradients, 2e Pad/n of AdamW moments and a 4-byte step counter per
    buffer; and, with cp 1, the activation peak of its pipeline table for microbatches of b/(d m) sequences, as one
    rank of its tensor-parallel group keeps them (no activation formula yet for a context-parallel grid)."""
    sizes = grid_sizes(world_size, o)
    e, t, n = train.torch_dtype.itemsize, o["tp"], o["dp"] * o["cp"]
    micro = train.batch // (o["dp"] * o["microbatches"])
    peaks = activation_peaks(cfg, train, o["pp"], o, micro, tp=t, sp=o["sp"])
    by_stage = []
    for stages, peak in zip(stage_layout(cfg, train, o["pp"], o["chunks"]), peaks, strict=True):
        shapes = _trainable_shards(stages, t)
        frozen = sum(q.numel() for _, q in reference_params(stages) if not q.requires_grad)
        if o["zero"]:
            pad = _zero1_padded(shapes, train.torch_dtype, n)
            states = {"params": e * (sum(pad) + frozen), "grads": e * sum(math.prod(shape) for shape in shapes)}
            states["optimizer"] = 2 * e * sum(pad) // n + 4 * len(pad)
        else:
            states = adamw_state_bytes(e, sum(math.prod(shape) for shape in shapes), frozen, len(shapes))
        by_stage.append(states | ({"activations": peak} if o["cp"] == 1 else {}))
    return [dict(by_stage[coords_of(rank, sizes)["pp"]]) for rank in range(world_size)]


def predict_axis_traffic(cfg: GPTConfig, train: TrainConfig, o: dict, rank: int) -> dict:
    """Bytes one rank of a grid sends per step along each axis (``o``: the run's settings), its stage holding L
    layers and each sequence s/C of its tokens.

    tp: its stage's tensor-parallel collectives (:func:`collectives_per_step` restricted to its layers, plus the
    embedding on the first stage and the head and loss on the last, for sequences of s/C tokens) for each of the m
    microbatches of b/(d m) sequences, and under SP the sum of its sequence-parallel gradients. cp: the K/V traffic
    of :func:`course_lib.parallel.context.kv_traffic` for L x m passes of its heads' blocks, 2 (b/(d m)) (s/C) (h/t)
    elements. pp: one message of (b/(d m)) x s/C (/t under SP) x h elements per transfer in its table. embedding:
    the tied embedding's gradient shard (V/t x h) summed between the first and last stage. dp (dp-cp when both
    axes are longer than one rank; its gradients' group, :func:`course_lib.mesh.joint_group`): all-reduce of every
    gradient it holds (ZeRO-1: reduce-scatter plus all-gather of its padded buckets) over the d c ranks.
    """
    sizes = grid_sizes(o["tp"] * o["cp"] * o["pp"] * o["dp"], o)
    c, t, p, n = coords_of(rank, sizes), o["tp"], o["pp"], o["dp"] * o["cp"]
    e, m = train.torch_dtype.itemsize, o["microbatches"]
    micro = train.batch // (o["dp"] * m)
    stages = stage_layout(cfg, train, p, o["chunks"])[c["pp"]]
    first, last = any(s.first for s in stages.values()), any(s.last for s in stages.values())
    layers = sorted(i for s in stages.values() for i in s.layers)
    local = dataclasses.replace(cfg, seq=cfg.seq // o["cp"])  # a rank's tokens of each sequence
    step = collectives_per_step(local, micro, e, o["sp"], layers, first, last)
    out = {"tp": m * sum(ring_factor(op, t) * nbytes for *_, op, nbytes in step)}
    if o["sp"]:
        out["tp"] += ring_factor("all_reduce", t) * sequence_parallel_grad_bytes(cfg, e, len(layers), last, first)
    if o["cp"] > 1:
        out["cp"] = sum(kv_traffic(cfg, micro, o["cp"], e, o["kv"], len(layers) * m, t).values())
    table = generate(o["schedule"], p, m, o["chunks"])[c["pp"]]
    if p > 1:
        tokens = _tokens_per_rank(cfg, t, o["cp"], o["sp"])
        out["pp"] = float(sum(a.kind.startswith("SEND") for a in table) * e * micro * tokens * cfg.d_model)
    if p > 1 and (first or last):
        out["embedding"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model // t
    shapes = _trainable_shards(stages, t)
    if o["zero"]:  # reduce-scatter and all-gather of this rank's tensor-parallel shards, in padded buckets
        numel = sum(_zero1_padded(shapes, train.torch_dtype, n))
    else:
        numel = sum(math.prod(shape) for shape in shapes)
    grads = "-".join(joint_axes(sizes, GRAD_AXES))
    out[grads] = out.get(grads, 0.0) + ring_factor("all_reduce", n) * e * numel
    return out


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank's bytes by axis (:func:`predict_axis_traffic`)."""
    return [predict_axis_traffic(cfg, train, o, rank) for rank in range(world_size)]


def describe(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> dict:
    return pipeline_report(o["pp"], o)


SCHEMES = (
    Scheme(
        "3d",
        "tensor (and context) parallel inside stages, pipeline across them, data parallel (or ZeRO-1) on top",
        train_3d,
        validate,
        predict_memory,
        predict_comm,
        (TP, CP, PP, DP, KV, ZERO, SP, SCHEDULE, MICROBATCHES, CHUNKS),
        axes=("tp", "cp", "pp", "dp"),
        describe=describe,
        layers_needed=lambda world_size, o: o["pp"] * o["chunks"],
    ),
)
