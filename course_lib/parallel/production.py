"""The bridge to production: the tiny GPT trained on the same data with PyTorch's own data-, tensor- and pipeline-
parallel APIs.

Rank functions with the same signature and report as the course's schemes, so that a lesson (and
``tests/test_production.py``) can set our losses and parameters beside PyTorch's:

* :func:`train_ddp`: ``torch.nn.parallel.DistributedDataParallel`` (Li et al. 2020), which buckets the gradients
  (25 MiB by default) and all-reduces them from autograd hooks, as :class:`course_lib.parallel.data.DataParallel`.
* :func:`train_fsdp2`: FSDP2, ``torch.distributed.fsdp.fully_shard`` (Zhao et al. 2023), one FSDP unit per
  transformer block and one for the root (embedding and final LayerNorm), as our ZeRO-3.
* :func:`train_dtensor_tp`: tensor parallelism with DTensor (``torch.distributed.tensor.parallel``), Megatron's
  column/row-parallel split of each block over all ranks, and optionally sequence-parallel LayerNorms, as our
  :mod:`course_lib.parallel.tensor` (every rank sees the whole batch).
* :func:`train_torch_pipelining`: ``torch.distributed.pipelining`` (``PipelineStage`` driven by ``ScheduleGPipe``,
  ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``) over the stages that our
  :func:`course_lib.parallel.pipeline.build_stages` cuts, as our :mod:`course_lib.parallel.pipeline`.
* :func:`torch_all_to_all`: PyTorch's differentiable ``all_to_all_single`` (``torch.distributed.nn.functional``,
  what torchtitan's expert-parallel dispatcher sends tokens with), a drop-in for the one our ``ep`` scheme uses
  (``run_scheme("ep", ..., patch=TORCH_ALL_TO_ALL)``).
* :func:`torch_head_tail_positions`: the token positions PyTorch's context parallelism gives each rank
  (its head-tail load balancer, ``_HeadTailLoadBalancer``, private in this version), to set beside ours.
* :func:`train_torch_context_parallel`: ``torch.distributed.tensor.experimental.context_parallel``, PyTorch's ring
  attention around ``scaled_dot_product_attention``; it supports only the CUDA attention kernels, so it runs on
  two or more GPUs only.

Each step is tagged on the course timeline (forward, backward and optimizer spans with ``step``; per microbatch
under pipelining), so a run's ``result.events`` time these steps as they time ours; PyTorch's collectives and
transfers bypass our ledger, so ``result.comm`` stays empty.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from course_lib.ledgers import trace
from course_lib.ledgers.comm import Group
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TinyGPT, final_params, make_optimizer, synthetic_tokens
from course_lib.parallel.data import all_reduce_grads, batch_shard
from course_lib.parallel.pipeline import build_stages, stage_params
from course_lib.parallel.schedules import validate
from course_lib.parallel.tensor import check_tensor_parallel
from course_lib.runtime import launch


def _train(model: nn.Module, cfg: GPTConfig, train: TrainConfig, shard_batch: bool = True) -> list[float]:
    """AdamW on this rank's rows of each global batch (all of them with ``shard_batch=False``, as tensor
    parallelism needs); the per-step losses of those rows."""
    rank, n, device = dist.get_rank(), dist.get_world_size(), launch.rank_device()
    if not shard_batch:
        rank, n = 0, 1
    optimizer = make_optimizer(model.parameters(), train)
    losses = []
    for step in range(train.steps):
        batch = synthetic_tokens(step, train.batch, cfg, train.seed)
        tokens, targets = (batch_shard(t, rank, n).to(device) for t in batch)
        with trace.tags(step=step):
            with trace.span("forward"):
                logits = model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            with trace.span("backward"):
                loss.backward()
            with trace.span("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                launch.sync(device)
        losses.append(loss.item())
    return losses


def train_ddp(cfg: GPTConfig, train: TrainConfig, bucket_cap_mb: float | None = None) -> dict:
    """Rank function: PyTorch DDP (``torch.nn.parallel.DistributedDataParallel``) over the tiny GPT.

    DDP registers only parameters that require grad (the frozen position embedding is left out) and sees the tied
    embedding/head weight once, so it needs no special options. ``bucket_cap_mb`` is DDP's bucket size in MiB;
    None keeps DDP's default (25 MiB, and 1 MiB for the first bucket). Our ``bucket_mb`` counts 10^6 bytes.
    """
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    device_ids = [launch.rank_device()] if launch.rank_device().type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    losses = _train(ddp, cfg, train)
    return {"losses": losses, "params": final_params(model)}


def train_fsdp2(cfg: GPTConfig, train: TrainConfig, reshard_after_forward: bool = True) -> dict:
    """Rank function: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) over the tiny GPT.

    ``fully_shard`` is applied to each block, then to the root model, whose unit holds the remaining parameters
    (embedding, frozen position embedding, final LayerNorm). Parameters become DTensors sharded on dim 0; at the end
    ``DTensor.full_tensor()`` all-gathers each one for the comparison with the reference.
    """
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    losses = _train(model, cfg, train)
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for name, p in model.named_parameters()
    }
    return {"losses": losses, "params": params}


def _qkv_rows_by_rank(weight: torch.Tensor, t: int) -> torch.Tensor:
    """[Wq; Wk; Wv] (3h, h) -> [q_0; k_0; v_0; q_1; ...]: rank r's heads of q, k and v as one contiguous block."""
    return weight.unflatten(0, (3, t, -1)).transpose(0, 1).flatten(0, 2)


