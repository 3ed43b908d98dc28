"""Published training throughput, row by row, beside the planner's estimate of it.

Thirty-seven runs whose layout, batch and recompute are all known, the check on
:func:`course_lib.planner.cost.step_time`:

* Narayanan et al. 2021 (SC21), "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  Table 1: ten GPT models from 1.7B to 1T parameters on 32 to 3072 A100s (80 GB, Selene). The micro-batch, the
  interleaving (``--num-layers-per-virtual-pipeline-stage``), full recompute and fp16 come from Megatron-LM's
  ``examples/sc21/run_table_1.sh`` and ``CONFIG.sh`` (commit 6985e589, the one the scripts' README names for these
  results); the paper's own eq. (3) turns a step into its "teraFLOP/s per GPU": hardware FLOPs, the recomputed
  forward counted, attention unmasked.
* Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B on 8,192 and 16,384 H100s at 8K
  tokens and on 16,384 at 128K, BF16, an interleaved schedule (§3.3.2), no activation recompute at 8K (§3.3.2; none
  stated at 128K either). Its TFLOP/s per GPU is "BF16 MFU" (Chowdhery et al. 2023) without a formula: compared
  here as the planner's model FLOPs, 6N plus causal attention (:func:`course_lib.planner.cost.flops_per_token`).
* MosaicML llm-foundry, ``scripts/train/benchmarking/README.md``, "H100 80GB BF16": six MPT runs, FSDP alone
  (FULL_SHARD) on 8 to 64 H100s, 1B to 70B parameters, at 2K tokens and one at 64K. Its MFU counts
  (6 N s + 12 L d s^2) FLOPs a sequence, attention not halved for the causal mask, against 989 TFLOP/s; its "Model
  TFLOP" column is that rate per GPU. Four of the six miss by more than 15%; each row's ``explained`` says why.
* torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md`` (2024-12): Llama 3.1 8B FSDP on 8 and 128 H100s
  (BF16), 70B FSDP x TP with and without async TP, 405B 3D with 1F1B and interleaved 1F1B, and FSDP x CP at a fixed
  GPU count with the sequence from 32K to 256K tokens, 8B on 8 GPUs and 405B with TP 8 x PP 8 on 512 (Float8 and
  torch.compile), on H100s held to 500 W whose peak the source does not know (profile ``h100-500w``); tokens/s per
  GPU in torchtitan's count (:func:`torchtitan_flops`). All fourteen miss by more than 15%, explained with computed
  facts (:func:`facts`); async TP is not modeled (``PublishedRow.async_tp``), its row says what it could hide.
* Megatron-Bridge, ``docs/performance-summary.md`` (25.11 and 25.09 containers, DGX-H100, FP8 with current
  scaling): Llama 3 8B, 70B and 405B, and DeepSeek-V3 with EP 64; Model TFLOP/s in Megatron's count
  (:func:`megatron_flops`), the linears at the FP8 peak (``h100+fp8``). DeepSeek-V3 misses, explained.

The hardware profiles' sustained fractions of peak are one number per GPU generation for every row
(:data:`course_lib.cluster.profiles.MATMUL_EFFICIENCY`); nothing here is set per row but what the sources state about
the run, and where a source is silent (Llama 3's chunks per rank and micro-batch) the assumption is written in ``run``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from course_lib.cluster.profiles import NVL_BF16_PEAK, get_profile
from course_lib.model.config import Layout
from course_lib.planner.cost import attention_flops_per_token, stage_counts
from course_lib.planner.evaluate import evaluate_layout
from course_lib.planner.layouts import Candidate
from course_lib.planner.published_rows import (
    LLAMA3_2024,
    LLM_FOUNDRY_2023,
    MEGATRON_BRIDGE_2025,
    NARAYANAN_2021,
    ROWS,
    TORCHTITAN_2024,
    PublishedRow,
    torchtitan_flops_per_token,
)

__all__ = [  # the rows, from published_rows, beside the comparison
    "LLAMA3_2024", "LLM_FOUNDRY_2023", "MEGATRON_BRIDGE_2025", "NARAYANAN_2021", "ROWS", "TORCHTITAN_2024",
    "PublishedRow", "Estimate", "compare", "estimate", "facts", "llm_foundry_flops", "megatron_flops",
    "narayanan_flops", "report", "torchtitan_flops",
]  # fmt: skip


def narayanan_flops(row: PublishedRow) -> float:
    """FLOPs of one iteration by Narayanan et al. 2021's eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh), the matmuls of
    forward, backward and the recomputed forward, attention unmasked, the logits not recomputed (Appendix)."""
    m = row.model
    s, h, layers, vocab = m.seq, m.hidden, m.layers, m.vocab
    return 96 * row.global_batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))


def llm_foundry_flops(row: PublishedRow) -> float:
    """FLOPs of one step as llm-foundry's MFU counts them: (6 N s + 12 L d s^2) a sequence, every parameter (the
    embeddings too) and the attention scores unmasked (:func:`course_lib.planner.cost.attention_flops_per_token`
    of attention that computes them all), no recompute."""
    m = row.model
    return row.global_batch * m.seq * (6 * m.params + attention_flops_per_token(m, "materialized"))


def torchtitan_flops(row: PublishedRow) -> float:
    """FLOPs of one step as torchtitan counts them (:func:`torchtitan_flops_per_token`)."""
    return row.tokens_per_batch * torchtitan_flops_per_token(row.model)


def _padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's vocabulary padded to a multiple of ``make_vocab_size_divisible_by`` (128) x TP
    (``calculate_padded_vocab_size``)."""
    step = multiple * tp
    return math.ceil(vocab / step) * step


