"""The parallelism planner: which TP x PP x DP (and ZeRO stage) to train a model with on a cluster, and why.

First the lesson's decision tree, on model states alone (16 bytes per parameter with mixed-precision Adam):

* they fit one GPU: data parallelism alone;
* they fit one node: tensor parallelism inside the node, data parallelism across nodes (or FSDP/ZeRO-3 over all
  GPUs for a team that wants no model parallelism);
* bigger than a node: 3D, TP inside nodes (NVLink), PP across nodes, DP on top.

Then every layout is enumerated and costed: TP degrees that divide the GPUs of a node (and the heads), PP degrees
that split the layers into stages of equal size, or, as Llama 3 does, first and last stage one layer shorter
(Grattafiori et al. 2024, §3.3.2), DP the rest, ZeRO 0, 1, 2 (3 only without TP and PP, i.e. FSDP). Ranks are
placed TP fastest, then PP, then DP. Memory per GPU is :func:`course_lib.memory.memory_formula` (TP with sequence
parallelism, the 1F1B first stage's activations), the same numbers as ``python -m course_lib memory``. Time per
step is a simple estimate (:func:`step_time`). Layouts that fit are ranked by it; the decision tree's shape is kept
unless another layout is more than ``CLOSE`` faster.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from course_lib.comm import ring_factor
from course_lib.hardware import HardwareProfile, collective_time, get_profile, link
from course_lib.memory import BYTES_PER_PARAM, CATEGORIES, memory_formula, model_state_formula, params_from_dims
from course_lib.parallel.schedules import bubble_formula

EFFICIENCY = 0.5  # fraction of peak FLOP/s a GPU sustains (the modeled clock's default, hardware.replay)
CLOSE = 0.10  # the decision tree's shape is kept if no layout is estimated more than 10% faster
DEFAULT_SEQ = 2048  # GPT-3's context (Brown et al. 2020)
DEFAULT_GLOBAL_BATCH = 1024  # sequences: 2M tokens at 2048, GPT-3 13B's batch (Brown et al. 2020, Table 2.1)
HEAD_DIM = 128  # GPT-3 from 6.7B up, Llama 3
PEAK = {"mixed": "bf16", "fp32": "fp32"}  # which peak of the hardware profile a precision computes at

SHAPES = {
    "dp": "data parallelism alone",
    "tp": "tensor parallelism inside a node (data parallelism across nodes)",
    "fsdp": "FSDP / ZeRO-3 over all GPUs, no model parallelism",
    "3d": "3D: TP inside nodes, PP across nodes, DP on top",
}


@dataclass(frozen=True)
class Model:
    """A transformer to plan for: all its parameters (what memory holds), the active ones (what a token computes
    with, fewer in a mixture of experts), the dims the activation and traffic formulas need, and where known the
    published global batch (sequences) and layout (tp, pp, dp)."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int
    active_params: float | None = None
    global_batch: int | None = None
    published: tuple[int, int, int] | None = None
    nominal: bool = False  # dims guessed from the parameter count (:func:`nominal_model`)
    source: str = ""


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """Parameters of a Llama 3 model (Grattafiori et al. 2024, Table 3 dims): per layer grouped-query attention
    (q and o h x h, k and v h x kv_heads*head_dim), a SwiGLU MLP of three h x ffn matrices and two RMSNorm weights;
    untied input and output embeddings, a final norm. Gives the released checkpoints' 8,030,261,248,
    70,553,706,496 and 405,853,388,800 parameters."""
    kv = kv_heads * hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


