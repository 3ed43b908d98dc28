"""The check of the MoE dispatch exercise (:func:`course_lib.practice.write_it.dispatch_counts`): the student's table of
rows per (source, destination) rank against the course's count (the dispatcher's
:func:`course_lib.model.gpt.within_capacity` and :func:`course_lib.parallel.expert.rows_between`), and against the
tables of the usual mistakes to name the one made (capacity as in GShard: Lepikhin et al. 2020, §2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from course_lib.model.config import GPTConfig
from course_lib.model.gpt import expert_capacity, within_capacity
from course_lib.parallel.expert import rows_between
from course_lib.practice.write_it_check import Feedback, call_student, hint_for_error, one_line, over_cases

DISPATCH = "MoE dispatch counts"


@dataclass(frozen=True)
class DispatchCase:
    """A routing to count: ``ranks`` ranks of ``tokens`` tokens each, ``experts`` experts, top-``k``."""

    ranks: int
    experts: int
    k: int
    tokens: int
    capacity_factor: float | None
    seed: int


DISPATCH_CASES = (
    DispatchCase(2, 4, 2, 8, None, 0),
    DispatchCase(4, 8, 2, 6, 1.0, 1),  # the first experts are favoured, so capacity drops pairs
    DispatchCase(4, 4, 1, 5, 1.25, 2),
)


def dispatch_choices(case: DispatchCase) -> list[torch.Tensor]:
    """Each rank's top-k experts per token, from a router that favours the first experts."""
    generator = torch.Generator().manual_seed(case.seed)
    favour = torch.linspace(1.5, 0.0, case.experts)
    return [
        (torch.randn(case.tokens, case.experts, generator=generator) + favour).topk(case.k).indices
        for _ in range(case.ranks)
    ]


def _pairs(choices: list[torch.Tensor], experts: int) -> torch.Tensor:
    """(source rank, expert) pairs before capacity."""
    return torch.stack([torch.bincount(c.reshape(-1), minlength=experts) for c in choices])


def course_dispatch_counts(choices: list[torch.Tensor], experts: int, capacity_factor: float | None) -> torch.Tensor:
    """The course's count: the dispatcher's capacity over the batch and its rows per (source, destination)."""
    cfg = GPTConfig(experts=experts, top_k=choices[0].shape[1], capacity_factor=capacity_factor)
    return rows_between(within_capacity(_pairs(choices, experts), cfg), len(choices))


def _usual_mistakes(choices: list[torch.Tensor], case: DispatchCase) -> list[tuple[torch.Tensor, str]]:
    """The tables of the usual mistakes, each with what it gets wrong."""
    n, e = case.ranks, case.experts
    right = course_dispatch_counts(choices, e, case.capacity_factor)
    pairs = _pairs(choices, e)
    out = [
        (right.T, "your table is transposed: counts[src][dst] is what rank src sends rank dst"),
        (right - torch.diag(right.diag()), "the diagonal counts the rows that stay on their own rank; keep them"),
    ]
    if case.capacity_factor is None:
        tokens = [[int(((chosen // (e // n)) == dst).any(1).sum()) for dst in range(n)] for chosen in choices]
        out.append(
            (
                torch.tensor(tokens),
                "you counted tokens; count (token, expert) pairs: a token whose two experts share a rank "
                "is sent there twice",
            )
        )
    dealt = torch.stack([torch.bincount(c.reshape(-1) % n, minlength=n) for c in choices])
    out.append((dealt, f"expert x lives on rank x // (E/n) = x // {e // n} (blocks), not x mod n"))
    if case.capacity_factor is not None:
        cfg = GPTConfig(experts=e, top_k=case.k, capacity_factor=case.capacity_factor)
        capacity, own = expert_capacity(cfg, n * case.tokens), expert_capacity(cfg, case.tokens)
        out.append((rows_between(pairs, n), f"you kept every pair; each expert keeps only its first C = {capacity}"))
        out.append(
            (
                rows_between(pairs.clamp(max=own), n),
                f"you capped each rank on its own, at C = {own} from its "
                f"own tokens; C = {capacity} is over the whole batch, rank 0's tokens first, then rank 1's, ...",
            )
        )
    return out


def _as_table(result: object, n: int) -> tuple[torch.Tensor | None, str]:
    try:
        table = torch.as_tensor(result).double()
    except Exception as error:  # any object the student returns
        return None, f"it returned {type(result).__name__}, not an n x n table ({one_line(error)})"
    if table.shape != (n, n) or not torch.equal(table, table.round()):
        return None, f"it returned a table of shape {tuple(table.shape)}; it needs {n} x {n} whole numbers"
    return table.long(), ""


def _judge_dispatch(fn: Callable, case: DispatchCase) -> tuple[str, str, dict]:
    choices = dispatch_choices(case)
    cap = "no capacity" if case.capacity_factor is None else f"capacity factor {case.capacity_factor}"
    name = f"{case.ranks} ranks x {case.tokens} tokens, {case.experts} experts, top-{case.k}, {cap}"
    result, error = call_student(fn, [c.clone() for c in choices], case.experts, case.capacity_factor)
    if error:
        return f"{name}: your function raised {error}", hint_for_error(error), {}
    table, problem = _as_table(result, case.ranks)
    if table is None:
        return f"{name}: {problem}", "return counts[src][dst] for every pair of ranks", {}
    right = course_dispatch_counts(choices, case.experts, case.capacity_factor)
    dropped = case.ranks * case.tokens * case.k - int(right.sum())
    measured = f"{name} ({dropped} pairs dropped): your table {table.tolist()}, the course's {right.tolist()}"
    numbers = {"counts": right.tolist(), "dropped": dropped}
    if torch.equal(table, right):
        return measured, "", numbers
    src, dst = (int(x) for x in (table != right).nonzero()[0])
    first = f"rank {src} -> rank {dst}: you count {int(table[src, dst])} rows, the course {int(right[src, dst])}"
    named = [why for wrong, why in _usual_mistakes(choices, case) if torch.equal(table, wrong)]
    return measured, "; ".join([first, *named[:1]]), numbers


def check_dispatch_counts(
    fn: Callable[[list[torch.Tensor], int, float | None], list[list[int]]],
    cases: Sequence[DispatchCase] = DISPATCH_CASES,
) -> Feedback:
    """Call ``fn(choices, experts, capacity_factor)`` on each case's routing and compare its table with the
    course's count; the hint names the first (src, dst) pair that differs and, where the table is that of a usual
    mistake, the mistake."""
    return over_cases(DISPATCH, cases, lambda case: _judge_dispatch(fn, case))
