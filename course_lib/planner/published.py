"""Published training throughput, row by row, beside the planner's estimate of it.

Nineteen runs whose layout, batch and recompute are all known, the check on :func:`course_lib.planner.cost.step_time`:

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

The hardware profiles' sustained fractions of peak are one number per GPU generation for every row
(:data:`course_lib.cluster.profiles.MATMUL_EFFICIENCY`); nothing here is set per row but what the sources state about
the run, and where a source is silent (Llama 3's chunks per rank and micro-batch) the assumption is written in ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.model.config import Layout
from course_lib.model.formulas import params_from_dims
from course_lib.planner.cost import attention_flops_per_token
from course_lib.planner.evaluate import evaluate_layout
from course_lib.planner.layouts import Candidate
from course_lib.planner.presets import PRESETS, Model

_N21 = "Narayanan et al. 2021 (SC21), Table 1"
_N21_RUN = (
    "micro-batch and interleaving from Megatron-LM examples/sc21/run_table_1.sh (commit 6985e589); full recompute "
    "(--activations-checkpoint-method uniform, every layer), fp16, no ZeRO, no sequence parallelism (2021); "
    "attention writes its scores to memory (no FlashAttention in 2021)"
)
_L3 = "Grattafiori et al. 2024 (The Llama 3 Herd of Models), Table 4"
_L3_RUN = (
    "BF16; FSDP that keeps the gathered weights through the step and reduce-scatters the gradients once (§3.3.2), "
    "costed as ZeRO-1; interleaved schedule (§3.3.2) with v = 8, one layer slot per chunk: the first chunk of the "
    "first stage holds only the embedding and the last of the last only the head, and 126 layers + 2 = 128 slots = "
    "16 stages x 8 (an inference, V is not published); micro-batch 1 (Batch size/DP sequences a DP rank, one per "
    "microbatch; not published); no recompute (§3.3.2 at 8K, none stated at 128K); FlashAttention-style attention "
    "and sequence parallelism assumed"
)
SEQ_N21, VOCAB_N21 = 2048, 51200  # Narayanan et al. 2021, §5.1


@dataclass(frozen=True)
class PublishedRow:
    """One published run: where it is printed, the model, the layout and how it ran, what it reached, and how its
    source counts FLOPs (``convention``: "eq3", Narayanan et al. 2021's eq. (3); "model", 6N + causal attention;
    "llm-foundry", 6N + unmasked attention). ``printed`` holds the numbers as the source prints them where a field
    here differs or is derived; ``explained``, for a row whose estimate misses by more than 15%, why."""

    source: str
    row: str
    model: Model
    gpus: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    tflops_per_gpu: float  # published
    peak_fraction: float  # published: "% of theoretical peak" (eq. 3) or "BF16 MFU"
    convention: str
    hardware: str
    precision: str  # as run: fp16 or bf16 (the planner's "mixed")
    recompute: str
    attention: str
    sp: bool
    zero: int
    cp: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    printed: tuple[tuple[str, float], ...] = ()
    run: str = ""
    explained: str = ""

    @property
    def label(self) -> str:
        return f"{self.source}, {self.row}"

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch * self.model.seq


def _narayanan(
    params: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, micro: int, v: int
) -> tuple[Model, dict]:
    model = Model(
        f"gpt-{params:g}b",
        params_from_dims(layers, hidden, VOCAB_N21, SEQ_N21),
        layers,
        hidden,
        heads,
        SEQ_N21,
        global_batch=batch,
        vocab=VOCAB_N21,
        source=f"{_N21}: {params:g}B parameters, {layers} layers, hidden {hidden}, {heads} heads",
    )
    layout = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "micro_batch": micro, "global_batch": batch}
    if v > 1:
        layout |= {"schedule": "interleaved", "chunks": v}
    return model, layout


def _narayanan_row(
    params: float,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
    peak: float,
    pflops: float,
    micro: int,
    v: int,
) -> PublishedRow:
    model, layout = _narayanan(params, heads, hidden, layers, tp, pp, gpus, batch, micro, v)
    return PublishedRow(
        _N21,
        f"{params:g}B row",
        model,
        gpus,
        tflops_per_gpu=tflops,
        peak_fraction=peak,
        convention="eq3",
        hardware="a100",
        precision="fp16",
        recompute="full",
        attention="materialized",
        sp=False,
        zero=0,
        printed=(("params_billions", params), ("aggregate_pflops", pflops)),
        run=_N21_RUN,
        **layout,
    )


# params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU, % of peak, aggregate PFLOP/s (Table 1);
# micro-batch and v (run_table_1.sh: v = layers per stage / --num-layers-per-virtual-pipeline-stage).
NARAYANAN_2021 = tuple(
    _narayanan_row(*r)
    for r in (
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 0.44, 4.4, 16, 1),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 0.44, 8.8, 16, 1),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 0.46, 18.2, 16, 1),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 0.43, 34.6, 8, 1),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 0.44, 70.8, 4, 1),  # no virtual stages in the script: 1F1B
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 0.45, 143.8, 2, 3),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 0.47, 227.1, 2, 2),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 0.50, 297.4, 1, 2),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 0.52, 410.2, 1, 3),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 0.52, 502.0, 1, 1),  # no virtual stages: 1F1B
    )
)

_LLAMA3_405B = PRESETS["llama3-405b"]
_LLAMA3_ROW = {
    "source": _L3,
    "tp": 8,
    "pp": 16,
    "micro_batch": 1,
    "convention": "model",
    "hardware": "h100",
    "precision": "bf16",
    "recompute": "none",
    "attention": "flash",
    "sp": True,
    "zero": 1,
    "schedule": "interleaved",
    "chunks": 8,
    "run": _L3_RUN,
}
LLAMA3_2024 = (
    PublishedRow(
        row="row 1 (8,192 GPUs, 8K)",
        model=replace(_LLAMA3_405B, seq=8192, global_batch=2048),
        gpus=8192,
        dp=64,
        global_batch=2048,
        tflops_per_gpu=430,
        peak_fraction=0.43,
        printed=(("batch_per_dp", 32), ("tokens_per_batch_m", 16)),
        **_LLAMA3_ROW,
    ),
    PublishedRow(
        row="row 2 (16,384 GPUs, 8K)",
        model=replace(_LLAMA3_405B, seq=8192, global_batch=2048),
        gpus=16384,
        dp=128,
        global_batch=2048,
        tflops_per_gpu=400,
        peak_fraction=0.41,
        printed=(("batch_per_dp", 16), ("tokens_per_batch_m", 16)),
        **_LLAMA3_ROW,
    ),
    # Printed with DP 4, a slip: TP 8 x CP 16 x PP 16 x DP 4 makes 8,192 GPUs, not the row's 16,384, and 4 x 16
    # sequences of 131,072 tokens make 8M tokens, not the row's 16M; DP 8 satisfies both (and the planner's
    # llama3-405b-128k preset keeps the printed 4 on the 8,192 GPUs it makes).
    PublishedRow(
        row="row 3 (16,384 GPUs, 128K; DP printed as 4, 8 used)",
        model=replace(PRESETS["llama3-405b-128k"], global_batch=128),
        gpus=16384,
        dp=8,
        cp=16,
        global_batch=128,
        tflops_per_gpu=380,
        peak_fraction=0.38,
        printed=(("dp", 4), ("batch_per_dp", 16), ("tokens_per_batch_m", 16)),
        **_LLAMA3_ROW,
    ),
)

_LLMF = "MosaicML llm-foundry, scripts/train/benchmarking/README.md, H100 80GB BF16"
_LLMF_RUN = (
    "MPT: GELU MLP 4d, LayerNorm, tied embeddings, vocabulary 50,368, learned positions (the table's NumParams grows "
    "by s d with the sequence); FSDP FULL_SHARD over every GPU (ZeRO-3), amp_bf16, FlashAttention-style attention; "
    "recompute as the table's Activation Checkpointing column; parameters counted without MPT's qkv bias (3 d a layer)"
)
VOCAB_MPT = 50368  # llm-foundry's MPT yamls
_LLMF_SHORT_STEP = (
    "not fully explained: one microbatch a step (GradAccum 1), about a second; the planner hides FSDP's gathers "
    "under the compute and counts no per-step cost beyond the matmuls and attention. Counting the first gather and "
    "the last reduce-scatter that nothing hides closes little of the gap (checked); the optimizer step and eager "
    "PyTorch's kernel launches are the candidates left, not measured. The 70B and 30B rows, several microbatches "
    "and tens of seconds a step, are within 15%"
)
_LLMF_64K = (
    "65,536 tokens: attention is most of the step's FLOPs, and the planner times it as a FlashAttention-2 kernel "
    "that skips the blocks the causal mask hides, at the H100 profile's attention efficiency (Shah et al. 2024); "
    "the 2023 MPT kernel either sustained less at this length or computed the masked blocks too (an inference, not "
    "measured: the table's 2K rows of large models are within 15%)"
)


def _mpt_row(
    size: str, layers: int, hidden: int, heads: int, seq: int, gpus: int, micro: int, batch: int, recompute: bool,
    mfu: float, model_tflop: float, tokens_per_gpu: int, num_params: int, explained: str = "",
) -> PublishedRow:  # fmt: skip
    model = Model(
        f"mpt-{size}",
        params_from_dims(layers, hidden, VOCAB_MPT, seq),
        layers,
        hidden,
        heads,
        seq,
        global_batch=batch,
        vocab=VOCAB_MPT,
        source=f"{_LLMF}: MPT {size}, {layers} layers, d_model {hidden}, {heads} heads (llm-foundry's yamls)",
    )
    return PublishedRow(
        _LLMF,
        f"{size} on {gpus} GPUs, seq {seq:,}",
        model,
        gpus,
        tp=1,
        pp=1,
        dp=gpus,
        micro_batch=micro,
        global_batch=batch,
        tflops_per_gpu=model_tflop / 1e12,
        peak_fraction=mfu / 100,
        convention="llm-foundry",
        hardware="h100",
        precision="bf16",
        recompute="full" if recompute else "none",
        attention="flash",
        sp=False,
        zero=3,
        printed=(("mfu_percent", mfu), ("tokens_per_s_per_gpu", tokens_per_gpu), ("num_params", num_params)),
        run=_LLMF_RUN,
        explained=explained,
    )


# Model, layers, d_model, heads, SeqLen, GPUs, MicroBatchSize, GlobalBatchSize, Activation Checkpointing, MFU (%),
# Model TFLOP (per GPU), Throughput (T/s/GPU), NumParams: the table's rows as printed.
LLM_FOUNDRY_2023 = (
    _mpt_row("70b", 80, 8192, 64, 2048, 64, 8, 2048, True, 42.57, 4.212583e14, 1039, 64862437376),
    _mpt_row("30b", 48, 7168, 56, 2048, 32, 14, 1344, True, 43.92, 4.346371e14, 2308, 29975214080),
    _mpt_row("13b", 40, 5120, 40, 2048, 8, 2, 16, False, 39.79, 3.937055e14, 4792, 12853954560, _LLMF_SHORT_STEP),
    _mpt_row("7b", 32, 4096, 32, 2048, 8, 6, 48, False, 46.44, 4.595096e14, 10643, 6658859008, _LLMF_SHORT_STEP),
    _mpt_row("7b", 32, 4096, 32, 65536, 8, 1, 16, True, 28.59, 2.829422e14, 1956, 6918905856, _LLMF_64K),
    _mpt_row("1b", 24, 2048, 16, 2048, 8, 14, 112, False, 41.82, 4.138134e14, 45455, 1315950592, _LLMF_SHORT_STEP),
)
ROWS = NARAYANAN_2021 + LLAMA3_2024 + LLM_FOUNDRY_2023


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
    and count its step's FLOPs as its source does: eq. (3) for Narayanan et al. 2021, the planner's model FLOPs for
    Llama 3, :func:`llm_foundry_flops` for llm-foundry."""
    layout = Layout(
        tp=row.tp,
        pp=row.pp,
        dp=row.dp,
        zero=row.zero,
        cp=row.cp,
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
    if row.convention == "eq3":
        flops = narayanan_flops(row)
    elif row.convention == "llm-foundry":
        flops = llm_foundry_flops(row)
    else:
        flops = c.model_flops
    return Estimate(row, c, flops / (c.step_time_s * row.gpus) / 1e12)


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
            lines.append(f"    missed: {e.row.explained}")
    return "\n".join(lines)
