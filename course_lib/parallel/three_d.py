"""3D and 4D parallelism: tensor parallelism inside each pipeline stage, context parallelism beside it, a pipeline
across stages, data parallelism (or ZeRO-1) over replicas of the whole pipeline (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §3, PTD-P; context parallelism as in Llama
3, Grattafiori et al. 2024, §3.3.2, with ring attention, Liu et al. 2023, §3).

Each rank sits at (dp, pp, cp, tp) on a :class:`course_lib.parallel.mesh.Mesh`. It builds the tensor-parallel model over
its TP group, keeps the layers of its pipeline stage(s), takes its data-parallel share of every global batch and, of
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

**Experts** (``ep``; an MoE tiny GPT, ``GPTConfig.experts`` > 0). The expert-parallel axis is carved out of the
data-parallel ranks, as in Megatron-core's "MoE parallel folding" (Liu et al. 2025, "MoE Parallel Folding") and
DeepSeek-V3 (DeepSeek-AI 2024, §3.2: PP 16 x DP 128 with EP 64 folded over DP): ``ep`` must divide ``dp``, and the
EP groups are ep consecutive DP replicas of a stage (``ep`` on the ledger,
:func:`course_lib.parallel.mesh.fold_experts`), over which each of the stage's MoE layers splits its experts and sends
tokens by all-to-all (:class:`course_lib.parallel.expert.AllToAllDispatcher`); the dp/ep ranks that hold the same
experts form the expert-data-parallel group (``edp``). Dense gradients are averaged over dp as before. An expert's
gradient on a rank already sums the losses of its EP group's ranks (their tokens reached it through the all-to-all),
each loss the mean over one of the dp data shares; so the edp group sums the experts' gradients over the replicas and
divides them by dp, the number of shares (with ep = dp, no edp sum: ``ep``'s division by n). The one-device reference
routes, caps and balances over the whole batch:

* with one microbatch (``microbatches`` 1), each layer's counts are gathered over the whole dp group, not just the
  EP group, so capacity (first come in token order: dp shares are blocks of the batch) and the balance loss's f_i
  are the batch's, exactly (global-batch load balancing; Qiu et al. 2025, "Demons in the Detail");
* with several microbatches, each routes on its own, as in Megatron (routing and aux loss per micro-batch): the
  reference's capacity and f_i depend on the whole batch, which exists only once every microbatch has run, and
  sum_i f_i P_i is not additive over microbatches. Per-microbatch routing is the reference's only when the model is
  dropless and has no balance loss, so ``validate`` refuses ``capacity_factor`` or ``aux_loss_coef`` > 0 then;
  the counts are gathered over the EP group only, for the all-to-all's splits. The balance loss also needs the
  whole model in one stage (a pipeline stage's backward carries no second loss).

Not built, and refused by ``validate``: experts with tp or cp > 1 (no expert tensor parallelism; CP's token chunks
are not a block of the batch in token order), with ZeRO-1 (the experts' states would shard over edp), and with
a schedule that splits off W (zb-h1, zb-h2, zb-v, dualpipev: its W pass would repeat the all-to-alls, and with TP
or CP every collective of the stage). ``routed_comm`` predicts the ``ep`` axis's all-to-all bytes from the counts
each rank reports per step, microbatch and layer. The pipeline's placement is the schedule's: in a V (zb-v,
dualpipev) rank 0 holds the first and the last stage, so there is no embedding group.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from course_lib.ledgers import comm
from course_lib.ledgers.comm import ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import adamw_state_bytes
from course_lib.model.gpt import MoE, make_optimizer, optimizer_settings
from course_lib.parallel import catalog
from course_lib.parallel.checks import grid_sizes, tokens_per_rank
from course_lib.parallel.context import (
    TensorContextParallelGPT,
    kv_traffic,
    sequence_shard,
)
from course_lib.parallel.data import all_reduce_grads, train_loop
from course_lib.parallel.expert import (
    RoutingLog,
    all_to_all_bytes,
    expert_params,
    finish_expert_gradients,
    local_experts,
    shard_experts,
    split_experts,
)
from course_lib.parallel.mesh import (
    AXES,
    Mesh,
    axis_groups,
    build_mesh,
    coords_of,
    fold_experts,
    joint_axes,
    joint_group,
)
from course_lib.parallel.pipeline import (
    PipelineStage,
    PipelineSync,
    activation_peaks,
    build_stages,
    pipeline_report,
    reference_params,
    schedule_runner,
    stage_layout,
)
from course_lib.parallel.schedules import embedding_ranks, generate
from course_lib.parallel.tensor import (
    TensorParallelGPT,
    collectives_per_step,
    sequence_parallel_grad_bytes,
    sequence_parallel_params,
    shard_shape,
    unshard,
)
from course_lib.parallel.zero import ZeroRedundancyOptimizer, bucket_sizes
from course_lib.runtime import launch

ZERO1_BUCKET_MB = 0.1  # ZeRO-1's flat buffers over the data-parallel axis


GRAD_AXES = ("dp", "cp")  # the axes over which gradients are averaged: Megatron's dp-cp group


class GridSync(PipelineSync):
    """What a grid rank does after its schedule: under SP, sum the sequence-parallel gradients over TP; sum the tied
    embedding's gradient between the first and the last stage; average every gradient over DP x CP (the dp-cp
    group ``grads``), or with ``zero`` reduce-scatter them to ZeRO-1 slices over it (whose step all-gathers the
    updated parameters). With experts, the experts' gradients are summed over the edp group instead and divided
    by DP (see the module docstring), and ``routing`` (:class:`RoutingLog`) keeps, per step, what each MoE
    layer's router counted in each forward pass (microbatch), in the order they ran."""

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
        self.sp_params = sequence_parallel_params(held)
        self.dense, self.experts = split_experts(held)
        self.routing = RoutingLog(held)

    def finish_gradients(self) -> None:
        if self.sp:
            all_reduce_grads(self.sp_params, self.mesh.groups["tp"])
        super().finish_gradients()
        if self.zero:
            self.optimizer.finish_gradient_synchronization()
        else:
            all_reduce_grads(self.dense, self.grads, average=True)
        if self.experts:
            replicas = self.mesh.groups["edp"] if len(self.mesh.members["edp"]) > 1 else None
            finish_expert_gradients(self.experts, replicas, self.mesh.sizes["dp"])
            self.routing.end_step()


