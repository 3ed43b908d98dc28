"""Hardware profiles: one kind of GPU node as the modeled clock and the planner see it, each figure with its source.

A :class:`HardwareProfile` gives a node's GPUs (dense peak per precision, memory, memory bandwidth), how many share
a node, and the two links of the modeled clock (:mod:`course_lib.cluster.clock`): NVLink-class inside a node, the
inter-node network across nodes, each as bandwidth per GPU and direction and a latency. The published profiles
(:data:`PROFILES`: DGX H100, the H800 of DeepSeek-V3's cluster, DGX A100, an L40S PCIe box) cite their datasheets.

Each profile also states what the planner's step-time model (:func:`course_lib.planner.cost.step_time`) assumes of the
GPU beyond its datasheet, one number per GPU generation with its source: the fraction of peak its matrix multiplies
and a fused attention kernel sustain in training (``MATMUL_EFFICIENCY``, ``ATTENTION_EFFICIENCY``) and its memory
bandwidth; what overlaps with what is written once in ``TIME_MODEL_ASSUMPTIONS``.

Beside the published profiles, a profile measured on a device by :mod:`course_lib.cluster.calibrate` is saved as JSON
(:func:`save_profile`) in :func:`measured_dir` and found by :func:`get_profile` by its name, like the published.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of node; bandwidths are per GPU and per direction, in bytes/s."""

    name: str
    description: str
    peak_flops: dict  # dense, by precision ("bf16", "fp32")
    memory_bytes: float
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency_s: float
    inter_bandwidth: float
    inter_latency_s: float
    matmul_efficiency: float  # fraction of the dense peak a training step's large matrix multiplies sustain
    attention_efficiency: float  # fraction of the dense peak a fused (FlashAttention-style) attention kernel sustains
    hbm_bandwidth: float  # bytes/s of the GPU's own memory, what the element-wise kernels stream through
    sources: tuple[str, ...] = field(default=())
    fp8_linears: bool = False  # the layers' linear matmuls at peak_flops["fp8"] (get_profile's "+fp8")


# What the planner's step-time model (course_lib.planner.cost.step_time) assumes of a GPU beside its datasheet, one
# number per GPU generation for every layout and model, none fitted to a published row (course_lib.planner.published
# holds the check).
#
# matmul_efficiency: the fraction of the dense peak a training step's matrix multiplies sustain. A100: 0.63, what the
# model needs to give Narayanan et al. 2021's Table 2 row for GPT-3 175B on 384 A100s (153 TFLOP/s per GPU, batch
# 1536, micro-batch 1, model-parallel 96 = TP 8 x PP 12, DP 4: 384 microbatches, so a bubble of 1-3% whatever the
# schedule): 0.627 interleaved, 0.637 1F1B. That row is from the same paper, code and cluster as Table 1 but not one
# of the rows validated against. Cross-check: Korthikanti et al. 2022's Table 4 (one layer of a 22B GPT on 8 A100s,
# 19.6 to 27.2 ms with and without recompute) gives 0.68-0.74 with the 2022 code, about 9% faster than 2021's: their
# Table 5's full-recompute 1T iteration (94.42 s, 512 microbatches as in Table 1's 1T row) is 56.8% of peak by eq. (3)
# against Table 1's 52%. H100: no measurement of its own independent of Llama 3's Table 4 was found; the A100's
# fraction scaled by the two GPUs' measured matmul ceilings (the largest BF16 matmul throughput found by a shape
# search, "MAMF": A100 SXM 85.9%, H100 SXM 80.1% of peak; Bekman, ml-engineering, compute/accelerator/README.md):
# 0.63 x 80.1 / 85.9 = 0.59. The H800 has the H100's compute; the L40S, unmeasured, is taken as the A100.
# The H100 at torchtitan's 500 W cap ("h100-500w") is the same chip: its fraction is the H100's (what the cap costs
# is in its peak, not here). FP8 matmuls (get_profile's "+fp8") are taken to sustain the same fraction of the FP8
# peak: no measurement of FP8's own was found, and the published FP8 rows test it.
MATMUL_EFFICIENCY = {"a100": 0.63, "h100": 0.59, "h100-500w": 0.59, "h800": 0.59, "pcie": 0.63}
# attention_efficiency: the fraction of the dense peak a fused attention kernel sustains. FlashAttention-2: 50-73% on
# A100 (Dao 2023, abstract; the low end, 0.5, taken), 35% on H100 (Shah et al. 2024, FlashAttention-3, abstract).
ATTENTION_EFFICIENCY = {"a100": 0.5, "h100": 0.35, "h100-500w": 0.35, "h800": 0.35, "pcie": 0.5}

