"""The parallelism planner: which TP x PP x DP (and ZeRO stage) to train a model with on a cluster, and why.

First the lesson's decision tree, on model states alone (16 bytes per parameter with mixed-precision Adam):

* they fit one GPU: data parallelism alone;
* they fit one node: tensor parallelism inside the node, data parallelism across nodes (or FSDP/ZeRO-3 over all
  GPUs for a team that wants no model parallelism);
* bigger than a node: 3D, TP inside nodes (NVLink), PP across nodes, DP on top.

Then every layout is enumerated and costed: TP degrees that divide the GPUs of a node (and the heads), PP degrees
that split the layers into stages of equal size, or, as Llama 3 does, first and last stage one layer shorter
(Grattafiori et al. 2024, §3.3.2), DP the rest, ZeRO 0, 1, 2 (3 only without TP and PP, i.e. FSDP), and each
pipeline with 1F1B, ZB-H1 and the interleaved schedule's chunk counts (:func:`pipeline_schedules`). Ranks are
placed as Llama 3 orders them, TP fastest, then CP, then PP, then DP (§3.3.2). Memory per GPU is
:func:`course_lib.memory.memory_formula` (TP with sequence parallelism, the 1F1B first stage's activations, scaled
for the interleaved schedule), the same numbers as ``python -m course_lib memory``. Time per step
(:func:`step_time`) is compute at the hardware profile's sustained matmul rate and memory bandwidth, the exposed
TP, PP, CP, EP and DP traffic and the schedule's bubble; beside it the model and hardware FLOPs, TFLOP/s per GPU
and MFU. It is checked against 13 published runs (:mod:`course_lib.published`). Layouts that fit are ranked by
it; the decision tree's shape is kept unless another layout is more than ``CLOSE`` faster. One given layout is
evaluated by :func:`evaluate_layout`.

A mixture of experts (:class:`Experts`) adds an EP axis: whole experts split over ``ep`` ranks carved out of a
stage's TP x CP x DP ranks (the expert-data-parallel group, tp x cp x dp / ep, holds the replicas ZeRO shards),
memory from all parameters, compute from the active ones, and four all-to-alls per MoE layer and microbatch.
Context parallelism (CP, a ring over the sequence) is considered only when nothing fits without it, as Llama 3
brought it in only for its 128K-token stage; like selective recompute, a last resort for memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from typing import NamedTuple

import numpy as np

from course_lib.hardware import HardwareProfile, get_profile
from course_lib.memory import (
    BYTES_PER_PARAM,
    CATEGORIES,
    RECOMPUTE,
    interleaved_activation_factor,
    memory_formula,
    model_state_formula,
    params_from_dims,
    transformer_params,
)
from course_lib.network import Network
from course_lib.parallel.schedules import Costs, bubble_formula, bubble_ratio, chunks_per_rank, peak_activations
from course_lib.topology import Topology, Torus, for_gpus

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
    "ep": "expert parallelism: the experts split over EP ranks (all-to-all), the dense rest by TP/PP, DP on top",
}


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts FFN of a model: ``routed`` experts of which each token visits ``top_k`` (GShard,
    Lepikhin et al. 2021, §2.2; Switch Transformers, Fedus et al. 2022, §2.1), each a SwiGLU FFN ``ffn`` wide,
    ``shared`` experts every token visits (DeepSeekMoE; DeepSeek-V3 §2.1.2), in every layer but the first
    ``dense_layers`` (DeepSeek-V3's 3), which keep a plain FFN."""

    routed: int
    top_k: int
    ffn: int
    shared: int = 0
    dense_layers: int = 0

    def check(self, layers: int, ep: int = 1) -> None:
        """Refuse what cannot be built, saying what to change."""
        if self.routed < 1 or self.top_k < 1 or self.ffn < 1 or self.shared < 0:
            raise ValueError("experts, top-k and the expert FFN must be at least 1 (shared experts at least 0)")
        if self.top_k > self.routed:
            raise ValueError(f"top-k {self.top_k} is more than the {self.routed} experts: choose top-k <= experts")
        if not 0 <= self.dense_layers < layers:
            raise ValueError(f"dense layers must be between 0 and layers - 1 = {layers - 1}, not {self.dense_layers}")
        if self.routed % ep:
            raise ValueError(
                f"{self.routed} experts do not split over ep {ep}: each expert-parallel rank holds a whole number of "
                f"experts; choose an ep that divides {self.routed}"
            )

    def routed_params(self, layers: int, hidden: int) -> int:
        """Parameters of the routed experts of a ``layers``-layer model, the ones expert parallelism shards."""
        return (layers - self.dense_layers) * self.routed * swiglu_params(hidden, self.ffn)

    @property
    def token_ffn(self) -> int:
        """The FFN width a token's activations pass through in an MoE layer: its top-k and the shared experts."""
        return (self.top_k + self.shared) * self.ffn


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
    published: dict[str, int] | None = None  # tp, cp, pp, dp, ep (and zero where stated) of a published run
    nominal: bool = False  # dims guessed from the parameter count (:func:`nominal_model`)
    source: str = ""
    kv_heads: int | None = None  # grouped-query attention's K/V heads (what a CP ring passes); None: heads
    experts: Experts | None = None
    vocab: int | None = None  # the embedding's rows (None: unknown, a nominal model)
    ffn: int | None = None  # a dense layer's MLP width (None: 4 x hidden)
    swiglu: bool = False  # a gated MLP, three ffn x h matrices (Shazeer 2020), instead of GELU's two
    tied: bool = True  # the output head shares the input embedding's weights
    norm: str = "layernorm"  # or "rmsnorm" (one weight per hidden unit)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.experts.dense_layers if self.experts else 0

    @property
    def expert_params(self) -> float:
        """Parameters of the routed experts, the ones expert parallelism shards."""
        return self.experts.routed_params(self.layers, self.hidden) if self.experts else 0.0

    @property
    def token_ffn(self) -> int | None:
        """The FFN width a token's activations pass through: in an MoE layer its experts', else the dense MLP's
        (None: 4h)."""
        return self.experts.token_ffn if self.experts else self.ffn

    @property
    def largest_layer(self) -> float:
        """Parameters of the largest single weight matrix, what ZeRO-3 gathers at once: the embedding (V x h) or an
        MLP matrix (h x ffn), as DeepSpeed's ZeRO-3 estimator takes the largest module's own parameters."""
        widths = [self.ffn or 4 * self.hidden] + ([self.experts.ffn] if self.experts else [])
        return max([(self.vocab or 0) * self.hidden] + [self.hidden * w for w in widths])

    def memory_shape(self) -> dict:
        """What :func:`course_lib.memory.memory_formula` needs of this model beyond the parallel layout."""
        return {
            "layers": self.layers,
            "seq": self.seq,
            "hidden": self.hidden,
            "heads": self.heads,
            "expert_params": self.expert_params,
            "ffn": self.token_ffn,
            "vocab": self.vocab,
            "tied": self.tied,
            "kv_heads": self.kv_heads,
            "swiglu": self.swiglu,
            "norm": self.norm,
            "largest_layer": self.largest_layer,
        }


