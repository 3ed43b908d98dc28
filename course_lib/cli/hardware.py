"""``hardware``: the hardware profiles of the modeled clock, the published ones and those measured here, and the
topologies whose links ``--topology`` times the collectives on."""

from __future__ import annotations

import argparse
import inspect

from course_lib.cli.common import add_json_flag, command_parser, say, write_json


def cmd_hardware(args: argparse.Namespace) -> int:
    from course_lib.cluster.profiles import PROFILES, measured_dir, measured_profiles

    measured = measured_profiles()
    shown = PROFILES | {name: p for name, p in measured.items() if name not in PROFILES}
    data = {name: {k: v for k, v in vars(p).items() if k != "name"} for name, p in shown.items()}
    write_json(data, args.json)
    for name, p in shown.items():
        say(
            args,
            f"{name}{' (measured, in ' + str(measured_dir()) + ')' if name not in PROFILES else ''}: {p.description}",
        )
        say(
            args,
            f"  peak bf16 {p.peak_flops['bf16'] / 1e12:g} TFLOP/s, fp32 {p.peak_flops['fp32'] / 1e12:g} TFLOP/s; "
            f"{p.memory_bytes / 1e9:g} GB; {p.gpus_per_node} GPUs per node",
        )
        say(
            args,
            f"  per GPU: intra-node {p.intra_bandwidth / 1e9:g} GB/s, {p.intra_latency_s * 1e6:g} us; "
            f"inter-node {p.inter_bandwidth / 1e9:g} GB/s, {p.inter_latency_s * 1e6:g} us",
        )
        say(
            args,
            f"  planner's step time: matmuls at {p.matmul_efficiency:.0%} of peak, fused attention at "
            f"{p.attention_efficiency:.0%}, memory {p.hbm_bandwidth / 1e12:g} TB/s",
        )
        for source in p.sources:
            say(args, f"  source: {source}")
    for line in topology_lines():
        say(args, line)
    return 0


def topology_lines() -> list[str]:
    """The topologies ``--topology`` takes (:data:`course_lib.cluster.topology.PROFILES`): each one's size syntax,
    its default size, its levels and the first words of its builder's docstring."""
    from course_lib.cluster.topology import PROFILES as TOPOLOGIES

    lines = [
        "topologies (--topology NAME, or NAME:SIZE with SIZE its nodes, racks or torus shape: h100-superpod:8, "
        "tpu-v5p:4x4x8;",
        "  plan sizes a NAME to its --gpus, run --hardware H takes its default size):",
    ]
    for name, build in TOPOLOGIES.items():
        size = next(iter(inspect.signature(build).parameters.values()))
        default = "x".join(map(str, size.default)) if isinstance(size.default, tuple) else size.default
        syntax = f"{name}:{'AxBxC' if size.name == 'shape' else size.name.upper()}"
        topology = build()
        levels = " x ".join(f"{level} ({n})" for level, n in topology.levels())
        summary = inspect.getdoc(build).replace("``", "").split(". ")[0].split(": ")[0].rstrip(".")
        lines.append(f"{syntax}: {summary}")
        lines.append(f"  default {name}:{default}, {topology.n_gpus} GPUs; levels, innermost first: {levels}")
    return lines


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``hardware`` takes no flag but ``--json``."""
    hw = command_parser(
        subparsers,
        "hardware",
        "list the hardware profiles of the modeled clock and the topologies of --topology",
        [("", "every profile, its figures and sources; every topology"), ("--json -", "the profiles as JSON")],
    )
    hw.set_defaults(func=cmd_hardware)
    add_json_flag(hw)