def _qkv_rows_by_projection(weight: torch.Tensor, t: int) -> torch.Tensor:
    """The inverse of :func:`_qkv_rows_by_rank`: back to [Wq; Wk; Wv]."""
    return weight.unflatten(0, (t, 3, -1)).transpose(0, 1).flatten(0, 2)


def _tensor_parallel_plan(sp: bool) -> dict[str, ParallelStyle]:
    """One block's plan: qkv and fc1 column-parallel, proj and fc2 row-parallel (Megatron's split); with ``sp``,
    LayerNorms on sequence shards, each sub-layer's input all-gathered and its output reduce-scattered."""
    if not sp:
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln1": SequenceParallel(),
        "attn": gather,
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _reduce_partial_grad(p: DTensor) -> None:
    """Post-accumulate-grad hook: all-reduce a ``Partial`` gradient to the parameter's ``Replicate`` once."""
    if any(placement.is_partial() for placement in p.grad.placements):
        p.grad = p.grad.redistribute(placements=p.placements)


def train_dtensor_tp(cfg: GPTConfig, train: TrainConfig, sp: bool = False, reduce_grads: bool = False) -> dict:
    """Rank function: PyTorch's tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``) over
    the tiny GPT's blocks, the whole world one tensor-parallel group; every rank sees the whole batch.

    The plan is Megatron's, as our :func:`course_lib.parallel.tensor.train_tensor_parallel`: ``ColwiseParallel``
    for qkv and fc1, ``RowwiseParallel`` for proj and fc2 (their biases replicated). ``ColwiseParallel`` gives rank r
    rows r*3h/t .. (r+1)*3h/t of the fused qkv weight, so its rows are first permuted into per-rank blocks
    [q_r; k_r; v_r]; each rank's attention then runs on its heads/t heads. With ``sp``, torchtitan's sequence-parallel
    plan: ``SequenceParallel`` LayerNorms, ``PrepareModuleInput`` all-gathering the sequence before each sub-layer,
    row-parallel outputs reduce-scattered to sequence shards (``Shard(1)``); the residual stream is scattered into
    sequence shards before the first block, and the final LayerNorm's output is all-gathered for the head. The
    embedding, the tied head and the cross-entropy stay replicated (ours splits them by vocabulary). Parameters are
    returned whole (``DTensor.full_tensor()``) under the reference's names and layout.

    Under SP the gradients of the sequence-parallel LayerNorms come out of backward as ``Partial`` DTensors (each rank
    holds its sequence shard's share) and DTensor reduces them lazily: AdamW's per-parameter ops all-reduce each one
    again every time they read it (three times a step). ``reduce_grads=True`` all-reduces each ``Partial`` gradient
    once, from a post-accumulate-grad hook in backward (ours sums them all in one flat all-reduce after backward).
    """
    n = dist.get_world_size()
    check_tensor_parallel(cfg, n, sp)
    device = launch.rank_device()
    mesh = DeviceMesh(device.type, list(range(n)))
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(device)
    for block in model.blocks:
        with torch.no_grad():
            block.attn.qkv.weight.copy_(_qkv_rows_by_rank(block.attn.qkv.weight, n).clone())
        block.attn.heads = cfg.heads // n
        parallelize_module(block, mesh, _tensor_parallel_plan(sp))
    if sp:
        scatter = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        parallelize_module(model.blocks[0], mesh, scatter)  # a local slice forward, an all-gather backward
        parallelize_module(model.ln_f, mesh, SequenceParallel())
        gather = PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
        parallelize_module(model.ln_f, mesh, gather)
    if reduce_grads:
        for p in model.parameters():
            if isinstance(p, DTensor) and p.requires_grad:
                p.register_post_accumulate_grad_hook(_reduce_partial_grad)
    losses = _train(model, cfg, train, shard_batch=False)
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if name.endswith("qkv.weight"):
            full = _qkv_rows_by_projection(full, n)
        params[name] = full.detach().cpu().clone()
    return {"losses": losses, "params": params}


