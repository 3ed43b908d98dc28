"""The figures carry labels with units and one row or bar per rank, say what their marks hold, and fit their
canvas."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from course_lib.harness import run_scheme  # noqa: E402
from course_lib.ledgers.comm import CommRecord  # noqa: E402
from course_lib.ledgers.trace import Event  # noqa: E402
from course_lib.model.config import TrainConfig  # noqa: E402
from course_lib.ui.plots import KIND_COLORS, byte_unit, plot_comm, plot_memory, plot_timeline
from course_lib.ui.run_figures import run_figures


@pytest.fixture(scope="module")
def dp_run():
    """Two data-parallel steps on 2 ranks, also replayed on a modeled H100 cluster (the tiny default model)."""
    return run_scheme("dp", 2, train=TrainConfig(steps=2), hardware="h100", gpus_per_node=1)


@pytest.fixture(scope="module")
def grid_run():
    """Two steps of a 2 x 2 x 2 grid on 8 ranks, also replayed on a modeled H100 cluster."""
    return run_scheme("3d", 8, train=TrainConfig(steps=2), hardware="h100")


@pytest.fixture(scope="module")
def dp_figures(dp_run):
    """The data-parallel run's figures, built once (building them costs more than reading them)."""
    return run_figures(dp_run)


@pytest.fixture(scope="module")
def grid_figures(grid_run):
    """The 3D run's figures, built once: the canvas check and the bytes-by-axis check read the same figures."""
    return run_figures(grid_run)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def fits(fig) -> bool:
    """Nothing drawn outside the canvas: titles, legends, notes and tick labels all inside it."""
    fig.canvas.draw()
    inside = fig.get_tightbbox(fig.canvas.get_renderer())
    width, height = fig.get_size_inches()
    return inside.x0 >= -0.01 and inside.y0 >= -0.01 and inside.x1 <= width + 0.01 and inside.y1 <= height + 0.01


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def idle_bars(ax) -> int:
    idle = to_hex(KIND_COLORS["idle"])
    return sum(to_hex(c.get_facecolor()[0]) == idle for c in ax.collections)


def test_byte_units_are_decimal():
    assert byte_unit(112e9) == (1e9, "GB") and byte_unit(2.5e6) == (1e6, "MB") and byte_unit(12) == (1.0, "B")


def test_figures_of_a_real_run_are_labelled(dp_run):
    timeline = plot_timeline(dp_run.result.events).axes[0]
    assert timeline.get_xlabel() == "wall clock: time (ms) from the first event shown"
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["rank 0", "rank 1"]
    assert {"forward", "backward", "optimizer"} <= set(legend_labels(timeline))

    memory = plot_memory([r["memory"] for r in dp_run.report["ranks"]], dp_run.predicted_memory).axes[0]
    assert memory.get_ylabel() == "bytes (MB)"
    assert "predicted" in memory.get_title()

    comm = plot_comm(dp_run.result.comm[0]).axes[0]
    assert comm.get_ylabel() == "bytes sent (kB)" and comm.get_xlabel() == "training step"
    heights = [p.get_height() for p in comm.patches]
    assert heights == [4 * dp_run.report["params"] / 1e3] * 2


def test_the_one_rank_memory_figure_fits_its_canvas():
    row = {"params": 439_808, "grads": 431_616, "optimizer": 863_332, "activations_peak": 2_637_828}
    assert fits(plot_memory([row | {"peak": 4_630_636}], [row], title="single_n1: memory per rank"))


def test_every_figure_of_a_run_fits_its_canvas(dp_figures, grid_figures):
    assert len(dp_figures) == len(grid_figures) == 4  # timeline, memory, comm and both clocks of each run
    for figures in (dp_figures, grid_figures):
        for name, fig in figures.items():
            assert fits(fig), name


def test_the_memory_peak_says_what_it_holds_beyond_the_bars(dp_run, dp_figures):
    ax = plot_memory([r["memory"] for r in dp_run.report["ranks"]], dp_run.predicted_memory).axes[0]
    peak = next(label for label in legend_labels(ax) if label.startswith("measured peak"))
    assert "temporaries" in peak and "gradients on their way back" in peak and "ZeRO-3" in peak

    ax = dp_figures["dp_n2_memory.png"].axes[0]
    peak = next(label for label in legend_labels(ax) if label.startswith("measured peak"))
    assert "gradients on their way back" in peak and "gathered" not in peak  # DP gathers nothing


def record(op: str, sent: float, step: int, group: str = "world") -> CommRecord:
    return CommRecord(op, group, 2, (0, 1), int(sent), sent, 0.0, 1.0, tags={"step": step})


