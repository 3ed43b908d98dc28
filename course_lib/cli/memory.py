"""``memory``: the predicted bytes per device of a model (a preset, a parameter count or its dims) in a precision
and a layout, from the memory formulas; no ranks start."""

from __future__ import annotations

import argparse

from course_lib.cli.common import (
    add_json_flag,
    command_parser,
    natural,
    param_count,
    positive_int,
    refusing,
    say,
    token_count,
    write_json,
)
from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.config import RECOMPUTE_MODES
from course_lib.model.formulas import memory_formula, transformer_params
from course_lib.parallel.catalog import STAGE_LAYERS, layer_counts

EXPERT_FLAGS = ("top_k", "expert_ffn", "shared_experts", "dense_layers")


def _experts(args: argparse.Namespace) -> dict:
    """The mixture-of-experts settings of ``memory`` (expert parameters, the FFN width a token passes through),
    refused with what to change when they do not go together."""
    if args.experts is None:
        given = [f"--{flag.replace('_', '-')}" for flag in EXPERT_FLAGS if getattr(args, flag) is not None]
        if args.ep > 1 or given:
            flags = ", ".join(([f"--ep {args.ep}"] if args.ep > 1 else []) + given)
            raise SystemExit(f"memory: {flags} without --experts: give the number of routed experts (--experts E)")
        return {}
    from course_lib.planner.presets import Experts

    missing = [f for f, v in (("--top-k", args.top_k), ("--expert-ffn", args.expert_ffn)) if v is None]
    missing += [
        f for f, v in (("--params", args.params), ("--layers", args.layers), ("--hidden", args.hidden)) if v is None
    ]
    if missing:
        raise SystemExit(
            f"memory: --experts needs {', '.join(missing)} (--params counts all parameters, experts included; the "
            "experts' share comes from --layers, --hidden and --expert-ffn)"
        )
    experts = Experts(args.experts, args.top_k, args.expert_ffn, args.shared_experts or 0, args.dense_layers or 0)
    try:
        experts.check(args.layers, args.ep)
    except ValueError as err:
        raise SystemExit(f"memory: {err}") from None
    return {
        "expert_params": experts.routed_params(args.layers, args.hidden),
        "ffn": experts.token_ffn,
        "moe_pattern": experts.pattern(args.layers),
        "dense_mlp": experts.dense_mlp(args.hidden, args.ffn or 4 * args.hidden, args.swiglu),
    }


SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads")  # what --preset gives
ALWAYS_SHOWN_AXES = ("dp", "tp", "pp")  # in memory's summary line; cp and ep only where they split something


def _memory_model(args) -> tuple[float, dict, str]:
    """The parameter count, the memory shape (:meth:`course_lib.planner.presets.Model.memory_shape` keys) and a name,
    from ``--preset`` or from the flags."""
    from course_lib.planner.presets import make_model

    if args.preset is not None:
        given = [f"--{f.replace('_', '-')}" for f in (*SHAPE_FLAGS, "params", "experts") if getattr(args, f)]
        if given or args.swiglu or args.untied:
            raise SystemExit(f"memory: --preset gives the model's dims; drop {', '.join(given) or 'the dim flags'}")
        try:
            model = make_model(preset=args.preset, seq=args.seq)
        except ValueError as err:
            raise SystemExit(f"memory: {err}") from None
        return model.params, model.memory_shape(), model.name
    moe = _experts(args)
    dims = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq}
    shape = {"kv_heads": args.kv_heads, "swiglu": args.swiglu, "tied": not args.untied, "norm": args.norm}
    if args.vocab is not None:
        shape["vocab"] = args.vocab
    if args.ffn is not None:
        shape["ffn"] = args.ffn
    if args.params is None:
        if args.layers is None or args.hidden is None or args.vocab is None:
            raise SystemExit("memory: give --preset NAME, --params N, or the model dims --layers, --hidden and --vocab")
        # A GELU model is counted as the course's GPT (biases, learned positions), a SwiGLU one as Llama (neither).
        params = transformer_params(
            args.layers,
            args.hidden,
            args.vocab,
            heads=args.heads,
            kv_heads=args.kv_heads,
            ffn=args.ffn,
            swiglu=args.swiglu,
            tied=not args.untied,
            norm=args.norm,
            biases=not args.swiglu,
            positions=0 if args.swiglu else args.seq or 0,
        )["total"]
    else:
        params = int(args.params) if float(args.params).is_integer() else args.params
    with_activations = all(v is not None for v in dims.values())
    return params, {**(dims if with_activations else {}), **shape, **moe}, f"{params / 1e9:.3g}B"


