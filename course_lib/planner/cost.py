"""What a step costs on a cluster: the model and hardware FLOPs a token takes (:func:`flops_per_token`,
:func:`hardware_flops_per_token`), one stage's compute at the profile's matmul rate and memory bandwidth
(:func:`stage_seconds`), the exposed TP, PP, CP, EP and DP traffic timed on a
:class:`~course_lib.cluster.network.Network`, and the step time by part with the schedule's bubble (:func:`step_time`;
Narayanan et al. 2021, §2.2, §3.3, §5.1; Korthikanti et al. 2022, §4-5; the assumptions:
``course_lib.cluster.profiles.TIME_MODEL_ASSUMPTIONS``)."""

from __future__ import annotations

from functools import cache

from course_lib.cluster.network import Network
from course_lib.cluster.profiles import HardwareProfile
from course_lib.model.config import BYTES_PER_PARAM, Layout
from course_lib.model.stages import even_counts
from course_lib.parallel.schedules import Costs, bubble_ratio, chunks_per_rank
from course_lib.planner.layouts import Candidate, groups
from course_lib.planner.presets import Model

PEAK = {"mixed": "bf16", "fp32": "fp32"}  # which peak of the hardware profile a precision computes at


def flops_per_token(model: Model) -> float:
    """Model FLOPs per token, what MFU counts: 6 x the *active* parameters (2 forward, 4 backward; Kaplan et al.
    2020, §2.1; a mixture of experts computes with the experts a token visits, Fedus et al. 2022, §2), plus the
    attention scores and their product with V, 4 s h per layer forward, x 3 with the backward, halved by the causal
    mask (Narayanan et al. 2021, §5.1, whose 96 B s l h^2 (1 + s/6h + ...) counts them unmasked and recomputed):
    6 L s h (:func:`attention_flops_per_token`). At 8K tokens Llama 3 405B's attention is 4% of its FLOPs, at 128K
    40%."""
    return 6 * (model.active_params or model.params) + attention_flops_per_token(model, "flash")


RECOMPUTE_PASSES = {"none": 0, "selective": 0, "full": 1}  # extra forwards of a layer's matmuls


def attention_flops_per_token(model: Model, attention: str = "flash") -> float:
    """FLOPs of the attention scores (Q K^T) and their product with V per token, forward and backward: 4 s h per
    layer forward, 3x that with the backward, 12 L s h; a FlashAttention kernel skips the blocks the causal mask
    hides, half of them, 6 L s h (Dao et al. 2022, §3.1 and its block-sparse variant); attention that writes its
    scores to memory (Megatron-LM 2021) computes all of them, as Narayanan et al.'s eq. (3) counts."""
    return (6 if attention == "flash" else 12) * model.layers * model.seq * model.hidden


def embedding_params(model: Model) -> float:
    """The input embedding and the output head: V x h, once if tied, twice if not (0 if the vocabulary is
    unknown)."""
    return model.vocab * model.hidden * (1 if model.tied else 2) if model.vocab else 0.0


def layer_params(model: Model) -> float:
    """Active parameters of one transformer layer, on average: all but the embeddings, over the layers."""
    return ((model.active_params or model.params) - embedding_params(model)) / model.layers


def hardware_flops_per_token(model: Model, recompute: str = "none", attention: str = "flash") -> float:
    """FLOPs per token the GPUs execute, what HFU counts: :func:`flops_per_token` with the attention as the kernel
    computes it (:func:`attention_flops_per_token`), plus the recomputed forward: full recompute runs every layer's
    forward again, 2 x the layer parameters and the attention's forward (8 per parameter-token instead of 6, as
    Narayanan et al. 2021's eq. (3) counts, Appendix); selective recompute only the attention's forward
    (Korthikanti et al. 2022, §5). The output head is not recomputed."""
    attention_flops = attention_flops_per_token(model, attention)
    extra = 2 * layer_params(model) * model.layers * RECOMPUTE_PASSES[recompute]
    extra += attention_flops / 3 * (recompute != "none")
    return flops_per_token(model) - attention_flops_per_token(model, "flash") + attention_flops + extra


