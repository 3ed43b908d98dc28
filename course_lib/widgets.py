"""Interactive explorers for the notebooks (ipywidgets): each redraws a course figure as its sliders move."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib.plots import plot_schedule, plot_zero_memory


def zero_memory_explorer(params: float = 7.5e9, dp: int = 64, precision: str = "mixed") -> widgets.Widget:
    """Sliders for the parameter count and the data-parallel degree, redrawing model-state memory per device for
    each ZeRO stage (defaults: the ZeRO paper's Figure 1, 7.5B parameters on 64 devices)."""

    def draw(params_billions: float, dp: int, precision: str) -> None:
        plot_zero_memory(params_billions * 1e9, dp, precision)
        plt.show()

    return widgets.interactive(
        draw,
        params_billions=widgets.FloatLogSlider(
            value=params / 1e9, base=10, min=0, max=3, step=0.05, description="Ψ (billions)", readout_format=".3g"
        ),
        dp=widgets.SelectionSlider(options=[2**k for k in range(11)], value=dp, description="N (devices)"),
        precision=widgets.ToggleButtons(options=["mixed", "fp32"], value=precision, description="precision"),
    )


def schedule_explorer(schedule: str = "1f1b", stages: int = 4, microbatches: int = 8) -> widgets.Widget:
    """Pick a schedule, the number of stages, microbatches and chunks, and the cost of F, B and W: the simulated
    timeline and its bubble are redrawn beside the paper's formula."""
    from course_lib.parallel.schedules import Costs, bubble_formula, generate, simulate

    def draw(schedule: str, stages: int, microbatches: int, chunks: int, f: float, b: float, w: float) -> None:
        chunks = chunks if schedule == "interleaved" else 1
        try:
            tables = generate(schedule, stages, microbatches, chunks, Costs(f, b, w))
        except ValueError as err:
            print(err)
            return
        sim = simulate(tables, Costs(f, b, w))
        plot_schedule(sim, title=f"{schedule}, p={stages}, m={microbatches}" + (f", v={chunks}" if chunks > 1 else ""))
        plt.show()
        formula = bubble_formula(schedule, stages, microbatches, chunks, Costs(f, b, w))
        print(
            f"bubble {sim.bubble_fraction:.4f}; the paper's formula: {formula:.4f}; "
            f"peak microbatches in flight per rank: {sim.peak_inflight}"
        )

    slider = dict(continuous_update=False)
    return widgets.interactive(
        draw,
        schedule=widgets.Dropdown(options=["gpipe", "1f1b", "interleaved", "zb-h1"], value=schedule),
        stages=widgets.IntSlider(value=stages, min=1, max=8, description="stages p", **slider),
        microbatches=widgets.IntSlider(value=microbatches, min=1, max=16, description="microbatches m", **slider),
        chunks=widgets.IntSlider(value=2, min=2, max=4, description="chunks v", **slider),
        f=widgets.FloatSlider(value=1.0, min=0.25, max=3, step=0.25, description="F cost", **slider),
        b=widgets.FloatSlider(value=1.0, min=0.25, max=3, step=0.25, description="B cost", **slider),
        w=widgets.FloatSlider(value=0.0, min=0.0, max=3, step=0.25, description="W cost", **slider),
    )
