"""Time to launch ranks: p50 and p99 of ``--launches`` back-to-back launches of a one-element all-reduce.

Each launch starts ``--world-size`` ranks from the warm forkserver, meets at a fresh file store, runs one
all-reduce and collects every rank's result; the first launch of the process (which starts the forkserver) is timed
apart. Target: p99 under 0.3 s for 8 ranks on 2 cores (one launch in four used to stall ~5 s on a TCP store's
reconnect back-off).

    .venv/bin/python benchmarks/launch.py --world-size 8 4 --launches 100
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

from course_lib.runtime import launch

TARGET_P99_S = {8: 0.3}


def one_all_reduce() -> float:
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t)
    return t.item()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank method: a value that was measured."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--launches", type=int, default=100)
    args = parser.parse_args()
    if args.launches < 1 or min(args.world_size) < 1:
        parser.error("--launches and every --world-size must be at least 1")
    started = time.perf_counter()
    launch.run(one_all_reduce, args.world_size[0])
    print(f"first launch (starts the forkserver): {time.perf_counter() - started:.2f} s")
    print(f"{'ranks':>5} {'launches':>9} {'p50 s':>8} {'p99 s':>8} {'max s':>8} {'> 1 s':>6}  target")
    for n in args.world_size:
        times = []
        for _ in range(args.launches):
            started = time.perf_counter()
            assert list(launch.run(one_all_reduce, n)) == [n * (n - 1) / 2] * n
            times.append(time.perf_counter() - started)
        target = TARGET_P99_S.get(n)
        verdict = "" if target is None else f"p99 < {target} s: {'met' if percentile(times, 99) < target else 'MISSED'}"
        print(
            f"{n:>5} {len(times):>9} {statistics.median(times):>8.3f} {percentile(times, 99):>8.3f} "
            f"{max(times):>8.3f} {sum(t > 1 for t in times):>6}  {verdict}"
        )


if __name__ == "__main__":
    main()
