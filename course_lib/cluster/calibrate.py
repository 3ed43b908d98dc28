"""Measure the device at hand and write it as a hardware profile of the modeled clock; then compare the clock's
compute with a measured training step on that device.

The published profiles (:data:`course_lib.cluster.profiles.PROFILES`) take a GPU's datasheet peak and a stated
fraction of it. Here each number is measured on the device this process sees (a CUDA GPU or the CPU):

* matrix-multiply throughput per precision: square ``n x n`` products, 2n^3 FLOPs each, over several ``n``; the
  best rate is kept, as the "maximum achievable matmul FLOPS" search does (Bekman, *Machine Learning Engineering*,
  compute/accelerator: H100 SXM reaches about 80% of its datasheet BF16 peak, A100 SXM about 86%);
* memory bandwidth: a copy between two large buffers, which reads and writes every byte once (STREAM's Copy,
  McCalpin 1995), so 2 x its bytes per copy;
* attention: ``scaled_dot_product_attention`` forward, 4 b h s^2 d FLOPs, as a fraction of the matmul rate.

A measured profile takes the measured matmul rate as its peak, so its ``matmul_efficiency`` is 1: it is the
ceiling a training step's matrix multiplies approach, not what they sustain (:func:`compare_step` shows the gap).
One device measures no link, so the links are those of a published profile (``links``), and the profile says so.
:func:`course_lib.cluster.profiles.save_profile` writes it where :func:`course_lib.cluster.profiles.get_profile`
finds it by name.

:func:`compare_step` trains a GPT on the device (the ``single`` scheme's rank function,
:func:`course_lib.parallel.data.train_data_parallel`, in this process), times its steps, and
replays its program on a measured profile: the modeled clock charges every counted FLOP, element-wise ones too, at
the matmul rate; a roofline variant charges the element-wise work at the memory bandwidth instead (three element
accesses per output element: two read, one written, an assumption). Both sit beside the measured step time.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course_lib.cluster.clock import replay
from course_lib.cluster.profiles import HardwareProfile, check_name, get_profile
from course_lib.ledgers.trace import Compute
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.data import train_data_parallel
from course_lib.runtime import launch
from course_lib.runtime.host import local_device

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# What a measurement tries, by device type: matmul sides, the copied buffer's bytes, attention's (b, h, s, d), and
# how long each timing runs at least. ``quick`` is for tests and a first look: under a second on a laptop.
SETTINGS = {
    "cuda": {"sides": (1024, 2048, 4096, 8192), "copy_bytes": 2**30, "attention": (4, 16, 2048, 64), "seconds": 0.2},
    "cpu": {"sides": (256, 512, 1024), "copy_bytes": 2**28, "attention": (2, 8, 512, 64), "seconds": 0.1},
    "quick": {"sides": (128, 256), "copy_bytes": 2**26, "attention": (1, 4, 128, 32), "seconds": 0.01},
}
# The GPTs compare_step trains: the course's tiny one, and a wider one sized for the device.
WIDER = {
    "cuda": GPTConfig(vocab=8192, seq=1024, layers=4, d_model=1024, heads=16),
    "cpu": GPTConfig(vocab=1024, seq=128, layers=2, d_model=256, heads=8),
}
ELEMENT_ACCESSES = 3  # the roofline variant's bytes per element-wise output: two elements read, one written


@dataclass(frozen=True)
class Measured:
    """What :func:`measure` found: rates in FLOP/s and bytes/s, and the sizes that gave the best ones."""

    device: str
    device_name: str
    matmul_flops: dict[str, float]
    matmul_side: dict[str, int]
    matmul_by_side: dict[str, dict[int, float]]
    attention_flops: float
    memory_bandwidth: float
    memory_bytes: float
    torch_version: str
    date: str


def best_seconds(fn: Callable[[], object], device: torch.device, seconds: float) -> float:
    """The fastest time of one call of ``fn``: calls in batches that each last about ``seconds``, timed between
    two synchronisations of ``device`` (the GPU's queue drained, so the clock sees the work, not its launch)."""
    fn()
    launch.sync(device)
    start = time.perf_counter()
    fn()
    launch.sync(device)
    calls = max(1, int(seconds / max(time.perf_counter() - start, 1e-9)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        launch.sync(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def matmul_rate(device: torch.device, dtype: torch.dtype, side: int, seconds: float) -> float:
    """FLOP/s of one ``side x side`` by ``side x side`` product: 2 side^3 FLOPs."""
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, side, device=device).to(dtype)
    return 2 * side**3 / best_seconds(lambda: a @ b, device, seconds)


def copy_bandwidth(device: torch.device, nbytes: int, seconds: float) -> float:
    """Bytes/s of a copy between two buffers of ``nbytes``: every byte read once and written once."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), device, seconds)


def attention_rate(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], seconds: float) -> float:
    """FLOP/s of ``scaled_dot_product_attention``'s forward on (b, h, s, d): 4 b h s^2 d (scores and output)."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device).to(dtype) for _ in range(3))
    return 4 * b * h * s * s * d / best_seconds(lambda: F.scaled_dot_product_attention(q, k, v), device, seconds)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and the threads torch uses on it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return f"{model}, {torch.get_num_threads()} threads"


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def device_memory(device: torch.device) -> float:
    """Bytes of memory: the GPU's own, or the machine's."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` is the first CUDA GPU if there is one, else the CPU; asking for CUDA without one is an error
    (:func:`course_lib.runtime.host.local_device`)."""
    return torch.device(local_device(None if device is None else str(device)))


def measure(device: str | torch.device | None = None, quick: bool = False) -> Measured:
    """Measure ``device`` (:func:`resolve_device`): matmul rate per precision, attention rate, copy bandwidth."""
    dev = resolve_device(device)
    s = SETTINGS["quick" if quick else dev.type]
    by_side = {
        key: {side: matmul_rate(dev, dtype, side, s["seconds"]) for side in s["sides"]} for key, dtype in DTYPES.items()
    }
    best = {key: max(rates, key=rates.get) for key, rates in by_side.items()}
    half = DTYPES["bf16"]
    return Measured(
        device=str(dev),
        device_name=device_name(dev),
        matmul_flops={key: by_side[key][side] for key, side in best.items()},
        matmul_side=best,
        matmul_by_side=by_side,
        attention_flops=attention_rate(dev, half, s["attention"], s["seconds"]),
        memory_bandwidth=copy_bandwidth(dev, s["copy_bytes"], s["seconds"]),
        memory_bytes=device_memory(dev),
        torch_version=torch.__version__,
        date=datetime.date.today().isoformat(),
    )


def default_name(measured: Measured) -> str:
    """``measured-`` and the device's name in lower case, runs of other characters as one dash."""
    model = measured.device_name.split(",")[0]
    return "measured-" + re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")


def as_profile(measured: Measured, name: str | None = None, links: str = "h100") -> HardwareProfile:
    """The measured device as a profile: its measured matmul rates as peaks (efficiency 1), attention's measured
    fraction of the bf16 rate, its memory and bandwidth; nodes and links copied from the published ``links``."""
    name = check_name(name or default_name(measured))
    base = get_profile(links)
    rates = ", ".join(
        f"{key} {rate / 1e12:.4g} TFLOP/s at n={measured.matmul_side[key]}"
        for key, rate in measured.matmul_flops.items()
    )
    return dataclasses.replace(
        base,
        name=name,
        description=f"measured: {measured.device_name} ({measured.device}), links as {base.name}'s",
        peak_flops=dict(measured.matmul_flops),
        memory_bytes=measured.memory_bytes,
        matmul_efficiency=1.0,
        attention_efficiency=min(1.0, measured.attention_flops / measured.matmul_flops["bf16"]),
        hbm_bandwidth=measured.memory_bandwidth,
        sources=(
            f"measured on {measured.date} with torch {measured.torch_version} by course_lib.cluster.calibrate: "
            f"{rates}; copy "
            f"{measured.memory_bandwidth / 1e9:.4g} GB/s; attention {measured.attention_flops / 1e12:.4g} TFLOP/s",
            f"links and GPUs per node: the published {base.name} profile's (one device measures no link)",
        ),
    )


@dataclass(frozen=True)
class StepComparison:
    """One GPT's training step on the device, measured and modeled (seconds). ``flops`` are its counted matrix
    FLOPs, ``elementwise`` its counted element-wise outputs, ``itemsize`` the bytes of one element."""

    label: str
    cfg: GPTConfig
    batch: int
    precision: str
    measured_s: float
    modeled_s: float
    roofline_s: float
    flops: int
    elementwise: int
    itemsize: int


def compare_step(
    profile: HardwareProfile,
    cfg: GPTConfig,
    train: TrainConfig = TrainConfig(steps=5),
    device: str | torch.device | None = None,
    label: str = "",
) -> StepComparison:
    """Train ``cfg`` on ``device`` with the ``single`` scheme in this process and compare one step's time with the
    modeled clock on ``profile`` at efficiency 1.

    The step is timed without FLOP counting (its dispatch hook slows every operator), as the median gap between
    consecutive steps' starts, the first step (warm-up) and the last (under the memory meter) left out; each step
    ends by waiting for the device, so on a GPU the gap is the device's time too. A second run of three steps
    counts the FLOPs; its middle step is replayed (:func:`course_lib.cluster.clock.replay`)."""
    if train.steps < 3:
        raise ValueError(
            f"compare_step times the steps between the first and the last: give steps >= 3, not {train.steps}"
        )
    key = train.half if train.precision is not None else {"float32": "fp32"}.get(train.dtype)
    if key not in DTYPES:
        raise ValueError("a profile has bf16 and fp32 rates: train in float32, or in mixed precision with bf16")
    dev = resolve_device(device)
    events = launch.run_here(train_data_parallel, cfg, train, device=dev).events[0]
    starts = [min(e.start for e in events if e.tags.get("step") == s) for s in range(train.steps)]
    measured_s = statistics.median(b - a for a, b in zip(starts[1:-1], starts[2:], strict=True))
    counted = launch.run_here(
        train_data_parallel, cfg, dataclasses.replace(train, steps=3), device=dev, count_flops=True
    )
    modeled = replay(counted.programs, counted.comm, profile, efficiency=1.0, precision=key, step=1)
    step = [c for c in counted.programs[0] if isinstance(c, Compute) and c.tags.get("step") == 1]
    flops, elementwise = sum(c.flops for c in step), sum(c.elementwise for c in step)
    itemsize = DTYPES[key].itemsize
    roofline = flops / profile.peak_flops[key] + ELEMENT_ACCESSES * itemsize * elementwise / profile.hbm_bandwidth
    return StepComparison(
        label, cfg, train.batch, key, measured_s, modeled.step_time_s, roofline, flops, elementwise, itemsize
    )


def compare_models(
    profile: HardwareProfile, device: str | torch.device | None = None, quick: bool = False
) -> list[StepComparison]:
    """:func:`compare_step` for the tiny GPT and a wider one sized for the device (:data:`WIDER`); ``quick``
    trains the tiny one only."""
    dev = resolve_device(device)
    out = [compare_step(profile, GPTConfig(), device=dev, label="tiny GPT")]
    if not quick:
        out.append(compare_step(profile, WIDER[dev.type], device=dev, label="wider GPT"))
    return out


# The published profile whose datasheet a measured device is compared with, by a word of its name.
PUBLISHED_MATCH = {"H100": "h100", "H800": "h800", "A100": "a100", "L40S": "pcie"}


def published_match(measured: Measured) -> HardwareProfile | None:
    """The published profile of the measured device's model, if there is one (a CPU has none)."""
    return next((get_profile(key) for word, key in PUBLISHED_MATCH.items() if word in measured.device_name), None)
