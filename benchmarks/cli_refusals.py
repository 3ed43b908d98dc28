"""How fast the command line says no: the wall time of every command's ``--help`` and of a refusal of each kind (an
unknown command or flag, a bad number, a bad choice, a bad size, a flag combination, a scheme's own check), each a
fresh ``python -m course_lib`` process. Target: under 0.5 s each, which parsing without torch makes possible (importing
torch alone takes seconds on 2 cores).

Each command line runs ``--repeats`` times; the median and the worst are printed, with the floor: a fresh interpreter
that imports nothing (``python -c pass``).

    .venv/bin/python benchmarks/cli_refusals.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

TARGET_S = 0.5
COMMANDS = ["memory", "run", "demo", "schedule", "hardware", "calibrate", "plan", "goodput"]
REFUSALS = [
    ["trian"],
    ["run", "dp", "--bogus"],
    ["run", "dp", "--steps", "0"],
    ["run", "nope"],
    ["run", "dp", "--tp", "2"],
    ["run", "dp", "--kill-rank", "1"],
    ["run", "dp", "--world-size", "3"],  # the scheme's own checks (parallel/checks.py), without torch too
    ["run", "tp", "--tp", "3"],
    ["run", "pp", "--schedule", "dualpipev", "--microbatches", "4"],
    ["run", "dp", "--layers", "1000000"],
    ["demo", "--world-size", "x"],
    ["memory", "--params", "7X"],
    ["memory", "--precision", "fp8"],
    ["schedule", "--schedule", "zz"],
    ["plan", "--gpus", "1e9"],
    ["plan", "--gpus", "8", "--preset", "gpt5"],
    ["goodput", "--gpus", "-5"],
    ["hardware", "--bogus"],
    ["calibrate", "--links", "tpu"],
]


def wall(argv: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, *argv], capture_output=True, check=False)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    floor = wall(["-c", "pass"], repeats)
    print(f"{'command line':<48}{'median s':>10}{'worst s':>10}")
    print(f"{'(python -c pass: the floor)':<48}{statistics.median(floor):>10.3f}{max(floor):>10.3f}")
    over = []
    for argv in [["--help"], *[[c, "--help"] for c in COMMANDS], *REFUSALS]:
        times = wall(["-m", "course_lib", *argv], repeats)
        line = " ".join(argv)
        print(f"{line:<48}{statistics.median(times):>10.3f}{max(times):>10.3f}")
        if statistics.median(times) > TARGET_S:
            over.append(line)
    print(f"target: under {TARGET_S} s each (median); " + (f"over: {', '.join(over)}" if over else "all under"))


if __name__ == "__main__":
    main()