def tied_embedding_group(mesh: Mesh, schedule: str, chunks: int) -> comm.Group:
    """This rank's 2-rank group of the ranks of its pipeline's first and last stage (every rank creates every such
    group); None where one rank holds both (one stage, or a V-shaped schedule)."""
    tied = None
    ends = embedding_ranks(schedule, mesh.sizes["pp"], chunks)
    for pipeline in axis_groups("pp", mesh.sizes):
        group = comm.new_group([pipeline[r] for r in ends], "embedding") if len(ends) > 1 else None
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
    ep: int = 1,
    stage_layers: tuple[int, ...] = (),
    measure_memory: bool = True,
) -> dict:
    """Rank function: the world is a dp x pp x cp x tp grid, with an MoE's experts split over ``ep`` of the dp
    ranks; see the module docstring. With experts, ``routings`` reports per step the counts of every routing (each
    microbatch's, each MoE layer's of this rank's stages, as they ran): (ranks of the counts' group, experts)."""
    mesh = build_mesh(dp=dp, pp=pp, cp=cp, tp=tp)
    tied = tied_embedding_group(mesh, schedule, chunks)
    grads, *_ = joint_group(mesh, GRAD_AXES)
    model = grid_model(cfg, train, mesh, sp, kv)
    stages = build_stages(model.to(launch.rank_device()), mesh.coords["pp"], pp, chunks, schedule, stage_layers)
    if cfg.experts:
        fold_experts(mesh, ep)
        counted = mesh.groups[counts_axis(microbatches)]
        for moe in (m for s in stages.values() for m in s.modules() if isinstance(m, MoE)):
            shard_experts(moe, mesh.groups["ep"], counted)
    strategy = GridSync(stages, train, mesh, tied, grads, sp, zero)
    table = generate(schedule, pp, microbatches, chunks)[mesh.coords["pp"]]
    run_schedule = schedule_runner(
        table,
        stages,
        microbatches,
        (train.batch // dp // microbatches, tokens_per_rank(cfg, tp, cp, sp), cfg.d_model),
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
    last = report["losses"] if any(s.last for s in stages.values()) else None
    return {**report, "losses": last, "params": params} | ({"routings": strategy.routing.steps} if cfg.experts else {})


def counts_axis(microbatches: int) -> str:
    """The axis whose group gathers an MoE layer's counts: ``dp`` with one microbatch (capacity and the balance
    loss's f_i over the whole batch), else ``ep`` (only the all-to-all's splits; see the module docstring)."""
    return "dp" if microbatches == 1 else "ep"


# ------------------------------------------------------------------------------------------------ checks, formulas


def _held_params(stages: dict[int, PipelineStage], ep: int, j: int) -> list[tuple[str, nn.Parameter]]:
    """The parameters a rank's stages hold (:func:`reference_params`) without the experts of the other ranks of its
    EP group, of which it is rank ``j`` of ``ep``."""
    others = {
        id(q)
        for s in stages.values()
        for moe in s.modules()
        if isinstance(moe, MoE)
        for name, mlp in moe.experts.items()
        if int(name) not in local_experts(moe.cfg.experts, j, ep)
        for q in mlp.parameters()
    }
    return [(name, q) for name, q in reference_params(stages) if id(q) not in others]


def _trainable_shards(
    stages: dict[int, PipelineStage], t: int, ep: int = 1, j: int = 0, experts: bool | None = None
) -> list[tuple[int, ...]]:
    """The shapes of the tensor-parallel shards of the trainable parameters a rank's stages hold, in the order its
    optimizer takes them (:class:`GridSync`: the stages' parameters), which decides ZeRO-1's buckets; as rank ``j``
    of an EP group of ``ep``, only its own experts; ``experts`` True or False: only the experts', or the others'."""
    order = {id(q): i for i, q in enumerate(nn.ModuleList(stages.values()).parameters())}
    expert = {id(q) for s in stages.values() for q in expert_params(s)}
    named = sorted(_held_params(stages, ep, j), key=lambda item: order[id(item[1])])
    return [
        shard_shape(name, q, t)
        for name, q in named
        if q.requires_grad and (experts is None or experts == (id(q) in expert))
    ]


def _zero1_padded(shapes: list[tuple[int, ...]], dtype: torch.dtype, dp: int) -> list[int]:
    """Padded sizes of ZeRO-1's flat buffers over a rank's trainable shards."""
    shards = nn.ParameterList(torch.empty(shape, dtype=dtype, device="meta") for shape in shapes)
    return bucket_sizes(shards, dp, ZERO1_BUCKET_MB)


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """A rank holds its tensor-parallel shard of each tensor of its stages with AdamW's states for them, or with
    ``zero`` 1 ZeRO-1's padded flat buffers over the n = d c ranks of its dp-cp group (Pad elements in k buffers):
    full parameters (views into the buffers) and gradients, 2e Pad/n of AdamW moments and a 4-byte step counter per
    buffer; and, with cp 1, the activation peak of its pipeline table for microbatches of b/(d m) sequences, as one
    rank of its tensor-parallel group keeps them (no activation formula yet for a context-parallel grid, nor for an
    MoE's, whose experts save what the router sends them). With experts, a rank holds E/ep of each MoE layer's."""
    sizes = grid_sizes(world_size, o)
    e, t, n = train.torch_dtype.itemsize, o["tp"], o["dp"] * o["cp"]
    micro = train.batch // (o["dp"] * o["microbatches"])
    layout = stage_layout(cfg, train, o["pp"], o["chunks"], o["schedule"], o["stage_layers"])
    exact = o["cp"] == 1 and not cfg.experts
    peaks = activation_peaks(cfg, train, o["pp"], o, micro, tp=t, sp=o["sp"]) if exact else [None] * len(layout)
    rows = []
    for rank in range(world_size):
        c = coords_of(rank, sizes)
        stages = layout[c["pp"]]
        shapes = _trainable_shards(stages, t, o["ep"], c["dp"] % o["ep"])
        frozen = sum(q.numel() for _, q in reference_params(stages) if not q.requires_grad)
        if o["zero"]:
            pad = _zero1_padded(shapes, train.torch_dtype, n)
            states = {"params": e * (sum(pad) + frozen), "grads": e * sum(math.prod(shape) for shape in shapes)}
            states["optimizer"] = 2 * e * sum(pad) // n + 4 * len(pad)
        else:
            states = adamw_state_bytes(e, sum(math.prod(shape) for shape in shapes), frozen, len(shapes))
        rows.append(states | ({"activations": peaks[c["pp"]]} if exact else {}))
    return rows


def predict_axis_traffic(cfg: GPTConfig, train: TrainConfig, o: dict, rank: int) -> dict:
    """Bytes one rank of a grid sends per step along each axis (``o``: the run's settings), its stage holding L
    layers and each sequence s/C of its tokens.

    tp: its stage's tensor-parallel collectives (:func:`collectives_per_step` restricted to its layers, plus the
    embedding on the first stage and the head and loss on the last, for sequences of s/C tokens) for each of the m
    microbatches of b/(d m) sequences, and under SP the sum of its sequence-parallel gradients. cp: the K/V traffic
    of :func:`course_lib.parallel.context.kv_traffic` for L x m passes of its heads' blocks, 2 (b/(d m)) (s/C) (h/t)
    elements. pp: one message of (b/(d m)) x s/C (/t under SP) x h elements per transfer in its table. embedding:
    the tied embedding's gradient shard (V/t x h) summed between the first and last stage. dp (dp-cp when both
    axes are longer than one rank; its gradients' group, :func:`course_lib.parallel.mesh.joint_group`): all-reduce of
    every gradient it holds (ZeRO-1: reduce-scatter plus all-gather of its padded buckets) over the d c ranks; with
    experts, every gradient but the experts'. The experts' (E/ep of each MoE layer) are all-reduced over the d/ep
    ranks of edp. Each MoE layer's counts, n x E int64, are all-gathered in each of the m forward passes over its
    counts' group: dp with one microbatch (n = d), else ep (n = ep). The ``ep`` axis's all-to-alls depend on the
    routing: :func:`routed_comm` adds them.
    """
    sizes = grid_sizes(o["tp"] * o["cp"] * o["pp"] * o["dp"], o)
    c, t, p, n = coords_of(rank, sizes), o["tp"], o["pp"], o["dp"] * o["cp"]
    e, m = train.torch_dtype.itemsize, o["microbatches"]
    micro = train.batch // (o["dp"] * m)
    stages = stage_layout(cfg, train, p, o["chunks"], o["schedule"], o["stage_layers"])[c["pp"]]
    first, last = any(s.first for s in stages.values()), any(s.last for s in stages.values())
    tied = len(embedding_ranks(o["schedule"], p, o["chunks"])) > 1
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
        tokens = tokens_per_rank(cfg, t, o["cp"], o["sp"])
        out["pp"] = float(sum(a.kind.startswith("SEND") for a in table) * e * micro * tokens * cfg.d_model)
    if tied and (first or last):
        out["embedding"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model // t
    ep, j = o["ep"], c["dp"] % o["ep"]
    shapes = _trainable_shards(stages, t, ep, j, experts=False if cfg.experts else None)
    if o["zero"]:  # reduce-scatter and all-gather of this rank's tensor-parallel shards, in padded buckets
        numel = sum(_zero1_padded(shapes, train.torch_dtype, n))
    else:
        numel = sum(math.prod(shape) for shape in shapes)
    grads = "-".join(joint_axes(sizes, GRAD_AXES))
    out[grads] = out.get(grads, 0.0) + ring_factor("all_reduce", n) * e * numel
    if cfg.experts:
        axis = counts_axis(m)
        n_counts = o[axis]
        out[axis] = (
            out.get(axis, 0.0) + m * len(layers) * ring_factor("all_gather", n_counts) * n_counts * cfg.experts * 8
        )
        replicas = o["dp"] // ep
        if replicas > 1:
            held = sum(math.prod(shape) for shape in _trainable_shards(stages, t, ep, j, experts=True))
            out["edp"] = ring_factor("all_reduce", replicas) * e * held
    return out


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank's bytes by axis (:func:`predict_axis_traffic`)."""
    return [predict_axis_traffic(cfg, train, o, rank) for rank in range(world_size)]


def routed_comm(results: list[dict], cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank's bytes on the ``ep`` axis in the last step: the all-to-alls of every routing it reports (each
    microbatch's, each MoE layer's), by :func:`course_lib.parallel.expert.all_to_all_bytes` on the counts of its
    counts' group (the dp group, whose EP groups are blocks of ep rows, or its EP group), at its row."""
    if not cfg.experts:
        return [{} for _ in results]
    sizes = grid_sizes(len(results), o)
    rows = []
    for rank, result in enumerate(results):
        row = coords_of(rank, sizes)["dp"] % o[counts_axis(o["microbatches"])]  # its row of the counts
        rows.append({"ep": all_to_all_bytes(result["routings"][-1], cfg, train, o["ep"])[row]})
    return rows


def describe(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> dict:
    return pipeline_report(o["pp"], o)


SCHEMES = (
    catalog.scheme(
        "3d",
        "tensor (and context) parallel inside stages, pipeline across them, data parallel (or ZeRO-1) on top, an "
        "MoE's experts split over ep of the data-parallel ranks",
        train_3d,
        predict_memory,
        predict_comm,
        describe=describe,
        routed_comm=routed_comm,
    ),
)
