"""The checks of :mod:`course_lib.write_it`: each runs a student's function, measures it against one device or the
course's own code, and answers with a :class:`Feedback` whose hint comes from what it measured.

A check never raises on what the student wrote: an exception, a hang, a table of the wrong shape, NaN, all become
feedback that names where (the rank, the case) and the exception's first line. Only a bad setting of the check
itself (a world size of 0, an unknown backend) is a ValueError, before any rank starts.

* :func:`check_ring_all_reduce`: real ranks (2 and 4 by default); every rank's result against
  ``dist.all_reduce``'s, exactly (integer-valued float64 sums have no rounding), the ledger's bytes per rank
  against the ring's 2(n-1)/n S, exactly; the messages, read as they are sent, against the ring's, step by step.
* :func:`check_one_f_one_b`: the table's cells, each microbatch once per stage, the dependencies in time, the
  course's schedule checker (:func:`course_lib.parallel.schedules.check`), 1F1B's memory (at most p-s microbatches
  in flight on stage s) and the course's simulator: each op at its earliest step, the bubble (p-1)/(m+p-1).
* :func:`check_dispatch_counts`: the table against the course's count (the dispatcher's
  :func:`course_lib.models.within_capacity` and :func:`course_lib.parallel.expert.rows_between`), and against the
  tables of the usual mistakes to name the one made.
* :func:`check_merge_partials`: blockwise attention (:func:`course_lib.parallel.context.attend_block`) merged by
  the student's function against attention over all the keys at once, float64, 1e-10; the log-sum-exp and the
  output measured apart.

:func:`model_answers` loads the model solutions from ``exercises/answers/write_it.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from course_lib import comm, launch
from course_lib.models import GPTConfig, expert_capacity, within_capacity
from course_lib.parallel import schedules
from course_lib.parallel.context import attend_block
from course_lib.parallel.expert import rows_between

ANSWERS = Path(__file__).resolve().parent.parent / "exercises" / "answers" / "write_it.py"
TOLERANCE = 1e-10  # float64: a right merge matches attention over all keys to ~1e-15
RING_CHUNK = 3  # elements per chunk: the ring's tensor has 3n float64 elements on n ranks
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


def _one_line(error: BaseException) -> str:
    first = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _call(fn: Callable, *args) -> tuple[object, str | None]:
    """``fn(*args)``, or the exception's first line."""
    try:
        return fn(*args), None
    except Exception as error:  # the student's code: whatever it raises becomes feedback
        return None, _one_line(error)


def _fix(error: str) -> str:
    """The hint for an exception's first line."""
    return STUB if "NotImplementedError" in error else "fix that exception first"


def _over_cases(exercise: str, cases: Sequence, judge: Callable, key: Callable = lambda case: case) -> Feedback:
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


def _values(t: torch.Tensor, limit: int = 4) -> str:
    shown = ", ".join(f"{x:g}" for x in t.flatten()[:limit].tolist())
    return f"[{shown}{', ...' if t.numel() > limit else ''}]"


# ------------------------------------------------------------------------------------------- 1. ring all-reduce
RING = "ring all-reduce"


