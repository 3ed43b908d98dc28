"""The models the planner plans for: :class:`Model` (with its mixture of experts, :class:`Experts`), the parameter
counts of real architectures (Llama 3, GPT-3, Megatron's 1T, DeepSeek-V3's MLA and MoE, Mixtral), :data:`PRESETS`
built from them, and the stand-in for a bare parameter count (:func:`nominal_model`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.model.formulas import check_params, params_from_dims, transformer_params

DEFAULT_SEQ = 2048  # GPT-3's context (Brown et al. 2020)
DEFAULT_GLOBAL_BATCH = 1024  # sequences: 2M tokens at 2048, GPT-3 13B's batch (Brown et al. 2020, Table 2.1)
HEAD_DIM = 128  # GPT-3 from 6.7B up, Llama 3


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts FFN of a model: ``routed`` experts of which each token visits ``top_k`` (GShard,
    Lepikhin et al. 2021, §2.2; Switch Transformers, Fedus et al. 2022, §2.1), each a SwiGLU FFN ``ffn`` wide,
    ``shared`` experts every token visits (DeepSeekMoE; DeepSeek-V3 §2.1.2), in every layer but the first
    ``dense_layers`` (DeepSeek-V3's 3), which keep a plain FFN.

    What expert parallelism's all-to-alls carry (:func:`course_lib.planner.cost.ep_comm`): ``dispatch_bytes`` a
    value on the way to the experts (the forward's dispatch and the backward's gradient into the experts' down
    projections), ``combine_bytes`` on the way back (the forward's combine and the backward's gradient out of the
    up projections); 2 (BF16) unless a source says otherwise: DeepSeek-V3 dispatches in FP8 (1 byte; its one
    scale per 128 values left out) and keeps both combines in BF16 (§3.3.3, "Low-Precision Communication").
    ``max_nodes``: node-limited routing, each token sent to at most that many nodes (DeepSeek-V3's 4, §3.2.2);
    None: no limit."""

    routed: int
    top_k: int
    ffn: int
    shared: int = 0
    dense_layers: int = 0
    dispatch_bytes: float = 2
    combine_bytes: float = 2
    max_nodes: int | None = None

    def check(self, layers: int, ep: int = 1) -> None:
        """Refuse what cannot be built, saying what to change."""
        if self.routed < 1 or self.top_k < 1 or self.ffn < 1 or self.shared < 0:
            raise ValueError("experts, top-k and the expert FFN must be at least 1 (shared experts at least 0)")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"a token must reach at least 1 node, not max_nodes {self.max_nodes}")
        if self.top_k > self.routed:
            raise ValueError(f"top-k {self.top_k} is more than the {self.routed} experts: choose top-k <= experts")
        if not 0 <= self.dense_layers < layers:
            raise ValueError(f"dense layers must be between 0 and layers - 1 = {layers - 1}, not {self.dense_layers}")
        if self.routed % ep:
            raise ValueError(
                f"{self.routed} experts do not split over ep {ep}: each expert-parallel rank holds a whole number of "
                f"experts; choose an ep that divides {self.routed}"
            )

    def pattern(self, layers: int) -> tuple[bool, ...]:
        """Which of ``layers`` layers are MoE layers, first to last: all but the first ``dense_layers`` (the
        per-layer pattern of :func:`course_lib.model.formulas.memory_formula`, Megatron-core's ``moe_layer_freq``
        as a list)."""
        return (False,) * self.dense_layers + (True,) * (layers - self.dense_layers)

    def routed_params(self, layers: int, hidden: int) -> int:
        """Parameters of the routed experts of a ``layers``-layer model, the ones expert parallelism shards."""
        return sum(self.pattern(layers)) * self.routed * swiglu_params(hidden, self.ffn)

    def dense_mlp(self, hidden: int, dense_ffn: int, swiglu: bool = True) -> int:
        """Parameters a dense layer's MLP (``dense_ffn`` wide) holds beyond what an MoE layer holds outside its
        routed experts, its shared experts and router (:func:`moe_params`)."""
        mlp = swiglu_params(hidden, dense_ffn) if swiglu else 2 * hidden * dense_ffn
        return mlp - self.shared * swiglu_params(hidden, self.ffn) - self.routed * hidden

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
        return sum(self.moe_pattern)

    @property
    def moe_pattern(self) -> tuple[bool, ...]:
        """Which layers are MoE layers (:meth:`Experts.pattern`); empty without experts."""
        return self.experts.pattern(self.layers) if self.experts else ()

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
        """What :func:`course_lib.model.formulas.memory_formula` needs of this model beyond the parallel layout."""
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
            "moe_pattern": self.moe_pattern,
            "dense_mlp": self.experts.dense_mlp(self.hidden, self.ffn or 4 * self.hidden, self.swiglu)
            if self.experts
            else 0.0,
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
    moe = sum(experts.pattern(layers))
    return moe * moe_layer + (layers - moe) * dense_layer + 2 * vocab * hidden + hidden


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
# FP8 dispatch, BF16 combine (§3.3.3); each token to at most 4 nodes (§3.2.2)
_DEEPSEEK_V3 = Experts(
    routed=256, top_k=8, ffn=2048, shared=1, dense_layers=3, dispatch_bytes=1, combine_bytes=2, max_nodes=4
)
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
        "DP, no TP, DualPipe (§3.2, §3.2.1); dispatch in FP8, combine in BF16 (§3.3.3), each token to at most 4 nodes "
        "(§3.2.2): here PP 16 x DP 128 with EP 64 carved out of the 128, the 2 replicas of each expert being "
        "DeepSeek's DP 2. The multi-token-prediction module (14B, §2.2) is not counted",
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


# Megatron-Bridge's DeepSeek-V3 on 1,024 H100s (docs/performance-summary.md, 25.09 container, DGX-H100 table): GBS
# 8192, MBS 1, 4096 tokens, TP 2, PP 8, CP 1, VP 4, EP 64, GA 128, no FSDP.
PRESETS["deepseek-v3-h100"] = replace(
    PRESETS["deepseek-v3"],
    name="deepseek-v3-h100",
    global_batch=8192,
    published={"tp": 2, "pp": 8, "dp": 64, "ep": 64},
    source="DeepSeek-V3's architecture (DeepSeek-AI 2024, §4.2) as Megatron-Bridge trains it on 1,024 H100s: "
    "docs/performance-summary.md (25.09 NeMo container, DGX-H100): GBS 8192 sequences of 4096 tokens, MBS 1, TP 2, "
    "PP 8 with VP 4 (interleaved), CP 1, EP 64 (carved out of DP 64), 128 gradient accumulations, DDP, 338 model "
    "TFLOP/s per GPU. The routing stays the model's (its config groups experts by node, 4 groups a token); the "
    "dispatch and combine precisions are not stated there, DeepSeek's are kept",
)


def nominal_model(params: float, seq: int = DEFAULT_SEQ) -> Model:
    """A GPT-3-shaped stand-in when only the parameter count is known (Brown et al. 2020, Table 2.1, from 6.7B up:
    hidden = 128 x layers, heads of 128): hidden rounded to a multiple of 1024 (heads a multiple of 8), layers to
    a multiple of 8, from N = 12 L h^2."""
    check_params(params)
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


def as_model(model: Model | str | float) -> Model:
    """A :class:`Model` as given, a preset by its name (:data:`PRESETS`) or a parameter count
    (:func:`nominal_model`)."""
    if isinstance(model, Model):
        return model
    return make_model(preset=model) if isinstance(model, str) else nominal_model(model)