def cmd_memory(args: argparse.Namespace) -> int:
    from course_lib.model.config import PRECISIONS, Layout

    params, shape, name = _memory_model(args)
    layout = Layout(
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        zero=args.zero,
        cp=args.cp,
        ep=args.ep,
        chunks=args.chunks,
        sp=args.sp,
        recompute=args.recompute,
        attention=args.attention,
        micro_batch=args.micro_batch,
        stage_layers=args.stage_layers or (),
    )
    axes = {axis: getattr(layout, axis) for axis in ("dp", "tp", "pp", "cp", "ep")}
    try:
        result = memory_formula(params, args.precision, layout, **shape)
    except ValueError as err:
        raise SystemExit(f"memory: {err}") from None
    stages = [memory_formula(params, args.precision, layout, **shape, stage=i) for i in range(args.pp)]
    data = {
        "model": name,
        "params": params,
        "precision": args.precision,
        "zero": args.zero,
        **axes,
        "expert_params": shape.get("expert_params", 0),
        "attention": args.attention,
        "bytes_per_device": result,
    }
    if layout.stage_layers:
        data |= {"stage_layers": list(layout.stage_layers), "bytes_per_stage": stages}
    write_json(data, args.json)
    shown = {k: v for k, v in axes.items() if k in ALWAYS_SHOWN_AXES or v > 1}  # cp and ep where they split
    experts = f" ({shape['expert_params']:,.0f} in routed experts)" if shape.get("expert_params") else ""
    say(
        args,
        f"{name}: {params:,.0f} parameters{experts}, {args.precision}, ZeRO-{args.zero}, "
        + " ".join(f"{k}={v}" for k, v in shown.items()),
    )
    where = {"all": "", "first": " (the first pipeline stage)", "last": " (the last pipeline stage)"}
    say(args, f"  bytes on the busiest GPU{where.get(result['stage'], ' (pipeline ' + result['stage'] + ')')}:")
    for key in (*CATEGORIES, "activations", "total"):
        say(args, f"  {key:<12} {result[key] / 1e9:12.3f} GB")
    if layout.stage_layers:
        _say_stages(args, layout.stage_layers, stages, result["stage"])
    if "layers" not in shape:
        say(args, "  (activations need --layers, --hidden, --heads and --seq)")
    say(args, f"  bytes per parameter: {PRECISIONS[args.precision].source}")
    if "layers" in shape:
        say(args, f"  attention: {ATTENTION_NOTES[args.attention]}")
    if args.precision in REFERENCE_NOTES:
        say(args, f"  against the reference: {REFERENCE_NOTES[args.precision]}")
    return 0


def _say_stages(args: argparse.Namespace, counts: tuple[int, ...], stages: list[dict], busiest: str) -> None:
    """Each pipeline stage's layers and bytes (model states, activations, total), the busiest one marked."""
    say(args, "  each pipeline stage (GB):   layers   states   activations   total")
    for n, got in zip(counts, stages, strict=True):
        states = sum(got[k] for k in CATEGORIES)
        mark = "  <- busiest" if got["stage"] == busiest else ""
        say(
            args,
            f"  {got['stage']:<26} {n:>6} {states / 1e9:8.3f} {got['activations'] / 1e9:13.3f} "
            f"{got['total'] / 1e9:7.3f}{mark}",
        )


REFERENCE_NOTES = {  # where we differ from the estimator a convention is named after (tests/test_memory_references.py)
    "megatron": "weights and optimizer equal Megatron-LM's theoretical_memory_usage.py for the same parameter count "
    "(it skips linear biases and learned positions, we count them); its activations count K/V as wide as Q and a "
    "SwiGLU MLP as GELU's 4 ffn/h, only the first stage, and without SP add 5% and take the MLP as 4h wide",
    "deepspeed": "equal to DeepSpeed's estimate_zero2/3_model_states_mem_needs (model states; it counts no "
    "activations); ZeRO-3 with the largest layer gathered",
}


