"""``python -m course_lib`` (also ``course-lib``): memory, run, demo, schedule, plan, hardware and calibrate.

Every command takes ``--json FILE`` (``-`` for standard output) to write its result as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from course_lib.faults import KINDS, PHASES, Fault
from course_lib.launch import RankError
from course_lib.memory import CATEGORIES, RECOMPUTE, memory_formula, transformer_params
from course_lib.models import GPTConfig, TrainConfig, within_capacity
from course_lib.parallel.schedules import SCHEDULES
from course_lib.precision import CONVENTIONS, HALF


def _is_lead() -> bool:
    """Under torchrun every rank runs the command; only rank 0 prints and writes."""
    return os.environ.get("RANK", "0") == "0"


def _write_json(data: dict, target: str | None) -> None:
    """Write the result; if the file cannot be written (a full disk, a folder gone), the result goes to standard
    output instead, with one line on standard error saying why, so a finished run is never lost."""
    if target is None or not _is_lead():
        return
    text = json.dumps(data, indent=2)
    if target != "-":
        try:
            with open(target, "w") as f:
                f.write(text + "\n")
            return
        except OSError as err:
            print(f"course-lib: could not write {target} ({err.strerror or err}); the JSON follows", file=sys.stderr)
    print(text)


def _say(args, text: str = "") -> None:
    """Human output; silent when the JSON goes to standard output, and on ranks other than 0 under torchrun."""
    if args.json != "-" and _is_lead():
        print(text)


# ------------------------------------------------------------------------------------------------ memory
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
    from course_lib.plan import Experts

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
    return {"expert_params": experts.routed_params(args.layers, args.hidden), "ffn": experts.token_ffn}


SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads")  # what --preset gives
ALWAYS_SHOWN_AXES = ("dp", "tp", "pp")  # in memory's summary line; cp and ep only where they split something


def _memory_model(args) -> tuple[float, dict, str]:
    """The parameter count, the memory shape (:meth:`course_lib.plan.Model.memory_shape` keys) and a name, from
    ``--preset`` or from the flags."""
    from course_lib.plan import make_model

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
    from course_lib.memory import PRECISIONS

    params, shape, name = _memory_model(args)
    layout = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}
    try:
        result = memory_formula(
            params,
            args.precision,
            args.zero,
            micro_batch=args.micro_batch,
            sp=args.sp,
            recompute=args.recompute,
            attention=args.attention,
            chunks=args.chunks,
            **layout,
            **shape,
        )
    except ValueError as err:
        raise SystemExit(f"memory: {err}") from None
    data = {
        "model": name,
        "params": params,
        "precision": args.precision,
        "zero": args.zero,
        **layout,
        "expert_params": shape.get("expert_params", 0),
        "attention": args.attention,
        "bytes_per_device": result,
    }
    _write_json(data, args.json)
    shown = {k: v for k, v in layout.items() if k in ALWAYS_SHOWN_AXES or v > 1}  # cp and ep where they split
    experts = f" ({shape['expert_params']:,.0f} in routed experts)" if shape.get("expert_params") else ""
    _say(
        args,
        f"{name}: {params:,.0f} parameters{experts}, {args.precision}, ZeRO-{args.zero}, "
        + " ".join(f"{k}={v}" for k, v in shown.items()),
    )
    stage = {"all": "", "first": " (the first pipeline stage)", "last": " (the last pipeline stage)"}
    _say(args, f"  bytes on the busiest GPU{stage[result['stage']]}:")
    for key in (*CATEGORIES, "activations", "total"):
        _say(args, f"  {key:<12} {result[key] / 1e9:12.3f} GB")
    if "layers" not in shape:
        _say(args, "  (activations need --layers, --hidden, --heads and --seq)")
    _say(args, f"  bytes per parameter: {PRECISIONS[args.precision].source}")
    if "layers" in shape:
        _say(args, f"  attention: {ATTENTION_NOTES[args.attention]}")
    if args.precision in REFERENCE_NOTES:
        _say(args, f"  against the reference: {REFERENCE_NOTES[args.precision]}")
    return 0


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


# ------------------------------------------------------------------------------------------------ run
MIXED_FLAGS = ("precision", "half", "loss_scale", "initial_scale")  # TrainConfig fields that ``run`` takes


def _train_config(args) -> TrainConfig:
    """The training settings given on the command line; ``run``'s mixed-precision flags where given."""
    mixed = {name: getattr(args, name) for name in MIXED_FLAGS if hasattr(args, name)}
    return TrainConfig(steps=args.steps, batch=_sizes(args)["batch"], seed=args.seed, dtype=args.dtype, **mixed)


# A modeled run's defaults: with the tiny GPT's (64 wide, 32 tokens, batch 8) an H100 computes a step in ~0.2 us,
# invisible beside communication; at these sizes compute is about a tenth of a data-parallel step.
MODELED_DEFAULTS = {"hidden": 256, "seq": 128, "batch": 32}


def _sizes(args) -> dict:
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


def _model_config(args, layers_needed: int = 1, model_settings: dict | None = None) -> GPTConfig:
    """The tiny GPT with the sizes given on the command line; by default 2 layers, or as many as the scheme needs
    (one per pipeline stage) if that is more; MoE settings from the command line over the scheme's
    ``model_settings`` (``ep``: 8 experts, top-2)."""
    sizes = _sizes(args)
    given = {name: getattr(args, name) for name in MOE_FLAGS if getattr(args, name, None) is not None}
    return GPTConfig(
        layers=args.layers or max(GPTConfig().layers, layers_needed),
        d_model=sizes["hidden"],
        heads=args.heads or GPTConfig().heads,
        seq=sizes["seq"],
        recompute=getattr(args, "recompute", "none"),
        **((model_settings or {}) if given.get("experts") != 0 else {}) | given,
    )


def _routing_lines(counts: list, cfg: GPTConfig) -> list[str]:
    """An MoE run's last step, per layer: assignments per expert, and what capacity kept of them."""
    lines = [f"  assignments per expert, last step (top-{cfg.top_k} of {cfg.experts}; routed -> kept by capacity):"]
    for layer, per_source in enumerate(counts[-1]):
        routed = torch.tensor(per_source)
        kept = within_capacity(routed, cfg)
        lines.append(f"    layer {layer}: {routed.sum(0).tolist()} -> {kept.sum(0).tolist()}")
    return lines


