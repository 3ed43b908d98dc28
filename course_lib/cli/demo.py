"""``demo``: every scheme on CPU ranks, one after the other, and a table of what each matched, held and sent."""

from __future__ import annotations

import argparse
import os
import time

from course_lib.cli.common import add_json_flag, command_parser, positive_int, save_plots, say, write_json
from course_lib.cli.training import add_training_flags, launch_limits, model_config, train_config, training_groups
from course_lib.ledgers.categories import CATEGORIES


def cmd_demo(args: argparse.Namespace) -> int:
    from course_lib.runtime import forkserver

    forkserver.warm()  # the arguments are accepted: the rank server imports torch beside this process
    from course_lib.harness import SCHEMES, run_scheme, validate
    from course_lib.runtime import launch

    train = train_config(args)
    sizes = {name: spec.grid_size(spec.settings({})) or args.world_size for name, spec in SCHEMES.items()}
    cfgs = {name: model_config(args, args.world_size, spec.model_settings) for name, spec in SCHEMES.items()}
    try:  # every scheme checked before the first one runs
        for name, n in sizes.items():
            validate(name, n, cfgs[name], train, {})
            launch.check_world_size(n, args.max_ranks)
    except ValueError as err:
        raise SystemExit(f"demo: {name} on {n} ranks: {err}") from None
    rows, reports = [], []
    started = time.perf_counter()
    for name, n in sizes.items():  # single: 1 rank; 3d: its default 2 x 2 x 2 grid
        run = run_scheme(name, n, cfgs[name], train, backend=args.backend, device=args.device, **launch_limits(args))
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
            save_plots(run, args.plot)
    write_json({"schemes": reports}, args.json)
    say(args, f"course_lib demo: the tiny GPT ({reports[0]['params']:,} parameters), {train.steps} steps, {args.dtype}")
    header = f"{'scheme':<8}{'ranks':>6}{'loss diff':>12}{'param err':>12}{'states/rank':>14}{'activ./rank':>13}"
    say(args, header + f"{'sent/rank/step':>16}")
    for name, n, dl, dp, state, act, sent in rows:
        say(args, f"{name:<8}{n:>6}{dl:>12.2e}{dp:>12.2e}{state:>14,}{act:>13,}{sent:>16,.0f}")
    say(args, "(bytes; loss diff: largest |difference| of a step's loss; param err: ||params - reference|| /")
    say(args, " ||reference||, both against the single-device reference trainer)")
    if args.plot:
        say(args, f"plots and Chrome traces (open in ui.perfetto.dev) written to {os.path.abspath(args.plot)}/")
    say(args, f"demo took {time.perf_counter() - started:.1f} s")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``demo``'s flags: the world size and the training flags it shares with ``run``."""
    demo = command_parser(
        subparsers,
        "demo",
        "run every scheme on CPU ranks and print a summary table",
        [
            ("", "every scheme on 4 ranks (grids on their own), 3 steps"),
            ("--world-size 2 --steps 1", "the quickest look"),
            ("--dtype float64 --json -", "in float64, the reports as JSON"),
        ],
    )
    groups = training_groups(demo)
    groups["what to run"].add_argument(
        "--world-size", type=positive_int, default=4, metavar="N", help="ranks of every one-axis scheme (default 4)"
    )
    add_training_flags(groups, modeled=False)
    demo.set_defaults(func=cmd_demo)
    add_json_flag(demo, groups["output"])
