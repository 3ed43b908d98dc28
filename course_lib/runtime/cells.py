"""Distributed cells: N ranks that stay alive between notebook cells, each cell run on them with what it moved.

``%load_ext course_lib`` adds one magic, ``ranks``::

    %ranks start 4 [--backend gloo|nccl] [--timeout 20]
    %%ranks [0,2] [--timeout S]     run the cell on every rank (or on a subset), in a namespace kept per rank
    %ranks get NAME                 the value of NAME on every rank, as a list in rank order
    %ranks put NAME=EXPR            EXPR evaluated here, sent to every rank as NAME
    %ranks ledger                   every cell's collectives so far, per rank
    %ranks stop

The ranks are the launcher's (:mod:`course_lib.runtime.launch`, with the plumbing of :mod:`course_lib.runtime.ranks`):
forked from its forkserver, joined in a gloo (or NCCL) group at a file store, each reporting the collective it is in
through the same shared status the launcher's hang report reads, and recording every collective in the comm ledger
(:mod:`course_lib.ledgers.comm`). Each rank runs a loop that reads a message from its pipe (a cell's code, a name to
get, a value to put), does it in its namespace (where ``rank``, ``world_size``, ``dist``, ``comm`` and ``torch`` are
ready) and answers on the same pipe with what the cell printed, the value of its last expression, its traceback if
it raised, the figures it left open (drawn with matplotlib's Agg backend, sent as PNG and closed) and the ledger
records it added.

A rank that raises answers with its traceback and keeps its loop, so the next cell finds every rank alive. A cell
whose ranks do not all answer within the timeout (a rank skipped a collective its peers wait in) is ended: the
message says where each rank was, and the ranks are restarted, their namespaces lost. ``%ranks stop``, and the
kernel's exit, stop and reap every rank.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import io
import linecache
import math
import os
import shlex
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.ledgers import comm
from course_lib.runtime import failures, launch
from course_lib.runtime.forkserver import RANK_NAME, context
from course_lib.runtime.host import check_world_size, cores
from course_lib.runtime.ranks import (
    RankState,
    collective_of,
    describe_exit,
    die_with_parent,
    laggards,
    new_store_path,
    rank_lines,
    reap,
    status_array,
)

DEFAULT_TIMEOUT_S = 20.0
START_TIMEOUT_S = 60.0  # how long the ranks may take to join their group
GROUP_TIMEOUT_S = 3600.0  # gloo's own limit on a collective; the cell's timeout ends a hang long before


class CellError(launch.RankError):
    """A cell failed on some rank or did not finish in time; the message says which ranks and why."""


@dataclass
class RankReply:
    """What one rank answers after a cell: its printed output, its last expression's ``repr`` (None if the cell
    did not end in an expression or it was None), its traceback (None if it did not raise), its new ledger
    records and the PNG of each figure it left open, oldest first."""

    out: str
    value: str | None
    error: str | None
    records: list[comm.CommRecord]
    figures: list[bytes] = field(default_factory=list)


@dataclass
class Cell:
    """One ``%%ranks`` cell as the kernel saw it: its number, the ranks it ran on and their ledger records."""

    number: int
    ranks: tuple[int, ...]
    records: dict[int, list[comm.CommRecord]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- in a rank
def _run_code(code: str, namespace: dict, filename: str) -> object:
    """Execute ``code`` in ``namespace`` like a notebook cell: the value of a final expression is returned."""
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the student's cell is the point
    return None if last is None else eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307


def _short_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the cell's own frame inward (the loop that ran it left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _use_agg() -> None:
    """Draw with matplotlib's Agg backend in this rank: a rank has no display, and the kernel's inline backend
    (which ipykernel names in ``MPLBACKEND``, inherited by the ranks) would show nothing from here."""
    os.environ["MPLBACKEND"] = "agg"
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("agg")


def _figures() -> list[bytes]:
    """The PNG of every pyplot figure left open, oldest first, as the inline backend would show it; all are closed,
    even when one fails to draw."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:  # the cell never imported pyplot: no figure can be open
        return []
    try:
        pngs = []
        for number in pyplot.get_fignums():
            png = io.BytesIO()
            pyplot.figure(number).savefig(png, format="png", bbox_inches="tight")
            pngs.append(png.getvalue())
        return pngs
    finally:
        pyplot.close("all")


