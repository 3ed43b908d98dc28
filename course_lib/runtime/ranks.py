"""The plumbing of local rank processes, shared by the launcher (:func:`course_lib.runtime.launch.run`'s ranks, one run
each) and the distributed cells (:class:`course_lib.runtime.cells.Ranks`, ranks that outlive a cell).

Both fork their ranks from the forkserver (:mod:`course_lib.runtime.forkserver`) and meet at a file store named here
(:func:`new_store_path`). In the launching process: the status array the ranks write into (:class:`RankStatus`,
:func:`status_array`), what the launcher knows of each rank (:class:`RankState`), reaping them (:func:`reap`) and
describing where each one is when a run fails, stalls or times out (:func:`laggards`, :func:`rank_lines`), and how
much memory this process may still take (:func:`available_memory`, which bounds the launcher's ranks). In a
rank: dying with the launching process (:func:`die_with_parent`), joining the group (:func:`join_group`), feeding
the rank's status entry from the comm ledger (:func:`status_teller`) and forwarding prints (:class:`PipeWriter`).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from course_lib.ledgers import comm

STATUS_TEXT_BYTES = 200
STATUS_GIVEN_BYTES = 120  # a tensor's dtype and shape, as comm.given says them
STORE_PREFIX = "course_lib-store-"  # a store file's name: the prefix, the launching process's pid, a random tail


class RankStatus(ctypes.Structure):
    """Where one rank is, in memory shared with the launcher: what it last did (in words); its current (or last)
    collective: the op, the group's name, a hash of its members (which of the groups of that name), the number on
    that group, its turn among the group's collectives (:attr:`course_lib.ledgers.comm.CommRecord.turn`) and what
    this rank gave it (:func:`course_lib.ledgers.comm.given`), with how often the rank has begun
    and ended writing those (odd while it writes: :func:`collective_of`); since when it has been blocked in it
    (``time.monotonic()``; 0 when not blocked); and the training step it began last (-1 before the first;
    :func:`course_lib.runtime.launch.began_step`)."""

    _fields_ = [
        ("text", ctypes.c_char * STATUS_TEXT_BYTES),
        ("writes", ctypes.c_long),
        ("op", ctypes.c_char * 16),
        ("group", ctypes.c_char * 32),
        ("members", ctypes.c_int64),
        ("number", ctypes.c_long),
        ("turn", ctypes.c_long),
        ("given", ctypes.c_char * STATUS_GIVEN_BYTES),
        ("blocked_since", ctypes.c_double),
        ("step", ctypes.c_long),
    ]


@dataclass
class RankState:
    """What the launching process learned about one rank."""

    process: mp.process.BaseProcess
    conn: object
    result: tuple | None = None
    error: tuple | None = None  # (type name, message, traceback text, pickled exception or None)
    exit_note: str | None = None


def status_array(ctx: mp.context.BaseContext, world_size: int):
    """A :class:`RankStatus` per rank in memory that ``ctx``'s children share, none of them in a training step."""
    status = ctx.Array(RankStatus, world_size, lock=False)
    for entry in status:
        entry.step = -1
    return status


# ----------------------------------------------------------------------------------------------- the store file
def new_store_path() -> str:
    """A fresh, empty file for the ranks' file store, named after this process so that a later launcher can tell
    a dead one's leftovers (:func:`remove_stale_stores`); the caller removes it after the run."""
    handle, path = tempfile.mkstemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    os.close(handle)
    return path


