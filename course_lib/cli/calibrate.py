"""``calibrate``: measure this GPU (or CPU) as a hardware profile, save it, and time a training step beside the
modeled clock's prediction."""

from __future__ import annotations

import argparse

from course_lib.cli.common import add_json_flag, command_parser, say, write_json


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from course_lib.cluster.profiles import check_name, save_profile
    from course_lib.runtime.host import local_device

    try:  # before torch is imported
        device = local_device(args.device)
        if args.name is not None:
            check_name(args.name)
    except ValueError as err:
        raise SystemExit(f"calibrate: {err}") from None
    import torch

    from course_lib.cluster import calibrate

    device = torch.device(device)
    say(args, f"measuring {device} ({calibrate.device_name(device)}) with torch {torch.__version__} ...")
    measured = calibrate.measure(device, quick=args.quick)
    profile = calibrate.as_profile(measured, args.name, args.links)
    published = calibrate.published_match(measured)

    def against(value: float, datasheet: float | None) -> str:
        return (
            f", {value / datasheet:.0%} of the {published.name} datasheet's {datasheet / 1e12:g}" if datasheet else ""
        )

    for key, rate in measured.matmul_flops.items():
        sides = ", ".join(f"n={n}: {r / 1e12:.3g}" for n, r in measured.matmul_by_side[key].items())
        peak = published.peak_flops[key] if published else None
        say(args, f"  matmul {key:<5} {rate / 1e12:8.3g} TFLOP/s at best ({sides}){against(rate, peak)}")
    say(
        args,
        f"  attention  {measured.attention_flops / 1e12:8.3g} TFLOP/s (scaled_dot_product_attention forward, bf16): "
        f"{profile.attention_efficiency:.0%} of the bf16 matmul rate",
    )
    hbm = published.hbm_bandwidth if published else None
    say(
        args,
        f"  copy       {measured.memory_bandwidth / 1e9:8.4g} GB/s (read + write)"
        f"{against(measured.memory_bandwidth, hbm)}; {measured.memory_bytes / 1e9:.3g} GB of memory",
    )
    try:
        path = save_profile(profile, args.out)
    except OSError as err:
        raise SystemExit(f"calibrate: could not write the profile ({err.strerror or err}: {err.filename})") from None
    use = profile.name if args.out is None else str(path)
    say(args, f"wrote the profile {profile.name} to {path}; use it with --hardware {use}")
    say(args, f"  its links are the {args.links} profile's: one device measures no link")
    steps = [] if args.no_train else calibrate.compare_models(profile, device, quick=args.quick)
    if steps:
        say(args, "a training step on this device, measured beside the modeled clock at the measured rates:")
    for c in steps:
        say(
            args,
            f"  {c.label} ({c.cfg.layers} layers x {c.cfg.d_model}, seq {c.cfg.seq}, batch {c.batch}, {c.precision}): "
            f"measured {c.measured_s * 1e3:.3g} ms; modeled {c.modeled_s * 1e3:.3g} ms, "
            f"{c.measured_s / c.modeled_s:.3g}x less; roofline {c.roofline_s * 1e3:.3g} ms, "
            f"{c.measured_s / c.roofline_s:.3g}x less",
        )
    if steps:
        say(args, "  modeled: every counted FLOP at the matmul rate; roofline: element-wise work at the copy bandwidth")
    write_json(
        {
            "measured": asdict(measured),
            "profile": asdict(profile),
            "path": str(path),
            "steps": [asdict(c) for c in steps],
        },
        args.json,
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``calibrate``'s flags: the device, the profile's name and file, whose links it takes, how much it measures."""
    from course_lib.cluster.profiles import PROFILES

    cal = command_parser(
        subparsers,
        "calibrate",
        "measure this GPU (or CPU) as a hardware profile and time a training step beside the model",
        [
            ("--quick", "about a second: small sizes, the tiny GPT only"),
            ("--device cpu --name laptop", "this CPU, saved as the profile laptop (then: --hardware laptop)"),
            ("--no-train --json -", "the rates only, as JSON"),
        ],
    )
    cal.add_argument("--device", help="cpu, cuda or cuda:N (default: the first GPU, else the CPU)")
    cal.add_argument("--name", help="the profile's name (default: measured- and the device's model)")
    cal.add_argument(
        "--out",
        metavar="FILE",
        help="write the profile here (default: NAME.json in $COURSE_LIB_PROFILES "
        "or ~/.course_lib/profiles, where --hardware NAME finds it)",
    )
    cal.add_argument(
        "--links", choices=sorted(PROFILES), default="h100", help="whose links and nodes the profile takes"
    )
    cal.add_argument("--quick", action="store_true", help="small sizes, the tiny GPT only: about a second")
    cal.add_argument("--no-train", action="store_true", help="measure only; train no GPT")
    cal.set_defaults(func=cmd_calibrate)
    add_json_flag(cal)