def _rate(profile: HardwareProfile, precision: str, efficiency: float) -> float:
    return profile.peak_flops[PEAK[precision]] * efficiency


def linear_rate(profile: HardwareProfile, precision: str) -> float:
    """FLOP/s of a transformer layer's linear matmuls: the profile's ``matmul_efficiency`` of its FP8 peak where it
    runs them in FP8 (``fp8_linears``, :func:`course_lib.cluster.profiles.get_profile`'s ``+fp8``) under mixed
    precision, else of the precision's peak."""
    fp8 = profile.fp8_linears and precision == "mixed"
    return (profile.peak_flops["fp8"] if fp8 else profile.peak_flops[PEAK[precision]]) * profile.matmul_efficiency


def _attention_efficiency(profile: HardwareProfile, attention: str) -> float:
    """Scores written to memory are batched matrix multiplies (their memory traffic counted apart,
    :func:`elementwise_bytes`); a fused kernel runs at its own measured rate."""
    return profile.matmul_efficiency if attention == "materialized" else profile.attention_efficiency


def elementwise_bytes(model: Model, c: Candidate, micro_batch: int) -> float:
    """Bytes one layer's element-wise kernels read and write in memory for one microbatch on one GPU, forward,
    backward and recompute: the work that runs at memory bandwidth rather than at the matmul rate.

    Forward, per token, 16-bit values and 1-byte dropout masks, the operations of Korthikanti et al. 2022, §4.1:
    two LayerNorms (read and write h each: 8h bytes), two bias-dropout-adds (the output and the residual read, the
    sum written, a mask: 7h each), the MLP's activation (GeLU reads and writes its ffn-wide input, 4 ffn; SwiGLU
    reads two and writes one, 6 ffn), and the attention: scores written to memory pass 13 bytes per score (Q K^T
    writes 2, softmax reads and writes 4, dropout 5 with its mask, the product with V reads 2; a s scores per
    token); a fused kernel reads Q, K, V and writes its output, 8h. TP splits the MLP and attention parts,
    sequence parallelism the rest too, CP everything. The backward moves twice the forward's bytes (reads the saved
    inputs and the incoming gradient, writes the outgoing one); full recompute repeats the forward's, selective
    the attention's."""
    tokens = micro_batch * model.seq / c.cp
    h, ffn = model.hidden, model.token_ffn or 4 * model.hidden
    rest = 22 * h * tokens / (c.tp if c.sp else 1)
    mlp = (6 if model.swiglu else 4) * ffn * tokens / c.tp
    scores = 13 * model.heads * model.seq if c.attention == "materialized" else 8 * h
    attention = scores * tokens / c.tp
    forward = rest + mlp + attention
    recomputed = forward if c.recompute == "full" else attention if c.recompute == "selective" else 0.0
    return 3 * forward + recomputed


def layer_seconds(model: Model, c: Candidate, micro_batch: int, profile: HardwareProfile, precision: str) -> float:
    """One transformer layer, one microbatch, one GPU, forward, backward and recompute: its matmuls at the
    profile's ``matmul_efficiency`` of peak (of the FP8 peak with FP8 linears, :func:`linear_rate`), its attention
    scores at the kernel's (:func:`_attention_efficiency`)
    and its element-wise kernels at the memory bandwidth (:func:`elementwise_bytes`), one after the other."""
    tokens = micro_batch * model.seq / c.cp / c.tp  # what a GPU's share of the matmuls amounts to
    matmul = 2 * layer_params(model) * tokens * (3 + RECOMPUTE_PASSES[c.recompute])
    attention = attention_flops_per_token(model, c.attention) / model.layers * tokens
    attention *= 1 + (c.recompute != "none") / 3
    return (
        matmul / linear_rate(profile, precision)
        + attention / _rate(profile, precision, _attention_efficiency(profile, c.attention))
        + elementwise_bytes(model, c, micro_batch) / profile.hbm_bandwidth
    )


