"""``schedule``: generate a pipeline schedule, check it, simulate it and draw it; no ranks start."""

from __future__ import annotations

import argparse

from course_lib.cli.common import (
    add_json_flag,
    command_parser,
    nonnegative_float,
    positive_float,
    positive_int,
    saved,
    say,
    write_json,
)
from course_lib.parallel.schedules import SCHEDULES


def cmd_schedule(args: argparse.Namespace) -> int:
    from course_lib.parallel.schedule_sim import check, simulate
    from course_lib.parallel.schedules import Costs, bubble_formula, chunks_per_rank, formula_text, generate

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
    write_json(data, args.json)
    say(
        args,
        f"{args.schedule}: {args.stages} stages, {args.microbatches} microbatches"
        + (f", {args.chunks} chunks per rank" if args.chunks > 1 else "")
        + f"; F {args.f}, B {args.b}, W {args.w}",
    )
    say(
        args,
        f"  makespan {sim.makespan:g}, bubble fraction {sim.bubble_fraction:.4f} "
        f"({formula_text(formula, args.schedule)}), peak microbatches in flight per stage {sim.peak_inflight}",
    )
    for r, table in enumerate(tables):
        say(args, f"  rank {r}: " + " ".join(str(a) for a in table if a.kind in ("F", "B", "W")))
    if args.plot:
        from course_lib.ui.figures_middle import plot_schedule

        def write() -> list[str]:
            plot_schedule(sim, title=f"{args.schedule}, p={args.stages}, m={args.microbatches}").savefig(
                args.plot, dpi=110
            )
            return [args.plot]

        say(args, "  " + saved(write))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``schedule``'s flags: the schedule, its shape and the costs of its passes."""
    sch = command_parser(
        subparsers,
        "schedule",
        "generate, check and simulate a pipeline schedule (no ranks)",
        [
            ("--stages 4 --microbatches 8", "1F1B: bubble (p-1)/(m+p-1) = 3/11"),
            ("--schedule interleaved --stages 4 --microbatches 8 --chunks 2", "two model chunks per rank"),
            ("--schedule zb-h1 --w 1 --plot out/zb.png", "zero bubble: B and W apart, drawn"),
        ],
    )
    sch.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="the schedule (default 1f1b)")
    sch.add_argument("--stages", type=positive_int, default=4, help="pipeline stages p, one per rank (default 4)")
    sch.add_argument("--microbatches", type=positive_int, default=8, help="microbatches m per step (default 8)")
    sch.add_argument(
        "--chunks",
        type=positive_int,
        default=1,
        help="model chunks per rank: interleaved splits each stage into them (default 1); zb-v and dualpipev hold 2 "
        "in a V by themselves (2 is accepted)",
    )
    sch.add_argument("--f", type=positive_float, default=1.0, help="cost of a forward")
    sch.add_argument("--b", type=positive_float, default=1.0, help="cost of a backward (input gradient)")
    sch.add_argument("--w", type=nonnegative_float, default=0.0, help="cost of a weight-gradient pass")
    sch.add_argument("--plot", metavar="FILE", help="draw the schedule into a PNG")
    sch.set_defaults(func=cmd_schedule)
    add_json_flag(sch)