# Our schedule names -> PyTorch's schedule classes (the interleaved one takes a list of stages, one per chunk).
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class _TracedStage(TorchPipelineStage):
    """PyTorch's ``PipelineStage`` that records each microbatch's forward and backward on the course timeline
    (tagged ``microbatch`` and ``chunk``, as our executor's spans); the transfers in between stay untimed."""

    def __init__(self, *args, chunk: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunk = chunk

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with trace.tags(microbatch=fwd_chunk_id, chunk=self.chunk), trace.span("forward"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with trace.tags(microbatch=bwd_chunk_id, chunk=self.chunk), trace.span("backward"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def train_torch_pipelining(
    cfg: GPTConfig, train: TrainConfig, schedule: str = "1f1b", microbatches: int = 4, chunks: int = 1
) -> dict:
    """Rank function: PyTorch's pipeline parallelism (``torch.distributed.pipelining``) over the tiny GPT, the whole
    world one pipeline, on the same split as our :func:`course_lib.parallel.pipeline.train_pipeline`.

    :func:`course_lib.parallel.pipeline.build_stages` cuts this rank's stages (virtual stage c*p + r for chunk c),
    and each becomes a ``torch.distributed.pipelining.PipelineStage``; ``schedule`` picks ``ScheduleGPipe``,
    ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (``chunks`` >= 2 stages per rank). Our last stage computes the
    head and the cross-entropy itself, from the targets that the schedule hands every stage of the last rank as a
    keyword argument (split into microbatches with the inputs), so the module's output is a microbatch's mean loss;
    the schedule's ``loss_fn`` only scales it by 1/m, and ``scale_grads=False`` (the schedule would otherwise divide
    the gradients by m after backward). The stages learn their activations' shapes from the first microbatch
    (PyTorch's dynamic metadata inference: one extra forward and input-gradient backward at the start of step 0,
    outside the timed spans, that leaves the parameters' gradients alone). After each step the first and the last
    stage, which both hold the tied embedding, sum its gradient (an all-reduce between ranks 0 and p-1, outside our
    ledger as PyTorch's transfers are), then AdamW. PyTorch's GPipe runs a stage's backward passes in microbatch
    order (ours in reverse), so its gradients add up in another order: equal to rounding; 1F1B and interleaved 1F1B
    match ours bit for bit.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    validate(schedule, p, microbatches, chunks)
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"PyTorch's pipelining runs the schedules {list(TORCH_SCHEDULES)}, not {schedule!r}")
    if train.batch % microbatches:
        raise ValueError(f"batch {train.batch} does not split into {microbatches} equal microbatches")
    device = launch.rank_device()
    stages = build_stages(TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(device), rank, p, chunks)
    torch_stages = [
        _TracedStage(stage, c * p + rank, p * chunks, device, chunk=c) for c, stage in sorted(stages.items())
    ]
    loss_fn = _microbatch_share(microbatches)
    cls = TORCH_SCHEDULES[schedule]
    options = {"n_microbatches": microbatches, "loss_fn": loss_fn, "scale_grads": False}
    runner = cls(torch_stages, **options) if schedule == "interleaved" else cls(torch_stages[0], **options)
    held = nn.ModuleList(stages.values())
    optimizer = make_optimizer(held.parameters(), train)
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    first, last = rank == 0, rank == p - 1
    losses = []
    for step in range(train.steps):
        tokens, targets = (t.to(device) for t in synthetic_tokens(step, train.batch, cfg, train.seed))
        step_losses: list[torch.Tensor] = []
        with trace.tags(step=step):
            args = (tokens,) if first else ()
            kwargs = {"target": targets, "targets": targets, "losses": step_losses} if last else {}
            runner.step(*args, return_outputs=False, **kwargs)
            if tied is not None and (first or last):
                dist.all_reduce(stages[0 if first else chunks - 1].tok_emb.weight.grad, group=tied)
            with trace.span("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                launch.sync(device)
        if last:
            losses.append(sum(loss.item() for loss in step_losses))
    params = stage_params(stages)
    return {"losses": losses if last else None, "params": params}


def _microbatch_share(microbatches: int):
    """The schedule's loss function: our last stage's output is already a microbatch's mean loss; scale it by 1/m."""

    def loss_fn(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss / microbatches

    return loss_fn


def torch_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    """Our :class:`course_lib.parallel.expert.AllToAll` done by PyTorch: ``input_splits[j]`` rows of ``x`` to rank
    j, ``output_splits[j]`` rows from it, and the gradients back the same way. It bypasses our ledger."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group or dist.group.WORLD)


TORCH_ALL_TO_ALL = ("course_lib.parallel.expert", "AllToAll.apply", torch_all_to_all)  # a run_scheme patch


def torch_head_tail_positions(seq: int) -> torch.Tensor:
    """Rank function: the positions 0..seq-1 sharded as PyTorch's context parallelism shards a sequence with its
    head-tail load balancer (each rank gets chunk r and chunk 2n-1-r of 2n), on a CPU device mesh."""
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(n)))
    balancer = _HeadTailLoadBalancer(seq, n, torch.device("cpu"))
    (positions,) = _context_parallel_shard(mesh, [torch.arange(seq).unsqueeze(0)], [1], load_balancer=balancer)
    return positions.squeeze(0)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def train_torch_context_parallel(cfg: GPTConfig, train: TrainConfig) -> dict:
    """Rank function: the tiny GPT with PyTorch's context parallelism over all ranks (Llama 3 §3.3.2; PyTorch's
    ``context_parallel``). Each block's attention is ``scaled_dot_product_attention``, which the context shards into
    a ring; tokens, targets and positions are split along the sequence (head-tail balanced, as ours); each rank's
    loss is the mean over its tokens, so the gradients are averaged over the ranks, as our ``cp`` does. Reports the
    mean loss over the ranks per step and the full parameters. Needs one CUDA device per rank (PyTorch's CP has no
    CPU attention kernel)."""
    device, n = launch.rank_device(), dist.get_world_size()
    if device.type != "cuda":
        raise RuntimeError("PyTorch's context parallelism runs only on the CUDA attention kernels; use --backend nccl")
    mesh = DeviceMesh("cuda", list(range(n)))
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(device)
    for block in model.blocks:
        block.attn.attend = _causal_sdpa
    optimizer = make_optimizer(model.parameters(), train)
    losses = []
    for step in range(train.steps):
        tokens, targets = (t.to(device) for t in synthetic_tokens(step, train.batch, cfg, train.seed))
        positions = torch.arange(cfg.seq, device=device)
        buffers = [tokens, targets, positions]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers=set(buffers)):
            x = model.tok_emb(tokens) + model.pos_emb[positions]
            for block in model.blocks:
                x = block(x)
            loss = model.output_loss(x, targets)
            loss.backward()
        all_reduce_grads([p for p in model.parameters() if p.requires_grad], average=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / n)
    return {"losses": losses, "params": final_params(model)}
