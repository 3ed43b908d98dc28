"""``run``: train the tiny GPT (or your model) with one scheme on real ranks, compare it with one device, say what
each rank held and sent, and optionally replay the last step on a modeled cluster."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from course_lib.cli.common import (
    add_json_flag,
    command_parser,
    natural,
    nonnegative_float,
    positive_float,
    positive_int,
    refusing,
    save_plots,
    say,
    write_json,
)
from course_lib.cli.training import add_training_flags, checked_configs, launch_limits, training_groups
from course_lib.cluster.settings import ClusterSettings, check_cluster
from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.config import HALF_TYPES, MIXED_PRECISIONS, GPTConfig, TrainConfig
from course_lib.parallel import catalog
from course_lib.runtime import checkpoint_plan, host
from course_lib.runtime.faults import KINDS, PHASES, Fault, check_fault
from course_lib.runtime.forkserver import under_torchrun

if TYPE_CHECKING:
    from course_lib.harness import SchemeRun


def _routing_lines(counts: list, cfg: GPTConfig) -> list[str]:
    """An MoE run's last step, per layer: assignments per expert, and what capacity kept of them."""
    import torch

    from course_lib.model.gpt import within_capacity

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
        f"    (model.config.PRECISIONS[{p['convention']!r}]); rank 0 holds {held:.2f} bytes of model states per "
        "parameter",
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
    if under_torchrun():  # as many ranks as torchrun started
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


def _scheme_flags(groups: dict[str, argparse._ArgumentGroup], schemes: dict[str, catalog.Card]) -> None:
    """One flag per option of any scheme (its help names the schemes that take it), and ``--<axis>`` for each
    one-axis scheme's axis (``run tp --tp 4``: the number of ranks); those of :data:`catalog.SCHEDULE_OPTIONS` in the
    schedule group, the others with what to run. A flag keeps its own name as its destination, and one not given
    stays out of the namespace (see :func:`_scheme_settings`)."""
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
        parser = groups["schedule" if option in catalog.SCHEDULE_OPTIONS else "what to run"]
        kind = option.kind if option else int
        metavar = {int: "N", float: "X"}.get(kind, flag.removeprefix("--").replace("-", "_").upper())
        if option is not None and option.kind is None:
            parser.add_argument(
                flag, dest=flag, action="store_const", const=option.value, default=argparse.SUPPRESS, help=text
            )
        elif option is not None and option.choices:
            parser.add_argument(
                flag, dest=flag, type=option.kind, choices=option.choices, default=argparse.SUPPRESS, help=text
            )
        else:
            parse = {int: positive_int, float: positive_float}.get(kind) or refusing(kind)
            parser.add_argument(flag, dest=flag, type=parse, metavar=metavar, default=argparse.SUPPRESS, help=text)


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
    from course_lib.runtime.forkserver import torchrun_restart

    fault = Fault(args.kill_rank, args.at_step, args.fault or "kill", args.fault_phase or "forward")
    restart = torchrun_restart()
    if restart:
        say(args, f"torchrun restart {restart}: the injected fault ({fault}) fired in the first attempt; not again")
        return None
    return fault


def _resume(args) -> str | None:
    """The checkpoint to resume from: ``--resume D``, or with ``--auto-resume`` the folder ``--checkpoint-dir``,
    whose newest intact checkpoint the harness takes (None when it holds none yet: the job's first start)."""
    if not args.auto_resume:
        return args.resume
    if args.resume is not None or args.checkpoint_dir is None:
        raise SystemExit(
            f"run {args.scheme}: --auto-resume resumes from the newest checkpoint in --checkpoint-dir D; give D, "
            f"and no --resume"
        )
    if checkpoint_plan.complete(args.checkpoint_dir):
        return args.checkpoint_dir
    if left := checkpoint_plan.skipped_saves(args.checkpoint_dir, -1):
        say(args, f"no complete checkpoint in {args.checkpoint_dir} to resume from: starting at step 0{_skipped(left)}")
    return None


def _skipped(saves: list[dict]) -> str:
    """``; skipped <folder>: <why>`` for each of ``saves``: what a resume passed over (unfinished or damaged)."""
    return "".join(f"; skipped {s['path']}: {s['why']}" for s in saves)


def _loss_scale(text: str) -> str | float | None:
    """``--loss-scale``: dynamic, none, or a fixed scale greater than 0."""
    if text in ("dynamic", "none"):
        return None if text == "none" else text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be dynamic, none or a finite number greater than 0, got {text}"
        ) from None