def swiglu_params(hidden: int, ffn: int) -> int:
    """A SwiGLU FFN: gate, up and down projections, three h x ffn matrices, no biases (Shazeer 2020)."""
    return 3 * hidden * ffn


def gqa_params(hidden: int, heads: int, kv_heads: int) -> int:
    """Grouped-query attention without biases: q and o h x h, k and v h x kv_heads*head_dim (Ainslie et al. 2023)."""
    return 2 * hidden * hidden + 2 * hidden * (kv_heads * hidden // heads)


def mla_params(hidden: int, heads: int, head_dim: int, rope_dim: int, q_rank: int, kv_rank: int) -> int:
    """Multi-head latent attention (DeepSeek-V2 §2.1.2, DeepSeek-V3 §2.1.1 eqs. 1-11): K/V down-projection to
    ``kv_rank`` with a shared RoPE key (h x (kv_rank + rope_dim)), their up-projections (kv_rank x heads x 2
    head_dim), the query down- and up-projections with a RoPE part per head (h x q_rank, q_rank x heads x
    (head_dim + rope_dim)), the output projection (heads x head_dim x h) and the RMSNorms of the two latents."""
    kv = hidden * (kv_rank + rope_dim) + kv_rank * heads * 2 * head_dim
    q = hidden * q_rank + q_rank * heads * (head_dim + rope_dim)
    return kv + q + heads * head_dim * hidden + q_rank + kv_rank


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """Parameters of a Llama 3 model (Grattafiori et al. 2024, Table 3 dims): per layer grouped-query attention, a
    SwiGLU MLP and two RMSNorm weights; untied input and output embeddings, a final norm. Gives the released
    checkpoints' 8,030,261,248, 70,553,706,496 and 405,853,388,800 parameters."""
    return transformer_params(
        layers, hidden, vocab, heads=heads, kv_heads=kv_heads, ffn=ffn, swiglu=True, tied=False, norm="rmsnorm",
        biases=False,
    )["total"]  # fmt: skip


def moe_params(
    layers: int, hidden: int, attention: int, experts: Experts, dense_ffn: int, vocab: int, active: bool = False
) -> int:
    """Parameters of a mixture-of-experts transformer, all of them or (``active``) those one token computes with:
    per layer ``attention`` parameters and two RMSNorms; an MoE layer's FFN is its routed experts (only ``top_k``
    active), its shared experts and the router (routed x h; DeepSeek-V3's bias used only to choose experts is not
    trained by gradients and not counted), a dense layer's a SwiGLU ``dense_ffn`` wide; untied embeddings and a
    final norm (Fedus et al. 2022, §2; DeepSeek-V3 §2.1.2)."""
    expert = swiglu_params(hidden, experts.ffn)
    visited = (experts.top_k if active else experts.routed) + experts.shared
    moe_layer = attention + visited * expert + experts.routed * hidden + 2 * hidden
    dense_layer = attention + swiglu_params(hidden, dense_ffn) + 2 * hidden
    moe = layers - experts.dense_layers
    return moe * moe_layer + experts.dense_layers * dense_layer + 2 * vocab * hidden + hidden


_LLAMA3 = "Grattafiori et al. 2024 (The Llama 3 Herd of Models), Table 3; 8192-token pretraining sequences"
_GPT3 = "Brown et al. 2020, Table 2.1 (dims, vocabulary 50257)"


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, **known) -> Model:
    """A Llama 3 model of these sizes and what the family shares: 8 K/V heads, a 128,256-token vocabulary, a SwiGLU
    MLP ``ffn`` wide, RMSNorm and untied embeddings, 8K-token sequences (Grattafiori et al. 2024, Table 3; the
    released checkpoints), its parameters counted by :func:`llama_params`."""
    known.setdefault("source", _LLAMA3)
    return Model(
        name, llama_params(layers, hidden, heads, 8, ffn, 128256), layers, hidden, heads, 8192, kv_heads=8,
        vocab=128256, ffn=ffn, swiglu=True, tied=False, norm="rmsnorm", **known,
    )  # fmt: skip


