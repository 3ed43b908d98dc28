"""Evaluating a layout: its memory per GPU (:func:`course_lib.model.formulas.memory_formula`, scaled for the pipeline
schedule's activations in flight), its step time by part (:func:`course_lib.planner.cost.step_time`), the FLOPs
rate and MFU it makes and where its groups sit (:func:`evaluate`); one given layout checked and evaluated
(:func:`evaluate_layout`, :func:`check_layout`); the network a plan is timed on (:func:`network`)."""

from __future__ import annotations

import math

from course_lib.cluster.network import Network
from course_lib.cluster.profiles import HardwareProfile, get_profile
from course_lib.cluster.topology import Topology, check_gpus, for_gpus, modeled
from course_lib.model.config import Layout, check_attention, check_recompute
from course_lib.model.formulas import memory_formula
from course_lib.model.stages import check_stage_layers
from course_lib.parallel.schedules import (
    PIPELINE_SCHEDULES,
    V_SHAPED,
    bubble_formula,
    bubble_ratio,
    check_v_chunks,
    peak_activations,
)
from course_lib.planner.cost import (
    PEAK,
    flops_per_token,
    hardware_flops_per_token,
    schedule_costs,
    step_time,
)
from course_lib.planner.layouts import (
    LAYOUT_AXES,
    SHORT_STAGES,
    Candidate,
    divisors,
    groups,
    schedule_name,
    splits_layers,
    stage_splits,
    v_schedules,
)
from course_lib.planner.presets import DEFAULT_GLOBAL_BATCH, Model, as_model


def placement(c: Candidate, net: Network) -> dict[str, dict]:
    """For each axis of groups of more than one GPU, where they sit
    (:meth:`course_lib.cluster.network.Network.where`)."""
    return {
        axis: net.where(ranks)
        for axis, ranks in groups(c.tp, c.pp, c.dp, c.cp, c.ep).items()
        if axis in LAYOUT_AXES and len(ranks[0]) > 1
    }


def evaluate(
    model: Model, layout: Layout, gpus: int, net: Network, gpu_mem: float, global_batch: int, precision: str
) -> Candidate:
    """Memory (:func:`memory_formula`, TP with SP where the layout asks for it and TP splits, experts over EP,
    activations over CP and for an interleaved schedule's chunks), bubble, step time, FLOPs and their rate, and
    placement of one layout."""
    tp, pp, dp, zero, m, cp, ep, schedule, chunks, sp, recompute, attention, micro_batch, stage_layers = layout
    sp = sp and tp > 1
    memory = memory_formula(model.params, precision, layout._replace(sp=sp), **model.memory_shape())
    _schedule_activations(memory, schedule, pp, m)
    c = Candidate(tp, pp, dp, zero, m, recompute, memory["total"] <= gpu_mem, memory["total"], 0.0, 0.0, memory)
    c.cp, c.ep, c.schedule, c.chunks, c.attention, c.sp = cp, ep, schedule, chunks, attention, sp
    c.stage_layers = stage_layers
    c.bubble_fraction = bubble_formula(schedule, pp, m, chunks, schedule_costs(recompute)) if pp > 1 else 0.0
    c.time = step_time(model, c, micro_batch, net, precision)
    c.step_time_s = sum(c.time.values())
    _throughput(model, c, gpus, global_batch, net.profile, precision)
    c.placement = placement(c, net)
    return c


def evaluate_splits(
    model: Model, layout: Layout, gpus: int, net: Network, gpu_mem: float, global_batch: int, precision: str
) -> Candidate:
    """:func:`evaluate` with each stage split the layout can take (:func:`stage_splits`: the even one, and the one
    that counts the embedding and the head as layers), keeping the even split unless the other fits where it does
    not, or is faster, or as fast with less memory on its busiest stage."""
    tried = [
        evaluate(model, layout._replace(stage_layers=split), gpus, net, gpu_mem, global_batch, precision)
        for split in stage_splits(model.layers, layout.pp, layout.schedule)
    ]
    return min(tried, key=lambda c: (not c.fits, c.step_time_s, c.memory_per_gpu_bytes))


def _schedule_activations(memory: dict, schedule: str, pp: int, m: int) -> None:
    """Scale :func:`memory_formula`'s 1F1B activations (the interleaved schedule's it scales itself) by the
    microbatches a schedule keeps in flight over 1F1B's p (:func:`course_lib.parallel.schedules.peak_activations`):
    ZB-H2 (2p-1)/p, ZB-V 1, DualPipeV (p+1/2)/p. The busiest stage's whole estimate is scaled, its embedding and
    head terms too, as memory_formula does for the interleaved schedule."""
    if schedule in ("zb-h2", "zb-v", "dualpipev"):
        extra = (peak_activations(schedule, pp, m) / peak_activations("1f1b", pp, m) - 1) * memory["activations"]
        memory["activations"] += extra
        memory["total"] += extra