def cmd_run(args: argparse.Namespace) -> int:
    card = catalog.card(args.scheme)  # everything up to the warm-up is checked without torch and refused in one line:
    options, axis_size = _scheme_settings(args, card)  # the flags,
    fault, resume = _fault(args), _resume(args)  # the fault's and the resume's (--auto-resume looks for one),
    world_size = _checked_world_size(args, card, options, axis_size)  # the ranks this machine holds,
    cfg, train = checked_configs(args, f"run {args.scheme}", card, world_size, options)  # the scheme's checks,
    _check_checkpoints(args, card, world_size, cfg, train, options.get("model"), resume, fault)  # checkpoints, fault
    _check_cluster(args, card, world_size)  # and the modeled cluster
    if card.axes or fault is not None:  # ranks will start (single trains in this process)
        from course_lib.runtime import forkserver

        forkserver.warm()  # the rank server imports torch beside this process
    from course_lib.cli import echo

    run = _train(args, world_size, cfg, train, options, fault, resume)
    report = run.report
    write_json(report, args.json)
    _say_what_ran(args, report, cfg, train, world_size, options.get("model"))
    settings = card.settings(options)
    for line in [echo.settings_line(card.name, settings), *echo.layout_lines(report), echo.bubble_line(report)]:
        if line:
            say(args, line)
    _say_checkpoints(args, report)
    _say_results(args, run, cfg)
    if run.modeled is not None:
        _say_modeled(args, report["modeled"])
    if args.plot:
        say(args, "  " + save_plots(run, args.plot))
    say(args, echo.verdict_line(report))
    return 0 if report["verdict"]["matches"] else 1


def _checked_world_size(args, card: catalog.Card, options: dict, axis_size: int | None) -> int:
    """The number of ranks (:func:`_world_size`), refused with how a grid's size factors if this machine cannot hold
    that many, or has not the GPUs ``--backend nccl`` or ``--device cuda`` asks for (torchrun's nodes have theirs)."""
    settings = card.settings(options)
    world_size = _world_size(args, card, settings, axis_size)
    try:
        host.check_world_size(world_size, args.max_ranks)
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {_grid_reason(card, settings, options)}{err}") from None
    if not under_torchrun():
        try:
            host.compute_device(host.resolve_backend(args.backend, world_size), args.device)
        except ValueError as err:
            raise SystemExit(f"run {args.scheme}: {err}") from None
    return world_size


def _check_checkpoints(
    args,
    card: catalog.Card,
    world_size: int,
    cfg: GPTConfig,
    train: TrainConfig,
    model,
    resume: str | None,
    fault: Fault | None,
) -> None:
    """Refuse checkpoint settings the run cannot keep, a checkpoint to resume from that is damaged or another run's
    (:func:`course_lib.runtime.checkpoint_plan.plan_for`), and a fault the run cannot fire
    (:func:`course_lib.runtime.faults.check_fault`), as the harness would, before anything starts."""
    try:
        plan = checkpoint_plan.plan_for(
            card.name,
            card.checkpoint,
            world_size,
            cfg,
            train,
            model,
            args.checkpoint_dir,
            args.checkpoint_every,
            resume,
            args.checkpoint_async,
        )
        if fault is not None:
            check_fault(fault, world_size, train.steps, plan, args.checkpoint_async, in_process=False)
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {err}") from None


def _check_cluster(args, card: catalog.Card, world_size: int) -> None:
    """Refuse a modeled cluster that cannot be (:func:`course_lib.cluster.settings.check_cluster`), before anything
    starts."""
    cluster = ClusterSettings(args.hardware, args.gpus_per_node, args.topology, args.algorithm, args.placement)
    try:
        check_cluster(cluster, world_size, card.axes)
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {err}") from None


def _train(
    args, world_size: int, cfg: GPTConfig, train: TrainConfig, options: dict, fault: Fault | None, resume: str | None
) -> SchemeRun:
    """The scheme's run (:func:`course_lib.harness.run_scheme`); a setting the harness refuses (the ranks' memory,
    a student's model) ends the command with its message."""
    from course_lib.harness import run_scheme
    from course_lib.runtime import launch

    try:
        return run_scheme(
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
            **launch_limits(args),
            **options,
        )
    except ValueError as err:
        raise SystemExit(f"run {args.scheme}: {err}") from None


def _say_what_ran(args, report: dict, cfg: GPTConfig, train: TrainConfig, world_size: int, model) -> None:
    """The first line: the scheme on how many ranks of which backend, the model (``--model``'s, or the tiny GPT's
    shape) and the training's sizes and precision."""
    moe = f", {cfg.experts} experts top-{cfg.top_k}" if cfg.experts else ""
    shape = (
        f"{cfg.layers} layers x {cfg.d_model} wide, {cfg.heads} heads{moe}"
        if model is None
        else f"your {getattr(model, '__qualname__', 'model')}"
    )
    say(
        args,
        f"{args.scheme} on {world_size} {report['backend']} rank{'s' * (world_size != 1)} ({report['device']}), "
        f"{report['params']:,} "
        f"parameters ({shape}, "
        f"{cfg.seq} tokens, batch {train.batch}), "
        f"{args.dtype if train.precision is None else f'{train.precision} precision, {train.half}'}"
        + ("" if cfg.recompute == "none" else f", {cfg.recompute} recompute"),
    )


