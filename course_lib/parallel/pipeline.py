"""Pipeline parallelism on real ranks: the tiny GPT cut into stages, driven by a schedule table.

The model's layers are split into v*p contiguous virtual stages (the embedding goes with the first, the final
LayerNorm, the tied output head and the loss with the last); rank r holds stages r, r+p, ... (one per chunk).
:func:`run_schedule` executes one rank's table from :mod:`course_lib.parallel.schedules`: it receives activations
and gradients with blocking receives, sends with non-blocking sends, runs each F, B and W on its stage, and keeps
each microbatch's activations exactly from its F to its last backward pass. The gradients of all microbatches add
up; the first and last stages, which both hold the tied embedding, sum its gradient before the optimizer step
(Narayanan et al. 2021, §3.1; Megatron-LM's embedding group). The loss of a microbatch is scaled by 1/m, so the
step is the one-device step on the whole batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm, launch, trace
from course_lib.comm import Group
from course_lib.memory import MemoryMeter
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, make_optimizer, synthetic_tokens
from course_lib.parallel.data import micro_batches
from course_lib.parallel.schedules import Action, generate


def split_layers(layers: int, stages: int) -> list[range]:
    """Contiguous layer ranges for each stage, as equal as possible (earlier stages get the extra layers)."""
    if stages > layers:
        raise ValueError(
            f"{stages} pipeline stages (ranks x chunks) for {layers} layers: every stage needs at least one layer. "
            f"Use at most {layers} stages or a deeper model."
        )
    base, extra = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


class PipelineStage(nn.Module):
    """Virtual stage ``stage`` of ``stages``: the embedding if first, its blocks, the head and loss if last."""

    def __init__(self, model: TinyGPT, stage: int, stages: int, layers: range) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
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

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or activations in; activations out, or the loss on the last stage."""
        if self.first:
            x = self.embed(x)
        for i, block in zip(self.layers, self.blocks, strict=True):
            with trace.tags(layer=i):
                x = block(x)
        return self.output_loss(x, targets) if self.last else x

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


def stage_params(stages: dict[int, PipelineStage]) -> dict[str, torch.Tensor]:
    """The parameters of this rank's stages under the one-device model's names (detached copies on CPU)."""
    return {name: p.detach().cpu().clone() for s in stages.values() for name, p in s.reference_names().items()}


def build_stages(model: TinyGPT, rank: int, p: int, chunks: int) -> dict[int, PipelineStage]:
    """Rank ``rank``'s stages by chunk, cut from ``model`` (the one-device model or its tensor-parallel version);
    the model keeps only what its embedding and loss need, so the other ranks' layers are freed."""
    ranges = split_layers(model.cfg.layers, p * chunks)
    stages = {c: PipelineStage(model, c * p + rank, p * chunks, ranges[c * p + rank]) for c in range(chunks)}
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
    (default: the whole world is the pipeline)."""
    device, m = launch.rank_device(), microbatches
    tokens, targets = (micro_batches(t, microbatches) for t in batch)
    split = any(a.kind == "W" for a in table)
    weights = {c: [p for p in s.parameters() if p.requires_grad] for c, s in stages.items()}
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
                with trace.span("forward"):
                    x = tokens[a.microbatch].to(device) if stage.first else inputs[key]
                    out = stage(x, targets[a.microbatch].to(device) if stage.last else None)
                    outputs[key] = out / m if stage.last else out
                if stage.last:
                    losses.append(out.item() / m)
            elif a.kind == "SEND_F":
                sends.append(comm.isend(outputs[key].detach(), peer(a), group))
            elif a.kind == "RECV_B":
                grads[key] = torch.empty(activation_shape, dtype=dtype, device=device)
                comm.recv(grads[key], peer(a), group)
            elif a.kind == "B":
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


def train_pipeline(
    cfg: GPTConfig,
    train: TrainConfig,
    schedule: str = "1f1b",
    microbatches: int = 4,
    chunks: int = 1,
    measure_memory: bool = True,
) -> dict:
    """Rank function: the whole world is one pipeline; every step runs ``schedule`` over ``microbatches``."""
    rank, p = dist.get_rank(), dist.get_world_size()
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    stages = build_stages(model, rank, p, chunks)
    table = generate(schedule, p, microbatches, chunks)[rank]
    held = nn.ModuleList(stages.values())
    optimizer = make_optimizer(held.parameters(), train)
    tied = comm.new_group([0, p - 1], "embedding") if p > 1 else None
    shape = (train.batch // microbatches, cfg.seq, cfg.d_model)
    losses = []
    for step in range(train.steps):
        metered = measure_memory and step == train.steps - 1  # the reported step
        meter = MemoryMeter(held, optimizer, device=launch.rank_device()) if metered else None
        with trace.tags(step=step), meter or contextlib.nullcontext():
            batch = synthetic_tokens(step, train.batch, cfg, train.seed)
            step_losses = run_schedule(table, stages, batch, microbatches, shape, train.torch_dtype)
            sum_tied_embedding(stages, tied)
            with trace.span("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            launch.sync(launch.rank_device())
        losses.append(sum(step_losses))
    params = stage_params(stages)
    last = any(s.last for s in stages.values())
    return {
        "losses": losses if last else None,
        "memory": meter.report().as_dict() if meter else None,
        "coords": {"pp": rank},
        "params": params,
    }
