"""The memory ledger: what each rank holds, measured by category, beside the formulas that predict it.

Measured (:class:`MemoryMeter`), deduplicated by storage so a tied or viewed tensor counts once:

* ``params``, ``grads``, ``optimizer``: the unique storages of the model's parameters, their ``.grad`` and the
  optimizer's state tensors.
* ``activations``: tensors that autograd saves for backward (``saved_tensors_hooks``), parameters excluded; the
  meter keeps the live total and its peak (a saved tensor stops counting when its graph frees it).
* ``peak``: the most bytes ever live at once, from a ``TorchDispatchMode`` that sees every storage an operator
  creates and a weak reference that sees it freed (on CPU there are no allocator statistics; on CUDA the
  allocator's own ``max_memory_allocated`` is reported beside it as ``cuda_peak``).

Predicted: bytes per parameter (fp32 Adam 4+4+8 = 16; mixed precision 2+2+12 = 16), divided by ZeRO stage over D
data-parallel ranks (Rajbhandari et al. 2020, §5.1-5.3) and by tensor and pipeline parallel degrees (routed experts
by expert and pipeline parallel degrees, ZeRO over the expert-data-parallel group), and activation bytes per
transformer layer (Korthikanti et al. 2022, §4, Table 2; split by context parallelism), plus the exact count for our
tiny GPT.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from course_lib.models import GPTConfig

BYTES_PER_PARAM = {
    # fp32 Adam: fp32 weights, fp32 grads, fp32 first and second moments.
    "fp32": {"params": 4, "grads": 4, "optimizer": 8},
    # The course's float64 runs (equivalence at 1e-10): every state twice as wide.
    "fp64": {"params": 8, "grads": 8, "optimizer": 16},
    # Mixed precision Adam (ZeRO §3.1): fp16/bf16 weights and grads; fp32 master weights, momentum and variance.
    "mixed": {"params": 2, "grads": 2, "optimizer": 12},
}
CATEGORIES = ("params", "grads", "optimizer")


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _unique_bytes(tensors) -> int:
    return sum(n for _, n in {_storage_key(t) for t in tensors if isinstance(t, torch.Tensor)})


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizer and the local one it wraps, if any (``.optim``: a ZeRO optimizer's, as in PyTorch's)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optim", None)
    return [optimizer, inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [
        v
        for o in _optimizers(optimizer)
        for state in o.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


def _held_params(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The model's parameters (a wrapper's and its ``.module``'s: FSDP's wrapper offers only its shards) and the
    optimizer's (a sharded scheme's optimizer holds shards, not the model's)."""
    params = list(model.parameters()) if model is not None else []
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        params += list(inner.parameters())
    return params + [p for o in _optimizers(optimizer) for group in o.param_groups for p in group["params"]]


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of the parameters, gradients and optimizer state, each storage counted once."""
    params = _held_params(model, optimizer)
    return {
        "params": _unique_bytes(params),
        "grads": _unique_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _unique_bytes(optimizer_tensors(optimizer)),
    }


_ACTIVE_METERS: list[MemoryMeter] = []


def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Grow or shrink ``tensor``'s storage in place, keeping every view of it (FSDP's way to free gathered
    parameters between uses); running meters are told, since a storage resize is no operator they can see."""
    storage = tensor.untyped_storage()
    storage.resize_(nbytes)
    for meter in _ACTIVE_METERS:
        meter._resized(storage)


@dataclass
class MemoryReport:
    """One rank's memory by category, in bytes."""

    params: int
    grads: int
    optimizer: int
    activations_peak: int
    peak: int
    cuda_peak: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class MemoryMeter(TorchDispatchMode):
    """Measure live storage bytes and saved activations while the ``with`` body runs.

    Storages that exist when the meter starts and belong to ``model``/``optimizer`` count as live from the start;
    everything an operator creates inside counts from its creation to its free.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.device = torch.device(device) if device is not None else None
        params = _held_params(model, optimizer)
        # Storage objects, not addresses: a sharded scheme re-allocates a parameter's storage in place.
        self._param_storages = {p.untyped_storage()._cdata for p in params}
        grads = [p.grad for p in params if p.grad is not None]
        self._initial = params + grads + optimizer_tensors(optimizer)
        self._live: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._saved: dict[tuple[int, int], int] = {}
        self.activations = 0
        self.activations_peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- live storages -------------------------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        self._track_storage(t.untyped_storage())

    def _track_storage(self, st) -> None:
        key = st._cdata
        if key in self._live:
            return
        self._live[key] = st.nbytes()
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._live.pop(key, 0)

    def _resized(self, storage) -> None:
        if storage._cdata not in self._live:
            self._track_storage(storage)
            return
        self.live += storage.nbytes() - self._live[storage._cdata]
        self._live[storage._cdata] = storage.nbytes()
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.untyped_storage()._cdata not in inputs:
                self._track(t)
        return out

    # -- saved activations ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.untyped_storage()._cdata in self._param_storages:
            return t
        key = _storage_key(t)
        if self._saved.get(key, 0) == 0:
            self.activations += key[1]
            self.activations_peak = max(self.activations_peak, self.activations)
        self._saved[key] = self._saved.get(key, 0) + 1
        return _SavedRef(t, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _SavedRef) else packed

    def _release(self, key: tuple[int, int]) -> None:
        self._saved[key] -= 1
        if self._saved[key] == 0:
            self.activations -= key[1]

    # -- context -------------------------------------------------------------------------------------------
    def __enter__(self):
        for t in self._initial:
            self._track(t)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hooks.__enter__()
        _ACTIVE_METERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        _ACTIVE_METERS.remove(self)
        self._hooks.__exit__(*exc)
        return result

    def report(self) -> MemoryReport:
        """Model-state bytes now, and the peaks seen while the meter ran."""
        state = (
            model_state_bytes(self.model, self.optimizer) if self.model is not None else dict.fromkeys(CATEGORIES, 0)
        )
        cuda_peak = None
        if self.device is not None and self.device.type == "cuda":
            cuda_peak = torch.cuda.max_memory_allocated(self.device)
        return MemoryReport(**state, activations_peak=self.activations_peak, peak=self.peak, cuda_peak=cuda_peak)


class _SavedRef:
    """What the graph keeps for a saved tensor; when the graph lets go of it, the activation stops counting."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: MemoryMeter) -> None:
        self.tensor = tensor
        weakref.finalize(self, meter._release, key)