def head_seconds(model: Model, c: Candidate, micro_batch: int, profile: HardwareProfile, precision: str) -> float:
    """The output head of one microbatch on the last stage, forward and backward, split by TP: 6 h V FLOPs a token
    (not recomputed). The input embedding is a lookup; its 6 h V of the 6N count is not executed."""
    if not model.vocab:
        return 0.0
    tokens = micro_batch * model.seq / c.cp / c.tp
    return 6 * model.hidden * model.vocab * tokens / _rate(profile, precision, profile.matmul_efficiency)


def stage_counts(model: Model, c: Candidate) -> list[int]:
    """The layers of each pipeline stage: the candidate's ``stage_layers``, or as even as they go, ceil(L/p) with
    the last stages a layer short (:func:`~course_lib.model.stages.even_counts`; Llama 3's last stage holds the
    head instead of a layer, §3.3.2)."""
    return list(c.stage_layers) or even_counts(model.layers, c.pp)


def stage_seconds(model: Model, c: Candidate, micro_batch: int, profile: HardwareProfile, precision: str) -> float:
    """One microbatch's compute on the slowest stage: each stage's layers (:func:`stage_counts`), the last with the
    output head (:func:`head_seconds`); every stage runs at the slowest one's pace. The input embedding is a
    lookup, not timed."""
    counts = stage_counts(model, c)
    layer = layer_seconds(model, c, micro_batch, profile, precision)
    head = head_seconds(model, c, micro_batch, profile, precision)
    return max(n * layer + head * (i == len(counts) - 1) for i, n in enumerate(counts))


def schedule_costs(recompute: str) -> Costs:
    """F, B (input gradient) and W (weight gradient) of a layer in units of its forward: the backward is twice the
    forward, split evenly into B and W (Qi et al. 2023, §2); full recompute runs the forward again before B."""
    return Costs(1.0, 1.0 + RECOMPUTE_PASSES[recompute], 1.0)


def tp_comm(model: Model, c: Candidate, micro_batch: int, net: Network) -> float:
    """TP's collectives on the slowest stage, not overlapped (``TIME_MODEL_ASSUMPTIONS``): per layer and
    microbatch 4 all-reduces of b x s/cp x h 16-bit values (2 forward, 2 backward; with sequence parallelism
    all-gathers and reduce-scatters of the same bytes), 2 more when full recompute runs the forward again, on the
    TP group's link (Narayanan et al. 2021, §3.3; Korthikanti et al. 2022, §4.2.2)."""
    if c.tp == 1:
        return 0.0
    size = 2 * micro_batch * model.seq / c.cp * model.hidden
    one = net.time("all_reduce", groups(c.tp, c.pp, c.dp, c.cp, c.ep)["tp"], size)
    return (4 + 2 * RECOMPUTE_PASSES[c.recompute]) * max(stage_counts(model, c)) * c.microbatches * one


def pp_comm(model: Model, c: Candidate, micro_batch: int, net: Network) -> float:
    """Point-to-point traffic, not overlapped: per microbatch and model chunk an activation forward and its
    gradient back, each b x s/cp x h / t 16-bit values (scatter/gather, Narayanan et al. 2021, §4.1; sequence
    parallelism splits them the same way); the interleaved schedule sends v times as many (§2.2.2), a V (ZB-V,
    DualPipeV) twice as many."""
    if c.pp == 1:
        return 0.0
    size = 2 * micro_batch * model.seq / c.cp * model.hidden / c.tp
    one = net.time("send", groups(c.tp, c.pp, c.dp, c.cp, c.ep)["pp"], size)
    return 2 * chunks_per_rank(c.schedule, c.chunks) * c.microbatches * one


def _kv_width(model: Model, tp: int) -> float:
    """K (or V) values per token a TP rank holds: its share of the K/V heads, at least one (replicated)."""
    kv_heads = model.kv_heads or model.heads
    return max(kv_heads / tp, 1) * model.hidden / model.heads


