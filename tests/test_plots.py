"""The figures carry labels with units and one row or bar per rank."""

import matplotlib

matplotlib.use("Agg")

from course_lib.models import TrainConfig  # noqa: E402
from course_lib.plots import byte_unit, plot_comm, plot_memory, plot_timeline  # noqa: E402
from course_lib.schemes import run_scheme  # noqa: E402


def test_byte_units_are_decimal():
    assert byte_unit(112e9) == (1e9, "GB") and byte_unit(2.5e6) == (1e6, "MB") and byte_unit(12) == (1.0, "B")


def test_figures_of_a_real_run_are_labelled():
    run = run_scheme("dp", 2, train=TrainConfig(steps=2))
    timeline = plot_timeline(run.result.events).axes[0]
    assert timeline.get_xlabel() == "time since launch (ms)"
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["rank 0", "rank 1"]
    assert {t.get_text() for t in timeline.get_legend().get_texts()} >= {"forward", "backward", "optimizer", "comm"}

    memory = plot_memory([r["memory"] for r in run.report["ranks"]], run.predicted_memory).axes[0]
    assert memory.get_ylabel() == "bytes (MB)"
    assert "predicted" in memory.get_title()

    comm = plot_comm(run.result.comm[0]).axes[0]
    assert comm.get_ylabel() == "bytes sent (kB)" and comm.get_xlabel() == "training step"
    heights = [p.get_height() for p in comm.patches]
    assert heights == [4 * run.report["params"] / 1e3] * 2