def _throughput(
    model: Model, c: Candidate, gpus: int, global_batch: int, profile: HardwareProfile, precision: str
) -> None:
    """Fill in the step's model and hardware FLOPs, their rate per GPU and their utilization of the peak."""
    tokens = global_batch * model.seq
    c.model_flops = flops_per_token(model) * tokens
    c.hardware_flops = hardware_flops_per_token(model, c.recompute, c.attention) * tokens
    per_gpu_second = c.step_time_s * gpus
    c.tflops_per_gpu = c.model_flops / per_gpu_second / 1e12
    c.hardware_tflops_per_gpu = c.hardware_flops / per_gpu_second / 1e12
    c.mfu = c.model_flops / per_gpu_second / profile.peak_flops[PEAK[precision]]
    c.hfu = c.hardware_flops / per_gpu_second / profile.peak_flops[PEAK[precision]]


def check_settings(gpus: int, gpus_per_node: int, global_batch: int, micro_batch: int, precision: str) -> None:
    """Refuse a cluster, batch or precision the planner cannot work with, saying what to change."""
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("global_batch", global_batch)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, not {micro_batch}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(
            f"{gpus} GPUs are not a whole number of {gpus_per_node}-GPU nodes: give a multiple of {gpus_per_node}"
        )
    if precision not in PEAK:
        raise ValueError(f"precision must be one of {sorted(PEAK)}, not {precision!r}")


def network(profile: HardwareProfile, gpus: int, gpus_per_node: int | None, topology: str | Topology | None) -> Network:
    """The :class:`course_lib.cluster.network.Network` a plan is timed on: the profile's nodes (of ``gpus_per_node``),
    or ``topology`` sized to ``gpus`` (:func:`course_lib.cluster.topology.for_gpus`); not both. More GPUs than
    :data:`course_lib.cluster.topology.MAX_GPUS` are refused first, so that no count of them takes long."""
    check_gpus(gpus)
    if topology is None:
        return Network(profile, gpus_per_node or profile.gpus_per_node)
    if gpus_per_node is not None:
        raise ValueError("a topology says which GPUs share a node; drop gpus_per_node")
    topo = modeled(for_gpus(topology, gpus) if isinstance(topology, str) else topology)
    if topo.n_gpus != gpus:
        raise ValueError(f"{topo.name} has {topo.n_gpus} GPUs, not the plan's {gpus}; give a topology of {gpus}")
    return Network(profile, profile.gpus_per_node, topo)  # with a topology, its domain replaces the nodes


