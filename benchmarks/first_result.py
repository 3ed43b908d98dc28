"""Time to the first result, as a new user meets it: a command line from a cold start, and a notebook's first launch.

* ``run dp --world-size 4 --steps 1`` and ``run single --steps 5``, each a fresh ``python -m course_lib`` process
  (imports, the rank server's start, the ranks, the one-device reference, the report). Target: under 3 s for dp.
* A notebook: a kernel runs an import cell (``from course_lib import launch``), then at once a cell that launches 4
  ranks; the time of that second cell is the first launch a student waits for. Target: under 2 s.

Each is measured ``--repeats`` times; the median and the worst are printed, with the floor under the command line:
a fresh interpreter importing ``torch`` and ``torch._dynamo``, which the rank server must finish before it can fork
the first rank (a rank imports the compiler as soon as it builds a torch optimizer or enters a dispatch mode such as
the memory meter, so the server imports it once for all ranks). On 2 cores that floor is about 2.7 s, which leaves
the 3 s target for ``run dp`` a few tenths of a second of room; getting under it would take patching torch's lazy
compiler import everywhere it is used, which the course does not do.

    .venv/bin/python benchmarks/first_result.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import nbformat
from nbclient import NotebookClient

COMMANDS = {
    "run dp --world-size 4 --steps 1": 3.0,
    "run single --steps 5": None,
}
NOTEBOOK_TARGET_S = 2.0
LAUNCH_CELL = """import time
import torch, torch.distributed as dist

def rank_value():
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t)
    return t.item()

started = time.perf_counter()
assert list(launch.run(rank_value, 4)) == [6.0] * 4
first_launch_s = time.perf_counter() - started
print(first_launch_s)"""


def time_command(command: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "course_lib", *command.split()], check=True, capture_output=True)
    return time.perf_counter() - started


def time_import_floor() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, torch._dynamo"], check=True)
    return time.perf_counter() - started


def time_notebook_first_launch() -> float:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from course_lib import launch"), nbformat.v4.new_code_cell(LAUNCH_CELL)]
    NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    return float(nb.cells[1].outputs[0]["text"])


def report(label: str, times: list[float], target: float | None) -> None:
    verdict = (
        "" if target is None else f"  target < {target:g} s: {'met' if statistics.median(times) < target else 'MISSED'}"
    )
    print(f"{label:<40} median {statistics.median(times):6.2f} s   worst {max(times):6.2f} s{verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    report("floor: import torch, torch._dynamo", [time_import_floor() for _ in range(args.repeats)], None)
    for command, target in COMMANDS.items():
        report(f"course-lib {command}", [time_command(command) for _ in range(args.repeats)], target)
    report(
        "notebook: first launch of 4 ranks",
        [time_notebook_first_launch() for _ in range(args.repeats)],
        NOTEBOOK_TARGET_S,
    )


if __name__ == "__main__":
    main()
