"""Mixed-precision training on real ranks: 16-bit weights and gradients, fp32 master weights and Adam moments, and
loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training", §3; Kalamkar et al. 2019, "A Study of
BFLOAT16 for Deep Learning Training", §3; Rajbhandari et al. 2020, "ZeRO", §3.1 for the 16 bytes).

Three conventions, each one of the memory model's (:data:`course_lib.model.config.PRECISIONS`), by bytes per parameter:

* ``mixed`` 16: weights (2) and gradients (2) in the 16-bit type, an fp32 master copy of the weights (4) that the
  optimizer updates and rounds back into them, and Adam's two fp32 moments (8) (§3.1).
* ``megatron`` 18: the same, but each gradient is accumulated into an fp32 ``main_grad`` (4) and all-reduced in fp32,
  as Megatron-LM's DDP does (its ``accumulate_allreduce_grads_in_fp32``, with ``Float16OptimizerWithFloat16Params``).
* ``no-master`` 12: no master copy: the fp32 update is computed from the 16-bit weight and rounded straight back, so
  an update below half a 16-bit ulp of its weight is lost (the count the "84 GB for 7B" figure assumes).

The forward runs under ``torch.autocast`` in the 16-bit type (backward follows the dtypes it chose), so the
operators autocast keeps in fp32 run in fp32: cross-entropy on every device; LayerNorm and softmax too on CUDA,
while on CPU their kernels accumulate in fp32 but return the 16-bit type. bf16 has fp32's 8-bit exponent and needs
no loss scaling; fp16 has 5 exponent bits (largest 65504, smallest subnormal 2^-24), so the loss is multiplied by a
scale S before backward, which keeps small gradients from flushing to zero, and the fp32 gradients are divided by S
(§3.2). A step whose gradients hold inf or NaN is skipped; a dynamic scaler then halves S and doubles it after
``window`` clean steps (DeepSpeed's ``DynamicLossScaler``, PyTorch's ``GradScaler``, Megatron-LM's
``DynamicGradScaler`` without its hysteresis; DeepSpeed's default start, 2^16).

:class:`MixedPrecisionOptimizer` wraps any ``torch.optim`` optimizer class; it is also the ``optimizer_class`` that
:class:`course_lib.parallel.zero.ZeroRedundancyOptimizer` shards, so under ZeRO-1/2 a rank keeps master weights and
moments for its slice alone: 2 + 2 + 12/N bytes per parameter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import comm
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.ledgers.memory import resize_storage
from course_lib.model.config import (
    DEFAULT_LOSS_SCALE,
    HALF_TYPES,
    PRECISIONS,
    Precision,
    TrainConfig,
    loss_scaling,
)

SCALE_WINDOW = 1000  # clean steps before a dynamic scale doubles (DeepSpeed's loss_scale_window, Megatron's)

# How far a mixed-precision loss curve may stray from the same run in fp32, over the course's runs of up to 20
# steps: 2% of the loss (measured on the tiny GPT in bf16: at most 0.8% over 20 steps, 0.6% over 10). It cannot be 0:
# bf16 keeps 8 significant bits (fp16 11), so every weight, matmul output and gradient is rounded to about 2^-9 of
# itself. The first loss, a mean over many tokens whose roundings mostly cancel, is off by a few 1e-6; then every
# update starts from rounded weights and gradients, and the two runs drift apart.
LOSS_TOLERANCE = 0.02
# How far a data-parallel (or ZeRO) mixed-precision run may stray from one device in the same precision: 1% of the
# loss (measured: at most 0.24% over 10 steps on 4 ranks). Each rank rounds the 16-bit gradient of its share of the
# batch before the all-reduce adds them, where one device rounds the whole batch's gradient once: the same kind of
# perturbation as bf16 against fp32, only smaller, and it drifts the same way.
DP_TOLERANCE = 0.01
# How far a parallel run in one dtype may stray from one device: in float64 1e-10 (a correct scheme lands within
# about 1e-13: only the order of its sums differs); in float32 1e-5 in the loss and in the parameters' relative norm
# (measured: at most about 1e-6 on the course's runs; elementwise, Adam turns rounding noise near eps into visible
# steps of single weights, see course_lib.model.gpt.rel_param_diff).
FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-5
_RELATIVE = {"params_measure": "relative param diff", "params_key": "rel_param_diff"}


def one_device_tolerances(train: TrainConfig, loss: float) -> dict:
    """The tolerances of a run against one device in the same dtype and precision (``loss``: the reference's
    largest loss, for a relative bound): ``loss`` (of max |loss diff|), and ``params`` of the measure
    ``params_measure`` (report key ``params_key``). In float64 both 1e-10 and the parameters elementwise; in float32
    1e-5 and the parameters' relative norm; in mixed precision the loss within :data:`DP_TOLERANCE` of itself and
    the parameters' relative norm ``None``: as far as the one-device run itself strays from fp32, which the harness
    measures."""
    if train.precision is not None:
        return {"loss": DP_TOLERANCE * loss, "params": None, **_RELATIVE}
    if train.dtype == "float64":
        return {
            "loss": FLOAT64_TOLERANCE,
            "params": FLOAT64_TOLERANCE,
            "params_measure": "max |param diff|",
            "params_key": "max_abs_param_diff",
        }
    return {"loss": FLOAT32_TOLERANCE, "params": FLOAT32_TOLERANCE, **_RELATIVE}


def one_device_verdict(report: dict, train: TrainConfig) -> dict:
    """Whether the run matches one device, each measure beside its tolerance for the run's dtype and precision
    (:func:`one_device_tolerances`): ``matches`` and, for ``loss`` and ``params``, the
    measure's name, its value and its tolerance. A mixed-precision run's parameters may stray from one device's as
    far as 16-bit rounding moves one device from fp32 (``rel_param_diff_vs_fp32``): the same kind of perturbation."""
    tolerance = one_device_tolerances(train, max(report["reference_losses"], default=0.0))
    params_tolerance = tolerance["params"]
    if params_tolerance is None:
        params_tolerance = report["precision"]["rel_param_diff_vs_fp32"]
    measures = {
        "loss": ("max |loss diff|", report["max_abs_loss_diff"], tolerance["loss"]),
        "params": (tolerance["params_measure"], report[tolerance["params_key"]], params_tolerance),
    }
    rows = {k: {"measure": m, "value": v, "tolerance": t} for k, (m, v, t) in measures.items()}
    return {"matches": all(r["value"] <= r["tolerance"] for r in rows.values()), **rows}



def convention(train: TrainConfig) -> Precision:
    """The memory model's convention a run trains in (:data:`course_lib.model.config.PRECISIONS`): its own precision, or
    ``fp32`` / ``fp64`` for one dtype throughout."""
    return PRECISIONS[train.precision or {"float32": "fp32", "float64": "fp64"}[train.dtype]]


def full_precision(train: TrainConfig) -> TrainConfig:
    """The same run in fp32 throughout: what a mixed-precision loss curve is compared with."""
    return replace(train, precision=None, half="bf16", loss_scale="auto", initial_scale=DEFAULT_LOSS_SCALE)


def state_bytes(train: TrainConfig, params: int, grads: int, optimizer: int, tensors: int) -> dict[str, int]:
    """Model-state bytes of a rank holding ``params`` weights, ``grads`` gradient elements and the optimizer state of
    ``optimizer`` elements in ``tensors`` tensors, at the run's bytes per element (:func:`convention`): master
    weights and AdamW's two moments per element, and AdamW's 4-byte step counter per tensor."""
    c = convention(train)
    return {"params": c.params * params, "grads": c.grads * grads, "optimizer": c.optimizer * optimizer + 4 * tensors}


def overflow_check_bytes(train: TrainConfig, n: int) -> float:
    """Bytes a rank sends per step so that n ranks holding slices of the gradients agree whether any overflowed:
    one all-reduced fp32 flag when the run scales its loss."""
    return ring_factor("all_reduce", n) * 4 if loss_scaling(train) is not None and n > 1 else 0.0


# ------------------------------------------------------------------------------------------------ weights, gradients
def prepare(module: nn.Module, train: TrainConfig) -> nn.Module:
    """Hold ``module`` as the run's precision does: its parameters and floating buffers in the 16-bit type, and
    under ``megatron`` each trainable parameter's gradient accumulated into an fp32 ``main_grad`` (its 16-bit
    ``.grad`` added in and dropped as soon as backward completes it, Megatron-LM's DDP hook). Unchanged in fp32."""
    if train.precision is None:
        return module
    module.to(getattr(torch, HALF_TYPES[train.half]))
    if train.precision == "megatron":
        for p in module.parameters():
            if p.requires_grad:
                p.main_grad = None
                p.register_post_accumulate_grad_hook(_into_main_grad)
    return module


