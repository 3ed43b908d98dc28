"""The check of the 1F1B exercise (:func:`course_lib.practice.write_it.one_f_one_b`): the table's cells, each
microbatch once per stage, the dependencies in time, the course's schedule checker
(:func:`course_lib.parallel.schedule_sim.check`), 1F1B's memory (at most p-s microbatches in flight on stage s)
and the course's simulator: each op at its earliest step, the bubble (p-1)/(m+p-1)
(PipeDream-Flush: Narayanan et al. 2021, §2).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

from course_lib.parallel import schedules
from course_lib.parallel.schedule_sim import Simulation, check, simulate
from course_lib.practice.write_it_check import Feedback, call_student, hint_for_error, over_cases

SCHEDULE = "1F1B table"
SCHEDULE_CASES = ((2, 3), (4, 8), (4, 2))  # (stages, microbatches): m > p, more microbatches, fewer than p
_OP = re.compile(r"([FB])(\d+)")


def _parse(table: object, p: int, m: int) -> tuple[list[list[tuple[str, int] | None]] | None, str]:
    """The table as cells (kind, microbatch) or None, or why it cannot be read."""
    if not isinstance(table, Sequence) or isinstance(table, str) or len(table) != p:
        got = f"{len(table)} rows" if isinstance(table, Sequence) else type(table).__name__
        return None, f"the table has {got}; it needs one row per stage, {p}"
    cells: list[list[tuple[str, int] | None]] = []
    for s, row in enumerate(table):
        if not isinstance(row, Sequence) or isinstance(row, str):
            return None, f"stage {s}'s row is a {type(row).__name__}, not a list of cells"
        cells.append([])
        for t, cell in enumerate(row):
            match = _OP.fullmatch(cell) if isinstance(cell, str) else None
            if cell is None or cell == "":
                cells[s].append(None)
            elif match is None or int(match[2]) >= m:
                return (
                    None,
                    f"stage {s}, step {t}: {cell!r} is not one op ('F3', 'B3' or '' for idle, microbatch < {m})",
                )
            else:
                cells[s].append((match[1], int(match[2])))
    return cells, ""


def _steps(cells: list[list]) -> list[dict[tuple[str, int], list[int]]]:
    out: list[dict] = [{} for _ in cells]
    for s, row in enumerate(cells):
        for t, op in enumerate(row):
            if op is not None:
                out[s].setdefault(op, []).append(t)
    return out


def _in_time_order(cells: list[list]) -> Iterator[tuple[int, int, tuple[str, int]]]:
    """(step, stage, op) of every op, by step, then stage."""
    yield from sorted((t, s, op) for s, row in enumerate(cells) for t, op in enumerate(row) if op is not None)


def _once_each(steps: list[dict], m: int) -> str:
    for s, ran in enumerate(steps):
        for kind in "FB":
            for i in range(m):
                at = ran.get((kind, i), [])
                if len(at) != 1:
                    return f"stage {s} runs {kind}{i} " + (f"{len(at)} times (steps {at})" if at else "never")
    return ""


def _dependency(cells: list[list], steps: list[dict], p: int) -> str:
    for t, s, (kind, i) in _in_time_order(cells):
        if kind == "F" and s > 0:
            need, where = ("F", i), s - 1
        elif kind == "B":
            need, where = (("B", i), s + 1) if s < p - 1 else (("F", i), s)
        else:
            continue
        at = steps[where][need][0]
        if at >= t:
            return f"stage {s}, step {t}: {kind}{i} runs before stage {where}'s {need[0]}{i}, which runs at step {at}"
    return ""


def _memory(cells: list[list], p: int, m: int) -> str:
    held = [0] * p
    for t, s, (kind, i) in _in_time_order(cells):
        held[s] += 1 if kind == "F" else -1
        if held[s] > p - s:
            kinds = "".join(op[0] for op in cells[s] if op is not None)
            gpipe = " (this row runs all its forwards first, as GPipe does)" if kinds == "F" * m + "B" * m else ""
            return (
                f"stage {s}, step {t}: F{i} makes {held[s]} microbatches' activations held at once; 1F1B holds at "
                f"most p-s = {p - s} on stage {s}, so a backward comes before this forward{gpipe}"
            )
    return ""


def _earliest(cells: list[list], sim: Simulation) -> str:
    """The first op that runs later than its input and its stage allow (the simulator's start of the same order)."""
    start = {(s, a.kind, a.microbatch): int(t0) for s, busy in enumerate(sim.busy) for t0, _, a in busy}
    for t, s, (kind, i) in _in_time_order(cells):
        if start[s, kind, i] < t:
            return (
                f"stage {s} waits until step {t} to run {kind}{i}, which could run at step {start[s, kind, i]}: put "
                f"each op at the earliest step its input and its stage allow"
            )
    return ""


def _schedule_problem(table: object, p: int, m: int) -> tuple[str, str, dict]:
    """(what was measured, the first rule broken with its stage and step, numbers); empty strings if none."""
    cells, problem = _parse(table, p, m)
    if cells is None:
        return "the table cannot be read", problem, {}
    steps = _steps(cells)
    rules = {
        "every F and B once per stage": lambda: _once_each(steps, m),
        "each op after its input": lambda: _dependency(cells, steps, p),
        "1F1B's memory": lambda: _memory(cells, p, m),
    }
    for name, rule in rules.items():
        problem = rule()
        if problem:
            return f"{p} rows of up to {max(map(len, cells))} steps, read rule by rule: {name} is broken", problem, {}
    orders = [[(kind, i, 0) for _, (kind, i) in sorted((steps[s][op][0], op) for op in steps[s])] for s in range(p)]
    tables = schedules.tables_from_orders("1f1b", p, orders)
    try:
        check(tables, m)
    except ValueError as error:
        return "the course's schedule checker refuses the table", str(error), {}
    sim = simulate(tables, schedules.Costs(1.0, 1.0, 0.0))
    length = 1 + max(t for row in cells for t, op in enumerate(row) if op is not None)
    bubble, formula = 1 - 2 * m / length, schedules.bubble_formula("1f1b", p, m)
    numbers = {"steps": length, "bubble": bubble, "formula": formula, "peak": sim.peak_inflight}
    measured = (
        f"{length} steps, a bubble of {bubble:.4f}; 1F1B: 2(m+p-1) = {2 * (m + p - 1)} steps, (p-1)/(m+p-1) = "
        f"{formula:.4f}; microbatches in flight per stage {sim.peak_inflight} (at most p-s)"
    )
    problem = _earliest(cells, sim)
    if not problem and abs(sim.bubble_fraction - formula) > 1e-12:
        problem = _first_idle_step(cells, p, m)
    return measured, problem, numbers


def _first_idle_step(cells: list[list], p: int, m: int) -> str:
    """The first (step, stage) where the table idles and the course's 1F1B table works."""
    reference = simulate(schedules.generate("1f1b", p, m), schedules.Costs(1.0, 1.0, 0.0))
    t, s, a = min(
        (int(t0), s, a)
        for s, busy in enumerate(reference.busy)
        for t0, _, a in busy
        if int(t0) >= len(cells[s]) or cells[s][int(t0)] is None
    )
    return (
        f"stage {s} idles at step {t}, where 1F1B runs {a.kind}{a.microbatch}: its order is min(p-s-1, m) warm-up "
        "forwards, then one forward one backward while forwards remain, then the backwards"
    )


def _judge_schedule(fn: Callable, p: int, m: int) -> tuple[str, str, dict]:
    table, error = call_student(fn, p, m)
    if error:
        return f"one_f_one_b({p}, {m}) raised {error}", hint_for_error(error), {}
    measured, problem, numbers = _schedule_problem(table, p, m)
    return f"p={p}, m={m}: {measured}", problem, numbers


def check_one_f_one_b(
    fn: Callable[[int, int], list[list[str]]], cases: Sequence[tuple[int, int]] = SCHEDULE_CASES
) -> Feedback:
    """Call ``fn(p, m)`` for each (stages, microbatches) case and check its table, rule by rule in this order:
    one op per cell, every F and B once per stage, dependencies in time, the course's checker, at most p-s
    microbatches in flight on stage s, each op at its earliest step with the bubble (p-1)/(m+p-1)."""
    return over_cases(SCHEDULE, cases, lambda case: _judge_schedule(fn, *case))