def _execute(namespace: dict, code: str, filename: str) -> RankReply:
    before = len(comm.records())
    out, value, error, figures = io.StringIO(), None, None, []
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            result = _run_code(code, namespace, filename)
            value = None if result is None else repr(result)
        except Exception as exc:  # noqa: BLE001 - the rank reports it and waits for the next cell
            error = _short_traceback(exc, filename)
        try:
            figures = _figures()
        except Exception as exc:  # noqa: BLE001 - a figure that does not draw is the cell's error
            error = (error or "") + _short_traceback(exc, filename)
    return RankReply(out.getvalue(), value, error, comm.records()[before:], figures)


def _answer(namespace: dict, kind: str, body) -> tuple[str, object]:
    """Do one request from the kernel; return the answer to send back."""
    if kind == "cell":
        return "reply", _execute(namespace, *body)
    if kind == "get":
        if body not in namespace:
            return "error", f"NameError: name {body!r} is not defined on rank {namespace['rank']}"
        return "value", cloudpickle.dumps(namespace[body])
    name, payload = body
    namespace[name] = cloudpickle.loads(payload)
    return "ok", None


def _rank_loop(rank: int, world_size: int, store_path: str, conn, status, backend: str, epoch: float, threads: int):
    """A persistent rank: join the group, then answer the kernel's requests until told to stop."""
    die_with_parent()
    _use_agg()
    placed = launch.compute_device(backend)
    launch.start_rank(rank, world_size, store_path, status, backend, placed, GROUP_TIMEOUT_S, epoch, threads)
    namespace = {"__name__": "__rank__", "rank": rank, "world_size": world_size, "dist": dist, "comm": comm}
    namespace["torch"] = torch
    conn.send(("ready", os.getpid()))
    while True:
        try:
            kind, body = conn.recv()
        except EOFError:
            break
        if kind == "stop":
            break
        try:
            answer = _answer(namespace, kind, body)
        except Exception as exc:  # noqa: BLE001 - a value that does not pickle must not end the rank
            answer = "error", f"{type(exc).__name__} on rank {rank}: {exc}"
        conn.send(answer)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- in the kernel