def cp_comm_exposed(model: Model, c: Candidate, micro_batch: int, net: Network, precision: str) -> float:
    """Ring attention's traffic not hidden behind attention compute (Liu et al. 2023, ring attention, §3).

    Each of the cp ranks holds s/cp tokens; in the forward its K and V blocks (b x s/cp x its K/V width, 16-bit)
    travel cp-1 steps round the CP ring, and at each step the rank computes its queries against the block it
    holds, 4 b (s/cp)^2 h / t FLOPs of which the causal mask keeps half (the 2cp-chunk split gives every step
    the same half). The backward passes K and V round again with their gradients dK and dV: twice the bytes, and
    twice the compute (Liu et al. 2023, Algorithm 1). Sending the next block overlaps computing the current one,
    so a step costs max(comm, compute): exposed = max(0, comm - compute) per step, 3 (cp-1) of those per layer and
    microbatch (one forward, two backward's worth). Llama 3 all-gathers K/V instead (§3.3.2), the same bytes;
    with grouped-query attention they are small, and mostly hidden at long sequences."""
    if c.cp == 1:
        return 0.0
    block = micro_batch * model.seq / c.cp
    rings = tuple(g + g[:1] for g in groups(c.tp, c.pp, c.dp, c.cp, c.ep)["cp"])  # each rank sends to the next
    comm = net.time("send", rings, 2 * 2 * block * _kv_width(model, c.tp))
    rate = _rate(net.profile, precision, _attention_efficiency(net.profile, c.attention))
    compute = 2 * block * model.seq / c.cp * model.hidden / c.tp / rate
    return model.layers / c.pp * c.microbatches * 3 * (c.cp - 1) * max(0.0, comm - compute)


def dispatch_bytes(model: Model, c: Candidate | Layout, micro_batch: int, value_bytes: float = 2) -> float:
    """What one rank hands one of expert parallelism's all-to-alls (dispatch or combine) for one microbatch, in
    bytes (:mod:`course_lib.ledgers.comm`'s S): its tokens, b x s / (cp x tp) (sequence parallelism and CP split them),
    top_k copies each, h values a copy of ``value_bytes`` each (GShard, Lepikhin et al. 2021, §3.2): 2 in bf16;
    DeepSeek-V3 dispatches in FP8, 1 byte, and combines in BF16, 2 (§3.3.3; the experts' ``dispatch_bytes`` and
    ``combine_bytes``). Under uniform routing (ep-1)/ep of it leaves the rank
    (:func:`course_lib.ledgers.comm.ring_factor`)."""
    tokens = micro_batch * model.seq / (c.cp * c.tp)
    return value_bytes * tokens * model.experts.top_k * model.hidden


PAIRS_F_AND_B = ("dualpipev",)  # schedules that run one microbatch's forward beside another's backward


