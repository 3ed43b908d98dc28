"""Fully sharded data parallelism around any module: ZeRO stage 3, P_os+g+p (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", §5.3), as PyTorch's FSDP builds it (Zhao et al.
2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", §3).

A policy picks the submodules that become *units*; the root unit holds every other trainable parameter. Each unit's
parameters are laid end to end in one flat buffer padded to a multiple of the n ranks, and rank r keeps slice r
alone: the shard, an ``nn.Parameter`` that the optimizer updates (FSDP's full sharding). Between a forward and
the end of its backward, the module's own parameters are views of their own shapes into a full buffer whose storage
exists only while the unit is gathered; otherwise each is its piece of this rank's shard, with its piece of the
averaged gradient as ``.grad`` (FSDP's original parameters). Parameters of modules the user names may instead stay
whole on every rank, their gradients all-reduced as DataParallel's:

* before a unit's forward its full parameters are all-gathered (and the next unit's gather started, forward
  prefetching); after it they are freed (``reshard_after_forward``);
* before the unit's backward they are gathered again (and the unit that ran before it prefetched: backward
  prefetching); once all of its gradients exist they are reduce-scattered and averaged, and the full parameters
  freed once more.

Bytes per rank and step: (n-1)/n x 3 x Psi x b, 1.5x plain data parallelism (without resharding after forward,
2 x: as much as DP). The course's ZeRO-3 scheme (:func:`train_fsdp`) is this wrapper around the tiny GPT, one unit
per block.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.ledgers.memory import resize_storage
from course_lib.model import precision
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import ModelFactory, TinyGPT, build_model, count_params, optimizer_settings
from course_lib.parallel import catalog
from course_lib.parallel.data import (
    DataParallelStrategy,
    EndOfBackward,
    ReadyGroups,
    broadcast_from_first,
    no_gradient_error,
    on_every_rank,
    split_like,
    train_loop,
)
from course_lib.parallel.zero import FlatShard
from course_lib.runtime import launch
from course_lib.runtime.checkpoint_state import Held, whole

Policy = Callable[[nn.Module], list[nn.Module]]
ROOT = "root"
REPLICATED = "replicated"


def children_with_params(module: nn.Module) -> list[nn.Module]:
    """The default policy: every direct child that holds a parameter becomes a unit."""
    return [child for child in module.children() if next(child.parameters(), None) is not None]


def replicated_params(module: nn.Module, replicate: Policy | None) -> list[nn.Parameter]:
    """The trainable parameters registered in (or under) the modules ``replicate`` picks, in ``module``'s order: kept
    whole on every rank, wherever else they are registered (a replica is whole at every use)."""
    picked = {id(p) for m in (replicate(module) if replicate else []) for p in m.parameters()}
    return [p for p in module.parameters() if p.requires_grad and id(p) in picked]


def shard_plan(
    module: nn.Module, policy: Policy, replicated: list[nn.Parameter] = ()
) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The units ``policy`` makes of ``module``, the root first: each one's name, module and trainable parameters
    (less the ``replicated`` ones).

    A parameter belongs to the innermost unit around the place it is registered. One registered in two units, or in a
    unit and outside every unit (an embedding tied to an output head), belongs to the root, which stays gathered
    for the whole forward and is gathered first in backward, so every use finds it whole. Units left without a
    trainable parameter are dropped; frozen parameters belong to none (they stay whole)."""
    chosen = {id(m): m for m in policy(module)}
    names = {id(module): ROOT}
    owners: dict[int, set[int]] = defaultdict(set)

    def visit(m: nn.Module, path: str, owner: int) -> None:
        if id(m) in chosen:
            owner = id(m)
            names.setdefault(owner, path)
        for p in m.parameters(recurse=False):
            owners[id(p)].add(owner)
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name, owner)

    visit(module, "", id(module))
    groups: dict[int, list[nn.Parameter]] = {owner: [] for owner in (id(module), *chosen)}
    kept = {id(p) for p in replicated}
    for p in module.parameters():
        if p.requires_grad and id(p) not in kept:
            shared = len(owners[id(p)]) > 1
            groups[id(module) if shared else next(iter(owners[id(p)]))].append(p)
    modules = {**chosen, id(module): module}
    return [(names[owner], modules[owner], params) for owner, params in groups.items() if params]


