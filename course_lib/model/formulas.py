"""The formulas that predict what a rank holds: parameters counted from a model's dimensions, bytes per parameter
under a named convention (:data:`course_lib.model.config.PRECISIONS`) divided by ZeRO stage over D data-parallel
ranks (Rajbhandari et al. 2020, §5.1-5.3) and by tensor and pipeline parallel degrees, the busiest pipeline stage
holding one embedding matrix beside its layers (routed experts by expert and pipeline parallel degrees, ZeRO over
the expert-data-parallel group; ZeRO-3 keeping its largest gathered layer), and activation bytes per transformer
layer (Korthikanti et al. 2022, §4, Table 2, with FlashAttention by default, grouped-query attention and SwiGLU;
split by context parallelism) and outside the layers, plus the exact count for our tiny GPT. What they predict,
:class:`course_lib.ledgers.memory.MemoryMeter` measures; ``tests/test_memory_references.py`` compares them with
Megatron-LM's and DeepSpeed's estimators.
"""

from __future__ import annotations

import math

from course_lib.ledgers.categories import CATEGORIES
from course_lib.model.config import (
    NORMS,
    GPTConfig,
    Layout,
    Precision,
    TrainConfig,
    check_attention,
    check_norm,
    check_recompute,
    precision_of,
)
from course_lib.model.stages import (
    check_moe_pattern,
    check_stage_layers,
    stage_expert_params,
    stage_name,
    stage_params,
    stage_shape,
)

# The most parameters the formulas take: a thousand times the largest models trained with a published size (a
# trillion or two: Switch-C's 1.6T, Kimi K2's 1T), so that a slip of the exponent gets no number for a model that
# nobody builds.
MAX_PARAMS = 10**15


def check_params(params: float) -> None:
    """Refuse a parameter count the formulas should not take: not a number, or beyond :data:`MAX_PARAMS`."""
    if not params <= MAX_PARAMS:  # NaN too
        raise ValueError(
            f"{params:g} parameters: the course's formulas take at most {MAX_PARAMS:.0e} (a thousand times the "
            "largest model trained); give the parameter count of a model that could be built"
        )