TIME_MODEL_ASSUMPTIONS = (
    "Compute: matrix multiplies at the profile's matmul_efficiency of its dense peak; fused attention at its "
    "attention_efficiency (attention that writes its scores to memory runs as matrix multiplies); element-wise "
    "kernels at the datasheet memory bandwidth, hbm_bandwidth; one after the other on a GPU.",
    "Collectives at the link's bandwidth per GPU and direction (intra_bandwidth inside a node, inter_bandwidth across "
    "nodes) plus a latency per ring step (collective_time).",
    "Not overlapped with compute: TP's all-reduces (or SP's all-gathers and reduce-scatters), pipeline sends and "
    "receives, expert parallelism's all-to-alls.",
    "Overlapped: a CP ring step with the attention of the block it holds; DP's gradient reduction (ZeRO-0 and 1) with "
    "the last microbatch's backward, ZeRO-2's with the whole backward, ZeRO-3's gathers and reductions with all the "
    "compute; ZeRO-1 and 2's all-gather of the updated weights after the step is not.",
    "Pipeline: every stage runs at the pace of the slowest (a full stage, or the last with the output head); the "
    "bubble is the schedule's idle over busy time times a stage's work, compute and its TP, CP and EP traffic.",
)

H100_SXM_PEAKS = {"bf16": 989e12, "fp32": 67e12, "fp8": 1979e12}  # dense (NVIDIA H100 datasheet, SXM5 column)
NVL_BF16_PEAK = 835e12  # H100 NVL, BF16 dense (NVIDIA H100 datasheet, NVL column: 1,671 TFLOPS with sparsity)
FP8 = "+fp8"  # a profile name's suffix: its linear layers in FP8 (get_profile)

