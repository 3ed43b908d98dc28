"""A toy scheme, written as a contributor would add one (docs/architecture.md, "Adding a scheme"): data parallelism
that all-gathers every rank's gradients and averages them itself. It trains exactly like one device, and each rank
sends (n-1) x the gradient bytes, where a ring all-reduce sends 2(n-1)/n x: the reason DDP all-reduces.

tests/test_scheme_interface.py registers it (the one registry line) and runs it through the harness and the
command line, which know nothing about it.
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib.ledgers import comm
from course_lib.ledgers.comm import ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TinyGPT, count_params, final_params, make_optimizer
from course_lib.parallel import catalog, checks, data
from course_lib.runtime import launch


class GatherGradients(data.DataParallelStrategy):
    """After backward: all-gather each gradient from every rank, then average the copies locally."""

    def finish_gradients(self) -> None:
        n = dist.get_world_size()
        for p in data.backward_order(self.model):
            flat = p.grad.reshape(-1)
            gathered = flat.new_empty(n * flat.numel())
            comm.all_gather(gathered, flat)
            p.grad.copy_(gathered.view(n, -1).mean(0).view_as(p.grad))


def train_gathered(cfg: GPTConfig, train: TrainConfig, grad_accum: int = 1, measure_memory: bool = True) -> dict:
    """Rank function: the tiny GPT on this rank's share of the batch, gradients gathered and averaged."""
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    strategy = GatherGradients(model, make_optimizer(model.parameters(), train))
    report = data.train_loop(strategy, cfg, train, grad_accum, measure_memory)
    return {**report, "params": final_params(model)}


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank receives every other rank's gradients: (n-1)/n of n copies of eP bytes."""
    n, e = world_size, train.torch_dtype.itemsize
    gathered = n * e * count_params(TinyGPT(cfg))
    return [{"all_gather": ring_factor("all_gather", n) * gathered} if n > 1 else {} for _ in range(n)]


# What parallel/catalog.py's CARDS would hold: its name, checks (plain data parallelism's) and options; no
# checkpoint (the course's checkpoints know nothing of it).
CARD = catalog.Card("gather_dp", checks.check_batch_split, options=(catalog.GRAD_ACCUM,), checkpoint=False)
SCHEMES = (
    catalog.scheme(
        CARD,
        "data parallel that all-gathers gradients: (n-1) x the bytes of one copy per rank",
        train_gathered,
        data.predict_memory,  # memory is plain data parallelism's
        predict_comm,
    ),
)
