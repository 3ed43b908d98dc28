"""Pipeline parallelism on real ranks: the tiny GPT cut into stages, driven by a schedule table.

The model's layers are split into v*p contiguous virtual stages (the embedding goes with the first, the final
LayerNorm, the tied output head and the loss with the last); which rank holds which is the schedule's placement
(:func:`course_lib.parallel.schedules.virtual_stage`): stages r, r+p, ... (one per chunk) in a loop, stages r and
2p-1-r in a V (ZB-V, DualPipeV). :func:`run_schedule` executes one rank's table from
:mod:`course_lib.parallel.schedules`: it receives activations and gradients with blocking receives, sends with
non-blocking sends, hands them over in memory between neighbouring stages of the same rank (the turn of a V), runs
each F, B and W on its stage, and keeps each microbatch's activations exactly from its F to its last backward pass.
The gradients of all microbatches add up; the first and last stages, which both hold the tied embedding, sum its
gradient before the optimizer step (Narayanan et al. 2021, §3.1; Megatron-LM's embedding group), unless one rank
holds both (a V), where both uses add up in the one parameter's ``.grad``. The loss of a microbatch is scaled by
1/m, so the step is the one-device step on the whole batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import adamw_state_bytes, tiny_gpt_activation_bytes
from course_lib.model.gpt import MoE, TinyGPT, make_optimizer
from course_lib.parallel import catalog
from course_lib.parallel.checks import split_layers
from course_lib.parallel.data import DataParallelStrategy, micro_batches, train_loop
from course_lib.parallel.schedule_sim import simulate
from course_lib.parallel.schedules import (
    Action,
    bubble_formula,
    chunks_per_rank,
    default_costs,
    embedding_ranks,
    generate,
    virtual_stage,
)
from course_lib.parallel.tensor import placement
from course_lib.runtime import launch
from course_lib.runtime.checkpoint_state import Held


class PipelineStage(nn.Module):
    """Virtual stage ``stage`` of ``stages``: the embedding if first, its blocks, the head and loss if last."""

    def __init__(self, model: TinyGPT, stage: int, stages: int, layers: range) -> None:
        super().__init__()
        self.index, self.first, self.last = stage, stage == 0, stage == stages - 1
        self.layers = layers
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        if self.first or self.last:
            self.tok_emb = model.tok_emb  # the first and the last stage each hold the tied embedding
        if self.first:
            self.pos_emb = model.pos_emb
        if self.last:
            self.ln_f = model.ln_f
        # The model's own embedding and loss (plain, or tensor-parallel): plain attributes, not submodules.
        self.embed, self.output_loss = model.embed, model.output_loss
        self.tp, self.tp_rank = getattr(model, "tp", 1), getattr(model, "tp_rank", 0)  # its tensor-parallel shards

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or activations in; activations out, or the loss on the last stage. A stage that
        is the whole model adds an MoE's balance losses to it, as :class:`TinyGPT` does (a stage of a longer pipeline
        does not: :mod:`course_lib.parallel.three_d` refuses a balance loss there)."""
        if self.first:
            x = self.embed(x)
        for i, block in zip(self.layers, self.blocks, strict=True):
            with trace.tags(layer=i):
                x = block(x)
        if not self.last:
            return x
        loss = self.output_loss(x, targets)
        if self.first and isinstance(self.blocks[0].mlp, MoE):
            loss = loss + sum(block.mlp.aux_loss for block in self.blocks)
        return loss

    def reference_names(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under the one-device model's names."""
        out = {
            f"blocks.{i}.{name}": p
            for i, block in zip(self.layers, self.blocks, strict=True)
            for name, p in block.named_parameters()
        }
        for name in ("tok_emb", "pos_emb", "ln_f"):
            if hasattr(self, name):
                module = getattr(self, name)
                out |= (
                    {name: module}
                    if isinstance(module, nn.Parameter)
                    else {f"{name}.{n}": p for n, p in module.named_parameters()}
                )
        return out

    def checkpoint_holdings(self) -> list[Held]:
        """This stage's trainable parameters (or tensor-parallel shards) for :mod:`course_lib.runtime.checkpoint`, under
        the one-device names. The tied embedding is saved by the first stage: the last one's copy is equal, but a grid's
        ZeRO-1 slices its optimizer state differently, and DCP deduplicates only identical pieces."""
        return [
            Held(name, p, *placement(name, p.shape, self.tp_rank, self.tp), save=self.first or name != "tok_emb.weight")
            for name, p in self.reference_names().items()
            if p.requires_grad
        ]


class Stages(nn.ModuleList):
    """A rank's pipeline stages, as its strategy's model."""

    def checkpoint_holdings(self) -> list[Held]:
        """Every stage's :meth:`PipelineStage.checkpoint_holdings`, each parameter once (saved if any stage saves
        it: a rank holding both the first and the last stage)."""
        held: dict[int, Held] = {}
        for stage in self:
            for h in stage.checkpoint_holdings():
                if id(h.param) not in held or h.save:
                    held[id(h.param)] = h
        return list(held.values())


def stage_params(stages: dict[int, PipelineStage]) -> dict[str, torch.Tensor]:
    """The parameters of this rank's stages under the one-device model's names (detached copies on CPU)."""
    return {name: p.detach().cpu().clone() for s in stages.values() for name, p in s.reference_names().items()}


def cut_stages(
    model: TinyGPT, rank: int, p: int, chunks: int, schedule: str, stage_layers: tuple[int, ...] = ()
) -> dict[int, PipelineStage]:
    """Rank ``rank``'s stages by chunk, cut from ``model``, each chunk the virtual stage the schedule places there
    (:func:`course_lib.parallel.schedules.virtual_stage`); ``chunks`` as given for the schedule (a V has 2);
    ``stage_layers``: the layers of each stage, when uneven (:func:`split_layers`)."""
    v = chunks_per_rank(schedule, chunks)
    ranges = split_layers(model.cfg.layers, p * v, stage_layers)
    where = {c: virtual_stage(schedule, rank, c, p) for c in range(v)}
    return {c: PipelineStage(model, s, p * v, ranges[s]) for c, s in where.items()}


def build_stages(
    model: TinyGPT, rank: int, p: int, chunks: int, schedule: str = "1f1b", stage_layers: tuple[int, ...] = ()
) -> dict[int, PipelineStage]:
    """Rank ``rank``'s stages by chunk (:func:`cut_stages`), cut from ``model`` (the one-device model or its
    tensor-parallel version); the model keeps only what its embedding and loss need, so the other ranks' layers
    are freed."""
    stages = cut_stages(model, rank, p, chunks, schedule, stage_layers)
    model.blocks = nn.ModuleList()
    return stages


def run_schedule(
    table: list[Action],
    stages: dict[int, PipelineStage],
    batch: tuple[torch.Tensor, torch.Tensor],
    microbatches: int,
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    peers: list[int] | None = None,
    group: Group = None,
) -> list[float]:
    """Execute one rank's table for one step on its ``batch`` (tokens, targets) cut into ``microbatches``;
    returns the losses of the microbatches it finished (last stage).

    ``peers`` maps the table's pipeline ranks to global ranks and ``group`` is the pipeline's process group
    (default: the whole world is the pipeline). Where the previous (next) stage is on this rank too, the table has
    no transfer: an F takes that stage's output, detached, as its input, and a B takes the gradient of the next
    stage's input as its output's."""
    device, m = launch.rank_device(), microbatches
    tokens, targets = (micro_batches(t, microbatches) for t in batch)
    split = any(a.kind == "W" for a in table)
    weights = {c: [p for p in s.parameters() if p.requires_grad] for c, s in stages.items()}
    local = {s.index: c for c, s in stages.items()}  # this rank's virtual stages -> their chunks
    inputs, outputs, grads, losses, sends = {}, {}, {}, [], []

    def peer(a: Action) -> int:
        return peers[a.peer] if peers else a.peer

    for a in table:
        key, stage = (a.microbatch, a.chunk), stages[a.chunk]
        with trace.tags(microbatch=a.microbatch, chunk=a.chunk):
            if a.kind == "RECV_F":
                buffer = torch.empty(activation_shape, dtype=dtype, device=device)
                comm.recv(buffer, peer(a), group)
                inputs[key] = buffer.requires_grad_(True)
            elif a.kind == "F":
                if stage.index - 1 in local and key not in inputs:  # the turn of a V: this rank's previous stage
                    inputs[key] = outputs[(a.microbatch, local[stage.index - 1])].detach().requires_grad_(True)
                with trace.span("forward"):
                    outputs[key] = _forward(stage, tokens[a.microbatch], targets[a.microbatch], inputs.get(key), m)
                if stage.last:
                    losses.append(outputs[key].item())
            elif a.kind == "SEND_F":
                sends.append(comm.isend(outputs[key].detach(), peer(a), group))
            elif a.kind == "RECV_B":
                grads[key] = torch.empty(activation_shape, dtype=dtype, device=device)
                comm.recv(grads[key], peer(a), group)
            elif a.kind == "B":
                if stage.index + 1 in local and key not in grads:  # the turn of a V: this rank's next stage
                    grads[key] = inputs.pop((a.microbatch, local[stage.index + 1])).grad
                with trace.span("backward"):
                    _backward(outputs[key], grads.get(key), inputs.get(key), split)
                if not split:
                    _forget(key, outputs, grads)
            elif a.kind == "W":
                with trace.span("weight_grad"):
                    torch.autograd.backward(outputs[key], grads.get(key), inputs=weights[a.chunk])
                _forget(key, outputs, grads)
            elif a.kind == "SEND_B":
                sends.append(comm.isend(inputs.pop(key).grad, peer(a), group))
    for handle in sends:
        handle.wait()
    return losses


def _forward(stage: PipelineStage, tokens, targets, inp, m: int) -> torch.Tensor:
    """F: the stage's output, or on the last stage its loss over ``m`` (a function, so that no local name keeps the
    microbatch's graph, and with it what a recomputed segment keeps, alive after its W)."""
    device = launch.rank_device()
    out = stage(tokens.to(device) if stage.first else inp, targets.to(device) if stage.last else None)
    return out / m if stage.last else out


def _backward(out, grad, inp, split: bool) -> None:
    """B: the whole backward of a stage, or with ``split`` only the gradient of its input (W does the weights)."""
    if not split:
        torch.autograd.backward(out, grad)
    elif inp is not None:
        (inp.grad,) = torch.autograd.grad(out, [inp], grad, retain_graph=True)


def _forget(key, *stores) -> None:
    for store in stores:
        store.pop(key, None)


def sum_tied_embedding(stages: dict[int, PipelineStage], group: Group) -> None:
    """The first and the last stage each hold the tied embedding and each computed part of its gradient (lookup,
    output head): sum the two over their 2-rank ``group`` so that both take the same step (None: one rank holds
    both, nothing to do)."""
    holder = next((s for s in stages.values() if s.first or s.last), None)
    if group is None or holder is None:
        return
    with trace.tags(phase="embedding_sync"):
        comm.all_reduce(holder.tok_emb.weight.grad, group=group)


class PipelineSync(DataParallelStrategy):
    """What a pipeline adds to the shared step (:func:`course_lib.parallel.data.train_loop`): after the schedule,
    the tied embedding's gradient summed between the first and the last stage over their 2-rank group ``tied``."""

    def __init__(
        self, stages: dict[int, PipelineStage], optimizer: torch.optim.Optimizer, tied: Group, coords: dict
    ) -> None:
        super().__init__(Stages(stages.values()), optimizer)
        self.stages, self.tied, self.coords = stages, tied, coords

    def finish_gradients(self) -> None:
        sum_tied_embedding(self.stages, self.tied)


def schedule_runner(
    table: list[Action],
    stages: dict[int, PipelineStage],
    microbatches: int,
    activation_shape: tuple[int, ...],
    dtype: torch.dtype,
    peers: list[int] | None = None,
    group: Group = None,
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The shared step's ``run_batch`` for a pipeline rank: run its table on the batch, return its losses' sum."""

    def run_batch(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        batch = (tokens, targets)
        return sum(run_schedule(table, stages, batch, microbatches, activation_shape, dtype, peers, group))

    return run_batch


def train_pipeline(
    cfg: GPTConfig,
    train: TrainConfig,
    schedule: str = "1f1b",
    microbatches: int = 4,
    chunks: int = 1,
    stage_layers: tuple[int, ...] = (),
    measure_memory: bool = True,
) -> dict:
    """Rank function: the whole world is one pipeline; every step runs ``schedule`` over ``microbatches``;
    ``stage_layers``, the layers of each stage when uneven (a stage with fewer layers, as BLOOM-176B gave the
    stages that hold the embedding and the head)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    stages = build_stages(model, rank, p, chunks, schedule, stage_layers)
    optimizer = make_optimizer(nn.ModuleList(stages.values()).parameters(), train)
    ends = embedding_ranks(schedule, p, chunks)
    tied = comm.new_group(ends, "embedding") if len(ends) > 1 else None
    strategy = PipelineSync(stages, optimizer, tied, {"pp": rank})
    table = generate(schedule, p, microbatches, chunks)[rank]
    shape = (train.batch // microbatches, cfg.seq, cfg.d_model)
    run_batch = schedule_runner(table, stages, microbatches, shape, train.torch_dtype)
    report = train_loop(
        strategy, cfg, train, measure_memory=measure_memory, data_rank=0, data_size=1, run_batch=run_batch
    )
    last = any(s.last for s in stages.values())
    return {**report, "losses": report["losses"] if last else None, "params": stage_params(stages)}


# ------------------------------------------------------------------------------------------------ checks, formulas


@functools.lru_cache(maxsize=8)
def stage_layout(
    cfg: GPTConfig, train: TrainConfig, p: int, chunks: int, schedule: str = "1f1b", stage_layers: tuple[int, ...] = ()
) -> list[dict[int, PipelineStage]]:
    """Every pipeline rank's stages (:func:`cut_stages`), cut from a one-device model (for the predictions; no
    ranks needed)."""
    model = TinyGPT(cfg, dtype=train.torch_dtype)
    return [cut_stages(model, r, p, chunks, schedule, stage_layers) for r in range(p)]


def reference_params(stages: dict[int, PipelineStage]) -> list[tuple[str, nn.Parameter]]:
    """The parameters a rank's stages hold, each once (the tied embedding may sit in two), with their names."""
    return list({id(q): (name, q) for s in stages.values() for name, q in s.reference_names().items()}.values())


def activation_peaks(
    cfg: GPTConfig, train: TrainConfig, p: int, o: dict, micro: int, tp: int | None = None, sp: bool = False
) -> list[int]:
    """Per pipeline rank, the peak of the activations its table keeps alive: a microbatch's, on a stage, from its F
    to its last backward pass (B, or W when the table splits them); ``tp``, ``sp``: one tensor-parallel rank's."""
    acts = tiny_gpt_activation_bytes(cfg, micro, train.torch_dtype.itemsize, tp=tp, sp=sp)
    first_bytes = (8 if tp is None else 9) * micro * cfg.seq  # input token ids (and the vocabulary-parallel mask)
    ends = {"first": first_bytes, "last": acts["outside_layers"] - first_bytes}
    peaks = []
    tables = generate(o["schedule"], p, o["microbatches"], o["chunks"])
    layout = stage_layout(cfg, train, p, o["chunks"], o["schedule"], o["stage_layers"])
    for table, stages in zip(tables, layout, strict=True):
        per_mb = {
            c: len(s.layers) * acts["per_layer"] + ends["first"] * s.first + ends["last"] * s.last
            for c, s in stages.items()
        }
        split = any(a.kind == "W" for a in table)
        live = peak = 0
        for a in table:
            if a.kind == "F":
                live += per_mb[a.chunk]
            elif a.kind == ("W" if split else "B"):
                live -= per_mb[a.chunk]
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Per rank: AdamW's states of the stages it holds (:func:`course_lib.model.formulas.adamw_state_bytes`) and the
    peak of the activations its table keeps alive (:func:`activation_peaks`)."""
    peaks = activation_peaks(cfg, train, world_size, o, train.batch // o["microbatches"])
    rows = []
    layout = stage_layout(cfg, train, world_size, o["chunks"], o["schedule"], o["stage_layers"])
    for stages, peak in zip(layout, peaks, strict=True):
        held = reference_params(stages)
        trainable = [q for _, q in held if q.requires_grad]
        frozen = sum(q.numel() for _, q in held if not q.requires_grad)
        e, numel = train.torch_dtype.itemsize, sum(q.numel() for q in trainable)
        states = adamw_state_bytes(e, numel, frozen, len(trainable))
        rows.append(states | {"activations": peak})
    return rows


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank sends one activation (F) or gradient (B) of (b/m) x s x h elements per send in its table, and the
    ranks of the first and the last stage, if two, all-reduce the tied embedding's gradient (V x h elements)."""
    p, e, m = world_size, train.torch_dtype.itemsize, o["microbatches"]
    message = e * (train.batch // m) * cfg.seq * cfg.d_model
    ends = embedding_ranks(o["schedule"], p, o["chunks"])
    rows = []
    for r, table in enumerate(generate(o["schedule"], p, m, o["chunks"])):
        sends = sum(a.kind.startswith("SEND") for a in table)
        row = {"send": float(sends * message), "recv": 0.0} if sends else {}
        if len(ends) > 1 and r in ends:
            row["all_reduce"] = ring_factor("all_reduce", 2) * e * cfg.vocab * cfg.d_model
        rows.append(row)
    return rows


def pipeline_report(p: int, o: dict) -> dict:
    """The report's ``pipeline`` entry: the schedule's settings and its plan with equal F and B costs (and W = F
    when it splits the backward), beside the formula; ``bubble_fraction`` is the plan's."""
    settings = {k: o[k] for k in ("schedule", "microbatches", "chunks")}
    costs = default_costs(o["schedule"])
    plan = simulate(generate(o["schedule"], p, o["microbatches"], o["chunks"]), costs)
    entry = settings | {
        "planned_bubble_fraction": plan.bubble_fraction,
        "formula_bubble_fraction": bubble_formula(o["schedule"], p, o["microbatches"], o["chunks"], costs),
        "peak_inflight": plan.peak_inflight,
    }
    return {"pipeline": entry, "bubble_fraction": plan.bubble_fraction}


def describe(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> dict:
    return pipeline_report(world_size, o)


SCHEMES = (
    catalog.scheme(
        "pp",
        "pipeline parallel: split the layers into stages, stream microbatches through them",
        train_pipeline,
        predict_memory,
        predict_comm,
        describe=describe,
    ),
)