_LLAMA3 = "Grattafiori et al. 2024 (The Llama 3 Herd of Models), Table 3; 8192-token pretraining sequences"
_GPT3 = "Brown et al. 2020, Table 2.1 (dims, vocabulary 50257)"
PRESETS = {
    "llama3-8b": Model("llama3-8b", llama_params(32, 4096, 32, 8, 14336, 128256), 32, 4096, 32, 8192, source=_LLAMA3),
    "llama3-70b": Model("llama3-70b", llama_params(80, 8192, 64, 8, 28672, 128256), 80, 8192, 64, 8192, source=_LLAMA3),
    "llama3-405b": Model(
        "llama3-405b",
        llama_params(126, 16384, 128, 8, 53248, 128256),
        126,
        16384,
        128,
        8192,
        global_batch=2048,
        published=(8, 16, 128),
        source=_LLAMA3 + "; Table 4: on 16,384 H100s TP 8, CP 1, PP 16, DP 128, 16M tokens (2048 sequences) a batch",
    ),
    "gpt3-175b": Model(
        "gpt3-175b",
        params_from_dims(96, 12288, 50257, 2048),
        96,
        12288,
        96,
        2048,
        global_batch=1536,
        source=_GPT3 + "; the batch of 1536 sequences is the one Narayanan et al. 2021 use for GPT-3-sized runs",
    ),
    "megatron-1t": Model(
        "megatron-1t",
        params_from_dims(128, 25600, 51200, 2048),
        128,
        25600,
        160,
        2048,
        global_batch=3072,
        published=(8, 64, 6),
        source="Narayanan et al. 2021, Table 1: 1008B parameters, 128 layers, hidden 25600, 160 heads, on 3072 "
        "A100s TP 8, PP 64 (DP 6), batch 3072",
    ),
    "deepseek-v3": Model(
        "deepseek-v3",
        671e9,
        61,
        7168,
        128,
        4096,
        active_params=37e9,
        source="DeepSeek-AI 2024 (DeepSeek-V3 technical report): 671B parameters, 37B active, 61 layers, hidden "
        "7168, 128 heads, 4K pretraining sequences; trained with 16-way PP, 64-way expert parallelism over 8 "
        "nodes and ZeRO-1 DP, no TP (§3.2)",
    ),
    "mixtral-8x22b": Model(
        "mixtral-8x22b",
        141e9,
        56,
        6144,
        48,
        4096,
        active_params=39e9,
        source="Mistral AI 2024: 141B parameters, 39B active; dims from the released config.json (56 layers, "
        "hidden 6144, 48 heads); the training sequence length is not published, 4096 assumed",
    ),
}


