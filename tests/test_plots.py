"""The figures carry labels with units and one row or bar per rank."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib.models import TrainConfig  # noqa: E402
from course_lib.plots import byte_unit, plot_comm, plot_memory, plot_timeline  # noqa: E402
from course_lib.schemes import run_scheme  # noqa: E402


def test_byte_units_are_decimal():
    assert byte_unit(112e9) == (1e9, "GB") and byte_unit(2.5e6) == (1e6, "MB") and byte_unit(12) == (1.0, "B")


def test_figures_of_a_real_run_are_labelled():
    run = run_scheme("dp", 2, train=TrainConfig(steps=2))
    timeline = plot_timeline(run.result.events).axes[0]
    assert timeline.get_xlabel() == "wall clock: time (ms) from the first event shown"
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["rank 0", "rank 1"]
    assert {t.get_text() for t in timeline.get_legend().get_texts()} >= {"forward", "backward", "optimizer", "comm"}

    memory = plot_memory([r["memory"] for r in run.report["ranks"]], run.predicted_memory).axes[0]
    assert memory.get_ylabel() == "bytes (MB)"
    assert "predicted" in memory.get_title()

    comm = plot_comm(run.result.comm[0]).axes[0]
    assert comm.get_ylabel() == "bytes sent (kB)" and comm.get_xlabel() == "training step"
    heights = [p.get_height() for p in comm.patches]
    assert heights == [4 * run.report["params"] / 1e3] * 2


def test_zero_memory_figure_shows_the_papers_four_totals():
    from course_lib.plots import plot_zero_memory

    ax = plot_zero_memory(7.5e9, 64).axes[0]
    assert [t.get_text() for t in ax.texts] == ["120.0", "31.4", "16.6", "1.9"]
    assert ax.get_ylabel() == "model states per device (GB)"


def test_zero_memory_explorer_redraws_for_its_sliders():
    from course_lib.widgets import zero_memory_explorer

    explorer = zero_memory_explorer(params=7.5e9, dp=64)
    sliders = {w.description: w for w in explorer.children if hasattr(w, "description")}
    assert sliders["N (devices)"].value == 64 and abs(sliders["Ψ (billions)"].value - 7.5) < 1e-9
    sliders["N (devices)"].value = 8  # moving a slider redraws
    assert plt.gcf().axes[0].get_title() == "7.5B parameters, mixed Adam, 8 data-parallel devices"


def test_both_clocks_side_by_side_use_their_own_units():
    from course_lib.plots import plot_clocks

    run = run_scheme("dp", 2, train=TrainConfig(steps=2), hardware="h100", gpus_per_node=1)
    wall, modeled = plot_clocks(run.result.events, run.modeled).axes
    assert wall.get_xlabel() == "wall clock: time (ms) from the first event shown"
    assert modeled.get_xlabel() == "modeled: h100, 1 GPU per node: time (µs) from the first event shown"


def test_schedule_explorer_redraws_with_its_bubble(capsys):
    from course_lib.widgets import schedule_explorer

    explorer = schedule_explorer("gpipe", stages=4, microbatches=8)
    controls = {w.description: w for w in explorer.children if hasattr(w, "description")}
    controls["microbatches m"].value = 4
    assert plt.gcf().axes[0].get_title() == "gpipe, p=4, m=4: bubble 42.9% of the time"
    controls["schedule"].value = "interleaved"
    assert "interleaved, p=4, m=4, v=2" in plt.gcf().axes[0].get_title()
    controls["microbatches m"].value = 3  # interleaving needs a multiple of p: said, not raised
    assert "3 microbatches is fewer than 4" in capsys.readouterr().out
