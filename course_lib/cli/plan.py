"""``plan``: choose a layout (TP x PP x DP, ZeRO, ...) for a model on a cluster and say why, or evaluate a given one
as the planner evaluates its own."""

from __future__ import annotations

import argparse

from course_lib.cli.common import (
    add_json_flag,
    command_parser,
    gpu_count,
    param_count,
    positive_float,
    positive_int,
    refusing,
    say,
    token_count,
    write_json,
)
from course_lib.model.config import RECOMPUTE_MODES
from course_lib.parallel.catalog import STAGE_LAYERS, layer_counts

LAYOUT_FLAGS = (
    "tp", "pp", "dp", "cp", "ep", "zero", "schedule", "chunks", "stage_layers", "recompute", "attention", "no_sp",
)  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    from course_lib.planner.layouts import describe
    from course_lib.planner.presets import make_model
    from course_lib.planner.search import plan

    given = [flag for flag in LAYOUT_FLAGS if getattr(args, flag) not in (None, False)]
    if given and not {"tp", "pp", "dp"} & set(given):
        flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
        raise SystemExit(f"plan: {flags} describe a given layout: give --tp, --pp and --dp too (or none of them)")
    if given and args.no_model_parallel:
        flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
        raise SystemExit(
            f"plan: --no-model-parallel asks the planner to search data-parallel layouts only, and {flags} give a "
            "layout to evaluate: drop one or the other"
        )
    try:
        model = make_model(args.preset, args.params, args.layers, args.hidden, args.heads, args.vocab, args.seq)
        if given:
            return _plan_layout(args, model)
        result = plan(
            model,
            args.gpus,
            args.gpus_per_node,
            args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else None,
            args.hardware,
            args.global_batch,
            args.micro_batch,
            no_model_parallel=args.no_model_parallel,
            topology=args.topology,
        )
    except ValueError as err:
        raise SystemExit(f"plan: {err}") from None
    write_json(result.as_dict(), args.json)
    _say_model(args, model, result.gpus, result.gpus_per_node, result.hardware, result.gpu_mem_bytes, result.topology)
    say(
        args,
        f"  choice: {describe(result)}, {result.microbatches} microbatches of {result.micro_batch} per DP rank"
        + (", selective recompute" if result.recompute != "none" else "")
        + _stages(result.stage_layers),
    )
    say(
        args,
        f"  memory per GPU {result.memory_per_gpu_bytes / 1e9:.1f} GB of {result.gpu_mem_bytes / 1e9:.4g} GB; "
        f"bubble {result.bubble_fraction:.1%}; estimated step {result.step_time_s:.3g} s, "
        f"{result.tflops_per_gpu:.3g} TFLOP/s per GPU, MFU {result.mfu:.1%}",
    )
    say(args, "  why:")
    for reason in result.reasons:
        say(args, f"    - {reason}")
    fitting = [c for c in result.candidates if c.fits]
    say(args, f"  top candidates (of {len(fitting)} that fit):")
    for i, c in enumerate(fitting[:3], 1):
        mark = "   <- chosen" if describe(c) == describe(result) else ""
        say(
            args,
            f"    {i}. {describe(c):<48}{c.memory_per_gpu_bytes / 1e9:7.1f} GB   bubble {c.bubble_fraction:6.1%}   "
            f"step {c.step_time_s:.3g} s   MFU {c.mfu:.1%}{mark}",
        )
    return 0


def _busiest(stage: str) -> str:
    """Where the busiest GPU of a pipeline sits and what it holds."""
    if stage in ("first", "last"):
        return f"on the {stage} pipeline stage, the busiest: its layers and one embedding matrix"
    return f"on pipeline {stage}, the busiest: its layers"


def _stages(counts: tuple[int, ...]) -> str:
    """The layers of each pipeline stage when the layout gives them (empty: the even split)."""
    return f"; stages of {','.join(map(str, counts))} layers" if counts else ""