PROFILES = {
    "h100": HardwareProfile(
        name="h100",
        description="DGX H100: 8x H100 SXM5 80 GB, NVLink 4 / NVSwitch, one 400 Gb/s NDR InfiniBand NIC per GPU",
        peak_flops=dict(H100_SXM_PEAKS),
        memory_bytes=80e9,
        gpus_per_node=8,
        intra_bandwidth=450e9,  # NVLink 4: 900 GB/s per GPU, both directions together
        intra_latency_s=2e-6,
        inter_bandwidth=50e9,  # 400 Gb/s ConnectX-7 per GPU
        inter_latency_s=5e-6,
        matmul_efficiency=MATMUL_EFFICIENCY["h100"],
        attention_efficiency=ATTENTION_EFFICIENCY["h100"],
        hbm_bandwidth=3.35e12,  # HBM3
        sources=(
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 989 TFLOPS dense, FP8 1,979 TFLOPS dense, FP32 67 "
            "TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; the datasheet prints the Tensor Core rates with "
            "sparsity, twice these)",
            "NVIDIA DGX H100 user guide (8x ConnectX-7 400 Gb/s InfiniBand for the compute fabric)",
        ),
    ),
    # torchtitan's Llama 3 benchmarks (benchmarks/llama3_h100_202412_torchtitan.md, "Hardware" and footnote 2): Meta's
    # Grand Teton hosts, 8 H100s fully connected with NVLink, each "HBM2e-based SXM H100 with lower TDP": 96 GB of
    # HBM2e at 2.4 TB/s, the default 500 W power limit (700 W TDP), 400 Gb/s of RDMA network per GPU. Its peak is
    # not stated: "between SXM and NVL, and we don't know its exact value". The profile takes the SXM5 datasheet's
    # dense peaks, the upper bound (and the peak torchtitan's own MFU divides by); the NVL's, 835 TFLOPS BF16 dense
    # (NVIDIA H100 datasheet, NVL column, 1,671 with sparsity), is the lower: NVL_BF16_PEAK. NVLink as the SXM5's.
    "h100-500w": HardwareProfile(
        name="h100-500w",
        description="Grand Teton: 8x H100 SXM 96 GB HBM2e at a 500 W power limit, NVLink, 400 Gb/s RDMA per GPU "
        "(torchtitan's Llama 3 benchmarks, 2024-12); peak taken as the SXM5's, an upper bound under the cap",
        peak_flops=dict(H100_SXM_PEAKS),
        memory_bytes=96e9,
        gpus_per_node=8,
        intra_bandwidth=450e9,  # NVLink 4 of an SXM H100: 900 GB/s per GPU, both directions together
        intra_latency_s=2e-6,
        inter_bandwidth=50e9,  # 400 Gb/s per GPU (stated)
        inter_latency_s=5e-6,
        matmul_efficiency=MATMUL_EFFICIENCY["h100-500w"],
        attention_efficiency=ATTENTION_EFFICIENCY["h100-500w"],
        hbm_bandwidth=2.4e12,  # HBM2e (stated)
        sources=(
            "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12): 8 H100s a host fully "
            "connected with NVLink, 96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, 500 W power limit; footnote 2: "
            "an HBM2e SXM H100 with lower TDP whose peak lies between the SXM's and the NVL's",
            "NVIDIA H100 Tensor Core GPU datasheet: SXM5 dense peaks (BF16 989, FP8 1,979 TFLOPS) taken as the "
            "upper bound; NVL BF16 835 TFLOPS dense the lower (NVL_BF16_PEAK)",
        ),
    ),
    "h800": HardwareProfile(
        name="h800",
        description="8x H800 SXM5 80 GB (the H100's export variant: same compute, NVLink cut to 400 GB/s), one "
        "400 Gb/s InfiniBand NIC per GPU: DeepSeek-V3's cluster",
        peak_flops=dict(H100_SXM_PEAKS),  # the H100 SXM5's dense peaks: same die, clocks
        memory_bytes=80e9,
        gpus_per_node=8,
        intra_bandwidth=160e9,  # what DeepSeek-V3 reports achieving over NVLink, per GPU
        intra_latency_s=2e-6,
        inter_bandwidth=50e9,  # 400 Gb/s per GPU, as DeepSeek-V3 reports it: NVLink is 3.2x faster
        inter_latency_s=5e-6,
        matmul_efficiency=MATMUL_EFFICIENCY["h800"],
        attention_efficiency=ATTENTION_EFFICIENCY["h800"],
        hbm_bandwidth=3.35e12,  # HBM3, as the H100
        sources=(
            "DeepSeek-AI 2024 (DeepSeek-V3 technical report), §3.2.2: 2,048 H800 GPUs, 8 per node over NVLink and "
            "NVSwitch, InfiniBand between nodes; NVLink 160 GB/s vs IB 50 GB/s, about 3.2x",
            "H800 SXM5: the H100 SXM5's compute (BF16 989 TFLOPS dense, FP32 67 TFLOPS) and 80 GB HBM3, NVLink "
            "400 GB/s",
        ),
    ),
    "a100": HardwareProfile(
        name="a100",
        description="DGX A100: 8x A100 SXM4 80 GB, NVLink 3 / NVSwitch, one 200 Gb/s HDR InfiniBand NIC per GPU",
        peak_flops={"bf16": 312e12, "fp32": 19.5e12},
        memory_bytes=80e9,
        gpus_per_node=8,
        intra_bandwidth=300e9,  # NVLink 3: 600 GB/s per GPU, both directions together
        intra_latency_s=2e-6,
        inter_bandwidth=25e9,  # 200 Gb/s ConnectX-6 per GPU
        inter_latency_s=5e-6,
        matmul_efficiency=MATMUL_EFFICIENCY["a100"],
        attention_efficiency=ATTENTION_EFFICIENCY["a100"],
        hbm_bandwidth=2.039e12,  # HBM2e
        sources=(
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, HBM2e "
            "2,039 GB/s, NVLink 600 GB/s)",
            "NVIDIA DGX A100 user guide (8x ConnectX-6 200 Gb/s HDR InfiniBand)",
        ),
    ),
    "pcie": HardwareProfile(
        name="pcie",
        description="8x L40S 48 GB on PCIe Gen4 x16 (no NVLink), two 100 Gb/s Ethernet ports per node",
        peak_flops={"bf16": 362e12, "fp32": 91.6e12},
        memory_bytes=48e9,
        gpus_per_node=8,
        intra_bandwidth=32e9,  # PCIe Gen4 x16: 64 GB/s both directions together
        intra_latency_s=3e-6,
        inter_bandwidth=25e9 / 8,  # 2 x 100 Gb/s per node, shared by 8 GPUs (an assumed, common build)
        inter_latency_s=10e-6,
        matmul_efficiency=MATMUL_EFFICIENCY["pcie"],
        attention_efficiency=ATTENTION_EFFICIENCY["pcie"],
        hbm_bandwidth=0.864e12,  # GDDR6
        sources=(
            "NVIDIA L40S datasheet (BF16 362 TFLOPS dense, FP32 91.6 TFLOPS, 48 GB GDDR6 at 864 GB/s, PCIe Gen4 "
            "x16 64 GB/s)",
            "Latencies of all three profiles: assumed, of the order of NCCL-tests small-message times",
        ),
    ),
}