_LLAMA3_405B = _llama(
    "llama3-405b",
    126,
    16384,
    128,
    53248,
    global_batch=2048,
    published={"tp": 8, "pp": 16, "dp": 128},
    source=_LLAMA3 + "; Table 4: on 16,384 H100s TP 8, CP 1, PP 16, DP 128, 16M tokens (2048 sequences) a batch",
)
_DEEPSEEK_V3 = Experts(routed=256, top_k=8, ffn=2048, shared=1, dense_layers=3)
_DEEPSEEK_V3_ATTENTION = mla_params(7168, 128, 128, 64, 1536, 512)
_MIXTRAL = Experts(routed=8, top_k=2, ffn=16384)
PRESETS = {
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _LLAMA3_405B,
    "llama3-405b-128k": replace(
        _LLAMA3_405B,
        name="llama3-405b-128k",
        seq=131072,
        global_batch=128,
        published={"tp": 8, "cp": 16, "pp": 16, "dp": 4},
        source=_LLAMA3 + "; §3.4.2 and Table 4, long-context pretraining: 131,072-token sequences, 16M tokens (128 "
        "sequences) a batch, TP 8, CP 16, PP 16 and DP printed as 4, which makes 8,192 GPUs, not the 16,384 the "
        "row states (DP 8 would): a slip in the table; planned here on the 8,192 its axes multiply to",
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
        vocab=50257,
    ),
    "megatron-1t": Model(
        "megatron-1t",
        params_from_dims(128, 25600, 51200, 2048),
        128,
        25600,
        160,
        2048,
        global_batch=3072,
        published={"tp": 8, "pp": 64, "dp": 6},
        source="Narayanan et al. 2021, Table 1: 1008B parameters, 128 layers, hidden 25600, 160 heads, on 3072 "
        "A100s TP 8, PP 64 (DP 6), batch 3072",
        vocab=51200,
    ),
    "deepseek-v3": Model(
        "deepseek-v3",
        moe_params(61, 7168, _DEEPSEEK_V3_ATTENTION, _DEEPSEEK_V3, 18432, 129280),
        61,
        7168,
        128,
        4096,
        active_params=moe_params(61, 7168, _DEEPSEEK_V3_ATTENTION, _DEEPSEEK_V3, 18432, 129280, active=True),
        global_batch=15360,
        published={"tp": 1, "pp": 16, "dp": 128, "ep": 64, "zero": 1},
        source="DeepSeek-AI 2024 (DeepSeek-V3 technical report): 671B parameters, 37B active, 61 layers, hidden "
        "7168, 128 heads, MLA (kv rank 512, q rank 1536, head dim 128, RoPE dim 64), 1 shared + 256 routed experts "
        "of FFN 2048, top-8, the first 3 layers dense (FFN 18432), vocabulary 129,280 (§4.2); 4K sequences, batch "
        "15,360 (§4.2); trained on 2,048 H800s with 16-way PP, 64-way expert parallelism over 8 nodes and ZeRO-1 "
        "DP, no TP (§3.2): here PP 16 x DP 128 with EP 64 carved out of the 128, the 2 replicas of each expert "
        "being DeepSeek's DP 2. The multi-token-prediction module (14B, §2.2) is not counted",
        kv_heads=128,
        experts=_DEEPSEEK_V3,
        vocab=129280,
        ffn=18432,
        swiglu=True,
        tied=False,
        norm="rmsnorm",
    ),
    "mixtral-8x22b": Model(
        "mixtral-8x22b",
        moe_params(56, 6144, gqa_params(6144, 48, 8), _MIXTRAL, 0, 32768),
        56,
        6144,
        48,
        4096,
        active_params=moe_params(56, 6144, gqa_params(6144, 48, 8), _MIXTRAL, 0, 32768, active=True),
        published={"tp": 4, "pp": 4, "dp": 8, "ep": 8},
        source="Mistral AI 2024: 141B parameters, 39B active; dims from the released config.json (56 layers, "
        "hidden 6144, 48 heads, 8 KV heads, 8 experts of FFN 16384, top-2, vocabulary 32,768, untied); the "
        "training sequence length is not published, 4096 assumed; no training layout is published either: EP 8 x "
        "PP 4 x TP 4 (128 GPUs, EP 8 carved out of DP 8) is the course lecture's claim, not Mistral's",
        kv_heads=8,
        experts=_MIXTRAL,
        vocab=32768,
        swiglu=True,
        tied=False,
        norm="rmsnorm",
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
    return Model(f"custom-{params / 1e9:.3g}b", params, layers, hidden, heads, seq, vocab=vocab)


@dataclass
class Candidate:
    """One layout and its numbers: memory per GPU by category (``memory``), the step time and its parts
    (``time``), the FLOPs a step does and the rate that makes (model FLOPs, :func:`flops_per_token`; hardware
    FLOPs, :func:`hardware_flops_per_token`, with the recomputed forward), and where each group of more than one GPU
    sits (``placement``)."""

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
    schedule: str = "1f1b"  # the pipeline schedule (:data:`PIPELINE_SCHEDULES`)
    chunks: int = 1  # model chunks per pipeline rank (v), more than 1 only interleaved (zb-v, dualpipev fix 2)
    attention: str = "flash"  # the attention kernel (:data:`ATTENTION`)
    sp: bool = True  # sequence parallelism with TP (Korthikanti et al. 2022, §4.2.2)
    model_flops: float = 0.0  # per step, :func:`flops_per_token` x tokens
    hardware_flops: float = 0.0  # per step, :func:`hardware_flops_per_token` x tokens
    tflops_per_gpu: float = 0.0  # model FLOPs per second per GPU, in TFLOP/s
    hardware_tflops_per_gpu: float = 0.0
    mfu: float = 0.0  # model FLOPs utilization: model FLOP/s per GPU over the profile's dense peak
    hfu: float = 0.0  # hardware FLOPs utilization, the same with the recomputed forward counted


class Layout(NamedTuple):
    """One way to lay a model out: the degrees, the ZeRO stage, the microbatches per DP rank and the pipeline
    schedule with its chunks per rank."""

    tp: int
    pp: int
    dp: int
    zero: int
    microbatches: int
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1


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


def _bytes(x: float) -> str:
    return f"{x / 1e12:.2f} TB" if x >= 1e12 else f"{x / 1e9:.1f} GB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SHORT_STAGES = 3  # Llama 3: 126 layers on 16 stages leave 2 short; DeepSeek-V3: 61 on 16 leave 3


def splits_layers(layers: int, pp: int) -> bool:
    """Stages of ceil(L/p) layers, at most ``SHORT_STAGES`` of them one layer shorter: Llama 3 puts 126 layers on
    16 stages so, the first and last one layer short as they also hold the embedding and the output head
    (Grattafiori et al. 2024, §3.3.2); DeepSeek-V3 trains its 61 layers on 16 stages (§3.2), three short."""
    return pp <= layers and pp * math.ceil(layers / pp) - layers <= SHORT_STAGES


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
    the ring behind (:func:`cp_comm_exposed`)."""
    return [
        cp for cp in _divisors(ranks) if cp == 1 or (model.seq % (2 * cp) == 0 and model.seq // cp >= MIN_CP_TOKENS)
    ]


def ep_degrees(model: Model, ranks: int) -> list[int]:
    """Expert-parallel degrees: each rank holds a whole number of experts, and EP divides the ``ranks`` (a
    stage's TP x CP x DP) it is carved out of."""
    if not model.experts:
        return [1]
    return [ep for ep in _divisors(model.experts.routed) if ranks % ep == 0]


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
    only without TP and PP). ``no_mp``: TP = CP = PP = EP = 1."""
    out = []
    for tp in _divisors(gpus_per_node):
        if not splits_heads(model, tp) or gpus % tp or (no_mp and tp > 1):
            continue
        for cp in cp_degrees(model, gpus // tp) if context and not no_mp else [1]:
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                m, rest = divmod(global_batch, dp * micro_batch)
                if (no_mp and pp > 1) or not splits_layers(model.layers, pp) or rest or m < pp:
                    continue
                zeros = (0,) if dp * cp == 1 else (0, 1, 2, 3) if tp == pp == 1 else (0, 1, 2)
                eps = [1] if no_mp else ep_degrees(model, tp * cp * dp)
                out += [
                    Layout(tp, pp, dp, zero, m, cp, ep, schedule, chunks)
                    for schedule, chunks in pipeline_schedules(model.layers, pp, m)
                    for ep in eps
                    for zero in zeros
                ]
    return out


# What the planner costs (the schedules module has GPipe too): the search ranks the first three
# (:func:`pipeline_schedules`); the others it evaluates for a given layout and beside its choice
# (:func:`beyond_search`).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")


def pipeline_schedules(layers: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, chunks) the search tries on a pipeline of ``pp`` stages with ``microbatches``: none but 1F1B's
    trivial one without a pipeline; else 1F1B (PipeDream-Flush, Narayanan et al. 2021, §2.2.1), ZB-H1 (Qi et al.
    2023, §3.1; at least p microbatches, as every layout here has) and interleaved 1F1B with each v of
    :func:`interleave_chunks`: what the published runs the planner is checked against could run."""
    if pp == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1), ("zb-h1", 1)] + [("interleaved", v) for v in interleave_chunks(layers, pp, microbatches)]


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
    return [v for v in _divisors(math.ceil(layers / pp)) if v > 1]


