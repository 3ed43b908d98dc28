"""The schemes without their training code: each scheme's card (:class:`Card`: name, mesh axes, options
(:class:`~course_lib.parallel.interface.Option`) with their defaults, checks and properties), in the registry's
order, and the second names.

A scheme module imports torch, and ``python -m course_lib run --help``, a typo, or a run that cannot work (3 ranks
for a batch of 8, a TP degree that does not divide the heads) must be answered before torch is imported, in a tenth
of a second with nothing started; so the command line reads its flags and runs the schemes' checks
(:mod:`course_lib.parallel.checks`) from here (:func:`refuse`). Each option and check is defined once and the
scheme modules build their registry entries from the cards (:func:`scheme`); :func:`check` runs as the harness
imports the schemes and refuses to go on if the registry's names, or the rank functions' defaults, differ from the
cards'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from course_lib.model.config import MIXED_PRECISIONS
from course_lib.parallel import checks
from course_lib.parallel.checks import KV_METHODS
from course_lib.parallel.interface import Check, Option, Prediction, Scheme, grid_size
from course_lib.parallel.schedules import SCHEDULES

if TYPE_CHECKING:
    from course_lib.model.config import GPTConfig, TrainConfig


def load_model(spec: str) -> object:
    """``--model``'s type: the factory ``FILE.py:NAME`` or ``package.module:NAME`` names, loaded by
    :func:`course_lib.model.gpt.load_factory` (which imports torch, as the student's model does)."""
    from course_lib.model.gpt import load_factory

    return load_factory(spec)


# data, zero, fsdp
BUCKET_MB = Option("bucket_mb", "gradient bucket size in MB (default 0.1)", float, default=0.1)
ONE_BUCKET = Option("bucket_mb", "all gradients in one bucket", flag="--one-bucket", value=None, default=0.1)
PER_PARAMETER = Option(
    "per_parameter", "one all-reduce per gradient (with --no-overlap: the naive scheme)", default=False
)
OVERLAP = Option("overlap", "communicate after backward, not during it", flag="--no-overlap", value=False, default=True)
GRAD_ACCUM = Option("grad_accum", "micro-batches per step, their gradients synced once (default 1)", int, default=1)
MODEL = Option(
    "model",
    "train your own model instead of the tiny GPT: FILE.py:NAME or package.module:NAME, a function returning an "
    "nn.Module whose forward(tokens, targets) returns the mean loss",
    load_model,
)
RESHARD = Option(
    "reshard_after_forward",
    "keep gathered parameters from forward to backward",
    flag="--no-reshard",
    value=False,
    default=True,
)
# tensor, pipeline, context
ASYNC_TP = Option(
    "async_tp", "async TP: the all-gathers and reduce-scatters as ring steps hidden behind the matmuls", default=False
)
SCHEDULE = Option("schedule", f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b)", str, default="1f1b")
MICROBATCHES = Option("microbatches", "microbatches per step (default 4)", int, default=4)
CHUNKS = Option(
    "chunks", "model chunks per rank, for interleaved (default 1; zb-v and dualpipev fix 2)", int, default=1
)


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
    default=(),
)
KV = Option(
    "kv",
    "how K and V reach every rank: ring (send/recv around the ring, default) or all-gather (Llama 3)",
    str,
    choices=KV_METHODS,
    default="ring",
)


# three_d
def _axis(name: str, default: int) -> Option:
    return Option(name, f"{name.upper()} size of a grid (default {default})", int, default=default)


TP, CP, PP, DP = _axis("tp", 2), _axis("cp", 1), _axis("pp", 2), _axis("dp", 2)
EP = Option(
    "ep",
    "expert-parallel size, carved out of the DP ranks: an MoE's experts split over EP of them (default 1)",
    int,
    default=1,
)
ZERO = Option("zero", "ZeRO-1 over the data-parallel (x context-parallel) ranks", int, choices=(0, 1), default=0)
SP = Option("sp", "sequence parallel inside the tensor-parallel groups", default=False)