def _precision_lines(report: dict) -> list[str]:
    """A mixed-precision run's bytes per parameter (the convention's, and rank 0's model states per parameter), its
    losses beside the same run in fp32, and its loss scale per step with the steps skipped on overflow."""
    p, memory = report["precision"], report["ranks"][0]["memory"]
    b, skipped = p["bytes_per_param"], p.get("skipped_steps", [])
    held = sum(memory[k] for k in CATEGORIES) / report["params"]
    lines = [
        f"  {p['convention']} precision, {p['half']}: weights {b['params']} + gradients {b['grads']} + master "
        f"{b['master']} + moments {b['moments']} = {b['params'] + b['grads'] + b['optimizer']} bytes per parameter",
        f"    (memory.PRECISIONS[{p['convention']!r}]); rank 0 holds {held:.2f} bytes of model states per parameter",
        f"  fp32 losses      {[round(x, 6) for x in p['fp32_losses']]}",
        f"  max |loss diff| vs fp32 {p['max_abs_loss_diff_vs_fp32']:.3e} (tolerance {p['tolerance_vs_fp32']:.0%} of "
        f"the loss{'; the skipped steps trained nothing' if skipped else ''})",
    ]
    if "loss_scale" in p:
        lines.append(
            f"  loss scale per step {[f'{s:.0f}' for s in p['loss_scale']]}; skipped on overflow: steps {skipped} "
            f"({len(skipped)} of {len(p['loss_scale'])})"
        )
    return lines


def _rank_table(report: dict) -> list[str]:
    lines = [
        f"  {'rank':<5}{'params':>12}{'grads':>12}{'optimizer':>12}{'activ.peak':>12}{'peak':>12}{'sent/step':>14}"
    ]
    for r in report["ranks"]:
        m = r["memory"]
        sent = sum(c["bytes"] for c in r["comm"].values())
        lines.append(
            f"  {r['rank']:<5}{m['params']:>12,}{m['grads']:>12,}{m['optimizer']:>12,}"
            f"{m['activations_peak']:>12,}{m['peak']:>12,}{sent:>14,.0f}"
        )
    return lines


def _scheme_settings(args, spec) -> tuple[dict, int | None]:
    """The options of ``spec`` given on the command line (only those, so that each keeps its scheme's default), and
    the world size a one-axis scheme's axis flag gave (``run tp --tp 4``). A flag the scheme does not take, or two
    flags setting one option, end the run with a message."""
    options, axis_size = {}, None
    axis_flag = f"--{spec.axes[0]}" if len(spec.axes) == 1 else None
    flags = {o.cli_flag: o for o in spec.options}
    for flag, value in vars(args).items():
        if not flag.startswith("--"):
            continue
        if flag == axis_flag:
            axis_size = value
        elif flag not in flags:
            takes = ", ".join(sorted([*flags, *([axis_flag] if axis_flag else [])])) or "no options"
            raise SystemExit(f"run {args.scheme}: {flag} is not a setting of {spec.name}; it takes {takes}")
        elif flags[flag].name in options:
            twins = " and ".join(f for f, o in flags.items() if o.name == flags[flag].name)
            raise SystemExit(f"run {args.scheme}: {twins} both set {flags[flag].name}; give one of them")
        else:
            options[flags[flag].name] = value
    return options, axis_size


def _world_size(args, spec, settings: dict, axis_size: int | None) -> int:
    """The number of ranks: fixed by a grid's axes (or 1 without axes), else ``--world-size`` or the scheme's axis
    flag, else torchrun's world, else 4."""
    from course_lib import launch

    grid = spec.grid_size(settings)
    if len(spec.axes) > 1:
        if args.world_size not in (None, grid):
            product = " x ".join(f"--{axis}" for axis in spec.axes)
            raise SystemExit(f"run {args.scheme}: --world-size {args.world_size} but {product} = {grid}")
        return grid
    if None not in (args.world_size, axis_size) and args.world_size != axis_size:
        raise SystemExit(
            f"run {args.scheme}: --world-size {args.world_size} but --{spec.axes[0]} {axis_size}; both give the number "
            f"of ranks of {spec.name}, give one"
        )
    if args.world_size or axis_size:
        return args.world_size or axis_size
    if launch.under_torchrun():  # as many ranks as torchrun started
        return int(os.environ["WORLD_SIZE"])
    return grid or 4


def _grid_reason(spec, settings: dict, options: dict) -> str:
    """For a grid, how its world size factors, naming the axes left at their defaults; else nothing."""
    if len(spec.axes) < 2:
        return ""
    product = " x ".join(f"{axis} {settings[axis]}" for axis in spec.axes)
    defaults = [f"--{axis} {settings[axis]}" for axis in spec.axes if axis not in options]
    return (
        f"{product} = {spec.grid_size(settings)} ranks"
        + (f" ({', '.join(defaults)} by default)" if defaults else "")
        + "; "
    )


def _scheme_flags(parser: argparse.ArgumentParser, schemes: dict) -> None:
    """One flag per option of any scheme (its help names the schemes that take it), and ``--<axis>`` for each
    one-axis scheme's axis (``run tp --tp 4``: the number of ranks). A flag keeps its own name as its destination,
    and one not given stays out of the namespace (see :func:`_scheme_settings`)."""
    options: dict[str, object] = {}  # flag -> its Option (None: only an axis flag, a positive int)
    helps: dict[str, dict[str, list[str]]] = {}  # flag -> help text -> schemes
    for spec in schemes.values():
        entries = [(o.cli_flag, o, o.help) for o in spec.options]
        if len(spec.axes) == 1:
            entries.append((f"--{spec.axes[0]}", None, "the number of ranks"))
        for flag, option, text in entries:
            known = options.get(flag)
            if option is not None and known is not None and known != option:
                raise RuntimeError(f"{flag}: two schemes define it differently ({known} and {option})")
            options[flag] = option or known
            helps.setdefault(flag, {}).setdefault(text, []).append(spec.name)
    for flag, option in options.items():
        text = "; ".join(f"{', '.join(names)}: {text}" for text, names in helps[flag].items())
        metavar = flag.removeprefix("--").replace("-", "_").upper()
        if option is not None and option.kind is None:
            parser.add_argument(
                flag, dest=flag, action="store_const", const=option.value, default=argparse.SUPPRESS, help=text
            )
        elif option is not None and option.choices:
            parser.add_argument(
                flag, dest=flag, type=option.kind, choices=option.choices, default=argparse.SUPPRESS, help=text
            )
        else:
            kind = option.kind if option else int
            parse = {int: _positive_int, float: _positive_float}.get(kind) or _refusing(kind)
            parser.add_argument(flag, dest=flag, type=parse, metavar=metavar, default=argparse.SUPPRESS, help=text)


def _refusing(kind: Callable[[str], object]) -> Callable[[str], object]:
    """``kind`` as an argparse type whose ValueError message reaches the user (argparse would print its own)."""

    def parse(text: str) -> object:
        try:
            return kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _limits(args) -> dict:
    """The launcher's limits from the command line: whole-run and stall timeouts, and the cap on local ranks."""
    return {"timeout": args.timeout, "stall_timeout": args.stall_timeout, "max_ranks": args.max_ranks}


