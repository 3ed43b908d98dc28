"""Model solutions of notebook 10's exercises (:mod:`course_lib.practice.write_it`): read them after your own has passed.

Loaded by ``course_lib.practice.write_it_check.model_answers()``; nothing in ``course_lib`` imports this file.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.ledgers import comm

Partial = tuple[torch.Tensor, torch.Tensor]


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """The ring: n-1 reduce-scatter steps, then n-1 all-gather steps, one chunk to the right neighbour per step."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).chunk(n)  # views: writing a chunk writes the tensor
    right, left = (r + 1) % n, (r - 1) % n
    arrived = torch.empty_like(chunks[0])
    for k in range(n - 1):
        sending = comm.isend(chunks[(r - k) % n], right)  # a blocking send first on every rank would deadlock
        comm.recv(arrived, left)
        sending.wait()
        chunks[(r - k - 1) % n].add_(arrived)
    for k in range(n - 1):
        sending = comm.isend(chunks[(r + 1 - k) % n], right)
        comm.recv(chunks[(r - k) % n], left)
        sending.wait()


def one_f_one_b(stages: int, microbatches: int) -> list[list[str]]:
    """Each stage's 1F1B order, then every op placed at the earliest step its input and its stage allow."""
    p, m = stages, microbatches
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [f"F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            order += [f"F{warmup + i}", f"B{i}"]
        orders.append(order + [f"B{i}" for i in range(m - warmup, m)])
    done: dict[tuple[str, int], int] = {}  # (op, stage) -> the step it ran
    free = [0] * p  # each stage's first free step
    nxt = [0] * p  # each stage's next op in its order
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            op = orders[s][nxt[s]]
            needs = (op, s - 1) if op[0] == "F" else (op, s + 1) if s < p - 1 else ("F" + op[1:], s)
            if op[0] == "F" and s == 0:
                ready = 0
            elif needs in done:
                ready = done[needs] + 1
            else:
                continue  # its input has not been made yet: come back to this stage
            done[op, s] = free[s] = max(free[s], ready)
            free[s] += 1
            nxt[s] += 1
    table = [[""] * max(free) for _ in range(p)]
    for (op, s), t in done.items():
        table[s][t] = op
    return table


def dispatch_counts(choices: list[torch.Tensor], experts: int, capacity_factor: float | None = None) -> list[list[int]]:
    """Count each rank's (token, expert) pairs per expert, cap each expert over the batch in rank order, then add
    each rank's kept pairs up by the rank that holds the expert."""
    n = len(choices)
    per = experts // n
    k = choices[0].shape[1]
    tokens = sum(c.shape[0] for c in choices)
    capacity = math.inf if capacity_factor is None else math.ceil(tokens * k / experts * capacity_factor)
    taken = [0] * experts  # pairs each expert has kept so far, in the batch's order
    counts = [[0] * n for _ in range(n)]
    for src, chosen in enumerate(choices):
        for expert in chosen.reshape(-1).tolist():
            if taken[expert] < capacity:
                taken[expert] += 1
                counts[src][expert // per] += 1
    return counts


def merge_partials(a: Partial, b: Partial) -> Partial:
    """The union's log-sum-exp by logaddexp (no overflow), and each output weighted by e^(its lse - the union's)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp() + out_b * (lse_b - lse).exp(), lse
