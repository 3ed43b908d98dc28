"""Why the planner chose what it chose: sentences with numbers on the model, the decision tree, memory, where the
groups sit, the pipeline and its schedules (with those past ZB-H1 evaluated beside the choice,
:func:`beyond_search`), the step time, and the alternatives: FSDP and the published layout
(:func:`published_candidate`)."""

from __future__ import annotations

import math

from course_lib.cluster.profiles import HardwareProfile
from course_lib.cluster.topology import Torus
from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.config import BYTES_PER_PARAM, Layout
from course_lib.model.formulas import interleaved_activation_factor, model_state_formula
from course_lib.parallel.schedules import bubble_ratio
from course_lib.planner.cost import PEAK, hardware_flops_per_token, schedule_costs
from course_lib.planner.evaluate import evaluate, evaluate_splits
from course_lib.planner.layouts import (
    CLOSE,
    LAYOUT_AXES,
    SHAPES,
    Candidate,
    Plan,
    describe,
    divisors,
    in_shape,
    pipeline_schedules,
    schedule_name,
    split_text,
    splits_heads,
    stage_splits,
    v_schedules,
)
from course_lib.planner.presets import Model


def format_bytes(x: float) -> str:
    """``x`` bytes in TB (from 1 TB) or GB, as the reasons write them."""
    return f"{x / 1e12:.2f} TB" if x >= 1e12 else f"{x / 1e9:.1f} GB"


def explain(
    p: Plan,
    profile: HardwareProfile,
    tree_best: Candidate | None,
    first_try: Candidate,
    without_cp: list[Candidate] | None = None,
) -> list[str]:
    """Sentences, with numbers, for the choice: the model, the tree, memory, placement, pipeline, time."""
    reasons = [_model_reason(p.model)]
    reasons += _tree_reasons(p, tree_best)
    if p.recompute == "selective":
        price = hardware_flops_per_token(p.model, "selective", p.attention) / hardware_flops_per_token(
            p.model, "none", p.attention
        )
        reasons.append(
            f"Nothing fits while keeping the attention scores (Korthikanti et al.'s 5as/h term: the smallest layout "
            f"needs {format_bytes(first_try.memory_per_gpu_bytes)}); selective recompute drops them (so does "
            f"FlashAttention, which never stores them), for {price - 1:.1%} more FLOPs: the scores computed again "
            "in backward (lesson 01 measures the price on the tiny GPT)."
        )
    if without_cp is not None:
        reasons.append(_cp_reason(p, without_cp))
    reasons.append(_memory_reason(p))
    reasons += _placement_reasons(p)
    if p.pp > 1:
        reasons.append(_pipeline_reason(p))
    reasons.append(_time_reason(p, profile))
    reasons += _alternative_reasons(p)
    return reasons


def _cp_reason(p: Plan, without_cp: list[Candidate]) -> str:
    """Why context parallelism: nothing fits without it, or no layout without it splits the batch."""
    why = (
        f"the smallest such layout, {describe(without_cp[0])}, needs {format_bytes(without_cp[0].memory_per_gpu_bytes)}"
        if without_cp
        else f"no layout without it splits {p.global_batch} sequences of {p.micro_batch} per DP rank over {p.gpus} "
        f"GPUs (at most TP {p.gpus_per_node} x PP x DP = {p.gpus_per_node * p.global_batch // p.micro_batch}, "
        "with PP no more than the microbatches)"
    )
    return (
        f"Context parallelism, because nothing fits without it, even with selective recompute: at {p.model.seq:,} "
        f"tokens {why}. CP {p.cp} splits every sequence over its ranks, and their activations with it (ring "
        f"attention, Liu et al. 2023; Llama 3 §3.3.2 for its 128K stage)."
    )


