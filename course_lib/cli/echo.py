"""What ``run`` says about itself: the scheme's settings right under the first line, each rank's place in the
layout, a pipeline's measured bubble beside its plan's, and, last, the verdict against one device with the
tolerances of the run's dtype and precision (:func:`course_lib.harness.verdict`)."""

from __future__ import annotations

SHOWN_PER_LINE = 4  # ranks per line of the layout

# How a setting reads, where its name alone would not say it (the others print as "name value").
WORDS = {
    "async_tp": lambda on: "async TP" if on else "TP's collectives not overlapped",
    "sp": lambda on: "sequence parallel" if on else "no sequence parallelism",
    "kv": lambda mode: f"K/V by {mode}",
    "overlap": lambda on: "communication overlapped with backward" if on else "communication after backward",
    "per_parameter": lambda on: "one all-reduce per gradient" if on else None,
    "bucket_mb": lambda mb: "one gradient bucket" if mb is None else f"gradient buckets of {mb:g} MB",
    "zero": lambda stage: f"ZeRO-{stage}",
    "reshard_after_forward": lambda on: "parameters freed after forward" if on else "parameters kept after forward",
    "grad_accum": lambda k: f"{k} micro-batches accumulated" if k > 1 else None,
    "stage_layers": lambda counts: f"stages of {', '.join(map(str, counts))} layers" if counts else None,
    "measure_memory": lambda on: None,
    "model": lambda factory: None,
}


def settings_line(scheme: str, settings: dict) -> str:
    """The scheme's settings in words, defaults included: what runs, not only what was typed."""
    parts = [WORDS[k](v) if k in WORDS else f"{k.replace('_', ' ')} {v}" for k, v in settings.items()]
    shown = [part for part in parts if part]
    return f"  {scheme}: " + (", ".join(shown) if shown else "no settings")


def layout_lines(report: dict) -> list[str]:
    """Each rank's coordinates on the mesh (``tp1 pp0 dp0``), a few ranks a line; an axis of size 1 (every rank at
    0 on it) is left out."""
    ranks = report["ranks"]
    axes = [axis for axis in ranks[0]["coords"] if any(r["coords"][axis] for r in ranks)]
    if not axes:
        return []
    cells = [f"rank {r['rank']}: " + " ".join(f"{axis}{r['coords'][axis]}" for axis in axes) for r in ranks]
    rows = [cells[i : i + SHOWN_PER_LINE] for i in range(0, len(cells), SHOWN_PER_LINE)]
    return ["  layout  " + "   ".join(row) if i == 0 else "          " + "   ".join(row) for i, row in enumerate(rows)]


def bubble_line(report: dict) -> str | None:
    """A pipeline's bubble: its schedule's plan and the paper's formula beside the one measured in the last step."""
    pipe = report.get("pipeline")
    if pipe is None or "measured_bubble_fraction" not in pipe:
        return None
    return (
        f"  bubble  planned {pipe['planned_bubble_fraction']:.1%} (the paper's formula "
        f"{pipe['formula_bubble_fraction']:.1%}), measured {pipe['measured_bubble_fraction']:.1%} on this machine's "
        "clock, where a stage waiting for a transfer counts as idle"
    )


def verdict_line(report: dict) -> str:
    """The last line: does the run match one device, each measure beside its tolerance, and whose tolerance."""
    v = report["verdict"]
    measured = ", ".join(
        f"{v[k]['measure']} {v[k]['value']:.2g} {'<=' if v[k]['value'] <= v[k]['tolerance'] else '>'} "
        f"{v[k]['tolerance']:.2g}"
        for k in ("loss", "params")
    )
    if "precision" in report:
        from course_lib.model.precision import DP_TOLERANCE

        whose = (
            f"{report['precision']['convention']} precision: the loss within {DP_TOLERANCE:.0%} of itself, the "
            f"parameters as far as {report['precision']['half']} moves one device from fp32"
        )
    else:
        whose = f"{report['dtype']}'s tolerances"
    return f"matches one device: {'yes' if v['matches'] else 'NO'} ({measured}; {whose})"
