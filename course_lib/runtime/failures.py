"""What the launcher says when a run fails: which rank is the root cause of a failure, who held a stalled run up,
which ranks a timeout caught, and where the ranks holding a run up were (their Python stacks, from ``faulthandler``).

Each message names every rank and what it was doing (:func:`course_lib.runtime.ranks.rank_lines`) and says what to
change; :func:`course_lib.runtime.launch.run` raises them as a :class:`course_lib.runtime.launch.RankError`. Where the
ranks of one collective gave it tensors of different shapes or dtypes, or called different collectives, the message
leads with that (:func:`mismatch`): gloo's own words for it are a closed connection, an abort or nothing at all, and
NCCL hangs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import cloudpickle

from course_lib.ledgers.comm import CommRecord
from course_lib.runtime.ranks import RankState, collective_of, laggards, last_seen, process_state, rank_lines

STACK_SIGNAL = signal.SIGUSR1  # asks a rank for its Python stacks (faulthandler), when it holds a run up
STACK_LINES = 8  # innermost frames per thread shown
_COMM_ERROR_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


# A collective as the checks below compare it: (turn, group name, members) -> {rank: (op, given, number)}
_Calls = dict[tuple, dict[int, tuple[str, str, int]]]


def mismatch(status, among: set[int] | None = None) -> str | None:
    """The first collective whose ranks (of ``among``, default all) gave it different tensors or called different
    ops at its turn, named with what each rank gave, from the ranks' status (each rank's current or last collective,
    :func:`course_lib.runtime.ranks.collective_of`); None where they agree. Point-to-point calls pair a rank with its
    peer, not with its group, and are left out."""
    calls: _Calls = {}
    for r, entry in enumerate(status):
        seen = collective_of(entry) if among is None or r in among else None
        if seen is not None:
            turn, group, members, number, op, given = seen
            calls.setdefault((turn, group, members), {})[r] = (op, given, number)
    return _first_disagreement(calls)


def ledger_mismatch(records: dict[int, list[CommRecord]], what: str) -> str | None:
    """:func:`mismatch` over every collective of the ranks' ledgers (``{rank: its records}``) of a ``what`` (a run, a
    cell) that ended without an error, and what that means; None where they agree. gloo runs some such collectives
    without a word: a broadcast into a larger tensor, an all_gather of other shapes on the rank that receives less."""
    calls: _Calls = {}
    for r, recs in records.items():
        for rec in recs:
            if rec.turn:
                calls.setdefault((rec.turn, rec.group, rec.ranks), {})[r] = (rec.op, rec.given, rec.number)
    disagreed = _first_disagreement(calls)
    if disagreed is None:
        return None
    return f"{disagreed}\nThe {what} ended without an error, but what that collective wrote is wrong on some rank."


def _first_disagreement(calls: _Calls) -> str | None:
    """The first collective, by turn, at which the ranks called different ops or gave different tensors, in words
    (its number as its lowest rank counts it)."""
    for (_, group, _), by_rank in sorted(calls.items(), key=lambda item: item[0][:2]):
        alike: dict[tuple[str, str], list[int]] = {}
        for r, (op, given, _) in sorted(by_rank.items()):
            alike.setdefault((op, given), []).append(r)
        if len(alike) < 2:
            continue
        ops, number = {op for op, _ in alike}, by_rank[min(by_rank)][2]
        if len(ops) > 1:
            said = ", ".join(f"{_ranks(rs)} called {op} ({what or 'no tensor'})" for (op, what), rs in alike.items())
            return (
                f"collective #{number} on group {group}: {said}: every rank of a group must call the same collectives "
                "in turn"
            )
        op = ops.pop()
        said = ", ".join(f"{_ranks(rs)} sent {what}" for (_, what), rs in alike.items())
        alike_in = "dtype and row shape" if op == "all_to_all" else "shape and dtype"
        return f"{op} #{number} on group {group}: {said}: the tensors must have the same {alike_in} on every rank"
    return None


def leading_with_mismatch(message: str, status, among: set[int] | None = None) -> str:
    """``message``, after the collective the ranks disagreed on if they did (:func:`mismatch`)."""
    disagreed = mismatch(status, among)
    return message if disagreed is None else f"{disagreed}\n{message}"


def _is_comm_error(state: RankState) -> bool:
    return bool(state.error) and any(m in state.error[1] for m in _COMM_ERROR_MARKERS)


def failure(ranks: list[RankState], status) -> tuple[str, BaseException | None]:
    """Pick the root cause (a rank's own exception over a peer's broken connection) and describe every rank, after
    the collective they disagreed on if they did (:func:`mismatch`): the message, and the root cause's own exception
    when it raised one that unpickles."""
    n = len(ranks)
    order = sorted(
        (r for r, s in enumerate(ranks) if s.error or s.exit_note),
        key=lambda r: (_is_comm_error(ranks[r]), ranks[r].error is None, r),
    )
    root = order[0]
    state = ranks[root]
    if state.error:
        type_name, message, tb, pickled = state.error
        head = f"rank {root} of {n} raised {type_name}: {message}\n\n--- traceback of rank {root} ---\n{tb}"
    else:
        pickled = None
        head = f"rank {root} of {n} {state.exit_note}{last_seen(status, root)}"
    others = []
    for r, s in enumerate(ranks):
        if r == root:
            continue
        if s.result:
            what = "finished"
        elif s.error:
            what = f"raised {s.error[0]}: {s.error[1].splitlines()[0] if s.error[1] else ''}"
        elif s.exit_note:
            what = s.exit_note
        else:
            what = "stopped by the launcher"
        others.append(f"rank {r}: {what}{last_seen(status, r)}")
    cause = None
    if pickled is not None:
        with contextlib.suppress(Exception):
            cause = cloudpickle.loads(pickled)
    return leading_with_mismatch(head + ("\nother ranks:\n  " + "\n  ".join(others) if others else ""), status), cause


def stall_message(ranks: list[RankState], pending: set[int], stall_timeout: float, status) -> str | None:
    """None while the run makes progress; the stall described once a rank has been blocked in a collective for
    ``stall_timeout`` seconds and some other rank is to blame for it, or the ranks in it gave it tensors that
    disagree (NCCL waits on such a collective for ever)."""
    now = time.monotonic()
    stuck = sorted(r for r in pending if status[r].blocked_since and now - status[r].blocked_since > stall_timeout)
    if not stuck:
        return None
    held_up_by = laggards(ranks, pending, status)
    disagreed = mismatch(status)
    if not held_up_by and disagreed is None:
        return None  # every rank is in the same collective: a slow transfer, which the whole-run timeout bounds
    names = ", ".join(str(r) for r in sorted(held_up_by))
    waiters = [r for r in stuck if r not in held_up_by]  # a rank stopped inside the collective holds it up
    stuck = waiters or stuck
    lines = [
        f"rank{'s' * (len(held_up_by) > 1)} {names} of {len(ranks)} held the run up: ranks {stuck} waited over "
        f"{stall_timeout:g} s in a collective that rank{'s' * (len(held_up_by) > 1)} {names} did not reach:"
        if held_up_by
        else f"ranks {stuck} of {len(ranks)} waited over {stall_timeout:g} s in a collective they disagree on:",
        *rank_lines(ranks, pending, status, held_up_by),
    ]
    if disagreed is not None:
        return "\n".join([disagreed, *lines])
    lines.append(
        "If a rank is only slow (a long computation between collectives), raise the stall timeout: stall_timeout= "
        "in launch.run and run_scheme, --stall-timeout on the command line."
    )
    return "\n".join(lines)


def timeout_message(ranks: list[RankState], pending: set[int], timeout: float, status) -> str:
    """The run outlived ``timeout``: where every rank is, and which ranks the waiting ones wait for."""
    held_up_by = laggards(ranks, pending, status)
    waiting = sorted(r for r in pending if status[r].blocked_since and r not in held_up_by)
    lines = [f"the run did not finish within timeout={timeout:g} s:", *rank_lines(ranks, pending, status, held_up_by)]
    if held_up_by and waiting:
        lines.append(f"Ranks {waiting} wait in a collective that ranks {sorted(held_up_by)} never reach.")
    lines.append(
        "If the work is simply slow, allow it more time: timeout= in launch.run and run_scheme, --timeout on the "
        "command line."
    )
    return leading_with_mismatch("\n".join(lines), status)


def stack_path(store_path: str, rank: int) -> str:
    """Where rank ``rank`` writes its Python stacks when the launcher asks (:data:`STACK_SIGNAL`)."""
    return f"{store_path}.stacks-{rank}"


def stacks(ranks: list[RankState], held_up_by: dict[int, str], store_path: str) -> str:
    """The Python stacks of the live ranks in ``held_up_by`` (:func:`course_lib.runtime.ranks.laggards`) that are
    not stopped, each asked for with :data:`STACK_SIGNAL` (``faulthandler``, which answers even from inside C
    code): the innermost frames of each thread, most recent first. Empty if none answers within a second."""
    asked = [r for r in sorted(held_up_by) if ranks[r].process.is_alive() and not process_state(ranks[r].process)]
    for r in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[r].process.pid, STACK_SIGNAL)
    lines, deadline = [], time.monotonic() + 1.0
    for r in asked:
        text, before = "", None
        while (not text or text != before) and time.monotonic() < deadline:  # until the dump stops growing
            before = text
            time.sleep(0.05)
            with contextlib.suppress(OSError), open(stack_path(store_path, r)) as f:
                text = f.read()
        if text:
            lines.append(f"where rank {r} was (faulthandler, most recent call first):")
            lines += [f"  {line}" for line in _innermost(text, STACK_LINES)]
    return "\n" + "\n".join(lines) if lines else ""


def _innermost(dump: str, keep: int) -> list[str]:
    """Each thread's header and its ``keep`` innermost frames, of a ``faulthandler`` dump."""
    out, kept = [], 0
    for line in dump.splitlines():
        if not line.startswith("  "):  # "Thread 0x... (most recent call first):" or "Current thread ..."
            out.append(line)
            kept = 0
        elif kept < keep:
            out.append(line.strip())
            kept += 1
    return [line for line in out if line]
