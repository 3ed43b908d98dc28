"""``goodput``: the checkpoint interval (Young, Daly) and the expected goodput of a model's training on a cluster
whose GPUs fail."""

from __future__ import annotations

import argparse
import math

from course_lib.cli.common import (
    add_json_flag,
    command_parser,
    gpu_count,
    nonnegative_float,
    positive_float,
    say,
    write_json,
)


def cmd_goodput(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from course_lib.planner.goodput import LLAMA3, choose_interval

    mtbf_gpu_h = args.mtbf_gpu_hours or LLAMA3.mtbf_gpu_hours()
    try:
        c = choose_interval(
            args.preset,
            args.gpus,
            mtbf_gpu_h * 3600,
            args.write_gbps * 1e9,
            args.restart_min * 60,
            storage_bandwidth=args.storage_tbps * 1e12 if args.storage_tbps else math.inf,
            deduplicate=not args.whole_replica,
            stall_s=args.stall_s,
        )
    except ValueError as err:
        raise SystemExit(f"goodput: {err}") from None
    write_json({"mtbf_gpu_hours": mtbf_gpu_h, **asdict(c)}, args.json)
    say(args, f"{args.preset} on {args.gpus} GPUs, {c.layout}")
    say(
        args,
        f"  checkpoint {c.checkpoint_bytes / 1e9:.3g} GB per rank ("
        + ("its whole holding, replicas included" if args.whole_replica else "every tensor once, spread over the ranks")
        + f"), written in {c.checkpoint_s:.3g} s"
        + (f" in the background (stall {args.stall_s:g} s)" if c.async_checkpoint else ""),
    )
    say(args, f"  MTBF {mtbf_gpu_h:.6g} h per GPU -> {c.mtbf_job_s / 3600:.3g} h for the job")
    say(args, f"  Young {c.young_s / 60:.3g} min, Daly {c.daly_s / 60:.3g} min: expected goodput {c.goodput:.1%}")
    for interval, goodput in c.table:
        say(args, f"    every {interval / 60:8.3g} min   goodput {goodput:6.1%}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``goodput``'s flags: the model and cluster, how often a GPU fails, how fast a checkpoint is written."""
    from course_lib.planner.presets import PRESETS

    gp = command_parser(
        subparsers,
        "goodput",
        "checkpoint interval and goodput for a model on a cluster (Young, Daly)",
        [
            ("--gpus 16384", "Llama 3 405B on 16,384 GPUs at Llama 3's failure rate"),
            ("--preset llama3-70b --gpus 2048 --write-gbps 5 --restart-min 5", "faster writes, faster restarts"),
            ("--gpus 16384 --stall-s 2", "asynchronous checkpoints: training stalls 2 s a save"),
            ("--gpus 16384 --whole-replica", "a save in which every rank writes all it holds, replicas too"),
        ],
        usage="--gpus N [options]",
    )
    gp.add_argument("--preset", choices=sorted(PRESETS), default="llama3-405b", help="a published model")
    gp.add_argument("--gpus", type=gpu_count, required=True, help="how many GPUs train it: 16384, 16K")
    gp.add_argument(
        "--mtbf-gpu-hours", type=positive_float, help="MTBF of one GPU (default: Llama 3's, 16,384 x 1296 h / 419)"
    )
    gp.add_argument("--write-gbps", type=positive_float, default=2.0, help="write bandwidth per rank, GB/s")
    gp.add_argument("--storage-tbps", type=positive_float, help="aggregate storage bandwidth, TB/s (default: no cap)")
    gp.add_argument("--restart-min", type=nonnegative_float, default=10.0, help="minutes to restart after a failure")
    gp.add_argument("--stall-s", type=positive_float, help="asynchronous checkpoints: seconds training stalls")
    gp.add_argument(
        "--whole-replica",
        action="store_true",
        help="every rank writes all it holds, replicas included (default: each tensor once, the writes spread over "
        "the ranks, as torch.distributed.checkpoint and lesson 08 do)",
    )
    gp.set_defaults(func=cmd_goodput)
    add_json_flag(gp)