def _model_reason(model: Model) -> str:
    text = (
        f"{model.name}: {model.params / 1e9:.1f}B parameters, {model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads, sequences of {model.seq}"
    )
    if model.nominal:
        return text + (
            ". Only the parameter count was given: these dims are a GPT-3-like stand-in (hidden = 128 x layers, "
            "heads of 128; Brown et al. 2020, Table 2.1) for the activations and traffic; give the real ones."
        )
    e = model.experts
    if e:
        shared = f" and {e.shared} shared" if e.shared else ""
        dense = f" in {model.moe_layers} of its {model.layers} layers" if e.dense_layers else ""
        return text + (
            f". A mixture of experts, {e.routed} routed experts{shared} of FFN {e.ffn}, top-{e.top_k}{dense}: memory "
            f"holds all {model.params / 1e9:.1f}B parameters, {model.expert_params / 1e9:.1f}B of them routed experts "
            f"that expert parallelism (EP) splits, and each token computes with {model.active_params / 1e9:.1f}B "
            f"active ones, the compute ({model.source})."
        )
    return text + f" ({model.source})." if model.source else text + "."


def _tree_reasons(p: Plan, tree_best: Candidate | None) -> list[str]:
    states = sum(model_state_formula(p.model.params, p.precision).values())
    node = min(p.gpus, p.gpus_per_node)
    gpu = format_bytes(p.gpu_mem_bytes)
    node_mem = f"{node} x {gpu} = {format_bytes(node * p.gpu_mem_bytes)}"
    where = {
        "dp": f"fit one GPU ({gpu})",
        "fsdp": f"exceed one GPU ({gpu})",
        "tp": f"fit one node ({node_mem})",
        "3d": f"exceed one node ({node_mem})",
        "ep": f"exceed one GPU ({gpu}), mostly in experts",
    }[p.shape]
    out = [
        f"Model states, {sum(BYTES_PER_PARAM[p.precision].values())} bytes per parameter with {p.precision} Adam, "
        f"{format_bytes(states)}, {where}: the decision tree says {SHAPES[p.shape]}."
    ]
    best = p.candidates[0]
    if tree_best is None:
        out.append(f"No layout of that shape fits; the fastest that fits is chosen: {describe(p)}.")
    elif tree_best is best:
        out.append(f"{describe(p)} has that shape and is also the fastest estimate.")
    elif in_shape(p, p.shape, p.gpus_per_node):
        out.append(
            f"{describe(p)} has that shape; the fastest estimate, {describe(best)}, is only "
            f"{1 - best.step_time_s / p.step_time_s:.1%} faster, within the {CLOSE:.0%} this estimate can tell."
        )
    else:
        out.append(
            f"The best layout of that shape, {describe(tree_best)}, is estimated "
            f"{tree_best.step_time_s / best.step_time_s - 1:.0%} slower than {describe(p)}, which is chosen."
        )
    return out


def _memory_reason(p: Plan) -> str:
    parts = ", ".join(f"{k} {p.memory[k] / 1e9:.3g}" for k in (*CATEGORIES, "activations"))
    edp = p.tp * p.cp * p.dp // p.ep
    experts = (
        f"; the routed experts' over EP x PP = {p.ep * p.pp}"
        + (f" and ZeRO-{p.zero} over the {edp} expert-data-parallel ranks (TP x CP x DP / EP)" if p.zero else "")
        if p.model.experts
        else ""
    )
    splits = [f"{p.tp} ways by TP with sequence parallelism"] * (p.tp > 1) + [f"{p.cp} ways by CP"] * (p.cp > 1)
    return (
        f"Per GPU: {format_bytes(p.memory_per_gpu_bytes)} of {format_bytes(p.gpu_mem_bytes)} (GB: {parts}), as "
        f"`python -m course_lib memory` computes it: {'dense ' * bool(p.model.experts)}model states over TP x PP = "
        f"{p.tp * p.pp}"
        + (f" and ZeRO-{p.zero} over DP x CP = {p.dp * p.cp}" if p.zero else "")
        + experts
        + (f"; activations split {' and '.join(splits)}" if splits else "")
        + "."
    )


def _placement_reasons(p: Plan) -> list[str]:
    out = [] if p.network.topology is None else [_topology_reason(p)]
    return out + (placement_sentences(p.placement) or ["One GPU: no group, no traffic."])


