"""The notebooks' explorers without a browser: what their controls hold, which are disabled, and what they print and
draw (tests/test_browser.py checks the same in JupyterLab)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.parallel.schedule_sim import simulate  # noqa: E402
from course_lib.parallel.schedules import SCHEDULES, Costs, generate  # noqa: E402
from course_lib.ui.widgets import billions_slider, planner_form, schedule_explorer, zero_memory_explorer, zero_totals

FIGURE_ONE = ["120.0", "31.4", "16.6", "1.9"]  # the ZeRO paper's Figure 1: 7.5B parameters, 64 GPUs, mixed precision
STAGES = ["DP (baseline)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def controls(explorer) -> dict:
    """An explorer's controls by their description (the last child is the output)."""
    return {control.description: control for control in explorer.children[:-1]}


def printed(capsys) -> list[str]:
    """The lines printed since the last call, without the terminal codes that clear_output prints outside Jupyter."""
    return [line.replace("\x1b[2K", "") for line in capsys.readouterr().out.splitlines()]


def test_zero_explorer_opens_on_figure_one_and_prints_what_its_bars_show(capsys):
    explorer = zero_memory_explorer(params=7.5e9, dp=64)
    psi, devices, precision = controls(explorer).values()
    assert (psi.value, psi.label, devices.value, devices.label, precision.value) == (7.5, "7.5", 64, "64", "mixed")
    bars = [text.get_text() for text in explorer.result.axes[0].texts]
    assert bars == FIGURE_ONE
    line = "model states per device (GB): DP (baseline) 120.0, ZeRO-1 31.4, ZeRO-2 16.6, ZeRO-3 1.9"
    assert printed(capsys)[-1] == line

    psi.value = 15
    devices.value = 8
    bars = [text.get_text() for text in explorer.result.axes[0].texts]
    assert bars == ["240.0", "82.5", "56.2", "30.0"]
    assert printed(capsys)[-1].endswith(": " + ", ".join(f"{n} {b}" for n, b in zip(STAGES, bars, strict=True)))


def test_zero_explorer_offers_the_values_it_is_given_as_stops():
    psi, devices, _ = controls(zero_memory_explorer(params=1.3e9, dp=48)).values()
    assert (psi.value, psi.label, devices.value, devices.label) == (1.3, "1.3", 48, "48")
    assert [value for _, value in devices.options] == [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024]


def test_zero_totals_are_in_the_unit_of_the_largest():
    totals, unit = zero_totals(7.5e9, 64)
    assert ([f"{t:.1f}" for t in totals], unit) == (FIGURE_ONE, "GB")
    assert zero_totals(50e6, 4, "fp32") == ([800.0, 500.0, 350.0, 200.0], "MB")


def test_billions_slider_stops_are_round_and_exact():
    slider = billions_slider(7.5)
    assert [label for label, _ in slider.options][:7] == ["1", "1.5", "2", "3", "5", "7.5", "10"]
    assert slider.options[-1] == ("1000", 1000)
    assert not slider.continuous_update
    finer = billions_slider(30, lowest=-1)
    assert finer.options[:3] == (("0.1", 0.1), ("0.15", 0.15), ("0.2", 0.2)) and finer.value == 30
    values = [value for _, value in finer.options]
    assert values == sorted(set(values))


def test_schedule_explorer_enables_chunks_for_interleaved_only(capsys):
    explorer = schedule_explorer("1f1b", stages=4, microbatches=8)
    shown = controls(explorer)
    assert [(name, c.value) for name, c in shown.items()] == [
        ("schedule", "1f1b"),
        ("stages p", 4),
        ("microbatches m", 8),
        ("chunks v", 2),
        ("F cost", 1.0),
        ("B cost", 1.0),
        ("W cost", 1.0),  # lesson 05's costs: a whole backward (B + W) twice a forward
    ]
    assert [name for name, c in shown.items() if c.disabled] == ["chunks v"]
    assert printed(capsys)[-1].startswith("bubble 0.2727; the paper's formula: 0.2727;")
    for schedule in SCHEDULES:
        shown["schedule"].value = schedule
        assert shown["chunks v"].disabled == (schedule != "interleaved")
        assert not shown["W cost"].disabled
        title = explorer.result.axes[0].get_title()
        assert title.startswith(f"{schedule}, p=4, m=8" + (", v=2:" if schedule == "interleaved" else ":"))


def test_w_cost_moves_every_schedule():
    """Why W stays enabled: a schedule without W actions runs the weight gradient inside B."""
    for schedule in SCHEDULES:
        chunks = 2 if schedule == "interleaved" else 1
        spans = {
            simulate(generate(schedule, 4, 8, chunks, Costs(1, 1, w)), Costs(1, 1, w)).makespan for w in (0.0, 1.0)
        }
        assert len(spans) == 2, schedule


def test_schedule_explorer_prints_why_sizes_do_not_fit(capsys):
    explorer = schedule_explorer("interleaved", stages=4, microbatches=6)
    assert explorer.result is None
    assert "Use a multiple of 4." in printed(capsys)[-1]


def test_planner_form_enables_the_parameter_count_only_without_a_preset(capsys):
    explorer = planner_form("llama3-70b", gpus=512)
    shown = controls(explorer)
    assert (shown["model"].value, shown["GPUs"].value, shown["GPUs per node"].value) == ("llama3-70b", 512, 8)
    assert (shown["Ψ (billions)"].value, shown["Ψ (billions)"].label) == (30, "30")
    assert [name for name, c in shown.items() if c.disabled] == ["Ψ (billions)"]
    assert explorer.result.axes[0].get_title().startswith("llama3-70b on 512 GPUs")
    shown["model"].value = "parameter count"
    assert not shown["Ψ (billions)"].disabled
    assert any(line.startswith("- gpt-like-30b: 30.0B parameters") for line in printed(capsys))
