"""Bug hunts: plausible mistakes planted in working schemes, found with the tools of the course.

Each hunt runs a scheme with one component replaced by a broken version, in every rank. The equivalence harness
shows that training no longer matches one device; the ledger (which collectives ran, per layer and per axis) and
the gradients show where. A student writes a fix with the same signature as the broken component, and
:func:`check_fix` runs the scheme with it: it passes when the run matches one device again (fp64, 1e-10).

* ``tp-forgets-allreduce``: a row-parallel linear returns its partial sum without Megatron's g all-reduce.
* ``sp-layernorm-grads``: under sequence parallelism, LayerNorm and row-bias gradients are not summed over the
  tensor-parallel group (a bug class of production sequence-parallel code).
* ``pp-tied-embedding``: the first and last pipeline stages never sum the tied embedding's gradient, so the two
  copies drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn.functional as F

from course_lib.harness import SchemeRun, run_scheme
from course_lib.model.config import GPTConfig, TrainConfig

TOLERANCE = 1e-10  # fp64: a correct scheme matches one device to ~1e-13


def _row_forward_without_g(self, x):
    return F.linear(x, self.weight) + self.bias  # the partial sum of this rank's input slice, never summed


def _finish_gradients_without_sp_sum(self):
    return None  # each rank keeps the LayerNorm gradients of its own sequence shard


def _tied_embedding_not_summed(stages, group):
    return None  # first and last stage each step with half of the embedding's gradient


@dataclass(frozen=True)
class Bug:
    name: str
    story: str
    scheme: str
    world_size: int
    target: tuple[str, str]  # (module, "Class.attribute" or "function") the broken version replaces
    broken: Callable
    options: dict = field(default_factory=dict)
    cfg: GPTConfig = GPTConfig()


BUGS = {
    bug.name: bug
    for bug in (
        Bug(
            "tp-forgets-allreduce",
            "A teammate's tensor-parallel run trains, but its loss drifts from the single-GPU run. Find the layer.",
            "tp",
            2,
            ("course_lib.parallel.tensor_layers", "RowParallelLinear.forward"),
            _row_forward_without_g,
        ),
        Bug(
            "sp-layernorm-grads",
            "Turning on sequence parallelism changed the loss curve, and the LayerNorm weights now differ between "
            "the ranks of a tensor-parallel group.",
            "sp",
            2,
            ("course_lib.parallel.tensor", "TensorParallelStrategy.finish_gradients"),
            _finish_gradients_without_sp_sum,
        ),
        Bug(
            "pp-tied-embedding",
            "A pipeline run with the output head tied to the embedding matches one GPU for a step, then drifts.",
            "pp",
            2,
            ("course_lib.parallel.pipeline", "sum_tied_embedding"),
            _tied_embedding_not_summed,
            {"schedule": "1f1b", "microbatches": 4},
            GPTConfig(layers=4),
        ),
    )
}


def hunt(name: str, fix: Callable | None = None, steps: int = 2) -> SchemeRun:
    """Run bug ``name``'s scheme in float64 with the broken component, or with ``fix`` in its place."""
    if name not in BUGS:
        raise ValueError(f"no bug hunt {name!r}; the hunts are {sorted(BUGS)}")
    bug = BUGS[name]
    patch = (*bug.target, fix or bug.broken)
    train = TrainConfig(steps=steps, dtype="float64")
    return run_scheme(bug.scheme, bug.world_size, bug.cfg, train, patch=patch, **bug.options)


def matches_one_device(run: SchemeRun) -> bool:
    return run.report["max_abs_loss_diff"] <= TOLERANCE and run.report["max_abs_param_diff"] <= TOLERANCE


def check_fix(name: str, fix: Callable) -> tuple[bool, str]:
    """Run the hunt with ``fix``; True with a note once the scheme matches one device again."""
    run = hunt(name, fix)
    report, ok = run.report, matches_one_device(run)
    verdict = "fixed: the run matches one device again" if ok else "not yet: the run still differs from one device"
    return ok, (
        f"{verdict} (largest loss difference {report['max_abs_loss_diff']:.1e}, parameter difference "
        f"{report['max_abs_param_diff']:.1e})"
    )
