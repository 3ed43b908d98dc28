"""ZeRO stages 1 and 2: shard what data parallelism replicates (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", §5.1-5.2), as an optimizer around any module's parameters.

Trainable parameters are laid end to end in flat buffers (buckets, in backward order) padded to a multiple of the n
ranks; the module's parameters become views into them. Rank r owns slice r of each buffer and keeps the optimizer
state of that slice alone, so it updates only its slice; the updated slices are then all-gathered into every rank's
full buffers, which are the parameters.

* Stage 1, P_os (§5.1): each bucket's gradients are reduce-scattered (from a backward hook as soon as they exist,
  or after backward) and averaged into the rank's slice; the full gradients stay as the module's ``.grad``.
  Bytes per rank: (n-1)/n x 2 x Psi x b, as plain DP (a reduce-scatter and an all-gather instead of an all-reduce).
* Stage 2, P_os+g (§5.2): the same reduce-scatter, after which the full gradients are dropped: a rank keeps only
  its gradient slice. Same bytes.

Stage 3, P_os+g+p, shards the parameters too: :mod:`course_lib.parallel.fsdp`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.model import precision
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import ModelFactory, build_model, count_params, final_params, optimizer_settings
from course_lib.model.precision import copy_hyperparameters, drop_grad, grad_of, set_grad
from course_lib.parallel import catalog
from course_lib.parallel.data import (
    DataParallelStrategy,
    ReadyGroups,
    broadcast_from_first,
    no_gradient_error,
    on_every_rank,
    split_into_buckets,
    split_like,
    train_loop,
)
from course_lib.parallel.interface import Scheme
from course_lib.runtime import launch


class FlatShard:
    """Parameters laid end to end in one flat buffer padded to a multiple of ``n``; rank ``rank`` owns slice r."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / n) * n
        self.shard_numel = self.padded // n
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        pad = tensors[0].new_zeros(self.padded - self.numel)
        return torch.cat([t.reshape(-1) for t in tensors] + [pad])

    def view_params_into(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into ``flat``, so writing the buffer writes the parameters."""
        for p, view in zip(self.params, split_like(flat, self.params), strict=True):
            p.data = view


def bucket_layout(params: list[nn.Parameter], bucket_mb: float | None) -> list[list[nn.Parameter]]:
    """The buckets ZeRO lays the trainable ``params`` (in forward order) into: by dtype, in backward order, of about
    ``bucket_mb`` MB each (``None``: one per dtype)."""
    trainable = [p for p in params if p.requires_grad]
    bucket_bytes = math.inf if bucket_mb is None else bucket_mb * 1e6
    return [
        bucket
        for dtype in dict.fromkeys(p.dtype for p in trainable)
        for bucket in split_into_buckets([p for p in reversed(trainable) if p.dtype == dtype], bucket_bytes)
    ]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any ``torch.optim`` optimizer (Rajbhandari et al. 2020, §5.1-5.2); the name and the
    first two arguments are those of PyTorch's ``ZeroRedundancyOptimizer``, so that one can replace the other.

    ``ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` broadcasts rank 0's values of the
    parameters it is given (frozen ones too; the module's buffers, and parameters it is not given, are not its to
    copy: seed every rank alike or wrap the module in DataParallel), lays the trainable ones of each parameter group
    into flat buffers of about ``bucket_mb`` megabytes (``None``: one per group and dtype) and builds
    ``optimizer_class(slices, **defaults)`` over this rank's slices (``.optim``).
    ``param_groups`` are the module's parameters with their hyperparameters, copied to ``.optim`` at every step,
    so learning-rate schedulers work as usual. Pass ``model.named_parameters()`` and errors name the parameters.

    ``average_gradients`` (default): each bucket's gradients are reduce-scattered and averaged over ``group``,
    from a backward hook as soon as they exist (``overlap``) or at :meth:`step`, which always finishes the
    reduction first (:meth:`finish_gradient_synchronization`), so ``loss.backward(); optimizer.step()`` is the whole
    loop, as with any optimizer; use :meth:`no_sync` for the inner micro-steps of gradient accumulation at stage 1.
    The reduction is finished by the step, not by autograd as :class:`course_lib.parallel.data.DataParallel` finishes
    its all-reduces: an optimizer sees no forward pass to hook, and a step may run several backward passes (a
    pipeline's micro-batches) with gradient work of its own between the last one and the reduction (3D's tied
    embedding). Without ``average_gradients`` the gradients must already be averaged (by
    :class:`course_lib.parallel.data.DataParallel`, as PyTorch's version expects from DDP): each rank only takes its
    slice of them, and only the optimizer state is sharded.

    Stage 1 keeps the full gradients as the parameters' ``.grad``, so every way of zeroing them (this optimizer's
    ``zero_grad``, the module's, with or without ``set_to_none``) behaves as in plain PyTorch. Stage 2 drops them once
    reduced and keeps only the slice; :meth:`step` consumes that slice, so gradients never carry over from one step
    to the next whichever ``zero_grad`` is called (or none). A trainable parameter without a gradient at the
    reduction is an error naming it: a sharded optimizer cannot skip part of a slice as a plain one skips a
    parameter whose ``.grad`` is ``None``. :meth:`state_dict` is this rank's slice of the state; each rank saves
    and loads its own.
    """

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type[torch.optim.Optimizer],
        stage: int = 1,
        average_gradients: bool = True,
        bucket_mb: float | None = 25.0,
        overlap: bool = True,
        group: Group = None,
        **defaults,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"ZeroRedundancyOptimizer shards stage 1 or 2, not {stage}; stage 3 is FullyShardedDataParallel"
            )
        if stage == 2 and not average_gradients:
            raise ValueError(
                "stage 2 keeps only this rank's slice of the gradients, which the reduce-scatter makes; with "
                "average_gradients=False the full averaged gradients already exist, so use stage 1"
            )
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(f"bucket size must be positive or None (one bucket), got {bucket_mb} MB")
        super().__init__(params, defaults)
        self.stage, self.average_gradients, self.group = stage, average_gradients, group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self._names: dict[int, str] = {}
        self.buckets: list[FlatShard] = []
        self._full: list[torch.Tensor] = []  # each bucket's flat parameter buffer; the parameters are views into it
        self._slices: list[nn.Parameter] = []  # this rank's slice of each buffer, what .optim updates
        inner_groups = []
        for g, param_group in enumerate(self.param_groups):
            names = param_group.get("param_names") or [None] * len(param_group["params"])
            trainable = [p for p in param_group["params"] if p.requires_grad]
            for j, (p, name) in enumerate(zip(param_group["params"], names, strict=True)):
                self._names[id(p)] = name or f"param_groups[{g}]['params'][{j}] of shape {tuple(p.shape)}"
            if average_gradients:
                broadcast_from_first(param_group["params"], group)
            first = len(self.buckets)
            for params in bucket_layout(trainable, bucket_mb):
                bucket = FlatShard(params, n, rank)
                full = bucket.flatten([p.detach() for p in params])
                bucket.view_params_into(full)
                self.buckets.append(bucket)
                self._full.append(full)
                self._slices.append(nn.Parameter(full[bucket.lo : bucket.hi]))
            hyper = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
            inner_groups.append({**hyper, "params": self._slices[first:]})
        self.optim = optimizer_class(inner_groups, **defaults)
        self.defaults = self.optim.defaults
        copy_hyperparameters(self.optim.param_groups, self.param_groups)  # the inner optimizer's defaults too
        self._in_flight: list[tuple[int, torch.Tensor, comm.Handle]] = []
        self._reduced: set[int] = set()  # buckets reduce-scattered since the last step, and not due again
        self.ready = None
        if average_gradients:  # which gradients came, and when a bucket's all have
            self.ready = ReadyGroups([b.params for b in self.buckets], self._reduce_scatter if overlap else self._due)

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "optim"):
            raise RuntimeError(
                "ZeroRedundancyOptimizer lays out its flat buffers when it is built; pass every parameter group then"
            )
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inner micro-steps of gradient accumulation: at stage 1 gradients add up locally and are reduced once;
        stage 2 keeps no full gradients to add up, so it reduces every micro-step (nothing changes)."""
        with self.ready.paused() if self.ready is not None and self.stage == 1 else contextlib.nullcontext():
            yield

    def _reduce_scatter(self, i: int) -> None:
        """Start summing bucket ``i``'s gradients into this rank's slice (at stage 2 the full ones are dropped)."""
        bucket = self.buckets[i]
        arrived = self.ready.arrived if self.ready is not None and self.stage == 2 else None
        missing = [p for p in bucket.params if grad_of(p) is None and (arrived is None or id(p) not in arrived)]
        if missing:
            raise no_gradient_error(
                [self._names[id(p)] for p in missing],
                "their slices cannot be reduce-scattered",
                "at stage 1, zero gradients with zero_grad(set_to_none=False) so that theirs count as zero",
            )
        grads = [grad_of(p) for p in bucket.params]
        zeros = [
            torch.zeros_like(p, dtype=precision.grad_dtype(p)) if g is None else g
            for p, g in zip(bucket.params, grads, strict=True)
        ]
        flat = bucket.flatten(zeros).div_(dist.get_world_size(self.group))  # averaged as DataParallel averages
        if self.stage == 2:
            for p in bucket.params:
                drop_grad(p)
        out = flat.new_empty(bucket.shard_numel)
        with trace.tags(bucket=i):
            self._in_flight.append((i, out, comm.reduce_scatter(out, flat, group=self.group, async_op=True)))
        self._reduced.add(i)

    def _due(self, i: int) -> None:
        """Without overlap: bucket ``i``'s gradients have all come (again), so its reduce-scatter is due at the
        next :meth:`finish_gradient_synchronization`, even if one already ran this step (a backward after it)."""
        self._reduced.discard(i)

    def finish_gradient_synchronization(self) -> None:
        """Reduce-scatter every bucket not reduced since its gradients last came (or that got them only in part),
        wait, and set each slice's gradient to the average (stage 2: add it). Without ``average_gradients``: take
        each slice of the averaged gradients. :meth:`step` calls it; call it yourself to see the slices' gradients
        before stepping (a second call, or the step's, then sends nothing)."""
        if not self.average_gradients:
            for bucket, shard in zip(self.buckets, self._slices, strict=True):
                missing = [p for p in bucket.params if grad_of(p) is None]
                if missing:
                    raise no_gradient_error(
                        [self._names[id(p)] for p in missing],
                        "this rank cannot take their slice",
                        "count their gradients as zero (DataParallel(find_unused_parameters=True) does)",
                    )
                set_grad(shard, bucket.flatten([grad_of(p) for p in bucket.params])[bucket.lo : bucket.hi].clone())
            return
        partial = self.ready.partly_arrived() if self.ready is not None else set()
        for i in range(len(self.buckets)):
            if i not in self._reduced or i in partial:
                self._reduce_scatter(i)
        if self.ready is not None:
            self.ready.reset()
        for i, out, handle in self._in_flight:
            handle.wait()
            shard = self._slices[i]
            set_grad(shard, out if self.stage == 1 or grad_of(shard) is None else grad_of(shard).add_(out))
        self._in_flight = []

    @torch.no_grad()
    def step(self, closure=None):
        """Finish the gradients' reduction, update this rank's slices with ``.optim``, all-gather the slices into
        every rank's parameters; the slices' gradients are consumed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_parameters_in_place()
        self.finish_gradient_synchronization()
        self._reduced = set()
        copy_hyperparameters(self.param_groups, self.optim.param_groups)
        self.optim.step()
        for shard in self._slices:
            if self.stage == 1:
                drop_grad(shard)  # the full gradients are the module's .grad
            elif grad_of(shard) is not None:
                grad_of(shard).zero_()  # stage 2 keeps its slice's buffer for the next step
        with trace.tags(phase="param_sync"):
            handles = [
                comm.all_gather(full, shard.detach().clone(), group=self.group, async_op=True)
                for full, shard in zip(self._full, self._slices, strict=True)
            ]
            for handle in handles:
                handle.wait()
        return loss

    def _check_parameters_in_place(self) -> None:
        for bucket, full in zip(self.buckets, self._full, strict=True):
            for p in bucket.params:
                if p.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                    raise RuntimeError(
                        f"parameter {self._names[id(p)]} no longer lives in ZeroRedundancyOptimizer's flat buffer "
                        f"(was the module moved with .to() or a parameter's .data replaced after the optimizer was "
                        f"built?); build the optimizer after the module is where it will train"
                    )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        precision.zero_main_grads((p for group in self.param_groups for p in group["params"]), set_to_none)
        self.optim.zero_grad(set_to_none)

    def local_shards(self) -> list[tuple[FlatShard, nn.Parameter]]:
        """Each flat buffer's layout with this rank's slice of it, which keys its state in ``.optim``: what
        :mod:`course_lib.runtime.checkpoint` saves, layout-free, as pieces of each parameter's optimizer state."""
        return list(zip(self.buckets, self._slices, strict=True))

    def state_dict(self) -> dict:
        """This rank's slice of the optimizer state (``.optim``'s state dict) and the hyperparameters."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` saved on this rank, into a ZeroRedundancyOptimizer laid out the same way."""
        self.optim.load_state_dict(state_dict)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)


