"""A rank's share of the training state, as ``torch.distributed.checkpoint`` (DCP) saves and loads it: which part
of each one-device tensor this rank holds, whatever the scheme's layout, and DCP's planners that read and write
those parts in place (:mod:`course_lib.runtime.checkpoint` saves, loads and plans checkpoints with them).

**What is saved.** Each trainable parameter and its AdamW state (``exp_avg``, ``exp_avg_sq``: parameter-shaped;
``step``: a scalar) under the parameter's fully qualified name on one device (``model.blocks.0.mlp.fc1.weight``,
``optim.blocks.0.mlp.fc1.weight.exp_avg``), in its one-device shape. A rank offers the pieces of it that it holds,
each a box of the one-device tensor at its offsets, one per dimension (:class:`Pieces`; DCP's chunk model). Two
descriptions compose into them. Where the local tensor sits in the whole one (:func:`holdings`, :class:`Held`, each
:class:`Box` of it placed at its offsets there): the whole tensor (DP's replicas, ZeRO's parameters, a pipeline
stage's; the stages name their parameters as one device does), or a tensor-parallel shard: one block of rows or of
columns, or for the fused qkv three blocks of rows (its q, k and v heads;
:func:`course_lib.parallel.tensor.placement`). And which elements of the local tensor the rank keeps: all of them,
or a 1-D range of the flattened tensor where it holds a slice of a flat buffer (ZeRO-1/2's optimizer state, ZeRO-3's
parameters and state, a 3D grid's ZeRO-1 state over its TP shards: :class:`course_lib.parallel.zero.FlatShard`),
which is a partial first row, whole rows and a partial last row of boxes (:func:`_range_boxes`). Each piece is a
view into the rank's own tensor, so a load writes in place. DCP writes every piece once (identical replicas are
deduplicated by its planner; the pipeline's tied embedding is offered by the first stage only, since the last
stage's copy may be cut differently by ZeRO) and records in its ``.metadata`` which chunk of which tensor is where;
at load, each rank asks for the pieces its own layout needs and DCP reads the overlapping chunks ("DCP reshards at
load time": PyTorch's DCP docs, "Distributed Checkpoint - torch.distributed.checkpoint"). The checkpoint therefore
knows nothing of buckets, units, padding, stages, TP degree or world size: ZeRO-3 on 4 ranks loads into ZeRO-3 on 2
or DP on 1, SP on 4 into TP on 2, a 3D grid into DP. Why not DTensor: a flat-buffer slice is an arbitrary 1-D range
of a parameter and the fused qkv's shard three blocks, not one of DTensor's even ``Shard`` placements; ShardedTensor
could say it but is deprecated and needs a collective per tensor. So :class:`Pieces` implements DCP's
``_Checkpointable`` protocol (``__create_write_items__``, ``__create_chunk_list__``, as DTensor does) and the
planners' documented extension points (``lookup_object``, ``lookup_tensor``) return its pieces.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's parameter-shaped state; "step" is its scalar


class Box(NamedTuple):
    """Where part of a rank's local tensor sits in the one-device tensor: the box of ``size`` at offsets ``local``
    in the local tensor is the box at offsets ``at`` in the whole one."""

    local: tuple[int, ...]
    at: tuple[int, ...]
    size: tuple[int, ...]


class Held(NamedTuple):
    """A trainable parameter as a rank holds it: its one-device ``name`` and ``shape``, the local tensor ``param``
    and the ``boxes`` that place it in the whole. ``save`` False: a replica whose equal copy another rank saves
    (the pipeline's tied embedding on the last stage); it is still loaded."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    save: bool = True


def whole(shape: Sequence[int]) -> tuple[Box, ...]:
    """The one box of a tensor held whole."""
    zeros = (0,) * len(shape)
    return (Box(zeros, zeros, tuple(shape)),)


def holdings(model: nn.Module) -> list[Held]:
    """The trainable parameters ``model`` holds: as its ``checkpoint_holdings()`` describes them (tensor-parallel
    shards, pipeline stages), else whole under their names in the module the course's wrappers wrap."""
    if hasattr(model, "checkpoint_holdings"):
        return model.checkpoint_holdings()
    return [
        Held(n, p, tuple(p.shape), whole(p.shape)) for n, p in _wrapped(model).named_parameters() if p.requires_grad
    ]


class Pieces:
    """This rank's pieces of one tensor of ``shape``: ``{offsets: view}``, each view a box of the tensor at its
    offsets (one per dimension). A DCP ``_Checkpointable``: each piece is a chunk of the global tensor."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape, self.pieces = torch.Size(shape), {}

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, _obj: object) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(piece), size=self.shape
                ),
            )
            for (offsets, piece), chunk in zip(self.pieces.items(), self.__create_chunk_list__(), strict=True)
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(o), piece.shape) for o, piece in self.pieces.items()]

    def piece(self, index: Any) -> torch.Tensor:
        """The piece at ``index.offset`` (a DCP ``MetadataIndex``)."""
        return self.pieces[tuple(index.offset)]


def _wrapped(model: nn.Module) -> nn.Module:
    """The student's or the tiny GPT's module inside the course's wrappers (``DataParallel``, FSDP), whose names
    the checkpoint uses; the model itself otherwise."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and hasattr(model, "finish_gradient_synchronization") else model


def _range_boxes(lo: int, hi: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements lo .. hi-1 (row-major) of a tensor of ``shape`` as few boxes (offsets, sizes): a partial
    first row, the whole rows between, a partial last row, each split the same way one dimension down."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)

    def in_row(r: int, a: int, b: int) -> list:
        return [((r, *o), (1, *s)) for o, s in _range_boxes(a, b, shape[1:])]

    if r0 == r1:
        return in_row(r0, c0, c1)
    boxes = in_row(r0, c0, inner) if c0 else []
    r0 += bool(c0)
    if r1 > r0:
        boxes.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    return boxes + (in_row(r1, 0, c1) if c1 else [])


def _pieces(held: Held, lo: int, flat: torch.Tensor) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """The elements lo .. lo + flat.numel() - 1 of ``held.param`` (row-major), kept in the contiguous 1-D ``flat``
    (a view of the parameter, of its optimizer state, or of a flat-buffer slice), as pieces of the one-device
    tensor: (offsets there, a view into ``flat`` of that box)."""
    shape = tuple(held.param.shape)
    strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    for offsets, sizes in _range_boxes(lo, lo + flat.numel(), shape):
        for box in held.boxes:
            first = [max(o, b) for o, b in zip(offsets, box.local, strict=True)]
            ends = [min(o + s, b + n) for o, s, b, n in zip(offsets, sizes, box.local, box.size, strict=True)]
            if any(a >= e for a, e in zip(first, ends, strict=True)):
                continue
            at = sum(a * s for a, s in zip(first, strides, strict=True)) - lo  # the box's first element in flat
            view = flat.as_strided(
                [e - a for a, e in zip(first, ends, strict=True)], strides, flat.storage_offset() + at
            )
            yield tuple(a - b + g for a, b, g in zip(first, box.local, box.at, strict=True)), view


def _segments(held: dict[int, Held], shards: list | None) -> Iterator[tuple[Held, int, torch.Tensor, int, int]]:
    """Where this rank keeps each held parameter's elements (or their optimizer state): (held, the first element's
    index in the parameter, the holder tensor, its index in the holder, how many). Without ``shards`` a parameter is
    its own holder; with them (``[(FlatShard, local slice)]``), each parameter's part in each of the rank's slices."""
    if shards is None:
        for h in held.values():
            yield h, 0, h.param, 0, h.param.numel()
        return
    for flat, local in shards:
        start = 0
        for p in flat.params:
            lo, hi = max(flat.lo, start), min(flat.hi, start + p.numel())
            if lo < hi and id(p) in held:
                yield held[id(p)], lo - start, local, lo - flat.lo, hi - lo
            start += p.numel()


def _adam_state(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, step_dtype: torch.dtype | None) -> dict:
    """AdamW's state of ``tensor``; created as AdamW's first step would (zeros, step 0) when ``step_dtype`` is given
    and there is none yet, so that a fresh optimizer can be loaded into."""
    state = optimizer.state[tensor]
    if not state and step_dtype is not None:
        state |= {"step": torch.zeros((), dtype=step_dtype)} | {k: torch.zeros_like(tensor) for k in STATE_KEYS}
    if set(state) != {"step", *STATE_KEYS}:
        raise RuntimeError(
            f"a checkpoint holds AdamW's state (step, exp_avg, exp_avg_sq), and this optimizer's state has "
            f"{sorted(state)}: use AdamW without amsgrad, or step it once before saving"
        )
    return state


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step_dtype: torch.dtype | None = None, saving: bool = False
):
    """The state dict DCP saves or loads for ``model`` and its ``optimizer``: ``{key: Pieces}`` of the
    parameter-shaped tensors, and ``{key: (state dict, ...)}`` of the AdamW step counters (one scalar per
    parameter; a ZeRO slice's counter serves every parameter it meets). Pass ``step_dtype`` to load: missing AdamW
    state is then created; ``saving``: leave out the replicas another rank saves (:class:`Held`).

    The layout is read from the model and the course's wrappers: :func:`holdings` places each local tensor in the
    one-device one (whole, or a tensor-parallel shard); a model with ``local_shards()`` (FSDP) holds slices of its
    parameters, an optimizer with ``local_shards()`` (ZeRO-1/2, a 3D grid's ZeRO-1) slices of their state in its
    inner ``.optim``."""
    held = {id(h.param): h for h in holdings(model) if h.save or not saving}
    tensors: dict[str, Pieces] = {}
    steps: dict[str, list[dict]] = {}

    def offer(key: str, h: Held, lo: int, flat: torch.Tensor) -> None:
        tensors.setdefault(key, Pieces(h.shape)).pieces.update(_pieces(h, lo, flat))

    model_shards = model.local_shards() if hasattr(model, "local_shards") else None
    for h, lo, holder, start, n in _segments(held, model_shards):
        offer(f"model.{h.name}", h, lo, holder.detach().view(-1)[start : start + n])
    opt_shards = optimizer.local_shards() if hasattr(optimizer, "local_shards") else model_shards
    inner = getattr(optimizer, "optim", optimizer)
    for h, lo, holder, start, n in _segments(held, opt_shards):
        state = _adam_state(inner, holder, step_dtype)
        for k in STATE_KEYS:
            offer(f"optim.{h.name}.{k}", h, lo, state[k].view(-1)[start : start + n])
        steps.setdefault(f"optim.{h.name}.step", []).append(state)
    return tensors, steps


def dcp_planners():
    """DCP's default planners, looking up :class:`Pieces` through their documented extension points."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            if not isinstance(obj, Pieces):
                return super().lookup_object(index)
            # a contiguous copy: torch.save of a view would write its whole buffer
            return obj.piece(index).clone(memory_format=torch.contiguous_format)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
            # DefaultLoadPlanner's set-up (_init_state_dict, torch 2.13) turns values that are not tensors into None;
            # ours hold no meta tensors to initialize, so put them back.
            pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
            super().set_up_planner(state_dict, metadata, is_coordinator)
            state_dict.update(pieces)
            self.state_dict.update(pieces)

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.piece(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)

    return SavePlanner(), LoadPlanner()
