"""The middle lessons' figures (course_lib.ui.figures_middle): a schedule chart says the costs it was simulated
with, so two charts of one schedule cannot disagree unseen, and its microbatch labels never overlap."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.parallel.schedule_sim import simulate  # noqa: E402
from course_lib.parallel.schedules import Costs, generate  # noqa: E402
from course_lib.ui.figures_middle import plot_schedule, plot_schedules, schedule_costs  # noqa: E402

COSTS = Costs(1, 1, 1)  # lesson 05's: a forward 1, a backward 2 (B 1 + W 1)


def simulated(schedule, p=4, m=8, chunks=1, costs=COSTS):
    return simulate(generate(schedule, p, m, chunks, costs=costs), costs)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_a_chart_reads_its_costs_from_the_simulation_and_says_them():
    assert schedule_costs(simulated("1f1b")) == {"F": 1, "B": 2}
    assert schedule_costs(simulated("zb-h1")) == {"F": 1, "B": 1, "W": 1}
    assert schedule_costs(simulated("interleaved", chunks=2)) == {"F": 1, "B": 2}  # per stage, not per chunk
    assert schedule_costs(simulated("1f1b", costs=Costs())) == {"F": 1, "B": 1}
    label = plot_schedule(simulated("1f1b")).axes[0].get_xlabel()
    assert "F = 1, B = 2 (the whole backward, W inside B)" in label


def test_one_cost_model_gives_1f1b_one_length_whether_or_not_w_is_split_off():
    one, zb = simulated("1f1b"), simulated("zb-h1")
    assert one.makespan == (8 + 4 - 1) * 3  # (m + p - 1)(F + B + W)
    assert zb.makespan < one.makespan


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "interleaved", "1f1b"])
def test_microbatch_labels_do_not_overlap(schedule):
    sims = {"1f1b": simulated("1f1b"), schedule: simulated(schedule, chunks=2 if schedule == "interleaved" else 1)}
    fig = plot_schedules({"1F1B": sims["1f1b"], schedule: sims[schedule]}, xmax=sims["1f1b"].makespan)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert boxes, "no microbatch label drawn"
        by_row: dict = {}
        for box in boxes:
            by_row.setdefault(round(box.y0), []).append(box)
        for row in by_row.values():
            row.sort(key=lambda b: b.x0)
            assert all(a.x1 <= b.x0 + 0.5 for a, b in zip(row, row[1:], strict=False))