def test_the_comm_legend_sits_beside_the_bars_and_zero_byte_calls_are_named_not_drawn():
    records = [
        record(op, sent, step) for step in (0, 1) for op, sent in (("send", 4e3), ("recv", 0.0), ("all_reduce", 2e3))
    ]
    fig = plot_comm(records)
    ax = fig.axes[0]
    assert legend_labels(ax) == ["send", "all_reduce"]
    assert len(ax.patches) == 4
    note = " ".join(t.get_text() for t in ax.texts).replace("\n", " ")
    assert "0 bytes sent: recv" in note and "sender" in note
    fig.canvas.draw()
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # beside the axes, over no bar


def test_a_3d_run_draws_each_ranks_bytes_by_axis_beside_the_prediction(grid_run, grid_figures):
    ax = grid_figures["3d_n8_comm.png"].axes[0]
    axes = legend_labels(ax)
    assert axes == ["tp", "pp", "embedding", "dp"]
    assert ax.get_ylabel() == "bytes sent (kB)"
    # Each rank's coordinates on the axes the run has (no cp0 without CP), two a line, so eight labels never touch.
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["rank 0\ndp0 pp0\ntp0", "rank 1\ndp0 pp0\ntp1"]
    assert ax.get_title().startswith("3d on 8 ranks: TP 2 x PP 2 x DP 2, 1f1b schedule with 4 microbatches: bytes")
    for rank, (row, predicted) in enumerate(zip(grid_run.report["ranks"], grid_run.predicted_comm, strict=True)):
        bars = [p for p in ax.patches if round(p.get_x() + p.get_width() / 2) == rank]
        solid = [1e3 * p.get_height() for p in bars if not p.get_hatch()]
        hatched = [1e3 * p.get_height() for p in bars if p.get_hatch()]
        assert solid == pytest.approx([row["comm_by_axis"].get(a, 0) for a in axes], rel=1e-12)
        assert hatched == pytest.approx([predicted.get(a, 0) for a in axes], rel=1e-12)


def test_the_wall_clock_draws_no_idle_and_says_what_a_collective_bar_holds(dp_run):
    ax = plot_timeline(dp_run.result.events).axes[0]
    assert idle_bars(ax) == 0  # a gap on the wall clock is waiting or untraced Python, not known to be idle
    assert "collective: issued → done,\nwaiting for peers included" in legend_labels(ax)
    assert "idle" not in " ".join(legend_labels(ax))
    assert [t.get_text() for t in ax.texts] == ["step 0", "step 1"]


def test_the_wall_clock_says_which_step_ran_under_the_memory_meter(dp_run):
    title = plot_timeline(dp_run.result.events, metered_step=1).axes[0].get_title()
    assert "step 1 ran under the memory meter, whose bookkeeping slows it (" in title and "; step 0: " in title
    assert "memory meter" not in plot_timeline(dp_run.result.events).axes[0].get_title()


def test_a_runs_timeline_shows_one_ordinary_step_and_says_so(dp_figures):
    ax = dp_figures["dp_n2_timeline.png"].axes[0]
    assert ax.get_title().startswith("dp on 2 ranks: what each rank did in step 0 (step 1 ran under the memory meter")
    assert [t.get_text() for t in ax.texts] == []  # one step: no step marks, and the metered step is not squeezed in


def test_where_no_formula_predicts_activations_the_figure_says_so():
    row = {"params": 4e5, "grads": 4e5, "optimizer": 8e5}
    ax = plot_memory([row | {"activations_peak": 2e6}], [row], labels=["rank 0"]).axes[0]
    assert [t.get_text() for t in ax.texts] == ["activations:\nnot\npredicted"]
    ax = plot_memory([row | {"activations_peak": 2e6}], [row | {"activations": 2e6}]).axes[0]
    assert len(ax.texts) == 0


def test_one_rank_without_collectives_gets_one_lane_and_no_idle():
    events = [
        Event(0, "forward", "forward", 0.0, 1.0, {"step": 0}),
        Event(0, "backward", "backward", 1.0, 2.0, {"step": 0}),
        Event(0, "optimizer", "optimizer", 2.5, 3.0, {"step": 0}),  # after untraced Python, not after waiting
    ]
    ax = plot_timeline([events]).axes[0]
    assert idle_bars(ax) == 0 and len(ax.collections) == 3
    assert all(c.get_paths()[0].get_extents().height == pytest.approx(0.7) for c in ax.collections)  # whole row
    assert "no rank made a collective" in ax.get_title() and "lower lane" not in ax.get_title()
    assert "memory meter" not in ax.get_title()


def test_both_clocks_side_by_side_use_their_own_units(dp_run):
    from course_lib.ui.plots import plot_clocks

    wall, modeled = plot_clocks(dp_run.result.events, dp_run.modeled, metered_step=1).axes
    assert wall.get_xlabel() == "wall clock: time (ms) from the first event shown"
    assert modeled.get_xlabel() == "modeled: h100, 1 GPU per node: time (µs) from the first event shown"
    assert "step 1 ran under the memory meter, whose bookkeeping slows it" in wall.get_title()
    assert "memory meter" not in modeled.get_title()  # the replay counts FLOPs, which the meter does not change
    assert "collective: data moving" in legend_labels(modeled) and "idle: waiting for\na collective" in legend_labels(
        modeled
    )


