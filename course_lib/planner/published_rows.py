"""The published runs the planner is checked against (:mod:`course_lib.planner.published`), row by row as their
sources print them: the model, the layout and how it ran, what it reached, and how the source counts FLOPs.

Narayanan et al. 2021's Table 1, Llama 3's Table 4 and six of llm-foundry's FSDP rows (what
:mod:`course_lib.planner.published` describes), torchtitan's Llama 3 H100 benchmarks (2024-12) and Megatron-Bridge's
performance summary (DGX-H100, FP8): where a source is silent, the assumption is written in the row's ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.cluster.profiles import H100_SXM_PEAKS
from course_lib.model.formulas import params_from_dims
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
_H100_PEAK = H100_SXM_PEAKS["bf16"]  # the dense BF16 peak the sources' MFU is taken against
SEQ_N21, VOCAB_N21 = 2048, 51200  # Narayanan et al. 2021, §5.1


@dataclass(frozen=True)
class PublishedRow:
    """One published run: where it is printed, the model, the layout and how it ran, what it reached, and how its
    source counts FLOPs (``convention``: "eq3", Narayanan et al. 2021's eq. (3); "model", 6N + causal attention;
    "llm-foundry", 6N + unmasked attention; "torchtitan", 6N without the input embedding + unmasked attention;
    "megatron", Megatron-Bridge's count, with ``mla`` and ``mtp_layers`` where the model has them). ``printed``
    holds the numbers as the source prints them where a field here differs or is derived; ``explained``, for a row
    whose estimate misses by more than 15%, why (its ``{fields}`` filled in by
    :func:`course_lib.planner.published.facts`); ``async_tp``, a run that overlapped TP's collectives with its
    matmuls (torchtitan's async TP), which the planner does not model."""

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
    precision: str  # as run: fp16, bf16 (the planner's "mixed") or fp8 (its linears: the hardware's "+fp8")
    recompute: str
    attention: str
    sp: bool
    zero: int
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    printed: tuple[tuple[str, float], ...] = ()
    run: str = ""
    explained: str = ""
    mla: tuple[int, ...] = ()  # multi-head latent attention: head dim, RoPE dim, V head dim, q rank, kv rank
    mtp_layers: int = 0  # multi-token-prediction layers the source's FLOP count includes
    async_tp: bool = False  # TP's collectives overlapped with the matmuls (torchtitan's async TP): not modeled

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


def torchtitan_flops_per_token(model: Model) -> float:
    """torchtitan's FLOPs a token (``get_num_flop_per_token`` in torchtitan/utils.py at commit 9dec370): 6 x the
    parameters without the input embedding (``exclude_embedding=True``) plus 12 L h s, attention's two matmuls
    forward and backward unmasked ("we follow the convention and do not account for sparsity in causal attention")
    and FlashAttention's recomputed one not counted."""
    return 6 * (model.params - model.vocab * model.hidden) + 12 * model.layers * model.hidden * model.seq


_TT = "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (2024-12)"
_TT_RUN = (
    "Llama 3.1 on Grand Teton H100s at 500 W (profile h100-500w); FSDP2 over the DP ranks (ZeRO-3; with PP it keeps "
    "the gathered weights through a step's microbatches, torchtitan's reshard_after_forward=False, same bytes)"
)
_TT_8K = (
    "; 8,192-token sequences (the seq_len of torchtitan's train_configs at commit 9dec370, the one the file names: "
    "the table states none; the 8B rows' 33-39% MFU of footnote 2 confirms it); BF16 mixed precision"
)
_TT_CP = (
    "; sequences as the table prints them, split over the CP ranks by torchtitan's context parallelism (PyTorch's "
    "context-parallel attention, K/V all-gathered, torchtitan's default rotate method; the causal blocks balanced "
    "over the ranks as the planner's CP model takes them, PyTorch's enable_load_balance default, not checked at "
    "torch 1963fc8); FSDP sharded over FSDP x CP; BF16 mixed precision"
)
_TT_FP8 = (
    "; torch.compile and Float8 linears (torchao, dynamic scaling; output head in BF16), as the table's title says"
)
_TT_ASYNC = "; async TP, which the planner does not model: its TP traffic is timed exposed"
_TT_PP = (
    "; microbatches: torchtitan's default, as many as the PP degree ({m} of {b} sequences; local batch {local})"
    "{schedule}"
)
_TT_EAGER = (
    "eager PyTorch, op-level selective checkpointing and the 500 W cap, none of which the planner counts: the "
    "table's own torch.compile row is {compiled:.2f}x faster on the same run (measured); torchtitan's 'op' policy "
    "recomputes every second matmul of a layer (wk, wo, w3: {sac:.0%} more matmul FLOPs, computed from the dims); "
    "the capped peak lies between the NVL's and the SXM's (footnote 2), at the NVL's the estimate is {nvl:.2f}x. "
    "The three together leave {left:.2f}x"
)
_TT_CAP = (
    "the 500 W cap: the profile takes the SXM's peak, the upper bound; at the NVL's dense peak, the lower bound "
    "footnote 2 names, the estimate is {nvl:.2f}x. FP8 matmuls are taken at the BF16 fraction of peak (unmeasured)"
)


_TT_HIDES = (
    "; async TP, which the run used, would hide the {tp_s:.1f} s of TP traffic the estimate exposes, widening the gap"
)
_TT_ASYNC_ROW = (
    "; async TP, which the planner does not model (the estimate is the row's without it): hidden in full behind the "
    "matmuls, the {tp_s:.1f} s of TP traffic the estimate exposes ({tp_share:.0%} of its step) would make it "
    "{no_tp:.2f}x; the table measures async TP {async_gain:.2f}x faster than the same run without it, "
    "{async_s:.2f} s off the published step"
)


def _tt_long(cp: int) -> str:
    """Why a long-sequence row misses: attention's share of the estimated compute, how the planner times it and, with
    CP, how PyTorch's context parallelism runs it; the attention efficiency that would close the gap."""
    how = (
        f", where PyTorch's context parallelism runs it K/V shard by shard, {cp} kernel calls a layer forward merged "
        "by their log-sum-exp (not measured)"
        if cp > 1
        else ""
    )
    return (
        "; attention is {attn:.0%} of the estimated compute at this length, timed as one FlashAttention kernel at the "
        "profile's {attn_eff:.0%} of the BF16 peak with the causal mask's blocks skipped" + how + ": had attention "
        "alone absorbed the gap left at the NVL's peak, it would sustain {implied:.0%}"
    )


def _torchtitan_row(
    row: str, model: Model, gpus: int, tp: int, pp: int, local: int, micro: int, tokens: int, recompute: str,
    fp8: bool, explained: str, schedule: str = "1f1b", chunks: int = 1, compiled: int = 0, cp: int = 1,
    async_tp: bool = False, without_async_tp: int = 0,
) -> PublishedRow:  # fmt: skip
    """A torchtitan row: tokens/s per GPU as printed, its TFLOP/s in torchtitan's count
    (:func:`course_lib.planner.published.torchtitan_flops`); ``without_async_tp``, the tokens/s per GPU the table
    prints for the same run without async TP."""
    dp = gpus // (tp * pp * cp)
    model = replace(model, global_batch=dp * local)
    rate = tokens * torchtitan_flops_per_token(model)  # FLOP/s per GPU
    printed = (("tokens_per_s_per_gpu", tokens), ("local_batch", local))
    printed += (("compiled_tokens_per_s_per_gpu", compiled),) if compiled else ()
    printed += (("without_async_tp_tokens_per_s_per_gpu", without_async_tp),) if without_async_tp else ()
    named = ", and the interleaved schedule's default 2 stages per rank" if schedule == "interleaved" else ""
    run = (
        _TT_RUN + (_TT_8K if model.seq == 8192 else _TT_CP) + (_TT_FP8 if fp8 else "") + (_TT_ASYNC if async_tp else "")
    )
    run += _TT_PP.format(m=pp, b=local // pp, local=local, schedule=named) if pp > 1 else ""
    return PublishedRow(
        _TT, row, model, gpus, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=micro, global_batch=dp * local,
        tflops_per_gpu=rate / 1e12, peak_fraction=rate / _H100_PEAK, convention="torchtitan",
        hardware="h100-500w+fp8" if fp8 else "h100-500w", precision="bf16", recompute=recompute, attention="flash",
        sp=tp > 1, zero=3, schedule=schedule, chunks=chunks, printed=printed, run=run, explained=explained,
        async_tp=async_tp,
    )  # fmt: skip


def _tt_cp_row(table: str, size: str, tp: int, pp: int, cp: int, local: int, tokens: int) -> PublishedRow:
    """Table 2 (8B, 8 GPUs, FSDP x CP) or Table 6 (405B, 512 GPUs, FSDP x TP 8 x PP 8 x CP, async TP, 1F1B): the
    sequence grows with CP, 32,768 tokens a CP rank; torch.compile, Float8, full activation checkpointing."""
    gpus = 8 * tp * pp
    seq = 32768 * cp
    label = f"{table}, {size} FSDP {gpus // (tp * pp * cp)} x " + (f"TP {tp} x PP {pp} x " if pp > 1 else "")
    return _torchtitan_row(
        f"{label}CP {cp}, seq {seq:,}", replace(PRESETS[f"llama3-{size.lower()}"], seq=seq), gpus, tp, pp, local,
        local // pp, tokens, "full", True, _TT_CAP + (_TT_HIDES if tp > 1 else "") + _tt_long(cp), cp=cp,
        async_tp=tp > 1,
    )  # fmt: skip


# Table, parallelism, GPUs, TP, PP, local batch, micro-batch, TPS/GPU, activation checkpointing (Tables 1, 3-5);
# Tables 2 and 6: CP, local batch, TPS/GPU.
TORCHTITAN_2024 = (
    _torchtitan_row("Table 1, 8B FSDP on 8 GPUs", PRESETS["llama3-8b"], 8, 1, 1, 2, 2, 5762, "selective", False,
                    _TT_EAGER, compiled=6667),
    _torchtitan_row("Table 3, 8B FSDP on 128 GPUs", PRESETS["llama3-8b"], 128, 1, 1, 2, 2, 5605, "selective", False,
                    _TT_EAGER, compiled=6514),
    _torchtitan_row("Table 4, 70B FSDP 32 x TP 8 on 256 GPUs", PRESETS["llama3-70b"], 256, 8, 1, 16, 16, 829, "full",
                    True, _TT_CAP),
    _torchtitan_row("Table 4, 70B FSDP 32 x TP 8 on 256 GPUs, async TP", PRESETS["llama3-70b"], 256, 8, 1, 16, 16,
                    876, "full", True, _TT_CAP + _TT_ASYNC_ROW, async_tp=True, without_async_tp=829),
    _torchtitan_row("Table 5, 405B FSDP 8 x TP 8 x PP 8, 1F1B", PRESETS["llama3-405b"], 512, 8, 8, 32, 4, 100, "full",
                    True, _TT_CAP + _TT_HIDES, async_tp=True),
    _torchtitan_row("Table 5, 405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B", PRESETS["llama3-405b"], 512, 8, 8, 32, 4,
                    128, "full", True, _TT_CAP + _TT_HIDES, schedule="interleaved", chunks=2, async_tp=True),
    *(_tt_cp_row("Table 2", "8B", 1, 1, cp, 1, tokens) for cp, tokens in ((1, 3890), (2, 2540), (4, 1071), (8, 548))),
    *(_tt_cp_row("Table 6", "405B", 8, 8, cp, 8, tokens) for cp, tokens in ((1, 76), (2, 47), (4, 31), (8, 16))),
)  # fmt: skip

_MB = "Megatron-Bridge, docs/performance-summary.md"
_MB_RUN = (
    "FP8 with current (per-tensor) scaling, Transformer Engine's linears (profile h100+fp8: the output head and "
    "attention in BF16); DGX-H100; DDP with the distributed optimizer (ZeRO-1) where FSDP is 0; no activation "
    "recompute (none in the recipe); sequence parallelism with TP; FlashAttention-style attention"
)
_MB_DSV3 = (
    "not fully explained: Megatron's count includes the multi-token-prediction layer, which the planner's model "
    "leaves out ({mtp:.1%} of the FLOPs counted: with its compute in the step the estimate is "
    "{with_mtp:.2f}x); the rest not measured: "
    "the router and the tokens' permutation and FP8 casts, which the planner does not time, the experts' grouped "
    "GEMMs timed at the dense matmuls' fraction of the FP8 peak, and the uneven stages of the recipe's pipeline "
    "layout (Et|(tt|)*30mL: embedding and one layer first, the MTP layer and loss last), which it splits evenly. "
    "The run overlapped the all-to-alls the estimate exposes ({ep_s:.1f} s a step), which would widen the gap"
)


def _bridge_row(
    release: str, model: Model, gpus: int, batch: int, tp: int, pp: int, cp: int, vp: int, ep: int, fsdp: int,
    tokens: int, tflops: int, explained: str = "", **extra,
) -> PublishedRow:  # fmt: skip
    """A Megatron-Bridge DGX-H100 row: tokens/s and Model TFLOP/s per GPU as printed, MBS 1."""
    layout = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp * cp), "cp": cp, "ep": ep, "micro_batch": 1}
    return PublishedRow(
        f"{_MB}, {release} NeMo container, DGX-H100",
        f"{model.name} on {gpus} GPUs",
        replace(model, global_batch=batch),
        gpus,
        global_batch=batch,
        tflops_per_gpu=tflops,
        peak_fraction=tflops / (_H100_PEAK / 1e12),
        convention="megatron",
        hardware="h100+fp8",
        precision="fp8",
        recompute=extra.pop("recompute", "none"),
        attention="flash",
        sp=tp > 1,
        zero=3 if fsdp else 1,
        schedule="interleaved" if vp > 1 else "1f1b",
        chunks=vp,
        printed=(("tokens_per_s_per_gpu", tokens),),
        run=_MB_RUN + extra.pop("run", ""),
        explained=explained,
        **layout,
        **extra,
    )


MEGATRON_BRIDGE_2025 = (
    # 25.11 (FP8-CS stated in the row): GPUs, GBS, TP, PP, CP, VP, EP, FSDP, tokens/s/GPU, Model TFLOP/s/GPU.
    _bridge_row("25.11", PRESETS["llama3-8b"], 8, 128, 1, 1, 1, 1, 1, 8, 14451, 744),
    _bridge_row("25.11", PRESETS["llama3-70b"], 64, 128, 4, 8, 1, 5, 1, 0, 1602, 719),
    _bridge_row("25.11", PRESETS["llama3-405b"], 1024, 512, 8, 8, 2, 8, 1, 0, 292, 737),
    # 25.09 (precision by the footnote: 338 per-tensor FP8, 330 the 128x128 blockwise; the recipe's fp8_cs): the
    # recipe's selective recompute, MTP 1 counted, EP 64 carved out of DP 64.
    _bridge_row("25.09", PRESETS["deepseek-v3-h100"], 1024, 8192, 2, 8, 1, 4, 64, 0, 1297, 338, _MB_DSV3,
                recompute="selective", mla=(128, 64, 128, 1536, 512), mtp_layers=1,
                run="; DeepEP dispatch with the all-to-all overlapped (moe_a2a_overlap), force-balanced routing"),
)  # fmt: skip
ROWS = NARAYANAN_2021 + LLAMA3_2024 + LLM_FOUNDRY_2023 + TORCHTITAN_2024 + MEGATRON_BRIDGE_2025
