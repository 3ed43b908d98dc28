"""Tensor parallelism's communication: the autograd operators that join the pieces of a split layer, and the ring
collectives of async TP (what Megatron's ``tensor_parallel/mappings.py`` and picotron's ``tp_communications.py`` hold).

* Megatron's f and g (Shoeybi et al. 2019, "Megatron-LM", §3, Fig. 3): f (:func:`copy_to_tensor_parallel`) is the
  identity forward and an all-reduce of the gradient backward, where a replicated activation enters a split region;
  g (:func:`reduce_from_tensor_parallel`) all-reduces the ranks' partial sums forward, the identity backward, where
  the region ends. :class:`GatherFromTensorParallel` and :class:`ScatterToTensorParallel` make a split last
  dimension whole and back.
* Sequence parallelism's g (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §4.2.2): a reduce-scatter to sequence shards forward, an all-gather backward
  (:class:`ReduceScatterToSequence`, over :func:`reduce_scatter_sequence` and :func:`gather_sequence`).
* Async TP's ring collectives (Wang et al. 2023, "Overlap Communication with Dependent Computation via
  Decomposition in Large Deep Learning Models", ASPLOS): an all-gather and a reduce-scatter taken apart into t-1
  ``isend``/``irecv`` steps, so that a matmul runs between a step's issue and its wait (:func:`ring_all_gather`,
  :func:`ring_reduce_scatter`).

Every collective goes through :mod:`course_lib.ledgers.comm`, tagged with the layer it belongs to and the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group


def direction_tags(ctx: FunctionCtx, direction: str) -> AbstractContextManager[None]:
    """Tags for a collective inside an autograd Function: the layer it belongs to and the pass."""
    return trace.tags(direction=direction, **({"layer": ctx.layer} if ctx.layer is not None else {}))


def remember_layer(ctx: FunctionCtx) -> None:
    """Note on ``ctx`` the layer the forward runs in, for the tags of the collectives its backward makes."""
    ctx.layer = trace.current_tags().get("layer")


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """A copy of ``x`` all-reduced over ``group`` (no autograd)."""
    out = x.contiguous().clone()
    comm.all_reduce(out, op=op, group=group)
    return out


def all_gather_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (one all-gather; no autograd)."""
    t, dim = dist.get_world_size(group), dim % x.dim()
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x.detach().contiguous(), group=group)  # autograd is handled by the callers' Functions
    return out.unflatten(0, (t, x.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h): all-gather along the sequence."""
    return all_gather_along(x, 1, group)


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s, h) partial sums on each rank -> (b, s/t, h) of the sum: reduce-scatter along the sequence."""
    t = dist.get_world_size(group)
    chunks = x.detach().unflatten(1, (t, -1)).transpose(0, 1).contiguous()  # (t, b, s/t, h)
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter(out, chunks.flatten(0, 1), group=group)
    return out


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        remember_layer(ctx)
        return x

    @staticmethod
    def backward(ctx, grad):
        with direction_tags(ctx, "backward"):
            return all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        remember_layer(ctx)
        with direction_tags(ctx, "forward"):
            return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's f (§3, eq. 3 and Fig. 3): ``x`` unchanged forward, its gradient all-reduced over ``group``
    backward. Apply it where a replicated activation enters a region split over the group (before the column-parallel
    matmuls): each rank's backward sees only its share of the gradient, and f sums the shares."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's g (§3, Fig. 3), f's conjugate: the ranks' partial sums all-reduced forward, the gradient unchanged
    backward. Apply it where a split region ends (after the row-parallel matmul, before the bias)."""
    return ReduceFromTensorParallel.apply(x, group)


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dimension (a column-parallel output made whole) forward; keep this rank's slice of the
    gradient backward (Megatron's gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        remember_layer(ctx)
        with direction_tags(ctx, "forward"):
            return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return shard_of(grad, -1, dist.get_rank(ctx.group), dist.get_world_size(ctx.group)), None


class ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension (a whole input split for a row-parallel linear) forward;
    all-gather the gradient backward (Megatron's scatter_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        remember_layer(ctx)
        return shard_of(x, -1, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        with direction_tags(ctx, "backward"):
            return all_gather_along(grad, -1, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter to sequence shards forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        remember_layer(ctx)
        with direction_tags(ctx, "forward"):
            return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        with direction_tags(ctx, "backward"):
            return gather_sequence(grad, ctx.group), None


def ring_peer(group: Group, offset: int) -> int:
    """The global rank ``offset`` places after this one on the ring of ``group``."""
    t = dist.get_world_size(group)
    peer = (dist.get_rank(group) + offset) % t
    return dist.get_global_rank(group, peer) if group is not None else peer


def _pass_on(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, list[comm.Handle]]:
    """One ring step, posted: the send of ``x`` to the next rank and the receive of the previous rank's into the
    returned buffer, to be read once the handles are waited for."""
    x = x.contiguous()
    received = torch.empty_like(x)
    return received, [comm.isend(x, ring_peer(group, 1), group), comm.irecv(received, ring_peer(group, -1), group)]


def _wait(handles: list[comm.Handle]) -> None:
    for handle in handles:
        handle.wait()


def ring_all_gather(shard: torch.Tensor, group: Group) -> Iterator[tuple[int, torch.Tensor]]:
    """An all-gather of the ranks' shards taken apart into t-1 ring steps, for a collective matmul (Wang et al.
    2023): yields (c, shard c) for every rank c's shard, this rank's own first, then the previous rank's, and
    so on around the ring. Before each yield the step that brings the next shard is posted, and it is waited for
    only after the caller's loop body has run: the compute on the shard in hand hides the transfer of the next.
    Each rank sends t-1 messages of one shard, the (t-1)/t of the gathered bytes a ring all-gather sends."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    held = shard.contiguous()
    for k in range(t):
        received, handles = _pass_on(held, group) if k < t - 1 else (held, [])
        yield (r - k) % t, held
        _wait(handles)
        held = received


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group: Group) -> torch.Tensor:
    """The sum over the ranks of ``partial(r)``, on rank r: a reduce-scatter taken apart into t-1 ring steps
    (Wang et al. 2023). Each rank starts with its contribution to the previous rank's chunk; at every step it
    posts the running sum to the next rank, computes its own ``partial`` of the chunk whose sum it will receive
    while that sum travels, and adds the two. After t-1 steps the sum of chunk r has visited every rank and ends on
    rank r. Each rank sends t-1 messages of one chunk, the (t-1)/t of the input's bytes a ring reduce-scatter
    sends."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    running = partial((r - 1) % t)
    for k in range(1, t):
        received, handles = _pass_on(running, group)
        mine = partial((r - 1 - k) % t)
        _wait(handles)
        running = received + mine
    return running


def shard_of(w: torch.Tensor, dim: int, r: int, t: int) -> torch.Tensor:
    """Rank ``r`` of ``t``'s part of ``w`` along ``dim``, a copy."""
    return w.chunk(t, dim)[r].clone()


def gather_param(p: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """A parameter whole from its shards along ``dim`` (tagged as the run's final gathers)."""
    with trace.tags(phase="final"):
        return all_gather_along(p, dim, group)
