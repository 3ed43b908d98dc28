"""The schemes as the command line parses them, without importing one: each scheme's name, mesh axes and options
(:class:`~course_lib.parallel.interface.Option`), in the registry's order, and the second names.

A scheme module imports torch, and ``python -m course_lib run --help`` (or a typo) must answer before torch is
imported, so the command line reads its flags here. Each option is defined here once and the scheme modules take
it from here; :func:`check` runs as the harness imports the schemes and refuses to go on if a scheme's names, axes
or options differ from its card, so a scheme's new option fails at once, naming the line to add here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from course_lib.parallel.interface import Option
from course_lib.parallel.schedules import SCHEDULES

if TYPE_CHECKING:
    from course_lib.parallel.interface import Scheme


def load_model(spec: str) -> object:
    """``--model``'s type: the factory ``FILE.py:NAME`` or ``package.module:NAME`` names, loaded by
    :func:`course_lib.model.gpt.load_factory` (which imports torch, as the student's model does)."""
    from course_lib.model.gpt import load_factory

    return load_factory(spec)


# data, zero, fsdp
BUCKET_MB = Option("bucket_mb", "gradient bucket size in MB (default 0.1)", float)
ONE_BUCKET = Option("bucket_mb", "all gradients in one bucket", flag="--one-bucket", value=None)
PER_PARAMETER = Option("per_parameter", "one all-reduce per gradient (with --no-overlap: the naive scheme)")
OVERLAP = Option("overlap", "communicate after backward, not during it", flag="--no-overlap", value=False)
GRAD_ACCUM = Option("grad_accum", "micro-batches per step, their gradients synced once (default 1)", int)
MODEL = Option(
    "model",
    "train your own model instead of the tiny GPT: FILE.py:NAME or package.module:NAME, a function returning an "
    "nn.Module whose forward(tokens, targets) returns the mean loss",
    load_model,
)
RESHARD = Option(
    "reshard_after_forward", "keep gathered parameters from forward to backward", flag="--no-reshard", value=False
)
# tensor, pipeline, context
ASYNC_TP = Option("async_tp", "async TP: the all-gathers and reduce-scatters as ring steps hidden behind the matmuls")
SCHEDULE = Option("schedule", f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b)", str)
MICROBATCHES = Option("microbatches", "microbatches per step (default 4)", int)
CHUNKS = Option("chunks", "model chunks per rank, for interleaved (default 1; zb-v and dualpipev fix 2)", int)


def layer_counts(text: str) -> tuple[int, ...]:
    """``--stage-layers``' type: the layers of each pipeline stage, first to last, separated by commas."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"give whole numbers separated by commas, one per pipeline stage (1,2,2,3), not {text!r}"
        ) from None
    if min(counts) < 1:
        raise ValueError(f"every pipeline stage needs at least one layer: {text!r}")
    return counts


STAGE_LAYERS = Option(
    "stage_layers",
    "layers of each pipeline stage, first to last, e.g. 1,2,2,3 (Megatron-LM's first/last-stage layer counts; "
    "default: as even as they go)",
    layer_counts,
)
KV = Option(
    "kv",
    "how K and V reach every rank: ring (send/recv around the ring, default) or all-gather (Llama 3)",
    str,
    choices=("ring", "all-gather"),
)


# three_d
def _axis(name: str, default: int) -> Option:
    return Option(name, f"{name.upper()} size of a grid (default {default})", int)


TP, CP, PP, DP = _axis("tp", 2), _axis("cp", 1), _axis("pp", 2), _axis("dp", 2)
EP = Option(
    "ep", "expert-parallel size, carved out of the DP ranks: an MoE's experts split over EP of them (default 1)", int
)
ZERO = Option("zero", "ZeRO-1 over the data-parallel (x context-parallel) ranks", int, choices=(0, 1))
SP = Option("sp", "sequence parallel inside the tensor-parallel groups")

SCHEDULE_OPTIONS = (GRAD_ACCUM, SCHEDULE, MICROBATCHES, CHUNKS, STAGE_LAYERS)  # run --help shows them under "schedule"


@dataclass(frozen=True)
class Card:
    """What the command line knows of a scheme: its name, mesh axes (one: ``run tp --tp 4`` sets the world size)
    and options, as :class:`~course_lib.parallel.interface.Scheme` has them."""

    name: str
    axes: tuple[str, ...] = ("dp",)
    options: tuple[Option, ...] = ()


_ZERO = (BUCKET_MB, ONE_BUCKET, OVERLAP, GRAD_ACCUM, MODEL)
CARDS = {
    card.name: card
    for card in (
        Card("single", (), (MODEL,)),
        Card("dp", options=(BUCKET_MB, ONE_BUCKET, PER_PARAMETER, OVERLAP, GRAD_ACCUM, MODEL)),
        Card("zero1", options=_ZERO),
        Card("zero2", options=_ZERO),
        Card("zero3", options=(OVERLAP, GRAD_ACCUM, RESHARD, MODEL)),
        Card("tp", ("tp",)),
        Card("sp", ("tp",), (ASYNC_TP,)),
        Card("pp", ("pp",), (SCHEDULE, MICROBATCHES, CHUNKS, STAGE_LAYERS)),
        Card(
            "3d",
            ("tp", "cp", "pp", "dp"),
            (TP, CP, PP, DP, KV, ZERO, SP, SCHEDULE, MICROBATCHES, CHUNKS, EP, STAGE_LAYERS),
        ),
        Card("cp", ("cp",), (KV, GRAD_ACCUM)),
        Card("ep", ("ep",)),
    )
}
ALIASES = {"fsdp": "zero3"}  # second names


def card(name: str) -> Card:
    """The card of a scheme by its name or second name."""
    return CARDS[ALIASES.get(name, name)]


def _same(ours: Option, theirs: Option) -> bool:
    """The same option, but for a loader (``--model``) whose import the catalog defers: any callable that is not a
    type stands for the scheme's own."""
    deferred = not isinstance(ours.kind, type) and ours.kind is not None and callable(theirs.kind)
    return replace(ours, kind=None) == replace(theirs, kind=None) and (deferred or ours.kind == theirs.kind)


def check(schemes: dict[str, Scheme]) -> None:
    """Refuse a catalog that says other than the registry ``schemes``: other names or order, axes or options."""
    if list(schemes) != list(CARDS):
        raise RuntimeError(
            f"course_lib/parallel/catalog.py lists the schemes {list(CARDS)}; the registry {list(schemes)}"
        )
    for name, spec in schemes.items():
        ours = CARDS[name]
        same = len(ours.options) == len(spec.options) and all(map(_same, ours.options, spec.options))
        if ours.axes != spec.axes or not same:
            raise RuntimeError(
                f"course_lib/parallel/catalog.py: scheme {name!r} has axes {spec.axes} and options {spec.options} "
                f"in its module, the catalog {ours.axes} and {ours.options}; make the catalog say what the module says"
            )