class ShardedStrategy(DataParallelStrategy):
    """The shared step's hooks for a :class:`ZeroRedundancyOptimizer`: accumulation under its ``no_sync``, the
    reduce-scatter finished in the grad_sync phase; its step all-gathers the parameters."""

    def no_sync(self):
        return self.optimizer.no_sync()

    def finish_gradients(self) -> None:
        self.optimizer.finish_gradient_synchronization()


def train_zero(
    cfg: GPTConfig,
    train: TrainConfig,
    stage: int = 1,
    bucket_mb: float | None = 0.1,
    overlap: bool = True,
    grad_accum: int = 1,
    measure_memory: bool = True,
    model: ModelFactory | None = None,
) -> dict:
    """Rank function: the tiny GPT (or the student's ``model``) trained by a :class:`ZeroRedundancyOptimizer` of
    AdamW at ``stage`` 1 or 2; under mixed precision of AdamW in a
    :class:`course_lib.model.precision.MixedPrecisionOptimizer`, so that each rank keeps the master weights and moments
    of its slice alone."""
    module = build_model(cfg, train, model).to(launch.rank_device())
    optimizer = ZeroRedundancyOptimizer(
        module.named_parameters(),
        precision.optimizer_class(train, sharded=True),
        stage,
        bucket_mb=bucket_mb,
        overlap=overlap,
        **optimizer_settings(train),
    )
    report = train_loop(ShardedStrategy(module, optimizer), cfg, train, grad_accum, measure_memory)
    return {**report, "params": final_params(module)}