def nominal_model(params: float, seq: int = DEFAULT_SEQ) -> Model:
    """A GPT-3-shaped stand-in when only the parameter count is known (Brown et al. 2020, Table 2.1, from 6.7B up:
    hidden = 128 x layers, heads of 128): hidden rounded to a multiple of 1024 (heads a multiple of 8), layers to
    a multiple of 8, from N = 12 L h^2."""
    hidden = max(1024, round((HEAD_DIM * params / 12) ** (1 / 3) / 1024) * 1024)
    layers = max(8, round(params / (12 * hidden**2) / 8) * 8)
    return Model(f"gpt-like-{params / 1e9:.3g}b", params, layers, hidden, hidden // HEAD_DIM, seq, nominal=True)


def make_model(
    preset: str | None = None,
    params: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
) -> Model:
    """A preset (``seq`` overrides its sequence length), the dims (``params`` from :func:`params_from_dims` unless
    given) or the parameter count alone (:func:`nominal_model`)."""
    dims = (layers, hidden, heads)
    if preset is not None:
        if params is not None or any(d is not None for d in (*dims, vocab)):
            raise ValueError("give a preset or the parameter count and dims, not both")
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        return replace(PRESETS[preset], seq=seq or PRESETS[preset].seq)
    if all(d is None for d in dims) and params is not None:
        return nominal_model(params, seq or DEFAULT_SEQ)
    if any(d is None for d in dims) or (params is None and vocab is None):
        raise ValueError("give a preset, the parameter count, or the dims: layers, hidden, heads (and vocab)")
    seq = seq or DEFAULT_SEQ
    params = params if params is not None else params_from_dims(layers, hidden, vocab, seq)
    return Model(f"custom-{params / 1e9:.3g}b", params, layers, hidden, heads, seq)


@dataclass
class Candidate:
    """One layout and its numbers: memory per GPU by category (``memory``), the step time and its parts
    (``time``), and where each group of more than one GPU sits (``placement``)."""

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

    def as_dict(self) -> dict:
        return asdict(self)


def describe(c: Candidate, zero0: bool = True) -> str:
    """ "TP t x PP p x DP d, ZeRO-k" (without ", ZeRO-0" when ``zero0`` is False)."""
    return f"TP {c.tp} x PP {c.pp} x DP {c.dp}" + (f", ZeRO-{c.zero}" if c.zero or zero0 else "")


def _bytes(x: float) -> str:
    return f"{x / 1e12:.2f} TB" if x >= 1e12 else f"{x / 1e9:.1f} GB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def splits_layers(layers: int, pp: int) -> bool:
    """Stages of ceil(L/p) layers, at most two (the first and last, which also hold the embedding and the output
    head) one layer shorter: Llama 3 puts 126 layers on 16 stages so (Grattafiori et al. 2024, §3.3.2)."""
    return pp <= layers and pp * math.ceil(layers / pp) - layers <= 2


def tree_shape(model: Model, gpus: int, gpus_per_node: int, gpu_mem: float, precision: str, no_mp: bool) -> str:
    """The lesson's decision tree on model states (16 bytes per parameter with Adam)."""
    states = sum(model_state_formula(model.params, precision).values())
    if states <= gpu_mem:
        return "dp"
    if no_mp:
        return "fsdp"
    return "tp" if states <= gpu_mem * min(gpus, gpus_per_node) else "3d"


def in_shape(c: Candidate, shape: str, gpus_per_node: int) -> bool:
    """Does layout ``c`` have the decision tree's ``shape``? 3D: TP, PP across nodes and DP on top."""
    if shape in ("dp", "fsdp"):
        return c.tp == c.pp == 1 and (c.zero == 3) == (shape == "fsdp")
    if shape == "tp":
        return c.tp > 1 and c.pp == 1
    return c.tp > 1 and c.pp > 1 and c.dp > 1 and c.tp * c.pp > gpus_per_node


def layouts(
    model: Model, gpus: int, gpus_per_node: int, global_batch: int, micro_batch: int, no_mp: bool
) -> list[tuple[int, int, int, int, int]]:
    """Every (tp, pp, dp, zero, microbatches): TP inside a node dividing the heads, PP splitting the layers
    (:func:`splits_layers`), DP the rest; the global batch a whole number of micro-batches per DP rank, at least
    one per stage (1F1B)."""
    out = []
    for tp in _divisors(gpus_per_node):
        if model.heads % tp or gpus % tp or (no_mp and tp > 1):
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            m, rest = divmod(global_batch, dp * micro_batch)
            if (no_mp and pp > 1) or not splits_layers(model.layers, pp) or rest or m < pp:
                continue
            zeros = (0,) if dp == 1 else (0, 1, 2, 3) if tp == pp == 1 else (0, 1, 2)
            out += [(tp, pp, dp, zero, m) for zero in zeros]
    return out


def groups(tp: int, pp: int, dp: int) -> dict[str, range]:
    """Rank 0's TP, PP and DP groups, ranks placed TP fastest, then PP, then DP."""
    return {"tp": range(tp), "pp": range(0, tp * pp, tp), "dp": range(0, tp * pp * dp, tp * pp)}


def dp_comm_exposed(
    model: Model, c: Candidate, compute_s: float, profile: HardwareProfile, gpus_per_node: int, precision: str
) -> float:
    """Data-parallel traffic left over after overlapping it with compute. Gradients of 2 bytes per parameter
    (mixed), divided by TP x PP. ZeRO-0 all-reduces them once per step, during the last microbatch's backward
    (gradient accumulation syncs once); ZeRO-1 reduce-scatters there and all-gathers the updated weights after the
    step, the same bytes (Rajbhandari et al. 2020, §7.2.1); ZeRO-2 keeps only its gradient shard, so it
    reduce-scatters every microbatch, under all the backward; ZeRO-3 also all-gathers the weights in each
    microbatch's forward and backward, 1.5x the all-reduce's bytes (§7.2.2), prefetched under all the compute."""
    if c.dp == 1:
        return 0.0
    bandwidth, latency, _ = link(profile, groups(c.tp, c.pp, c.dp)["dp"], gpus_per_node)
    shard = model.params / (c.tp * c.pp)
    grads, weights = (BYTES_PER_PARAM[precision][k] * shard for k in ("grads", "params"))

    def ring(op: str, size: float) -> float:
        return collective_time(op, ring_factor(op, c.dp) * size, c.dp, bandwidth, latency)

    backward = 2 / 3 * compute_s  # backward = 2 x forward (Kaplan et al. 2020: 6N = 2N forward + 4N backward)
    if c.zero == 0:
        return max(0.0, ring("all_reduce", grads) - backward / c.microbatches)
    if c.zero == 1:
        return max(0.0, ring("reduce_scatter", grads) - backward / c.microbatches) + ring("all_gather", weights)
    if c.zero == 2:
        return max(0.0, c.microbatches * ring("reduce_scatter", grads) - backward) + ring("all_gather", weights)
    per_microbatch = 2 * ring("all_gather", weights) + ring("reduce_scatter", grads)
    return max(0.0, c.microbatches * per_microbatch - compute_s)


def step_time(
    model: Model,
    c: Candidate,
    gpus: int,
    global_batch: int,
    micro_batch: int,
    profile: HardwareProfile,
    gpus_per_node: int,
    precision: str,
) -> dict[str, float]:
    """A rough time per step, in seconds, by part:

    * compute: 6 x active parameters x tokens / GPUs at ``EFFICIENCY`` of peak (Kaplan et al. 2020);
    * TP: per layer and microbatch 4 all-reduces of b x s x h 16-bit values (2 forward, 2 backward; with sequence
      parallelism all-gathers and reduce-scatters of the same bytes) on the TP group's link, not overlapped
      (Narayanan et al. 2021, §3.3; Korthikanti et al. 2022, §4.2.2);
    * bubble: 1F1B idles (p-1)/m of the compute (Narayanan et al. 2021, §2.2.1);
    * PP: per microbatch an activation forward and its gradient back, each b x s x h / t (scatter/gather, §4.1);
    * DP: what :func:`dp_comm_exposed` leaves exposed.
    """
    b, s, h = micro_batch, model.seq, model.hidden
    compute = 6 * (model.active_params or model.params) * global_batch * s / gpus
    compute /= profile.peak_flops[PEAK[precision]] * EFFICIENCY
    ranks = groups(c.tp, c.pp, c.dp)
    tp_s = pp_s = 0.0
    if c.tp > 1:
        bandwidth, latency, _ = link(profile, ranks["tp"], gpus_per_node)
        one = collective_time("all_reduce", ring_factor("all_reduce", c.tp) * 2 * b * s * h, c.tp, bandwidth, latency)
        tp_s = 4 * model.layers / c.pp * c.microbatches * one
    if c.pp > 1:
        bandwidth, latency, _ = link(profile, ranks["pp"], gpus_per_node)
        pp_s = 2 * c.microbatches * collective_time("send", 2 * b * s * h / c.tp, 2, bandwidth, latency)
    return {
        "compute_s": compute,
        "tp_comm_s": tp_s,
        "bubble_s": compute * (c.pp - 1) / c.microbatches,
        "pp_comm_s": pp_s,
        "dp_comm_exposed_s": dp_comm_exposed(model, c, compute, profile, gpus_per_node, precision),
    }


def placement(c: Candidate, profile: HardwareProfile, gpus_per_node: int) -> dict[str, dict]:
    """For each group of more than one GPU: its size, whether it spans nodes and its link's bandwidth per GPU."""
    out = {}
    for axis, ranks in groups(c.tp, c.pp, c.dp).items():
        if len(ranks) > 1:
            bandwidth, _, spans = link(profile, ranks, gpus_per_node)
            out[axis] = {"size": len(ranks), "spans_nodes": spans, "bandwidth": bandwidth}
    return out


def evaluate(
    model: Model,
    layout: tuple[int, int, int, int, int],
    gpus: int,
    gpus_per_node: int,
    gpu_mem: float,
    profile: HardwareProfile,
    global_batch: int,
    micro_batch: int,
    precision: str,
    recompute: str,
) -> Candidate:
    """Memory (:func:`memory_formula`, TP with SP), bubble, step time and placement of one layout."""
    tp, pp, dp, zero, m = layout
    dims = {"layers": model.layers, "seq": model.seq, "hidden": model.hidden, "heads": model.heads}
    memory = memory_formula(
        model.params, precision, zero, dp, tp, pp, micro_batch=micro_batch, sp=tp > 1, recompute=recompute, **dims
    )
    c = Candidate(tp, pp, dp, zero, m, recompute, memory["total"] <= gpu_mem, memory["total"], 0.0, 0.0, memory)
    c.bubble_fraction = bubble_formula("1f1b", pp, m)
    c.time = step_time(model, c, gpus, global_batch, micro_batch, profile, gpus_per_node, precision)
    c.step_time_s = sum(c.time.values())
    c.placement = placement(c, profile, gpus_per_node)
    return c


def _rank(cands: list[Candidate]) -> list[Candidate]:
    """Those that fit, fastest first (ties: lower ZeRO stage, less model parallelism), then the rest by memory."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: (c.step_time_s, c.zero, c.tp * c.pp))
    return fitting + sorted((c for c in cands if not c.fits), key=lambda c: c.memory_per_gpu_bytes)


def _check(gpus: int, gpus_per_node: int, global_batch: int, micro_batch: int, precision: str) -> None:
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


def _as_model(model: Model | str | float) -> Model:
    if isinstance(model, Model):
        return model
    return make_model(preset=model) if isinstance(model, str) else nominal_model(model)


def plan(
    model: Model | str | float,
    gpus: int,
    gpus_per_node: int | None = None,
    gpu_mem_bytes: float | None = None,
    hardware: str = "h100",
    global_batch: int | None = None,
    micro_batch: int = 1,
    precision: str = "mixed",
    no_model_parallel: bool = False,
) -> Plan:
    """Plan ``model`` (a :class:`Model`, a preset name or a parameter count) on ``gpus`` GPUs. GPUs per node and
    memory default to the ``hardware`` profile's; the global batch (sequences) to the preset's published one, else
    ``DEFAULT_GLOBAL_BATCH``. Selective recompute is used only if nothing fits without it."""
    model = _as_model(model)
    profile = get_profile(hardware)
    per_node = gpus_per_node or profile.gpus_per_node
    gpu_mem = gpu_mem_bytes or profile.memory_bytes
    batch = global_batch or model.global_batch or DEFAULT_GLOBAL_BATCH
    _check(gpus, per_node, batch, micro_batch, precision)
    shapes = layouts(model, gpus, per_node, batch, micro_batch, no_model_parallel)
    if not shapes:
        raise ValueError(
            f"no layout of {gpus} GPUs splits a global batch of {batch} sequences into micro-batches of "
            f"{micro_batch} per DP rank (at least one per pipeline stage): change the batch or the GPUs"
        )
    tries = []
    for recompute in ("none", "selective"):
        args = (gpus, per_node, gpu_mem, profile, batch, micro_batch, precision, recompute)
        ranked = _rank([evaluate(model, layout, *args) for layout in shapes])
        tries.append(ranked)
        if ranked[0].fits:
            break
    else:
        raise ValueError(_nothing_fits(model, tries[-1][0], gpu_mem))
    shape = tree_shape(model, gpus, per_node, gpu_mem, precision, no_model_parallel)
    chosen, tree_best = _choose(ranked, shape, per_node)
    result = Plan(
        **vars(chosen),
        model=model,
        hardware=profile.name,
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_mem_bytes=gpu_mem,
        global_batch=batch,
        micro_batch=micro_batch,
        precision=precision,
        shape=shape,
        candidates=ranked,
    )
    result.reasons = explain(result, profile, tree_best, tries[0][0])
    return result


def _nothing_fits(model: Model, smallest: Candidate, gpu_mem: float) -> str:
    moe = (
        f" ({model.name} is a mixture of experts planned as dense: expert parallelism would shard its experts)"
        if model.active_params
        else ""
    )
    return (
        f"nothing fits in {_bytes(gpu_mem)} per GPU, even with selective recompute: the smallest layout, "
        f"{describe(smallest)}, needs {_bytes(smallest.memory_per_gpu_bytes)}, "
        f"{_bytes(smallest.memory_per_gpu_bytes - gpu_mem)} more than a GPU has; add GPUs (or recompute fully){moe}"
    )


def _choose(ranked: list[Candidate], shape: str, gpus_per_node: int) -> tuple[Candidate, Candidate | None]:
    """The fastest layout of the tree's shape if within ``CLOSE`` of the fastest, else the fastest; and the
    fastest of the tree's shape (None if none fits)."""
    best = ranked[0]
    tree = next((c for c in ranked if c.fits and in_shape(c, shape, gpus_per_node)), None)
    if tree is not None and tree.step_time_s <= best.step_time_s * (1 + CLOSE):
        return tree, tree
    return best, tree


# ------------------------------------------------------------------------------------------------ reasons
def explain(p: Plan, profile: HardwareProfile, tree_best: Candidate | None, first_try: Candidate) -> list[str]:
    """Sentences, with numbers, for the choice: the model, the tree, memory, placement, pipeline, time."""
    reasons = [_model_reason(p.model)]
    reasons += _tree_reasons(p, tree_best)
    if p.recompute == "selective":
        reasons.append(
            f"Nothing fits while keeping the attention scores (Korthikanti et al.'s 5as/h term: the smallest layout "
            f"needs {_bytes(first_try.memory_per_gpu_bytes)}); selective recompute drops them (so does "
            f"FlashAttention, which never stores them)."
        )
    reasons.append(_memory_reason(p))
    reasons += _placement_reasons(p)
    if p.pp > 1:
        reasons.append(_pipeline_reason(p))
    reasons.append(_time_reason(p, profile))
    reasons += _alternative_reasons(p)
    return reasons


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
    if model.active_params:
        return text + (
            f". A mixture of experts with {model.active_params / 1e9:.0f}B parameters active per token: planned as a "
            f"dense model that holds all {model.params / 1e9:.0f}B (memory) and computes with "
            f"{model.active_params / 1e9:.0f}B (time). Expert parallelism, the next lesson's axis, would shard the "
            f"experts instead of replicating them over DP ({model.source})."
        )
    return text + f" ({model.source})." if model.source else text + "."


def _tree_reasons(p: Plan, tree_best: Candidate | None) -> list[str]:
    states = sum(model_state_formula(p.model.params, p.precision).values())
    node = min(p.gpus, p.gpus_per_node)
    gpu, node_mem = _bytes(p.gpu_mem_bytes), f"{node} x {_bytes(p.gpu_mem_bytes)} = {_bytes(node * p.gpu_mem_bytes)}"
    where = {
        "dp": f"fit one GPU ({gpu})",
        "fsdp": f"exceed one GPU ({gpu})",
        "tp": f"fit one node ({node_mem})",
        "3d": f"exceed one node ({node_mem})",
    }[p.shape]
    out = [
        f"Model states, {sum(BYTES_PER_PARAM[p.precision].values())} bytes per parameter with {p.precision} Adam, "
        f"{_bytes(states)}, {where}: the decision tree says {SHAPES[p.shape]}."
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
    return (
        f"Per GPU: {_bytes(p.memory_per_gpu_bytes)} of {_bytes(p.gpu_mem_bytes)} (GB: {parts}), as "
        f"`python -m course_lib memory` computes it: model states over TP x PP = {p.tp * p.pp}"
        + (f" and ZeRO-{p.zero} over DP = {p.dp}" if p.zero else "")
        + (f"; activations split {p.tp} ways by TP with sequence parallelism" if p.tp > 1 else "")
        + "."
    )


def _placement_reasons(p: Plan) -> list[str]:
    names = {"tp": "TP group", "pp": "pipeline", "dp": "DP group"}
    out = []
    for axis, g in p.placement.items():
        where = "spans nodes" if g["spans_nodes"] else "sits inside a node"
        out.append(f"The {names[axis]} of {g['size']} {where} ({g['bandwidth'] / 1e9:g} GB/s per GPU).")
    if not out:
        out.append("One GPU: no group, no traffic.")
    return out


def _pipeline_reason(p: Plan) -> str:
    text = (
        f"1F1B over {p.pp} stages with {p.microbatches} microbatches of {p.micro_batch} per DP rank: bubble "
        f"(p-1)/(m+p-1) = {p.bubble_fraction:.1%}; the first stage keeps {p.pp} microbatches of its layers in "
        f"flight, one microbatch's worth of all {p.model.layers} layers."
    )
    short = p.pp * math.ceil(p.model.layers / p.pp) - p.model.layers
    if short:
        text += (
            f" {p.model.layers} layers do not split evenly into {p.pp} stages: {short} of them (first, last) get one "
            f"layer fewer, as in Llama 3; memory is the even split's, as the memory command computes it."
        )
    return text


def _time_reason(p: Plan, profile: HardwareProfile) -> str:
    t = p.time
    text = (
        f"Estimated step {p.step_time_s:.3g} s: compute {t['compute_s']:.3g} s "
        f"({EFFICIENCY:.0%} of {profile.peak_flops[PEAK[p.precision]] / 1e12:g} TFLOP/s), bubble "
        f"{t['bubble_s']:.3g} s, TP {t['tp_comm_s']:.3g} s, PP {t['pp_comm_s']:.3g} s, exposed DP "
        f"{t['dp_comm_exposed_s']:.3g} s."
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
    fsdp = next((c for c in p.candidates if c.tp == c.pp == 1 and c.zero == 3), None)
    if fsdp is not None and p.zero != 3:
        verdict = f"fits, step {fsdp.step_time_s:.3g} s" if fsdp.fits else "does not fit"
        out.append(
            f"FSDP (ZeRO-3 over all {p.gpus} GPUs, no model parallelism) would need "
            f"{_bytes(fsdp.memory_per_gpu_bytes)} per GPU, {_bytes(fsdp.memory['activations'])} of it activations "
            f"that only TP splits: {verdict}."
        )
    published = p.model.published
    if published and math.prod(published) == p.gpus:
        matches = [(i, c) for i, c in enumerate(p.candidates) if (c.tp, c.pp, c.dp) == published]
        fitting = [(i, c) for i, c in matches if c.fits]
        layout = "TP {} x PP {} x DP {}".format(*published)
        if fitting:
            i, c = fitting[0]
            out.append(
                f"Published: {layout}; here it fits with ZeRO-{c.zero} at {_bytes(c.memory_per_gpu_bytes)} and "
                f"ranks {i + 1} of {sum(c.fits for c in p.candidates)} fitting layouts ({c.step_time_s:.3g} s)."
            )
        elif matches:
            out.append(f"Published: {layout}; here it needs {_bytes(matches[0][1].memory_per_gpu_bytes)}: no fit.")
        else:
            out.append(f"Published: {layout}; not among the layouts considered here.")
    return out