@cache
def groups(tp: int, pp: int, dp: int, cp: int = 1, ep: int = 1) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every group of each axis, rank 0's first, each in increasing rank order, ranks placed as Llama 3 orders
    them, TP fastest, then CP, then PP, then DP (§3.3.2): rank = ((d x PP + p) x CP + c) x TP + t, as
    :mod:`course_lib.mesh` numbers them. An EP group is ``ep`` consecutive ranks of a stage's TP x CP x DP ranks in
    that order (Megatron-core's folding of EP into them); ``dp_cp``, the DP x CP ranks that average dense
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


def flops_per_token(model: Model) -> float:
    """Model FLOPs per token, what MFU counts: 6 x the *active* parameters (2 forward, 4 backward; Kaplan et al.
    2020, §2.1; a mixture of experts computes with the experts a token visits, Fedus et al. 2022, §2), plus the
    attention scores and their product with V, 4 s h per layer forward, x 3 with the backward, halved by the causal
    mask (Narayanan et al. 2021, §5.1, whose 96 B s l h^2 (1 + s/6h + ...) counts them unmasked and recomputed):
    6 L s h (:func:`attention_flops_per_token`). At 8K tokens Llama 3 405B's attention is 4% of its FLOPs, at 128K
    40%."""
    return 6 * (model.active_params or model.params) + attention_flops_per_token(model, "flash")


ATTENTION = ("flash", "materialized")  # FlashAttention (Dao et al. 2022) or scores written to memory (Megatron 2021)
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
    profile's ``matmul_efficiency`` of peak, its attention scores at the kernel's (:func:`_attention_efficiency`)
    and its element-wise kernels at the memory bandwidth (:func:`elementwise_bytes`), one after the other."""
    tokens = micro_batch * model.seq / c.cp / c.tp  # what a GPU's share of the matmuls amounts to
    matmul = 2 * layer_params(model) * tokens * (3 + RECOMPUTE_PASSES[c.recompute])
    attention = attention_flops_per_token(model, c.attention) / model.layers * tokens
    attention *= 1 + (c.recompute != "none") / 3
    return (
        matmul / _rate(profile, precision, profile.matmul_efficiency)
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


def stage_layers(model: Model, pp: int) -> tuple[int, int]:
    """Layers of a full stage, ceil(L/p), and of the last stage: one fewer when the layers do not split evenly
    (:func:`splits_layers`: Llama 3's last stage holds the head instead of a layer, §3.3.2)."""
    full = math.ceil(model.layers / pp)
    return full, full - (pp * full > model.layers)


def stage_seconds(model: Model, c: Candidate, micro_batch: int, profile: HardwareProfile, precision: str) -> float:
    """One microbatch's compute on the slowest stage: a full stage's layers, or the last stage's with the output
    head (:func:`head_seconds`), whichever is longer; every stage runs at the slowest one's pace."""
    full, last = stage_layers(model, c.pp)
    layer = layer_seconds(model, c, micro_batch, profile, precision)
    return max(full * layer, last * layer + head_seconds(model, c, micro_batch, profile, precision))


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
    return (4 + 2 * RECOMPUTE_PASSES[c.recompute]) * stage_layers(model, c.pp)[0] * c.microbatches * one


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


def dispatch_bytes(model: Model, c: Candidate | Layout, micro_batch: int) -> float:
    """What one rank hands one of expert parallelism's all-to-alls (dispatch or combine) for one microbatch, in
    bytes (:mod:`course_lib.comm`'s S): its tokens, b x s / (cp x tp) (sequence parallelism and CP split them),
    top_k copies each, h 16-bit values a copy (GShard, Lepikhin et al. 2021, §3.2). Under uniform routing
    (ep-1)/ep of it leaves the rank (:func:`course_lib.comm.ring_factor`). DeepSeek-V3 dispatches in FP8, half
    of this (§3.3)."""
    tokens = micro_batch * model.seq / (c.cp * c.tp)
    return 2 * tokens * model.experts.top_k * model.hidden


def ep_comm(model: Model, c: Candidate, micro_batch: int, net: Network) -> float:
    """Expert parallelism's all-to-alls, not overlapped (1F1B; DeepSeek-V3's DualPipe hides them behind another
    microbatch's compute, §3.2.1). Per MoE layer and microbatch four: dispatch and combine, forward and
    backward (GShard, Lepikhin et al. 2021, §3.2; Switch Transformers, Fedus et al. 2022, §2.2), each of
    :func:`dispatch_bytes`, timed as an all-to-all on the EP group's slowest link
    (:func:`course_lib.hardware.collective_time`)."""
    if c.ep == 1:
        return 0.0
    ranks = groups(c.tp, c.pp, c.dp, c.cp, c.ep)["ep"]
    one = net.time("all_to_all", ranks, dispatch_bytes(model, c, micro_batch))
    return 4 * model.moe_layers / c.pp * c.microbatches * one


def step_time(model: Model, c: Candidate, micro_batch: int, net: Network, precision: str) -> dict[str, float]:
    """Time per step, in seconds, by part (the assumptions: ``course_lib.hardware.TIME_MODEL_ASSUMPTIONS``):

    * compute: the microbatches through the slowest stage (:func:`stage_seconds`);
    * TP: :func:`tp_comm`; CP: what :func:`cp_comm_exposed` leaves exposed; EP: :func:`ep_comm`;
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
        "ep_comm_s": ep_comm(model, c, micro_batch, net),
    }
    ratio = bubble_ratio(c.schedule, c.pp, c.microbatches, c.chunks, schedule_costs(c.recompute))
    parts["bubble_s"] = ratio * sum(parts.values())
    parts["pp_comm_s"] = pp_comm(model, c, micro_batch, net)
    parts["dp_comm_exposed_s"] = dp_comm_exposed(model, c, compute, net, precision)
    return parts


AXES = ("tp", "cp", "pp", "dp", "ep")


def placement(c: Candidate, net: Network) -> dict[str, dict]:
    """For each axis of groups of more than one GPU, where they sit (:meth:`course_lib.network.Network.where`)."""
    return {
        axis: net.where(ranks)
        for axis, ranks in groups(c.tp, c.pp, c.dp, c.cp, c.ep).items()
        if axis in AXES and len(ranks[0]) > 1
    }


def evaluate(
    model: Model,
    layout: Layout | tuple,
    gpus: int,
    net: Network,
    gpu_mem: float,
    global_batch: int,
    micro_batch: int,
    precision: str,
    recompute: str,
    attention: str = "flash",
    sp: bool | None = None,
) -> Candidate:
    """Memory (:func:`memory_formula`, TP with SP unless ``sp`` is False, experts over EP, activations over CP and
    for an interleaved schedule's chunks), bubble, step time, FLOPs and their rate, and placement of one layout (a
    :class:`Layout`, or its first five fields)."""
    tp, pp, dp, zero, m, cp, ep, schedule, chunks = Layout(*layout)
    sp = tp > 1 if sp is None else sp and tp > 1
    memory = memory_formula(
        model.params,
        precision,
        zero,
        dp,
        tp,
        pp,
        micro_batch=micro_batch,
        sp=sp,
        recompute=recompute,
        ep=ep,
        cp=cp,
        attention=attention,
        chunks=chunks,
        **model.memory_shape(),
    )
    _schedule_activations(memory, schedule, pp, m)
    c = Candidate(tp, pp, dp, zero, m, recompute, memory["total"] <= gpu_mem, memory["total"], 0.0, 0.0, memory)
    c.cp, c.ep, c.schedule, c.chunks, c.attention, c.sp = cp, ep, schedule, chunks, attention, sp
    c.bubble_fraction = bubble_formula(schedule, pp, m, chunks, schedule_costs(recompute)) if pp > 1 else 0.0
    c.time = step_time(model, c, micro_batch, net, precision)
    c.step_time_s = sum(c.time.values())
    _throughput(model, c, gpus, global_batch, net.profile, precision)
    c.placement = placement(c, net)
    return c


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


def network(profile: HardwareProfile, gpus: int, gpus_per_node: int | None, topology: str | Topology | None) -> Network:
    """The :class:`course_lib.network.Network` a plan is timed on: the profile's nodes (of ``gpus_per_node``),
    or ``topology`` sized to ``gpus`` (:func:`course_lib.topology.for_gpus`); not both."""
    if topology is None:
        return Network(profile, gpus_per_node or profile.gpus_per_node)
    if gpus_per_node is not None:
        raise ValueError("a topology says which GPUs share a node; drop gpus_per_node")
    topo = for_gpus(topology, gpus) if isinstance(topology, str) else topology
    if topo.n_gpus != gpus:
        raise ValueError(f"{topo.name} has {topo.n_gpus} GPUs, not the plan's {gpus}; give a topology of {gpus}")
    return Network(profile, profile.gpus_per_node, topo)  # with a topology, its domain replaces the nodes


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
    topology: str | Topology | None = None,
) -> Plan:
    """Plan ``model`` (a :class:`Model`, a preset name or a parameter count) on ``gpus`` GPUs. GPUs per node and
    memory default to the ``hardware`` profile's; the global batch (sequences) to the preset's published one, else
    ``DEFAULT_GLOBAL_BATCH``. Selective recompute is used only if nothing fits without it, context parallelism only
    if nothing fits without it even with selective recompute (:func:`_tries`). With ``topology`` (a profile name
    of :mod:`course_lib.topology`, sized to the GPUs unless given ``NAME:SIZE``, or a Topology of ``gpus`` GPUs)
    the traffic is timed on its links (:mod:`course_lib.network`), TP may grow to its fast domain (an NVL72 rack,
    a whole torus) and the reasons say where each group sits; compute and memory stay the hardware profile's."""
    model = _as_model(model)
    profile = get_profile(hardware)
    net = network(profile, gpus, gpus_per_node, topology)
    per_node = net.domain
    gpu_mem = gpu_mem_bytes or profile.memory_bytes
    batch = global_batch or model.global_batch or DEFAULT_GLOBAL_BATCH
    _check(gpus, per_node, batch, micro_batch, precision)
    tries, without_cp = _tries(model, gpus, net, gpu_mem, batch, micro_batch, precision, no_model_parallel)
    ranked = tries[-1]
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
        topology=net.topology.name if net.topology else None,
        network=net,
    )
    result.reasons = explain(result, profile, tree_best, tries[0][0], without_cp)
    return result


def evaluate_layout(
    model: Model | str | float,
    gpus: int,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    zero: int | None = None,
    schedule: str = "1f1b",
    chunks: int = 1,
    micro_batch: int = 1,
    global_batch: int | None = None,
    recompute: str = "none",
    hardware: str = "h100",
    gpus_per_node: int | None = None,
    gpu_mem_bytes: float | None = None,
    precision: str = "mixed",
    attention: str = "flash",
    sp: bool | None = None,
    topology: str | Topology | None = None,
) -> Candidate:
    """One given layout of ``model`` (a :class:`Model`, a preset name or a parameter count) on ``gpus`` GPUs, as
    the planner evaluates its own (:func:`evaluate`): memory, step time and its parts, FLOPs, TFLOP/s per GPU and
    MFU. DP defaults to the GPUs the other axes leave, the global batch to the model's published one (else
    ``DEFAULT_GLOBAL_BATCH``), ZeRO to the lowest stage that fits (the lowest of all if none does), SP to TP > 1.
    A layout that cannot run raises ValueError saying how to fix it (:func:`check_layout`). ``topology``: as
    for :func:`plan`."""
    model = _as_model(model)
    profile = get_profile(hardware)
    net = network(profile, gpus, gpus_per_node, topology)
    per_node = net.domain
    batch = global_batch or model.global_batch or DEFAULT_GLOBAL_BATCH
    _check(gpus, per_node, batch, micro_batch, precision)
    dp = dp if dp is not None else max(1, gpus // (tp * cp * pp))
    check_layout(model, gpus, tp, pp, dp, cp, ep, zero, schedule, chunks, micro_batch, batch, recompute, attention)
    m = batch // (dp * micro_batch)
    zeros = [zero] if zero is not None else [0, 1, 2] + [3] * (tp == pp == 1) if dp * cp > 1 else [0]
    tried = [
        evaluate(
            model,
            Layout(tp, pp, dp, z, m, cp, ep, schedule, chunks),
            gpus,
            net,
            gpu_mem_bytes or profile.memory_bytes,
            batch,
            micro_batch,
            precision,
            recompute,
            attention,
            sp,
        )
        for z in zeros
    ]
    return next((c for c in tried if c.fits), tried[0])


def check_layout(
    model: Model,
    gpus: int,
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    ep: int,
    zero: int | None,
    schedule: str,
    chunks: int,
    micro_batch: int,
    global_batch: int,
    recompute: str,
    attention: str,
) -> None:
    """Refuse a layout that cannot run, in one sentence that says what to change."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    _check_degrees(model, gpus, tp, pp, dp, cp, ep)
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {zero}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, not {recompute!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, not {attention!r}")
    m, rest = divmod(global_batch, dp * micro_batch)
    if rest:
        raise ValueError(
            f"a global batch of {global_batch} sequences does not split into micro-batches of {micro_batch} over "
            f"DP {dp}: make the global batch a multiple of DP x micro-batch = {dp * micro_batch}"
        )
    _check_schedule(model, pp, dp, m, schedule, chunks, micro_batch)
    if pp > 1 and bubble_ratio(schedule, pp, m, chunks, schedule_costs(recompute)) is None:
        raise ValueError(
            f"{schedule_name(schedule, chunks)} has no closed-form bubble with {recompute} recompute (B = "
            f"{schedule_costs(recompute).b:g} F): use recompute none or selective, or another schedule"
        )


def _check_degrees(model: Model, gpus: int, tp: int, pp: int, dp: int, cp: int, ep: int) -> None:
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
            f"stages one layer short): choose PP among {[p for p in _divisors(gpus) if splits_layers(model.layers, p)]}"
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


def _check_schedule(model: Model, pp: int, dp: int, m: int, schedule: str, chunks: int, micro_batch: int) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    if chunks > 1 and schedule in ("zb-v", "dualpipev"):
        raise ValueError(f"{schedule_name(schedule)} fixes 2 chunks per rank in a V: leave chunks out")
    if chunks > 1 and schedule != "interleaved":
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
                f"{[v for v in _divisors(stage) if v > 1]}"
            )


def _tries(
    model: Model,
    gpus: int,
    net: Network,
    gpu_mem: float,
    batch: int,
    micro_batch: int,
    precision: str,
    no_mp: bool,
) -> tuple[list[list[Candidate]], list[Candidate] | None]:
    """The ranked candidates of each try, the last one's first fitting: without CP, then (if nothing fits) with
    it, as Llama 3 added CP only for 128K-token sequences; in each, without recompute, then selective. Also, if CP
    was needed, the last try without it (empty: no layout without CP splits the batch)."""
    tries: list[list[Candidate]] = []
    for context in (False, True):
        shapes = layouts(model, gpus, net.domain, batch, micro_batch, no_mp, context)
        for recompute in ("none", "selective") if shapes else ():
            args = (gpus, net, gpu_mem, batch, micro_batch, precision, recompute)
            tries.append(_rank([evaluate(model, layout, *args) for layout in shapes]))
            if tries[-1][0].fits:
                return tries, (tries[-3] if len(tries) > 2 else []) if context else None
    if not tries:
        raise ValueError(
            f"no layout of {gpus} GPUs splits a global batch of {batch} sequences into micro-batches of "
            f"{micro_batch} per DP rank (at least one per pipeline stage): change the batch or the GPUs"
        )
    raise ValueError(_nothing_fits(model, tries[-1][0], gpu_mem))


def _nothing_fits(model: Model, smallest: Candidate, gpu_mem: float) -> str:
    return (
        f"nothing fits in {_bytes(gpu_mem)} per GPU, even with selective recompute and context parallelism: the "
        f"smallest layout, {describe(smallest)}, needs {_bytes(smallest.memory_per_gpu_bytes)}, "
        f"{_bytes(smallest.memory_per_gpu_bytes - gpu_mem)} more than a GPU has; add GPUs (or recompute fully)"
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
            f"needs {_bytes(first_try.memory_per_gpu_bytes)}); selective recompute drops them (so does "
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
        f"the smallest such layout, {describe(without_cp[0])}, needs {_bytes(without_cp[0].memory_per_gpu_bytes)}"
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
    gpu, node_mem = _bytes(p.gpu_mem_bytes), f"{node} x {_bytes(p.gpu_mem_bytes)} = {_bytes(node * p.gpu_mem_bytes)}"
    where = {
        "dp": f"fit one GPU ({gpu})",
        "fsdp": f"exceed one GPU ({gpu})",
        "tp": f"fit one node ({node_mem})",
        "3d": f"exceed one node ({node_mem})",
        "ep": f"exceed one GPU ({gpu}), mostly in experts",
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
    edp = p.tp * p.cp * p.dp // p.ep
    experts = (
        f"; the routed experts' over EP x PP = {p.ep * p.pp}"
        + (f" and ZeRO-{p.zero} over the {edp} expert-data-parallel ranks (TP x CP x DP / EP)" if p.zero else "")
        if p.model.experts
        else ""
    )
    splits = [f"{p.tp} ways by TP with sequence parallelism"] * (p.tp > 1) + [f"{p.cp} ways by CP"] * (p.cp > 1)
    return (
        f"Per GPU: {_bytes(p.memory_per_gpu_bytes)} of {_bytes(p.gpu_mem_bytes)} (GB: {parts}), as "
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
    """One sentence per axis of a layout's :func:`placement`: the group's size, where it sits and its link."""
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
    degrees = [t for t in _divisors(p.network.domain) if splits_heads(p.model, t)]
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
    text += _beyond_search_reason(p)
    short = p.pp * math.ceil(p.model.layers / p.pp) - p.model.layers
    if short:
        text += (
            f" {p.model.layers} layers do not split evenly into {p.pp} stages: {short} of them "
            f"{'(first, last) ' if short <= 2 else ''}get one layer fewer, as in Llama 3; memory counts "
            f"{p.model.layers}/{p.pp} layers a stage and the embedding on the busiest, as the memory command does."
        )
    return text


def beyond_search(p: Plan) -> list[Candidate]:
    """The plan's layout evaluated with each schedule past ZB-H1 it can run (:func:`v_schedules`): their bubble,
    activations and step time beside the choice; the search itself ranks only :func:`pipeline_schedules`."""
    if p.pp == 1:
        return []
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.micro_batch)
    sizes = (p.tp, p.pp, p.dp, p.zero, p.microbatches, p.cp, p.ep)
    return [
        evaluate(p.model, Layout(*sizes, s, 1), *args, p.precision, p.recompute, p.attention, p.sp)
        for s in v_schedules(p.model.layers, p.pp, p.microbatches)
        if bubble_ratio(s, p.pp, p.microbatches, 1, schedule_costs(p.recompute)) is not None
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
        + (f"EP all-to-all {t['ep_comm_s']:.3g} s, " if p.ep > 1 else "")
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
            f"{_bytes(fsdp.memory_per_gpu_bytes)} per GPU, {_bytes(fsdp.memory['activations'])} of it activations "
            f"that only TP splits: {verdict}."
        )
    if p.model.published and published_gpus(p.model.published) == p.gpus:
        out.append(_published_reason(p, published_candidate(p)))
    return out


# Why a published layout can be estimated slower than the choice, by the part of the step that differs most.
SLOWER_BECAUSE = {
    "bubble_s": "its pipeline idles more, even with the schedule that suits it best among those that fit here; "
    "Llama 3 interleaves its stages and DeepSeek-V3 runs DualPipe, both idling less for more activation memory than "
    "this memory model leaves",
    "ep_comm_s": "the all-to-alls are not overlapped here; DeepSeek-V3's DualPipe hides them behind another "
    "microbatch's compute and its routing sends each token to at most 4 nodes (§3.2.1-3.2.2)",
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
        return f"Published: {layout}; here it needs {_bytes(c.memory_per_gpu_bytes)}: no fit."
    fitting = [x for x in p.candidates if x.fits]
    recompute = f", {c.recompute} recompute" if c.recompute != p.recompute else ""
    text = (
        f"Published: {layout}; here it fits with ZeRO-{c.zero}{recompute} at {_bytes(c.memory_per_gpu_bytes)} and "
        f"ranks {1 + sum(x.step_time_s < c.step_time_s for x in fitting)} of {len(fitting)} fitting layouts "
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
    if that fits, else selective; with the fastest schedule that fits (:func:`pipeline_schedules`). None if its
    axes do not split the batch."""
    pub = {axis: p.model.published.get(axis, 1) for axis in AXES}
    m, rest = divmod(p.global_batch, pub["dp"] * p.micro_batch)
    if rest or m < pub["pp"]:
        return None
    zeros = [p.model.published["zero"]] if "zero" in p.model.published else [0, 1, 2]
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.micro_batch)
    schedules = pipeline_schedules(p.model.layers, pub["pp"], m)
    tried = []
    for recompute in ("none", "selective"):
        for zero in zeros:
            sizes = (pub["tp"], pub["pp"], pub["dp"], zero, m, pub["cp"], pub["ep"])
            tried = [evaluate(p.model, Layout(*sizes, *s), *args, p.precision, recompute) for s in schedules]
            fitting = [c for c in tried if c.fits]
            if fitting:
                return min(fitting, key=lambda c: c.step_time_s)
    return tried[0]


def published_gpus(published: dict[str, int]) -> int:
    """The GPUs a published layout's axes multiply to (EP is carved out of the others, not a factor)."""
    return math.prod(published.get(axis, 1) for axis in ("tp", "cp", "pp", "dp"))


def describe_published(published: dict[str, int]) -> str:
    """A published layout as :func:`describe` writes a candidate's (ZeRO only where the source states it)."""
    sizes = {axis: published.get(axis, 1) for axis in AXES}
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