def placement_sentences(where: dict[str, dict]) -> list[str]:
    """One sentence per axis of a layout's :func:`~course_lib.planner.evaluate.placement`: the group's size, where it
    sits and its link."""
    names = {"tp": "TP group", "cp": "CP ring", "pp": "pipeline", "dp": "DP group", "ep": "EP group (all-to-all)"}
    out = []
    for axis, g in where.items():
        place = "sits " + g["where"] if "where" in g else "spans nodes" if g["spans_nodes"] else "sits inside a node"
        hops = f", up to {g['hops']} hops" if "hops" in g else ""
        out.append(f"The {names[axis]} of {g['size']} {place} ({g['bandwidth'] / 1e9:g} GB/s per GPU{hops}).")
    return out


def _topology_reason(p: Plan) -> str:
    """What the topology lets the layout do, and which of its axes the fast links carry (issue 22)."""
    topo = p.network.topology
    fast = [f"{axis.upper()} {g['size']}" for axis, g in p.placement.items() if not g["spans_nodes"]]
    slow = [f"{axis.upper()} {g['size']}" for axis, g in p.placement.items() if g["spans_nodes"]]
    degrees = [t for t in divisors(p.network.domain) if splits_heads(p.model, t)]
    if isinstance(topo, Torus):
        links = (
            f"a {'x'.join(map(str, topo.shape))} torus, every chip on {topo.link_bandwidth / 1e9:g} GB/s links to "
            f"its neighbours ({topo.hop_latency * 1e6:g} us a hop), no slower network inside it"
        )
        fast_place, slow_place = "a box of neighbouring chips", "scattered, more hops apart"
    else:
        links = (
            f"NVLink domains of {topo.gpus_per_domain} GPUs at {topo.nvlink_bandwidth / 1e9:g} GB/s per GPU each way, "
            f"{topo.nic_bandwidth / 1e9:g} GB/s NICs between them"
            + (f", {topo.oversubscription:g}:1 oversubscribed above the leaves" if topo.oversubscription > 1 else "")
        )
        fast_place, slow_place = "one NVLink domain", "across domains"
    return (
        f"Timed on {topo.name} ({links}; compute and memory stay {p.hardware}'s): TP may be any of {degrees} (dividing "
        f"the {p.model.heads} heads and the {p.network.domain} GPUs TP may span here). On {fast_place}: "
        f"{', '.join(fast) or 'no group'}; {slow_place}: {', '.join(slow) or 'no group'}."
    )


def _pipeline_reason(p: Plan) -> str:
    bubble = {
        "1f1b": "(p-1)/(m+p-1)",
        "interleaved": "(p-1)/(v m+p-1)",
        "zb-h1": "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))",
        "dualpipev": "(p-1)(F+2B-W)/2 over m(F+B+W) plus itself",
    }[p.schedule]
    memory = (
        f"1 + (p-1)/(p v) = {interleaved_activation_factor(p.pp, p.chunks):.3g} times that"
        if p.schedule == "interleaved"
        else "the same"
    )
    text = (
        f"{_schedule_sentence(p)} over {p.pp} stages with {p.microbatches} microbatches of {p.micro_batch} per DP "
        f"rank: bubble {bubble} = {p.bubble_fraction:.1%}. 1F1B's first stage keeps {p.pp} microbatches of its layers "
        f"in flight, one microbatch's worth of all {p.model.layers} layers; {schedule_name(p.schedule, p.chunks)} "
        f"holds {memory}."
    )
    same = (p.tp, p.cp, p.pp, p.dp, p.ep, p.zero, p.recompute)
    rest = sorted(
        (
            c
            for c in p.candidates
            if (c.tp, c.cp, c.pp, c.dp, c.ep, c.zero, c.recompute) == same
            and (c.schedule, c.chunks) != (p.schedule, p.chunks)
        ),
        key=lambda c: (not c.fits, c.step_time_s),
    )
    if rest:
        text += " The same layout with other schedules: " + ", ".join(
            f"{schedule_name(c.schedule, c.chunks)} {c.step_time_s:.3g} s" + ("" if c.fits else " (does not fit)")
            for c in rest[:4]
        )
        text += "."
    return text + _beyond_search_reason(p) + _split_reason(p)