def _into_main_grad(p: nn.Parameter) -> None:
    p.main_grad = p.grad.float() if p.main_grad is None else p.main_grad.add_(p.grad)
    p.grad = None


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient is kept in: fp32 for a parameter with a main gradient, else its own."""
    return torch.float32 if hasattr(p, "main_grad") else p.dtype


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s gradient: its fp32 ``main_grad`` if it keeps one, else ``.grad``."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Make ``grad`` ``p``'s gradient: ``.grad``, or ``main_grad`` when ``p`` keeps one or the dtypes differ (a
    16-bit slice of ZeRO's receives fp32 main gradients)."""
    if hasattr(p, "main_grad") or grad.dtype != p.dtype:
        p.main_grad = grad
    else:
        p.grad = grad


def drop_grad(p: torch.Tensor) -> None:
    """Forget ``p``'s gradient, main gradient included."""
    p.grad = None
    if hasattr(p, "main_grad"):
        p.main_grad = None


def zero_main_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """What ``zero_grad`` does to ``.grad``, done to the main gradients of ``params``."""
    for p in params:
        if getattr(p, "main_grad", None) is not None:
            if set_to_none:
                p.main_grad = None
            else:
                p.main_grad.zero_()


def copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """Copy every setting but the parameters from each group of ``source`` to the same group of ``target`` (how an
    optimizer that wraps another keeps the two alike, so that learning-rate schedulers work)."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k not in ("params", "param_names")})


# ------------------------------------------------------------------------------------------------ loss scaling
class LossScaler:
    """A loss scale S and its history (Micikevicius et al. 2018, §3.2). Each step's :meth:`update` records S and
    says whether to skip the step: one whose gradients overflowed. A ``dynamic`` scale then halves (down to
    ``min_scale``; overflowing there ends the run) and doubles after ``window`` clean steps in a row."""

    def __init__(self, scale: float, dynamic: bool = True, window: int = SCALE_WINDOW, min_scale: float = 1.0) -> None:
        self.scale, self.dynamic, self.window, self.min_scale = float(scale), dynamic, window, min_scale
        self.clean = 0
        self.scales: list[float] = []  # the scale of each step
        self.skipped: list[int] = []  # the steps skipped because their gradients overflowed

    def update(self, overflow: bool) -> bool:
        """Record this step's scale; True if the step must be skipped."""
        step = len(self.scales)
        self.scales.append(self.scale)
        if not overflow:
            self.clean += 1
            if self.dynamic and self.clean % self.window == 0:
                self.scale *= 2
            return False
        if self.dynamic and self.scale <= self.min_scale:
            raise FloatingPointError(
                f"fp16 gradients overflowed at step {step} even at the smallest loss scale {self.min_scale:g}: "
                f"train in bf16 (half='bf16')"
            )
        self.skipped.append(step)
        self.clean = 0
        if self.dynamic:
            self.scale = max(self.scale / 2, self.min_scale)
        return True


