"""What the checks of :mod:`course_lib.practice.write_it` share: each runs a student's function, measures it against one
device or the course's own code, and answers with a :class:`Feedback` whose hint comes from what it measured.

A check never raises on what the student wrote: an exception, a hang, a table of the wrong shape, NaN, all become
feedback that names where (the rank, the case) and the exception's first line (:func:`call_student`,
:func:`hint_for_error`). Only a bad setting of the check itself (a world size of 0, an unknown backend) is a
ValueError, before any rank starts.

The checks, one module each: :func:`course_lib.practice.check_ring.check_ring_all_reduce`,
:func:`course_lib.practice.check_schedule.check_one_f_one_b`,
:func:`course_lib.practice.check_dispatch.check_dispatch_counts`,
:func:`course_lib.practice.check_merge.check_merge_partials`.

:func:`model_answers` loads the model solutions from ``exercises/answers/write_it.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

ANSWERS = Path(__file__).resolve().parents[2] / "exercises" / "answers" / "write_it.py"
STUB = "the stub is still in place: write the function's body (its docstring says what to compute)"


@dataclass(frozen=True)
class Feedback:
    """A check's answer: passed or not, what it measured (in words, with the numbers), a hint drawn from the
    measurement (empty once passed), and the numbers themselves."""

    exercise: str
    passed: bool
    measured: str
    hint: str = ""
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.exercise}: {'passed' if self.passed else 'not yet'}."]
        for label, text in (("measured", self.measured), ("hint", self.hint)):
            if text:
                lines.append(textwrap.fill(text, 116, initial_indent=f"  {label}: ", subsequent_indent="    "))
        return "\n".join(lines)


def model_answers() -> ModuleType:
    """The model solutions, loaded from ``exercises/answers/write_it.py`` (outside the package, so nothing imports
    them by accident); their functions travel to the ranks by value, as a student's do."""
    name = "write_it_answers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ANSWERS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def one_line(error: BaseException) -> str:
    """An exception as its type and the first line of its message."""
    first = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def call_student(fn: Callable, *args) -> tuple[object, str | None]:
    """``fn(*args)``, or the exception's first line."""
    try:
        return fn(*args), None
    except Exception as error:  # the student's code: whatever it raises becomes feedback
        return None, one_line(error)


def hint_for_error(error: str) -> str:
    """The hint for an exception's first line."""
    return STUB if "NotImplementedError" in error else "fix that exception first"


def over_cases(exercise: str, cases: Sequence, judge: Callable, key: Callable = lambda case: case) -> Feedback:
    """``judge(case)`` gives (measured, hint, numbers), a hint when the case fails: the first failure, or a pass
    with every case's measurement and numbers (by ``key(case)``)."""
    texts, numbers = [], {}
    for case in cases:
        measured, hint, found = judge(case)
        if hint:
            return Feedback(exercise, False, measured, hint, found)
        texts.append(measured)
        numbers[key(case)] = found
    return Feedback(exercise, True, "; ".join(texts), numbers=numbers)


def show_values(t: torch.Tensor, limit: int = 4) -> str:
    """A tensor's first ``limit`` values, for a hint."""
    shown = ", ".join(f"{x:g}" for x in t.flatten()[:limit].tolist())
    return f"[{shown}{', ...' if t.numel() > limit else ''}]"