SCHEDULE_OPTIONS = (GRAD_ACCUM, SCHEDULE, MICROBATCHES, CHUNKS, STAGE_LAYERS)  # run --help shows them under "schedule"


@dataclass(frozen=True)
class Card:
    """What a scheme is without its training code, which imports torch: its name, mesh axes (one: ``run tp --tp
    4`` sets the world size), options and settings fixed by the scheme (``stage`` 2 of ZeRO-2), the checks its
    settings must pass (``validate``, from :mod:`course_lib.parallel.checks`), the fewest layers it needs (one per
    pipeline stage), whether it trains an MoE tiny GPT, the model settings it gives one (``ep``: 8 experts, top-2),
    whether :mod:`course_lib.runtime.checkpoint` saves it, and its mixed-precision conventions. The registry's
    :class:`~course_lib.parallel.interface.Scheme` entries are made from the cards (:func:`scheme`), so the command
    line refuses exactly what the harness would, before torch is imported (:func:`refuse`)."""

    name: str
    validate: Check
    axes: tuple[str, ...] = ("dp",)
    options: tuple[Option, ...] = ()
    fixed: dict = field(default_factory=dict)
    layers_needed: Callable[[int, dict], int] | None = None
    moe: bool = False
    model_settings: dict = field(default_factory=dict)
    checkpoint: bool = True
    precisions: tuple[str, ...] = ()

    def settings(self, options: dict) -> dict:
        """Every setting of the scheme, in the rank function's order: ``options`` over the fixed settings and the
        options' defaults (of two flags setting one option, the first's)."""
        settings = dict(self.fixed)
        for option in self.options:
            settings.setdefault(option.name, option.default)
        return settings | options

    def grid_size(self, o: dict) -> int | None:
        """The world size the settings fix: 1 without axes, the product of the axes for a grid, else None."""
        return grid_size(self.axes, o)


_ZERO = (BUCKET_MB, ONE_BUCKET, OVERLAP, GRAD_ACCUM, MODEL)
_PIPELINE = (SCHEDULE, MICROBATCHES, CHUNKS, STAGE_LAYERS)
CARDS = {
    card.name: card
    for card in (
        Card(
            "single",
            checks.validate_single,
            (),
            (MODEL,),
            fixed={"bucket_mb": 0.1, "per_parameter": False, "overlap": True, "grad_accum": 1},  # dp's, unused
            moe=True,
            precisions=MIXED_PRECISIONS,
        ),
        Card(
            "dp",
            checks.check_batch_split,
            options=(BUCKET_MB, ONE_BUCKET, PER_PARAMETER, OVERLAP, GRAD_ACCUM, MODEL),
            precisions=MIXED_PRECISIONS,
        ),
        Card("zero1", checks.check_batch_split, options=_ZERO, fixed={"stage": 1}, precisions=MIXED_PRECISIONS),
        Card("zero2", checks.check_batch_split, options=_ZERO, fixed={"stage": 2}, precisions=MIXED_PRECISIONS),
        Card(
            "zero3",
            checks.check_batch_split,
            options=(OVERLAP, GRAD_ACCUM, RESHARD, MODEL),
            precisions=("mixed", "no-master"),  # Megatron's fp32 main gradients come with its DDP and ZeRO-1 alone
        ),
        Card("tp", checks.validate_tensor, ("tp",), fixed={"sp": False, "async_tp": False}),
        Card("sp", checks.validate_tensor, ("tp",), (ASYNC_TP,), fixed={"sp": True}),
        Card("pp", checks.validate_pipeline, ("pp",), _PIPELINE, layers_needed=checks.pipeline_layers),
        Card(
            "3d",
            checks.validate_3d,
            ("tp", "cp", "pp", "dp"),
            (TP, CP, PP, DP, KV, ZERO, SP, SCHEDULE, MICROBATCHES, CHUNKS, EP, STAGE_LAYERS),
            layers_needed=checks.grid_layers,
            moe=True,
            model_settings={"aux_loss_coef": 0.0},  # an MoE in a pipeline of microbatches: see checks.check_experts
        ),
        Card("cp", checks.validate_context, ("cp",), (KV, GRAD_ACCUM)),
        Card("ep", checks.validate_expert, ("ep",), moe=True, model_settings={"experts": 8, "top_k": 2}),
    )
}
ALIASES = {"fsdp": "zero3"}  # second names


