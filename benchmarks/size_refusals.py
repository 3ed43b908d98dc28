"""How fast the library refuses sizes nobody could run or plan (issue 37 item 3), in this process, after the imports:
a run larger than this machine's memory (the one-device reference by the tiny GPT's formula, built by nobody), a
seed torch cannot take, a parameter count beyond the formulas' bound, a cluster or a topology beyond the GPUs the
course models. Target: each well under a second (the command line adds its imports: ~1.5 s with torch on 2 cores).
Also the largest plan accepted, timed once (``--largest``, about 30 s on 2 cores), which sets the GPU bound.

    .venv/bin/python benchmarks/size_refusals.py [--largest]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from course_lib import harness
from course_lib.cluster.topology import MAX_GPUS, for_gpus, from_spec
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import memory_formula
from course_lib.planner.goodput import choose_interval
from course_lib.planner.search import plan

TARGET_S = 1.0
CASES: dict[str, Callable[[], object]] = {
    "run dp --layers 100000": lambda: harness.validate("dp", 4, GPTConfig(layers=100_000), TrainConfig(), {}),
    "run dp --hidden 100000000": lambda: harness.validate("dp", 4, GPTConfig(d_model=10**8), TrainConfig(), {}),
    "run dp --seq 100000": lambda: harness.validate("dp", 4, GPTConfig(seq=100_000), TrainConfig(), {}),
    "run dp --batch 10000000": lambda: harness.validate("dp", 4, GPTConfig(), TrainConfig(batch=10**7), {}),
    "run dp --seed 99999999999999999999999": lambda: TrainConfig(seed=99999999999999999999999),
    "memory --params 1e300": lambda: memory_formula(1e300),
    "plan --params 1e300 --gpus 8": lambda: plan(1e300, 8),
    "plan --gpus 100000000": lambda: plan(7e9, 10**8),
    "plan --gpus 10000000 (the old worst)": lambda: plan(7e9, 10**7),
    "goodput --gpus 100000000000": lambda: choose_interval("llama3-405b", 10**11, 1e9, 2e9, 600),
    "--topology h100-superpod:99999999999": lambda: from_spec("h100-superpod:99999999999"),
    "--topology tpu-v5p:99999x99999x99999": lambda: from_spec("tpu-v5p:99999x99999x99999"),
    "plan --topology tpu-v5p --gpus 1000000": lambda: for_gpus("tpu-v5p", 10**6),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--largest", action="store_true", help=f"also time a plan of Llama 3 405B on {MAX_GPUS} GPUs")
    args = parser.parse_args()
    print(f"{'refusal':<44}{'seconds':>10}  message")
    over = []
    for name, case in CASES.items():
        started = time.perf_counter()
        try:
            case()
            message = "NOT REFUSED"
        except ValueError as err:
            message = str(err)
        elapsed = time.perf_counter() - started
        print(f"{name:<44}{elapsed:>10.4f}  {message[:90]}")
        if elapsed > TARGET_S or message == "NOT REFUSED":
            over.append(name)
    print(f"target: refused in under {TARGET_S} s each; " + (f"not: {', '.join(over)}" if over else "all are"))
    if args.largest:
        started = time.perf_counter()
        plan("llama3-405b", MAX_GPUS, global_batch=MAX_GPUS)
        print(f"plan of llama3-405b on {MAX_GPUS:,} GPUs (the bound): {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
