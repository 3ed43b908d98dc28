"""The process that local ranks are forked from: a multiprocessing forkserver with torch and course_lib imported.

Importing torch takes seconds, so a rank is not spawned fresh (each would import it again) but forked from a server
that imported it once; plain ``fork`` of the caller is no option either, since libgomp deadlocks in a child once
the parent has run a threaded torch op. This module imports neither torch nor the rest of course_lib, so a command
can :func:`warm` the server before its own imports: the two run side by side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing import forkserver, resource_tracker, spawn

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.optim",
    "course_lib",
    "course_lib.runtime.launch",
    "course_lib.runtime.ranks",
    "course_lib.runtime.failures",
    "course_lib.model.gpt",
    "course_lib.ledgers.memory",
]
RANK_NAME = "course_lib-rank"  # every local rank's process name starts with it
_LOCK = threading.Lock()
_standard_preparation_data = spawn.get_preparation_data


def _preparation_data(name: str) -> dict:
    """What multiprocessing tells a new process before it starts, minus the caller's main module for our ranks.

    multiprocessing re-runs the parent's ``__main__`` in every child so that pickled references to it resolve; a
    script without an ``if __name__ == "__main__":`` guard would then launch ranks from inside its ranks. Our ranks
    receive their function by value (cloudpickle), so they never need the caller's main module.
    """
    data = _standard_preparation_data(name)
    if name.startswith(RANK_NAME):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


spawn.get_preparation_data = _preparation_data


def context() -> mp.context.BaseContext:
    """The forkserver context the launcher starts ranks with."""
    ctx = mp.get_context("forkserver")
    with _LOCK:
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def under_torchrun() -> bool:
    """True in a process that torchrun started (RANK and WORLD_SIZE set): ranks run in place."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_restart() -> int:
    """Which attempt of a torchrun job this is: 0 for the first, n after n restarts (``--max-restarts``); 0
    outside torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if under_torchrun() else 0


def warm() -> None:
    """Start the server now, in the background, so that the first launch does not wait for its imports. A no-op
    inside a rank or any other child process, and under torchrun (whose ranks run in place)."""
    if mp.parent_process() is not None or under_torchrun():
        return
    context()
    forkserver.ensure_running()


def discard() -> None:
    """End the server that :func:`warm` started for a command refused before its ranks ran, at once (SIGKILL: it
    may still be importing torch, which would keep it alive for seconds after the refusal). A no-op when none runs."""
    server = forkserver._forkserver
    if server._forkserver_pid is None:
        return
    os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()  # reaps it


def _stop_servers() -> None:
    """Stop the rank server and multiprocessing's resource tracker, and reap them: what a kernel must do before it
    shuts down. ipykernel's shutdown terminates the kernel's children and waits until none is left, but the
    resource tracker ignores SIGTERM and an ended server stays a zombie until reaped, so without this every
    shutdown or restart waited for Jupyter to kill the kernel (2.5 s) and skipped its exit handlers."""
    cells = sys.modules.get("course_lib.runtime.cells")
    if cells is not None:
        cells.stop()  # persistent ranks first: they are the server's children
    forkserver._forkserver._stop()
    resource_tracker._resource_tracker._stop()


def _stop_servers_on_kernel_shutdown() -> None:
    """In a Jupyter kernel, stop the servers when the kernel is asked to shut down or restart."""
    from ipykernel.kernelapp import IPKernelApp

    if not IPKernelApp.initialized():
        return
    kernel = IPKernelApp.instance().kernel
    shutdown = kernel.do_shutdown

    def do_shutdown(restart: bool):
        _stop_servers()
        return shutdown(restart)

    kernel.do_shutdown = do_shutdown


if "ipykernel" in sys.modules and mp.parent_process() is None:  # a notebook will launch ranks soon: start now
    warm()
    _stop_servers_on_kernel_shutdown()