def bucket_sizes(model: nn.Module, n: int, bucket_mb: float | None = 0.1) -> list[int]:
    """Padded element counts of the flat buffers a ZeroRedundancyOptimizer over ``model.parameters()`` lays out
    over n ranks (for the predictions; no ranks needed)."""
    return [FlatShard(b, n, 0).padded for b in bucket_layout(list(model.parameters()), bucket_mb)]


# ------------------------------------------------------------------------------------------------ checks, formulas
def _bucket_sizes(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[int]:
    return bucket_sizes(build_model(cfg, train, o["model"]), world_size, o["bucket_mb"])


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """With P trainable and F frozen parameters, and the flat buffers padded to a multiple of n (Pad elements in k
    buffers), a rank keeps the weights of Pad + F (the module's are views into the buffers), the optimizer state of
    Pad/n (stage 1, §5.1) with AdamW's step counter per buffer, the gradients of P at stage 1 (the module's own
    .grad) and only of Pad/n at stage 2 (§5.2), at the run's bytes per element
    (:func:`course_lib.model.precision.state_bytes`: in mixed precision 2 + 2 + 12/n bytes per parameter at stage 1);
    and the activations of one micro-batch."""
    model = build_model(cfg, train, o["model"])
    sizes = bucket_sizes(model, world_size, o["bucket_mb"])
    trainable, frozen = count_params(model), count_params(model, trainable_only=False) - count_params(model)
    n, pad = world_size, sum(sizes)
    grads = pad // n if o["stage"] == 2 else trainable
    return on_every_rank(precision.state_bytes(train, pad + frozen, grads, pad // n, len(sizes)), n, cfg, train, o)


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each bucket's gradients are reduce-scattered and its updated parameters all-gathered, (n-1)/n x e Pad bytes
    each, e the bytes of a gradient and of a weight (:func:`course_lib.model.precision.convention`; 2 for bf16, 4 for
    Megatron's fp32 main gradients); stage 2 reduce-scatters every micro-batch. With a loss scaler the ranks agree
    whether any slice's gradients overflowed: one all-reduced flag."""
    n, k = world_size, o["grad_accum"]
    if n == 1:
        return [{}]
    part = ring_factor("all_gather", n) * sum(_bucket_sizes(n, cfg, train, o))
    c = precision.convention(train)
    row = {"reduce_scatter": (k if o["stage"] == 2 else 1) * c.grads * part, "all_gather": c.params * part}
    if flag := precision.overflow_check_bytes(train, n):
        row["all_reduce"] = flag
    return [dict(row) for _ in range(n)]


def _scheme(stage: int, summary: str) -> Scheme:
    return catalog.scheme(
        f"zero{stage}", summary, functools.partial(train_zero, stage=stage), predict_memory, predict_comm
    )


SCHEMES = (
    _scheme(1, "ZeRO-1: shard the optimizer state"),
    _scheme(2, "ZeRO-2: shard optimizer state and gradients"),
)
