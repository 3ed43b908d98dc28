"""``demo``: every scheme on CPU ranks, one after the other, and a table of what each matched, held and sent."""

from __future__ import annotations

import argparse
import os
import time

from course_lib.cli.common import add_json_flag, command_parser, positive_int, save_plots, saved, say, write_json
from course_lib.cli.training import add_training_flags, checked_configs, launch_limits, training_groups
from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel import catalog
from course_lib.runtime import host


def cmd_demo(args: argparse.Namespace) -> int:
    from course_lib.runtime import forkserver

    sizes, cfgs, train = _checked_schemes(args)  # before torch: the rank server warms only for a demo that will run
    forkserver.warm()  # the arguments are accepted: the rank server imports torch beside this process
    from course_lib.harness import run_scheme, validate

    for name, n in sizes.items():  # the ranks' memory too (the schemes' formulas need torch), before the first runs
        try:
            validate(name, n, cfgs[name], train, {})
        except ValueError as err:
            raise SystemExit(f"demo: {name} on {n} ranks: {err}") from None
    reports = []
    started = time.perf_counter()
    for name, n in sizes.items():  # single: 1 rank; 3d: its default 2 x 2 x 2 grid
        run = run_scheme(name, n, cfgs[name], train, backend=args.backend, device=args.device, **launch_limits(args))
        reports.append(run.report)
        if args.plot:
            save_plots(run, args.plot)
    write_json({"schemes": reports}, args.json)
    for line in table(reports, train.steps, args.dtype):
        say(args, line)
    if args.plot:
        say(args, "  " + saved(lambda: [save_summary(reports, args.plot)]))
        say(args, f"plots and Chrome traces (open in ui.perfetto.dev) written to {os.path.abspath(args.plot)}/")
    say(args, f"demo took {time.perf_counter() - started:.1f} s")
    return 0 if all(r["verdict"]["matches"] for r in reports) else 1


def _checked_schemes(args: argparse.Namespace) -> tuple[dict[str, int], dict[str, GPTConfig], TrainConfig]:
    """Every scheme's world size (a grid's default, else ``--world-size``) and model (the tiny GPT with at least
    ``--world-size`` layers), and the training settings, each scheme's checked without torch
    (:func:`course_lib.cli.training.checked_configs`) with the ranks this machine holds."""
    sizes = {name: card.grid_size(card.settings({})) or args.world_size for name, card in catalog.CARDS.items()}
    cfgs = {}
    for name, n in sizes.items():
        which = f"{name} on {n} ranks"
        cfgs[name], train = checked_configs(args, "demo", catalog.CARDS[name], n, layers=args.world_size, which=which)
        try:
            host.check_world_size(n, args.max_ranks)
        except ValueError as err:
            raise SystemExit(f"demo: {which}: {err}") from None
    return sizes, cfgs, train


def size(nbytes: float) -> str:
    """Bytes in decimal units, three significant digits: ``838 kB``, ``3.33 MB``."""
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def table(reports: list[dict], steps: int, dtype: str) -> list[str]:
    """One row per scheme: does it match one device (:func:`course_lib.harness.verdict`), its differences, and what
    its busiest rank holds and sends; then what the columns mean, and why a scheme on another model differs."""
    from course_lib.ui.scheme_summary import busiest_rank

    first = reports[0]
    lines = [
        f"course_lib demo: the tiny GPT ({first['params']:,} parameters), {steps} step{'s' * (steps != 1)}, {dtype}",
        f"{'scheme':<8}{'ranks':>6}{'matches':>9}{'loss diff':>11}{'param err':>11}{'states/rank':>13}"
        f"{'activ./rank':>13}{'sent/rank/step':>16}",
    ]
    for r in reports:
        b = busiest_rank(r)
        state = sum(b["memory"][k] for k in CATEGORIES)
        sent = sum(c["bytes"] for c in b["comm"].values())
        lines.append(
            f"{r['scheme']:<8}{r['world_size']:>6}{'yes' if r['verdict']['matches'] else 'NO':>9}"
            f"{r['max_abs_loss_diff']:>11.1e}{r['rel_param_diff']:>11.1e}{size(state):>13}"
            f"{size(b['memory']['activations_peak']):>13}{size(sent):>16}"
        )
    lines += [
        "matches: within the tolerances of the dtype (run prints them); loss diff: largest |difference| of a step's",
        "loss; param err: ||params - reference|| / ||reference||, both against the one-device reference; memory and",
        "bytes sent: the busiest rank's, in the last step.",
    ]
    for r in reports:
        if r["params"] != first["params"]:
            lines += [
                f"{r['scheme']} trains another model, a mixture of experts of {r['params']:,} parameters: each rank "
                f"holds 1/{r['world_size']} of the",
                "experts and a whole copy of the rest, so its row is not the tiny GPT split, and can hold more than "
                "one device does.",
            ]
    return lines


def save_summary(reports: list[dict], folder: str) -> str:
    """The cross-scheme figure (:func:`course_lib.ui.scheme_summary.plot_scheme_summary`) as ``folder/summary.png``."""
    import matplotlib.pyplot as plt

    from course_lib.ui.scheme_summary import plot_scheme_summary

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "summary.png")
    fig = plot_scheme_summary(reports)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
