"""The interface every scheme module of :mod:`course_lib.parallel` implements.

A scheme module holds a scheme's rank function and, next to the code they describe, its checks and its formulas;
at its end a ``SCHEMES`` tuple of :class:`Scheme` entries names them. The harness (:mod:`course_lib.harness`), the
command line and the notebooks use nothing else, so a new scheme needs no change outside its module, one line of
the registry, its tests and its lesson (``docs/architecture.md`` has the checklist).

Every check and formula takes ``(world_size, cfg, train, o)``, with ``o`` = :meth:`Scheme.settings`: every keyword
of the rank function, the user's options over its defaults.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from course_lib.model.config import GPTConfig, TrainConfig

Check = Callable[[int, "GPTConfig", "TrainConfig", dict], None]
Prediction = Callable[[int, "GPTConfig", "TrainConfig", dict], list[dict]]


@dataclass(frozen=True)
class Option:
    """A setting a user may change: keyword ``name`` of the rank function, ``default`` when not given (the rank
    function's own default: :func:`course_lib.parallel.catalog.check` compares them). On the command line it is
    ``flag`` (default ``--name``, dashes for underscores) taking a value of ``kind`` (int and float must be positive;
    ``choices`` limits them instead), or, with ``kind`` None, a switch that sets ``value``."""

    name: str
    help: str
    kind: type | None = None
    flag: str = ""
    value: object = True
    choices: tuple = ()
    default: object = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Scheme:
    """One entry of the registry.

    ``train`` is the rank function ``train(cfg, train, **settings) -> dict`` (``losses``, ``params``, ``memory``,
    ``coords``; see :mod:`course_lib.harness`). ``validate`` raises ``ValueError`` saying what to change before any
    rank starts. ``predict_memory`` gives each rank's bytes by category (``params``, ``grads``, ``optimizer``,
    ``activations``), ``predict_comm`` each rank's bytes sent per step: by collective, or by axis for a grid.
    ``axes`` are the mesh axes the ranks form: none (one rank), one (its size is the world size: ``run tp --tp 4``)
    or several, each an option, whose product is the world size. ``describe`` adds scheme-specific entries to the
    report (a pipeline's plan); ``layers_needed`` is the fewest layers the model needs (one per pipeline stage).
    ``moe`` says whether the scheme trains a tiny GPT with experts (``GPTConfig.experts`` > 0) exactly; the harness
    refuses an MoE model for the others. ``model_settings`` are the fields of :class:`course_lib.model.config.GPTConfig`
    the command line and the demo give the scheme's model unless the user gives them (``ep``: 8 experts, top-2).
    ``routed_comm`` predicts the bytes that depend on where a router sent the tokens (an MoE's all-to-alls) from
    the ranks' reports and the settings: ``routed_comm(results, cfg, train, o)`` gives each rank's bytes by
    collective (by axis for a grid), which the harness adds to ``predict_comm``'s, key by key. ``checkpoint`` says
    whether the scheme's state is one :mod:`course_lib.runtime.checkpoint` can save and resume (parameters with AdamW,
    whole, as tensor-parallel shards or pipeline stages, or their slices in ZeRO's and FSDP's flat buffers); the harness
    refuses checkpoint settings for the others. ``precisions`` are the mixed-precision conventions the scheme trains
    in (``TrainConfig.precision``: :mod:`course_lib.model.precision`); the harness refuses the others.
    """

    name: str
    summary: str
    train: Callable[..., dict]
    validate: Check
    predict_memory: Prediction
    predict_comm: Prediction
    options: tuple[Option, ...] = ()
    axes: tuple[str, ...] = ("dp",)
    describe: Callable[[int, GPTConfig, TrainConfig, dict], dict] | None = None
    layers_needed: Callable[[int, dict], int] | None = None
    moe: bool = False
    model_settings: dict = field(default_factory=dict)
    routed_comm: Callable[[list[dict], GPTConfig, TrainConfig, dict], list[dict]] | None = None
    checkpoint: bool = False
    precisions: tuple[str, ...] = ()

    def settings(self, options: dict) -> dict:
        """Every keyword of the rank function: ``options`` over its defaults. Refuses an option the scheme does not
        take, naming the ones it does."""
        takes = {o.name for o in self.options}
        unknown = set(options) - takes
        if unknown:
            raise ValueError(
                f"scheme {self.name!r} takes no option(s) {sorted(unknown)}; it takes {sorted(takes) or 'none'}"
            )
        defaults = {
            name: p.default
            for name, p in inspect.signature(self.train).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        return defaults | options

    def grid_size(self, o: dict) -> int | None:
        """The world size the settings fix (:func:`grid_size`)."""
        return grid_size(self.axes, o)


def grid_size(axes: tuple[str, ...], o: dict) -> int | None:
    """The world size settings ``o`` fix for a scheme on mesh ``axes``: 1 without axes, the product of the axes for
    a grid, else None (the caller chooses)."""
    if not axes:
        return 1
    return math.prod(o[axis] for axis in axes) if len(axes) > 1 else None
