"""Step time of our tensor parallelism (and TP with sequence parallelism) against PyTorch's DTensor TP, on the same
ranks and model.

Each scheme trains the tiny GPT for ``--steps`` steps on ``--world-size`` ranks that form one tensor-parallel group
(gloo on CPU, NCCL on GPUs), every rank on the whole ``--batch``, ``--repeats`` launches each, interleaved. Ours is
``course_lib.parallel.tensor.train_tensor_parallel`` (Megatron's f/g operators, vocabulary-parallel embedding, head
and cross-entropy), PyTorch's ``course_lib.parallel.production.train_dtensor_tp`` (``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``, and ``SequenceParallel`` LayerNorms under SP; embedding, head and loss
replicated). Step times are measured as in ``dp_zero.py``: on each rank from the first start to the last end of the
step's timeline events, the step's time that of its slowest rank, the median over the steps after ``--warmup`` of
all launches. The bytes are what rank 0 sends per step by our ledger (PyTorch's collectives bypass it). Ours runs
with ``measure_memory=False``, as PyTorch's loop has no memory meter. Under SP, PyTorch's is timed a second time with
``reduce_grads=True`` (its ``Partial`` LayerNorm gradients all-reduced once in backward instead of lazily in every
optimizer op that reads them; see :func:`course_lib.parallel.production.train_dtensor_tp`), the ratio in parentheses.

    .venv/bin/python benchmarks/tp.py --world-size 4 --steps 10 --warmup 3
"""

from __future__ import annotations

from dp_zero import benchmark_parser, check_timing_arguments, mean_losses, sent_bytes, time_interleaved

from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.production import train_dtensor_tp
from course_lib.parallel.tensor import check_tensor_parallel, train_tensor_parallel
from course_lib.runtime import launch

ROW = "{:<42} {:>8} {:>8} {:>16} {:>11}"


def main() -> None:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0], "the tensor-parallel degree", "global batch (sequences); every rank sees all of it"
    )
    args = parser.parse_args()
    check_timing_arguments(parser, args)
    n = args.world_size
    cfg, train = GPTConfig(layers=args.layers, d_model=args.d_model), TrainConfig(args.steps, args.batch)
    try:
        check_tensor_parallel(cfg, n, sp=True)
    except ValueError as exc:
        parser.error(str(exc))
    timed = range(args.warmup, args.steps)
    print(f"{n} ranks ({launch.resolve_backend('auto', n)}), {cfg}, batch {train.batch}, median of steps {timed}")
    print(ROW.format("scheme", "step ms", "ours/pt", "bytes/rank/step", "max|dloss|"))
    for sp in (False, True):
        name = "TP + SP" if sp else "TP"
        theirs, ours = f"PyTorch DTensor {name}", f"ours: {name}"
        runs = {
            theirs: (train_dtensor_tp, {"sp": sp}),
            ours: (train_tensor_parallel, {"sp": sp, "measure_memory": False}),
        }
        if sp:  # PyTorch's again, its Partial LayerNorm gradients all-reduced once in backward, not in the optimizer
            runs[f"{theirs}, reduce_grads"] = (train_dtensor_tp, {"sp": sp, "reduce_grads": True})
        ms, last = time_interleaved(runs, n, cfg, train, args.repeats, timed)
        losses = zip(mean_losses(last[ours]), mean_losses(last[theirs]), strict=True)
        print(ROW.format(theirs, f"{ms[theirs]:.1f}", "", "(not in ledger)", "").rstrip())
        for label in runs:
            if label.startswith(f"{theirs},"):  # a PyTorch variant: its time against ours
                ratio = f"{ms[ours] / ms[label]:.2f}x"
                print(ROW.format(label, f"{ms[label]:.1f}", f"({ratio})", "(not in ledger)", "").rstrip())
        print(
            ROW.format(
                ours,
                f"{ms[ours]:.1f}",
                f"{ms[ours] / ms[theirs]:.2f}x",
                f"{sent_bytes(last[ours], timed[-1]):,.0f}",
                f"{max(abs(a - b) for a, b in losses):.1e}",
            )
        )


if __name__ == "__main__":
    main()
