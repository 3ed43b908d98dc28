"""The tiny GPT and its training as the command line gives them, shared by ``run`` and ``demo``: the flags, and the
:class:`~course_lib.model.config.GPTConfig`, :class:`~course_lib.model.config.TrainConfig` and launcher limits they
make."""

from __future__ import annotations

import argparse

from course_lib.cli.common import natural, positive_float, positive_int, token_count
from course_lib.model.config import RECOMPUTE_MODES, GPTConfig, TrainConfig
from course_lib.model.formulas import check_reference_fits
from course_lib.parallel import catalog
from course_lib.parallel.catalog import Card
from course_lib.runtime.host import available_memory

MIXED_FLAGS = ("precision", "half", "loss_scale", "initial_scale")  # TrainConfig fields that ``run`` takes


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The training settings given on the command line; ``run``'s mixed-precision flags where given."""
    mixed = {name: getattr(args, name) for name in MIXED_FLAGS if hasattr(args, name)}
    return TrainConfig(steps=args.steps, batch=model_sizes(args)["batch"], seed=args.seed, dtype=args.dtype, **mixed)


# A modeled run's defaults: with the tiny GPT's (64 wide, 32 tokens, batch 8) an H100 computes a step in ~0.2 us,
# invisible beside communication; at these sizes compute is about a tenth of a data-parallel step.
MODELED_DEFAULTS = {"hidden": 256, "seq": 128, "batch": 32}


def model_sizes(args: argparse.Namespace) -> dict:
    """The model and batch sizes given on the command line, the modeled-run defaults where ``--hardware`` is given
    and a size is not, else the tiny GPT's."""
    modeled = MODELED_DEFAULTS if getattr(args, "hardware", None) else {}
    default = GPTConfig()
    return {
        "hidden": args.hidden or modeled.get("hidden", default.d_model),
        "seq": args.seq or modeled.get("seq", default.seq),
        "batch": args.batch or modeled.get("batch", TrainConfig().batch),
    }


MOE_FLAGS = ("experts", "top_k", "capacity_factor", "aux_loss_coef")  # GPTConfig fields that ``run`` takes


def model_config(args: argparse.Namespace, layers_needed: int = 1, model_settings: dict | None = None) -> GPTConfig:
    """The tiny GPT with the sizes given on the command line; by default 2 layers, or as many as the scheme needs
    (one per pipeline stage) if that is more; MoE settings from the command line over the scheme's
    ``model_settings`` (``ep``: 8 experts, top-2)."""
    sizes = model_sizes(args)
    given = {name: getattr(args, name) for name in MOE_FLAGS if getattr(args, name, None) is not None}
    return GPTConfig(
        layers=args.layers or max(GPTConfig().layers, layers_needed),
        d_model=sizes["hidden"],
        heads=args.heads or GPTConfig().heads,
        seq=sizes["seq"],
        recompute=getattr(args, "recompute", "none"),
        **((model_settings or {}) if given.get("experts") != 0 else {}) | given,
    )


def launch_limits(args: argparse.Namespace) -> dict:
    """The launcher's limits from the command line: whole-run and stall timeouts, and the cap on local ranks."""
    return {"timeout": args.timeout, "stall_timeout": args.stall_timeout, "max_ranks": args.max_ranks}


GROUPS = ("what to run", "model and data", "schedule", "precision", "output")  # run --help and demo --help, in order


