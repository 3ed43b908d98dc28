"""The memory ledger: what each rank holds, measured by category, each storage counted once (a tied or viewed
tensor counts once). The formulas that predict the same categories are :mod:`course_lib.model.formulas`.

* ``params``, ``grads``, ``optimizer`` (:data:`CATEGORIES`): the unique storages of the model's parameters, their
  ``.grad`` and the optimizer's state tensors.
* ``activations``: tensors that autograd saves for backward (``saved_tensors_hooks``), parameters excluded; the
  meter keeps the live total and its peak (a saved tensor stops counting when its graph frees it).
* ``peak``: the most bytes ever live at once, from a ``TorchDispatchMode`` that sees every storage an operator
  creates and a weak reference that sees it freed (on CPU there are no allocator statistics; on CUDA the
  allocator's own ``max_memory_allocated`` is reported beside it as ``cuda_peak``).
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib.ledgers.categories import CATEGORIES


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _unique_bytes(tensors) -> int:
    return sum(n for _, n in {_storage_key(t) for t in tensors if isinstance(t, torch.Tensor)})


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizer and those it wraps, each the ``.optim`` of the one before (a ZeRO optimizer's local optimizer,
    as in PyTorch's; a mixed-precision optimizer's fp32 one)."""
    chain = []
    while isinstance(optimizer, torch.optim.Optimizer):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optim", None)
    return chain


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
    optimizer's (a sharded scheme's optimizer holds shards, not the model's), less what an optimizer holds as its
    state: the fp32 master weights a mixed-precision optimizer keeps, which the optimizer it wraps updates, count as
    optimizer state."""
    params = list(model.parameters()) if model is not None else []
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module):
        params += list(inner.parameters())
    params += [p for o in _optimizers(optimizer) for group in o.param_groups for p in group["params"]]
    state = {_storage_key(t) for t in optimizer_tensors(optimizer)}
    return [p for p in params if _storage_key(p) not in state]


def _gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params``: ``.grad`` and, where a parameter keeps one, its fp32 ``main_grad``
    (Megatron-LM's; :func:`course_lib.model.precision.prepare`)."""
    return [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of the parameters, gradients and optimizer state, each storage counted once."""
    params = _held_params(model, optimizer)
    return {
        "params": _unique_bytes(params),
        "grads": _unique_bytes(_gradients(params)),
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
        self._params = params
        self._initial = params + _gradients(params) + optimizer_tensors(optimizer)
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
        # Storage objects, not addresses, and each parameter's as it is saved: a sharded scheme re-allocates a
        # parameter's storage in place, and FSDP's parameters view a gathered buffer in forward, their shard between.
        if t.untyped_storage()._cdata in {p.untyped_storage()._cdata for p in self._params}:
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