def _fault(args) -> Fault | None:
    """The fault plan of ``--kill-rank R --at-step K [--fault KIND] [--fault-phase PHASE]``, or None. Under torchrun
    it is injected in the job's first attempt only: a restarted attempt (``--max-restarts``) runs without it, as a
    job restarted after a real failure would."""
    where = {"--kill-rank": args.kill_rank, "--at-step": args.at_step}
    given = [flag for flag, value in where.items() if value is not None]
    if not given and args.fault is None and args.fault_phase is None:
        return None
    if len(given) < 2:
        got = " ".join(given) or "neither"
        raise SystemExit(f"run {args.scheme}: a fault needs both --kill-rank R and --at-step K (given: {got})")
    from course_lib.forkserver import torchrun_restart

    fault = Fault(args.kill_rank, args.at_step, args.fault or "kill", args.fault_phase or "forward")
    restart = torchrun_restart()
    if restart:
        _say(args, f"torchrun restart {restart}: the injected fault ({fault}) fired in the first attempt; not again")
        return None
    return fault


def _resume(args) -> str | None:
    """The checkpoint to resume from: ``--resume D``, or with ``--auto-resume`` the newest in ``--checkpoint-dir``
    (None when it holds none yet: the job's first start)."""
    from course_lib import checkpoint

    if not args.auto_resume:
        return args.resume
    if args.resume is not None or args.checkpoint_dir is None:
        raise SystemExit(
            f"run {args.scheme}: --auto-resume resumes from the newest checkpoint in --checkpoint-dir D; give D, "
            f"and no --resume"
        )
    newest = checkpoint.latest(args.checkpoint_dir)
    return None if newest is None else str(newest)