class Ranks:
    """``world_size`` persistent ranks and the pipes to them, with the ledger of every cell run on them."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size, self.timeout = world_size, timeout
        self.backend = launch.resolve_backend(backend, world_size)
        self.cells: list[Cell] = []
        self.pids: list[int] = []
        self._ranks: list[RankState] = []
        self._store_path = ""
        self._status = None
        self._asked_at: list[tuple | None] = []  # each rank's collective when the last request was sent
        self.start()

    def start(self) -> None:
        """Fork the ranks and wait until each has joined the group."""
        ctx = context()
        self._store_path = new_store_path()
        self._status = status_array(ctx, self.world_size)
        threads, epoch = max(1, cores() // self.world_size), time.perf_counter()
        for rank in range(self.world_size):
            mine, theirs = ctx.Pipe()
            args = (rank, self.world_size, self._store_path, theirs, self._status, self.backend, epoch, threads)
            process = ctx.Process(target=_rank_loop, args=args, name=f"{RANK_NAME}{rank}", daemon=True)
            process.start()
            theirs.close()
            self._ranks.append(RankState(process, mine))
        try:
            ready = self._collect(range(self.world_size), START_TIMEOUT_S)
        except CellError:
            self.stop()
            raise
        self.pids = [ready[r][1] for r in range(self.world_size)]

    def stop(self) -> None:
        """Tell every rank to stop, then reap them (terminating any that does not exit) and remove the store."""
        for state in self._ranks:
            with contextlib.suppress(OSError, ValueError):
                state.conn.send(("stop", None))
        for state in self._ranks:
            state.process.join(timeout=1.0)
        reap(self._ranks)
        self._ranks, self.pids = [], []
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._store_path)

    def restart(self) -> None:
        self.stop()
        self.start()

    def ask(self, ranks: tuple[int, ...], kind: str, body, timeout: float) -> dict[int, tuple[str, object]]:
        """Send one request to ``ranks`` and return their answers; a rank that dies, a request that outlives
        ``timeout`` or an interrupt (Jupyter's stop button) restarts all ranks, so that no late answer is taken for
        the next request's, and raises :class:`CellError` saying where each rank was."""
        self._asked_at = [collective_of(entry) for entry in self._status]
        for r in ranks:
            with contextlib.suppress(OSError):  # a rank that died since the last request: _collect reports it
                self._ranks[r].conn.send((kind, body))
        try:
            return self._collect(ranks, timeout)
        except (CellError, KeyboardInterrupt) as error:
            what = str(error) if isinstance(error, CellError) else "the cell was interrupted"
            self.restart()
            raise CellError(f"{what}\nThe {self.world_size} ranks were restarted: their variables are gone.") from None

    def _collect(self, ranks, timeout: float) -> dict[int, tuple[str, object]]:
        """Each of ``ranks``'s answer; :class:`CellError` at the timeout, when one of them dies, or once one has
        waited ``launch.STALL_CONFIRM_S`` in a collective that the ranks gave different tensors (it never ends)."""
        answers, pending, deadline = {}, set(ranks), time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CellError(self._where(pending, {}, f"did not finish within timeout={timeout:g} s"))
            sentinels = {self._ranks[r].process.sentinel: r for r in pending}
            wait([self._ranks[r].conn for r in pending] + list(sentinels), timeout=min(left, launch.POLL_S))
            self._receive(pending, answers)
            if self._stuck_in_a_mismatch(pending):
                raise CellError(self._where(pending, {}, "stalled in a collective its ranks disagree on"))
            dead = {r: describe_exit(self._ranks[r].process.exitcode) for r in pending if self._dead(r)}
            if dead:
                time.sleep(0.1)  # let the answers already on their way arrive, then say where everyone was
                self._receive(pending, answers)
                lost = ", ".join(f"rank {r}" for r in sorted(dead))
                raise CellError(self._where(pending, dead, f"lost {lost}"))
        return answers

    def _receive(self, pending: set[int], answers: dict) -> None:
        for r in list(pending):
            with contextlib.suppress(EOFError, OSError):
                if self._ranks[r].conn.poll():
                    answers[r] = self._ranks[r].conn.recv()
                    pending.discard(r)

    def _dead(self, rank: int) -> bool:
        process = self._ranks[rank].process
        if process.is_alive():
            return False
        process.join()
        return True

    def _where(self, pending: set[int], dead: dict[int, str], what: str) -> str:
        """``what`` happened, then one line per rank: finished, dead, or where it was (the launcher's words); first
        the collective the ranks disagreed on in this request, if they did."""
        held_up_by = laggards(self._ranks, pending - set(dead), self._status)
        lines = rank_lines(self._ranks, pending, self._status, held_up_by)
        lines = [f"  rank {r}: {dead[r]}" if r in dead else line for r, line in enumerate(lines)]
        return self._leading_with_mismatch("\n".join([f"the cell {what}:", *lines]))

    def _stuck_in_a_mismatch(self, pending: set[int]) -> bool:
        """Whether a rank of ``pending`` has waited ``launch.STALL_CONFIRM_S`` in a collective while the ranks
        disagree on one in this request (:meth:`_entered`)."""
        since = [self._status[r].blocked_since for r in pending if self._status[r].blocked_since]
        if not since or time.monotonic() - min(since) < launch.STALL_CONFIRM_S:
            return False
        return failures.mismatch(self._status, self._entered()) is not None

    def _leading_with_mismatch(self, message: str) -> str:
        """``message``, after the collective the ranks gave different tensors in this request, if they did
        (:func:`course_lib.runtime.failures.mismatch` among :meth:`_entered`)."""
        return failures.leading_with_mismatch(message, self._status, self._entered())

    def _entered(self) -> set[int]:
        """The ranks that entered a collective since the last request was sent: a rank's status otherwise still
        holds a collective of an earlier cell."""
        asked_at = self._asked_at or [None] * self.world_size  # nothing asked yet: the ranks are starting
        return {r for r, entry in enumerate(self._status) if collective_of(entry) != asked_at[r]}

    def run_cell(self, code: str, ranks: tuple[int, ...], timeout: float) -> Cell:
        """Run ``code`` on ``ranks``, show each rank's output, value and figures, and return the cell's ledger."""
        cell = Cell(len(self.cells) + 1, ranks)
        filename = f"<ranks cell {cell.number}>"
        answers = self.ask(ranks, "cell", (code, filename), timeout)
        replies: dict[int, RankReply] = {r: answers[r][1] for r in ranks}
        cell.records = {r: reply.records for r, reply in replies.items()}
        self.cells.append(cell)
        _show(replies)
        print(ledger_line(cell.records))
        errors = {r: reply.error for r, reply in replies.items() if reply.error}
        if errors:
            said = "\n".join(f"{label} raised:\n{text}" for label, text in _grouped(errors)).rstrip()
            raise CellError(self._leading_with_mismatch(said))
        disagreed = failures.ledger_mismatch(cell.records, "cell")
        if disagreed is not None:
            raise CellError(disagreed)
        return cell

    def get(self, name: str, timeout: float) -> list:
        answers = self.ask(tuple(range(self.world_size)), "get", name, timeout)
        failed = [answers[r][1] for r in sorted(answers) if answers[r][0] == "error"]
        if failed:
            raise CellError(failed[0])
        return [cloudpickle.loads(answers[r][1]) for r in range(self.world_size)]

    def put(self, name: str, value: object, timeout: float) -> None:
        self.ask(tuple(range(self.world_size)), "put", (name, cloudpickle.dumps(value)), timeout)


def _label(ranks: list[int]) -> str:
    return f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {','.join(map(str, ranks))}]"


