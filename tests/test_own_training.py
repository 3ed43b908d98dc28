"""The practice checker for a student's own data-parallel loop: right loops are accepted, and each classic mistake
gets the verdict that names it."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import comm
from course_lib.parallel.data import DataParallel, batch_shard
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.parallel.zero import ZeroRedundancyOptimizer
from course_lib.practice.own_training import check_training


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.out = nn.Linear(16, 128)

    def forward(self, tokens, targets):
        return nn.functional.cross_entropy(self.out(self.embed(tokens)).flatten(0, 1), targets.flatten())


def mine(tokens: torch.Tensor) -> torch.Tensor:
    return batch_shard(tokens, dist.get_rank(), dist.get_world_size())


def steps(wrapper, opt, batches, rows=mine) -> None:
    """The student's loop over a wrapper with finish_gradient_synchronization (DataParallel or FSDP)."""
    for tokens, targets in batches:
        opt.zero_grad()
        wrapper(rows(tokens), rows(targets)).backward()
        wrapper.finish_gradient_synchronization()
        opt.step()


def wrapped(model, batches):
    ddp = DataParallel(model)
    steps(ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01), batches)
    return model.state_dict()


def sharded_state(model, batches):
    ddp = DataParallel(model)
    steps(ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, average_gradients=False, lr=0.01), batches)
    return model.state_dict()


def fully_sharded(model, batches):
    fsdp = FullyShardedDataParallel(model)
    steps(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=0.01), batches)
    return fsdp.full_params()


def unwrapped(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for tokens, targets in batches:
        opt.zero_grad()
        model(mine(tokens), mine(targets)).backward()
        opt.step()
    return model.state_dict()


def summed(model, batches):
    ddp = DataParallel(model)  # equal weights, but gradients summed by hand on top of the average: n times too big
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for tokens, targets in batches:
        opt.zero_grad()
        ddp(mine(tokens), mine(targets)).backward()
        ddp.finish_gradient_synchronization()
        for p in model.parameters():
            comm.all_reduce(p.grad)
        opt.step()
    return model.state_dict()


def whole_batch(model, batches):
    ddp = DataParallel(model)
    steps(ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01), batches, rows=lambda tokens: tokens)
    return model.state_dict()


@pytest.mark.parametrize("loop", [wrapped, sharded_state, fully_sharded])
def test_a_right_loop_is_accepted(loop):
    verdict = check_training(loop, Bigram, world_size=2)
    assert verdict.correct, verdict.message
    assert "trains your Bigram exactly as one process does" in str(verdict) and "its 4 rows" in str(verdict)


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        (unwrapped, "the 2 ranks hold different parameters .* Wrap the model"),
        (summed, "agree with each other but not with one process .* summed rather than averaged"),
        (whole_batch, r"the ranks saw \[24, 24\] rows over 3 steps, not 12 each: that is not data parallelism yet"),
    ],
)
def test_each_classic_mistake_is_named(loop, message):
    verdict = check_training(loop, Bigram, world_size=2)
    assert not verdict.correct
    assert re.search(message, verdict.message), verdict.message