def megatron_flops(row: PublishedRow) -> float:
    """FLOPs of one step as Megatron-Bridge counts them (``num_floating_point_operations``, its
    training/utils/flop_utils.py): 12 x every GEMM's h x n a token (forward, weight and input gradients) over the
    layers and the multi-token-prediction layers, the SwiGLU MLPs (a dense layer's ffn, an MoE layer's top-k and
    shared experts') at 3/2; attention's scores and their product with V causal, halved; grouped-query attention's
    K and V at their share of the heads, or multi-head latent attention's projections (``row.mla``); the output
    head over the vocabulary padded to 128 x TP; the input embedding not counted."""
    m, h, s = row.model, row.model.hidden, row.model.seq
    layers = m.layers + row.mtp_layers
    e = m.experts
    moe = (m.layers - e.dense_layers + row.mtp_layers) if e else 0
    mlp = 12 * h * 1.5 * ((layers - moe) * m.ffn + (moe * (e.top_k + e.shared) * e.ffn if e else 0))
    if row.mla:
        head, rope, v, q_rank, kv_rank = row.mla
        n = m.heads
        per_layer = (
            q_rank * (h + n * (head + rope) + 1) + kv_rank * (h + n * (head + v) + 1) + h * rope + n * v * h
            + s * n * (head + rope) / 2 + s * n * v / 2
        )  # fmt: skip
        attention = 6 * layers * per_layer
    else:
        attention = 12 * layers * h * h * (1 + (m.kv_heads or m.heads) / m.heads + s / h / 2)
    mtp = 6 * row.mtp_layers * (3 * h + 2 * h * h)
    logits = 6 * h * _padded_vocab(m.vocab, row.tp) * (row.mtp_layers + 1)
    return row.tokens_per_batch * (mlp + attention + mtp + logits)


CONVENTIONS = {
    "eq3": narayanan_flops,
    "llm-foundry": llm_foundry_flops,
    "torchtitan": torchtitan_flops,
    "megatron": megatron_flops,
}  # "model": the planner's own model FLOPs


@dataclass
class Estimate:
    """The planner's estimate of a published row: its evaluation of the layout (:class:`Candidate`, the step
    time and its parts) and the TFLOP/s per GPU it implies under the row's own FLOP convention."""

    row: PublishedRow
    candidate: Candidate
    tflops_per_gpu: float

    @property
    def ratio(self) -> float:
        """Estimated over published TFLOP/s per GPU."""
        return self.tflops_per_gpu / self.row.tflops_per_gpu

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The estimated step's tokens per second per GPU."""
        return self.row.tokens_per_batch / (self.candidate.step_time_s * self.row.gpus)

    def breakdown(self) -> str:
        """The step time and its parts, in seconds, for messages and notes."""
        parts = ", ".join(f"{k[:-2]} {v:.3g}" for k, v in self.candidate.time.items() if v)
        return f"step {self.candidate.step_time_s:.3g} s ({parts})"


