"""Layouts: what one is (:class:`Layout`), what the planner makes of it (:class:`Candidate`, :class:`Plan`), how
it is named (:func:`describe`), and every one the search enumerates for a model on a cluster (:func:`layouts`): TP
inside a node dividing the heads, CP for long sequences, PP splitting the layers as Llama 3 does (Grattafiori et
al. 2024, §3.3.2), DP the rest, EP carved out of a stage's ranks, each pipeline with the schedules it can run; and
the lesson's decision tree on model states (:func:`tree_shape`), the shape the choice keeps unless another layout is
more than ``CLOSE`` faster. :func:`groups` places every group's ranks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cache

import numpy as np

from course_lib.cluster.network import Network
from course_lib.model.config import Layout
from course_lib.model.formulas import model_state_formula
from course_lib.model.stages import even_counts
from course_lib.planner.presets import DEFAULT_GLOBAL_BATCH, Model

CLOSE = 0.10  # the decision tree's shape is kept if no layout is estimated more than 10% faster

SHAPES = {
    "dp": "data parallelism alone",
    "tp": "tensor parallelism inside a node (data parallelism across nodes)",
    "fsdp": "FSDP / ZeRO-3 over all GPUs, no model parallelism",
    "3d": "3D: TP inside nodes, PP across nodes, DP on top",
    "ep": "expert parallelism: the experts split over EP ranks (all-to-all), the dense rest by TP/PP, DP on top",
}


@dataclass
class Candidate:
    """One layout and its numbers: memory per GPU by category (``memory``), the step time and its parts (``time``), the
    FLOPs a step does and the rate that makes (model FLOPs, :func:`~course_lib.planner.cost.flops_per_token`; hardware
    FLOPs, :func:`~course_lib.planner.cost.hardware_flops_per_token`, with the recomputed forward), and where each group
    of more than one GPU sits (``placement``)."""

    tp: int
    pp: int
    dp: int
    zero: int
    microbatches: int
    recompute: str
    fits: bool
    memory_per_gpu_bytes: float
    bubble_fraction: float
    step_time_s: float
    memory: dict = field(default_factory=dict)
    time: dict = field(default_factory=dict)
    placement: dict = field(default_factory=dict)
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"  # the pipeline schedule (:data:`course_lib.parallel.schedules.PIPELINE_SCHEDULES`)
    chunks: int = 1  # model chunks per pipeline rank (v), more than 1 only interleaved (zb-v, dualpipev fix 2)
    attention: str = "flash"  # the attention kernel (:data:`course_lib.model.config.ATTENTION_KERNELS`)
    sp: bool = True  # sequence parallelism with TP (Korthikanti et al. 2022, §4.2.2)
    model_flops: float = 0.0  # per step, :func:`~course_lib.planner.cost.flops_per_token` x tokens
    hardware_flops: float = 0.0  # per step, :func:`~course_lib.planner.cost.hardware_flops_per_token` x tokens
    tflops_per_gpu: float = 0.0  # model FLOPs per second per GPU, in TFLOP/s
    hardware_tflops_per_gpu: float = 0.0
    mfu: float = 0.0  # model FLOPs utilization: model FLOP/s per GPU over the profile's dense peak
    hfu: float = 0.0  # hardware FLOPs utilization, the same with the recomputed forward counted
    stage_layers: tuple[int, ...] = ()  # the layers of each pipeline stage (:func:`stage_splits`); (): even


@dataclass
class Plan(Candidate):
    """The chosen layout (the :class:`Candidate` fields), why (``reasons``) and the alternatives: those that fit
    ranked by step time, then those that do not, by memory."""

    model: Model | None = None
    hardware: str = "h100"
    gpus: int = 1
    gpus_per_node: int = 8
    gpu_mem_bytes: float = 80e9
    global_batch: int = DEFAULT_GLOBAL_BATCH
    micro_batch: int = 1
    precision: str = "mixed"
    shape: str = "dp"
    reasons: list[str] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)
    topology: str | None = None  # the topology's name when the traffic was timed on one
    network: Network | None = field(default=None, repr=False, compare=False)  # what it was timed on

    def as_dict(self) -> dict:
        return asdict(replace(self, network=None))

    @property
    def layout(self) -> Layout:
        """The chosen layout, as :func:`course_lib.planner.evaluate.evaluate` takes one."""
        return Layout(
            self.tp, self.pp, self.dp, self.zero, self.microbatches, self.cp, self.ep, self.schedule, self.chunks,
            self.sp, self.recompute, self.attention, self.micro_batch, self.stage_layers,
        )  # fmt: skip


def describe(c: Candidate, zero0: bool = True) -> str:
    """ "TP t x PP p x DP d, ZeRO-k" (without ", ZeRO-0" when ``zero0`` is False), with " x CP c" after TP and
    ", EP e" (carved out of TP x CP x DP) when they are more than 1, and the pipeline schedule when it is not
    1F1B (:func:`schedule_name`)."""
    cp = f" x CP {c.cp}" if c.cp > 1 else ""
    ep = f", EP {c.ep}" if c.ep > 1 else ""
    schedule = f", {schedule_name(c.schedule, c.chunks)}" if c.schedule != "1f1b" else ""
    return f"TP {c.tp}{cp} x PP {c.pp} x DP {c.dp}{ep}" + (f", ZeRO-{c.zero}" if c.zero or zero0 else "") + schedule


def schedule_name(schedule: str, chunks: int = 1) -> str:
    """ "1F1B", "interleaved v=4", "ZB-H1", "ZB-H2", "ZB-V" or "DualPipeV"."""
    names = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "zb-v": "ZB-V", "dualpipev": "DualPipeV"}
    return names.get(schedule, f"interleaved v={chunks}")


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first: those up to its square root, then their cofactors (so a cluster of
    ten million GPUs takes milliseconds, not seconds)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


SHORT_STAGES = 3  # Llama 3: 126 layers on 16 stages leave 2 short; DeepSeek-V3: 61 on 16 leave 3


def splits_layers(layers: int, pp: int) -> bool:
    """Stages of ceil(L/p) layers, at most ``SHORT_STAGES`` of them one layer shorter: Llama 3 puts 126 layers on
    16 stages so, the first and last one layer short as they also hold the embedding and the output head
    (Grattafiori et al. 2024, §3.3.2); DeepSeek-V3 trains its 61 layers on 16 stages (§3.2), three short."""
    return pp <= layers and pp * math.ceil(layers / pp) - layers <= SHORT_STAGES


def stage_splits(layers: int, pp: int, schedule: str = "1f1b") -> list[tuple[int, ...]]:
    """The layers of each stage the planner tries for a pipeline of ``pp`` stages running ``schedule``: the even
    split first, then the balanced one where it differs.

    Even: () when ``pp`` divides the layers (Megatron-LM's default), else ceil(L/p) a stage with the last ones a
    layer short (:func:`splits_layers`), counted stage by stage. Balanced: the embedding and the output head each
    take a layer's place, L + 2 slots split as evenly, the first and last stage a layer short for them (BLOOM-176B's
    ``type:transformer|embedding``, 70 layers on 12 stages as 5, 6, ..., 6, 5; Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``; Llama 3's 126 layers
    on 16 stages as 7, 8, ..., 8, 7, Grattafiori et al. 2024, §3.3.2), kept if every stage has a layer. Only for
    schedules of one chunk a rank (1F1B, ZB-H1): interleaved and V schedules keep the even split, () (their
    chunks' layers averaged, as Megatron-LM's estimator does)."""
    if pp == 1 or schedule not in ("1f1b", "zb-h1"):
        return [()]
    even = even_counts(layers, pp)
    balanced = even_counts(layers + 2, pp)
    balanced[0], balanced[-1] = balanced[0] - 1, balanced[-1] - 1
    splits = [() if layers % pp == 0 else tuple(even)]
    return splits + [tuple(balanced)] * (min(balanced) >= 1 and balanced != even)


def split_text(counts: tuple[int, ...]) -> str:
    """A stage split in a few characters: ``7,8,...,8,7`` (all of them up to 6 stages)."""
    shown = [*counts[:2], "...", *counts[-2:]] if len(counts) > 6 else counts
    return ",".join(map(str, shown))


def tree_shape(model: Model, gpus: int, gpus_per_node: int, gpu_mem: float, precision: str, no_mp: bool) -> str:
    """The lesson's decision tree on model states (16 bytes per parameter with Adam); a mixture of experts that
    does not fit one GPU is the expert-parallel shape."""
    states = sum(model_state_formula(model.params, precision).values())
    if states <= gpu_mem:
        return "dp"
    if no_mp:
        return "fsdp"
    if model.experts:
        return "ep"
    return "tp" if states <= gpu_mem * min(gpus, gpus_per_node) else "3d"


def in_shape(c: Candidate, shape: str, gpus_per_node: int) -> bool:
    """Does layout ``c`` have the decision tree's ``shape``? 3D: TP, PP across nodes and DP on top."""
    if shape in ("dp", "fsdp"):
        return c.tp == c.pp == 1 and (c.zero == 3) == (shape == "fsdp")
    if shape == "tp":
        return c.tp > 1 and c.pp == 1
    if shape == "ep":
        return c.ep > 1
    return c.tp > 1 and c.pp > 1 and c.dp > 1 and c.tp * c.pp > gpus_per_node


