"""The configs at the bottom of the model: the tiny GPT's sizes (:class:`GPTConfig`), a training run's settings
(:class:`TrainConfig`), a parallel layout (:class:`Layout`), and the one copy of each vocabulary they and the memory
formulas name, with its validator: attention kernels, recompute modes, norms, the bytes-per-parameter conventions
(:data:`PRECISIONS`; ZeRO's 16 = 2 + 2 + 12, Rajbhandari et al. 2020, §3.1), the 16-bit types and loss scaling.

It imports nothing of course_lib, so every other module of the model, and everything above it, can import it; and no
torch (:attr:`TrainConfig.torch_dtype` imports it when asked), so the command line can take its vocabularies without.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# FlashAttention (Dao et al. 2022) never stores the (heads, s, s) scores; "materialized" writes them to memory, as
# Korthikanti et al. 2022 count them (Table 2).
ATTENTION_KERNELS = ("flash", "materialized")
# Activation recomputation (Korthikanti et al. 2022, §5; :mod:`course_lib.model.recompute`): keep everything, recompute
# the attention core, or recompute each layer from its input.
RECOMPUTE_MODES = ("none", "selective", "full")
NORMS = {"layernorm": 2, "rmsnorm": 1}  # weights per hidden unit: LayerNorm's scale and bias, RMSNorm's scale
# The synthetic data of step k comes from seed x DATA_SEED_STRIDE + k (:func:`course_lib.model.gpt.synthetic_tokens`),
# and torch seeds a generator with at most 64 bits, so a run's seeds stop at :func:`max_seed` of its steps.
DATA_SEED_STRIDE = 1_000_003
TORCH_SEED_LIMIT = 2**64 - 1  # torch.Generator.manual_seed's largest seed (a negative one wraps: not taken here)


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, not {recompute!r}")


def check_attention(attention: str) -> None:
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, not {attention!r}")


def check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {sorted(NORMS)}, not {norm!r}")


# ------------------------------------------------------------------------------------------------ bytes per parameter
@dataclass(frozen=True)
class Precision:
    """What a parameter costs in bytes, by what holds it: the weights forward and backward use (``params``), the
    gradients kept until the optimizer step (``grads``), an fp32 copy of the weights the optimizer updates
    (``master``, 0 without one) and Adam's two moments (``moments``). ``zero3_grads``: the gradient bytes that stay
    per parameter under ZeRO-3, where a layer's 16-bit gradient is reduce-scattered as soon as backward makes it
    (None: ``grads``)."""

    name: str
    params: int
    grads: int
    master: int
    moments: int
    zero3_grads: int | None = None
    source: str = ""

    @property
    def optimizer(self) -> int:
        return self.master + self.moments

    def bytes(self, zero: int = 0) -> dict[str, int]:
        """Bytes per parameter by category (``params``, ``grads``, ``optimizer``) at ZeRO stage ``zero``."""
        grads = self.zero3_grads if zero == 3 and self.zero3_grads is not None else self.grads
        return {"params": self.params, "grads": grads, "optimizer": self.optimizer}


# The conventions the field uses; each names who counts that way. "mixed" is the course's name for ZeRO's.
PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", 4, 4, 0, 8, source="fp32 Adam: fp32 weights, gradients, both moments"),
        Precision("fp64", 8, 8, 0, 16, source="the course's float64 runs (equivalence at 1e-10): all twice fp32"),
        Precision(
            "mixed",
            2,
            2,
            4,
            8,
            source="ZeRO (Rajbhandari et al. 2020, §3.1): 16-bit weights and gradients, fp32 "
            "master weights and moments: 16 bytes",
        ),
        Precision("zero", 2, 2, 4, 8, source="the same as mixed, under the paper's name: 2 + 2 + 12 = 16 bytes"),
        Precision(
            "megatron",
            2,
            4,
            4,
            8,
            source="Megatron-LM (theoretical_memory_usage.py, dist_optimizer.md): bf16 "
            "weights, fp32 main gradients, fp32 master and moments: 18 bytes; its distributed optimizer shards "
            "master and moments over DP (our ZeRO-1): 6 + 12/d",
        ),
        Precision(
            "deepspeed",
            2,
            6,
            4,
            8,
            zero3_grads=4,
            source="DeepSpeed's ZeRO estimators "
            "(estimate_zero2/3_model_states_mem_needs): fp16 weights, fp16 and fp32 gradients, fp32 master and "
            "moments; ZeRO-2 2 + 18/N, ZeRO-3 18/N plus the gathered largest layer (its fp16 gradient is "
            "reduce-scattered at once, only the fp32 one stays)",
        ),
        Precision(
            "no-master",
            2,
            2,
            0,
            8,
            source="16-bit weights and gradients, fp32 moments, no master copy: 12 bytes "
            "(what a count that forgets the master copy gives)",
        ),
    )
}
BYTES_PER_PARAM = {name: p.bytes() for name, p in PRECISIONS.items()}  # at ZeRO 0, by category


def precision_of(precision: str | Precision) -> Precision:
    """A :class:`Precision`, or the convention of that name (:data:`PRECISIONS`)."""
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
    return PRECISIONS[precision]


# ------------------------------------------------------------------------------------------------ training precision
HALF_TYPES = {"bf16": "bfloat16", "fp16": "float16"}  # TrainConfig.half -> the name of its torch dtype
MIXED_PRECISIONS = ("mixed", "megatron", "no-master")  # the PRECISIONS a run can train in (TrainConfig.precision)
DEFAULT_LOSS_SCALE = 2.0**16  # where a dynamic loss scale starts (DeepSpeed's initial_scale_power 16, GradScaler's)


def check_precision_settings(train: TrainConfig) -> None:
    """Refuse a precision, 16-bit type or loss scale that makes no sense, or no sense together, saying what to do."""
    if train.precision is not None and train.precision not in MIXED_PRECISIONS:
        raise ValueError(
            f"precision must be None (every tensor in dtype) or one of {list(MIXED_PRECISIONS)} (16, 18 and 12 "
            f"bytes per parameter), not {train.precision!r}"
        )
    if train.half not in HALF_TYPES:
        raise ValueError(f"half must be one of {list(HALF_TYPES)}, not {train.half!r}")
    scale = train.loss_scale
    if not (scale in ("auto", "dynamic", None) or _positive_number(scale)):
        raise ValueError(f"loss_scale must be 'dynamic', None (no scaler) or a number greater than 0, not {scale!r}")
    if not _positive_number(train.initial_scale):
        raise ValueError(f"initial_scale must be a number greater than 0, not {train.initial_scale!r}")
    if train.precision is None:
        if (train.half, train.loss_scale, train.initial_scale) != ("bf16", "auto", DEFAULT_LOSS_SCALE):
            raise ValueError(
                f"half, loss_scale and initial_scale set up mixed precision: give precision too "
                f"({', '.join(map(repr, MIXED_PRECISIONS))}), or leave them out to train in {train.dtype} throughout"
            )
        return
    if train.dtype != "float32":
        raise ValueError(
            f"mixed precision keeps fp32 master weights and moments: use dtype='float32', not {train.dtype!r}"
        )
    if train.half == "bf16" and scale not in ("auto", None):
        raise ValueError(
            "bf16 has fp32's exponent range and needs no loss scaling: leave loss_scale out, or use half='fp16'"
        )
    if train.initial_scale != DEFAULT_LOSS_SCALE and loss_scaling(train) != "dynamic":
        raise ValueError("initial_scale is where a dynamic loss scale starts: use it with loss_scale='dynamic'")


def max_seed(steps: int) -> int:
    """The largest seed a run of ``steps`` steps can take: its last step's data seed, seed x
    :data:`DATA_SEED_STRIDE` + steps - 1, must be one torch takes (:data:`TORCH_SEED_LIMIT`)."""
    return (TORCH_SEED_LIMIT - (steps - 1)) // DATA_SEED_STRIDE


def _positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def loss_scaling(train: TrainConfig) -> str | float | None:
    """The loss scaling a run uses: ``dynamic``, a fixed scale, or None (bf16 by default, and fp32)."""
    if train.loss_scale != "auto":
        return train.loss_scale
    return "dynamic" if train.precision is not None and train.half == "fp16" else None


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the tiny GPT. ``heads`` must divide ``d_model``.

    ``experts`` > 0 makes every block's MLP a mixture of that many experts (:class:`course_lib.model.gpt.MoE`),
    each token sent to its ``top_k`` best; ``capacity_factor`` None is dropless, a float caps each expert at
    ceil(tokens x top_k / experts x capacity_factor) assignments per batch; ``aux_loss_coef`` is Switch's alpha.

    ``recompute`` (:mod:`course_lib.model.recompute`): ``full`` recomputes every block in backward from its input,
    ``selective`` only the attention core from Q, K and V; ``none`` keeps everything.
    """

    vocab: int = 128
    seq: int = 32
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    ffn_mult: int = 4
    frozen_pos: bool = True
    experts: int = 0
    top_k: int = 1
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    recompute: str = "none"

    def __post_init__(self) -> None:
        check_recompute(self.recompute)
        for name in ("vocab", "seq", "layers", "d_model", "heads", "ffn_mult"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")
        if self.experts < 0:
            raise ValueError(f"GPTConfig.experts must be 0 (a dense MLP) or a number of experts, got {self.experts}")
        if self.experts == 0 and (self.top_k != 1 or self.capacity_factor is not None):
            raise ValueError(
                f"top_k={self.top_k} and capacity_factor={self.capacity_factor} route tokens to experts, but this "
                f"model is dense (experts=0); set experts to 1 or more, or leave them at 1 and None"
            )
        if not 1 <= self.top_k <= max(self.experts, 1):
            raise ValueError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ValueError(
                f"capacity_factor must be a positive number (1.25 is Switch's) or None (dropless), got "
                f"{self.capacity_factor}"
            )
        if not 0 <= self.aux_loss_coef < math.inf:
            raise ValueError(f"aux_loss_coef must be 0 or more (Switch uses 0.01), got {self.aux_loss_coef}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the same for the reference and every parallel scheme.

    ``precision`` None trains every tensor in ``dtype``; ``mixed`` (16 bytes per parameter), ``megatron`` (18) or
    ``no-master`` (12) train with 16-bit weights of type ``half`` (``bf16`` or ``fp16``) and fp32 optimizer state
    (:mod:`course_lib.model.precision`). ``loss_scale``: ``auto`` (a dynamic scale for fp16, none for bf16),
    ``dynamic`` (starting at ``initial_scale``), a fixed number, or None (no scaler).
    """

    steps: int = 3
    batch: int = 8
    lr: float = 1e-2
    weight_decay: float = 0.1
    # AdamW's eps. With PyTorch's 1e-8, a weight whose gradient is below ~1e-8 takes a step of ~lr decided by the
    # gradient's rounding noise, so two correct summation orders (one device, 4 ranks) end up 1e-4 apart in fp32;
    # the tiny GPT has such weights. 1e-6 (BERT's and RoBERTa's choice) keeps fp32 comparisons about the scheme.
    adam_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"
    precision: str | None = None
    half: str = "bf16"
    loss_scale: float | str | None = "auto"
    initial_scale: float = DEFAULT_LOSS_SCALE

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"steps and batch must be at least 1, got steps={self.steps}, batch={self.batch}")
        if not 0 <= self.seed <= max_seed(self.steps):
            raise ValueError(
                f"seed must be a whole number from 0 to {max_seed(self.steps):,}, got {self.seed}: torch seeds with "
                f"64 bits, and step k's data with seed x {DATA_SEED_STRIDE:,} + k; use a smaller seed"
            )
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', not {self.dtype!r}")
        check_precision_settings(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, so that the configs (and the command line's vocabularies) import no torch

        return getattr(torch, self.dtype)


class Layout(NamedTuple):
    """One way to lay a model out: the degrees (tensor, pipeline, data, context, expert parallel), the ZeRO stage,
    the microbatches per DP rank and the pipeline schedule with its model chunks per rank; and what each rank does
    with a microbatch of ``micro_batch`` sequences: sequence parallelism beside TP, the recompute mode
    (:data:`RECOMPUTE_MODES`) and the attention kernel (:data:`ATTENTION_KERNELS`).

    ``stage_layers``: the layers of each pipeline stage, first to last, when they are uneven (Megatron-LM's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``; BLOOM-176B gave its first and
    last stage one block fewer, for the embedding and the head); empty: as even as the layers allow."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    microbatches: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    sp: bool = False
    recompute: str = "none"
    attention: str = "flash"
    micro_batch: int = 1
    stage_layers: tuple[int, ...] = ()