def estimate(row: PublishedRow) -> Estimate:
    """Evaluate the row's layout with :func:`course_lib.planner.evaluate.evaluate_layout` on its hardware profile
    and count its step's FLOPs as its source does (:data:`CONVENTIONS`; the planner's model FLOPs for Llama 3)."""
    layout = Layout(
        tp=row.tp,
        pp=row.pp,
        dp=row.dp,
        zero=row.zero,
        cp=row.cp,
        ep=row.ep,
        schedule=row.schedule,
        chunks=row.chunks,
        sp=row.sp,
        recompute=row.recompute,
        attention=row.attention,
        micro_batch=row.micro_batch,
    )
    c = evaluate_layout(
        row.model, row.gpus, layout, global_batch=row.global_batch, hardware=row.hardware, precision="mixed"
    )
    flops = CONVENTIONS[row.convention](row) if row.convention in CONVENTIONS else c.model_flops
    return Estimate(row, c, flops / (c.step_time_s * row.gpus) / 1e12)


def _recomputed_by_op_policy(row: PublishedRow) -> float:
    """The matmul FLOPs torchtitan's op-level selective checkpointing adds, over a layer's: it saves every odd
    matmul of a layer's seven (wq wk wv wo w1 w3 w2, parallelize_llama.py's ``_custom_policy``) and recomputes
    wk, wo and w3 forward, 2 x their parameters a token, against 6 x all seven's."""
    m = row.model
    kv = (m.kv_heads or m.heads) * m.hidden // m.heads
    seven = 2 * m.hidden * m.hidden + 2 * m.hidden * kv + 3 * m.hidden * m.ffn
    return 2 * (m.hidden * kv + m.hidden * m.hidden + m.hidden * m.ffn) / (6 * seven)


def _bubble_share(e: Estimate) -> float:
    """The bubble over the work it scales with: the compute and the TP, CP and EP traffic (:func:`cost.step_time`)."""
    t = e.candidate.time
    return t["bubble_s"] / sum(t[k] for k in ("compute_s", "tp_comm_s", "cp_comm_exposed_s", "ep_comm_s"))


def _ratio_at_slower_compute(e: Estimate, factor: float) -> float:
    """The estimate's ratio had its compute run ``factor`` times slower: the compute and the bubble's share of it."""
    step = e.candidate.step_time_s + (factor - 1) * e.candidate.time["compute_s"] * (1 + _bubble_share(e))
    return e.ratio * e.candidate.step_time_s / step


def _attention_seconds(e: Estimate) -> float:
    """The attention scores' share of the estimated compute, in seconds: what :func:`cost.layer_seconds` times at
    the kernel's efficiency, over the busiest stage's layers and the microbatches."""
    m, c, profile = e.row.model, e.candidate, get_profile(e.row.hardware)
    tokens = e.row.micro_batch * m.seq / c.cp / c.tp
    flops = attention_flops_per_token(m, c.attention) / m.layers * tokens * (1 + (c.recompute != "none") / 3)
    per_layer = flops / (profile.peak_flops["bf16"] * profile.attention_efficiency)
    return per_layer * max(stage_counts(m, c)) * c.microbatches


def _implied_attention_efficiency(e: Estimate, nvl_factor: float) -> float:
    """The attention efficiency at which the estimate, its compute at the H100 NVL's peak, takes the published
    step: the gap left there (published step - estimated) added to the attention's time (with its bubble)."""
    step = e.candidate.step_time_s
    share = 1 + _bubble_share(e)
    at_nvl = step + (nvl_factor - 1) * e.candidate.time["compute_s"] * share
    attention = nvl_factor * _attention_seconds(e)
    gap = e.ratio * step - at_nvl  # the published step is the estimated one x the ratio
    return get_profile(e.row.hardware).attention_efficiency * attention / (attention + gap / share)