def _say_model(
    args, model, gpus: int, per_node: int, hardware: str, gpu_mem: float, topology: str | None = None
) -> None:
    nodes = -(-gpus // per_node)
    where = (
        f"{topology}'s links, {hardware}'s compute"
        if topology
        else f"{nodes} node{'s' * (nodes > 1)} of {per_node}, {hardware}"
    )
    say(
        args,
        f"{model.name}: {model.params / 1e9:.1f}B parameters"
        + (f" ({model.active_params / 1e9:.1f}B active a token)" if model.experts else "")
        + f" on {gpus} GPUs ({where}, {gpu_mem / 1e9:.4g} GB each)",
    )


def _plan_layout(args: argparse.Namespace, model) -> int:
    """``plan --tp T --pp P --dp D ...``: one given layout, evaluated as the planner evaluates its own."""
    from dataclasses import asdict

    from course_lib.cluster.profiles import get_profile
    from course_lib.model.config import Layout
    from course_lib.planner.cost import PEAK
    from course_lib.planner.evaluate import evaluate_layout
    from course_lib.planner.layouts import describe

    profile = get_profile(args.hardware)
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=args.dp if args.dp is not None else max(1, args.gpus // (tp * cp * pp)),
        zero=args.zero or 0,
        cp=cp,
        ep=args.ep or 1,
        schedule=args.schedule or "1f1b",
        chunks=args.chunks or 1,
        sp=not args.no_sp,
        recompute=args.recompute or "none",
        attention=args.attention or "flash",
        micro_batch=args.micro_batch,
        stage_layers=args.stage_layers or (),
    )
    c = evaluate_layout(
        model,
        args.gpus,
        layout,
        lowest_fitting_zero=args.zero is None,
        global_batch=args.global_batch,
        hardware=args.hardware,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_bytes=args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else None,
        topology=args.topology,
    )
    gpu_mem = args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else profile.memory_bytes
    per_node = args.gpus_per_node or profile.gpus_per_node
    write_json({"model": model.name, "gpus": args.gpus, "hardware": profile.name, **asdict(c)}, args.json)
    _say_model(args, model, args.gpus, per_node, profile.name, gpu_mem, args.topology)
    say(
        args,
        f"  layout: {describe(c)}; {c.microbatches} microbatches of {args.micro_batch} per DP rank, "
        f"{'no' if c.recompute == 'none' else c.recompute} recompute, {c.attention} attention"
        + (", sequence parallel" if c.sp else "")
        + _stages(c.stage_layers),
    )
    parts = ", ".join(f"{k} {c.memory[k] / 1e9:.3g}" for k in ("params", "grads", "optimizer", "activations"))
    verdict = "fits" if c.fits else f"does not fit, {(c.memory_per_gpu_bytes - gpu_mem) / 1e9:.1f} GB over"
    say(args, f"  memory per GPU {c.memory_per_gpu_bytes / 1e9:.1f} GB of {gpu_mem / 1e9:.4g} GB ({parts}): {verdict}")
    if c.memory["stage"] != "all":
        say(args, f"    ({_busiest(c.memory['stage'])})")
    t = c.time
    say(
        args,
        f"  step {c.step_time_s:.3g} s: compute {t['compute_s']:.3g} s, bubble {t['bubble_s']:.3g} s "
        f"({c.bubble_fraction:.1%} of the pipeline's time), exposed TP {t['tp_comm_s']:.3g} s, PP {t['pp_comm_s']:.3g} "
        f"s, CP {t['cp_comm_exposed_s']:.3g} s, EP {t['ep_comm_s']:.3g} s, DP {t['dp_comm_exposed_s']:.3g} s",
    )
    for axis, g in c.placement.items():
        if "where" in g:  # on a topology
            say(
                args,
                f"  {axis.upper()} {g['size']} sits {g['where']} ({g['bandwidth'] / 1e9:g} GB/s, {g['hops']} hops)",
            )
    peak = profile.peak_flops[PEAK["mixed"]] / 1e12
    say(
        args,
        f"  model FLOPs (6N + causal attention) {c.model_flops:.3g} a step: {c.tflops_per_gpu:.3g} TFLOP/s per GPU, "
        f"MFU {c.mfu:.1%} of {peak:g} TFLOP/s",
    )
    say(
        args,
        f"  hardware FLOPs (as computed, with the recomputed forward) {c.hardware_flops:.3g}: "
        f"{c.hardware_tflops_per_gpu:.3g} TFLOP/s per GPU, HFU {c.hfu:.1%}",
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``plan``'s flags: the model, the cluster, the batch, and a given layout's degrees and settings."""
    from course_lib.cluster.profiles import PROFILES
    from course_lib.cluster.topology import PROFILES as TOPOLOGIES
    from course_lib.parallel.schedules import PIPELINE_SCHEDULES
    from course_lib.planner.presets import PRESETS

    pl = command_parser(
        subparsers,
        "plan",
        "choose TP x PP x DP (and ZeRO) for a model on a cluster, and say why",
        [
            ("--preset llama3-405b --gpus 16384", "Llama 3 405B on 16,384 GPUs: TP 8 x PP 16 x DP 128"),
            ("--params 70B --gpus 512 --hardware a100", "a GPT-3-like 70B model on A100s"),
            ("--preset llama3-405b --gpus 16384 --tp 8 --pp 16 --dp 128 --schedule zb-h1", "one given layout"),
            ("--params 7B --gpus 256 --topology tpu-v5p", "the traffic timed on a torus"),
        ],
        usage="--gpus N [options]",
    )
    model = pl.add_argument_group("the model (a preset, a parameter count, or the dims)")
    model.add_argument("--preset", choices=sorted(PRESETS), help="a published model")
    model.add_argument("--params", type=param_count, help="parameter count: 30e9, 30B (alone: a GPT-3-like shape)")
    model.add_argument("--layers", type=positive_int, help="transformer layers")
    model.add_argument("--hidden", type=positive_int, help="model width")
    model.add_argument("--heads", type=positive_int, help="attention heads")
    model.add_argument("--vocab", type=token_count, help="vocabulary size, e.g. 128K")
    model.add_argument(
        "--seq", type=token_count, help="tokens per sequence, e.g. 8K (default: the preset's, else 2048)"
    )
    cluster = pl.add_argument_group("the cluster and the batch")
    cluster.add_argument("--gpus", type=gpu_count, required=True, help="how many GPUs: 1024, 16K")
    cluster.add_argument("--gpus-per-node", type=gpu_count, help="default: the hardware profile's")
    cluster.add_argument("--gpu-mem-gb", type=positive_float, help="memory per GPU (default: the hardware profile's)")
    cluster.add_argument(
        "--hardware", default="h100", help=f"{', '.join(sorted(PROFILES))}, or a measured profile (default h100)"
    )
    cluster.add_argument(
        "--topology",
        metavar="NAME[:SIZE]",
        help=f"time the traffic on this topology's links ({', '.join(TOPOLOGIES)}), sized to --gpus unless SIZE is "
        "given; compute and memory stay --hardware's",
    )
    cluster.add_argument(
        "--global-batch", type=token_count, help="sequences per step (default: the preset's, else 1024)"
    )
    cluster.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per microbatch (default 1)")
    cluster.add_argument("--no-model-parallel", action="store_true", help="only DP and ZeRO/FSDP: tp = pp = 1")
    given = pl.add_argument_group("a given layout (evaluated instead of searched: give --tp, --pp and --dp)")
    for axis, what in (("tp", "tensor"), ("pp", "pipeline"), ("dp", "data"), ("cp", "context"), ("ep", "expert")):
        given.add_argument(f"--{axis}", type=positive_int, help=f"{what} parallel degree")
    given.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="default: the lowest stage that fits")
    given.add_argument("--schedule", choices=PIPELINE_SCHEDULES, help="pipeline schedule (default 1f1b)")
    given.add_argument(
        "--chunks", type=positive_int, help="model chunks per pipeline rank (v), interleaved; zb-v and dualpipev hold 2"
    )
    given.add_argument(STAGE_LAYERS.cli_flag, type=refusing(layer_counts), help=STAGE_LAYERS.help)
    given.add_argument("--recompute", choices=RECOMPUTE_MODES, help="activation recompute (default none)")
    given.add_argument("--attention", choices=["flash", "materialized"], help="attention kernel (default flash)")
    given.add_argument("--no-sp", action="store_true", help="no sequence parallelism with TP")
    pl.set_defaults(func=cmd_plan)
    add_json_flag(pl)