def _split_reason(p: Plan) -> str:
    """How the layers split into the stages: the even split, or (when the search took it,
    :func:`~course_lib.planner.evaluate.evaluate_splits`) the one that counts the embedding and the head as layers,
    with the memory and time it saves against the even split, evaluated here."""
    layers, even = p.model.layers, stage_splits(p.model.layers, p.pp, p.schedule)[0]
    if p.stage_layers and p.stage_layers != even:
        args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.precision)
        other = evaluate(p.model, p.layout._replace(stage_layers=even), *args)
        faster = (
            f", and the step takes {p.step_time_s:.3g} s instead of {other.step_time_s:.3g} s"
            if p.step_time_s < other.step_time_s
            else ""
        )
        return (
            f" Stages {split_text(p.stage_layers)}: the embedding and the head take a layer's place on the first and "
            f"last stage (as BLOOM and Llama 3 split theirs), so the busiest stage ({p.memory['stage']}) holds "
            f"{format_bytes(p.memory_per_gpu_bytes)} instead of {format_bytes(other.memory_per_gpu_bytes)} with "
            f"{split_text(even) if even else f'{layers // p.pp} layers a stage'}"
            + ("" if other.fits else ", which does not fit")
            + f"{faster}."
        )
    if not layers % p.pp:
        return ""
    if p.stage_layers:
        return (
            f" {layers} layers do not split evenly into {p.pp} stages: {split_text(p.stage_layers)}, the last "
            f"{p.pp * math.ceil(layers / p.pp) - layers} a layer short; memory counts each stage's own layers, as "
            "`memory --stage-layers` does."
        )
    return (
        f" {layers} layers do not split evenly into {p.pp} stages of {schedule_name(p.schedule, p.chunks)}'s chunks: "
        f"memory counts {layers}/{p.pp} layers a stage and the embedding on the busiest, as the memory command does."
    )


def beyond_search(p: Plan) -> list[Candidate]:
    """The plan's layout evaluated with each schedule past ZB-H1 it can run (:func:`v_schedules`) that the search
    did not rank (:func:`pipeline_schedules`): their bubble, activations and step time beside the choice."""
    if p.pp == 1:
        return []
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.precision)
    ranked = pipeline_schedules(p.model.layers, p.pp, p.microbatches, bool(p.model.experts))
    return [
        evaluate(p.model, p.layout._replace(schedule=s, chunks=1, stage_layers=()), *args)
        for s in v_schedules(p.model.layers, p.pp, p.microbatches)
        if (s, 1) not in ranked and bubble_ratio(s, p.pp, p.microbatches, 1, schedule_costs(p.recompute)) is not None
    ]


def _beyond_search_reason(p: Plan) -> str:
    others = beyond_search(p)
    if not others:
        return ""
    return (
        " Past ZB-H1, not ranked by the search: "
        + ", ".join(
            f"{schedule_name(c.schedule)} {c.step_time_s:.3g} s (bubble {c.bubble_fraction:.1%}, activations "
            f"{c.memory['activations'] / 1e9:.3g} GB" + ("" if c.fits else ", does not fit") + ")"
            for c in others
        )
        + "."
    )


def _schedule_sentence(p: Candidate) -> str:
    return {
        "1f1b": "1F1B (PipeDream-Flush, Narayanan et al. 2021, §2.2.1)",
        "interleaved": f"Interleaved 1F1B with v = {p.chunks} chunks per rank (Narayanan et al. 2021, §2.2.2)",
        "zb-h1": "ZB-H1 (Qi et al. 2023, §3.1: the weight-gradient passes fill the waits)",
        "dualpipev": "DualPipeV (DeepSeek-AI 2024, §3.2.1: DualPipe in one V, a forward paired with another "
        "microbatch's backward)",
    }[p.schedule]