def _grouped(by_rank: dict[int, object]) -> list[tuple[str, object]]:
    """(label, thing) per distinct thing: one block when every rank has the same, else one per rank."""
    things = list(by_rank.values())
    if len(things) > 1 and all(t == things[0] for t in things):
        return [(_label(sorted(by_rank)), things[0])]
    return [(_label([r]), t) for r, t in sorted(by_rank.items())]


def _show(replies: dict[int, RankReply]) -> None:
    """Show each rank's output under its label, its last value as ``Out:`` and its figures as images; one block
    when every rank printed the same (their figures then follow, each under its rank's label)."""
    texts = {r: (reply.out, reply.value) for r, reply in replies.items()}
    blocks = _grouped(texts)
    if len(blocks) == 1 and len(replies) > 1:
        _show_block(blocks[0][0], *blocks[0][1])
        texts = dict.fromkeys(replies, ("", None))
    for r, reply in sorted(replies.items()):
        _show_block(_label([r]), *texts[r], reply.figures)


def _show_block(label: str, out: str, value: str | None, figures: Sequence[bytes] = ()) -> None:
    """``label``, then the output, the value and the figures under it; nothing at all when there are none."""
    if not (out or value is not None or figures):
        return
    print(label)
    print(out, end="" if out.endswith("\n") or not out else "\n")
    if value is not None:
        print(f"Out: {value}")
    if figures:
        from IPython.display import Image, display

        for png in figures:
            display(Image(data=png, format="png"))


def _bytes(n: float) -> str:
    return f"{n:,.0f} B"


def ledger_line(records: dict[int, list[comm.CommRecord]]) -> str:
    """One line: the collectives a cell issued by kind, the bytes each rank sent and the longest time a rank spent
    in them."""
    if not any(records.values()):
        return "comm: nothing communicated"
    calls = {
        r: ", ".join(f"{op} x{n}" for op, n in Counter(x.op for x in recs).items()) or "nothing"
        for r, recs in records.items()
    }
    grouped = _grouped(calls)
    kinds = grouped[0][1] if len(grouped) == 1 else "; ".join(f"{label} {text}" for label, text in grouped)
    sent = {r: sum(rec.sent_bytes for rec in recs) for r, recs in records.items()}
    if len(set(sent.values())) == 1:
        per_rank = f"{_bytes(next(iter(sent.values())))} sent by each rank"
    else:
        per_rank = "sent " + ", ".join(f"rank {r} {_bytes(b)}" for r, b in sorted(sent.items()))
    busy = max(sum(rec.end - rec.start for rec in recs) for recs in records.values())
    return f"comm: {kinds}; {per_rank}; {busy * 1e3:.1f} ms in collectives"


def ledger_table(cells: list[Cell]) -> str:
    """Every cell's collectives: per cell and op, the calls and the bytes each rank sent."""
    rows = [f"{'cell':>4}  {'op':<15}{'calls':>6}  bytes sent by rank"]
    for cell in cells:
        for op in dict.fromkeys(rec.op for recs in cell.records.values() for rec in recs):
            mine = {r: [rec for rec in recs if rec.op == op] for r, recs in cell.records.items()}
            n = max(len(recs) for recs in mine.values())
            sent = ", ".join(f"{r}: {_bytes(sum(x.sent_bytes for x in recs))}" for r, recs in sorted(mine.items()))
            rows.append(f"{cell.number:>4}  {op:<15}{n:>6}  {sent}")
    return "\n".join(rows) if len(rows) > 1 else "comm: no cell has communicated yet"


# ----------------------------------------------------------------------------------------------- the magic
_SESSION: Ranks | None = None


def session() -> Ranks | None:
    """The running ranks (None before ``%ranks start`` and after ``%ranks stop``)."""
    return _SESSION


def stop() -> None:
    """Stop the running ranks, if any (also run at the kernel's exit)."""
    global _SESSION
    if _SESSION is not None:
        _SESSION.stop()
        _SESSION = None


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"the timeout must be a positive number of seconds, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%ranks", add_help=False, exit_on_error=False)
    parser.add_argument("words", nargs="*")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "auto"))
    parser.add_argument("--timeout", type=_seconds, default=None)
    return parser