def scaler_for(train: TrainConfig) -> LossScaler | None:
    """The run's loss scaler (:func:`course_lib.model.config.loss_scaling`): dynamic from ``initial_scale``, fixed,
    or none."""
    kind = loss_scaling(train)
    if kind is None:
        return None
    return LossScaler(train.initial_scale) if kind == "dynamic" else LossScaler(kind, dynamic=False)


# ------------------------------------------------------------------------------------------------ the optimizer
class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Any ``torch.optim`` optimizer over fp32 copies of 16-bit parameters (Micikevicius et al. 2018, §3.1).

    ``MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` takes parameters of one 16-bit type
    and builds ``optimizer_class`` (``.optim``) over an fp32 copy of each. With ``master`` (default) the copies are
    the master weights, kept in :attr:`state` (so a memory ledger counts them as optimizer state, 4 bytes per
    parameter); each :meth:`step` hands them the gradients in fp32 (a main gradient as it is, a 16-bit one
    converted, either divided by the loss scale), steps ``.optim`` and rounds the masters into the parameters.
    Without ``master`` a copy exists only during the step: filled from the 16-bit weight, stepped, rounded back
    and freed; ``.optim``'s state (Adam's moments) is fp32 either way.

    ``scaler`` (a :class:`LossScaler`) scales the loss (:meth:`scale_loss`) and skips a step whose gradients hold
    inf or NaN; with ``sharded`` (ZeRO: each rank holds a slice of the gradients) the ranks of ``group`` agree on it
    by all-reducing one flag. fp16 without a scaler refuses such a step with an error. :meth:`autocast` is the
    context the forward runs in.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        master: bool = True,
        scaler: LossScaler | None = None,
        sharded: bool = False,
        group: Group = None,
        **defaults,
    ) -> None:
        super().__init__(params, defaults)
        dtypes = {p.dtype for group_ in self.param_groups for p in group_["params"]}
        if len(dtypes) != 1 or not dtypes <= {getattr(torch, name) for name in HALF_TYPES.values()}:
            raise ValueError(
                f"MixedPrecisionOptimizer takes parameters of one 16-bit type ({', '.join(HALF_TYPES)}), got "
                f"{sorted(map(str, dtypes))}: cast the model first (precision.prepare)"
            )
        self.half = dtypes.pop()
        self.master, self.scaler, self.sharded, self.group = master, scaler, sharded, group
        self.steps = 0
        inner = []
        for group_ in self.param_groups:
            hyper = {k: v for k, v in group_.items() if k not in ("params", "param_names")}
            inner.append({**hyper, "params": [self._fp32_copy(p) for p in group_["params"]]})
        self.optim = optimizer_class(inner, **defaults)
        self.defaults = self.optim.defaults
        copy_hyperparameters(self.optim.param_groups, self.param_groups)

    def _fp32_copy(self, p: torch.Tensor) -> nn.Parameter:
        copy = nn.Parameter(p.detach().float())
        if self.master:
            self.state[p]["master"] = copy
        else:
            resize_storage(copy, 0)
        return copy

    def _pairs(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [
            pair
            for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True)
            for pair in zip(outer["params"], inner["params"], strict=True)
        ]

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context a forward runs in: ``torch.autocast`` in this optimizer's 16-bit type."""
        return torch.autocast(device.type, dtype=self.half)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: multiplied by the loss scale, if there is one."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def _skip(self, grads: list[torch.Tensor]) -> bool:
        """Whether this step's gradients overflowed and the step is skipped (fp16 without a scaler: an error)."""
        if self.scaler is None and self.half != torch.float16:
            return False
        overflow = any(not bool(torch.isfinite(g).all()) for g in grads)
        if self.scaler is None:
            if overflow:
                raise FloatingPointError(
                    f"fp16 gradients overflowed at step {self.steps} with no loss scaler: use loss_scale='dynamic' or "
                    f"half='bf16'"
                )
            return False
        if self.sharded and dist.get_world_size(self.group) > 1:
            flag = torch.tensor([float(overflow)], device=self._pairs()[0][0].device)
            comm.all_reduce(flag, comm.ReduceOp.MAX, group=self.group)
            overflow = bool(flag.item())
        return self.scaler.update(overflow)

    @torch.no_grad()
    def step(self, closure=None):
        """Skip the step if the gradients overflowed; else give the fp32 copies the unscaled fp32 gradients, step
        ``.optim`` and round the copies into the 16-bit parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._pairs()
        grads = {id(p): g for p, _ in pairs if (g := grad_of(p)) is not None}
        skip = self._skip(list(grads.values()))
        self.steps += 1
        if skip:
            return loss
        unscale = 1.0 if self.scaler is None else 1.0 / self.scaler.scale
        copy_hyperparameters(self.param_groups, self.optim.param_groups)
        for p, copy in pairs:
            if not self.master:
                resize_storage(copy, copy.numel() * copy.element_size())
                copy.copy_(p)
            grad = grads.get(id(p))
            copy.grad = None if grad is None else grad.float() if unscale == 1.0 else grad.float() * unscale
        self.optim.step()
        for p, copy in pairs:
            p.copy_(copy)
            copy.grad = None
            if not self.master:
                resize_storage(copy, 0)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        zero_main_grads((p for group_ in self.param_groups for p in group_["params"]), set_to_none)


def optimizer_class(train: TrainConfig, sharded: bool = False, group: Group = None) -> type[torch.optim.Optimizer]:
    """The optimizer class a run builds over its parameters: AdamW, or under mixed precision AdamW inside a
    :class:`MixedPrecisionOptimizer` with the run's scaler (``sharded`` and ``group``: see there)."""
    if train.precision is None:
        return torch.optim.AdamW
    return functools.partial(
        MixedPrecisionOptimizer,
        optimizer_class=torch.optim.AdamW,
        master=train.precision != "no-master",
        scaler=scaler_for(train),
        sharded=sharded,
        group=group,
    )


def find(optimizer: torch.optim.Optimizer | None) -> MixedPrecisionOptimizer | None:
    """The :class:`MixedPrecisionOptimizer` among ``optimizer`` and those it wraps (``.optim``), if any."""
    while isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, MixedPrecisionOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optim", None)
    return None


def autocast(optimizer: torch.optim.Optimizer, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward runs in: autocast in the 16-bit type of a mixed-precision ``optimizer``, else none."""
    mixed = find(optimizer)
    return contextlib.nullcontext() if mixed is None else mixed.autocast(device)


def scaled(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The loss to call ``backward`` on: scaled by a mixed-precision ``optimizer``'s loss scaler, if any."""
    mixed = find(optimizer)
    return loss if mixed is None else mixed.scale_loss(loss)


def scaling_report(optimizer: torch.optim.Optimizer) -> dict:
    """A run's loss scale per step and the steps it skipped on overflow (empty without a scaler)."""
    mixed = find(optimizer)
    if mixed is None or mixed.scaler is None:
        return {}
    return {"loss_scale": list(mixed.scaler.scales), "skipped_steps": list(mixed.scaler.skipped)}


def summary(train: TrainConfig, rank: dict, losses: list[float], fp32_losses: list[float]) -> dict:
    """What a report says about a mixed-precision run: its convention and bytes per parameter, the loss scale and
    skipped steps of ``rank`` (a rank's report), and the losses beside the same run in fp32 with the tolerance."""
    c = convention(train)
    return {
        "convention": c.name,
        "half": train.half,
        "bytes_per_param": c.bytes() | {"master": c.master, "moments": c.moments},
        "fp32_losses": list(fp32_losses),
        "max_abs_loss_diff_vs_fp32": max(abs(a - b) for a, b in zip(losses, fp32_losses, strict=True)),
        "tolerance_vs_fp32": LOSS_TOLERANCE,
        **{key: rank[key] for key in ("loss_scale", "skipped_steps") if key in rank},
    }
