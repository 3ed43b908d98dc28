"""The toy model a student brings (tied and frozen parameters) and its training on one process, the reference
that the wrapper tests (DataParallel, ZeroRedundancyOptimizer) compare every step with."""

import torch
from torch import nn


class ToyModel(nn.Module):
    """An embedding tied to the output projection, an MLP with a frozen bias, and a frozen extra parameter."""

    def __init__(self, vocab: int = 12, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.fc2.bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.full((hidden,), 0.5), requires_grad=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale
        logits = x @ self.embed.weight.T
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int, batch: int = 24, seq: int = 5):
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randint(12, (batch, seq), generator=gen), torch.randint(12, (batch, seq), generator=gen))
        for _ in range(steps)
    ]


def make_optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def halve_lr_every_step(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def one_process(optimizer: str, steps: int, schedule: bool = False) -> list[dict[str, torch.Tensor]]:
    """Train the toy model seeded 0 on every whole batch; its state after each step (with ``schedule``, the
    learning rate halves after every step)."""
    torch.manual_seed(0)
    model = ToyModel().double()
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    scheduler = halve_lr_every_step(opt) if schedule else None
    history = []
    for x, y in batches(steps):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history