def _usage(message: str) -> Exception:
    from IPython.core.error import UsageError

    return UsageError(f"{message}\n{USAGE}")


USAGE = (
    "usage: %ranks start N [--backend gloo|nccl] [--timeout S] | %%ranks [0,2] [--timeout S] | %ranks get NAME | "
    "%ranks put NAME=EXPR | %ranks ledger | %ranks stop"
)


def _parse(line: str) -> argparse.Namespace:
    try:
        return _parser().parse_args(shlex.split(line))
    except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError) as error:
        raise _usage(str(error)) from None


def _running() -> Ranks:
    if _SESSION is None:
        raise _usage("no ranks are running: start them with %ranks start N")
    return _SESSION


def _subset(words: list[str], world_size: int) -> tuple[int, ...]:
    if not words:
        return tuple(range(world_size))
    try:
        ranks = tuple(sorted({int(w) for w in ",".join(words).split(",") if w}))
    except ValueError:
        raise _usage(f"ranks must be numbers separated by commas, like 0,2; got {' '.join(words)!r}") from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world_size:
        raise _usage(f"ranks must be among 0..{world_size - 1}, not {ranks}")
    return ranks


def _start(words: list[str], options: argparse.Namespace) -> None:
    global _SESSION
    if len(words) != 1 or not words[0].isdigit() or int(words[0]) < 1:
        raise _usage("say how many ranks to start: %ranks start 4")
    world_size = int(words[0])
    check_world_size(world_size)
    if _SESSION is not None:
        print(f"stopping the {_SESSION.world_size} running ranks first")
        stop()
    started = time.perf_counter()
    _SESSION = Ranks(world_size, options.backend, options.timeout or DEFAULT_TIMEOUT_S)
    print(f"{world_size} ranks up ({_SESSION.backend}) in {time.perf_counter() - started:.1f} s")


def _put(assignment: str, user_ns: dict) -> None:
    """``%ranks put NAME=EXPR``: EXPR evaluated in the kernel's namespace, sent to every rank as NAME."""
    name, _, expr = assignment.partition("=")
    if not name.strip().isidentifier() or not expr.strip():
        raise _usage(f"put needs NAME=EXPR with NAME a Python name, not {assignment!r}")
    session_ = _running()
    session_.put(name.strip(), eval(expr, user_ns), session_.timeout)  # noqa: S307 - the kernel's own expression


def ranks_magic(line: str, cell: str | None, user_ns: dict) -> object:
    """The ``%ranks`` line magic and the ``%%ranks`` cell magic (see the module docstring)."""
    if line.split(maxsplit=1)[:1] == ["put"]:  # EXPR is Python, not options: parse it apart
        return _put(line.split(maxsplit=1)[1] if " " in line.strip() else "", user_ns)
    options = _parse(line)
    if cell is not None:
        session_ = _running()
        session_.run_cell(cell, _subset(options.words, session_.world_size), options.timeout or session_.timeout)
        return None
    command, *words = options.words or [""]
    if command == "start":
        return _start(words, options)
    if command == "stop":
        return stop()
    session_ = _running()
    timeout = options.timeout or session_.timeout
    if command == "get" and len(words) == 1:
        return session_.get(words[0], timeout)
    if command == "ledger":
        return print(ledger_table(session_.cells))
    raise _usage(f"unknown %ranks command {line!r}")


def _show_cell_error(shell, etype, value, tb, tb_offset=None) -> None:
    """Show a :class:`CellError` as its message alone, as the cell's error output: the ranks' tracebacks are in it;
    the kernel's would be noise. (IPython discards what a custom handler returns, so it shows the error itself.)"""
    shell._showtraceback(etype, value, [f"{etype.__name__}: {value}"])


def load(ipython) -> None:
    """Register ``%ranks``/``%%ranks`` in ``ipython`` and stop the ranks when the kernel exits."""
    from IPython.core.magic import Magics, line_cell_magic, magics_class

    @magics_class
    class RankMagics(Magics):
        @line_cell_magic
        def ranks(self, line: str, cell: str | None = None) -> object:
            return ranks_magic(line, cell, self.shell.user_ns)

    ipython.register_magics(RankMagics)
    ipython.set_custom_exc((CellError,), _show_cell_error)
    atexit.register(stop)


__all__ = ["CellError", "Ranks", "load", "ledger_line", "ledger_table", "session", "stop"]