class ShardedUnit:
    """One FSDP unit: a shard that persists, and a full buffer that exists only between :meth:`gather` and
    :meth:`free`, in ``compute_dtype`` if one is given. ``replicated``: the shard is the whole unit on every rank
    (gathered by a copy, its gradients all-reduced), DataParallel's way for parameters kept whole.

    The module's parameters take one of two forms (Zhao et al. 2023, §3, FSDP's original parameters as views into
    the flat parameter): during forward and backward (:meth:`use_full`) each is a view of its own shape into the full
    buffer; otherwise (:meth:`use_shard`) each is the 1-D piece of its flattened values that this rank's shard holds
    (empty where another rank holds them all), with that piece of the shard's gradient as its ``.grad``. ``flat``
    lays out stand-ins of the parameters' own shapes on the meta device, so the layout never depends on the form."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[nn.Parameter],
        group: Group,
        compute_dtype: torch.dtype | None,
        replicated: bool = False,
    ) -> None:
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"unit {name!r} mixes dtypes {sorted({str(p.dtype) for p in params})}; use one dtype")
        self.name, self.module, self.params, self.group, self.replicated = name, module, params, group, replicated
        n, rank = (1, 0) if replicated else (dist.get_world_size(group), dist.get_rank(group))
        self.flat = FlatShard([torch.empty_like(p, device="meta") for p in params], n, rank)
        full = self.flat.flatten([p.detach() for p in params])
        self.shard = nn.Parameter(full[self.flat.lo : self.flat.hi].clone())
        self.full = full.to(compute_dtype or full.dtype)
        self.views = split_like(self.full, self.flat.params)  # made while the storage exists; they outlive its frees
        self._nbytes = self.full.untyped_storage().nbytes()
        self._pending: comm.Handle | None = None
        self.forward_started = 0.0
        self.free()
        self.use_shard()

    def use_full(self) -> None:
        """Each parameter a view of its own shape into the full buffer (freed or not), without ``.grad``."""
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = None
            p.data = view

    def use_shard(self) -> None:
        """Each parameter its piece of this rank's shard (in its own shape when replicated), its ``.grad`` that piece
        of the shard's gradient."""
        start = 0
        for p, like in zip(self.params, self.flat.params, strict=True):
            lo, hi = (min(max(i - self.flat.lo, 0), self.flat.shard_numel) for i in (start, start + like.numel()))
            shape = like.shape if self.replicated else (hi - lo,)
            p.grad = None
            p.data = self.shard.detach()[lo:hi].view(shape)
            if self.shard.grad is not None:
                p.grad = self.shard.grad[lo:hi].view(shape)
            start += like.numel()

    def gather(self) -> None:
        """Start the all-gather of the full parameters (a copy when replicated), unless they are here or on their
        way."""
        if self.gathered or self._pending is not None:
            return
        resize_storage(self.full, self._nbytes)
        if self.replicated:
            self.full.copy_(self.shard.detach())
            self.gathered = True
            return
        with trace.tags(unit=self.name):
            shard = self.shard.detach().to(self.full.dtype)
            self._pending = comm.all_gather(self.full, shard, group=self.group, async_op=True)

    def ensure_gathered(self) -> None:
        """Block until the full parameters are here (gathering now if nobody started it)."""
        self.gather()
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self.gathered = True

    def free(self) -> None:
        """Drop the full parameters (after any all-gather still writing into them)."""
        if self._pending is not None:
            self.ensure_gathered()
        resize_storage(self.full, 0)
        self.gathered = False

    def reduce(self) -> tuple[torch.Tensor, comm.Handle]:
        """Start summing the unit's gradients (zero for a parameter that got none) into this rank's slice (all of
        them, all-reduced, when replicated); the full gradients and parameters are freed. Returns the slice being
        written and the collective's handle."""
        grads = [self.full.new_zeros(p.shape) if p.grad is None else p.grad for p in self.params]
        flat = self.flat.flatten(grads).div_(dist.get_world_size(self.group))  # averaged as DataParallel averages
        for p in self.params:
            p.grad = None
        self.free()
        with trace.tags(unit=self.name):
            if self.replicated:
                return flat, comm.all_reduce(flat, group=self.group, async_op=True)
            out = flat.new_empty(self.flat.shard_numel)
            return out, comm.reduce_scatter(out, flat, group=self.group, async_op=True)

    def whole(self, piece: torch.Tensor) -> torch.Tensor:
        """This rank's ``piece`` of the unit (its shard, or the shard's gradient) and every other rank's, end to end:
        the padded flat unit (all-gathered; every rank of the group must call it, unless replicated)."""
        if self.replicated:
            return piece
        flat = piece.new_empty(self.flat.padded)
        comm.all_gather(flat, piece, group=self.group)
        return flat


