"""Interactive explorers for the notebooks (ipywidgets): each redraws a course figure as its controls move.

Every control shows its whole label, a control that cannot change the figure in the current state is disabled, and
a slider offers the value the notebook asks for as one of its stops (a browser slider shows only its stops: a log
slider stepping 0.05 in the exponent would move 7.5 to 10^0.9 = 7.94 and send that back to the kernel).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib.model.formulas import model_state_formula
from course_lib.ui.figures_middle import plot_schedule
from course_lib.ui.plots import MEMORY_COLORS, ZERO_STAGES, byte_unit, plot_zero_memory

if TYPE_CHECKING:
    from course_lib.parallel.schedules import Costs

# Room for the longest label ("microbatches m", "GPUs per node") before every control, so that the controls line up.
LABEL_STYLE = {"description_width": "8.5em"}
SLIDER_LAYOUT = {"width": "30em"}
ROUND_MANTISSAS = (1, 1.5, 2, 3, 5, 7.5)
STAGE_NAMES = [name.split("\n")[0] for name in ZERO_STAGES.values()]


def _stops(values: Iterable[float], value: float) -> list[tuple[str, float]]:
    """(label, value) options for a :class:`~ipywidgets.SelectionSlider`: ``values`` and ``value``, in order."""
    return [(f"{x:g}", x) for x in sorted({*values, value})]


def billions_slider(value: float, lowest: int = 0, highest: int = 3) -> widgets.SelectionSlider:
    """A slider over round parameter counts in billions, 1, 1.5, 2, 3, 5 and 7.5 times each power of ten from
    10^lowest to 10^highest, with ``value`` one of its stops; its value changes when it is released."""
    rounds = [m * 10**k if k >= 0 else m / 10**-k for k in range(lowest, highest + 1) for m in ROUND_MANTISSAS]
    return widgets.SelectionSlider(
        options=_stops([x for x in rounds if x <= 10**highest], value),
        value=value,
        description="Ψ (billions)",
        continuous_update=False,
        style=LABEL_STYLE,
        layout=SLIDER_LAYOUT,
    )


def zero_totals(params: float, dp: int, precision: str = "mixed") -> tuple[list[float], str]:
    """Model-state memory per device of DP and ZeRO stages 1-3, in the unit :func:`plot_zero_memory` draws them
    in (the largest total's decimal unit), with that unit's name."""
    totals = [sum(model_state_formula(params, precision, zero=stage, dp=dp).values()) for stage in ZERO_STAGES]
    scale, unit = byte_unit(max(totals))
    return [total / scale for total in totals], unit


def zero_memory_explorer(params: float = 7.5e9, dp: int = 64, precision: str = "mixed") -> widgets.interactive:
    """Sliders for the parameter count and the data-parallel degree, redrawing model-state memory per device for
    each ZeRO stage and printing the totals the bars show (defaults: the ZeRO paper's Figure 1, 7.5B parameters
    on 64 devices). ``result`` is the figure drawn."""

    def draw(params_billions: float, dp: int, precision: str) -> plt.Figure:
        fig = plot_zero_memory(params_billions * 1e9, dp, precision)
        plt.show()
        totals, unit = zero_totals(params_billions * 1e9, dp, precision)
        shown = ", ".join(f"{name} {total:.1f}" for name, total in zip(STAGE_NAMES, totals, strict=True))
        print(f"model states per device ({unit}): {shown}")
        return fig

    return widgets.interactive(
        draw,
        params_billions=billions_slider(params / 1e9),
        dp=widgets.SelectionSlider(
            options=_stops([2**k for k in range(11)], dp),
            value=dp,
            description="N (devices)",
            continuous_update=False,
            style=LABEL_STYLE,
            layout=SLIDER_LAYOUT,
        ),
        # ipywidgets lays toggle buttons out under their label; the class of the other controls puts them beside it.
        precision=widgets.ToggleButtons(
            options=["mixed", "fp32"],
            value=precision,
            description="precision",
            style={**LABEL_STYLE, "button_width": "7em"},
        ).add_class("widget-inline-hbox"),
    )


def schedule_explorer(
    schedule: str = "1f1b", stages: int = 4, microbatches: int = 8, costs: Costs | None = None
) -> widgets.interactive:
    """Pick a schedule, the number of stages, microbatches and chunks, and the cost of F, B and W: the simulated
    timeline and its bubble are redrawn beside the paper's formula. Chunks are enabled for the interleaved schedule
    only (zb-v and dualpipev fix 2 per rank, in a V); W stays enabled for all, since a schedule that does not split
    the backward runs W inside B (B costs B + W). The sliders start at ``costs``, by default lesson 05's: F 1, B 1
    and W 1 (a whole backward twice a forward). ``result`` is the figure drawn, None if the sizes do not suit the
    schedule."""
    from course_lib.parallel.schedule_sim import simulate
    from course_lib.parallel.schedules import SCHEDULES, Costs, bubble_formula, formula_text, generate

    start = costs or Costs(1.0, 1.0, 1.0)

    def draw(
        schedule: str, stages: int, microbatches: int, chunks: int, f: float, b: float, w: float
    ) -> plt.Figure | None:
        chunks = chunks if schedule == "interleaved" else 1
        try:
            tables = generate(schedule, stages, microbatches, chunks, Costs(f, b, w))
        except ValueError as err:
            print(err)
            return None
        sim = simulate(tables, Costs(f, b, w))
        fig = plot_schedule(
            sim, title=f"{schedule}, p={stages}, m={microbatches}" + (f", v={chunks}" if chunks > 1 else "")
        )
        plt.show()
        formula = bubble_formula(schedule, stages, microbatches, chunks, Costs(f, b, w))
        print(
            f"bubble {sim.bubble_fraction:.4f}; the paper's {formula_text(formula, schedule)}; "
            f"peak microbatches in flight per rank: {sim.peak_inflight}"
        )
        return fig

    slider = dict(continuous_update=False, style=LABEL_STYLE, layout=SLIDER_LAYOUT)
    choice = widgets.Dropdown(options=SCHEDULES, value=schedule, description="schedule", style=LABEL_STYLE)
    chunks = widgets.IntSlider(value=2, min=2, max=4, description="chunks v", **slider)
    widgets.dlink((choice, "value"), (chunks, "disabled"), lambda name: name != "interleaved")
    return widgets.interactive(
        draw,
        schedule=choice,
        stages=widgets.IntSlider(value=stages, min=1, max=8, description="stages p", **slider),
        microbatches=widgets.IntSlider(value=microbatches, min=1, max=16, description="microbatches m", **slider),
        chunks=chunks,
        f=widgets.FloatSlider(value=start.f, min=0.25, max=3, step=0.25, description="F cost", **slider),
        b=widgets.FloatSlider(value=start.b, min=0.25, max=3, step=0.25, description="B cost", **slider),
        w=widgets.FloatSlider(
            value=start.w,
            min=0.0,
            max=3,
            step=0.25,
            description="W cost",
            tooltip="the weight-gradient pass: its own action in zb-h1, zb-h2, zb-v and dualpipev, part of B in "
            "the other schedules",
            **slider,
        ),
    )


def _plot_plan(result) -> plt.Figure:
    """The chosen layout and the next fitting ones: per GPU, params, grads, optimizer and activations stacked
    (:func:`course_lib.model.formulas.memory_formula`), the GPU's memory as a dotted line."""
    from course_lib.planner.layouts import describe

    shown = [result] + [c for c in result.candidates if c.fits and describe(c) != describe(result)][:2]
    scale, unit = byte_unit(max(result.gpu_mem_bytes, *(c.memory_per_gpu_bytes for c in shown)))
    fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
    for x, c in enumerate(shown):
        bottom = 0.0
        for cat, color in MEMORY_COLORS.items():
            ax.bar(x, c.memory[cat] / scale, 0.6, bottom=bottom, color=color, label=cat if x == 0 else None)
            bottom += c.memory[cat] / scale
    ax.axhline(
        result.gpu_mem_bytes / scale, color="black", ls=":", label=f"one GPU ({result.gpu_mem_bytes / 1e9:g} GB)"
    )
    labels = [describe(c).replace(", ", "\n") + ("\n(chosen)" if i == 0 else "") for i, c in enumerate(shown)]
    ax.set_xticks(range(len(shown)), labels, fontsize=8)
    ax.set_ylabel(f"bytes per GPU ({unit})")
    ax.set_title(f"{result.model.name} on {result.gpus} GPUs: {describe(result)}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


def planner_form(
    preset: str = "gpt3-175b", gpus: int = 1536, gpus_per_node: int = 8, gpu_mem_gb: float = 80
) -> widgets.interactive:
    """Pick a model (a preset, or a parameter count alone), the GPUs, GPUs per node and memory per GPU: the
    planner's choice (:func:`course_lib.planner.search.plan`) is printed with its reasons, beside memory bars of the
    chosen layout and the next fitting ones. The parameter count is enabled when the model is "parameter count" only.
    ``result`` is the figure drawn, None if the planner refuses the inputs (if nothing fits, say; it prints why)."""
    from course_lib.planner.layouts import describe
    from course_lib.planner.presets import PRESETS
    from course_lib.planner.search import plan

    def draw(
        model: str, params_billions: float, gpus: int, gpus_per_node: int, gpu_mem_gb: float, no_tp_pp: bool
    ) -> plt.Figure | None:
        try:
            result = plan(
                model if model in PRESETS else params_billions * 1e9,
                gpus,
                gpus_per_node,
                gpu_mem_gb * 1e9,
                no_model_parallel=no_tp_pp,
            )
        except ValueError as err:
            print(err)
            return None
        print(
            f"{describe(result)}, {result.microbatches} microbatches; {result.memory_per_gpu_bytes / 1e9:.1f} GB "
            f"per GPU; bubble {result.bubble_fraction:.1%}; estimated step {result.step_time_s:.3g} s"
        )
        fig = _plot_plan(result)
        plt.show()
        for reason in result.reasons:
            print("-", reason)
        return fig

    labels = dict(style=LABEL_STYLE)
    model = widgets.Dropdown(options=[*PRESETS, "parameter count"], value=preset, description="model", **labels)
    params_billions = billions_slider(30, lowest=-1)
    widgets.dlink((model, "value"), (params_billions, "disabled"), lambda name: name in PRESETS)
    return widgets.interactive(
        draw,
        model=model,
        params_billions=params_billions,
        gpus=widgets.BoundedIntText(value=gpus, min=1, max=65536, description="GPUs", **labels),
        gpus_per_node=widgets.BoundedIntText(value=gpus_per_node, min=1, max=64, description="GPUs per node", **labels),
        gpu_mem_gb=widgets.BoundedFloatText(value=gpu_mem_gb, min=1, max=1024, description="GB per GPU", **labels),
        no_tp_pp=widgets.Checkbox(
            value=False, description="no TP/PP (DP, ZeRO, FSDP only)", layout={"width": "auto"}, **labels
        ),
    )
