"""The bridge to production: the tiny GPT trained on the same data with PyTorch's own data- and tensor-parallel APIs.

Rank functions with the same signature and report as the course's schemes, so that a lesson (and
``tests/test_production.py``) can set our losses and parameters beside PyTorch's:

* :func:`train_ddp`: ``torch.nn.parallel.DistributedDataParallel`` (Li et al. 2020), which buckets the gradients
  (25 MiB by default) and all-reduces them from autograd hooks, as :class:`course_lib.parallel.data.BucketedAllReduce`.
* :func:`train_fsdp2`: FSDP2, ``torch.distributed.fsdp.fully_shard`` (Zhao et al. 2023), one FSDP unit per
  transformer block and one for the root (embedding and final LayerNorm), as our ZeRO-3.
* :func:`train_dtensor_tp`: tensor parallelism with DTensor (``torch.distributed.tensor.parallel``), Megatron's
  column/row-parallel split of each block over all ranks, and optionally sequence-parallel LayerNorms, as our
  :mod:`course_lib.parallel.tensor` (every rank sees the whole batch).

Each step is tagged on the course timeline (forward, backward and optimizer spans with ``step``), so a run's
``result.events`` time these steps as they time ours; PyTorch's collectives bypass our ledger, so ``result.comm``
stays empty.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
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

from course_lib import launch, trace
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, final_params, make_optimizer, synthetic_tokens
from course_lib.parallel.data import batch_shard
from course_lib.parallel.tensor import check_tensor_parallel


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
