"""The check of ring attention's merge exercise (:func:`course_lib.practice.write_it.merge_partials`): blockwise
attention (:func:`course_lib.parallel.context.attend_block`) merged by the student's function against attention over all
the keys at once, float64, 1e-10; the log-sum-exp and the output measured apart (the online-softmax merge of Milakov &
Gimelshein 2018, as ring attention uses it: Liu et al. 2023, §3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from course_lib.parallel.context import attend_block
from course_lib.practice.write_it_check import Feedback, call_student, hint_for_error, over_cases

TOLERANCE = 1e-10  # float64: a right merge matches attention over all keys to ~1e-15

MERGE = "merge of partial attentions"


@dataclass(frozen=True)
class MergeCase:
    """Queries attending to ``blocks`` key blocks (the last one on the diagonal, causal), scores scaled by
    ``scale``, merged as ring attention merges them: the own block first, then each one received."""

    name: str
    blocks: int
    scale: float


MERGE_CASES = (
    MergeCase("two blocks", 2, 1.0),
    MergeCase("two blocks, scores in the hundreds", 2, 400.0),
    MergeCase("three blocks, merged as a ring of three steps", 3, 1.0),
)


def merge_inputs(case: MergeCase, queries: int = 6, dim: int = 4) -> tuple[list, tuple[torch.Tensor, torch.Tensor]]:
    """The case's partial attentions (the course's blockwise attention, float64), own block first, and attention
    over all their keys at once: (output, log-sum-exp)."""
    generator = torch.Generator().manual_seed(case.blocks)
    q = torch.randn(2, 2, queries, dim, generator=generator, dtype=torch.float64) * case.scale / math.sqrt(dim)
    k, v = (torch.randn(2, 2, case.blocks * queries, dim, generator=generator, dtype=torch.float64) for _ in "kv")
    future = torch.ones(queries, queries, dtype=torch.bool).triu(1)  # the own block: causal
    blocks = list(zip(k.split(queries, -2), v.split(queries, -2), strict=True))
    partials = [attend_block(q, *blocks[-1], future)] + [attend_block(q, kb, vb) for kb, vb in blocks[-2::-1]]
    scores = q @ k.transpose(-2, -1)
    scores[..., -queries:] = scores[..., -queries:].masked_fill(future, float("-inf"))
    return partials, (torch.softmax(scores, -1) @ v, scores.logsumexp(-1, keepdim=True))


def _merge_diagnosis(a: tuple, b: tuple, out: torch.Tensor, lse: torch.Tensor, want: tuple) -> str:
    """Which part is off, and the usual mistake it matches."""
    (oa, la), (ob, lb) = a, b
    right_lse = torch.logaddexp(la, lb)

    def near(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.shape == y.shape and bool(((x - y).abs() <= TOLERANCE * (1 + y.abs())).all())

    lse_ok, out_ok = near(lse, want[1]), near(out, want[0])
    if not lse_ok:
        named = {
            "max(l_a, l_b)": torch.maximum(la, lb),
            "l_a + l_b": la + lb,
            "log((e^l_a + e^l_b) / 2)": right_lse - math.log(2),
        }
        guess = next((f": yours is {name}" for name, x in named.items() if near(lse, x)), "")
        follows = near(out, oa * (la - lse).exp() + ob * (lb - lse).exp()) and not out_ok
        also = "; the output's weights follow your log-sum-exp, so fixing it fixes both" if follows else ""
        return f"the log-sum-exp is off{guess}; the union's is log(e^l_a + e^l_b) (torch.logaddexp){also}"
    named = {
        "(o_a + o_b) / 2, a plain average": (oa + ob) / 2,
        "o_a + o_b: the weights must add up to 1": oa + ob,
        "the weights swapped": oa * (lb - right_lse).exp() + ob * (la - right_lse).exp(),
        "e^l_a o_a + e^l_b o_b, not divided by e^l": oa * la.exp() + ob * lb.exp(),
    }
    guess = next((f": yours is {name}" for name, x in named.items() if near(out, x)), "")
    return (
        f"the log-sum-exp is right but the output is off{guess}; weight each partial by its share of the softmax's "
        "mass, e^(l_i - l)"
    )


def _merged(fn: Callable, partials: list) -> tuple[tuple | None, str, str]:
    """The partials merged by ``fn`` in ring order, or (None, what happened, hint)."""
    merged = partials[0]
    for step, received in enumerate(partials[1:], 1):
        result, error = call_student(fn, tuple(t.clone() for t in merged), tuple(t.clone() for t in received))
        if error:
            return None, f"merge {step} raised {error}", hint_for_error(error)
        if not (isinstance(result, tuple | list) and len(result) == 2 and all(torch.is_tensor(t) for t in result)):
            return None, f"merge {step} returned {type(result).__name__}", "return the pair (out, lse)"
        merged = tuple(result)
    return merged, "", ""


def _judge_merge(fn: Callable, case: MergeCase) -> tuple[str, str, dict]:
    """(measured, hint, numbers) of one case; an empty hint when it passes."""
    partials, want = merge_inputs(case)
    merged, what, hint = _merged(fn, partials)
    if merged is None:
        return f"{case.name}: {what}", hint, {}
    out, lse = merged
    if out.shape != want[0].shape or lse.shape != want[1].shape:
        shapes = f"{tuple(out.shape)} and {tuple(lse.shape)}, not {tuple(want[0].shape)} and {tuple(want[1].shape)}"
        return f"{case.name}: the merged pair has shapes {shapes}", "keep the shapes: (..., q, d) and (..., q, 1)", {}
    err_out, err_lse = ((x - y).abs().max().item() for x, y in zip(merged, want, strict=True))
    numbers = {"output_error": err_out, "lse_error": err_lse}
    measured = (
        f"{case.name}: largest error {err_out:.1e} in the output and {err_lse:.1e} in the log-sum-exp against "
        f"attention over all keys at once (float64; tolerance {TOLERANCE:g})"
    )
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return (
            measured,
            (
                f"the merge returned inf or NaN where the log-sum-exps reach {want[1].max().item():.0f}: e^l overflows "
                "float64 past e^709. Use torch.logaddexp for the log-sum-exp and the weights e^(l_i - l), at most 1"
            ),
            numbers,
        )
    if err_out <= TOLERANCE and err_lse <= TOLERANCE:
        return measured, "", numbers
    if len(partials) > 2:
        return measured, "each merge must return what the next one merges: the union's (out, lse)", numbers
    return measured, _merge_diagnosis(*partials, out, lse, want), numbers


def check_merge_partials(fn: Callable, cases: Sequence[MergeCase] = MERGE_CASES) -> Feedback:
    """Merge each case's partial attentions with ``fn`` and compare with attention over all the keys at once."""
    return over_cases(MERGE, cases, lambda case: _judge_merge(fn, case), key=lambda case: case.name)
