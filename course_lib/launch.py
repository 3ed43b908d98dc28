"""Run one Python function on N real ``torch.distributed`` ranks and get back what each rank did.

``run(fn, world_size, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank once the process group is up
and returns the per-rank return values in rank order (a :class:`RunResult`, a list that also carries each rank's
comm ledger and timeline). Inside ``fn`` a rank asks ``torch.distributed`` for its rank and :func:`rank_device`
for its device.

* From a notebook cell, pytest or a script: one local process per rank, started by a *forkserver* whose server has
  torch, torch.distributed and course_lib imported already (a launch costs about a second the first time and a
  fraction of one after). The function travels with cloudpickle, so a function defined in a notebook cell or in a
  script without an ``if __name__ == "__main__":`` guard works: ranks never re-import the caller's main module.
  The processes meet at a file store in a fresh temporary file (removed after the run, so two runs never collide).
  Each rank uses ``max(1, cores // world_size)`` threads. Backend: gloo on CPU, NCCL when CUDA has at least
  ``world_size`` devices (rank r on ``cuda:r``). ``device="cuda"`` puts gloo ranks on GPUs too, several to a GPU
  if need be (:func:`compute_device`; their collectives go through host memory, :mod:`course_lib.comm`).
* Under torchrun (RANK and WORLD_SIZE set) ``fn`` runs in place on this rank and the results of all ranks are
  gathered, so the same rank function serves notebooks, tests and multi-node GPU jobs.

Failures become a :class:`RankError` in the caller: a rank that raises (with its traceback), a rank that dies
without reporting (its exit code or signal, and the training step it had begun: :func:`began_step`), and a run
that outlives ``timeout`` (naming the ranks that did not finish and the collective each was last in). Every child
process is reaped in all cases.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import functools
import importlib
import io
import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from types import ModuleType

import cloudpickle
import torch
import torch.distributed as dist

from course_lib import comm, trace
from course_lib.forkserver import RANK_NAME, context, torchrun_restart, under_torchrun

STATUS_TEXT_BYTES = 200
POLL_S = 0.25  # how often the launcher looks at the ranks' status for a stall
# A stall is reported once it has lasted this long, as the launcher sees it, with no rank making progress: the
# virtual machine this course's CI runs in can be paused, and the monotonic clock then jumps past the stall timeout
# of a rank that was merely waiting (an 8-rank launch that had made every step was reported stalled for 20 s).
STALL_CONFIRM_S = 1.0
STACK_SIGNAL = signal.SIGUSR1  # asks a rank for its Python stacks (faulthandler), when it holds a run up
STACK_LINES = 8  # innermost frames per thread shown
_COMM_ERROR_MARKERS = ("Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")


class RankError(RuntimeError):
    """A rank raised, died or hung; the message names the ranks and what each was doing."""


class RunResult(list):
    """The per-rank return values in rank order, with each rank's ledger attached.

    ``comm[r]`` is rank r's list of :class:`course_lib.comm.CommRecord`, ``events[r]`` its timeline
    (:class:`course_lib.trace.Event`), ``programs[r]`` its program (compute, issue, wait; see
    :mod:`course_lib.trace`), ``wall_s`` the seconds from launch to the last result, ``device`` what the ranks
    computed on (``cpu`` or ``cuda``, :func:`compute_device`).
    """

    def __init__(
        self, values, comm_records, events, programs, backend: str, wall_s: float, device: str = "cpu"
    ) -> None:
        super().__init__(values)
        self.comm = comm_records
        self.events = events
        self.programs = programs
        self.backend = backend
        self.device = device
        self.world_size = len(values)
        self.wall_s = wall_s


class _RankStatus(ctypes.Structure):
    """Where one rank is, in memory shared with the launcher: what it last did (in words), the group and number of
    its current collective, since when it has been blocked in it (``time.monotonic()``; 0 when not blocked), and
    the training step it began last (-1 before the first; :func:`began_step`)."""

    _fields_ = [
        ("text", ctypes.c_char * STATUS_TEXT_BYTES),
        ("group", ctypes.c_char * 32),
        ("number", ctypes.c_long),
        ("blocked_since", ctypes.c_double),
        ("step", ctypes.c_long),
    ]


@dataclass(frozen=True)
class _Limits:
    timeout: float
    stall_timeout: float


@dataclass
class _RankState:
    """What the launching process learned about one rank."""

    process: mp.process.BaseProcess
    conn: object
    result: tuple | None = None
    error: tuple | None = None  # (type name, message, traceback text, pickled exception or None)
    exit_note: str | None = None


_DEVICE = torch.device("cpu")
_IN_RANK = False
_STATUS: _RankStatus | None = None  # this local rank's entry in the launcher's status array
_PAYLOAD_LOCK = threading.Lock()


def rank_device() -> torch.device:
    """The device this rank computes on: ``cuda:<local rank modulo the GPUs>`` when :func:`compute_device` put the ranks
    on CUDA (always under NCCL), else the CPU."""
    return _DEVICE


def began_step(step: int) -> None:
    """Tell the launcher that this rank begins training step ``step``, so that a rank that dies or hangs is reported
    with the step it was in (a no-op outside a local rank)."""
    if _STATUS is not None:
        _STATUS.step = step


def with_setting(fn: Callable, module: str, name: str, value: object) -> Callable:
    """``fn`` (a rank function) that runs with ``module.name`` set to ``value`` in its rank's process, put back
    afterwards (an in-process run leaves the caller's as it was): how a fault plan or a checkpoint plan travels with
    the rank function to every rank. Pass the result to :func:`run` or :func:`run_here`."""
    return functools.partial(_run_with_setting, module, name, value, fn)


def _run_with_setting(module: str, name: str, value: object, fn: Callable, *args, **kwargs):
    owner = importlib.import_module(module)
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        return fn(*args, **kwargs)
    finally:
        setattr(owner, name, before)


def sync(device: torch.device) -> None:
    """Wait until the device has finished its queued work (a no-op on CPU); call it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_device(backend: str, device: str | None = None) -> str:
    """Where ranks compute: ``cpu``, or ``cuda`` (local rank r on GPU r modulo the GPUs). By default CUDA under
    NCCL and the CPU under gloo. gloo ranks may compute on CUDA too, several to a GPU: their collectives then go
    through host memory (:mod:`course_lib.comm`). NCCL ranks compute on their GPUs only."""
    if device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' needs a CUDA GPU, and this machine has none: use device 'cpu'")
    if device == "cpu" and backend == "nccl":
        raise ValueError("NCCL ranks compute on their GPUs: use backend 'gloo' for ranks on the CPU")
    return device


def _set_device(placed: str, local_rank: int) -> None:
    """Make this rank compute where :func:`compute_device` put it."""
    global _DEVICE
    if placed == "cuda":
        _DEVICE = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(_DEVICE)


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` becomes nccl when CUDA has one device per rank, else gloo; an impossible choice is an error."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend 'nccl' needs one CUDA device per rank: world_size={world_size} but this machine has {gpus}. "
            "Use backend='gloo' (CPU ranks) or a smaller world_size."
        )
    return backend


RANK_MEMORY_BYTES = 400 * 2**20  # what one local CPU rank costs: its own pages beyond the forkserver's, generously


def _cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def max_local_ranks() -> int:
    """How many local ranks this machine holds: four per core (at least 8, the course's 3D grid) and no more than
    the available memory fits at :data:`RANK_MEMORY_BYTES` each."""
    by_cores = max(8, 4 * _cores())
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such sysconf name on this system
        return by_cores
    return max(1, min(by_cores, available // RANK_MEMORY_BYTES))


def check_world_size(world_size: int, max_ranks: int | None = None) -> None:
    """Refuse more local CPU ranks than this machine holds (``max_ranks``, default :func:`max_local_ranks`): a typo
    must not fork a thousand processes. Under torchrun, torchrun decides how many processes there are."""
    limit = max_local_ranks() if max_ranks is None else max_ranks
    if world_size > limit and not under_torchrun():
        raise ValueError(
            f"world size {world_size} is more ranks than this machine holds ({limit}: four per core, at least 8, "
            f"within the free memory at ~{RANK_MEMORY_BYTES // 2**20} MB a rank). Use fewer ranks, or raise the "
            "limit if you know better (max_ranks= in launch.run and run_scheme, --max-ranks on the command line)."
        )


def run(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "auto",
    timeout: float = 120.0,
    stall_timeout: float = 20.0,
    max_ranks: int | None = None,
    count_flops: bool = False,
    device: str | None = None,
    **kwargs,
) -> RunResult:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their values in rank order.

    ``device`` is where the ranks compute, ``cpu`` or ``cuda`` (default: CUDA under NCCL, else the CPU;
    :func:`compute_device`): with gloo and ``cuda``, several ranks may share one GPU.

    ``timeout`` (seconds) bounds the whole run: a rank still running then is reported and killed.
    ``stall_timeout`` (seconds): once a rank has waited that long in a collective that another rank has not reached
    (busy elsewhere, stopped, or a collective behind), the run ends naming that rank and where every rank is.
    ``max_ranks`` raises the machine's limit on local ranks (:func:`max_local_ranks`).
    ``count_flops`` counts every operator's FLOPs into the ranks' programs (needed to replay them on a modeled
    cluster, :func:`course_lib.hardware.replay`; it slows CPU ranks down about as much as the memory meter).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, not {world_size!r}")
    for name, seconds in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{name} must be a positive number of seconds, not {seconds!r}")
    if _IN_RANK:
        raise RuntimeError("run() was called inside a rank function; launch ranks from the top level only")
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout, count_flops, device)
    backend = resolve_backend(backend, world_size)
    placed = compute_device(backend, device)
    if backend == "gloo":
        check_world_size(world_size, max_ranks)
    return _run_local(fn, world_size, args, kwargs, backend, placed, _Limits(timeout, stall_timeout), count_flops)


def run_here(fn: Callable, *args, count_flops: bool = False, device: torch.device | None = None, **kwargs) -> RunResult:
    """Call ``fn`` as the one rank of a world of one, in this process: no process to start, so no wait for the
    rank server (``run single`` on the command line). A rank that hangs here hangs the caller; use :func:`run` where
    that matters. ``device`` is the rank's device (:func:`rank_device`; default the CPU), put back afterwards."""
    global _DEVICE
    if _IN_RANK or dist.is_initialized():
        raise RuntimeError("run_here() needs a process without a process group; call it from the top level")
    started, before = time.perf_counter(), _DEVICE
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _DEVICE = torch.device("cpu") if device is None else device
    try:
        trace.reset(0, started)
        comm.reset()
        value = _call(fn, args, kwargs, count_flops)
        return RunResult(
            [value],
            [comm.records()],
            [trace.events()],
            [trace.program()],
            "gloo",
            time.perf_counter() - started,
            _DEVICE.type,
        )
    finally:
        _DEVICE = before
        dist.destroy_process_group()


def _call(fn, args, kwargs, count_flops: bool):
    with trace.FlopCounter() if count_flops else contextlib.nullcontext():
        return fn(*args, **kwargs)


def _ledgers(value) -> tuple:
    """What a rank sends back: its value, comm records, timeline events and program."""
    return value, comm.records(), trace.events(), trace.program()


# ----------------------------------------------------------------------------------------------- torchrun
def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's rendezvous store, seen under a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``).

    After a restart (``--max-restarts``) the store still holds the failed attempt's gloo addresses; a restarted
    rank that read one of them before its peer rewrote it failed in ``connectFullMesh`` (connection refused, two
    restarts in three here, and with plain ``init_process_group`` too). Each attempt's own keys avoid that."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
    )
    return dist.PrefixStore(f"course_lib/attempt-{torchrun_restart()}", store)


def _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout, count_flops, device) -> RunResult:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(
            f"run(..., world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: "
            f"start torchrun with --nproc-per-node x --nnodes = {world_size}, or pass world_size={env_world}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    placed = compute_device(backend, device)
    _set_device(placed, local_rank)
    if not dist.is_initialized():
        rank, pg_timeout = int(os.environ["RANK"]), timedelta(seconds=timeout)
        store = _attempt_store(rank, env_world, pg_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=env_world, timeout=pg_timeout)
        # Tear the group down before the interpreter does: a rank that exited with its group and store alive
        # aborted now and then ("terminate called without an active exception").
        atexit.register(dist.destroy_process_group)
    started = time.perf_counter()
    trace.reset(dist.get_rank(), started)
    comm.reset()
    value = _call(fn, args, kwargs, count_flops)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, _ledgers(value))
    values, records, events, programs = (list(x) for x in zip(*gathered, strict=True))
    return RunResult(values, records, events, programs, backend, time.perf_counter() - started, placed)


# ----------------------------------------------------------------------------------------------- local ranks
def _travels_by_value(obj) -> ModuleType | None:
    """The module of a function or class defined outside installed packages and the course (a student's file),
    which the ranks could not import by name; None for anything else."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "") if callable(obj) else None
    installed = (sys.prefix, sys.base_prefix)  # the environment's packages and the standard library
    if (
        module is None
        or module.__name__ == "__main__"
        or module.__name__.startswith("course_lib")
        or (getattr(module, "__file__", None) or "").startswith(installed)
    ):
        return None
    return module


def _payload(fn, args, kwargs) -> bytes:
    """cloudpickle ``fn`` and its arguments; code outside installed packages (``fn``'s, or that of a function or
    class passed as an argument, such as a model factory) travels by value."""
    modules = {m for obj in (fn, *args, *kwargs.values()) if (m := _travels_by_value(obj)) is not None}
    # cloudpickle's by-value registry is global: two threads launching from one module must not interleave.
    with _PAYLOAD_LOCK:
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
        try:
            return cloudpickle.dumps((fn, args, kwargs))
        finally:
            for module in modules:
                cloudpickle.unregister_pickle_by_value(module)


_STORE_PREFIX = "course_lib-store-"


def _remove_stale_stores() -> None:
    """Delete the store files of launchers that died before they could (killed parents): their pid is in the name."""
    for path in Path(tempfile.gettempdir()).glob(f"{_STORE_PREFIX}*-*"):
        pid = path.name[len(_STORE_PREFIX) :].split("-", 1)[0]
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


def _run_local(fn, world_size, args, kwargs, backend, placed: str, limits: _Limits, count_flops) -> RunResult:
    ctx = context()
    payload = _payload(fn, args, kwargs)
    # Rendezvous through a file, not a TCP store hosted here: a rank's first connection to such a store was now and
    # then reset and torch's client retried after a back-off of 1-5 s (one launch in four stalled ~5 s).
    _remove_stale_stores()
    handle, store_path = tempfile.mkstemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-")
    os.close(handle)
    status = ctx.Array(_RankStatus, world_size, lock=False)
    for entry in status:
        entry.step = -1
    threads = max(1, _cores() // world_size)
    epoch = time.perf_counter()
    ranks: list[_RankState] = []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    world_size,
                    store_path,
                    payload,
                    child_conn,
                    status,
                    backend,
                    placed,
                    limits.timeout,
                    epoch,
                    threads,
                    count_flops,
                ),
                name=f"{RANK_NAME}{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            ranks.append(_RankState(process, parent_conn))
        _collect(ranks, epoch + limits.timeout, limits, status, store_path)
    finally:
        _reap(ranks)
        for path in [store_path] + [_stack_path(store_path, r) for r in range(world_size)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    values, records, events, programs = zip(*(cloudpickle.loads(r.result[0]) for r in ranks), strict=True)
    wall_s = time.perf_counter() - epoch
    return RunResult(list(values), list(records), list(events), list(programs), backend, wall_s, placed)


def _collect(ranks: list[_RankState], deadline: float, limits: _Limits, status, store_path: str) -> None:
    """Read every rank's messages until all have reported; raise RankError on the first failure, on a stall (a rank
    blocked in a collective for ``stall_timeout`` that another rank has not reached, seen for ``STALL_CONFIRM_S``
    without progress; the message ends with where the ranks holding it up were, their Python stacks) and at the
    deadline."""
    pending, suspected = set(range(len(ranks))), None  # suspected: (when a stall was first seen, the progress then)
    while pending:
        waitables = {ranks[r].conn: r for r in pending} | {ranks[r].process.sentinel: r for r in pending}
        left = deadline - time.perf_counter()
        if left <= 0:
            laggards = _laggards(ranks, pending, status)
            raise RankError(
                _timeout_message(ranks, pending, limits.timeout, status) + _stacks(ranks, laggards, store_path)
            )
        for obj in wait(list(waitables), timeout=min(left, POLL_S)):
            r = waitables[obj]
            if r in pending and _drain(ranks[r]):
                pending.discard(r)
        failed = [r for r, s in enumerate(ranks) if s.error or s.exit_note]
        if failed:
            # Let the other ranks' reports that are already on their way arrive, then name the root cause.
            time.sleep(0.2)
            for r in list(pending):
                _drain(ranks[r])
            raise _failure(ranks, status)
        stall = _stall_message(ranks, pending, limits.stall_timeout, status)
        progress = _progress(status)
        if not stall or suspected is None or suspected[1] != progress:
            suspected = (time.monotonic(), progress) if stall else None
        elif time.monotonic() - suspected[0] >= STALL_CONFIRM_S:
            raise RankError(stall + _stacks(ranks, _laggards(ranks, pending, status), store_path))


def _progress(status) -> tuple:
    """What every rank is doing, as far as a stall is concerned: its status text and collective number."""
    return tuple((s.text, s.number) for s in status)


def _drain(state: _RankState) -> bool:
    """Read what a rank sent; True once it has reported a result or an error, or has died."""
    try:
        while state.conn.poll():
            kind, body = state.conn.recv()
            if kind == "out":
                print(body, end="")
            elif kind == "ok":
                state.result = (body,)
                return True
            else:
                state.error = body
                return True
    except (EOFError, OSError):
        pass
    if not state.process.is_alive():
        state.process.join()
        if state.result is None and state.error is None:
            state.exit_note = _describe_exit(state.process.exitcode)
        return True
    return False


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without returning a result"


def _status_of(status, rank: int) -> str:
    return status[rank].text.decode(errors="replace") or "no collective yet"


def _last(status, rank: int) -> str:
    """`` during step k (last: what it did)``: the step the rank began last, if it trains, and its last collective."""
    step = status[rank].step
    return f"{f' during step {step}' if step >= 0 else ''} (last: {_status_of(status, rank)})"


def _is_comm_error(state: _RankState) -> bool:
    return bool(state.error) and any(m in state.error[1] for m in _COMM_ERROR_MARKERS)


def _failure(ranks: list[_RankState], status) -> RankError:
    """Pick the root cause (a rank's own exception over a peer's broken connection) and describe every rank."""
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
        head = f"rank {root} of {n} {state.exit_note}{_last(status, root)}"
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
        others.append(f"rank {r}: {what}{_last(status, r)}")
    error = RankError(head + ("\nother ranks:\n  " + "\n  ".join(others) if others else ""))
    if pickled is not None:
        with contextlib.suppress(Exception):
            error.__cause__ = cloudpickle.loads(pickled)
    return error


def _process_state(process: mp.process.BaseProcess) -> str | None:
    """'stopped' for a process stopped by a signal (SIGSTOP, Ctrl-Z), as Linux's /proc reports it; else None."""
    try:
        with open(f"/proc/{process.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return "stopped" if state in ("T", "t") else None


def _laggards(ranks: list[_RankState], pending: set[int], status) -> dict[int, str]:
    """The ranks holding the others up, each with why: stopped by a signal, busy outside any collective, or in an
    earlier collective on a group than its peers are."""
    blocked = {r for r in pending if status[r].blocked_since}
    out = {r: "stopped by a signal (SIGSTOP or Ctrl-Z?)" for r in pending if _process_state(ranks[r].process)}
    out |= {r: "busy outside any collective" for r in pending - blocked if r not in out}
    ahead: dict[bytes, int] = {}
    for r in blocked:
        ahead[status[r].group] = max(ahead.get(status[r].group, 0), status[r].number)
    for r in blocked:
        if r not in out and status[r].number < ahead[status[r].group]:
            out[r] = f"a collective behind its peers on {status[r].group.decode()}"
    return out


def _rank_lines(ranks: list[_RankState], pending: set[int], status, laggards: dict[int, str]) -> list[str]:
    now, lines = time.monotonic(), []
    for r in range(len(ranks)):
        since = status[r].blocked_since
        if r not in pending:
            lines.append(f"  rank {r}: finished")
        elif r in laggards:
            lines.append(f"  rank {r}: {laggards[r]}{_last(status, r)}")
        elif since:
            lines.append(f"  rank {r}: waiting {now - since:.1f} s, {_status_of(status, r)}")
        else:
            lines.append(f"  rank {r}: running{_last(status, r)}")
    return lines


def _stall_message(ranks: list[_RankState], pending: set[int], stall_timeout: float, status) -> str | None:
    """None while the run makes progress; the stall described once a rank has been blocked in a collective for
    ``stall_timeout`` seconds and some other rank is to blame for it."""
    now = time.monotonic()
    stuck = sorted(r for r in pending if status[r].blocked_since and now - status[r].blocked_since > stall_timeout)
    if not stuck:
        return None
    laggards = _laggards(ranks, pending, status)
    if not laggards:
        return None  # every rank is in the same collective: a slow transfer, which the whole-run timeout bounds
    names = ", ".join(str(r) for r in sorted(laggards))
    lines = [
        f"rank{'s' * (len(laggards) > 1)} {names} of {len(ranks)} held the run up: ranks {stuck} waited over "
        f"{stall_timeout:g} s in a collective that rank{'s' * (len(laggards) > 1)} {names} did not reach:",
        *_rank_lines(ranks, pending, status, laggards),
        "If a rank is only slow (a long computation between collectives), raise the stall timeout: stall_timeout= "
        "in launch.run and run_scheme, --stall-timeout on the command line.",
    ]
    return "\n".join(lines)


def _stack_path(store_path: str, rank: int) -> str:
    """Where rank ``rank`` writes its Python stacks when the launcher asks (:data:`STACK_SIGNAL`)."""
    return f"{store_path}.stacks-{rank}"


def _stacks(ranks: list[_RankState], laggards: dict[int, str], store_path: str) -> str:
    """The Python stacks of the live laggards that are not stopped, each asked for with :data:`STACK_SIGNAL`
    (``faulthandler``, which answers even from inside C code): the innermost frames of each thread, most recent
    first. Empty if none answers within a second."""
    asked = [r for r in sorted(laggards) if ranks[r].process.is_alive() and not _process_state(ranks[r].process)]
    for r in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[r].process.pid, STACK_SIGNAL)
    lines, deadline = [], time.monotonic() + 1.0
    for r in asked:
        text, before = "", None
        while (not text or text != before) and time.monotonic() < deadline:  # until the dump stops growing
            before = text
            time.sleep(0.05)
            with contextlib.suppress(OSError), open(_stack_path(store_path, r)) as f:
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


def _timeout_message(ranks: list[_RankState], pending: set[int], timeout: float, status) -> str:
    laggards = _laggards(ranks, pending, status)
    waiting = sorted(r for r in pending if status[r].blocked_since and r not in laggards)
    lines = [f"the run did not finish within timeout={timeout:g} s:", *_rank_lines(ranks, pending, status, laggards)]
    if laggards and waiting:
        lines.append(f"Ranks {waiting} wait in a collective that ranks {sorted(laggards)} never reach.")
    lines.append(
        "If the work is simply slow, allow it more time: timeout= in launch.run and run_scheme, --timeout on the "
        "command line."
    )
    return "\n".join(lines)


def _reap(ranks: list[_RankState]) -> None:
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


# ----------------------------------------------------------------------------------------------- in the child
class _PipeWriter(io.TextIOBase):
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


def _die_with_parent() -> None:
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


def _status_teller(mine: _RankStatus) -> comm.StatusSink:
    """A :func:`course_lib.comm.set_status_sink` sink that writes into this rank's shared status entry."""

    def tell(text: str, group: str, number: int, blocked: bool) -> None:
        mine.blocked_since = 0.0
        mine.text = text.encode()[: STATUS_TEXT_BYTES - 1]
        mine.group, mine.number = group.encode()[:31], number
        mine.blocked_since = time.monotonic() if blocked else 0.0

    return tell


def _join_group(rank: int, world_size: int, store_path: str, backend: str, placed: str, timeout: float) -> None:
    """Set this rank's device and join the process group at the file store; return once every rank has joined."""
    _set_device(placed, rank)
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


def _rank_main(
    rank, world_size, store_path, payload, conn, status, backend, placed, timeout, epoch, threads, count_flops
) -> None:
    global _IN_RANK, _STATUS
    _die_with_parent()
    _IN_RANK = True
    stacks = open(_stack_path(store_path, rank), "w")  # noqa: SIM115 - open for the process's life: faulthandler writes
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    lock = threading.Lock()
    sys.stdout = sys.stderr = _PipeWriter(conn, rank, lock)
    torch.set_num_threads(threads)
    _STATUS = status[rank]
    try:
        _join_group(rank, world_size, store_path, backend, placed, timeout)
        trace.reset(rank, epoch)
        comm.reset()
        comm.set_status_sink(_status_teller(_STATUS))
        fn, args, kwargs = cloudpickle.loads(payload)
        value = _call(fn, args, kwargs, count_flops)
        sys.stdout.flush()
        body = cloudpickle.dumps(_ledgers(value))
        with lock:
            conn.send(("ok", body))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
        sys.stdout.flush()
        try:
            pickled = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
            pickled = None
        with lock:
            conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc(), pickled)))
        conn.close()
        os._exit(1)