@cache
def ep_links(tp: int, pp: int, dp: int, cp: int, ep: int, domain: int) -> tuple[int, tuple, tuple]:
    """The most nodes (of ``domain`` GPUs, rank r on GPU r) an EP group of the layout spans; the groups of one
    member per node at the same place in its node's share (the rails InfiniBand carries a token on); and each
    node's share of a group (what NVLink forwards within). Groups of one GPU, which send nothing, are left out;
    a group that straddles racks unevenly (a topology's 72-GPU domains) has shorter rails at its short end."""
    per_node = []
    for g in groups(tp, pp, dp, cp, ep)["ep"]:
        nodes: dict[int, list[int]] = {}
        for r in g:
            nodes.setdefault(r // domain, []).append(r)
        per_node.append(list(nodes.values()))
    rails = (tuple(n[i] for n in g if i < len(n)) for g in per_node for i in range(max(map(len, g))))
    local = (tuple(n) for g in per_node for n in g)
    return max(map(len, per_node)), tuple(r for r in rails if len(r) > 1), tuple(n for n in local if len(n) > 1)


def ep_transfer(model: Model, c: Candidate, micro_batch: int, net: Network, value_bytes: float) -> float:
    """Seconds of one all-to-all of expert parallelism, each value ``value_bytes``, for one microbatch and MoE
    layer: a rank hands it :func:`dispatch_bytes`.

    Inside one node (or without node-limited routing) an all-to-all on the EP group's slowest link. With
    node-limited routing (:attr:`~course_lib.planner.presets.Experts.max_nodes`, DeepSeek-V3 §3.2.2) over an EP
    group that spans nodes, a token crosses InfiniBand once per node it is sent to, at most min(top-k, M, the
    group's nodes) copies, from each GPU to the same local rank of the other nodes (DeepEP's rails), and NVLink
    forwards it to its top-k experts' GPUs in the node; the two run at once (§3.2.2: IB sends and NVLink forwards
    overlap), so the transfer takes the longer of the two."""
    e = model.experts
    size = dispatch_bytes(model, c, micro_batch, value_bytes)
    nodes, rails, local = ep_links(c.tp, c.pp, c.dp, c.cp, c.ep, net.domain)
    if e.max_nodes is None or nodes == 1:
        return net.time("all_to_all", groups(c.tp, c.pp, c.dp, c.cp, c.ep)["ep"], size)
    ib = net.time("all_to_all", rails, size * min(e.top_k, e.max_nodes, nodes) / e.top_k)
    return max(ib, net.time("all_to_all", local, size) if local else 0.0)


def paired_fraction(schedule: str, pp: int, microbatches: int) -> float:
    """The share of a rank's forward chunks a schedule runs beside another microbatch's backward chunk, on the
    rank with the fewest: DualPipeV's rank 0 pairs 2(m-2p+1) + p-1 = 2m-3p+1 of its 2m (steps 4 and 5 of
    :func:`course_lib.parallel.schedules.generate`'s ``_dualpipe_v``; DeepSeek-AI 2024, §3.2.1); none in 1F1B,
    ZB-H1 or the interleaved schedule, which run one chunk at a time."""
    if schedule not in PAIRS_F_AND_B:
        return 0.0
    return max(0.0, (2 * microbatches - 3 * pp + 1) / (2 * microbatches))


def ep_comm(model: Model, c: Candidate, micro_batch: int, net: Network, precision: str = "mixed") -> float:
    """Expert parallelism's all-to-alls left exposed, per step on the slowest stage. Per MoE layer and microbatch
    four (GShard, Lepikhin et al. 2021, §3.2; Switch Transformers, Fedus et al. 2022, §2.2), each an
    :func:`ep_transfer`: forward dispatch and backward gradient to the experts at the experts' ``dispatch_bytes``
    a value, forward combine and backward gradient back at ``combine_bytes`` (DeepSeek-V3 §3.3.3).

    Run one chunk at a time (1F1B, ZB-H1, interleaved) they are all exposed. DualPipe(V) pairs one microbatch's
    forward chunk with another's backward chunk and overlaps each one's all-to-alls with the other's compute
    (DeepSeek-AI 2024, §3.2.1, Figure 4): on a paired chunk the forward's two hide behind the backward's compute
    (2/3 of a layer's, :func:`schedule_costs`) and the backward's two behind the forward's (1/3), exposed =
    max(0, all-to-all - compute) each; the unpaired chunks (:func:`paired_fraction`) expose theirs. The SMs
    DeepSeek sets aside for communication (20 of 132, §3.2.2) are not taken from the compute."""
    if c.ep == 1:
        return 0.0
    e = model.experts
    one_way = sum(ep_transfer(model, c, micro_batch, net, b) for b in (e.dispatch_bytes, e.combine_bytes))
    layers = model.moe_layers / c.pp
    paired = paired_fraction(c.schedule, c.pp, c.microbatches)
    layer = layer_seconds(model, c, micro_batch, net.profile, precision)
    hidden = max(0.0, one_way - 2 / 3 * layer) + max(0.0, one_way - 1 / 3 * layer)
    return layers * c.microbatches * ((1 - paired) * 2 * one_way + paired * hidden)


def dp_comm_exposed(model: Model, c: Candidate, compute_s: float, net: Network, precision: str) -> float:
    """Data-parallel traffic left over after overlapping it with compute. Gradients of 2 bytes per parameter
    (mixed): the dense ones divided by TP x PP and reduced over DP x CP, the experts' divided by EP x PP and
    reduced over the expert-data-parallel group (:func:`groups`), one after the other. ZeRO-0 all-reduces them
    once per step, during the last microbatch's backward (gradient accumulation syncs once); ZeRO-1
    reduce-scatters there and all-gathers the updated weights after the step, the same bytes (Rajbhandari et al.
    2020, §7.2.1); ZeRO-2 keeps only its gradient shard, so it reduce-scatters every microbatch, under all the
    backward; ZeRO-3 also all-gathers the weights in each microbatch's forward and backward, 1.5x the
    all-reduce's bytes (§7.2.2), prefetched under all the compute."""
    ranks = groups(c.tp, c.pp, c.dp, c.cp, c.ep)
    parts = [
        (shard, members)
        for shard, members in (
            ((model.params - model.expert_params) / (c.tp * c.pp), ranks["dp_cp"]),
            (model.expert_params / (c.ep * c.pp), ranks["edp"]),
        )
        if shard and len(members[0]) > 1
    ]
    if not parts:
        return 0.0

    def ring(op: str, kind: str) -> float:
        return sum(net.time(op, members, BYTES_PER_PARAM[precision][kind] * shard) for shard, members in parts)

    backward = 2 / 3 * compute_s  # backward = 2 x forward (Kaplan et al. 2020: 6N = 2N forward + 4N backward)
    if c.zero == 0:
        return max(0.0, ring("all_reduce", "grads") - backward / c.microbatches)
    if c.zero == 1:
        return max(0.0, ring("reduce_scatter", "grads") - backward / c.microbatches) + ring("all_gather", "params")
    if c.zero == 2:
        return max(0.0, c.microbatches * ring("reduce_scatter", "grads") - backward) + ring("all_gather", "params")
    per_microbatch = 2 * ring("all_gather", "params") + ring("reduce_scatter", "grads")
    return max(0.0, c.microbatches * per_microbatch - compute_s)


def step_time(model: Model, c: Candidate, micro_batch: int, net: Network, precision: str) -> dict[str, float]:
    """Time per step, in seconds, by part (the assumptions: ``course_lib.cluster.profiles.TIME_MODEL_ASSUMPTIONS``):

    * compute: the microbatches through the slowest stage (:func:`stage_seconds`);
    * TP: :func:`tp_comm`; CP: what :func:`cp_comm_exposed` leaves exposed; EP: what :func:`ep_comm` leaves
      exposed;
    * bubble: the schedule's idle over busy time (:func:`course_lib.parallel.schedules.bubble_ratio`: (p-1)/m for
      1F1B, (p-1)/(v m) interleaved, (p-1)(F+B-W)/(m(F+B+W)) for ZB-H1) times a stage's work, its compute and its
      TP, CP and EP traffic (Narayanan et al. 2021, §2.2);
    * PP: :func:`pp_comm`;
    * DP: what :func:`dp_comm_exposed` leaves exposed.
    """
    compute = c.microbatches * stage_seconds(model, c, micro_batch, net.profile, precision)
    parts = {
        "compute_s": compute,
        "tp_comm_s": tp_comm(model, c, micro_batch, net),
        "cp_comm_exposed_s": cp_comm_exposed(model, c, micro_batch, net, precision),
        "ep_comm_s": ep_comm(model, c, micro_batch, net, precision),
    }
    ratio = bubble_ratio(c.schedule, c.pp, c.microbatches, c.chunks, schedule_costs(c.recompute))
    parts["bubble_s"] = ratio * sum(parts.values())
    parts["pp_comm_s"] = pp_comm(model, c, micro_batch, net)
    parts["dp_comm_exposed_s"] = dp_comm_exposed(model, c, compute, net, precision)
    return parts