def _time_reason(p: Plan, profile: HardwareProfile) -> str:
    t = p.time
    peak = profile.peak_flops[PEAK[p.precision]]
    text = (
        f"Estimated step {p.step_time_s:.3g} s: compute {t['compute_s']:.3g} s (matmuls at "
        f"{profile.matmul_efficiency:.0%} of {peak / 1e12:g} TFLOP/s, attention at {profile.attention_efficiency:.0%}, "
        f"element-wise work at {profile.hbm_bandwidth / 1e12:g} TB/s"
        + (f"; {p.model.active_params / 1e9:.1f}B active parameters a token" if p.model.experts else "")
        + f"), bubble {t['bubble_s']:.3g} s, TP {t['tp_comm_s']:.3g} s, PP {t['pp_comm_s']:.3g} s, "
        + (f"CP ring exposed {t['cp_comm_exposed_s']:.3g} s, " if p.cp > 1 else "")
        + (f"EP all-to-all exposed {t['ep_comm_s']:.3g} s, " if p.ep > 1 else "")
        + f"exposed DP {t['dp_comm_exposed_s']:.3g} s: {p.tflops_per_gpu:.0f} TFLOP/s per GPU of model FLOPs, MFU "
        f"{p.mfu:.1%}"
        + (f" ({p.hardware_tflops_per_gpu:.0f} TFLOP/s with the recomputed forward)" if p.recompute != "none" else "")
        + "."
    )
    if p.zero >= 2 and t["dp_comm_exposed_s"] > t["compute_s"] / 4:
        text += (
            f" ZeRO-{p.zero} moves its shards again for each of the {p.microbatches} microbatches: fewer, larger "
            f"ones (a bigger micro-batch, made affordable by full recompute) would cut that."
        )
    return text


def _alternative_reasons(p: Plan) -> list[str]:
    """FSDP as the alternative (when not chosen), and where the published layout lands."""
    out = []
    fsdp = next((c for c in p.candidates if c.tp == c.pp == c.cp == 1 and c.zero == 3), None)
    if fsdp is not None and p.zero != 3:
        verdict = f"fits, step {fsdp.step_time_s:.3g} s" if fsdp.fits else "does not fit"
        out.append(
            f"FSDP (ZeRO-3 over all {p.gpus} GPUs, no model parallelism) would need "
            f"{format_bytes(fsdp.memory_per_gpu_bytes)} per GPU, {format_bytes(fsdp.memory['activations'])} of it "
            f"activations that only TP splits: {verdict}."
        )
    if p.model.published and published_gpus(p.model.published) == p.gpus:
        published = published_candidate(p)
        out.append(_published_reason(p, published))
        if (
            published is not None
            and published.fits
            and p.step_time_s < published.step_time_s <= p.step_time_s * (1 + CLOSE)
        ):
            out.append(_preference_reason(p, published))
    return out


# Why the choice is estimated faster than a published layout that fits, by the part of the step that differs most.
PREFERS_BECAUSE = {
    "compute_s": "with fewer layers a stage, the last stage's output head outweighs the layer it lacks, and every "
    "stage runs at the slowest one's pace",
    "bubble_s": "its pipeline idles less",
    "ep_comm_s": "less of its all-to-all is left exposed",
    "tp_comm_s": "less TP traffic in every layer",
    "pp_comm_s": "fewer stages send fewer activations",
    "cp_comm_exposed_s": "less of the CP ring is exposed",
    "dp_comm_exposed_s": "less data-parallel traffic is left unhidden",
}


def _preference_reason(p: Plan, published: Candidate) -> str:
    """One line: why the choice is preferred to a published layout estimated within ``CLOSE`` of it (evaluated as
    :func:`published_candidate` does), by the part of the step it saves most on (a published layout further off
    gets :data:`SLOWER_BECAUSE` in :func:`_published_reason`)."""
    part = max(p.time, key=lambda k: published.time[k] - p.time[k])
    gap = published.step_time_s / p.step_time_s - 1
    return (
        f"Preferred to the published layout ({describe(published)}): {gap:.1%} faster here, within the {CLOSE:.0%} "
        "this estimate can tell "
        f"({p.step_time_s:.3g} s against {published.step_time_s:.3g} s), mostly {part[:-2].replace('_', ' ')} "
        f"({p.time[part]:.3g} s against {published.time[part]:.3g} s): {PREFERS_BECAUSE[part]}."
    )