def facts(e: Estimate) -> dict[str, float]:
    """What a row's explanation quotes, computed: the ratio; the ratio had the compute run at the H100 NVL's BF16
    peak, the lower bound of torchtitan's capped H100 (``nvl``); the extra matmul FLOPs of torchtitan's op-level
    checkpointing (``sac``); torch.compile's measured speed-up where printed (``compiled``); the ratio left once
    the three are counted (``left``); the exposed TP and EP traffic in seconds (``tp_s``, ``ep_s``), TP's share of
    the step (``tp_share``) and the ratio with it hidden (``no_tp``); async TP's measured speed-up where the table
    prints the run without it (``async_gain``) and the seconds it took off the published step (``async_s``); the
    attention's share of the estimated compute (``attn``), the profile's attention efficiency (``attn_eff``) and the
    one that would close the gap left at the NVL's peak (``implied``); the multi-token-prediction layer's share of
    Megatron's count (``mtp``) and the ratio with its compute in the step (``with_mtp``)."""
    printed = dict(e.row.printed)
    profile = get_profile(e.row.hardware)
    t, step = e.candidate.time, e.candidate.step_time_s
    nvl = _ratio_at_slower_compute(e, profile.peak_flops["bf16"] / NVL_BF16_PEAK)
    sac = _recomputed_by_op_policy(e.row) if e.row.convention == "torchtitan" else 0.0
    tokens = printed.get("tokens_per_s_per_gpu", 1)
    compiled = printed.get("compiled_tokens_per_s_per_gpu", 0) / tokens
    with_sac = _ratio_at_slower_compute(e, 1 + sac)
    left = e.ratio / ((e.ratio / with_sac) * (e.ratio / nvl) * max(compiled, 1.0))
    mtp = 1 - megatron_flops(replace(e.row, mtp_layers=0)) / megatron_flops(e.row) if e.row.mtp_layers else 0.0
    without = printed.get("without_async_tp_tokens_per_s_per_gpu", 0)
    per_gpu = e.row.tokens_per_batch / e.row.gpus
    return {
        "ratio": e.ratio, "nvl": nvl, "sac": sac, "compiled": compiled, "left": left,
        "tp_s": t["tp_comm_s"], "ep_s": t["ep_comm_s"], "tp_share": t["tp_comm_s"] / step,
        "no_tp": e.ratio * step / (step - t["tp_comm_s"] * (1 + _bubble_share(e))),
        "async_gain": tokens / without if without else 0.0,
        "async_s": per_gpu / without - per_gpu / tokens if without else 0.0,
        "attn": _attention_seconds(e) / t["compute_s"], "attn_eff": profile.attention_efficiency,
        "implied": _implied_attention_efficiency(e, profile.peak_flops["bf16"] / NVL_BF16_PEAK),
        "mtp": mtp, "with_mtp": _ratio_at_slower_compute(e, 1 / (1 - mtp)),
    }  # fmt: skip


def compare() -> list[Estimate]:
    """Every row's estimate."""
    return [estimate(row) for row in ROWS]


def report(estimates: list[Estimate]) -> str:
    """One line per row: its source and row, published and estimated TFLOP/s per GPU in its source's convention
    and their ratio; under a row whose estimate misses by more than 15%, why, and its tokens/s per GPU published and
    estimated where the source prints them."""
    lines = []
    for e in estimates:
        lines.append(
            f"{e.row.label}: published {e.row.tflops_per_gpu:.0f}, estimated {e.tflops_per_gpu:.0f} TFLOP/s per GPU "
            f"({e.row.convention}; {e.ratio:.2f}x)"
        )
        if e.row.explained:
            tokens = dict(e.row.printed).get("tokens_per_s_per_gpu")
            if tokens:
                lines.append(f"    tokens/s per GPU: published {tokens:,.0f}, estimated {e.tokens_per_s_per_gpu:,.0f}")
            lines.append(f"    missed: {e.row.explained.format(**facts(e))}")
    return "\n".join(lines)