def test_the_modeled_clock_says_when_compute_is_too_thin_to_see(dp_run):
    modeled = dp_run.modeled
    ax = plot_timeline(modeled.events, clock="modeled: h100").axes[0]
    share = sum(r.compute_s for r in modeled.ranks) / sum(r.step_time_s for r in modeled.ranks)
    assert share < 0.02  # the tiny default model gives an H100 almost nothing to do
    assert "compute is" in ax.get_title() and "too thin to see" in ax.get_title()
    busy = [[Event(r, "forward", "forward", 0.0, 9.0), Event(r, "comm", "all_reduce", 9.0, 10.0)] for r in (0, 1)]
    assert "compute is" not in plot_timeline(busy, clock="modeled: h100").axes[0].get_title()


def test_zero_memory_figure_shows_the_papers_four_totals():
    from course_lib.ui.plots import plot_zero_memory

    ax = plot_zero_memory(7.5e9, 64).axes[0]
    assert [t.get_text() for t in ax.texts] == ["120.0", "31.4", "16.6", "1.9"]
    assert ax.get_ylabel() == "model states per device (GB)"


def test_zero_memory_explorer_redraws_for_its_sliders():
    from course_lib.ui.widgets import zero_memory_explorer

    explorer = zero_memory_explorer(params=7.5e9, dp=64)
    sliders = {w.description: w for w in explorer.children if hasattr(w, "description")}
    assert sliders["N (devices)"].value == 64 and abs(sliders["Ψ (billions)"].value - 7.5) < 1e-9
    sliders["N (devices)"].value = 8  # moving a slider redraws
    assert plt.gcf().axes[0].get_title() == "7.5B parameters, mixed Adam, 8 data-parallel devices"


def test_schedule_explorer_redraws_with_its_bubble(capsys):
    from course_lib.ui.widgets import schedule_explorer

    explorer = schedule_explorer("gpipe", stages=4, microbatches=8)
    controls = {w.description: w for w in explorer.children if hasattr(w, "description")}
    # It starts at lesson 05's costs: a whole backward (B + W) twice a forward.
    assert [controls[f"{part} cost"].value for part in "FBW"] == [1.0, 1.0, 1.0]
    controls["microbatches m"].value = 4
    assert plt.gcf().axes[0].get_title() == "gpipe, p=4, m=4: bubble 42.9% of the time"
    controls["schedule"].value = "interleaved"
    assert "interleaved, p=4, m=4, v=2" in plt.gcf().axes[0].get_title()
    controls["microbatches m"].value = 3  # interleaving needs a multiple of p: said, not raised
    assert "3 microbatches is fewer than 4" in capsys.readouterr().out


def test_the_checkpoint_timeline_draws_each_stall_and_write_and_sums_the_stalls(tmp_path):
    from course_lib.ui.plots import plot_checkpoint_timeline

    runs = {
        label: run_scheme(
            "dp",
            2,
            train=TrainConfig(steps=4),
            checkpoint_dir=tmp_path / label,
            checkpoint_every=2,
            checkpoint_async=label == "asynchronous",
        )
        for label in ("synchronous", "asynchronous")
    }
    fig = plot_checkpoint_timeline(runs)
    assert fits(fig)
    axes = fig.axes
    unit = axes[1].get_xlabel().rsplit("(", 1)[1].rstrip(")")  # ms, or s on a busy machine
    assert len(axes) == 2 and axes[1].get_xlabel() == f"wall clock on rank 0 since its first step ({unit})"
    factor = {"s": 1.0, "ms": 1e3}[unit]
    assert legend_labels(axes[0]) == [
        "a training step (its number)",
        "training stalled by a checkpoint",
        "checkpoint being written (its folder)",
    ]
    for ax, (label, run) in zip(axes, runs.items(), strict=True):
        saves = run.report["checkpoints"]["saves"][0]
        stall = sum(b - a for t in saves for a, b in [t["stall"], *([t["wait"]] if "wait" in t else [])])
        widths = {}
        for bars in ax.collections:  # one broken_barh per bar: the steps, the stalls, the writes
            widths.setdefault(to_hex(bars.get_facecolor()[0]), []).append(bars.get_paths()[0].get_extents().width)
        assert len(widths["#55a868"]) == len(saves) == 2  # one write per checkpoint
        assert sum(widths["#c44e52"]) == pytest.approx(stall * factor)
        assert ax.get_title().startswith(f"{label}: ") and f"stood still {stall * factor:.3g} {unit}" in ax.get_title()