def card(name: str) -> Card:
    """The card of a scheme by its name or second name."""
    return CARDS[ALIASES.get(name, name)]


def scheme(
    card: Card | str,
    summary: str,
    train: Callable[..., dict],
    predict_memory: Prediction,
    predict_comm: Prediction,
    **torch_side: Callable,
) -> Scheme:
    """The registry entry of a scheme: its card's (given, or :data:`CARDS`' by name) name, axes, options, checks and
    properties, with the training code and formulas of its module (and ``describe``, ``routed_comm`` where it has
    them)."""
    c = CARDS[card] if isinstance(card, str) else card
    return Scheme(
        c.name,
        summary,
        train,
        c.validate,
        predict_memory,
        predict_comm,
        c.options,
        axes=c.axes,
        layers_needed=c.layers_needed,
        moe=c.moe,
        model_settings=c.model_settings,
        checkpoint=c.checkpoint,
        precisions=c.precisions,
        **torch_side,
    )


def check(schemes: dict[str, Scheme]) -> None:
    """Refuse a catalog that says other than the registry ``schemes``: other names or order, or settings whose
    defaults differ from the rank functions' (what the command line checks before torch would not be what runs)."""
    if list(schemes) != list(CARDS):
        raise RuntimeError(
            f"course_lib/parallel/catalog.py lists the schemes {list(CARDS)}; the registry {list(schemes)}"
        )
    for name, spec in schemes.items():
        ours, theirs = CARDS[name].settings({}), spec.settings({})
        theirs.pop("measure_memory", None)
        if list(ours.items()) != list(theirs.items()):  # in the same order too: the settings line prints them
            raise RuntimeError(
                f"course_lib/parallel/catalog.py: scheme {name!r}'s rank function has the settings {theirs}, its card "
                f"{ours}; make the options' defaults (and the card's fixed settings) say what the function says"
            )


def refuse(scheme: Card | Scheme, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict) -> None:
    """Raise ``ValueError`` saying what to change if ``scheme`` (a card, or a registry entry) cannot run with the
    user's ``options``: a model it does not train (an MoE, a precision, a student's model), or a setting its checks
    refuse (on every setting, ``scheme.settings(options)``). Without torch: the command line calls it before anything
    starts, the harness before it launches ranks."""
    if cfg.experts and not scheme.moe:
        takers = [n for n, other in CARDS.items() if other.moe]
        raise ValueError(
            f"scheme {scheme.name!r} trains the dense tiny GPT, and this model has {cfg.experts} experts per layer; "
            f"an MoE model runs under {takers} (or set experts=0)"
        )
    if train.precision is not None and train.precision not in scheme.precisions:
        takers = [n for n, other in CARDS.items() if train.precision in other.precisions]
        raise ValueError(f"precision {train.precision!r} runs under schemes {takers}, not under {scheme.name!r}")
    if options.get("model") is not None and MODEL not in scheme.options:
        takers = [n for n, other in CARDS.items() if MODEL in other.options]
        raise ValueError(
            f"scheme {scheme.name!r} trains the course's tiny GPT only; your own model runs under {takers}. For "
            "tensor parallelism in your model, place ColumnParallelLinear/RowParallelLinear in it "
            "(parallelize_module)."
        )
    scheme.validate(world_size, cfg, train, scheme.settings(options))
