"""An example of "your own model" for the lessons that wrap any module (02's DataParallel, 03's ZeRO and FSDP).

It is deliberately not the tiny GPT, and it has the two things a wrapper must get right beyond plain weights: a
weight that two children share (the output head is tied to the embedding) and a frozen parameter. Any class with
the same ``forward(tokens, targets) -> mean loss`` can take its place in ``run_scheme(..., model=...)``.
"""

from __future__ import annotations

import torch
from torch import nn


class RunningAverageLM(nn.Module):
    """Each token predicts the next from its embedding and the average of the embeddings up to it.

    ``embed`` (vocab x width) maps tokens to vectors; ``mix`` (2·width -> width) combines a token's vector with the
    running average; ``head`` maps back to the vocabulary and shares its weight with ``embed`` (tied: one tensor,
    used twice); ``temperature`` divides the logits and is frozen (``requires_grad=False``).
    """

    def __init__(self, vocab: int = 128, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.temperature = nn.Parameter(torch.tensor(2.0), requires_grad=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of predicting ``targets`` (batch x seq) from ``tokens`` (batch x seq)."""
        x = self.embed(tokens)
        context = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).unsqueeze(-1)
        logits = self.head(torch.tanh(self.mix(torch.cat([x, context], -1)))) / self.temperature
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