# ------------------------------------------------------------------------------------------------ formulas
def model_state_formula(
    params: float,
    precision: str = "fp32",
    zero: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    expert_params: float = 0.0,
    ep: int = 1,
    cp: int = 1,
) -> dict[str, float]:
    """Predicted model-state bytes per device for ``params`` parameters, ``expert_params`` of them in routed experts.

    Dense parameters: tensor and pipeline parallelism split every tensor over ``tp * pp`` devices; ZeRO then
    divides, over the ``dp * cp`` ranks that hold the same shard, the optimizer state (stage 1, P_os), also the
    gradients (stage 2, P_os+g) and also the parameters (stage 3, P_os+g+p) — Rajbhandari et al. 2020, §5.1 and
    Figure 1. Context-parallel ranks hold the same weights and average their gradients, so ZeRO shards over them
    too (Megatron-core's distributed optimizer uses the data-parallel group *with* context parallelism).

    Routed experts (GShard, Lepikhin et al. 2021, §2.2; Switch Transformers, Fedus et al. 2022, §2.2): each of the
    ``ep`` expert-parallel ranks holds whole experts, ``1/ep`` of those of its stage's layers, not split by TP
    (expert tensor parallelism 1, as DeepSeek-V3, which has no TP at all, §3.2). The expert-parallel group is
    carved out of a stage's ``tp * cp * dp`` ranks, so each expert is replicated over the *expert-data-parallel*
    group of ``tp * cp * dp / ep`` ranks, and that is the group ZeRO shards expert states over (Megatron-core's
    MoE "parallel folding", Liu et al. 2025, §3; DeepSpeed-MoE's expert-data-parallel groups; DeepSeek-V3's 2,048
    GPUs as PP 16 x EP 64 leave 2 replicas of each expert for its ZeRO-1, §3.2).
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, not {precision!r}")
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
    dense = _sharded_states(params - expert_params, precision, zero, tp * pp, dp * cp)
    if not expert_params:
        return dense
    experts = _sharded_states(expert_params, precision, zero, ep * pp, tp * cp * dp // ep)
    return {cat: dense[cat] + experts[cat] for cat in CATEGORIES}


def _sharded_states(params: float, precision: str, zero: int, split: int, zero_group: int) -> dict[str, float]:
    """Bytes of ``params`` split ``split`` ways by model parallelism, then by the ZeRO stage over ``zero_group``."""
    per_rank = params / split
    sharded = {"optimizer": zero >= 1, "grads": zero >= 2, "params": zero >= 3}
    return {cat: BYTES_PER_PARAM[precision][cat] * per_rank / (zero_group if sharded[cat] else 1) for cat in CATEGORIES}


def adamw_state_bytes(element_size: int, trainable: int, frozen: int = 0, tensors: int = 0) -> dict[str, int]:
    """Model-state bytes of a rank that holds ``trainable`` and ``frozen`` elements whole, in ``tensors`` trainable
    tensors, trained by AdamW: the parameters, a gradient per trainable element, two moments per trainable element
    and a 4-byte step counter per trainable tensor (what the schemes' predictions start from)."""
    e = element_size
    return {"params": e * (trainable + frozen), "grads": e * trainable, "optimizer": 2 * e * trainable + 4 * tensors}


RECOMPUTE = ("none", "selective", "full")


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
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    Assumes 16-bit activations, 1-byte dropout masks and attention that materialises the (heads, s, s) scores:
    sbh(34 + 5as/h) with no parallelism; with tensor parallelism over t ranks only the parts inside the split
    linears shrink, sbh(10 + 24/t + 5as/(ht)); sequence parallelism splits the rest too, sbh/t (34 + 5as/h).
    Selective recompute drops the 5as/h attention term; full recompute keeps only the layer input, 2sbh.

    ``ffn``: the MLP width a token's activations pass through, 4h by default. Of the 34, the MLP's two 4h-wide
    intermediates are 16 (4 ffn / h; §4.1), split by TP; a mixture-of-experts layer's token passes through its
    top-k routed experts and the shared ones, (top_k + shared) x expert FFN wide. (Not counted: the k copies of
    its input the dispatch makes, and the router's logits, of order 2k and 2E/h sbh.)

    Context parallelism over ``cp`` ranks gives each rank s/cp of the sequence, its queries against all the keys:
    everything divided by cp (Liu et al. 2023, ring attention, §3; Llama 3, Grattafiori et al. 2024, §3.3.2).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2 * s * b * h / cp
    scores = 0 if recompute == "selective" else 5 * a * s / h
    mlp = 16 if ffn is None else 4 * ffn / h
    if sp:
        return s * b * h / t * (18 + mlp + scores) / cp
    return s * b * h * (10 + (8 + mlp) / t + scores / t) / cp


def tiny_gpt_activation_bytes(
    cfg: GPTConfig, micro_batch: int, element_size: int = 4, tp: int | None = None, sp: bool = False
) -> dict[str, int]:
    """Exact saved-activation bytes of one forward of the tiny GPT (no dropout): the single-device
    :class:`course_lib.models.TinyGPT`, or with ``tp`` one rank of its tensor-parallel version (and ``sp``).

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
    """
    s, b, h, a, v, e = cfg.seq, micro_batch, cfg.d_model, cfg.heads, cfg.vocab, element_size
    if tp is None:
        per_layer = e * (16 * s * b * h + a * s * s * b + 4 * s * b) + s * s
        outside = 2 * 8 * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v + 1)
    elif sp:
        per_layer = e * (16 * s * b * h + a * s * s * b + 4 * s * b) // tp + s * s
        outside = 2 * (8 + 1) * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v) // tp
    else:
        per_layer = e * (4 * s * b * h + 12 * s * b * h // tp + a * s * s * b // tp + 4 * s * b) + s * s
        outside = 2 * (8 + 1) * b * s + e * (2 * s * b * h + 2 * s * b + s * b * v // tp)
    return {
        "per_layer": per_layer,
        "layers": cfg.layers * per_layer,
        "outside_layers": outside,
        "total": cfg.layers * per_layer + outside,
    }


def memory_formula(
    params: float,
    precision: str = "fp32",
    zero: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    layers: int | None = None,
    seq: int | None = None,
    micro_batch: int = 1,
    hidden: int | None = None,
    heads: int | None = None,
    sp: bool = False,
    recompute: str = "none",
    expert_params: float = 0.0,
    ep: int = 1,
    cp: int = 1,
    ffn: float | None = None,
) -> dict[str, float]:
    """Bytes per device: model states (:func:`model_state_formula`: dense and expert parameters, ``ep``, ``cp``)
    and, when the dims are given, activations (:func:`activation_bytes_per_layer`, ``ffn`` wide, split ``cp``
    ways).

    Activations: with a 1F1B pipeline the first stage keeps ``pp`` microbatches of its ``layers/pp`` layers in
    flight, which is one microbatch of all ``layers`` (Korthikanti et al. 2022, §4.2.3).
    """
    out = model_state_formula(params, precision, zero, dp, tp, pp, expert_params, ep, cp)
    dims = (layers, seq, hidden, heads)
    if any(d is not None for d in dims) and any(d is None for d in dims):
        raise ValueError("activations need all of layers, seq, hidden and heads (or none of them)")
    if heads is not None and heads % tp:
        raise ValueError(f"tensor parallelism splits attention by heads: tp {tp} does not divide {heads} heads")
    if seq is not None and cp > 1 and seq % (2 * cp):
        raise ValueError(
            f"context parallelism cuts the sequence into 2 x cp = {2 * cp} chunks (rank r holds chunks r and "
            f"2cp-1-r, for causal balance): seq {seq} is not a multiple of {2 * cp}; change seq or cp"
        )
    out["activations"] = (
        layers * activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp, sp, recompute, ffn, cp)
        if layers
        else 0.0
    )
    out["total"] = sum(out[k] for k in (*CATEGORIES, "activations"))
    return out


def params_from_dims(layers: int, hidden: int, vocab: int, seq: int = 0, ffn_mult: int = 4) -> int:
    """Parameters of a GPT-style model: (4 + 2m) h^2 per layer (attention 4h^2, MLP 2m h^2 for an m-times-wider
    MLP), biases and LayerNorms (m + 6) h per layer (no bias on the qkv projection), token embeddings V h shared
    with the output head, learned positions s h, and a final LayerNorm 2h."""
    per_layer = (4 + 2 * ffn_mult) * hidden * hidden + (6 + ffn_mult) * hidden
    return layers * per_layer + vocab * hidden + seq * hidden + 2 * hidden