def _say_checkpoints(args, report: dict) -> None:
    """The checkpoint the run resumed from, and the ones it wrote: how often, where, and how long training stood
    still for them."""
    from course_lib.runtime import checkpoint

    if "resumed_from" in report:
        r = report["resumed_from"]
        saved = f"step {report['first_step']}, saved by {r['scheme']} on {r['world_size']}"
        say(args, f"  resumed from {r['path']} ({saved}){_skipped(r['skipped'])}")
    if "checkpoints" in report:
        c = report["checkpoints"]
        how = "in the background" if c["asynchronous"] else "while training waits"
        every = "every step" if c["every"] == 1 else f"every {c['every']} steps"
        stood = sum(b - a for t in c["saves"][0] for a, b in checkpoint.stalls(t))
        say(
            args,
            f"  checkpoints after {every} in {c['directory']}, written {how}; training stood still "
            f"{stood * 1e3:.3g} ms for them on rank 0",
        )


def _say_results(args, run: SchemeRun, cfg: GPTConfig) -> None:
    """The losses beside one device's, the largest differences, a mixed-precision run's bytes and loss scale, the
    bytes each rank held and sent, and an MoE run's routing."""
    report = run.report
    say(args, f"  losses           {[round(x, 6) for x in report['losses']]}")
    say(args, f"  reference losses {[round(x, 6) for x in report['reference_losses']]}")
    say(
        args,
        f"  max |loss diff| {report['max_abs_loss_diff']:.3e}   max |param diff| {report['max_abs_param_diff']:.3e}",
    )
    for line in _precision_lines(report) if "precision" in report else []:
        say(args, line)
    say(args, "  bytes per rank, last step:")
    for line in _rank_table(report):
        say(args, line)
    if "counts" in run.result[0]:
        for line in _routing_lines(run.result[0]["counts"], cfg):
            say(args, line)


def _say_modeled(args, m: dict) -> None:
    """The last step replayed on the modeled cluster: its times, the collective algorithms used, and where each
    group's ranks sit on a topology."""
    where = (
        f"{m['hardware']}'s compute, {m['topology']}'s links"
        if "topology" in m
        else f"{m['hardware']} ({m['gpus_per_node']} GPUs per node)"
    )
    say(args, f"  modeled on {where}, last step:")
    say(
        args,
        f"    step {m['step_time_s'] * 1e6:.2f} us   compute {m['compute_s'] * 1e6:.2f} us   "
        f"comm {m['comm_s'] * 1e6:.2f} us   exposed comm {m['exposed_comm_s'] * 1e6:.2f} us   "
        f"bubble {m['bubble_fraction']:.1%}   (means over ranks; step = makespan)",
    )
    for op, used in m.get("algorithms", {}).items():
        say(args, f"    {op}: " + ", ".join(f"{algorithm} x{count}" for algorithm, count in used.items()))
    for group, where in m.get("placement", {}).items():
        links = f"; slowest link {where['slowest_link'] / 1e9:g} GB/s, up to {where['hops']} hops"
        say(args, f"    {group} groups: {where['what']}" + links * (where["hops"] > 0))