# Why a published layout can be estimated slower than the choice, by the part of the step that differs most.
SLOWER_BECAUSE = {
    "bubble_s": "its pipeline idles more, even with the schedule that suits it best among those that fit here; "
    "Llama 3 interleaves its stages, idling less for more activation memory than this memory model leaves",
    "ep_comm_s": "more of its all-to-alls are exposed: they cross InfiniBand, and a schedule that does not pair one "
    "microbatch's forward with another's backward cannot hide them (DeepSeek-V3's DualPipe does, §3.2.1)",
    "tp_comm_s": "TP's all-reduces in every layer are not overlapped",
    "pp_comm_s": "more stages send more activations",
    "cp_comm_exposed_s": "the CP ring's traffic exceeds the attention compute it hides behind",
    "dp_comm_exposed_s": "ZeRO's traffic is not hidden by the backward",
}


def _published_reason(p: Plan, c: Candidate | None) -> str:
    layout = describe_published(p.model.published)
    if c is None:
        return f"Published: {layout}; not among the layouts considered here (it does not split the batch)."
    if not c.fits:
        return f"Published: {layout}; here it needs {format_bytes(c.memory_per_gpu_bytes)}: no fit."
    fitting = [x for x in p.candidates if x.fits]
    recompute = f", {c.recompute} recompute" if c.recompute != p.recompute else ""
    text = (
        f"Published: {layout}; here it fits with ZeRO-{c.zero}{recompute} at {format_bytes(c.memory_per_gpu_bytes)} "
        f"and ranks {1 + sum(x.step_time_s < c.step_time_s for x in fitting)} of {len(fitting)} fitting layouts "
        f"({c.step_time_s:.3g} s)"
    )
    if c.step_time_s <= p.step_time_s * (1 + CLOSE):
        return text + "."
    part = max(c.time, key=lambda k: c.time[k] - p.time[k])
    return text + (
        f", {c.step_time_s / p.step_time_s - 1:.0%} slower than the choice, mostly {part[:-2].replace('_', ' ')} "
        f"({c.time[part]:.3g} s against {p.time[part]:.3g} s): {SLOWER_BECAUSE[part]}."
    )


def published_candidate(p: Plan) -> Candidate | None:
    """The published layout (:attr:`Model.published`) evaluated as the planner evaluates its own, on the plan's
    GPUs and batch: at its ZeRO stage where the source states one, else the lowest that fits; without recompute
    if that fits, else selective; with the fastest schedule that fits (:func:`pipeline_schedules`) and the stage
    split the planner would give it (:func:`course_lib.planner.evaluate.evaluate_splits`). None if its axes do not
    split the batch."""
    pub = {axis: p.model.published.get(axis, 1) for axis in LAYOUT_AXES}
    m, rest = divmod(p.global_batch, pub["dp"] * p.micro_batch)
    if rest or m < pub["pp"]:
        return None
    zeros = [p.model.published["zero"]] if "zero" in p.model.published else [0, 1, 2]
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.precision)
    schedules = pipeline_schedules(p.model.layers, pub["pp"], m, bool(p.model.experts))
    tried = []
    for recompute in ("none", "selective"):
        for zero in zeros:
            sizes = (pub["tp"], pub["pp"], pub["dp"], zero, m, pub["cp"], pub["ep"])
            settings = {"sp": pub["tp"] > 1, "recompute": recompute, "micro_batch": p.micro_batch}
            tried = [evaluate_splits(p.model, Layout(*sizes, *s, **settings), *args) for s in schedules]
            fitting = [c for c in tried if c.fits]
            if fitting:
                return min(fitting, key=lambda c: c.step_time_s)
    return tried[0]


def published_gpus(published: dict[str, int]) -> int:
    """The GPUs a published layout's axes multiply to (EP is carved out of the others, not a factor)."""
    return math.prod(published.get(axis, 1) for axis in ("tp", "cp", "pp", "dp"))


def describe_published(published: dict[str, int]) -> str:
    """A published layout as :func:`describe` writes a candidate's (ZeRO only where the source states it)."""
    sizes = {axis: published.get(axis, 1) for axis in LAYOUT_AXES}
    zero = published.get("zero", 0)
    return describe(
        Candidate(
            **sizes,
            zero=zero,
            microbatches=0,
            recompute="",
            fits=False,
            memory_per_gpu_bytes=0.0,
            bubble_fraction=0.0,
            step_time_s=0.0,
        ),
        "zero" in published,
    )