def model_state_formula(
    params: float,
    precision: str | Precision = "fp32",
    zero: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    expert_params: float = 0.0,
    ep: int = 1,
    cp: int = 1,
    *,
    embedding_params: float = 0.0,
    tied: bool = True,
    replicated_params: float = 0.0,
    largest_layer: float = 0.0,
    stage_layers: tuple[int, ...] = (),
    final_norm: float = 0.0,
    moe_pattern: tuple[bool, ...] = (),
    dense_mlp: float = 0.0,
    stage: int | None = None,
) -> dict[str, float]:
    """Predicted model-state bytes on the busiest device for ``params`` parameters, ``expert_params`` of them in
    routed experts, at ``precision``'s bytes per parameter (:data:`course_lib.model.config.PRECISIONS`:
    ``mixed``/``zero`` 16, ``megatron`` 18, ``deepspeed``, ``no-master`` 12, ``fp32`` 16).

    Dense parameters: pipeline parallelism gives each stage its share of the layers (``stage_layers``, the layers
    of each stage when uneven), and the end stages one V x h embedding matrix more (:func:`stage_params`, with
    ``embedding_params`` = V x h; 0: all spread evenly); the bytes are those of ``stage`` (counted from 0), or by
    default of the stage that holds the most;
    tensor parallelism splits them over ``tp`` ranks but for ``replicated_params`` (LayerNorm weights, which every
    TP rank keeps). ZeRO then divides, over the ``dp * cp`` ranks that hold the same shard, the optimizer state
    (stage 1, P_os; Megatron-LM's distributed optimizer), also the gradients (stage 2, P_os+g) and also the
    parameters (stage 3, P_os+g+p) — Rajbhandari et al. 2020, §5.1 and Figure 1. Context-parallel ranks hold the
    same weights and average their gradients, so ZeRO shards over them too (Megatron-core's distributed optimizer
    uses the data-parallel group *with* context parallelism). ZeRO-3 must still gather one layer at a time, its
    16-bit weights and then their gradients: ``largest_layer`` parameters (of a TP rank's shard), counted at the
    weights' width in ``params`` and again in ``grads``, as DeepSpeed's ZeRO-3 estimator does (4 bytes per
    parameter of the largest layer); without it ZeRO-3 would seem to shrink towards nothing.

    Routed experts (GShard, Lepikhin et al. 2021, §2.2; Switch Transformers, Fedus et al. 2022, §2.2): each of the
    ``ep`` expert-parallel ranks holds whole experts, ``1/ep`` of those of its stage's layers, not split by TP
    (expert tensor parallelism 1, as DeepSeek-V3, which has no TP at all, §3.2). The expert-parallel group is
    carved out of a stage's ``tp * cp * dp`` ranks, so each expert is replicated over the *expert-data-parallel*
    group of ``tp * cp * dp / ep`` ranks, and that is the group ZeRO shards expert states over (Megatron-core's
    MoE "parallel folding", Liu et al. 2025, §3; DeepSpeed-MoE's expert-data-parallel groups; DeepSeek-V3's 2,048
    GPUs as PP 16 x EP 64 leave 2 replicas of each expert for its ZeRO-1, §3.2). With uneven stages and a
    ``moe_pattern`` (which layers are MoE, ``dense_mlp`` the parameters a dense layer's MLP holds beyond an MoE
    layer's outside its experts) each stage holds its own layers' dense parameters and experts
    (:func:`stage_params`, :func:`stage_expert_params`).
    """
    bytes_of = precision_of(precision)
    _check_states(params, zero, dp, tp, pp, expert_params, ep, cp)
    check_stage_layers(pp, stage_layers)
    check_moe_pattern(moe_pattern, sum(stage_layers) if stage_layers else None, expert_params)
    rows = stage_params(
        params - expert_params, pp, embedding_params, tied, replicated_params, stage_layers, final_norm,
        moe_pattern, dense_mlp,
    )  # fmt: skip
    routed = stage_expert_params(expert_params, pp, stage_layers, moe_pattern)
    per_stage = []
    for (split, whole), held in zip(rows, routed, strict=True) if stage is None else [(rows[stage], routed[stage])]:
        out = _sharded_states(split / tp + whole, bytes_of, zero, dp * cp)
        if expert_params:  # each stage's MoE layers hold their share of the experts
            experts = _sharded_states(held / ep, bytes_of, zero, tp * cp * dp // ep)
            out = {cat: out[cat] + experts[cat] for cat in CATEGORIES}
        if zero == 3 and dp * cp > 1:
            gathered = bytes_of.params * largest_layer / tp
            out["params"] += gathered
            out["grads"] += gathered
        per_stage.append(out)
    return max(per_stage, key=lambda out: sum(out.values()))  # of one, with ``stage``


def _check_states(params: float, zero: int, dp: int, tp: int, pp: int, expert_params: float, ep: int, cp: int) -> None:
    """Refuse degrees, a ZeRO stage or experts :func:`model_state_formula` cannot take, saying what to change."""
    check_params(params)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3, not {zero!r}")
    for name, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if degree < 1:
            raise ValueError(f"{name} must be at least 1, not {degree}")
    if not 0 <= expert_params <= params:
        raise ValueError(f"expert parameters must be between 0 and all {params:g} parameters, not {expert_params:g}")
    if ep > 1 and not expert_params:
        raise ValueError(f"ep {ep} needs experts to split: give the experts (expert parallelism shards only them)")
    if (tp * cp * dp) % ep:
        raise ValueError(
            f"the expert-parallel group is carved out of a stage's tp x cp x dp = {tp * cp * dp} ranks: ep {ep} "
            f"does not divide it; choose an ep that does"
        )


def _sharded_states(params: float, precision: Precision, zero: int, zero_group: int) -> dict[str, float]:
    """Bytes of ``params`` parameters on a rank, by category, the ZeRO stage sharding over ``zero_group``."""
    sharded = {"optimizer": zero >= 1, "grads": zero >= 2, "params": zero >= 3}
    per_param = precision.bytes(zero)
    return {cat: per_param[cat] * params / (zero_group if sharded[cat] else 1) for cat in CATEGORIES}


def adamw_state_bytes(element_size: int, trainable: int, frozen: int = 0, tensors: int = 0) -> dict[str, int]:
    """Model-state bytes of a rank that holds ``trainable`` and ``frozen`` elements whole, in ``tensors`` trainable
    tensors, trained by AdamW: the parameters, a gradient per trainable element, two moments per trainable element
    and a 4-byte step counter per trainable tensor (what the schemes' predictions start from)."""
    e = element_size
    return {"params": e * (trainable + frozen), "grads": e * trainable, "optimizer": 2 * e * trainable + 4 * tensors}


def activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    ffn: float | None = None,
    cp: int = 1,
    *,
    kv_heads: int | None = None,
    swiglu: bool = False,
    attention: str = "flash",
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, §4, Table 2).

    16-bit activations and 1-byte dropout masks. Per token, in units of h bytes: the two LayerNorm inputs 4, the
    attention's and the MLP's inputs 4, two dropout masks 2 (10 in all, which every TP rank keeps unless sequence
    parallelism splits them); q 2, k and v 2 each (x kv_heads/heads with grouped-query attention), the output
    projection's input 2; the MLP's inner activations, 2 bytes each ffn wide: GELU's input and output (4 ffn/h,
    Korthikanti's 16 at ffn = 4h) or a fused SwiGLU's gate and up projections and their product (6 ffn/h). With
    ``attention`` = ``materialized`` the (heads, s, s) softmax, its dropout mask and output add 5as/h, as
    Korthikanti counts them: sbh(34 + 5as/h) per layer without parallelism. FlashAttention (Dao et al. 2022),
    which every large run uses today, never stores the scores (only a logsumexp of heads x s floats, not counted),
    so ``flash`` (the default) is Korthikanti's selective recompute for free.

    Tensor parallelism over t ranks splits what lies between the split linears, sbh(10 + 24/t (+ 5as/(ht))) at
    ffn = 4h; sequence parallelism splits the rest too, sbh/t (34 (+ 5as/h)). Selective recompute drops the 5as/h
    term; full recompute keeps only the layer's input, 2sbh, split by sequence parallelism when it is on.

    ``ffn``: the MLP width a token's activations pass through, 4h by default; a mixture-of-experts layer's token
    passes through its top-k routed experts and the shared ones, (top_k + shared) x expert FFN wide. (Not counted:
    the k copies of its input the dispatch makes, and the router's logits, of order 2k and 2E/h sbh.)

    Context parallelism over ``cp`` ranks gives each rank s/cp of the sequence, its queries against all the keys:
    everything divided by cp (Liu et al. 2023, ring attention, §3; Llama 3, Grattafiori et al. 2024, §3.3.2).
    """
    check_recompute(recompute)
    check_attention(attention)
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2 * s * b * h / ((t if sp else 1) * cp)
    kv = (kv_heads or a) / a
    inner = (6 if swiglu else 4) * (4 * h if ffn is None else ffn) / h
    split = 4 + 4 * kv + inner
    scores = 5 * a * s / h if attention == "materialized" and recompute == "none" else 0
    if sp:
        return s * b * h / t * (10 + split + scores) / cp
    return s * b * h * (10 + (split + scores) / t) / cp


def tiny_gpt_activation_bytes(
    cfg: GPTConfig, micro_batch: int, element_size: int = 4, tp: int | None = None, sp: bool = False
) -> dict[str, int]:
    """Exact saved-activation bytes of one forward of the tiny GPT (no dropout): the single-device
    :class:`course_lib.model.gpt.TinyGPT`, or with ``tp`` one rank of its tensor-parallel version (and ``sp``).

    Per layer, in elements: LayerNorm inputs 2sbh and their mean and rstd 4sb; the qkv input sbh; q, k and v as
    the matmuls save them 3sbh; the softmax output as^2 b (also what the attention-times-v matmul saves); the
    output projection input sbh; the MLP input sbh, GELU input 4sbh and output 4sbh: 16sbh + as^2 b + 4sb, plus
    the s x s boolean causal mask. That is Korthikanti's 34sbh bytes (17sbh 16-bit elements) less the two sbh-byte
    dropout masks, and his 5as^2 b less the attention dropout. Outside the layers: the input and target token ids
    (int64), the final LayerNorm (sbh + 2sb), the output head input sbh, the log-softmax output sbV and one
    scalar of the loss.

    Tensor parallelism over t ranks splits what lies between the column- and row-parallel linears (q, k, v, the
    scores, the projection input, the MLP's 8sbh): 4sbh + 12sbh/t + as^2 b/t + 4sb per layer, the rest replicated
    (Korthikanti's sbh(10 + 24/t + 5as/(ht))). Sequence parallelism splits the rest too: everything but the mask
    divided by t. Outside the layers a TP rank keeps the vocabulary masks (bs bytes each) of its embedding and
    cross-entropy, its sbV/t slice of the softmax, and the final LayerNorm and head input (divided by t under SP).

    Recomputation (``cfg.recompute``, :mod:`course_lib.model.recompute`): ``selective`` drops the scores and the mask
    (as^2 b/t elements and s^2 bytes) and keeps q, k and v, which the attention matmuls saved anyway; ``full``
    keeps a layer's input alone: sbh elements (its sequence shard under SP). Outside the layers nothing changes.
    """
    s, b, h, a, v, e = cfg.seq, micro_batch, cfg.d_model, cfg.heads, cfg.vocab, element_size
    t = tp or 1
    scores = e * a * s * s * b // t + s * s if cfg.recompute == "none" else 0
    if cfg.recompute == "full":
        per_layer = e * s * b * h // (t if sp else 1)
    elif sp:
        per_layer = e * (16 * s * b * h + 4 * s * b) // t + scores
    else:
        per_layer = e * (4 * s * b * h + 12 * s * b * h // t + 4 * s * b) + scores
    if tp is None:
        outside = 2 * 8 * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v + 1)
    elif sp:
        outside = 2 * (8 + 1) * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v) // tp
    else:
        outside = 2 * (8 + 1) * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v // tp)
    return {
        "per_layer": per_layer,
        "layers": cfg.layers * per_layer,
        "outside_layers": outside,
        "total": cfg.layers * per_layer + outside,
    }


def interleaved_activation_factor(pp: int, chunks: int) -> float:
    """How much more activation memory the interleaved schedule's first stage holds than 1F1B's: 1 + (p-1)/(p v)
    (Megatron-LM's ``theoretical_memory_usage.py``; Narayanan et al. 2021, §2.2.2). 1 for any other schedule."""
    return 1 + (pp - 1) / (pp * chunks) if chunks > 1 else 1.0


def memory_formula(
    params: float,
    precision: str | Precision = "fp32",
    layout: Layout = Layout(),
    *,
    layers: int | None = None,
    seq: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    ffn: float | None = None,
    expert_params: float = 0.0,
    vocab: int | None = None,
    tied: bool = True,
    kv_heads: int | None = None,
    swiglu: bool = False,
    norm: str = "layernorm",
    largest_layer: float | None = None,
    moe_pattern: tuple[bool, ...] = (),
    dense_mlp: float = 0.0,
    stage: int | None = None,
) -> dict[str, float]:
    """Bytes on the busiest device of ``layout``: model states (:func:`model_state_formula`) and, when the dims are
    given, activations (:func:`stage_activations`), of the pipeline stage whose states and activations add up to
    the most (or of ``stage``, counted from 0), and ``stage``, which one that is (:func:`stage_name`). Of the
    layout, the degrees, ZeRO stage, model chunks per stage, sequence parallelism, recompute mode, attention kernel,
    micro-batch size and uneven stages (``stage_layers``) count; the schedule is 1F1B's or the interleaved one's
    (``chunks`` > 1).

    With the ``vocab`` and ``hidden`` known, the busiest stage holds one V x h embedding matrix beside its layers
    (two on a single stage when untied), every TP rank keeps the ``norm`` weights whole (LayerNorm 2h, RMSNorm h, two
    per layer and a final one), and ZeRO-3's floor is the largest layer: the embedding or an MLP matrix
    (``largest_layer`` to give it). ``ffn``: the MLP width a token's activations pass through (4h by default);
    ``expert_params``: the parameters in routed experts, on uneven stages in the MoE layers of ``moe_pattern``
    (:func:`model_state_formula`).
    """
    _check_shape(layout, layers, seq, hidden, heads, kv_heads, norm)
    check_moe_pattern(moe_pattern, layers, expert_params)
    shape = {}
    if vocab is not None and hidden is not None:
        shape = stage_shape(vocab, hidden, layers or 0, tied, norm)
        if largest_layer is None:
            largest_layer = max(vocab * hidden, hidden * (4 * hidden if ffn is None else ffn))
    degrees = (layout.zero, layout.dp, layout.tp, layout.pp, expert_params, layout.ep, layout.cp)
    per_stage = [
        model_state_formula(
            params, precision, *degrees, largest_layer=largest_layer or 0.0, stage_layers=layout.stage_layers,
            moe_pattern=moe_pattern, dense_mlp=dense_mlp, stage=i, **shape,
        )
        for i in range(layout.pp)
    ]  # fmt: skip
    activations = [0.0] * layout.pp
    if layers:
        activations = stage_activations(
            layout, layers, seq, hidden, heads, vocab, ffn=ffn, kv_heads=kv_heads, swiglu=swiglu
        )
    busiest = (
        stage if stage is not None else max(range(layout.pp), key=lambda i: sum(per_stage[i].values()) + activations[i])
    )
    out = per_stage[busiest] | {"activations": activations[busiest], "stage": stage_name(busiest, layout.pp)}
    out["total"] = sum(out[k] for k in (*CATEGORIES, "activations"))
    return out


def _check_shape(
    layout: Layout,
    layers: int | None,
    seq: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    norm: str,
) -> None:
    """Refuse a model shape that is half given or that the layout cannot split, saying why: tensor parallelism
    splits whole heads (and K/V heads, or copies them), context parallelism cuts the sequence into 2 x cp chunks,
    an interleaved schedule gives each model chunk at least one layer, and uneven stages give each stage at least
    one, all the layers in all, with one model chunk each (as Megatron-LM's first and last stage counts do)."""
    dims = (layers, seq, hidden, heads)
    if any(d is not None for d in dims) and any(d is None for d in dims):
        raise ValueError("activations need all of layers, seq, hidden and heads (or none of them)")
    tp, pp, cp, chunks = layout.tp, layout.pp, layout.cp, layout.chunks
    if heads is not None and heads % tp:
        raise ValueError(f"tensor parallelism splits attention by heads: tp {tp} does not divide {heads} heads")
    if kv_heads is not None and heads is not None and (heads % kv_heads or kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"{kv_heads} K/V heads must divide the {heads} heads, and tp {tp} must divide them or be a multiple "
            f"of them (each TP rank holds whole K/V heads, or a copy)"
        )
    if seq is not None and cp > 1 and seq % (2 * cp):
        raise ValueError(
            f"context parallelism cuts the sequence into 2 x cp = {2 * cp} chunks (rank r holds chunks r and "
            f"2cp-1-r, for causal balance): seq {seq} is not a multiple of {2 * cp}; change seq or cp"
        )
    check_norm(norm)
    if chunks < 1 or (chunks > 1 and pp == 1):
        raise ValueError("chunks (model chunks per pipeline stage) must be at least 1, and 1 without a pipeline")
    check_stage_layers(pp, layout.stage_layers, layers)
    if layout.stage_layers and chunks > 1:
        raise ValueError("uneven stages (stage_layers) take one model chunk per stage: leave chunks at 1")
    if layers is not None and chunks > math.ceil(layers / pp):
        raise ValueError(
            f"the interleaved schedule cuts each stage's {math.ceil(layers / pp)} layers into {chunks} model chunks "
            f"of at least one layer: choose chunks of at most layers / pp"
        )


def stage_activations(
    layout: Layout,
    layers: int,
    seq: int,
    hidden: int,
    heads: int,
    vocab: int | None = None,
    *,
    ffn: float | None = None,
    kv_heads: int | None = None,
    swiglu: bool = False,
) -> list[float]:
    """Activation bytes on each pipeline stage, first to last: its layers of :func:`activation_bytes_per_layer`
    for each microbatch it keeps in flight, and what lies outside them.

    With a 1F1B pipeline stage i of p keeps p - i microbatches in flight (Narayanan et al. 2021, §2.2.1), so the
    first keeps p microbatches of its layers/p layers, which is one microbatch of all ``layers`` (Korthikanti et
    al. 2022, §4.2.3), and with the interleaved schedule over ``chunks`` model chunks per stage 1 + (p-1)/(p x
    chunks) times that (Megatron-LM's ``theoretical_memory_usage.py``). Uneven stages (``layout.stage_layers``)
    keep their own layers so: with (1, 2, 2, 3) the second stage, 3 microbatches of 2 layers, holds the most.
    Outside the layers the first stage keeps, per microbatch in flight, the token ids (8 bytes each) and the
    embedding's dropout mask (sbh bytes); the stage with the output head keeps, for its one microbatch, the head's
    input and the fp32 logits of the cross-entropy, 4sbh + 4sbV bytes (Megatron's count), all split by TP under
    sequence parallelism. The last stage (its layers for one microbatch and the logits) holds the most when the
    vocabulary is large enough.
    """
    tp, pp, cp, sp, micro_batch = layout.tp, layout.pp, layout.cp, layout.sp, layout.micro_batch
    layer = activation_bytes_per_layer(
        seq,
        micro_batch,
        hidden,
        heads,
        tp,
        sp,
        layout.recompute,
        ffn,
        cp,
        kv_heads=kv_heads,
        swiglu=swiglu,
        attention=layout.attention,
    )
    split = tp if sp else 1
    sb = seq * micro_batch
    inputs = (8 * sb + sb * hidden) / (split * cp)  # token ids, the embedding's dropout mask
    outputs = (4 * sb * hidden + 4 * sb * vocab / (1 if sp else tp)) / (split * cp) if vocab else 0.0
    if pp == 1:
        return [layers * layer + inputs + outputs]
    counts = layout.stage_layers or (1,) * pp
    kept = [layers * n * (pp - i) / sum(counts) * layer for i, n in enumerate(counts)]  # p - i in flight
    kept[0] = interleaved_activation_factor(pp, layout.chunks) * (kept[0] + pp * inputs)
    kept[-1] += outputs
    return kept


def transformer_params(
    layers: int,
    hidden: int,
    vocab: int,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    swiglu: bool = False,
    tied: bool = True,
    norm: str = "layernorm",
    biases: bool = True,
    positions: int = 0,
) -> dict[str, int]:
    """Parameters of a decoder-only transformer by where they sit: ``layers`` (attention, MLP and their biases, all
    layers; what tensor parallelism splits), ``replicated`` (the LayerNorm or RMSNorm weights, two per layer and a
    final one; every TP rank keeps them), ``embedding`` (one V x h matrix), ``positions`` (learned positions, s x h)
    and ``total`` (with the output head's own matrix when untied).

    Per layer: attention q and o h x h, k and v h x (kv_heads x head dim) each (grouped-query attention, Ainslie
    et al. 2023; all heads by default): 2h^2 (1 + kv_heads/heads); the MLP 2 h x ffn (GELU) or 3 (SwiGLU, Shazeer
    2020), ffn = 4h by default; with ``biases`` those of the course's GPT: the attention output projection h and
    the GELU MLP's ffn + h (none on q, k, v). Megatron-LM's ``theoretical_memory_usage.py`` counts the same without
    any bias or learned position (``biases=False``, ``positions=0``)."""
    check_norm(norm)
    kv = 1.0 if kv_heads is None else kv_heads / heads
    width = 4 * hidden if ffn is None else ffn
    attention = round(2 * hidden * hidden * (1 + kv))
    mlp = (3 if swiglu else 2) * hidden * width
    bias = (hidden + (0 if swiglu else width + hidden)) if biases else 0
    counts = {
        "layers": layers * (attention + mlp + bias),
        "replicated": (2 * layers + 1) * NORMS[norm] * hidden,
        "embedding": vocab * hidden,
        "positions": positions * hidden,
    }
    counts["total"] = sum(counts.values()) + (0 if tied else vocab * hidden)
    return counts


def params_from_dims(layers: int, hidden: int, vocab: int, seq: int = 0, ffn_mult: int = 4) -> int:
    """Parameters of a GPT-style model like the course's: (4 + 2m) h^2 per layer (attention 4h^2, MLP 2m h^2 for
    an m-times-wider MLP), biases and LayerNorms (m + 6) h per layer (no bias on the qkv projection), token
    embeddings V h shared with the output head, learned positions s h, and a final LayerNorm 2h
    (:func:`transformer_params`)."""
    return transformer_params(layers, hidden, vocab, ffn=ffn_mult * hidden, positions=seq)["total"]


def tiny_gpt_params(cfg: GPTConfig) -> dict[str, int]:
    """The exact parameters of the tiny GPT of ``cfg`` (:class:`course_lib.model.gpt.TinyGPT`), counted without
    building it: ``trainable`` and ``frozen`` elements (the learned positions, s x h, unless trained) and the
    trainable ``tensors``. A layer is two LayerNorms, qkv (no bias) and the output projection, and a GELU MLP h -> mh
    -> h with biases, or with ``experts`` E a router (h x E, no bias) and E such MLPs; around them the V x h token
    embedding (tied to the output head) and a final LayerNorm."""
    h, width = cfg.d_model, cfg.ffn_mult * cfg.d_model
    mlp = 2 * h * width + width + h
    experts = cfg.experts
    layer = 4 * h + 3 * h * h + h * h + h + (h * experts + experts * mlp if experts else mlp)
    tensors_per_layer = 4 + 3 + (1 + 4 * experts if experts else 4)
    positions = cfg.seq * h
    trainable = cfg.layers * layer + cfg.vocab * h + 2 * h + (0 if cfg.frozen_pos else positions)
    tensors = cfg.layers * tensors_per_layer + 3 + (0 if cfg.frozen_pos else 1)
    return {"trainable": trainable, "frozen": positions if cfg.frozen_pos else 0, "tensors": tensors}


def tiny_gpt_memory(cfg: GPTConfig, batch: int, precision: Precision) -> dict[str, int]:
    """What one device holds training the whole tiny GPT on ``batch`` sequences at once (the harness's reference):
    the weights, gradients and AdamW state of :func:`tiny_gpt_params` at ``precision``'s bytes per parameter plus
    AdamW's 4-byte step counter per tensor, and the activations of :func:`tiny_gpt_activation_bytes` in elements of
    the weights' size (those of a dense layer: an MoE's routed tokens pass through top-k experts, counted as one)."""
    counts = tiny_gpt_params(cfg)
    p = precision_of(precision)
    out = {
        "params": p.params * (counts["trainable"] + counts["frozen"]),
        "grads": p.grads * counts["trainable"],
        "optimizer": p.optimizer * counts["trainable"] + 4 * counts["tensors"],
        "activations": tiny_gpt_activation_bytes(cfg, batch, p.params)["total"],
    }
    out["total"] = sum(out.values())
    return out


def bytes_text(x: float) -> str:
    """``x`` bytes in TB, GB or MB, one decimal."""
    unit, scale = next((u, s) for u, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)) if x >= s or u == "MB")
    return f"{x / scale:,.1f} {unit}"


def check_reference_fits(cfg: GPTConfig, train: TrainConfig, available: float | None) -> None:
    """Refuse a tiny GPT whose one-device reference (the whole model and batch in one process,
    :func:`tiny_gpt_memory`, the model never built) and its process's own ``RANK_MEMORY_BYTES`` do not fit the
    ``available`` bytes (:func:`course_lib.runtime.host.available_memory`; None: nothing to compare with). Imports
    no torch, so the command line refuses such a model before it imports torch."""
    from course_lib.runtime.host import RANK_MEMORY_BYTES

    if available is None:
        return
    one = tiny_gpt_memory(cfg, train.batch, train.precision or {"float32": "fp32", "float64": "fp64"}[train.dtype])
    if one["total"] + RANK_MEMORY_BYTES > available:
        count = sum(tiny_gpt_params(cfg).values())
        raise ValueError(
            f"the one-device reference would need about {bytes_text(one['total'] + RANK_MEMORY_BYTES)} by the "
            f"course's memory formula ({cfg.layers} layers x {cfg.d_model} wide, {count:,} parameters: "
            f"{bytes_text(one['total'] - one['activations'])} of weights, gradients and AdamW state, "
            f"{bytes_text(one['activations'])} of activations for {train.batch} x {cfg.seq} tokens), more than the "
            f"{bytes_text(available)} this machine has available; use fewer layers, a narrower model, or a shorter "
            "sequence or smaller batch"
        )
