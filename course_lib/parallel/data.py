"""Data parallelism: every rank holds the whole model, takes its slice of the global batch, and after backward the
gradients are all-reduced and averaged so that every replica takes the same optimizer step.

Naive form (Li et al. 2020, "PyTorch Distributed", §3.2): one all-reduce per gradient after backward. Its ring
cost per step is 2(n-1)/n x (bytes of all gradients) per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import comm, launch, trace
from course_lib.memory import MemoryMeter
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, final_params, make_optimizer, synthetic_tokens


def batch_shard(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A copy of rows ``rank*B/n .. (rank+1)*B/n`` of a global batch of B rows (a rank holds only its own)."""
    rows = tokens.shape[0] // world_size
    return tokens[rank * rows : (rank + 1) * rows].clone()


def allreduce_gradients(model: torch.nn.Module, group=None) -> None:
    """Average every gradient over the group: all-reduce the sum, divide by the group size."""
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group)
            p.grad.div_(n)


def train_data_parallel(cfg: GPTConfig, train: TrainConfig) -> dict:
    """Rank function: train the tiny GPT with naive data parallelism; returns this rank's losses and state."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = launch.rank_device()
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(device)
    optimizer = make_optimizer(model, train)
    losses = []
    for step in range(train.steps):
        tokens, targets = (
            batch_shard(t, rank, n).to(device) for t in synthetic_tokens(step, train.batch, cfg, train.seed)
        )
        with trace.tags(step=step), MemoryMeter(model, optimizer, device=device) as meter:
            with trace.span("forward"):
                loss = model.loss(tokens, targets)
            with trace.span("backward"):
                loss.backward()
            if n > 1:
                with trace.tags(phase="grad_sync"):
                    allreduce_gradients(model)
            with trace.span("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            launch.sync(device)
        losses.append(loss.item())
    return {"losses": losses, "params": final_params(model), "memory": meter.report().as_dict(), "coords": {"dp": rank}}
