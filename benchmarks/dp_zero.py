"""Step time of our bucketed data parallel and ZeRO-3 against PyTorch's DDP and FSDP2, on the same ranks and model.

Each scheme trains the tiny GPT for ``--steps`` steps on ``--world-size`` ranks (gloo on CPU, NCCL on GPUs),
``--repeats`` launches each, interleaved. Ours (``course_lib.parallel``) and PyTorch's
(``course_lib.parallel.production``) both record forward, backward and optimizer spans (and ours its collectives) on the
course timeline, tagged with the step; a step takes, on one rank, from the first start to the last end of its events
(building the batch is outside), and the step's time is that of its slowest rank. The table gives the median over the
steps after ``--warmup`` of all launches, and the bytes a rank sends per step by our ledger (PyTorch's collectives
bypass it). Our DP and DDP use the same bucket size. Targets: our bucketed DP within 1.10x of DDP, our ZeRO-3 within
1.25x of FSDP2.

Our training loop normally runs every step inside ``MemoryMeter``, a ``TorchDispatchMode`` that does Python
bookkeeping on every operator; PyTorch's loop has no meter, so ours is timed with ``measure_memory=False``, and once
more with the meter on, to show what the instrument itself costs.

    .venv/bin/python benchmarks/dp_zero.py --world-size 4 --steps 10 --warmup 3
"""

from __future__ import annotations

import argparse
import statistics

from course_lib.ledgers import comm
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.data import train_data_parallel
from course_lib.parallel.fsdp import train_fsdp
from course_lib.parallel.production import train_ddp, train_fsdp2
from course_lib.runtime import launch


def step_times(result: launch.RunResult, steps: range) -> list[float]:
    """Seconds of each step in ``steps`` on its slowest rank (last event end minus first event start on a rank)."""
    times = []
    for step in steps:
        spans = []
        for events in result.events:
            tagged = [e for e in events if e.tags.get("step") == step]
            spans.append(max(e.end for e in tagged) - min(e.start for e in tagged))
        times.append(max(spans))
    return times


def sent_bytes(result: launch.RunResult, step: int) -> float:
    """Bytes rank 0 sent during ``step`` by our ledger (0 for PyTorch's schemes, whose collectives bypass it)."""
    return sum(s["bytes"] for s in comm.summarize(r for r in result.comm[0] if r.tags.get("step") == step).values())


def mean_losses(result: launch.RunResult) -> list[float]:
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in result), strict=True)]


ROW = "{:<34} {:>8} {:>8} {:>7} {:>4} {:>16} {:>11}"


def time_interleaved(runs: dict, n: int, cfg, train, repeats: int, timed: range) -> tuple[dict, dict]:
    """Launch each labelled (rank function, options) ``repeats`` times, interleaved so that a burst of load
    elsewhere falls on every scheme; return the median step time in ms per label and each label's last run."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    last: dict[str, launch.RunResult] = {}
    for _ in range(repeats):
        for label, (rank_fn, opts) in runs.items():
            last[label] = launch.run(rank_fn, n, cfg, train, timeout=600, **opts)
            times[label] += step_times(last[label], timed)
    return {label: 1e3 * statistics.median(t) for label, t in times.items()}, last


def benchmark_parser(description: str, world_size_help: str, batch_help: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ranks, steps timed, model size, batch, repeats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world-size", type=int, default=4, help=world_size_help)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help=batch_help)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each scheme; their steps are pooled")
    return parser


def check_timing_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.warmup < args.steps or args.repeats < 1:
        parser.error(
            f"need 0 <= --warmup < --steps and --repeats >= 1, got {args.warmup}, {args.steps}, {args.repeats}"
        )


def main() -> None:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0], "number of ranks", "global batch (sequences), split over the ranks"
    )
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket (10^6 bytes), ours and DDP's")
    args = parser.parse_args()
    check_timing_arguments(parser, args)
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} does not split evenly over --world-size {args.world_size}")
    n = args.world_size
    cfg, train = GPTConfig(layers=args.layers, d_model=args.d_model), TrainConfig(args.steps, args.batch)
    timed = range(args.warmup, args.steps)
    # (ours: name, rank function, options), (PyTorch's: the same), target ratio ours / PyTorch
    pairs = [
        (
            ("bucketed DP", train_data_parallel, {"bucket_mb": args.bucket_mb}),
            ("DDP", train_ddp, {"bucket_cap_mb": args.bucket_mb * 1e6 / 2**20}),
            1.10,
        ),
        (("ZeRO-3", train_fsdp, {}), ("FSDP2", train_fsdp2, {}), 1.25),
    ]
    print(f"{n} ranks ({launch.resolve_backend('auto', n)}), {cfg}, batch {train.batch}, median of steps {timed}")
    print(ROW.format("scheme", "step ms", "ours/pt", "target", "met", "bytes/rank/step", "max|dloss|"))
    for (name, fn, options), (pt_name, pt_fn, pt_options), target in pairs:
        runs = {
            f"PyTorch {pt_name}": (pt_fn, pt_options),
            f"ours: {name}": (fn, {**options, "measure_memory": False}),
            f"ours: {name}, memory meter on": (fn, options),
        }
        ms, last = time_interleaved(runs, n, cfg, train, args.repeats, timed)
        theirs = f"PyTorch {pt_name}"
        for label in runs:
            if label == theirs:
                print(ROW.format(label, f"{ms[label]:.1f}", "", "", "", "(not in ledger)", "").rstrip())
                continue
            ratio = ms[label] / ms[theirs]
            losses = zip(mean_losses(last[label]), mean_losses(last[theirs]), strict=True)
            print(
                ROW.format(
                    label,
                    f"{ms[label]:.1f}",
                    f"{ratio:.2f}x",
                    f"{target:.2f}x",
                    "yes" if ratio <= target else "no",
                    f"{sent_bytes(last[label], timed[-1]):,.0f}",
                    f"{max(abs(a - b) for a, b in losses):.1e}",
                )
            )


if __name__ == "__main__":
    main()
