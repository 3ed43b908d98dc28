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
  if need be (:func:`compute_device`; their collectives go through host memory, :mod:`course_lib.ledgers.comm`).
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
import faulthandler
import functools
import importlib
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from types import ModuleType

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.ledgers import comm, trace
from course_lib.runtime import failures
from course_lib.runtime.forkserver import RANK_NAME, context, torchrun_restart, under_torchrun
from course_lib.runtime.host import check_world_size, compute_device, cores, resolve_backend
from course_lib.runtime.ranks import (
    PipeWriter,
    RankState,
    RankStatus,
    describe_exit,
    die_with_parent,
    join_group,
    laggards,
    new_store_path,
    reap,
    remove_stale_stores,
    status_array,
    status_teller,
)

POLL_S = 0.25  # how often the launcher looks at the ranks' status for a stall
# A stall is reported once it has lasted this long, as the launcher sees it, with no rank making progress: the
# virtual machine this course's CI runs in can be paused, and the monotonic clock then jumps past the stall timeout
# of a rank that was merely waiting (an 8-rank launch that had made every step was reported stalled for 20 s).
STALL_CONFIRM_S = 1.0


class RankError(RuntimeError):
    """A rank raised, died or hung; the message names the ranks and what each was doing."""


class RunResult(list):
    """The per-rank return values in rank order, with each rank's ledger attached.

    ``comm[r]`` is rank r's list of :class:`course_lib.ledgers.comm.CommRecord`, ``events[r]`` its timeline
    (:class:`course_lib.ledgers.trace.Event`), ``programs[r]`` its program (compute, issue, wait; see
    :mod:`course_lib.ledgers.trace`), ``wall_s`` the seconds from launch to the last result, ``device`` what the ranks
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


@dataclass(frozen=True)
class _Limits:
    timeout: float
    stall_timeout: float


_DEVICE = torch.device("cpu")
_IN_RANK = False
_STATUS: RankStatus | None = None  # this local rank's entry in the launcher's status array
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


def _set_device(placed: str, local_rank: int) -> None:
    """Make this rank compute where :func:`compute_device` put it."""
    global _DEVICE
    if placed == "cuda":
        _DEVICE = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(_DEVICE)


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
    cluster, :func:`course_lib.cluster.clock.replay`; it slows CPU ranks down about as much as the memory meter).
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


def _refuse_a_mismatch(records) -> None:
    """A :class:`RankError` for a run that ended without an error although its ranks gave a collective different
    tensors (:func:`course_lib.runtime.failures.ledger_mismatch`): its results are wrong."""
    disagreed = failures.ledger_mismatch(dict(enumerate(records)), "run")
    if disagreed is not None:
        raise RankError(disagreed)


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
    _refuse_a_mismatch(records)
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


def _run_local(fn, world_size, args, kwargs, backend, placed: str, limits: _Limits, count_flops) -> RunResult:
    ctx = context()
    payload = _payload(fn, args, kwargs)
    # Rendezvous through a file, not a TCP store hosted here: a rank's first connection to such a store was now and
    # then reset and torch's client retried after a back-off of 1-5 s (one launch in four stalled ~5 s).
    remove_stale_stores()
    store_path = new_store_path()
    status = status_array(ctx, world_size)
    threads = max(1, cores() // world_size)
    epoch = time.perf_counter()
    ranks: list[RankState] = []
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
            ranks.append(RankState(process, parent_conn))
        _collect(ranks, epoch + limits.timeout, limits, status, store_path)
    finally:
        reap(ranks)
        for path in [store_path] + [failures.stack_path(store_path, r) for r in range(world_size)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    values, records, events, programs = zip(*(cloudpickle.loads(r.result[0]) for r in ranks), strict=True)
    _refuse_a_mismatch(records)
    wall_s = time.perf_counter() - epoch
    return RunResult(list(values), list(records), list(events), list(programs), backend, wall_s, placed)


def _collect(ranks: list[RankState], deadline: float, limits: _Limits, status, store_path: str) -> None:
    """Read every rank's messages until all have reported; raise RankError on the first failure, on a stall (a rank
    blocked in a collective for ``stall_timeout`` that another rank has not reached, seen for ``STALL_CONFIRM_S``
    without progress; the message ends with where the ranks holding it up were, their Python stacks) and at the
    deadline."""
    pending, suspected = set(range(len(ranks))), None  # suspected: (when a stall was first seen, the progress then)
    while pending:
        waitables = {ranks[r].conn: r for r in pending} | {ranks[r].process.sentinel: r for r in pending}
        left = deadline - time.perf_counter()
        if left <= 0:
            held_up_by = laggards(ranks, pending, status)
            raise RankError(
                failures.timeout_message(ranks, pending, limits.timeout, status)
                + failures.stacks(ranks, held_up_by, store_path)
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
            message, cause = failures.failure(ranks, status)
            error = RankError(message)
            error.__cause__ = cause
            raise error
        stall = failures.stall_message(ranks, pending, limits.stall_timeout, status)
        progress = _progress(status)
        if not stall or suspected is None or suspected[1] != progress:
            suspected = (time.monotonic(), progress) if stall else None
        elif time.monotonic() - suspected[0] >= STALL_CONFIRM_S:
            raise RankError(stall + failures.stacks(ranks, laggards(ranks, pending, status), store_path))


def _progress(status) -> tuple:
    """What every rank is doing, as far as a stall is concerned: its status text and collective number."""
    return tuple((s.text, s.number) for s in status)


def _drain(state: RankState) -> bool:
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
            state.exit_note = describe_exit(state.process.exitcode)
        return True
    return False


# ----------------------------------------------------------------------------------------------- in the child
def start_rank(
    rank: int,
    world_size: int,
    store_path: str,
    status,
    backend: str,
    placed: str,
    timeout: float,
    epoch: float,
    threads: int,
) -> None:
    """Make this freshly forked process local rank ``rank`` (of :func:`run`, or a persistent rank of
    :class:`course_lib.runtime.cells.Ranks`): the rank that :func:`rank_device` and :func:`began_step` speak for,
    computing on ``threads`` threads where ``placed`` says (:func:`compute_device`); join the group at the file store
    (its collectives wait ``timeout`` + 30 s) and start the ledgers on the launcher's clock (``epoch``), each collective
    told to this rank's entry of the shared ``status`` (:func:`course_lib.runtime.ranks.status_array`)."""
    global _IN_RANK, _STATUS
    _IN_RANK, _STATUS = True, status[rank]
    torch.set_num_threads(threads)
    _set_device(placed, rank)
    join_group(rank, world_size, store_path, backend, timeout)
    trace.reset(rank, epoch)
    comm.reset()
    comm.set_status_sink(status_teller(_STATUS))


def _rank_main(
    rank, world_size, store_path, payload, conn, status, backend, placed, timeout, epoch, threads, count_flops
) -> None:
    die_with_parent()
    dump = failures.stack_path(store_path, rank)
    stacks = open(dump, "w")  # noqa: SIM115 - open for the process's life: faulthandler writes
    faulthandler.register(failures.STACK_SIGNAL, file=stacks, all_threads=True)
    lock = threading.Lock()
    sys.stdout = sys.stderr = PipeWriter(conn, rank, lock)
    try:
        start_rank(rank, world_size, store_path, status, backend, placed, timeout, epoch, threads)
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
