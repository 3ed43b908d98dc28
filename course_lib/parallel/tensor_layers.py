"""Tensor parallelism's layers: Megatron's column- and row-parallel linears (Shoeybi et al. 2019, "Megatron-LM",
§3, eq. 3), with sequence parallelism's gathered input (Korthikanti et al. 2022, §4.2.2) and async TP's collective
matmuls (Wang et al. 2023, ASPLOS), and :func:`parallelize_module`, which puts them into a student's own model with
PyTorch's names (what Megatron's ``tensor_parallel/layers.py`` holds).

:class:`ColumnParallelLinear` holds this rank's output features and needs no communication forward (f before it);
:class:`RowParallelLinear` holds its input features and sums the ranks' partial products (g after it). Under SP the
column-parallel linear all-gathers its sequence-sharded input (:class:`GatherSequenceLinear`, keeping only the shard
for backward) and the row-parallel one reduce-scatters to sequence shards; with ``async_tp`` both run in ring steps,
each hidden behind a chunk's matmul (:class:`AllGatherLinear`, :class:`LinearReduceScatter`). The operators and
collectives they use are :mod:`course_lib.parallel.tensor_mappings`.

:func:`parallelize_module` replaces the ``nn.Linear`` layers a plan names by :class:`ColumnParallelLinear`
(``"colwise"``) and :class:`RowParallelLinear` (``"rowwise"``), each built by ``from_linear``;
:func:`full_parameters` gathers the parameters whole again, to compare with one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.ledgers.comm import Group
from course_lib.parallel.checks import require_divides
from course_lib.parallel.tensor_mappings import (
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    ReduceScatterToSequence,
    ScatterToTensorParallel,
    copy_to_tensor_parallel,
    direction_tags,
    gather_param,
    gather_sequence,
    reduce_scatter_sequence,
    remember_layer,
    ring_all_gather,
    ring_reduce_scatter,
    shard_of,
)


class GatherSequenceLinear(torch.autograd.Function):
    """Sequence-parallel f fused with a column-parallel linear: all-gather the sequence, multiply; keep only the
    shard for backward and all-gather it again there (Korthikanti et al. §4.2.2); reduce-scatter the input grad."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        remember_layer(ctx)
        ctx.save_for_backward(x_shard, weight)
        with direction_tags(ctx, "forward"):
            return F.linear(gather_sequence(x_shard, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        with direction_tags(ctx, "backward"):
            x = gather_sequence(x_shard, ctx.group)
            grad_x = reduce_scatter_sequence(grad @ weight, ctx.group)
        grad_w = grad.flatten(0, -2).T @ x.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class AllGatherLinear(torch.autograd.Function):
    """Async TP's column-parallel linear under SP (PyTorch's fused_all_gather_matmul): the sequence all-gather
    taken apart by :func:`ring_all_gather`, each shard multiplied while the next one travels; only the shard is kept
    for backward (Korthikanti et al. §4.2.2). Backward mirrors it: the input re-gathered the same way, each shard's
    weight-gradient product computed while the next arrives, and the input's gradient reduce-scattered by
    :func:`ring_reduce_scatter`, each chunk's product computed while the running sum travels."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        remember_layer(ctx)
        ctx.save_for_backward(x_shard, weight)
        out = [None] * dist.get_world_size(group)
        with direction_tags(ctx, "forward"):
            for c, x_c in ring_all_gather(x_shard, group):
                out[c] = F.linear(x_c, weight, bias)
        return torch.cat(out, 1)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        grads = grad.chunk(dist.get_world_size(ctx.group), 1)
        grad_w = torch.zeros_like(weight)
        with direction_tags(ctx, "backward"):
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
        remember_layer(ctx)
        ctx.save_for_backward(x, weight)
        chunks = x.chunk(dist.get_world_size(group), 1)
        with direction_tags(ctx, "forward"):
            return ring_reduce_scatter(lambda c: F.linear(chunks[c], weight), group)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        t = dist.get_world_size(ctx.group)
        chunks, grad_x, grad_w = x.chunk(t, 1), [None] * t, torch.zeros_like(weight)
        with direction_tags(ctx, "backward"):
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
        require_divides(t, what, linear.weight.shape[cls.split_dim])
        with torch.no_grad():
            weight = shard_of(linear.weight, cls.split_dim, r, t)
            bias = shard_of(linear.bias, 0, r, t) if cls.splits_bias and linear.bias is not None else linear.bias
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
        bias = None if self.bias is None else gather_param(self.bias, 0, self.group)
        return _linear(gather_param(self.weight, 0, self.group), bias, self)

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
        return _linear(gather_param(self.weight, 1, self.group), self.bias, self)

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
