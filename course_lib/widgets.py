"""Interactive explorers for the notebooks (ipywidgets): each redraws a course figure as its sliders move."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib.plots import plot_zero_memory


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
