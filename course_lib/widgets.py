"""Interactive explorers for the notebooks (ipywidgets): each redraws a course figure as its sliders move."""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt

from course_lib.plots import MEMORY_COLORS, byte_unit, plot_schedule, plot_zero_memory


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


def _plot_plan(result) -> plt.Figure:
    """The chosen layout and the next fitting ones: per GPU, params, grads, optimizer and activations stacked
    (:func:`course_lib.memory.memory_formula`), the GPU's memory as a dotted line."""
    from course_lib.plan import describe

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
) -> widgets.Widget:
    """Pick a model (a preset, or a parameter count alone), the GPUs, GPUs per node and memory per GPU: the
    planner's choice (:func:`course_lib.plan.plan`) is printed with its reasons, beside memory bars of the chosen
    layout and the next fitting ones."""
    from course_lib.plan import PRESETS, describe, plan

    def draw(
        model: str, params_billions: float, gpus: int, gpus_per_node: int, gpu_mem_gb: float, no_tp_pp: bool
    ) -> None:
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
            return
        print(
            f"{describe(result)}, {result.microbatches} microbatches; {result.memory_per_gpu_bytes / 1e9:.1f} GB "
            f"per GPU; bubble {result.bubble_fraction:.1%}; estimated step {result.step_time_s:.3g} s"
        )
        _plot_plan(result)
        plt.show()
        for reason in result.reasons:
            print("-", reason)

    wide = dict(style={"description_width": "initial"})
    return widgets.interactive(
        draw,
        model=widgets.Dropdown(options=[*PRESETS, "parameter count"], value=preset, description="model"),
        params_billions=widgets.FloatLogSlider(
            value=30, base=10, min=-1, max=3, step=0.05, description="Ψ (billions)", continuous_update=False
        ),
        gpus=widgets.BoundedIntText(value=gpus, min=1, max=65536, description="GPUs", **wide),
        gpus_per_node=widgets.BoundedIntText(value=gpus_per_node, min=1, max=64, description="GPUs per node", **wide),
        gpu_mem_gb=widgets.BoundedFloatText(value=gpu_mem_gb, min=1, max=1024, description="GB per GPU", **wide),
        no_tp_pp=widgets.Checkbox(value=False, description="no TP/PP (DP, ZeRO, FSDP only)"),
    )