MIN_CP_TOKENS = 4096  # Llama 3's CP 16 at 128K keeps 8,192 tokens a rank


def cp_degrees(model: Model, ranks: int) -> list[int]:
    """Context-parallel degrees dividing ``ranks`` that cut the sequence into 2 x cp equal chunks (rank r holds
    chunks r and 2cp-1-r, which balances the causal mask's work; Llama 3 §3.3.2), each rank keeping at least
    ``MIN_CP_TOKENS``: CP is for long sequences; shorter blocks leave the attention kernel too little work to hide
    the ring behind (:func:`~course_lib.planner.cost.cp_comm_exposed`)."""
    return [cp for cp in divisors(ranks) if cp == 1 or (model.seq % (2 * cp) == 0 and model.seq // cp >= MIN_CP_TOKENS)]


def ep_degrees(model: Model, ranks: int) -> list[int]:
    """Expert-parallel degrees: each rank holds a whole number of experts, and EP divides the ``ranks`` (a
    stage's TP x CP x DP) it is carved out of."""
    if not model.experts:
        return [1]
    return [ep for ep in divisors(model.experts.routed) if ranks % ep == 0]


def splits_heads(model: Model, tp: int) -> bool:
    """TP ``tp`` splits the attention heads: it divides them, and each rank holds whole K/V heads or a copy of one
    (it divides the K/V heads or is a multiple of them)."""
    kv = model.kv_heads or model.heads
    return not model.heads % tp and not (kv % tp and tp % kv)


def layouts(
    model: Model,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    micro_batch: int,
    no_mp: bool,
    context: bool = False,
) -> list[Layout]:
    """Every :class:`Layout`: TP inside a node (``gpus_per_node``: the GPUs TP may span, a topology's fast domain)
    dividing the heads (and the K/V heads, or a multiple of them), with ``context`` every CP degree
    (:func:`cp_degrees`), PP splitting the layers (:func:`splits_layers`), DP the rest, every EP degree
    (:func:`ep_degrees`); the global batch a whole number of micro-batches per DP rank, at least one per stage;
    each pipeline with every schedule it can run (:func:`pipeline_schedules`). ZeRO shards over DP x CP (3, FSDP,
    only without TP and PP). ``no_mp``: TP = CP = PP = EP = 1. Each with sequence parallelism where TP splits,
    no recompute, FlashAttention and micro-batches of ``micro_batch``."""
    out = []
    for tp in divisors(gpus_per_node):
        if not splits_heads(model, tp) or gpus % tp or (no_mp and tp > 1):
            continue
        for cp in cp_degrees(model, gpus // tp) if context and not no_mp else [1]:
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                m, rest = divmod(global_batch, dp * micro_batch)
                if (no_mp and pp > 1) or not splits_layers(model.layers, pp) or rest or m < pp:
                    continue
                zeros = (0,) if dp * cp == 1 else (0, 1, 2, 3) if tp == pp == 1 else (0, 1, 2)
                eps = [1] if no_mp else ep_degrees(model, tp * cp * dp)
                out += [
                    Layout(tp, pp, dp, zero, m, cp, ep, schedule, chunks, sp=tp > 1, micro_batch=micro_batch)
                    for schedule, chunks in pipeline_schedules(model.layers, pp, m, bool(model.experts))
                    for ep in eps
                    for zero in zeros
                ]
    return out


def pipeline_schedules(layers: int, pp: int, microbatches: int, moe: bool = False) -> list[tuple[str, int]]:
    """(schedule, chunks) the search tries on a pipeline of ``pp`` stages with ``microbatches``: none but 1F1B's
    trivial one without a pipeline; else 1F1B (PipeDream-Flush, Narayanan et al. 2021, §2.2.1), ZB-H1 (Qi et al.
    2023, §3.1; at least p microbatches, as every layout here has) and interleaved 1F1B with each v of
    :func:`interleave_chunks`: what the published runs the planner is checked against could run. For a mixture of
    experts (``moe``) also DualPipeV where it can run (:func:`v_schedules`), the schedule DeepSeek-V3 trained
    with, whose paired forward and backward hide the all-to-alls (DeepSeek-AI 2024, §3.2.1)."""
    if pp == 1:
        return [("1f1b", 1)]
    dualpipe = [("dualpipev", 1)] * (moe and "dualpipev" in v_schedules(layers, pp, microbatches))
    interleaved = [("interleaved", v) for v in interleave_chunks(layers, pp, microbatches)]
    return [("1f1b", 1), ("zb-h1", 1), *interleaved, *dualpipe]


def v_schedules(layers: int, pp: int, microbatches: int) -> list[str]:
    """The schedules past ZB-H1 a pipeline of ``pp`` stages can run ``microbatches`` with, where their bubble has
    its closed form: ZB-H2 (Qi et al. 2023, §3.1) and ZB-V (§6) with at least 2p-1 microbatches, DualPipeV
    (DeepSeek-AI 2024, §3.2.1) with at least 2p; the last two only if a stage's ceil(L/p) layers cut into the V's 2
    equal chunks."""
    out = ["zb-h2"] if microbatches >= 2 * pp - 1 else []
    if math.ceil(layers / pp) % 2 == 0:
        out += ["zb-v"] * (microbatches >= 2 * pp - 1) + ["dualpipev"] * (microbatches >= 2 * pp)
    return out


def interleave_chunks(layers: int, pp: int, microbatches: int) -> list[int]:
    """The v an interleaved schedule can split each stage into (Narayanan et al. 2021, §2.2.2): at least 2, a
    divisor of a full stage's ceil(L/p) layers (a stage one layer short, as Llama 3's first and last, has one
    chunk a layer short: its first or last chunk, the one next to the embedding or the head, Grattafiori et al.
    2024, §3.3.2), and only if the microbatches are a multiple of p, as Megatron-LM's implementation requires."""
    if pp == 1 or microbatches % pp:
        return []
    return [v for v in divisors(math.ceil(layers / pp)) if v > 1]


@cache
def groups(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every group of each axis, rank 0's first, each in increasing rank order, ranks placed as Llama 3 orders
    them, TP fastest, then CP, then PP, then DP (§3.3.2): rank = ((d x PP + p) x CP + c) x TP + t, as
    :mod:`course_lib.parallel.mesh` numbers them. An EP group is ``ep`` consecutive ranks of a stage's TP x CP x DP
    ranks in that order (Megatron-core's folding of EP into them); ``dp_cp``, the DP x CP ranks that average dense
    gradients; ``edp``, the expert-data-parallel groups, every ``ep``-th of a stage's TP x CP x DP ranks, holding
    the same experts."""
    ranks = np.arange(dp * pp * cp * tp).reshape(dp, pp, cp, tp)

    def last(*order: int, size: int) -> tuple[tuple[int, ...], ...]:  # the axes in ``order``, the group's last
        return tuple(map(tuple, ranks.transpose(*order).reshape(-1, size).tolist()))

    stages = ranks.transpose(1, 0, 2, 3).reshape(pp, -1)  # each stage's TP x CP x DP ranks, t fastest
    return {
        "tp": last(0, 1, 2, 3, size=tp),
        "cp": last(0, 1, 3, 2, size=cp),
        "pp": last(0, 2, 3, 1, size=pp),
        "dp": last(1, 2, 3, 0, size=dp),
        "dp_cp": last(1, 3, 0, 2, size=dp * cp),
        "ep": tuple(map(tuple, stages.reshape(-1, ep).tolist())),
        "edp": tuple(tuple(g) for stage in stages for g in stage.reshape(-1, ep).T.tolist()),
    }


# A layout's axes, innermost first as :func:`groups` numbers the ranks (EP folded into TP x CP x DP); the mesh
# lists its own outermost first (:data:`course_lib.parallel.mesh.AXES`).
LAYOUT_AXES = ("tp", "cp", "pp", "dp", "ep")