ATTENTION_NOTES = {
    "flash": "FlashAttention, the s x s scores never stored (Korthikanti's formula without its 5as/h term); "
    "--attention materialized for his full count",
    "materialized": "the (heads, s, s) scores stored, as Korthikanti et al. 2022 Table 2 counts them (5as/h)",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``memory``'s flags: the model, its experts, the precision and the layout."""
    mem = command_parser(
        subparsers,
        "memory",
        "predicted bytes per device (model states, activations)",
        [
            ("--params 7B --precision fp32", "112 GB: 16 bytes per parameter"),
            ("--preset llama3-8b --pp 4 --precision megatron", "a published model, as Megatron-LM counts it"),
            ("--params 70B --precision mixed --zero 3 --dp 64", "ZeRO-3 over 64 GPUs"),
            (
                "--layers 32 --hidden 4096 --heads 32 --vocab 32K --seq 4K --precision mixed --tp 8 --sp",
                "with activations",
            ),
        ],
    )
    mem.add_argument("--preset", help="a model of plan's presets (llama3-8b, gpt3-175b, ...) in place of the dims")
    mem.add_argument("--params", type=param_count, help="parameter count: 7e9, 7B, 1.5T, 70M")
    mem.add_argument("--layers", type=positive_int, help="transformer layers (with --hidden and --vocab: the count)")
    mem.add_argument("--hidden", type=positive_int, help="model width")
    mem.add_argument("--heads", type=positive_int, help="attention heads (for the activations)")
    mem.add_argument("--vocab", type=token_count, help="vocabulary size, e.g. 32000 or 128K")
    mem.add_argument("--seq", type=token_count, help="tokens per sequence, e.g. 4096 or 8K (for the activations)")
    mem.add_argument("--ffn", type=positive_int, help="the MLP's width (default 4 x hidden)")
    mem.add_argument("--kv-heads", type=positive_int, help="K/V heads of grouped-query attention (default: --heads)")
    mem.add_argument("--swiglu", action="store_true", help="a gated SwiGLU MLP (default GELU)")
    mem.add_argument("--untied", action="store_true", help="the output head has its own matrix")
    mem.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm", help="default layernorm")
    mem.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per microbatch (default 1)")
    mem.add_argument(
        "--precision",
        choices=["fp32", "mixed", "zero", "megatron", "deepspeed", "no-master"],
        default="fp32",
        help="bytes per parameter: mixed = zero (16: ZeRO's count), megatron (18; with --zero 1 its distributed "
        "optimizer, 6 + 12/d), deepspeed (its ZeRO estimators), no-master (12), fp32 (16)",
    )
    mem.add_argument(
        "--zero",
        type=int,
        choices=[0, 1, 2, 3],
        default=0,
        help="ZeRO stage: shard optimizer state (1), gradients (2), parameters (3) over --dp (default 0)",
    )
    for axis, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline")):
        mem.add_argument(f"--{axis}", type=positive_int, default=1, help=f"{what} parallel degree (default 1)")
    mem.add_argument("--chunks", type=positive_int, default=1, help="interleaved pipeline: model chunks per stage")
    mem.add_argument(STAGE_LAYERS.cli_flag, type=refusing(layer_counts), help=STAGE_LAYERS.help)
    mem.add_argument("--cp", type=positive_int, default=1, help="context parallel: the sequence split over cp ranks")
    mem.add_argument("--ep", type=positive_int, default=1, help="expert parallel (with --experts), within tp*cp*dp")
    mem.add_argument("--experts", type=positive_int, help="routed experts per MoE layer (a mixture of experts)")
    mem.add_argument("--top-k", type=positive_int, help="experts each token visits (with --experts)")
    mem.add_argument("--expert-ffn", type=positive_int, help="one expert's FFN width (SwiGLU; with --experts)")
    mem.add_argument("--shared-experts", type=natural, help="experts every token visits (default 0)")
    mem.add_argument("--dense-layers", type=natural, help="first layers without experts (default 0)")
    mem.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    mem.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none", help="activation recompute (default none)")
    mem.add_argument(
        "--attention", choices=["flash", "materialized"], default="flash", help="is the s x s score matrix stored?"
    )
    mem.set_defaults(func=cmd_memory)
    add_json_flag(mem)