def remove_stale_stores() -> None:
    """Delete the store files of launchers that died before they could (killed parents): their pid is in the name."""
    for path in Path(tempfile.gettempdir()).glob(f"{STORE_PREFIX}*-*"):
        pid = path.name[len(STORE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# ----------------------------------------------------------------------------------------------- in the launcher
def reap(ranks: list[RankState]) -> None:
    """Stop and join every child that is still alive (a stopped one too); close the pipes."""
    for state in ranks:
        if state.process.is_alive():
            state.process.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(state.process.pid, signal.SIGCONT)  # a stopped rank acts on SIGTERM only once it runs
    for state in ranks:
        state.process.join(timeout=2.0)
        if state.process.is_alive():
            state.process.kill()
            state.process.join()
        state.conn.close()


def describe_exit(code: int | None) -> str:
    """How a rank that reported nothing ended, from its exit code: the signal that killed it, or the code."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without returning a result"


def process_state(process: mp.process.BaseProcess) -> str | None:
    """'stopped' for a process stopped by a signal (SIGSTOP, Ctrl-Z), as Linux's /proc reports it; else None."""
    try:
        with open(f"/proc/{process.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return "stopped" if state in ("T", "t") else None


def _status_of(status, rank: int) -> str:
    return status[rank].text.decode(errors="replace") or "no collective yet"


def collective_of(entry: RankStatus) -> tuple[int, str, int, int, str, str] | None:
    """A rank's current (or last) collective, read whole from its status entry: (its turn on the group, the group's
    name, a hash of its members, its number, op, what the rank gave it); None before the first, for a point-to-point
    call (no turn) and while the rank writes a new one, so that no mix of two collectives is taken for one."""
    writes = entry.writes
    if writes % 2 or not entry.turn:
        return None
    op, given = entry.op.decode(errors="replace"), entry.given.decode(errors="replace")
    seen = (entry.turn, entry.group.decode(errors="replace"), entry.members, entry.number, op, given)
    return seen if entry.writes == writes else None


def last_seen(status, rank: int) -> str:
    """`` during step k (last: what it did)``: the step the rank began last, if it trains, and its last collective."""
    step = status[rank].step
    return f"{f' during step {step}' if step >= 0 else ''} (last: {_status_of(status, rank)})"


def laggards(ranks: list[RankState], pending: set[int], status) -> dict[int, str]:
    """The ranks holding the others up, each with why: stopped by a signal, busy outside any collective, or in an
    earlier collective on a group than its peers are."""
    blocked = {r for r in pending if status[r].blocked_since}
    out = {r: "stopped by a signal (SIGSTOP or Ctrl-Z?)" for r in pending if process_state(ranks[r].process)}
    out |= {r: "busy outside any collective" for r in pending - blocked if r not in out}
    ahead: dict[bytes, int] = {}
    for r in blocked:
        ahead[status[r].group] = max(ahead.get(status[r].group, 0), status[r].number)
    for r in blocked:
        if r not in out and status[r].number < ahead[status[r].group]:
            out[r] = f"a collective behind its peers on {status[r].group.decode()}"
    return out


def rank_lines(ranks: list[RankState], pending: set[int], status, held_up_by: dict[int, str]) -> list[str]:
    """One line per rank: finished, holding the run up (why, from ``held_up_by``: :func:`laggards`), waiting in a
    collective (how long), or running (its step and last collective)."""
    now, lines = time.monotonic(), []
    skipped = _skipped_world_collective(pending, status)
    for r in range(len(ranks)):
        since = status[r].blocked_since
        if r not in pending:
            lines.append(f"  rank {r}: finished{skipped}")
        elif r in held_up_by:
            lines.append(f"  rank {r}: {held_up_by[r]}{last_seen(status, r)}")
        elif since:
            lines.append(f"  rank {r}: waiting {now - since:.1f} s, {_status_of(status, r)}")
        else:
            lines.append(f"  rank {r}: running{last_seen(status, r)}")
    return lines


def _skipped_world_collective(pending: set[int], status) -> str:
    """What a rank that finished while others wait in a collective of the whole world did wrong: it never called
    that collective (every rank belongs to the world group, so every rank must); '' when no rank waits in one."""
    waiting = sorted(r for r in pending if status[r].blocked_since and status[r].group == b"world")
    if not waiting:
        return ""
    first = status[waiting[0]]
    names = ", ".join(map(str, waiting))
    return (
        f", without calling {first.op.decode(errors='replace')} #{first.number} on world, which rank"
        f"{'s' * (len(waiting) > 1)} {names} wait{'s' * (len(waiting) == 1)} in: this rank skipped a collective "
        "every rank must call"
    )


# ----------------------------------------------------------------------------------------------- in a rank
class PipeWriter(io.TextIOBase):
    """Forwards a rank's prints to the launching process, line by line, prefixed with the rank."""

    def __init__(self, conn, rank: int, lock: threading.Lock) -> None:
        self._conn, self._prefix, self._lock, self._buffer = conn, f"[rank {rank}] ", lock, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buffer += text
        if "\n" in self._buffer:
            complete, self._buffer = self._buffer.rsplit("\n", 1)
            self._send(complete + "\n")
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self._send(self._buffer + "\n")
            self._buffer = ""

    def _send(self, text: str) -> None:
        lines = "".join(self._prefix + line for line in text.splitlines(keepends=True))
        with self._lock:
            self._conn.send(("out", lines))


def die_with_parent() -> None:
    """End this rank when the process that started it dies, however it dies (SIGKILL, SIGTERM, a closed terminal).

    A rank's parent is the forkserver, which exits once every holder of the launching process's "alive" pipe is
    gone; multiprocessing hands each child a copy (so that it could start processes of its own), which would keep
    the forkserver, and so the ranks, alive after the launcher's death. A rank starts nothing, so it closes its copy.
    On Linux the kernel then kills the rank when the forkserver exits (PR_SET_PDEATHSIG); elsewhere a thread checks
    every half second whether the rank has been re-parented."""
    from multiprocessing import forkserver

    with contextlib.suppress(AttributeError, OSError, TypeError):
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def status_teller(mine: RankStatus) -> comm.StatusSink:
    """A :func:`course_lib.ledgers.comm.set_status_sink` sink that writes into this rank's shared status entry."""

    def tell(text: str, rec: comm.CommRecord, blocked: bool) -> None:
        mine.blocked_since = 0.0
        mine.text = text.encode()[: STATUS_TEXT_BYTES - 1]
        mine.writes += 1
        mine.op, mine.group, mine.members = rec.op.encode()[:15], rec.group.encode()[:31], hash(rec.ranks)
        mine.number, mine.turn, mine.given = rec.number, rec.turn, rec.given.encode()[: STATUS_GIVEN_BYTES - 1]
        mine.writes += 1
        mine.blocked_since = time.monotonic() if blocked else 0.0

    return tell


def join_group(rank: int, world_size: int, store_path: str, backend: str, timeout: float) -> None:
    """Join the process group at the file store (this rank's device set already); return once every rank has
    joined."""
    # The launcher's deadline, not gloo's, decides when a hang is reported, so the collectives wait longer.
    pg_timeout = timedelta(seconds=timeout + 30)
    store = dist.FileStore(store_path, world_size)
    store.set_timeout(pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
    # gloo can finish a rank's side of its connections before its peers have finished theirs; a rank that then
    # returned and exited at once broke a peer's set-up ("Connection closed by peer"). Start together instead.
    if store.add("ranks_up", 1) == world_size:
        store.set("all_up", "1")
    store.wait(["all_up"])