def training_groups(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The groups of flags ``run`` and ``demo`` show their help in (:data:`GROUPS`), by name; a command adds its own
    flags to them (``run``'s scheme first) before :func:`add_training_flags` adds the shared ones."""
    return {name: p.add_argument_group(name) for name in GROUPS}


def add_training_flags(groups: dict[str, argparse._ArgumentGroup], modeled: bool) -> None:
    """The flags of the launch, the model, the training and its output that ``run`` and ``demo`` share;
    ``modeled``: the command takes ``--hardware``, which changes the model's default sizes."""
    launch = groups["what to run"]
    launch.add_argument(
        "--backend", choices=["auto", "gloo", "nccl"], default="auto", help="default auto: nccl with CUDA, else gloo"
    )
    launch.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the ranks compute (default: cuda under nccl, else cpu)",
    )
    launch.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        metavar="S",
        help="seconds the whole run may take (default 300)",
    )
    launch.add_argument(
        "--stall-timeout",
        type=positive_float,
        default=20.0,
        metavar="S",
        help="seconds a rank may wait for a peer in a collective (default 20)",
    )
    launch.add_argument(
        "--max-ranks", type=positive_int, metavar="N", help="allow more local ranks than this machine's limit"
    )
    _add_model_flags(groups["model and data"], MODELED_DEFAULTS if modeled else {})
    groups["schedule"].add_argument(
        "--steps", type=positive_int, default=3, metavar="N", help="training steps (default 3)"
    )
    groups["precision"].add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="every tensor's type (default float32)"
    )
    groups["output"].add_argument("--plot", metavar="DIR", help="write the figures and a Chrome trace into DIR")
    groups["output"].add_argument(
        "--traceback",
        action="store_true",
        help="when a rank fails, print its whole traceback and what the other ranks were doing (default: its "
        "innermost lines)",
    )


def _add_model_flags(model: argparse._ArgumentGroup, modeled: dict) -> None:
    """The tiny GPT's sizes, its recompute and its data's seed; ``modeled``: the defaults with ``--hardware``."""

    def default(flag: str, value: int) -> str:
        return f"default {value}" + (f"; {modeled[flag]} with --hardware" if flag in modeled else "")

    model.add_argument(
        "--layers", type=positive_int, metavar="N", help="transformer layers (default 2, or one per stage)"
    )
    model.add_argument("--hidden", type=positive_int, metavar="N", help=f"model width ({default('hidden', 64)})")
    model.add_argument(
        "--heads", type=positive_int, metavar="N", help="attention heads, must divide --hidden (default 4)"
    )
    model.add_argument("--seq", type=token_count, metavar="N", help=f"tokens per sequence ({default('seq', 32)})")
    model.add_argument(
        "--batch", type=positive_int, metavar="N", help=f"global batch in sequences ({default('batch', 8)})"
    )
    model.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default="none",
        help="recompute in backward: selective (attention scores), full (layers)",
    )
    model.add_argument(
        "--seed", type=natural, default=0, metavar="N", help="random seed of the weights and data (default 0)"
    )


def checked_configs(
    args: argparse.Namespace,
    command: str,
    card: Card,
    world_size: int,
    options: dict | None = None,
    layers: int | None = None,
    which: str = "",
) -> tuple[GPTConfig, TrainConfig]:
    """The model and training settings the command line gives ``card``'s scheme on ``world_size`` ranks with
    ``options`` (the tiny GPT with ``layers`` at least, else as many as the scheme needs), refused as ``command:
    why`` if this machine could not hold their one-device reference
    (:func:`course_lib.model.formulas.check_reference_fits`), or ``command: which: why`` if the scheme cannot run
    them (:func:`course_lib.parallel.catalog.refuse`: its sizes, checks and models). Before torch is imported and
    anything starts; the harness checks the ranks' memory, which needs the scheme's code, after."""
    options = options or {}
    settings = card.settings(options)
    try:
        needed = layers or (card.layers_needed(world_size, settings) if card.layers_needed else 1)
        cfg, train = model_config(args, needed, card.model_settings), train_config(args)
        if options.get("model") is None:  # a student's model is built, and its size checked, by the harness
            check_reference_fits(cfg, train, available_memory())
    except ValueError as err:
        raise SystemExit(f"{command}: {err}") from None
    try:
        catalog.refuse(card, world_size, cfg, train, options)
    except ValueError as err:
        raise SystemExit(f"{command}: {which + ': ' if which else ''}{err}") from None
    return cfg, train
