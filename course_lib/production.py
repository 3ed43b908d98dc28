"""The bridge to production: the tiny GPT trained on the same data with PyTorch's own data-parallel APIs.

Rank functions with the same signature and report as the course's schemes, so that a lesson (and
``tests/test_production.py``) can set our losses and parameters beside PyTorch's:

* :func:`train_ddp`: ``torch.nn.parallel.DistributedDataParallel`` (Li et al. 2020), which buckets the gradients
  (25 MiB by default) and all-reduces them from autograd hooks, as :class:`course_lib.parallel.data.BucketedAllReduce`.
* :func:`train_fsdp2`: FSDP2, ``torch.distributed.fsdp.fully_shard`` (Zhao et al. 2023), one FSDP unit per
  transformer block and one for the root (embedding and final LayerNorm), as our ZeRO-3.

Each step is tagged on the course timeline (forward, backward and optimizer spans with ``step``), so a run's
``result.events`` time these steps as they time ours; PyTorch's collectives bypass our ledger, so ``result.comm``
stays empty.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from course_lib import launch, trace
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, final_params, make_optimizer, synthetic_tokens
from course_lib.parallel.data import batch_shard


def _train(model: nn.Module, cfg: GPTConfig, train: TrainConfig) -> list[float]:
    """AdamW on this rank's rows of each global batch; the per-step losses of those rows."""
    rank, n, device = dist.get_rank(), dist.get_world_size(), launch.rank_device()
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