def _neighbour(order: list[ShardedUnit], unit: ShardedUnit, offset: int) -> ShardedUnit | None:
    """The unit ``offset`` places from ``unit`` in ``order``, if any."""
    if unit not in order:
        return None
    i = order.index(unit) + offset
    return order[i] if 0 <= i < len(order) else None


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3 / FSDP around any module (Zhao et al. 2023, §3; Rajbhandari et al. 2020, §5.3).

    At construction rank 0's parameters and buffers are broadcast over ``group``, then ``units(module)`` (default:
    :func:`children_with_params`) picks the units (see :func:`shard_plan` for tied parameters) and every unit's
    trainable parameters are sharded. ``parameters()`` are the shards alone, so ``torch.optim.AdamW(fsdp.parameters())``
    updates this rank's slices: the module is kept as a plain attribute, not a registered submodule, so its
    parameters (views into the shards or into full buffers that are mostly freed) stay out; they remain real leaves,
    whose gradient hooks find out when a unit's gradients are complete. Move the module to its device before
    wrapping. ``replicate(module)`` picks modules whose trainable parameters stay whole on every rank (the norms,
    say): one more unit, never sharded, whose gradients are all-reduced and averaged as DataParallel's are.

    The module's parameters are, as FSDP's original parameters (``use_orig_params``) are, views into the flat
    shards outside forward and backward (Zhao et al. 2023, §3): each is the 1-D piece of its flattened values that
    this rank holds (whole when replicated, empty where other ranks hold it all) and, once a backward has finished,
    its ``.grad`` is that piece of the averaged gradient, in the shards' dtype (the master weights', under
    ``compute_dtype``); so ``p.grad.shape == p.shape`` for every parameter, and a replicated one's is its own whole
    gradient. Between a forward and the end of its backward each is a view of its own shape into its unit's full
    buffer, in ``compute_dtype``. :meth:`full_grads` gathers every gradient whole when asked (:meth:`full_params` the
    parameters). Unlike FSDP2, whose parameters are DTensors of their own global shape sharded on dim 0, a
    parameter here is a range of a unit's flat buffer, so between steps its shape is its piece's; the pieces are
    views of the shards' gradients as the last backward left them (zeroed with the shards' by ``zero_grad
    (set_to_none=False)``; after ``set_to_none`` they keep the old values until the next forward drops them).

    ``reshard_after_forward`` frees a unit's full parameters after its forward (gathered again for backward);
    ``prefetch`` starts the next unit's all-gather while a unit computes (in forward the order of the previous
    forward, in backward that forward's reverse). ``compute_dtype`` gathers the parameters in that dtype and runs
    forward and backward in it (floating-point inputs are cast; frozen parameters are kept in it once); gradients
    are reduce-scattered in it and added to the shards in the shards' dtype (FSDP's native mixed precision).

    Used as PyTorch's FSDP is: ``loss.backward(); optimizer.step()``. Backward finishes the reduce-scatters itself,
    from autograd's final callback (:meth:`_end_backward`), so ``backward()`` returns with the averaged slices added
    to the shards' gradients (several backward passes before a step accumulate there);
    :meth:`finish_gradient_synchronization`, which some assignments ask for, then has nothing left to do. A
    trainable parameter that got no gradient in a backward is an error naming it, raised by that ``backward()``;
    with ``find_unused_parameters`` its gradient counts as zero. Reduce-scatters start in a fixed unit order on
    every rank (the units' reverse order, the root last), each as soon as it and all before it are complete; what is
    missing at the end of backward is then sent with zeros. As with PyTorch's FSDP, every rank must run the same
    units forward (and, when a unit is gathered again for backward, backward): gathers are collectives, and a unit
    that one rank skips leaves the others waiting.
    """

    def __init__(
        self,
        module: nn.Module,
        units: Policy | None = None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        compute_dtype: torch.dtype | None = None,
        group: Group = None,
        find_unused_parameters: bool = False,
        replicate: Policy | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not registered: its full parameters are not ours to offer
        self.reshard_after_forward, self.prefetch, self.group = reshard_after_forward, prefetch, group
        self.compute_dtype, self.find_unused_parameters = compute_dtype, find_unused_parameters
        broadcast_from_first(module, group)
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._frozen = {id(p): p.detach() for p in module.parameters() if not p.requires_grad}
        if compute_dtype is not None:
            for p in module.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(compute_dtype)
            module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        kept = replicated_params(module, replicate)
        plan = shard_plan(module, units or children_with_params, kept)
        self.units = [ShardedUnit(name, m, params, group, compute_dtype) for name, m, params in plan]
        if kept:  # first, so that its all-reduce is started last and never holds up a reduce-scatter
            self.units.insert(0, ShardedUnit(REPLICATED, module, kept, group, compute_dtype, replicated=True))
        self.shards = nn.ParameterList(unit.shard for unit in self.units)
        self.ready = ReadyGroups([unit.params for unit in self.units], self._unit_ready)
        self._in_flight: list[tuple[ShardedUnit, torch.Tensor, comm.Handle]] = []
        self._ready: set[int] = set()
        self._issued = 0  # reduce-scatters started in this backward, in the order of reversed(self.units)
        self._forward_order, self._pre_order, self._post_order = list(self.units), [], []
        self._full_views, self._backward_due = False, False
        self.end_of_backward = EndOfBackward(self._end_backward)
        module.register_forward_pre_hook(self._begin_forward)
        module.register_forward_hook(self._end_forward)
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))

    def forward(self, *args, **kwargs):
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as err:
            away = [unit.name for unit in self.units if not unit.gathered]
            if "storage of size 0" not in str(err) or not away:
                raise
            raise RuntimeError(
                f"{type(self.module).__name__} used a parameter that FSDP had freed (units not gathered at that "
                f"moment: {away}). FSDP gathers a unit's parameters only around that submodule's own forward, so a "
                f"parameter used outside it (a weight tied by hand, as in x @ self.embed.weight.T) must belong to a "
                f"unit around every use: choose units without that submodule (its parameters then stay in the "
                f"root), or tie through a second module (head.weight = embed.weight), which puts it in the root."
            ) from err

    def train(self, mode: bool = True) -> FullyShardedDataParallel:
        self.module.train(mode)
        return super().train(mode)

    # -- forward -------------------------------------------------------------------------------------------
    def _cast_inputs(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(x):
            return x.to(self.compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return tree_map(cast, (args, kwargs))

    def _begin_forward(self, _module: nn.Module, _args: tuple) -> None:
        self._pre_order, self._post_order = [], []
        self._use_full_views(True)

    def _use_full_views(self, full: bool) -> None:
        """Make the module's parameters views of their own shape into the full buffers (``full``) or their pieces
        of the shards, with the shards' gradients (see the class)."""
        if full != self._full_views:
            for unit in self.units:
                unit.use_full() if full else unit.use_shard()
            self._full_views = full

    def _before_forward(self, unit: ShardedUnit, _module: nn.Module, _args: tuple) -> None:
        unit.ensure_gathered()
        if self.prefetch and (following := _neighbour(self._forward_order, unit, 1)) is not None:
            following.gather()
        self._pre_order.append(unit)
        unit.forward_started = trace.now()

    def _after_forward(self, unit: ShardedUnit, _module: nn.Module, _args: tuple, output) -> None:
        if unit.module is not self.module:  # the root's forward spans every other unit's
            trace.record("compute", f"{unit.name} forward", unit.forward_started, trace.now(), unit=unit.name)
        self._post_order.append(unit)
        needs_grad = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard_after_forward or not needs_grad:  # no backward to come: nothing to keep them for
            unit.free()
        for t in needs_grad:
            t.register_hook(functools.partial(self._before_backward, unit))

    def _end_forward(self, _module: nn.Module, _args: tuple, output) -> None:
        self._forward_order = self._pre_order
        self.end_of_backward.watch(output)
        self._backward_due |= any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output))
        if not self._backward_due:  # evaluation: no backward to keep the full views for
            self._use_full_views(False)

    # -- backward ------------------------------------------------------------------------------------------
    def _before_backward(self, unit: ShardedUnit, _grad: torch.Tensor) -> None:
        unit.ensure_gathered()
        if self.prefetch and (previous := _neighbour(self._post_order, unit, -1)) is not None:
            previous.gather()

    def _unit_ready(self, i: int) -> None:
        """Unit ``i``'s gradients are complete: start every reduce-scatter whose turn has come."""
        self._ready.add(i)
        while (turn := len(self.units) - 1 - self._issued) in self._ready:
            self._in_flight.append((self.units[turn], *self.units[turn].reduce()))
            self._issued += 1

    def _end_backward(self) -> None:
        """Autograd's last act in a backward (Zhao et al. 2023, §3: FSDP's post-backward): settle the units whose
        gradients did not all come (zeros with ``find_unused_parameters``, an error naming them without), free
        every unit, wait for the reduce-scatters, add the averaged slices to the shards' gradients and make the
        module's parameters their pieces of the shards, with those of the gradients as ``.grad``."""
        missing = [p for unit in self.units for p in unit.params if id(p) not in self.ready.arrived]
        self.ready.reset()
        if self.find_unused_parameters:
            for i in range(len(self.units)):
                self._unit_ready(i)
        self._ready, self._issued = set(), 0
        for unit in self.units:
            unit.free()
        in_flight, self._in_flight = self._in_flight, []
        for unit, out, handle in in_flight:
            handle.wait()
            grad = out.to(unit.shard.dtype)
            unit.shard.grad = grad if unit.shard.grad is None else unit.shard.grad.add_(grad)
        self._backward_due = False
        self._use_full_views(False)
        if missing and not self.find_unused_parameters:
            raise no_gradient_error(
                [self._names[id(p)] for p in missing],
                "their unit cannot be reduce-scattered",
                "pass find_unused_parameters=True to count them as zero",
            )

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do, and nothing sent: every ``backward()`` has already added the averaged slices to the
        shards' gradients and given each module parameter its piece as ``.grad`` (:meth:`_end_backward`). Kept for
        training loops written for a wrapper that needs the call (CS336's assignment asks for one); calling it once,
        twice or never gives the same step."""

    def local_shards(self) -> list[tuple[FlatShard, nn.Parameter]]:
        """Each unit's flat layout with this rank's shard of it: what :mod:`course_lib.runtime.checkpoint` saves,
        layout-free, as pieces of each parameter (and of its optimizer state, keyed by the shard)."""
        return [(unit.flat, unit.shard) for unit in self.units]

    def checkpoint_holdings(self) -> list[Held]:
        """Each trainable parameter as :mod:`course_lib.runtime.checkpoint` places it: whole in its own shape, held
        as the pieces :meth:`local_shards` lays out (whatever form the module's parameters have now)."""
        return [
            Held(self._names[id(p)], like, tuple(like.shape), whole(like.shape))
            for unit in self.units
            for p, like in zip(unit.params, unit.flat.params, strict=True)
        ]

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the module whole, by its name there, in the shards' dtype, on the CPU (every rank of
        the group must call it: it all-gathers each unit's shards)."""
        whole_params = dict(self._frozen)
        with trace.tags(phase="final"):
            for unit in self.units:
                values = split_like(unit.whole(unit.shard.detach()), unit.flat.params)
                whole_params |= {id(p): value for p, value in zip(unit.params, values, strict=True)}
        return {name: whole_params[id(p)].detach().cpu().clone() for name, p in self.module.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's gradient whole, in its own shape, by its name in the module, in the shards'
        dtype, on the CPU: FSDP1's ``summon_full_params(with_grads=True)``, FSDP2's ``full_tensor()`` of each
        ``.grad``. Every rank of the group must call it: it all-gathers each sharded unit's gradient slices (a
        collective tagged ``phase="full_grads"``, outside any training step's bytes). A unit with no gradient yet is
        left out."""
        grads = {}
        with trace.tags(phase="full_grads"):
            for unit in self.units:
                if unit.shard.grad is not None:
                    values = split_like(unit.whole(unit.shard.grad), unit.flat.params)
                    grads |= {self._names[id(p)]: g.cpu().clone() for p, g in zip(unit.params, values, strict=True)}
        return grads


def gpt_blocks(model: TinyGPT) -> list[nn.Module]:
    """The course's policy: one unit per transformer block; the root keeps the embeddings and the final LayerNorm."""
    return list(model.blocks)


def policy_for(model: ModelFactory | None) -> Policy:
    """The units of a course run: one per block of the tiny GPT; for a student's model, FSDP's default."""
    return gpt_blocks if model is None else children_with_params


def train_fsdp(
    cfg: GPTConfig,
    train: TrainConfig,
    overlap: bool = True,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    measure_memory: bool = True,
    model: ModelFactory | None = None,
) -> dict:
    """Rank function: ZeRO-3, the tiny GPT in :class:`FullyShardedDataParallel` with :func:`gpt_blocks` units (or
    the student's ``model`` with one unit per child); ``overlap`` prefetches the next unit's parameters. Under mixed
    precision the module is held in 16 bits, so are its shards, and AdamW in a
    :class:`course_lib.model.precision.MixedPrecisionOptimizer` keeps fp32 master weights and moments of the shards."""
    module = build_model(cfg, train, model).to(launch.rank_device())
    fsdp = FullyShardedDataParallel(module, policy_for(model), reshard_after_forward, prefetch=overlap)
    optimizer = precision.optimizer_class(train, sharded=True)(fsdp.parameters(), **optimizer_settings(train))
    report = train_loop(DataParallelStrategy(fsdp, optimizer), cfg, train, grad_accum, measure_memory)
    return {**report, "params": fsdp.full_params()}


# ------------------------------------------------------------------------------------------------ checks, formulas
def unit_sizes(model: nn.Module, n: int, policy: Policy = gpt_blocks) -> list[int]:
    """Padded element counts of the units ``policy`` makes of ``model`` over n ranks, the root first (no ranks
    needed; the default policy is the tiny GPT's)."""
    return [FlatShard(params, n, 0).padded for _, _, params in shard_plan(model, policy)]


def _unit_sizes(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[int]:
    return unit_sizes(build_model(cfg, train, o["model"]), world_size, policy_for(o["model"]))


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """With the units padded to a multiple of n (Pad elements in k units), a rank keeps weights, gradients and
    optimizer state of Pad/n (plus the frozen weights whole) with AdamW's step counter per unit (§5.3), at the run's
    bytes per element (:func:`course_lib.model.precision.state_bytes`: (2 + 2 + 12)/n per parameter in mixed precision),
    and the activations of one micro-batch."""
    model = build_model(cfg, train, o["model"])
    sizes = unit_sizes(model, world_size, policy_for(o["model"]))
    frozen = count_params(model, trainable_only=False) - count_params(model)
    shard = sum(sizes) // world_size
    return on_every_rank(
        precision.state_bytes(train, shard + frozen, shard, shard, len(sizes)), world_size, cfg, train, o
    )


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Per micro-batch every unit is all-gathered twice (forward and backward; once without resharding after
    forward) and reduce-scattered once, (n-1)/n x e Pad bytes each, e the bytes of a weight (2 in bf16); with a loss
    scaler the ranks agree whether any shard's gradients overflowed: one all-reduced flag per step."""
    part = ring_factor("all_gather", world_size) * precision.convention(train).params
    part *= sum(_unit_sizes(world_size, cfg, train, o))
    gathers = 2 if o["reshard_after_forward"] else 1
    row = {"all_gather": gathers * o["grad_accum"] * part, "reduce_scatter": o["grad_accum"] * part}
    if flag := precision.overflow_check_bytes(train, world_size):
        row["all_reduce"] = flag
    return [dict(row) for _ in range(world_size)]


SCHEMES = (
    catalog.scheme(
        "zero3",
        "ZeRO-3 / FSDP: shard parameters too, gather each block when it runs",
        train_fsdp,
        predict_memory,
        predict_comm,
    ),
)