def cmd_run(args: argparse.Namespace) -> int:
    from course_lib import checkpoint, launch
    from course_lib.schemes import ALIASES, SCHEMES, run_scheme

    spec = SCHEMES[ALIASES.get(args.scheme, args.scheme)]
    fault, resume = _fault(args), _resume(args)
    options, axis_size = _scheme_settings(args, spec)
    settings = spec.settings(options)
    world_size = _world_size(args, spec, settings, axis_size)
    try:
        launch.check_world_size(world_size, args.max_ranks)
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {_grid_reason(spec, settings, options)}{err}") from None
    try:
        layers_needed = spec.layers_needed(world_size, settings) if spec.layers_needed else 1
        cfg, train = _model_config(args, layers_needed, spec.model_settings), _train_config(args)
        run = run_scheme(
            args.scheme,
            world_size,
            cfg,
            train,
            backend=args.backend,
            device=args.device,
            hardware=args.hardware,
            gpus_per_node=args.gpus_per_node,
            topology=args.topology,
            algorithm=args.algorithm,
            placement=args.placement,
            in_process=world_size == 1 and not launch.under_torchrun() and fault is None,
            fault=fault,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=resume,
            checkpoint_async=args.checkpoint_async,
            **_limits(args),
            **options,
        )
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {err}") from None
    report = run.report
    _write_json(report, args.json)
    model = options.get("model")
    moe = f", {cfg.experts} experts top-{cfg.top_k}" if cfg.experts else ""
    shape = (
        f"{cfg.layers} layers x {cfg.d_model} wide, {cfg.heads} heads{moe}"
        if model is None
        else f"your {getattr(model, '__qualname__', 'model')}"
    )
    _say(
        args,
        f"{args.scheme} on {world_size} {report['backend']} rank{'s' * (world_size != 1)} ({report['device']}), "
        f"{report['params']:,} "
        f"parameters ({shape}, "
        f"{cfg.seq} tokens, batch {train.batch}), "
        f"{args.dtype if train.precision is None else f'{train.precision} precision, {train.half}'}"
        + ("" if cfg.recompute == "none" else f", {cfg.recompute} recompute"),
    )
    if "resumed_from" in report:
        r = report["resumed_from"]
        _say(args, f"  resumed from {r['path']} ({r['scheme']} on {r['world_size']}) at step {report['first_step']}")
    if "checkpoints" in report:
        c = report["checkpoints"]
        how = "in the background" if c["asynchronous"] else "while training waits"
        every = "every step" if c["every"] == 1 else f"every {c['every']} steps"
        stood = sum(b - a for t in c["saves"][0] for a, b in checkpoint.stalls(t))
        _say(
            args,
            f"  checkpoints after {every} in {c['directory']}, written {how}; training stood still "
            f"{stood * 1e3:.3g} ms for them on rank 0",
        )
    _say(args, f"  losses           {[round(x, 6) for x in report['losses']]}")
    _say(args, f"  reference losses {[round(x, 6) for x in report['reference_losses']]}")
    _say(
        args,
        f"  max |loss diff| {report['max_abs_loss_diff']:.3e}   max |param diff| {report['max_abs_param_diff']:.3e}",
    )
    for line in _precision_lines(report) if "precision" in report else []:
        _say(args, line)
    _say(args, "  bytes per rank, last step:")
    for line in _rank_table(report):
        _say(args, line)
    if "counts" in run.result[0]:
        for line in _routing_lines(run.result[0]["counts"], cfg):
            _say(args, line)
    if run.modeled is not None:
        m = report["modeled"]
        where = (
            f"{m['hardware']}'s compute, {m['topology']}'s links"
            if "topology" in m
            else f"{m['hardware']} ({m['gpus_per_node']} GPUs per node)"
        )
        _say(args, f"  modeled on {where}, last step:")
        _say(
            args,
            f"    step {m['step_time_s'] * 1e6:.2f} us   compute {m['compute_s'] * 1e6:.2f} us   "
            f"comm {m['comm_s'] * 1e6:.2f} us   exposed comm {m['exposed_comm_s'] * 1e6:.2f} us   "
            f"bubble {m['bubble_fraction']:.1%}   (means over ranks; step = makespan)",
        )
        for op, used in m.get("algorithms", {}).items():
            _say(args, f"    {op}: " + ", ".join(f"{algorithm} x{count}" for algorithm, count in used.items()))
        for group, where in m.get("placement", {}).items():
            links = f"; slowest link {where['slowest_link'] / 1e9:g} GB/s, up to {where['hops']} hops"
            _say(args, f"    {group} groups: {where['what']}" + links * (where["hops"] > 0))
    if args.plot:
        _say(args, "  " + _save_plots(run, args.plot))
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from course_lib.parallel.schedules import (
        Costs,
        bubble_formula,
        check,
        chunks_per_rank,
        formula_text,
        generate,
        simulate,
    )

    costs = Costs(args.f, args.b, args.w)
    try:
        tables = generate(args.schedule, args.stages, args.microbatches, args.chunks, costs)
    except ValueError as err:
        raise SystemExit(f"schedule: {err}") from None
    check(tables, args.microbatches, chunks_per_rank(args.schedule, args.chunks))
    sim = simulate(tables, costs)
    formula = bubble_formula(args.schedule, args.stages, args.microbatches, args.chunks, costs)
    data = {
        "schedule": args.schedule,
        "stages": args.stages,
        "microbatches": args.microbatches,
        "chunks": args.chunks,
        "costs": {"f": args.f, "b": args.b, "w": args.w},
        "bubble_fraction": sim.bubble_fraction,
        "bubble_formula": formula,
        "makespan": sim.makespan,
        "idle_per_stage": sim.idle,
        "peak_inflight": sim.peak_inflight,
        "actions": [[str(a) for a in table] for table in tables],
    }
    _write_json(data, args.json)
    _say(
        args,
        f"{args.schedule}: {args.stages} stages, {args.microbatches} microbatches"
        + (f", {args.chunks} chunks per rank" if args.chunks > 1 else "")
        + f"; F {args.f}, B {args.b}, W {args.w}",
    )
    _say(
        args,
        f"  makespan {sim.makespan:g}, bubble fraction {sim.bubble_fraction:.4f} "
        f"({formula_text(formula, args.schedule)}), peak microbatches in flight per stage {sim.peak_inflight}",
    )
    for r, table in enumerate(tables):
        _say(args, f"  rank {r}: " + " ".join(str(a) for a in table if a.kind in ("F", "B", "W")))
    if args.plot:
        from course_lib.plots import plot_schedule

        def write() -> list[str]:
            plot_schedule(sim, title=f"{args.schedule}, p={args.stages}, m={args.microbatches}").savefig(
                args.plot, dpi=110
            )
            return [args.plot]

        _say(args, "  " + _saved(write))
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from course_lib.hardware import PROFILES, measured_dir, measured_profiles

    measured = measured_profiles()
    shown = PROFILES | {name: p for name, p in measured.items() if name not in PROFILES}
    data = {name: {k: v for k, v in vars(p).items() if k != "name"} for name, p in shown.items()}
    _write_json(data, args.json)
    for name, p in shown.items():
        _say(
            args,
            f"{name}{' (measured, in ' + str(measured_dir()) + ')' if name not in PROFILES else ''}: {p.description}",
        )
        _say(
            args,
            f"  peak bf16 {p.peak_flops['bf16'] / 1e12:g} TFLOP/s, fp32 {p.peak_flops['fp32'] / 1e12:g} TFLOP/s; "
            f"{p.memory_bytes / 1e9:g} GB; {p.gpus_per_node} GPUs per node",
        )
        _say(
            args,
            f"  per GPU: intra-node {p.intra_bandwidth / 1e9:g} GB/s, {p.intra_latency_s * 1e6:g} us; "
            f"inter-node {p.inter_bandwidth / 1e9:g} GB/s, {p.inter_latency_s * 1e6:g} us",
        )
        _say(
            args,
            f"  planner's step time: matmuls at {p.matmul_efficiency:.0%} of peak, fused attention at "
            f"{p.attention_efficiency:.0%}, memory {p.hbm_bandwidth / 1e12:g} TB/s",
        )
        for source in p.sources:
            _say(args, f"  source: {source}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from course_lib import calibrate
    from course_lib.hardware import save_profile

    try:
        device = calibrate.resolve_device(args.device)
        if args.name is not None:
            calibrate.check_name(args.name)
    except ValueError as err:
        raise SystemExit(f"calibrate: {err}") from None
    _say(args, f"measuring {device} ({calibrate.device_name(device)}) with torch {torch.__version__} ...")
    measured = calibrate.measure(device, quick=args.quick)
    profile = calibrate.as_profile(measured, args.name, args.links)
    published = calibrate.published_match(measured)

    def against(value: float, datasheet: float | None) -> str:
        return (
            f", {value / datasheet:.0%} of the {published.name} datasheet's {datasheet / 1e12:g}" if datasheet else ""
        )

    for key, rate in measured.matmul_flops.items():
        sides = ", ".join(f"n={n}: {r / 1e12:.3g}" for n, r in measured.matmul_by_side[key].items())
        peak = published.peak_flops[key] if published else None
        _say(args, f"  matmul {key:<5} {rate / 1e12:8.3g} TFLOP/s at best ({sides}){against(rate, peak)}")
    _say(
        args,
        f"  attention  {measured.attention_flops / 1e12:8.3g} TFLOP/s (scaled_dot_product_attention forward, bf16): "
        f"{profile.attention_efficiency:.0%} of the bf16 matmul rate",
    )
    hbm = published.hbm_bandwidth if published else None
    _say(
        args,
        f"  copy       {measured.memory_bandwidth / 1e9:8.4g} GB/s (read + write)"
        f"{against(measured.memory_bandwidth, hbm)}; {measured.memory_bytes / 1e9:.3g} GB of memory",
    )
    try:
        path = save_profile(profile, args.out)
    except OSError as err:
        raise SystemExit(f"calibrate: could not write the profile ({err.strerror or err}: {err.filename})") from None
    use = profile.name if args.out is None else str(path)
    _say(args, f"wrote the profile {profile.name} to {path}; use it with --hardware {use}")
    _say(args, f"  its links are the {args.links} profile's: one device measures no link")
    steps = [] if args.no_train else calibrate.compare_models(profile, device, quick=args.quick)
    if steps:
        _say(args, "a training step on this device, measured beside the modeled clock at the measured rates:")
    for c in steps:
        _say(
            args,
            f"  {c.label} ({c.cfg.layers} layers x {c.cfg.d_model}, seq {c.cfg.seq}, batch {c.batch}, {c.precision}): "
            f"measured {c.measured_s * 1e3:.3g} ms; modeled {c.modeled_s * 1e3:.3g} ms, "
            f"{c.measured_s / c.modeled_s:.3g}x less; roofline {c.roofline_s * 1e3:.3g} ms, "
            f"{c.measured_s / c.roofline_s:.3g}x less",
        )
    if steps:
        _say(
            args, "  modeled: every counted FLOP at the matmul rate; roofline: element-wise work at the copy bandwidth"
        )
    _write_json(
        {
            "measured": asdict(measured),
            "profile": asdict(profile),
            "path": str(path),
            "steps": [asdict(c) for c in steps],
        },
        args.json,
    )
    return 0


def _save_plots(run, folder: str) -> str:
    from course_lib.plots import save_run_figures

    return _saved(lambda: save_run_figures(run, folder))


def _saved(write) -> str:
    """Run ``write`` (which returns the files it wrote) and say what it wrote, or in one line why it could not."""
    try:
        return "wrote " + ", ".join(write())
    except OSError as err:
        return f"could not write the figures ({err.strerror or err}: {err.filename or ''}); the results above stand"


# ------------------------------------------------------------------------------------------------ demo
def cmd_demo(args: argparse.Namespace) -> int:
    from course_lib import launch
    from course_lib.schemes import SCHEMES, run_scheme, validate

    train = _train_config(args)
    sizes = {name: spec.grid_size(spec.settings({})) or args.world_size for name, spec in SCHEMES.items()}
    cfgs = {name: _model_config(args, args.world_size, spec.model_settings) for name, spec in SCHEMES.items()}
    try:  # every scheme checked before the first one runs
        for name, n in sizes.items():
            validate(name, n, cfgs[name], train, {})
            launch.check_world_size(n, args.max_ranks)
    except ValueError as err:
        raise SystemExit(f"demo: {name} on {n} ranks: {err}") from None
    rows, reports = [], []
    started = time.perf_counter()
    for name, n in sizes.items():  # single: 1 rank; 3d: its default 2 x 2 x 2 grid
        run = run_scheme(name, n, cfgs[name], train, backend=args.backend, device=args.device, **_limits(args))
        reports.append(run.report)
        r0 = run.report["ranks"][0]
        state = sum(r0["memory"][k] for k in CATEGORIES)
        rows.append(
            (
                name,
                n,
                run.report["max_abs_loss_diff"],
                run.report["rel_param_diff"],
                state,
                r0["memory"]["activations_peak"],
                sum(c["bytes"] for c in r0["comm"].values()),
            )
        )
        if args.plot:
            _save_plots(run, args.plot)
    _write_json({"schemes": reports}, args.json)
    _say(
        args, f"course_lib demo: the tiny GPT ({reports[0]['params']:,} parameters), {train.steps} steps, {args.dtype}"
    )
    header = f"{'scheme':<8}{'ranks':>6}{'loss diff':>12}{'param err':>12}{'states/rank':>14}{'activ./rank':>13}"
    _say(args, header + f"{'sent/rank/step':>16}")
    for name, n, dl, dp, state, act, sent in rows:
        _say(args, f"{name:<8}{n:>6}{dl:>12.2e}{dp:>12.2e}{state:>14,}{act:>13,}{sent:>16,.0f}")
    _say(args, "(bytes; loss diff: largest |difference| of a step's loss; param err: ||params - reference|| /")
    _say(args, " ||reference||, both against the single-device reference trainer)")
    if args.plot:
        _say(args, f"plots and Chrome traces (open in ui.perfetto.dev) written to {os.path.abspath(args.plot)}/")
    _say(args, f"demo took {time.perf_counter() - started:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------ plan
LAYOUT_FLAGS = ("tp", "pp", "dp", "cp", "ep", "zero", "schedule", "chunks", "recompute", "attention", "no_sp")


def cmd_plan(args: argparse.Namespace) -> int:
    from course_lib.plan import describe, make_model, plan

    given = [flag for flag in LAYOUT_FLAGS if getattr(args, flag) not in (None, False)]
    if given and not {"tp", "pp", "dp"} & set(given):
        flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
        raise SystemExit(f"plan: {flags} describe a given layout: give --tp, --pp and --dp too (or none of them)")
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
    _write_json(result.as_dict(), args.json)
    _say_model(args, model, result.gpus, result.gpus_per_node, result.hardware, result.gpu_mem_bytes, result.topology)
    _say(
        args,
        f"  choice: {describe(result)}, {result.microbatches} microbatches of {result.micro_batch} per DP rank"
        + (", selective recompute" if result.recompute != "none" else ""),
    )
    _say(
        args,
        f"  memory per GPU {result.memory_per_gpu_bytes / 1e9:.1f} GB of {result.gpu_mem_bytes / 1e9:.4g} GB; "
        f"bubble {result.bubble_fraction:.1%}; estimated step {result.step_time_s:.3g} s, "
        f"{result.tflops_per_gpu:.3g} TFLOP/s per GPU, MFU {result.mfu:.1%}",
    )
    _say(args, "  why:")
    for reason in result.reasons:
        _say(args, f"    - {reason}")
    fitting = [c for c in result.candidates if c.fits]
    _say(args, f"  top candidates (of {len(fitting)} that fit):")
    for i, c in enumerate(fitting[:3], 1):
        mark = "   <- chosen" if describe(c) == describe(result) else ""
        _say(
            args,
            f"    {i}. {describe(c):<48}{c.memory_per_gpu_bytes / 1e9:7.1f} GB   bubble {c.bubble_fraction:6.1%}   "
            f"step {c.step_time_s:.3g} s   MFU {c.mfu:.1%}{mark}",
        )
    return 0


def _say_model(
    args, model, gpus: int, per_node: int, hardware: str, gpu_mem: float, topology: str | None = None
) -> None:
    nodes = -(-gpus // per_node)
    where = (
        f"{topology}'s links, {hardware}'s compute"
        if topology
        else f"{nodes} node{'s' * (nodes > 1)} of {per_node}, {hardware}"
    )
    _say(
        args,
        f"{model.name}: {model.params / 1e9:.1f}B parameters"
        + (f" ({model.active_params / 1e9:.1f}B active a token)" if model.experts else "")
        + f" on {gpus} GPUs ({where}, {gpu_mem / 1e9:.4g} GB each)",
    )


def _plan_layout(args: argparse.Namespace, model) -> int:
    """``plan --tp T --pp P --dp D ...``: one given layout, evaluated as the planner evaluates its own."""
    from dataclasses import asdict

    from course_lib.hardware import get_profile
    from course_lib.plan import PEAK, describe, evaluate_layout

    profile = get_profile(args.hardware)
    c = evaluate_layout(
        model,
        args.gpus,
        tp=args.tp or 1,
        pp=args.pp or 1,
        dp=args.dp,
        cp=args.cp or 1,
        ep=args.ep or 1,
        zero=args.zero,
        schedule=args.schedule or "1f1b",
        chunks=args.chunks or 1,
        micro_batch=args.micro_batch,
        global_batch=args.global_batch,
        recompute=args.recompute or "none",
        hardware=args.hardware,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_bytes=args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else None,
        attention=args.attention or "flash",
        sp=False if args.no_sp else None,
        topology=args.topology,
    )
    gpu_mem = args.gpu_mem_gb * 1e9 if args.gpu_mem_gb else profile.memory_bytes
    per_node = args.gpus_per_node or profile.gpus_per_node
    _write_json({"model": model.name, "gpus": args.gpus, "hardware": profile.name, **asdict(c)}, args.json)
    _say_model(args, model, args.gpus, per_node, profile.name, gpu_mem, args.topology)
    _say(
        args,
        f"  layout: {describe(c)}; {c.microbatches} microbatches of {args.micro_batch} per DP rank, "
        f"{'no' if c.recompute == 'none' else c.recompute} recompute, {c.attention} attention"
        + (", sequence parallel" if c.sp else ""),
    )
    parts = ", ".join(f"{k} {c.memory[k] / 1e9:.3g}" for k in ("params", "grads", "optimizer", "activations"))
    verdict = "fits" if c.fits else f"does not fit, {(c.memory_per_gpu_bytes - gpu_mem) / 1e9:.1f} GB over"
    _say(args, f"  memory per GPU {c.memory_per_gpu_bytes / 1e9:.1f} GB of {gpu_mem / 1e9:.4g} GB ({parts}): {verdict}")
    if c.memory["stage"] != "all":
        _say(args, f"    (on the {c.memory['stage']} pipeline stage, the busiest: its layers and one embedding matrix)")
    t = c.time
    _say(
        args,
        f"  step {c.step_time_s:.3g} s: compute {t['compute_s']:.3g} s, bubble {t['bubble_s']:.3g} s "
        f"({c.bubble_fraction:.1%} of the pipeline's time), exposed TP {t['tp_comm_s']:.3g} s, PP {t['pp_comm_s']:.3g} "
        f"s, CP {t['cp_comm_exposed_s']:.3g} s, EP {t['ep_comm_s']:.3g} s, DP {t['dp_comm_exposed_s']:.3g} s",
    )
    for axis, g in c.placement.items():
        if "where" in g:  # on a topology
            _say(
                args,
                f"  {axis.upper()} {g['size']} sits {g['where']} ({g['bandwidth'] / 1e9:g} GB/s, {g['hops']} hops)",
            )
    peak = profile.peak_flops[PEAK["mixed"]] / 1e12
    _say(
        args,
        f"  model FLOPs (6N + causal attention) {c.model_flops:.3g} a step: {c.tflops_per_gpu:.3g} TFLOP/s per GPU, "
        f"MFU {c.mfu:.1%} of {peak:g} TFLOP/s",
    )
    _say(
        args,
        f"  hardware FLOPs (as computed, with the recomputed forward) {c.hardware_flops:.3g}: "
        f"{c.hardware_tflops_per_gpu:.3g} TFLOP/s per GPU, HFU {c.hfu:.1%}",
    )
    return 0


def cmd_goodput(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from course_lib.goodput import LLAMA3, choose_interval

    mtbf_gpu_h = args.mtbf_gpu_hours or LLAMA3.mtbf_gpu_hours()
    try:
        c = choose_interval(
            args.preset,
            args.gpus,
            mtbf_gpu_h * 3600,
            args.write_gbps * 1e9,
            args.restart_min * 60,
            storage_bandwidth=args.storage_tbps * 1e12 if args.storage_tbps else math.inf,
            deduplicate=args.deduplicate,
            stall_s=args.stall_s,
        )
    except ValueError as err:
        raise SystemExit(f"goodput: {err}") from None
    _write_json({"mtbf_gpu_hours": mtbf_gpu_h, **asdict(c)}, args.json)
    _say(args, f"{args.preset} on {args.gpus} GPUs, {c.layout}")
    _say(
        args,
        f"  checkpoint {c.checkpoint_bytes / 1e9:.3g} GB per rank, written in {c.checkpoint_s:.3g} s"
        + (f" in the background (stall {args.stall_s:g} s)" if c.async_checkpoint else ""),
    )
    _say(args, f"  MTBF {mtbf_gpu_h:.6g} h per GPU -> {c.mtbf_job_s / 3600:.3g} h for the job")
    _say(args, f"  Young {c.young_s / 60:.3g} min, Daly {c.daly_s / 60:.3g} min: expected goodput {c.goodput:.1%}")
    for interval, goodput in c.table:
        _say(args, f"    every {interval / 60:8.3g} min   goodput {goodput:6.1%}")
    return 0


# ------------------------------------------------------------------------------------------------ parser
def _number(text: str, kind: type, least: float, strict: bool) -> float:
    """Parse ``text`` as ``kind``; refuse NaN, infinity and values below ``least`` (or equal to it if ``strict``)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if not math.isfinite(value) or value < least or (strict and value == least):
        if kind is int:
            wanted = f"a whole number of at least {least + 1 if strict else least}"
        else:
            wanted = f"a finite number {'greater than' if strict else 'of at least'} {least:g}"
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, 0, strict=True)


def _natural(text: str) -> int:
    return _number(text, int, 0, strict=False)


def _positive_float(text: str) -> float:
    return _number(text, float, 0.0, strict=True)


def _nonnegative_float(text: str) -> float:
    return _number(text, float, 0.0, strict=False)


def _loss_scale(text: str) -> str | float | None:
    """``--loss-scale``: dynamic, none, or a fixed scale greater than 0."""
    if text in ("dynamic", "none"):
        return None if text == "none" else text
    try:
        return _positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be dynamic, none or a finite number greater than 0, got {text}"
        ) from None


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (what is wrong, and where the help is), exit status 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="course-lib", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mem = sub.add_parser("memory", help="predicted bytes per device (model states, activations)")
    mem.add_argument("--preset", help="a model of plan's presets (llama3-8b, gpt3-175b, ...) in place of the dims")
    mem.add_argument("--params", type=_positive_float, help="parameter count, e.g. 7e9")
    for dim in ("layers", "hidden", "heads", "vocab", "seq"):
        mem.add_argument(f"--{dim}", type=_positive_int)
    mem.add_argument("--ffn", type=_positive_int, help="the MLP's width (default 4 x hidden)")
    mem.add_argument("--kv-heads", type=_positive_int, help="K/V heads of grouped-query attention (default: --heads)")
    mem.add_argument("--swiglu", action="store_true", help="a gated SwiGLU MLP (default GELU)")
    mem.add_argument("--untied", action="store_true", help="the output head has its own matrix")
    mem.add_argument("--norm", choices=["layernorm", "rmsnorm"], default="layernorm")
    mem.add_argument("--micro-batch", type=_positive_int, default=1)
    mem.add_argument(
        "--precision",
        choices=["fp32", "mixed", "zero", "megatron", "deepspeed", "no-master"],
        default="fp32",
        help="bytes per parameter: mixed = zero (16: ZeRO's count), megatron (18; with --zero 1 its distributed "
        "optimizer, 6 + 12/d), deepspeed (its ZeRO estimators), no-master (12), fp32 (16)",
    )
    mem.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    for axis in ("dp", "tp", "pp"):
        mem.add_argument(f"--{axis}", type=_positive_int, default=1)
    mem.add_argument("--chunks", type=_positive_int, default=1, help="interleaved pipeline: model chunks per stage")
    mem.add_argument("--cp", type=_positive_int, default=1, help="context parallel: the sequence split over cp ranks")
    mem.add_argument("--ep", type=_positive_int, default=1, help="expert parallel (with --experts), within tp*cp*dp")
    mem.add_argument("--experts", type=_positive_int, help="routed experts per MoE layer (a mixture of experts)")
    mem.add_argument("--top-k", type=_positive_int, help="experts each token visits (with --experts)")
    mem.add_argument("--expert-ffn", type=_positive_int, help="one expert's FFN width (SwiGLU; with --experts)")
    mem.add_argument("--shared-experts", type=_natural, help="experts every token visits (default 0)")
    mem.add_argument("--dense-layers", type=_natural, help="first layers without experts (default 0)")
    mem.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    mem.add_argument("--recompute", choices=RECOMPUTE, default="none")
    mem.add_argument(
        "--attention", choices=["flash", "materialized"], default="flash", help="is the s x s score matrix stored?"
    )
    mem.set_defaults(func=cmd_memory)

    def training_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--layers", type=_positive_int, help="transformer layers (default 2, or one per pipeline stage)")
        modeled = MODELED_DEFAULTS
        p.add_argument(
            "--hidden", type=_positive_int, help=f"model width (default 64; {modeled['hidden']} with --hardware)"
        )
        p.add_argument("--heads", type=_positive_int, help="attention heads, must divide --hidden (default 4)")
        p.add_argument(
            "--seq", type=_positive_int, help=f"tokens per sequence (default 32; {modeled['seq']} with --hardware)"
        )
        p.add_argument(
            "--recompute",
            choices=RECOMPUTE,
            default="none",
            help="activation recompute in backward: selective (the attention scores) or full (every layer)",
        )
        p.add_argument("--steps", type=_positive_int, default=3)
        p.add_argument(
            "--batch",
            type=_positive_int,
            help=f"global batch in sequences (default 8; {modeled['batch']} with --hardware)",
        )
        p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
        p.add_argument(
            "--device",
            choices=["cpu", "cuda"],
            help="where the ranks compute (default: cuda under nccl, else cpu); gloo ranks on cuda share the GPUs",
        )
        p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
        p.add_argument("--seed", type=_natural, default=0)
        p.add_argument(
            "--timeout", type=_positive_float, default=300.0, help="seconds the whole run may take (default 300)"
        )
        p.add_argument(
            "--stall-timeout",
            type=_positive_float,
            default=20.0,
            help="seconds a rank may wait in a collective that another rank has not reached (default 20)",
        )
        p.add_argument(
            "--max-ranks", type=_positive_int, help="allow more local ranks than this machine's limit (you know better)"
        )
        p.add_argument("--plot", metavar="DIR", help="write timeline, memory and comm figures and a Chrome trace")

    from course_lib.schemes import ALIASES, SCHEMES

    run = sub.add_parser("run", help="train the tiny GPT with a scheme and compare with one device")
    run.add_argument("scheme", choices=sorted(SCHEMES) + sorted(ALIASES))
    run.add_argument("--world-size", type=_positive_int, help="number of ranks (default 4; 1 for single)")
    _scheme_flags(run, SCHEMES)
    run.add_argument("--hardware", help="also replay the last step on a modeled cluster (see: course-lib hardware)")
    run.add_argument(
        "--gpus-per-node", type=_positive_int, help="with --hardware: GPUs per node (default: the profile's)"
    )
    run.add_argument(
        "--topology",
        metavar="NAME[:SIZE]",
        help="with --hardware: time the collectives on this topology's links (h100-superpod, gb200-nvl72, tpu-v5p, "
        "ethernet-2to1, h100-two-level; SIZE: nodes, racks or a torus shape such as 4x4x4)",
    )
    run.add_argument(
        "--algorithm",
        choices=["ring", "tree", "hierarchical", "torus"],
        help="with --topology: force this collective algorithm where it can run (default: the fastest, as NCCL picks)",
    )
    run.add_argument(
        "--placement",
        metavar="AXES[/AXES...]",
        help="with --topology: the mesh's axes on the topology's levels, innermost first, a '/' before each next "
        "level (NVLink domain / across domains; torus axes), e.g. tp/pp,dp (default: rank r on GPU r)",
    )
    training_flags(run)
    mixed_schemes = ", ".join(name for name, spec in SCHEMES.items() if spec.precisions)
    mixed = run.add_argument_group(f"mixed precision ({mixed_schemes})")
    mixed.add_argument(
        "--precision",
        choices=CONVENTIONS,
        default=argparse.SUPPRESS,
        help="16-bit weights, fp32 optimizer state: mixed 16 bytes per parameter (fp32 master weights and moments), "
        "megatron 18 (also fp32 main gradients), no-master 12 (no master copy); default: --dtype throughout",
    )
    mixed.add_argument("--half", choices=list(HALF), default=argparse.SUPPRESS, help="the 16-bit type (default bf16)")
    mixed.add_argument(
        "--loss-scale",
        type=_loss_scale,
        default=argparse.SUPPRESS,
        metavar="S",
        help="dynamic, none, or a fixed scale (default: dynamic with fp16, none with bf16)",
    )
    mixed.add_argument(
        "--initial-scale",
        type=_positive_float,
        default=argparse.SUPPRESS,
        metavar="S",
        help="where a dynamic loss scale starts (default 65536)",
    )
    moe = run.add_argument_group("mixture of experts (ep: default 8 experts, top-2)")
    moe.add_argument("--experts", type=_natural, help="experts per layer in place of each MLP (0: dense)")
    moe.add_argument("--top-k", type=_positive_int, help="experts each token goes to")
    moe.add_argument("--capacity-factor", type=_positive_float, help="cap each expert's load (default: dropless)")
    moe.add_argument("--aux-loss-coef", type=_nonnegative_float, help="load-balancing loss weight (default 0.01)")
    broken = run.add_argument_group("failure injection (the run then ends in the launcher's report of the failure)")
    broken.add_argument("--kill-rank", type=_natural, metavar="R", help="the rank that fails (with --at-step)")
    broken.add_argument("--at-step", type=_natural, metavar="K", help="the step it fails in, from 0")
    broken.add_argument("--fault", choices=KINDS, help="how it fails (default kill: SIGKILL)")
    broken.add_argument("--fault-phase", choices=PHASES, help="where in the step (default forward: its start)")
    saving = run.add_argument_group("checkpoints (every scheme; any of them resumes any other's)")
    saving.add_argument("--checkpoint-dir", metavar="D", help="save the training state as D/step-<n>")
    saving.add_argument("--checkpoint-every", type=_positive_int, metavar="K", help="after every K-th step")
    saving.add_argument(
        "--resume", metavar="D", help="load a checkpoint (D/step-<n>, or the newest in D) and train the steps left"
    )
    saving.add_argument(
        "--checkpoint-async", action="store_true", help="write each checkpoint in the background as training goes on"
    )
    saving.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from the newest checkpoint in --checkpoint-dir if there is one, else start at step 0 "
        "(a job that restarts itself: torchrun --max-restarts)",
    )
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="run every scheme on CPU ranks and print a summary table")
    demo.add_argument("--world-size", type=_positive_int, default=4)
    training_flags(demo)
    demo.set_defaults(func=cmd_demo)

    sch = sub.add_parser("schedule", help="generate, check and simulate a pipeline schedule (no ranks)")
    sch.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    sch.add_argument("--stages", type=_positive_int, default=4)
    sch.add_argument("--microbatches", type=_positive_int, default=8)
    sch.add_argument("--chunks", type=_positive_int, default=1)
    sch.add_argument("--f", type=_positive_float, default=1.0, help="cost of a forward")
    sch.add_argument("--b", type=_positive_float, default=1.0, help="cost of a backward (input gradient)")
    sch.add_argument("--w", type=_nonnegative_float, default=0.0, help="cost of a weight-gradient pass")
    sch.add_argument("--plot", metavar="FILE", help="draw the schedule into a PNG")
    sch.set_defaults(func=cmd_schedule)

    hw = sub.add_parser("hardware", help="list the hardware profiles of the modeled clock")
    hw.set_defaults(func=cmd_hardware)

    from course_lib.hardware import PROFILES

    cal = sub.add_parser(
        "calibrate", help="measure this GPU (or CPU) as a hardware profile and time a training step beside the model"
    )
    cal.add_argument("--device", help="cpu, cuda or cuda:N (default: the first GPU, else the CPU)")
    cal.add_argument("--name", help="the profile's name (default: measured- and the device's model)")
    cal.add_argument(
        "--out",
        metavar="FILE",
        help="write the profile here (default: NAME.json in $COURSE_LIB_PROFILES "
        "or ~/.course_lib/profiles, where --hardware NAME finds it)",
    )
    cal.add_argument(
        "--links", choices=sorted(PROFILES), default="h100", help="whose links and nodes the profile takes"
    )
    cal.add_argument("--quick", action="store_true", help="small sizes, the tiny GPT only: about a second")
    cal.add_argument("--no-train", action="store_true", help="measure only; train no GPT")
    cal.set_defaults(func=cmd_calibrate)
    from course_lib.plan import PIPELINE_SCHEDULES, PRESETS

    pl = sub.add_parser("plan", help="choose TP x PP x DP (and ZeRO) for a model on a cluster, and say why")
    pl.add_argument("--preset", choices=sorted(PRESETS), help="a published model")
    pl.add_argument("--params", type=_positive_float, help="parameter count, e.g. 30e9 (alone: a GPT-3-like shape)")
    for dim in ("layers", "hidden", "heads", "vocab", "seq"):
        pl.add_argument(f"--{dim}", type=_positive_int)
    pl.add_argument("--gpus", type=_positive_int, required=True)
    pl.add_argument("--gpus-per-node", type=_positive_int, help="default: the hardware profile's")
    pl.add_argument("--gpu-mem-gb", type=_positive_float, help="memory per GPU (default: the hardware profile's)")
    pl.add_argument(
        "--hardware", default="h100", help=f"{', '.join(sorted(PROFILES))}, or a measured profile (default h100)"
    )
    pl.add_argument(
        "--topology",
        metavar="NAME[:SIZE]",
        help="time the traffic on this topology's links (h100-superpod, gb200-nvl72, tpu-v5p, ethernet-2to1, "
        "h100-two-level), sized to --gpus unless SIZE is given; compute and memory stay --hardware's",
    )
    pl.add_argument("--global-batch", type=_positive_int, help="sequences per step (default: the preset's, else 1024)")
    pl.add_argument("--micro-batch", type=_positive_int, default=1)
    pl.add_argument("--no-model-parallel", action="store_true", help="only DP and ZeRO/FSDP: tp = pp = 1")
    given = pl.add_argument_group("a given layout (evaluated instead of searched: give --tp, --pp and --dp)")
    for axis in ("tp", "pp", "dp", "cp", "ep"):
        given.add_argument(f"--{axis}", type=_positive_int)
    given.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="default: the lowest stage that fits")
    given.add_argument("--schedule", choices=PIPELINE_SCHEDULES, help="pipeline schedule (default 1f1b)")
    given.add_argument("--chunks", type=_positive_int, help="model chunks per pipeline rank (v), interleaved")
    given.add_argument("--recompute", choices=RECOMPUTE, help="activation recompute (default none)")
    given.add_argument("--attention", choices=["flash", "materialized"], help="attention kernel (default flash)")
    given.add_argument("--no-sp", action="store_true", help="no sequence parallelism with TP")
    pl.set_defaults(func=cmd_plan)

    gp = sub.add_parser("goodput", help="checkpoint interval and goodput for a model on a cluster (Young, Daly)")
    gp.add_argument("--preset", choices=sorted(PRESETS), default="llama3-405b", help="a published model")
    gp.add_argument("--gpus", type=_positive_int, required=True)
    gp.add_argument(
        "--mtbf-gpu-hours", type=_positive_float, help="MTBF of one GPU (default: Llama 3's, 16,384 x 1296 h / 419)"
    )
    gp.add_argument("--write-gbps", type=_positive_float, default=2.0, help="write bandwidth per rank, GB/s")
    gp.add_argument("--storage-tbps", type=_positive_float, help="aggregate storage bandwidth, TB/s (default: no cap)")
    gp.add_argument("--restart-min", type=_nonnegative_float, default=10.0, help="minutes to restart after a failure")
    gp.add_argument("--stall-s", type=_positive_float, help="asynchronous checkpoints: seconds training stalls")
    gp.add_argument("--deduplicate", action="store_true", help="replicas written once, spread over the ranks")
    gp.add_argument("--json", metavar="FILE", help="write the result as JSON (- for standard output)")
    gp.set_defaults(func=cmd_goodput, parser=gp)

    for p in (mem, run, demo, sch, hw, cal, pl):
        p.add_argument("--json", metavar="FILE", help="write the result as JSON (- for standard output)")
        p.set_defaults(parser=p)
    return parser


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work starts, so no result is computed for nothing;
    create the folders a plot goes into."""
    if args.json not in (None, "-"):
        _check_writable(parser, "--json", args.json)
    if getattr(args, "out", None) is not None:
        _check_writable(parser, "--out", args.out)
    plot = getattr(args, "plot", None)
    if plot:
        import matplotlib

        matplotlib.use("Agg")  # files only, whatever display the terminal has
    if plot and args.command == "schedule":
        from matplotlib.figure import Figure

        extension = os.path.splitext(plot)[1].lstrip(".").lower()
        formats = Figure().canvas.get_supported_filetypes()
        if os.path.isdir(plot):
            parser.error(f"--plot {plot}: is a folder; give a file name such as {os.path.join(plot, 'schedule.png')}")
        if extension not in formats:
            parser.error(f"--plot {plot}: give a file name ending in one of .{', .'.join(sorted(formats))}")
        _check_writable(parser, "--plot", plot, create=True)
    elif plot:
        if os.path.exists(plot) and not os.path.isdir(plot):
            parser.error(f"--plot {plot}: is a file; --plot takes a folder for the figures")
        _check_writable(parser, "--plot", os.path.join(plot, "figure.png"), create=True)


def _check_writable(parser: argparse.ArgumentParser, flag: str, path: str, create: bool = False) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder; give a file name")
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            parser.error(f"{flag} {path}: cannot create the folder {folder} ({err.strerror})")
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: the folder {folder} is not writable")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_outputs(args.parser, args)
    try:
        return args.func(args)
    except RankError as err:  # the failing rank's own lines, not the launcher's traceback
        if _is_lead():
            # A numerical diagnosis (fp16 gradients overflowing) says what to change; its traceback adds nothing.
            said = str(err).splitlines()[0] if isinstance(err.__cause__, FloatingPointError) else err
            print(f"course-lib {args.command}: {said}", file=sys.stderr)
        return 1
    except SystemExit as stop:  # a refusal: under torchrun every rank refuses, rank 0 says why
        if isinstance(stop.code, str) and not _is_lead():
            return 1
        raise
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing more, and let Python's final flush find nowhere to fail.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