def evaluate_layout(
    model: Model | str | float,
    gpus: int,
    layout: Layout,
    *,
    lowest_fitting_zero: bool = False,
    global_batch: int | None = None,
    hardware: str = "h100",
    gpus_per_node: int | None = None,
    gpu_mem_bytes: float | None = None,
    precision: str = "mixed",
    topology: str | Topology | None = None,
) -> Candidate:
    """One given ``layout`` of ``model`` (a :class:`Model`, a preset name or a parameter count) on ``gpus`` GPUs,
    as the planner evaluates its own (:func:`evaluate`): memory, step time and its parts, FLOPs, TFLOP/s per GPU
    and MFU. Its microbatches are those the global batch (the model's published one unless given, else
    ``DEFAULT_GLOBAL_BATCH``) leaves each DP rank, whatever ``layout.microbatches`` says; sequence parallelism
    applies only with TP > 1. With ``lowest_fitting_zero`` the ZeRO stage is the lowest that fits (the lowest of
    all if none does) instead of ``layout.zero``. A layout that cannot run raises ValueError saying how to fix it
    (:func:`check_layout`). ``topology``: as for :func:`course_lib.planner.search.plan`."""
    model = as_model(model)
    profile = get_profile(hardware)
    net = network(profile, gpus, gpus_per_node, topology)
    batch = global_batch or model.global_batch or DEFAULT_GLOBAL_BATCH
    check_settings(gpus, net.domain, batch, layout.micro_batch, precision)
    check_layout(model, gpus, layout, batch)
    layout = layout._replace(microbatches=batch // (layout.dp * layout.micro_batch))
    if layout.schedule in V_SHAPED:  # its 2 chunks a rank are the V's own: chunks stays 1 for the formulas
        layout = layout._replace(chunks=1)
    zeros = _zero_stages(layout) if lowest_fitting_zero else [layout.zero]
    gpu_mem = gpu_mem_bytes or profile.memory_bytes
    tried = [evaluate(model, layout._replace(zero=z), gpus, net, gpu_mem, batch, precision) for z in zeros]
    return next((c for c in tried if c.fits), tried[0])


def _zero_stages(layout: Layout) -> list[int]:
    """The ZeRO stages a layout can run, lowest first: none without DP x CP ranks to shard over, 3 (FSDP) only
    without TP and PP."""
    if layout.dp * layout.cp == 1:
        return [0]
    return [0, 1, 2] + [3] * (layout.tp == layout.pp == 1)


def check_layout(model: Model, gpus: int, layout: Layout, global_batch: int) -> None:
    """Refuse a layout that cannot run, in one sentence that says what to change."""
    for name in ("tp", "pp", "dp", "cp", "ep"):
        if getattr(layout, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(layout, name)}")
    _check_degrees(model, gpus, layout)
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {layout.zero}")
    check_recompute(layout.recompute)
    check_attention(layout.attention)
    dp, micro_batch, recompute = layout.dp, layout.micro_batch, layout.recompute
    m, rest = divmod(global_batch, dp * micro_batch)
    if rest:
        raise ValueError(
            f"a global batch of {global_batch} sequences does not split into micro-batches of {micro_batch} over "
            f"DP {dp}: make the global batch a multiple of DP x micro-batch = {dp * micro_batch}"
        )
    _check_schedule(model, layout, m)
    pp, schedule, chunks = layout.pp, layout.schedule, layout.chunks
    check_stage_layers(pp, layout.stage_layers, model.layers)
    if layout.stage_layers and schedule not in ("1f1b", "zb-h1"):
        raise ValueError(
            f"uneven stages give each rank one stage; {schedule_name(schedule, chunks)} holds 2 or more chunks a "
            "rank: use --schedule 1f1b or zb-h1, or leave out --stage-layers"
        )
    if pp > 1 and bubble_ratio(schedule, pp, m, chunks, schedule_costs(recompute)) is None:
        raise ValueError(
            f"{schedule_name(schedule, chunks)} has no closed-form bubble with {recompute} recompute (B = "
            f"{schedule_costs(recompute).b:g} F): use recompute none or selective, or another schedule"
        )


def _check_degrees(model: Model, gpus: int, layout: Layout) -> None:
    tp, pp, dp, cp, ep = layout.tp, layout.pp, layout.dp, layout.cp, layout.ep
    if tp * cp * pp * dp != gpus:
        rest, left = divmod(gpus, tp * cp * pp)
        fix = f"give DP {rest}" if not left else f"choose degrees whose product is {gpus}"
        raise ValueError(f"TP {tp} x CP {cp} x PP {pp} x DP {dp} = {tp * cp * pp * dp} GPUs, not {gpus}: {fix}")
    if model.heads % tp:
        raise ValueError(
            f"TP {tp} does not divide the {model.heads} attention heads: choose a TP that divides {model.heads}"
        )
    if not splits_layers(model.layers, pp):
        raise ValueError(
            f"{model.layers} layers do not split into {pp} stages (ceil(L/p) layers each, at most {SHORT_STAGES} "
            f"stages one layer short): choose PP among {[p for p in divisors(gpus) if splits_layers(model.layers, p)]}"
        )
    if cp > 1 and model.seq % (2 * cp):
        raise ValueError(
            f"CP {cp} cuts each sequence into 2 x CP = {2 * cp} chunks: seq {model.seq} is not a multiple of "
            f"{2 * cp}; choose another CP or sequence length"
        )
    if ep > 1 and not model.experts:
        raise ValueError(f"EP {ep} needs a mixture of experts; {model.name} has none: use EP 1")
    if ep > 1:
        model.experts.check(model.layers, ep)
        if (tp * cp * dp) % ep:
            raise ValueError(f"EP {ep} is carved out of TP x CP x DP = {tp * cp * dp} ranks: choose an EP dividing it")


def _check_schedule(model: Model, layout: Layout, m: int) -> None:
    pp, dp, schedule, chunks, micro_batch = layout.pp, layout.dp, layout.schedule, layout.chunks, layout.micro_batch
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    check_v_chunks(schedule, chunks)
    if chunks > 1 and schedule not in ("interleaved", *V_SHAPED):
        raise ValueError(f"{chunks} chunks per rank need the interleaved schedule, not {schedule}")
    if pp == 1:
        if schedule != "1f1b":
            raise ValueError(f"the {schedule} schedule needs a pipeline: give PP of at least 2")
        return
    if m < pp:
        raise ValueError(
            f"{m} microbatches per DP rank are fewer than the {pp} pipeline stages: raise the global batch to at "
            f"least PP x DP x micro-batch = {pp * dp * micro_batch} sequences, or use fewer stages"
        )
    if schedule in ("zb-h2", "zb-v", "dualpipev") and schedule not in v_schedules(model.layers, pp, m):
        need = 2 * pp if schedule == "dualpipev" else 2 * pp - 1
        if m < need:
            raise ValueError(
                f"{schedule_name(schedule)} on PP {pp} needs at least {need} microbatches per DP rank, not {m}: make "
                f"the global batch at least {need * dp * micro_batch} sequences"
            )
        raise ValueError(
            f"{schedule_name(schedule)} cuts each stage's {math.ceil(model.layers / pp)} layers into a V's 2 chunks: "
            "choose a PP that leaves an even number of layers per stage"
        )
    if schedule == "interleaved":
        stage = math.ceil(model.layers / pp)
        if chunks < 2:
            raise ValueError("the interleaved schedule needs at least 2 chunks per rank: give chunks (v) of 2 or more")
        if m % pp:
            raise ValueError(
                f"the interleaved schedule runs microbatches in groups of PP = {pp} (Megatron-LM): {m} microbatches "
                f"per DP rank are not a multiple of {pp}; make the global batch a multiple of {pp * dp * micro_batch}"
            )
        if stage % chunks:
            raise ValueError(
                f"{chunks} chunks do not divide a stage's {stage} layers: choose v among "
                f"{[v for v in divisors(stage) if v > 1]}"
            )
