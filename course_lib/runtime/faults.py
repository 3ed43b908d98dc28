"""Failure injection on real ranks: a fault plan makes one rank fail at a chosen step, in a chosen way.

A :class:`Fault` names the rank (global), the step (from 0, as ``trace.tags(step=...)``), the kind and the point in
the step where it fires:

* ``raise``: an :class:`InjectedFault` (``injected fault: rank 1 at step 2 (forward)``), as a bug in the code would;
* ``exit``: ``os._exit(EXIT_CODE)``, a process that ends without a word (an OOM killer's victim, a failed assert in C);
* ``kill``: SIGKILL to itself, a lost node or GPU;
* ``hang``: sleep forever, a stuck kernel or a dead link; the launcher's stall detector or timeout must end it.

Phases: ``forward`` (the start of the step, before its forward), ``grad_sync`` (after backward, before the strategy
finishes the gradients; a scheme that overlaps its gradient collectives with backward has issued them already),
``optimizer`` (before the optimizer step) and ``checkpoint`` (in a step that saves a checkpoint, after every rank wrote
its shards and before the folder is renamed into place: :func:`course_lib.runtime.checkpoint.save`; for an asynchronous
checkpoint in the thread that writes it, :class:`course_lib.runtime.checkpoint.Saver`). Every scheme trains through
:func:`course_lib.parallel.data.train_loop`, which calls :func:`reach` at those points, so no scheme knows about faults.
The plan reaches the ranks with the rank function: :func:`injected` wraps it so that each rank sets the active plan in
its own process before training (``run_scheme(..., fault=Fault(1, 2, "kill"))``, ``run dp --kill-rank 1 --at-step 2``);
the launcher then reports the failure like any other (:class:`course_lib.runtime.launch.RankError`, naming the rank and
the step it had begun).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from course_lib.runtime.checkpoint_plan import CheckpointPlan

KINDS = ("raise", "exit", "kill", "hang")
PHASES = ("forward", "grad_sync", "optimizer", "checkpoint")
EXIT_CODE = 3  # what an ``exit`` fault's rank exits with


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws inside its rank."""


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` fails at step ``step`` (from 0), at ``phase`` of that step, by ``kind``."""

    rank: int
    step: int
    kind: str = "kill"
    phase: str = "forward"

    def __post_init__(self) -> None:
        for name in ("rank", "step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"a fault's {name} must be a whole number of at least 0, not {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown fault phase {self.phase!r}; choose one of {PHASES}")

    def check(self, world_size: int, steps: int) -> None:
        """Refuse a fault that could never fire in a run of ``world_size`` ranks and ``steps`` steps."""
        if self.rank >= world_size:
            raise ValueError(f"cannot fail rank {self.rank}: the run's ranks are 0 to {world_size - 1}")
        if self.step >= steps:
            raise ValueError(f"cannot fail at step {self.step}: the run's steps are 0 to {steps - 1}")

    def __str__(self) -> str:
        return f"rank {self.rank} at step {self.step} ({self.phase})"


_ACTIVE: Fault | None = None  # the plan of this rank's process, set by injected


def injected(fn: Callable, fault: Fault) -> Callable:
    """``fn`` (a rank function) with ``fault`` active in every rank that runs it; pass it to ``launch.run``."""
    from course_lib.runtime import launch

    return launch.with_setting(fn, __name__, "_ACTIVE", fault)


def _hang(fault: Fault) -> None:
    while True:
        time.sleep(3600)


def _raise(fault: Fault) -> None:
    raise InjectedFault(f"injected fault: {fault}")


_FIRE: dict[str, Callable[[Fault], None]] = {
    "raise": _raise,
    "exit": lambda fault: os._exit(EXIT_CODE),
    "kill": lambda fault: os.kill(os.getpid(), signal.SIGKILL),
    "hang": _hang,
}


def reach(step: int, phase: str) -> None:
    """The training loop is at ``phase`` of ``step``: fire the active fault if it is this rank's, here and now."""
    fault = _ACTIVE
    if fault is None or (fault.step, fault.phase) != (step, phase):
        return
    import torch.distributed as dist  # here, so that the command line takes KINDS and PHASES without torch

    if dist.get_rank() == fault.rank:
        _FIRE[fault.kind](fault)


def check_fault(
    fault: Fault,
    world_size: int,
    steps: int,
    plan: CheckpointPlan | None,
    asynchronous: bool,
    in_process: bool,
) -> None:
    """Refuse a fault this run cannot fire: in this process, before a resumed run's first step, in a checkpoint
    phase of a step that saves none or of an asynchronous checkpoint."""
    if in_process:
        raise ValueError("a fault is injected into launched ranks, not into this process; drop in_process")
    fault.check(world_size, steps)
    start = plan.start if plan is not None else 0
    if fault.step < start:
        raise ValueError(f"cannot fail at step {fault.step}: the resumed run trains steps {start} to {steps - 1}")
    if fault.phase == "checkpoint" and (plan is None or not plan.due(fault.step)):
        raise ValueError(
            f"a fault in the checkpoint phase fires in a step that saves one, and step {fault.step} does not: "
            f"pass checkpoint_every=K with (step + 1) divisible by K"
        )
    if fault.phase == "checkpoint" and fault.kind == "hang" and asynchronous:
        raise ValueError(
            "a hang in the checkpoint phase of an asynchronous checkpoint would stop only the thread that writes "
            "it, not the rank; hang a synchronous checkpoint, or another phase"
        )