def ring_input(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s tensor on ``n`` ranks: 3n integer-valued float64 elements, so every sum is exact."""
    generator = torch.Generator().manual_seed(1000 * n + rank)
    return torch.randint(0, 100, (RING_CHUNK * n,), generator=generator).double()


@contextlib.contextmanager
def _recording_sends(log: list) -> Iterator[None]:
    """While inside, every ``comm.send`` / ``comm.isend`` also appends (destination, a copy of the message)."""
    send, isend = comm.send, comm.isend

    def recorded(original: Callable) -> Callable:
        def call(tensor: torch.Tensor, dst: int, group: comm.Group = None):
            log.append((dst, tensor.detach().cpu().clone()))
            return original(tensor, dst, group)

        return call

    comm.send, comm.isend = recorded(send), recorded(isend)
    try:
        yield
    finally:
        comm.send, comm.isend = send, isend


def measure_ring(fn: Callable) -> dict:
    """On each rank: ``dist.all_reduce`` of this rank's input (the expected sum, off the ledger), then the
    student's function on a copy, its messages read as they are sent; what the check compares."""
    n, rank, device = dist.get_world_size(), dist.get_rank(), launch.rank_device()
    tensor = ring_input(rank, n).to(device)
    expected = tensor.clone()
    dist.all_reduce(expected)
    first, sent = len(comm.records()), []
    with _recording_sends(sent):
        returned = fn(tensor)
    return {
        "result": tensor.cpu(),
        "expected": expected.cpu(),
        "returned": returned.detach().cpu() if isinstance(returned, torch.Tensor) else None,
        "sent": sent,
        "records": comm.records()[first:],
    }


def ring_messages(n: int) -> list[list[tuple[int, int, torch.Tensor, str]]]:
    """The ring's messages on ``n`` ranks, per rank and step: (destination, chunk, contents, what it holds)."""
    chunks = [list(ring_input(r, n).chunk(n)) for r in range(n)]
    out: list[list[tuple]] = [[] for _ in range(n)]
    for k in range(2 * (n - 1)):
        gather = k >= n - 1
        for r in range(n):
            c = (r + 1 - (k - n + 1)) % n if gather else (r - k) % n
            members = [str((r - j) % n) for j in range(k, -1, -1)]
            summed = "all ranks" if gather else f"rank{'s' if k else ''} {', '.join(members)}"
            out[r].append(((r + 1) % n, c, chunks[r][c].clone(), f"chunk {c} summed over {summed}"))
        for r in range(n):
            dst, c, message, _ = out[r][k]
            chunks[dst][c] = message if gather else chunks[dst][c] + message
    return out


def _step_name(k: int, n: int) -> str:
    return f"reduce-scatter step {k + 1} of {n - 1}" if k < n - 1 else f"all-gather step {k - n + 2} of {n - 1}"


def _first_wrong_message(measured: list[dict]) -> str | None:
    """The first (step, rank) whose message differs from the ring's, in words; None if every message matches."""
    n = len(measured)
    ring = ring_messages(n)
    for k in range(2 * (n - 1)):
        for r in range(n):
            sent, (dst, _, want, holds) = measured[r]["sent"], ring[r][k]
            at = f"at {_step_name(k, n)} (step {k + 1} of the ring's {2 * (n - 1)})"
            if k >= len(sent):
                unseen = " through comm.send/comm.isend" if not sent else ""
                return f"rank {r} sent {len(sent)} messages{unseen}; {at} it should send {holds} to rank {dst}"
            peer, got = sent[k]
            if peer != dst:
                return f"{at}, rank {r} sent to rank {peer}; every rank sends to its right neighbour, here rank {dst}"
            if got.numel() != want.numel():
                return f"{at}, rank {r} sent {got.numel()} elements; the ring sends one chunk of S/n = {want.numel()}"
            if not torch.equal(got.flatten().to(want.dtype), want):
                return (
                    f"values first differ {at}: rank {r} sent {_values(got)}, the ring sends {holds}, {_values(want)}"
                )
    return None


def _values_hint(measured: list[dict], wrong: list[int]) -> str:
    r = wrong[0]
    m = measured[r]
    if m["returned"] is not None and torch.equal(m["returned"].flatten(), m["expected"].flatten()):
        return (
            f"rank {r} returned the sum but left `tensor` as it was: all-reduce works in place, as dist.all_reduce "
            "does (write through views of its chunks, or copy into it)"
        )
    message = _first_wrong_message(measured)
    if message is not None:
        return message
    n = len(measured)
    got, want = m["result"].flatten().chunk(n), m["expected"].flatten().chunk(n)
    c = next(i for i in range(n) if not torch.equal(got[i], want[i]))
    return (
        f"every message matched the ring, but rank {r}'s chunk {c} ends as {_values(got[c])} instead of "
        f"{_values(want[c])}: look at what rank {r} does with the last chunks it receives (the all-gather stores them)"
    )


def _bytes_hint(sent: list[float], counts: list[int], formula: float, size: int) -> str:
    n = len(sent)
    r = next(i for i in range(n) if sent[i] != formula)
    said = f"rank {r} sent {sent[r]:g} B in {counts[r]} messages"
    ring = f"the ring sends 2(n-1) = {2 * (n - 1)} chunks of S/n = {size // n} B, 2(n-1)/n S = {formula:g} B"
    if counts[r] == 0:
        return (
            f"the ledger saw no send from rank {r}: call comm.send or comm.isend (torch.distributed's own are not "
            f"recorded); {ring}"
        )
    if sent[r] == (n - 1) * size:
        return f"{said}: its whole tensor to each of the n-1 others; {ring}, whatever n is"
    return f"{said}; {ring}"


def judge_ring(measured: list[dict]) -> Feedback:
    """Judge one run of :func:`measure_ring` (every rank's dict, in rank order): collectives used, every rank's
    result against dist.all_reduce's, the ledger's bytes per rank against 2(n-1)/n S."""
    n = len(measured)
    size = measured[0]["expected"].numel() * measured[0]["expected"].element_size()
    formula = 2 * (n - 1) / n * size
    sent = [sum(rec.sent_bytes for rec in m["records"] if rec.op == "send") for m in measured]
    counts = [sum(rec.op == "send" for rec in m["records"]) for m in measured]
    wrong = [r for r, m in enumerate(measured) if not torch.equal(m["result"], m["expected"])]
    collectives = sorted({rec.op for m in measured for rec in m["records"]} - {"send", "recv"})
    measurement = (
        f"{n} ranks, S = {size} B: the result equals dist.all_reduce's on {n - len(wrong)} of {n} ranks; the ledger "
        f"has {counts} sends per rank, [{', '.join(f'{b:g}' for b in sent)}] B (the ring: 2(n-1)/n S = {formula:g} B)"
    )
    numbers = {"ranks": n, "S": size, "sent_bytes": sent, "formula_bytes": formula, "wrong_ranks": wrong}
    if collectives:
        hint = f"your function called {', '.join(collectives)}: write the ring from send and recv alone"
    elif wrong:
        hint = _values_hint(measured, wrong)
    elif any(b != formula for b in sent):
        hint = _bytes_hint(sent, counts, formula, size)
    else:
        return Feedback(RING, True, measurement, numbers=numbers)
    return Feedback(RING, False, measurement, hint, numbers)


def crashed_run(exercise: str, n: int, error: launch.RankError) -> Feedback:
    """Feedback for a run that ended in a :class:`course_lib.launch.RankError`: its first line, and for a run
    that hung, where each rank waited."""
    lines, ranks = str(error).splitlines(), f"{n} rank{'s' if n > 1 else ''}"
    waiting = [line.strip() for line in lines if re.match(r"\s+rank \d+: ", line)]
    numbers = {"error": str(error)}
    if "did not finish" in lines[0]:
        measured = f"on {ranks}, {lines[0].rstrip(':')}: " + "; ".join(waiting)
        if waiting and all(" in send " in line for line in waiting):
            hint = (
                "every rank waits in a blocking send: gloo's send returns only once the peer receives, and every "
                "peer is sending too. Post the send with comm.isend, receive with comm.recv, then wait() the send"
            )
        else:
            hint = "a rank waits for a message no rank sends: each receive needs a matching send from that peer"
        return Feedback(exercise, False, measured, hint, numbers)
    if "Connection closed by peer" in lines[0]:
        hint = (
            "that rank was still waiting to receive when its peer had returned: each receive needs a matching send "
            "from that peer, and every rank takes the same steps"
        )
    else:
        hint = _fix(lines[0]) + ("" if _fix(lines[0]) == STUB else " (the rank's traceback: .numbers['error'])")
    return Feedback(exercise, False, f"on {ranks}: {lines[0]}", hint, numbers)


def check_ring_all_reduce(
    fn: Callable[[torch.Tensor], None],
    world_sizes: Sequence[int] = (2, 4),
    backend: str = "auto",
    timeout: float = 10.0,
) -> Feedback:
    """Run ``fn`` on each world size in turn (:func:`course_lib.write_it.ring_all_reduce` says what it computes)
    and judge it (:func:`judge_ring`); the first size that fails is the feedback."""
    sizes = list(world_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"world_sizes must be positive integers, such as (2, 4), not {world_sizes!r}")
    if launch.resolve_backend(backend, max(sizes)) == "gloo":
        launch.check_world_size(max(sizes))
    passed = []
    for n in sizes:
        try:
            run = launch.run(measure_ring, n, fn, backend=backend, timeout=timeout)
        except launch.RankError as error:
            return crashed_run(RING, n, error)
        except Exception as error:  # the function could not be sent to the ranks (cloudpickle)
            measured = f"the ranks could not start your function: {_one_line(error)}"
            return Feedback(RING, False, measured, "define it at the top level of a cell or a file")
        feedback = judge_ring(list(run))
        if not feedback.passed:
            return feedback
        passed.append(feedback)
    measured = "; ".join(f.measured for f in passed)
    return Feedback(RING, True, measured, numbers={f.numbers["ranks"]: f.numbers for f in passed})


# --------------------------------------------------------------------------------------------- 2. 1F1B table
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


def _earliest(cells: list[list], sim: schedules.Simulation) -> str:
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
        schedules.check(tables, m)
    except ValueError as error:
        return "the course's schedule checker refuses the table", str(error), {}
    sim = schedules.simulate(tables, schedules.Costs(1.0, 1.0, 0.0))
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
    reference = schedules.simulate(schedules.generate("1f1b", p, m), schedules.Costs(1.0, 1.0, 0.0))
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
    table, error = _call(fn, p, m)
    if error:
        return f"one_f_one_b({p}, {m}) raised {error}", _fix(error), {}
    measured, problem, numbers = _schedule_problem(table, p, m)
    return f"p={p}, m={m}: {measured}", problem, numbers


def check_one_f_one_b(
    fn: Callable[[int, int], list[list[str]]], cases: Sequence[tuple[int, int]] = SCHEDULE_CASES
) -> Feedback:
    """Call ``fn(p, m)`` for each (stages, microbatches) case and check its table, rule by rule in this order:
    one op per cell, every F and B once per stage, dependencies in time, the course's checker, at most p-s
    microbatches in flight on stage s, each op at its earliest step with the bubble (p-1)/(m+p-1)."""
    return _over_cases(SCHEDULE, cases, lambda case: _judge_schedule(fn, *case))


# ------------------------------------------------------------------------------------------ 3. MoE dispatch
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
        return None, f"it returned {type(result).__name__}, not an n x n table ({_one_line(error)})"
    if table.shape != (n, n) or not torch.equal(table, table.round()):
        return None, f"it returned a table of shape {tuple(table.shape)}; it needs {n} x {n} whole numbers"
    return table.long(), ""


def _judge_dispatch(fn: Callable, case: DispatchCase) -> tuple[str, str, dict]:
    choices = dispatch_choices(case)
    cap = "no capacity" if case.capacity_factor is None else f"capacity factor {case.capacity_factor}"
    name = f"{case.ranks} ranks x {case.tokens} tokens, {case.experts} experts, top-{case.k}, {cap}"
    result, error = _call(fn, [c.clone() for c in choices], case.experts, case.capacity_factor)
    if error:
        return f"{name}: your function raised {error}", _fix(error), {}
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
    return _over_cases(DISPATCH, cases, lambda case: _judge_dispatch(fn, case))


# ---------------------------------------------------------------------------------- 4. ring attention's merge
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
        result, error = _call(fn, tuple(t.clone() for t in merged), tuple(t.clone() for t in received))
        if error:
            return None, f"merge {step} raised {error}", _fix(error)
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
    return _over_cases(MERGE, cases, lambda case: _judge_merge(fn, case), key=lambda case: case.name)
