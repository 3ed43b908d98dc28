"""``hardware``: the hardware profiles of the modeled clock, the published ones and those measured here."""

from __future__ import annotations

import argparse

from course_lib.cli.common import add_json_flag, say, write_json


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
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``hardware`` takes no flag but ``--json``."""
    hw = subparsers.add_parser("hardware", help="list the hardware profiles of the modeled clock")
    hw.set_defaults(func=cmd_hardware)
    add_json_flag(hw)
