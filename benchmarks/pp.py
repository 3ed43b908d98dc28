"""Step time of our pipeline parallelism against PyTorch's ``torch.distributed.pipelining``, on the same ranks, model,
split and schedules.

Each scheme trains the tiny GPT for ``--steps`` steps on ``--world-size`` ranks that form one pipeline (gloo on CPU,
NCCL on GPUs), the global ``--batch`` cut into ``--microbatches``, ``--repeats`` launches each, interleaved. Ours is
``course_lib.parallel.pipeline.train_pipeline`` (our schedule tables, blocking receives and non-blocking sends
through our ledger), PyTorch's ``course_lib.parallel.production.train_torch_pipelining`` (``PipelineStage`` with
``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``); both run the same stage modules
(``build_stages``) and sum the tied embedding's gradient between the first and the last stage. For each of GPipe,
1F1B and interleaved 1F1B (``--chunks`` stages per rank; needs ``--layers`` >= world size x chunks and microbatches
a multiple of the world size) the table gives the step time, measured as in ``dp_zero.py``: on each rank from the
first start to the last end of the step's timeline events (ours: its transfers and compute; PyTorch's: each
microbatch's forward and backward and the optimizer, its transfers untimed), the step's time that of its slowest
rank, the median over the steps after ``--warmup`` of all launches. The bytes are what each rank sends in a step by
our ledger (first/middle/last rank; PyTorch's transfers bypass it). Ours runs with ``measure_memory=False``, as
PyTorch's loop has no memory meter.

    .venv/bin/python benchmarks/pp.py --world-size 4 --microbatches 8
"""

from __future__ import annotations

from dp_zero import benchmark_parser, check_timing_arguments, time_interleaved

from course_lib.ledgers import comm
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.pipeline import split_layers, train_pipeline
from course_lib.parallel.production import train_torch_pipelining
from course_lib.parallel.schedules import validate
from course_lib.runtime import launch

ROW = "{:<34} {:>8} {:>8} {:>28} {:>11}"
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}


def bytes_by_rank(result: launch.RunResult, step: int) -> list[float]:
    """Bytes each rank sent during ``step`` by our ledger."""
    return [
        sum(s["bytes"] for s in comm.summarize(r for r in records if r.tags.get("step") == step).values())
        for records in result.comm
    ]


def main() -> None:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0], "the pipeline depth (ranks)", "global batch (sequences), cut into microbatches"
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=2, help="stages per rank of the interleaved schedule")
    parser.set_defaults(layers=8, batch=32)
    args = parser.parse_args()
    check_timing_arguments(parser, args)
    n, m = args.world_size, args.microbatches
    if m < 1 or args.batch % m:
        parser.error(f"--batch {args.batch} does not split into --microbatches {m}")
    cfg, train = GPTConfig(layers=args.layers, d_model=args.d_model), TrainConfig(args.steps, args.batch)
    schedules = {"gpipe": 1, "1f1b": 1, "interleaved": args.chunks}
    try:
        for schedule, chunks in schedules.items():
            validate(schedule, n, m, chunks)
            split_layers(cfg.layers, n * chunks)
    except ValueError as exc:
        parser.error(str(exc))
    timed = range(args.warmup, args.steps)
    print(
        f"{n} ranks ({launch.resolve_backend('auto', n)}), {cfg}, batch {train.batch} in {m} microbatches, "
        f"median of steps {timed}"
    )
    print(ROW.format("scheme", "step ms", "ours/pt", "bytes/rank/step (0/mid/last)", "max|dloss|"))
    for schedule, chunks in schedules.items():
        name = NAMES[schedule] + (f", {chunks} chunks" if chunks > 1 else "")
        theirs, ours = f"PyTorch {name}", f"ours: {name}"
        options = {"schedule": schedule, "microbatches": m, "chunks": chunks}
        runs = {
            theirs: (train_torch_pipelining, options),
            ours: (train_pipeline, {**options, "measure_memory": False}),
        }
        ms, last = time_interleaved(runs, n, cfg, train, args.repeats, timed)
        sent = bytes_by_rank(last[ours], timed[-1])
        middle = f"{sent[1]:,.0f}/" if n > 2 else ""
        losses = zip(last[ours][-1]["losses"], last[theirs][-1]["losses"], strict=True)
        print(ROW.format(theirs, f"{ms[theirs]:.1f}", "", "(not in ledger)", "").rstrip())
        print(
            ROW.format(
                ours,
                f"{ms[ours]:.1f}",
                f"{ms[ours] / ms[theirs]:.2f}x",
                f"{sent[0]:,.0f}/{middle}{sent[-1]:,.0f}",
                f"{max(abs(a - b) for a, b in losses):.1e}",
            )
        )


if __name__ == "__main__":
    main()