EXAMPLES = [
    ("dp --world-size 2", "data parallel on 2 CPU ranks, beside one device"),
    ("pp --world-size 4 --schedule interleaved --microbatches 8 --chunks 2", "a pipeline schedule"),
    ("zero2 --world-size 2 --precision mixed --half fp16", "16-bit weights with a loss scaler"),
    ("sp --tp 2 --hardware h100 --topology h100-superpod:2", "the last step replayed on a modeled cluster"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``run SCHEME``'s flags, in groups: what to run (the scheme, its settings from the catalog, the launch), the
    model and data, the schedule, precision, the modeled cluster, faults, checkpoints and output."""
    summary = "train the tiny GPT with a scheme and compare with one device"
    run = command_parser(subparsers, "run", summary, EXAMPLES, usage="SCHEME [options]")
    groups = training_groups(run)
    what = groups["what to run"]
    what.add_argument("scheme", choices=[*catalog.CARDS, *catalog.ALIASES], help="the scheme (fsdp is zero3)")
    what.add_argument("--world-size", type=positive_int, metavar="N", help="number of ranks (default 4; 1 for single)")
    _scheme_flags(groups, catalog.CARDS)
    add_training_flags(groups, modeled=True)
    _add_mixed_precision_flags(groups["precision"])
    _add_expert_flags(groups["model and data"])
    _add_cluster_flags(run.add_argument_group("modeled cluster (the last step replayed on it)"))
    _add_fault_flags(run.add_argument_group("faults (the run ends in the launcher's report of the failure)"))
    _add_checkpoint_flags(run.add_argument_group("checkpoints (every scheme; any of them resumes any other's)"))
    run.set_defaults(func=cmd_run)
    add_json_flag(run, groups["output"])


def _add_cluster_flags(cluster: argparse._ArgumentGroup) -> None:
    """The modeled cluster the last step is replayed on: its hardware, topology, algorithm and placement."""
    cluster.add_argument("--hardware", metavar="NAME", help="a hardware profile, e.g. h100 (see the hardware command)")
    cluster.add_argument(
        "--gpus-per-node",
        type=positive_int,
        metavar="N",
        help="with --hardware: GPUs per node (default: the profile's)",
    )
    cluster.add_argument(
        "--topology",
        metavar="NAME[:SIZE]",
        help="with --hardware: time the collectives on these links (see the hardware command)",
    )
    cluster.add_argument(
        "--algorithm",
        choices=["ring", "tree", "hierarchical", "torus"],
        help="with --topology: force this collective algorithm (default: the fastest, as NCCL picks)",
    )
    cluster.add_argument(
        "--placement",
        metavar="AXES[/AXES...]",
        help="with --topology: the mesh's axes on its levels, innermost first, '/' between levels: tp/pp,dp "
        "(default: rank r on GPU r)",
    )


def _add_mixed_precision_flags(mixed: argparse._ArgumentGroup) -> None:
    """Mixed precision: the convention of bytes per parameter, the 16-bit type, the loss scale."""
    mixed.add_argument(
        "--precision",
        choices=MIXED_PRECISIONS,
        default=argparse.SUPPRESS,
        help="16-bit weights, fp32 optimizer state: mixed (16 bytes a parameter), megatron (18: fp32 gradients), "
        "no-master (12)",
    )
    mixed.add_argument(
        "--half", choices=list(HALF_TYPES), default=argparse.SUPPRESS, help="the 16-bit type (default bf16)"
    )
    mixed.add_argument(
        "--loss-scale",
        type=_loss_scale,
        default=argparse.SUPPRESS,
        metavar="S",
        help="dynamic, none, or a fixed scale (default: dynamic with fp16)",
    )
    mixed.add_argument(
        "--initial-scale",
        type=positive_float,
        default=argparse.SUPPRESS,
        metavar="S",
        help="where a dynamic loss scale starts (default 65536)",
    )


def _add_expert_flags(moe: argparse._ArgumentGroup) -> None:
    """A mixture of experts in place of the tiny GPT's MLPs (``ep``: 8 experts, top-2, unless given)."""
    moe.add_argument(
        "--experts", type=natural, metavar="E", help="experts per layer in place of each MLP (0: dense; ep: 8)"
    )
    moe.add_argument("--top-k", type=positive_int, metavar="K", help="experts each token goes to (ep: 2)")
    moe.add_argument(
        "--capacity-factor", type=positive_float, metavar="X", help="cap each expert's load (default: dropless)"
    )
    moe.add_argument(
        "--aux-loss-coef", type=nonnegative_float, metavar="X", help="load-balancing loss weight (default 0.01)"
    )


def _add_fault_flags(broken: argparse._ArgumentGroup) -> None:
    """A rank that fails at a given step, and how."""
    broken.add_argument("--kill-rank", type=natural, metavar="R", help="the rank that fails (with --at-step)")
    broken.add_argument("--at-step", type=natural, metavar="K", help="the step it fails in, from 0")
    broken.add_argument("--fault", choices=KINDS, help="how it fails (default kill: SIGKILL)")
    broken.add_argument("--fault-phase", choices=PHASES, help="where in the step (default forward: its start)")


def _add_checkpoint_flags(saving: argparse._ArgumentGroup) -> None:
    """Checkpoints: where, how often, in the background or not, and resuming from one."""
    saving.add_argument("--checkpoint-dir", metavar="D", help="save the training state as D/step-<n>")
    saving.add_argument("--checkpoint-every", type=positive_int, metavar="K", help="after every K-th step")
    saving.add_argument(
        "--resume", metavar="D", help="train the steps left from a checkpoint (D/step-<n>, or the newest in D)"
    )
    saving.add_argument("--checkpoint-async", action="store_true", help="write the checkpoints in the background")
    saving.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from the newest checkpoint in --checkpoint-dir, if any (torchrun --max-restarts)",
    )