PROFILES_DIR_VARIABLE = "COURSE_LIB_PROFILES"


def measured_dir() -> Path:
    """Where measured profiles (:mod:`course_lib.cluster.calibrate`) are kept: ``$COURSE_LIB_PROFILES``, else
    ``~/.course_lib/profiles``."""
    return Path(os.environ.get(PROFILES_DIR_VARIABLE) or Path.home() / ".course_lib" / "profiles")


def save_profile(profile: HardwareProfile, path: str | Path | None = None) -> Path:
    """Write ``profile`` as JSON to ``path`` (default: ``NAME.json`` in :func:`measured_dir`); returns the path."""
    target = Path(path) if path is not None else measured_dir() / f"{profile.name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(profile), indent=1) + "\n")
    return target


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile written by :func:`save_profile`; a file that is not one is an error saying which."""
    try:
        data = json.loads(Path(path).read_text())
        return HardwareProfile(**{**data, "sources": tuple(data.get("sources", ()))})
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"{path} is not a hardware profile ({err}); write one with: python -m course_lib calibrate"
        ) from None


def measured_profiles() -> dict[str, HardwareProfile]:
    """The profiles in :func:`measured_dir`, by file name without ``.json`` (files that are not profiles are left
    out)."""
    found = {}
    for path in sorted(measured_dir().glob("*.json")):
        with contextlib.suppress(ValueError):
            found[path.stem] = load_profile(path)
    return found


def get_profile(name: str) -> HardwareProfile:
    """A published profile (:data:`PROFILES`), a measured one by name (:func:`measured_profiles`), or a profile's
    JSON file by path; ``NAME+fp8``: that profile with its transformer layers' linear matmuls at its FP8 peak
    (``fp8_linears``), as Transformer Engine's FP8 and torchao's Float8 run them; attention, the output head and the
    element-wise kernels stay BF16, and memory and traffic are counted as in BF16 mixed precision."""
    if name.endswith(FP8):
        base = get_profile(name.removesuffix(FP8))
        if "fp8" not in base.peak_flops:
            raise ValueError(f"{base.name} has no FP8 peak: drop {FP8}, or use one of {sorted(PROFILES)}")
        return replace(base, name=name, description=base.description + "; linear layers in FP8", fp8_linears=True)
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        return load_profile(name)
    measured = measured_profiles()
    if name not in measured:
        mine = (
            f", measured: {sorted(measured)}" if measured else " (measure this device: python -m course_lib calibrate)"
        )
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PROFILES)}{mine}, or a profile's .json")
    return measured[name]


def check_name(name: str) -> str:
    """``name`` if a measured profile may have it: a file name of letters, digits, '.', '_' and '-' that is not a
    published profile's (which :func:`get_profile` would find first)."""
    if name in PROFILES or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ValueError(
            f"cannot name a measured profile {name!r}: use letters, digits, '.', '_' and '-', and not a published "
            f"profile's name ({', '.join(sorted(PROFILES))})"
        )
    return name
