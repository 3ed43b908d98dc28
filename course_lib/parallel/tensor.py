"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3) and sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4.2.2) for the tiny GPT.

Megatron splits each block between the t ranks of a tensor-parallel group: the MLP's first linear by output
columns and its second by input rows, so GELU runs on each rank's columns with no communication in between; the
attention by heads (q, k and v column-parallel, the output projection row-parallel). Two conjugate operators join
the pieces: f is the identity forward and an all-reduce backward (before a column-parallel linear), g an all-reduce
forward and the identity backward (after a row-parallel linear). Per layer: 2 all-reduces forward, 2 backward.

Sequence parallelism shards, along the sequence, what TP leaves replicated (LayerNorms, residuals): g becomes a
reduce-scatter to sequence shards, f an all-gather from them, with the same total bytes. The column-parallel linear
keeps its *sharded* input for backward and all-gathers it again there (§4.2.2), so every activation is divided by
t. LayerNorm and output-bias gradients then cover only a rank's shard and are all-reduced over the group after
backward. The embedding and the tied output head are split by vocabulary rows; the cross-entropy works on vocab
shards with three small all-reduces (max, target logit, sum of exponentials), never gathering the logits.

Async TP (``async_tp``, with SP) hides those all-gathers and reduce-scatters behind the matmuls beside them, as the
collective matmul of Wang et al. ("Overlap Communication with Dependent Computation via Decomposition in Large Deep
Learning Models", ASPLOS 2023) and PyTorch's async TP (``fused_all_gather_matmul``, ``fused_matmul_reduce_scatter``)
do: a linear works token by token, so each sequence chunk's product is a matmul of its own. The all-gather before a
column-parallel linear becomes t-1 ring steps, the chunk in hand multiplied while the next one travels
(:func:`ring_all_gather`); the reduce-scatter after a row-parallel linear passes running sums around the ring, each
rank computing its part of the next chunk while the sum of that chunk travels to it (:func:`ring_reduce_scatter`).
Backward does the same with the mirrored collectives. Each step is an ``isend``/``irecv`` pair issued before the
matmul and waited for after it, so the modeled clock (:func:`course_lib.hardware.replay`) overlaps them; a rank
sends t-1 messages of S/t, the ring collective's (t-1)/t of S. The embedding's reduce-scatter (no matmul beside it)
and its backward all-gather stay collectives.

The same layers split a student's own model, with PyTorch's names: :func:`parallelize_module` replaces the
``nn.Linear`` layers a plan names by :class:`ColumnParallelLinear` (``"colwise"``) and :class:`RowParallelLinear`
(``"rowwise"``), each built by ``from_linear``; :func:`copy_to_tensor_parallel` and
:func:`reduce_from_tensor_parallel` are f and g for hand-written regions; :func:`full_parameters` gathers the
parameters whole again, to compare with one process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import comm, launch, trace
from course_lib.checkpoint import Block, Held, whole
from course_lib.comm import Group, ring_factor
from course_lib.memory import adamw_state_bytes, tiny_gpt_activation_bytes
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, count_params, make_optimizer
from course_lib.parallel.data import DataParallelStrategy, all_reduce_grads, train_loop
from course_lib.parallel.interface import Option, Scheme


def _direction(ctx, direction: str):
    """Tags for a collective inside an autograd Function: the layer it belongs to and the pass."""
    return trace.tags(direction=direction, **({"layer": ctx.layer} if ctx.layer is not None else {}))


def _remember_layer(ctx) -> None:
    ctx.layer = trace.current_tags().get("layer")


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
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
        _remember_layer(ctx)
        return x

    @staticmethod
    def backward(ctx, grad):
        with _direction(ctx, "backward"):
            return all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        _remember_layer(ctx)
        with _direction(ctx, "forward"):
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
        _remember_layer(ctx)
        with _direction(ctx, "forward"):
            return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _shard(grad, -1, dist.get_rank(ctx.group), dist.get_world_size(ctx.group)), None


class ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension (a whole input split for a row-parallel linear) forward;
    all-gather the gradient backward (Megatron's scatter_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _remember_layer(ctx)
        return _shard(x, -1, dist.get_rank(group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad):
        with _direction(ctx, "backward"):
            return all_gather_along(grad, -1, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter to sequence shards forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        _remember_layer(ctx)
        with _direction(ctx, "forward"):
            return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        with _direction(ctx, "backward"):
            return gather_sequence(grad, ctx.group), None


class GatherSequenceLinear(torch.autograd.Function):
    """Sequence-parallel f fused with a column-parallel linear: all-gather the sequence, multiply; keep only the
    shard for backward and all-gather it again there (Korthikanti et al. §4.2.2); reduce-scatter the input grad."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        _remember_layer(ctx)
        ctx.save_for_backward(x_shard, weight)
        with _direction(ctx, "forward"):
            return F.linear(gather_sequence(x_shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        with _direction(ctx, "backward"):
            x = gather_sequence(x_shard, ctx.group)
            grad_x = reduce_scatter_sequence(grad @ weight, ctx.group)
        grad_w = grad.flatten(0, -2).T @ x.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


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


class AllGatherLinear(torch.autograd.Function):
    """Async TP's column-parallel linear under SP (PyTorch's fused_all_gather_matmul): the sequence all-gather
    taken apart by :func:`ring_all_gather`, each shard multiplied while the next one travels; only the shard is kept
    for backward (Korthikanti et al. §4.2.2). Backward mirrors it: the input re-gathered the same way, each shard's
    weight-gradient product computed while the next arrives, and the input's gradient reduce-scattered by
    :func:`ring_reduce_scatter`, each chunk's product computed while the running sum travels."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        _remember_layer(ctx)
        ctx.save_for_backward(x_shard, weight)
        out = [None] * dist.get_world_size(group)
        with _direction(ctx, "forward"):
            for c, x_c in ring_all_gather(x_shard, group):
                out[c] = F.linear(x_c, weight, bias)
        return torch.cat(out, 1)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        grads = grad.chunk(dist.get_world_size(ctx.group), 1)
        grad_w = torch.zeros_like(weight)
        with _direction(ctx, "backward"):
            for c, x_c in ring_all_gather(x_shard, ctx.group):
                grad_w = torch.addmm(grad_w, grads[c].flatten(0, -2).T, x_c.flatten(0, -2))
            grad_x = ring_reduce_scatter(lambda c: grads[c] @ weight, ctx.group)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class LinearReduceScatter(torch.autograd.Function):
    """Async TP's row-parallel product under SP (PyTorch's fused_matmul_reduce_scatter): the partial sums
    reduce-scattered to sequence shards by :func:`ring_reduce_scatter`, each chunk's product computed while the
    running sum travels. Backward, the output gradient's all-gather is taken apart by :func:`ring_all_gather`, each
    shard's input- and weight-gradient products computed while the next shard arrives."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        _remember_layer(ctx)
        ctx.save_for_backward(x, weight)
        chunks = x.chunk(dist.get_world_size(group), 1)
        with _direction(ctx, "forward"):
            return ring_reduce_scatter(lambda c: F.linear(chunks[c], weight), group)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        t = dist.get_world_size(ctx.group)
        chunks, grad_x, grad_w = x.chunk(t, 1), [None] * t, torch.zeros_like(weight)
        with _direction(ctx, "backward"):
            for c, g in ring_all_gather(grad_shard, ctx.group):
                grad_x[c] = g @ weight
                grad_w = torch.addmm(grad_w, g.flatten(0, -2).T, chunks[c].flatten(0, -2))
        return torch.cat(grad_x, 1), grad_w, None


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, sp: bool, async_tp: bool = False
) -> torch.Tensor:
    """x W_r^T + b_r for this rank's output columns; x arrives whole (through f) or as sequence shards (SP), which
    ``async_tp`` gathers in ring steps hidden behind the multiplication."""
    if sp:
        return (AllGatherLinear if async_tp else GatherSequenceLinear).apply(x, weight, bias, group)
    return F.linear(copy_to_tensor_parallel(x, group), weight, bias)


def row_parallel_product(x: torch.Tensor, weight: torch.Tensor, group: Group, sp: bool, async_tp: bool) -> torch.Tensor:
    """The sum over the ranks of x_r W_r^T: all-reduced (g), or under SP reduce-scattered to sequence shards, which
    ``async_tp`` does in ring steps hidden behind the multiplication."""
    if sp and async_tp:
        return LinearReduceScatter.apply(x, weight, group)
    reduce = ReduceScatterToSequence if sp else ReduceFromTensorParallel
    return reduce.apply(F.linear(x, weight), group)


def check_async_tp(sp: bool, async_tp: bool) -> None:
    """Async TP takes apart sequence parallelism's all-gathers and reduce-scatters; plain TP has none."""
    if async_tp and not sp:
        raise ValueError(
            "async TP overlaps sequence parallelism's all-gathers and reduce-scatters with the matmuls beside them, "
            "and plain TP has none (its all-reduces): use sequence parallelism (scheme sp, or sp=True) or drop async_tp"
        )


class _ShardedLinear(nn.Module):
    """What both Megatron linears share: this rank's ``weight`` shard and ``bias`` (its shard, or whole), the group,
    ``sp`` and ``async_tp``; and cutting that shard from a whole ``nn.Linear`` along ``split_dim`` of its weight."""

    split_dim: int  # 0: output features (rows), 1: input features (columns)
    splits_bias: bool

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group = None,
        sp: bool = False,
        async_tp: bool = False,
    ):
        super().__init__()
        check_async_tp(sp, async_tp)
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self.group, self.sp, self.async_tp = group, sp, async_tp

    @classmethod
    def _cut(cls, linear: nn.Linear, group: Group, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's part of ``linear``'s weight and bias; refuses a degree that does not divide ``what``."""
        t, r = dist.get_world_size(group), dist.get_rank(group)
        _require_divides(t, what, linear.weight.shape[cls.split_dim])
        with torch.no_grad():
            weight = _shard(linear.weight, cls.split_dim, r, t)
            bias = _shard(linear.bias, 0, r, t) if cls.splits_bias and linear.bias is not None else linear.bias
        return weight, bias


class ColumnParallelLinear(_ShardedLinear):
    """A linear layer holding this rank's output features, rows of the weight and entries of the bias (§3, eq. 3):
    y_r = f(x) W_r^T + b_r, no communication forward. ``gather_output`` all-gathers the ranks' y_r into the whole y
    (a drop-in ``nn.Linear``); without it the output stays split, for a row-parallel layer or local heads. ``sp``: the
    input arrives as sequence shards (Korthikanti et al. §4.2.2), for the tiny GPT; ``async_tp`` gathers them in
    ring steps, each hidden behind the product of the shard in hand (:class:`AllGatherLinear`)."""

    split_dim, splits_bias = 0, True

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group = None,
        sp: bool = False,
        gather_output: bool = False,
        async_tp: bool = False,
    ) -> None:
        super().__init__(weight, bias, group, sp, async_tp)
        self.gather_output = gather_output

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: Group = None,
        gather_output: bool = False,
        sp: bool = False,
        async_tp: bool = False,
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear``: weight rows and bias entries r*out/t .. (r+1)*out/t of rank r of t.

        ``linear`` must be the same on every rank of ``group`` (built from one seed, or after
        :func:`course_lib.parallel.data.broadcast_from_first`); frozen parameters stay frozen.
        """
        weight, bias = cls._cut(linear, group, "out_features of a column-parallel linear")
        return _frozen_like(cls(weight, bias, group, sp, gather_output, async_tp), linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, self.group, self.sp, self.async_tp)
        return GatherFromTensorParallel.apply(y, self.group) if self.gather_output else y

    def unshard(self) -> nn.Linear:
        """The whole layer, its rows all-gathered (every rank of the group must call it)."""
        bias = None if self.bias is None else _gather_param(self.bias, 0, self.group)
        return _linear(_gather_param(self.weight, 0, self.group), bias, self)

    def extra_repr(self) -> str:
        out, inputs = self.weight.shape
        return f"in_features={inputs}, out_features={out} of this rank, gather_output={self.gather_output}"


class RowParallelLinear(_ShardedLinear):
    """A linear layer holding this rank's input features, columns of the weight (§3, eq. 3): y = g(sum over ranks of
    x_r W_r^T) + b, g an all-reduce (or under ``sp`` a reduce-scatter to sequence shards), the bias whole and added
    once, after the sum. The input x_r is this rank's features, as a column-parallel layer leaves them; with
    ``input_is_parallel=False`` the layer takes the whole x and keeps its own slice. ``async_tp`` (with ``sp``)
    reduce-scatters in ring steps, each hidden behind the product of the next chunk (:class:`LinearReduceScatter`)."""

    split_dim, splits_bias = 1, False

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group = None,
        sp: bool = False,
        input_is_parallel: bool = True,
        async_tp: bool = False,
    ) -> None:
        super().__init__(weight, bias, group, sp, async_tp)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: Group = None,
        input_is_parallel: bool = True,
        sp: bool = False,
        async_tp: bool = False,
    ) -> RowParallelLinear:
        """This rank's shard of ``linear``: weight columns r*in/t .. (r+1)*in/t of rank r of t, the bias whole.

        ``linear`` must be the same on every rank of ``group`` (built from one seed, or after
        :func:`course_lib.parallel.data.broadcast_from_first`); frozen parameters stay frozen.
        """
        weight, bias = cls._cut(linear, group, "in_features of a row-parallel linear")
        return _frozen_like(cls(weight, bias, group, sp, input_is_parallel, async_tp), linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = ScatterToTensorParallel.apply(x, self.group)
        y = row_parallel_product(x, self.weight, self.group, self.sp, self.async_tp)
        return y if self.bias is None else y + self.bias

    def unshard(self) -> nn.Linear:
        """The whole layer, its columns all-gathered (every rank of the group must call it)."""
        return _linear(_gather_param(self.weight, 1, self.group), self.bias, self)

    def extra_repr(self) -> str:
        out, inputs = self.weight.shape
        return f"in_features={inputs} of this rank, out_features={out}, input_is_parallel={self.input_is_parallel}"


def _frozen_like(layer: nn.Module, linear: nn.Linear) -> nn.Module:
    """``layer`` with each parameter's requires_grad as ``linear``'s parameter of the same name."""
    for name, p in layer.named_parameters():
        p.requires_grad_(getattr(linear, name).requires_grad)
    return layer


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, like: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` and ``bias`` (no random init), frozen where ``like`` is."""
    out, inputs = weight.shape
    linear = nn.utils.skip_init(nn.Linear, inputs, out, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return _frozen_like(linear, like)


@dataclass(frozen=True)
class ColwiseParallel:
    """A plan entry for :func:`parallelize_module` (PyTorch's ``ColwiseParallel``; the string ``"colwise"``): split
    the ``nn.Linear`` by output features, :class:`ColumnParallelLinear`."""

    gather_output: bool = False

    def parallelize(self, linear: nn.Linear, group: Group) -> ColumnParallelLinear:
        return ColumnParallelLinear.from_linear(linear, group, self.gather_output)


@dataclass(frozen=True)
class RowwiseParallel:
    """A plan entry for :func:`parallelize_module` (PyTorch's ``RowwiseParallel``; the string ``"rowwise"``): split
    the ``nn.Linear`` by input features, :class:`RowParallelLinear`."""

    input_is_parallel: bool = True

    def parallelize(self, linear: nn.Linear, group: Group) -> RowParallelLinear:
        return RowParallelLinear.from_linear(linear, group, self.input_is_parallel)


Style = ColwiseParallel | RowwiseParallel
STYLES: dict[str, Style] = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}


def parallelize_module(module: nn.Module, plan: Mapping[str, str | Style], group: Group = None) -> nn.Module:
    """Split the ``nn.Linear`` layers that ``plan`` names over ``group``, in place, and return ``module``: PyTorch's
    ``torch.distributed.tensor.parallel.parallelize_module`` with Megatron's layers (§3).

    ``plan`` maps dotted submodule names (``"fc1"``, ``"layers.0.attn.q"``) to ``"colwise"``, ``"rowwise"``,
    :class:`ColwiseParallel` or :class:`RowwiseParallel`. ``module`` must be the same on every rank (build it from one
    seed, or call :func:`course_lib.parallel.data.broadcast_from_first` first; PyTorch's scatters rank 0's weights
    instead); what the plan leaves alone stays replicated and trains as on one process. Each colwise layer
    all-reduces its input's gradient in backward (f), each rowwise layer its output in forward (g). The forward must
    accept the local shapes: a colwise output holds out_features / t features, so attention with colwise q, k, v runs
    heads / t heads on each rank (infer the count: ``q.unflatten(-1, (-1, head_dim))``). Every entry is checked
    before any layer is replaced.
    """
    modules = dict(module.named_modules())
    linears = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
    styles = {name: _style(name, style) for name, style in plan.items()}
    for name in styles:
        target = modules.get(name) if name else None
        if target is None:
            raise ValueError(
                f"plan entry {name!r} names no submodule of {type(module).__name__}; its nn.Linear layers are {linears}"
            )
        if not isinstance(target, nn.Linear):
            inside = [n for n in linears if n.startswith(f"{name}.")]
            raise ValueError(
                f"plan entry {name!r} is a {type(target).__name__}, not an nn.Linear: only linear layers split by "
                f"columns or rows. Name the nn.Linear layers inside it instead: {inside}"
            )
    _check_rowwise_inputs(styles, {name: modules[name] for name in styles})
    layers = {}
    for name, style in styles.items():
        try:
            layers[name] = style.parallelize(modules[name], group)
        except ValueError as error:
            raise ValueError(f"plan entry {name!r}: {error}") from None
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, layer)
    return module


def _style(name: str, style: object) -> Style:
    if isinstance(style, Style):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    raise ValueError(
        f"plan entry {name!r} has style {style!r}; use 'colwise' or 'rowwise' (or course_lib's ColwiseParallel() "
        "and RowwiseParallel(), not PyTorch's)"
    )


def _check_rowwise_inputs(styles: dict[str, Style], linears: dict[str, nn.Linear]) -> None:
    """A rowwise layer that expects its input split must find a colwise layer in the plan whose (split) output has as
    many features as it has inputs: a cheap check that it follows one."""
    split = {
        linears[name].out_features
        for name, style in styles.items()
        if isinstance(style, ColwiseParallel) and not style.gather_output
    }
    for name, style in styles.items():
        if isinstance(style, RowwiseParallel) and style.input_is_parallel and linears[name].in_features not in split:
            raise ValueError(
                f"plan entry {name!r} is rowwise, so its input must arrive split by features, as the output of a "
                f"colwise layer does, but no colwise layer in the plan has {linears[name].in_features} output "
                f"features. Make the layer that feeds it colwise, or use RowwiseParallel(input_is_parallel=False) "
                f"to have it split a whole input."
            )


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole, under the names :meth:`nn.Module.named_parameters` gives on one process:
    the tensor-parallel layers all-gather their shards (every rank of their group must call it)."""
    parallel = (ColumnParallelLinear, RowParallelLinear)
    whole = {prefix: m.unshard() for prefix, m in module.named_modules() if isinstance(m, parallel)}
    full = {}
    for name, p in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        full[name] = (getattr(whole[owner], leaf) if owner in whole else p).detach().cpu().clone()
    return full


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary rows [lo, hi) (Megatron's _VocabParallelCrossEntropy)."""

    @staticmethod
    def forward(ctx, logits, targets, lo, group):
        ctx.layer = None
        with _direction(ctx, "forward"):
            shifted = logits - all_reduce(logits.max(-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
            mine = (targets >= lo) & (targets < lo + logits.shape[-1])
            local = (targets - lo).clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
            target_logit = all_reduce(shifted.gather(-1, local).squeeze(-1) * mine, group)
            exp = shifted.exp()
            sum_exp = all_reduce(exp.sum(-1), group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.scatter_add(-1, local, -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * (grad / mine.numel()), None, None, None


class TensorParallelGPT(TinyGPT):
    """The tiny GPT with every block split over a tensor-parallel group (and, with ``sp``, its sequence; with
    ``async_tp`` too, SP's all-gathers and reduce-scatters beside the linears taken apart into ring steps that overlap
    the matmuls).

    It is built from the same seed as the reference and then split, so rank r holds exactly its shard of the
    reference's weights under the reference's parameter names.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        group: Group = None,
        sp: bool = False,
        async_tp: bool = False,
    ) -> None:
        super().__init__(cfg, seed, dtype)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        check_tensor_parallel(cfg, t, sp)
        check_async_tp(sp, async_tp)
        if cfg.experts and t > 1:
            raise ValueError("the course splits no mixture of experts over tensor-parallel ranks: use a TP group of 1")
        self.group, self.sp, self.async_tp, self.tp, self.tp_rank = group, sp, async_tp, t, r
        h, v = cfg.d_model, cfg.vocab
        self.vocab_lo = r * v // t
        with torch.no_grad():
            self.tok_emb.weight = nn.Parameter(self.tok_emb.weight[self.vocab_lo : self.vocab_lo + v // t].clone())
            for block in self.blocks:
                attn, mlp = block.attn, block.mlp
                heads = _shard(attn.qkv.weight.unflatten(0, (3, h)), 1, r, t).flatten(0, 1)  # [q_r; k_r; v_r]
                attn.qkv = ColumnParallelLinear(heads, None, group, sp, async_tp=async_tp)
                attn.proj = RowParallelLinear.from_linear(attn.proj, group, sp=sp, async_tp=async_tp)
                attn.heads = cfg.heads // t
                if not cfg.experts:  # an MoE stays whole (a TP group of one rank)
                    mlp.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group, sp=sp, async_tp=async_tp)
                    mlp.fc2 = RowParallelLinear.from_linear(mlp.fc2, group, sp=sp, async_tp=async_tp)

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """The position embeddings of this rank's tokens: all of them, or its sequence shard under SP."""
        pos = self.positions(tokens)
        return pos.chunk(self.tp, 0)[self.tp_rank] if self.sp else pos

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup summed over the group (all-reduce, or reduce-scatter to sequence shards)."""
        mine = (tokens >= self.vocab_lo) & (tokens < self.vocab_lo + self.tok_emb.weight.shape[0])
        local = F.embedding((tokens - self.vocab_lo) * mine, self.tok_emb.weight) * mine.unsqueeze(-1)
        with trace.tags(layer="embedding"):
            reduce = ReduceScatterToSequence if self.sp else ReduceFromTensorParallel
            return reduce.apply(local, self.group) + self._positions(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, (batch, seq, vocab / t)."""
        with trace.tags(layer="head"):  # the tied output head: a column-parallel linear over the vocabulary
            return column_parallel_linear(self.ln_f(x), self.tok_emb.weight, None, self.group, self.sp, self.async_tp)

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        with trace.tags(layer="loss"):
            return VocabParallelCrossEntropy.apply(logits, targets, self.vocab_lo, self.group)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        return sequence_parallel_params(self)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under the reference's names (all-gathers the shards; every rank must call it)."""
        return {name: unshard(name, p, self.group, self.cfg.d_model) for name, p in self.named_parameters()}

    def checkpoint_holdings(self) -> list[Held]:
        """This rank's shards for :mod:`course_lib.checkpoint`, each placed in its one-device parameter."""
        return [
            Held(name, p, *placement(name, p.shape, self.tp_rank, self.tp))
            for name, p in self.named_parameters()
            if p.requires_grad
        ]


def unshard(name: str, p: torch.Tensor, group: Group, hidden: int) -> torch.Tensor:
    """The whole parameter ``name`` from this rank's shard ``p`` (all-gathers over the tensor-parallel group)."""
    split, t = sharding(name), dist.get_world_size(group)
    if split == "rows":
        full = _gather_param(p, 0, group)
    elif split == "columns":
        full = _gather_param(p, 1, group)
    elif split == "heads":  # [q_0; k_0; v_0; q_1; ...] -> (t, 3, h/t, h) -> (3, t, h/t, h) -> (3h, h)
        full = _gather_param(p, 0, group).unflatten(0, (t, 3, hidden // t)).transpose(0, 1).flatten(0, 2)
    else:
        full = p.detach()
    return full.detach().cpu().clone()


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters applied to sequence shards (LayerNorms, row-parallel biases, and a trained position
    embedding, each rank adding the rows of its shard): under SP each rank's gradient covers its shard only, so the
    tensor-parallel group must sum them."""
    rows = [m.bias for m in module.modules() if isinstance(m, RowParallelLinear)]
    norms = [p for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    positions = [p for name, p in module.named_parameters() if name.endswith("pos_emb") and p.requires_grad]
    return rows + norms + positions


def sharding(name: str) -> str | None:
    """How a parameter of the tiny GPT is split over a tensor-parallel group: by ``rows`` (vocabulary, MLP
    columns), ``columns`` (inputs of row-parallel linears), ``heads`` (the fused qkv), or not at all (None)."""
    if name == "tok_emb.weight" or name.endswith(("fc1.weight", "fc1.bias")):
        return "rows"
    if name.endswith(("proj.weight", "fc2.weight")):
        return "columns"
    return "heads" if name.endswith("qkv.weight") else None


def collectives_per_step(
    cfg: GPTConfig,
    batch: int,
    element_size: int,
    sp: bool,
    layers: range | None = None,
    first: bool = True,
    last: bool = True,
    async_tp: bool = False,
) -> list[tuple]:
    """Every collective a tensor-parallel rank makes in one step of one batch, as (layer, direction, op, tensor
    bytes); by default the whole model, or a pipeline stage's ``layers`` with the embedding if ``first`` and the
    head and loss if ``last``.

    Per layer: TP, all-reduces of the (b, s, h) activations, 2 forward (after each row-parallel linear) and 2
    backward (before each column-parallel linear). SP: each becomes an all-gather or reduce-scatter of the same
    size (S = e b s h, the whole sequence), plus, in backward, an all-gather per column-parallel linear to rebuild
    the input it kept sharded. Outside: the embedding, the tied head, the cross-entropy's three all-reduces of
    e b s bytes, and under SP one all-reduce of the sequence-parallel parameters' gradients.

    Full recomputation (``cfg.recompute``) runs each layer's forward again in backward, with its collectives, up to
    the last tensor the layer saves: PyTorch's checkpoint stops there (``set_checkpoint_early_stop``), so the
    MLP's closing all-reduce (or reduce-scatter) is not repeated; the recomputed ones are tagged ``recompute``.
    Under ``async_tp`` that closing reduce-scatter is one autograd Function with the matmul before it, which saves
    its input only once it has run, so it is repeated too.
    """
    S, small = element_size * batch * cfg.seq * cfg.d_model, element_size * batch * cfg.seq
    layers = range(cfg.layers) if layers is None else layers
    if sp:
        layer = [("forward", "all_gather"), ("forward", "reduce_scatter")] * 2 + [
            ("backward", "all_gather"),
            ("backward", "reduce_scatter"),
            ("backward", "all_gather"),
        ] * 2
        ends = [
            ("embedding", "forward", "reduce_scatter"),
            ("embedding", "backward", "all_gather"),
            ("head", "forward", "all_gather"),
            ("head", "backward", "all_gather"),
            ("head", "backward", "reduce_scatter"),
        ]
    else:
        layer = [("forward", "all_reduce"), ("backward", "all_reduce")] * 2
        ends = [("embedding", "forward", "all_reduce"), ("head", "backward", "all_reduce")]
    if cfg.recompute == "full":
        layer += [("recompute", op) for d, op in layer if d == "forward"][: None if async_tp else -1]
    out = [(i, d, op, S) for i in layers for d, op in layer]
    out += [
        (where, d, op, S) for where, d, op in ends if (where == "embedding" and first) or (where == "head" and last)
    ]
    out += [("loss", "forward", "all_reduce", small)] * 3 * last
    return out


def async_tp_messages(collectives: list[tuple], t: int) -> list[tuple]:
    """:func:`collectives_per_step`'s list as async TP makes it on ``t`` ranks: each all-gather and reduce-scatter
    beside a linear (all but the embedding's) becomes t-1 ring steps, each a send and a receive of one chunk, S/t
    bytes (:func:`ring_all_gather`, :func:`ring_reduce_scatter`); a rank sends (t-1) S/t, what the ring collective
    sends."""
    out = []
    for where, direction, op, nbytes in collectives:
        if where != "embedding" and op in ("all_gather", "reduce_scatter"):
            out += [(where, direction, message, nbytes // t) for _ in range(t - 1) for message in ("send", "recv")]
        else:
            out.append((where, direction, op, nbytes))
    return out


def sequence_parallel_grad_bytes(
    cfg: GPTConfig, element_size: int, layers: int, last: bool = True, first: bool = True
) -> int:
    """Bytes of the gradients SP sums over the group after backward: per layer two LayerNorms (4h) and two
    row-parallel biases (2h), the final LayerNorm (2h) on the stage that holds it, and a trained position embedding
    (s x h) on the stage that embeds."""
    positions = cfg.seq * cfg.d_model * (first and not cfg.frozen_pos)
    return element_size * (6 * cfg.d_model * layers + 2 * cfg.d_model * last + positions)


def _shard(w: torch.Tensor, dim: int, r: int, t: int) -> torch.Tensor:
    return w.chunk(t, dim)[r].clone()


def _gather_param(p: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """A parameter whole from its shards along ``dim`` (tagged as the run's final gathers)."""
    with trace.tags(phase="final"):
        return all_gather_along(p, dim, group)


def check_tensor_parallel(cfg: GPTConfig, tp: int, sp: bool) -> None:
    """Refuse a degree that does not divide the heads, the MLP width, the vocabulary or (with SP) the sequence."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be at least 1, not {tp}")
    sizes = {"heads": cfg.heads, "MLP width (ffn_mult x d_model)": cfg.ffn_mult * cfg.d_model, "vocab": cfg.vocab}
    if sp:
        sizes["sequence length (sequence parallel)"] = cfg.seq
    for what, size in sizes.items():
        _require_divides(tp, what, size)


def _require_divides(tp: int, what: str, size: int) -> None:
    if size % tp:
        raise ValueError(
            f"tensor-parallel degree {tp} does not divide the {what} = {size}: each rank must get an equal share. "
            f"Use a degree that divides {size}."
        )


class TensorParallelStrategy(DataParallelStrategy):
    """What TP adds to plain training: under SP, sum the sequence-parallel parameters' gradients."""

    def __init__(self, model: TensorParallelGPT, train: TrainConfig) -> None:
        super().__init__(model, make_optimizer(model.parameters(), train))
        self.coords = {"tp": model.tp_rank}

    def finish_gradients(self) -> None:
        if self.model.sp:
            with trace.tags(phase="sp_grad_sync"):
                all_reduce_grads(self.model.sequence_parallel_params(), self.model.group)


def train_tensor_parallel(
    cfg: GPTConfig, train: TrainConfig, sp: bool = False, async_tp: bool = False, measure_memory: bool = True
) -> dict:
    """Rank function: the whole world is one tensor-parallel group; every rank sees the whole batch."""
    model = TensorParallelGPT(cfg, train.seed, train.torch_dtype, sp=sp, async_tp=async_tp).to(launch.rank_device())
    strategy = TensorParallelStrategy(model, train)
    report = train_loop(strategy, cfg, train, measure_memory=measure_memory, data_rank=0, data_size=1)
    return {**report, "params": model.full_params()}


# ------------------------------------------------------------------------------------------------ checks, formulas
def shard_shape(name: str, param: torch.Tensor, t: int) -> tuple[int, ...]:
    """The shape of a tensor-parallel rank's shard of the one-device parameter ``name``."""
    shape = list(param.shape)
    split = sharding(name)
    if split in ("rows", "heads"):
        shape[0] //= t
    elif split == "columns":
        shape[1] //= t
    return tuple(shape)


def placement(name: str, shard: tuple[int, ...], r: int, t: int) -> tuple[tuple[int, ...], tuple[Block, ...]]:
    """The one-device shape of parameter ``name`` and where rank ``r`` of ``t``'s shard of shape ``shard`` sits in
    it, as :class:`course_lib.checkpoint.Block` boxes: one for ``rows`` (a block of rows) and ``columns`` (a block
    of columns), three for ``heads`` (the fused qkv's [q_r; k_r; v_r]: rows r h/t .. (r+1) h/t of each of q, k
    and v), the whole tensor when it is not split."""
    shard = tuple(shard)
    split = sharding(name)
    if split is None or t == 1:
        return shard, whole(shard)
    zeros = (0,) * len(shard)
    if split == "heads":
        third = shard[0] // 3  # h/t rows of each of q, k, v
        blocks = tuple(Block((j * third, 0), (j * third * t + r * third, 0), (third, shard[1])) for j in range(3))
        return (3 * third * t, shard[1]), blocks
    dim = 0 if split == "rows" else 1
    shape = tuple(n * t if d == dim else n for d, n in enumerate(shard))
    at = tuple(r * n if d == dim else 0 for d, n in enumerate(shard))
    return shape, (Block(zeros, at, shard),)


def validate(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    check_tensor_parallel(cfg, world_size, o["sp"])


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """A rank holds 1/t of every split matrix (and of the vocabulary), LayerNorms and row-parallel biases whole,
    with AdamW's states for them, and the activations of the whole batch as
    :func:`course_lib.memory.tiny_gpt_activation_bytes` counts them for one rank of t (and under SP)."""
    model, e = TinyGPT(cfg), train.torch_dtype.itemsize
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    held = sum(math.prod(shard_shape(name, p, world_size)) for name, p in trainable)
    frozen = count_params(model, trainable_only=False) - count_params(model)
    row = adamw_state_bytes(e, held, frozen, len(trainable))
    row["activations"] = tiny_gpt_activation_bytes(cfg, train.batch, e, tp=world_size, sp=o["sp"])["total"]
    return [dict(row) for _ in range(world_size)]


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Every collective of :func:`collectives_per_step` in ring accounting (with ``async_tp``, as ring steps:
    :func:`async_tp_messages`), and under SP the all-reduce of the sequence-parallel gradients
    (:func:`sequence_parallel_grad_bytes`)."""
    e, t, row = train.torch_dtype.itemsize, world_size, {}
    step = collectives_per_step(cfg, train.batch, e, o["sp"], async_tp=o["async_tp"])
    for *_, op, nbytes in async_tp_messages(step, t) if o["async_tp"] else step:
        row[op] = row.get(op, 0.0) + ring_factor(op, t) * nbytes
    if o["sp"]:
        row["all_reduce"] += ring_factor("all_reduce", t) * sequence_parallel_grad_bytes(cfg, e, cfg.layers)
    return [dict(row) for _ in range(world_size)]


ASYNC_TP = Option("async_tp", "async TP: the all-gathers and reduce-scatters as ring steps hidden behind the matmuls")


def _scheme(name: str, summary: str, sp: bool, options: tuple[Option, ...] = ()) -> Scheme:
    train = functools.partial(train_tensor_parallel, sp=sp)
    return Scheme(name, summary, train, validate, predict_memory, predict_comm, options, axes=("tp",), checkpoint=True)


SCHEMES = (
    _scheme("tp", "Megatron tensor parallel: split every layer's matmuls", sp=False),
    _scheme("sp", "tensor + sequence parallel: shard the rest along the sequence", sp=True, options=(ASYNC_TP,)),
)
