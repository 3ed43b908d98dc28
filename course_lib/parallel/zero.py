"""ZeRO: shard what data parallelism replicates (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", §5; stage 3 is PyTorch's FSDP, Zhao et al. 2023).

Parameters are laid end to end in flat buffers padded to a multiple of the n ranks; rank r owns slice r of each
buffer and keeps the optimizer state (and, from stage 2, the gradients; at stage 3, the parameters) of that slice
alone.

* Stage 1, P_os (§5.1): full gradients are reduce-scattered bucket by bucket; each rank updates its slice with its
  own Adam state; the updated slices are all-gathered. Bytes per rank: (n-1)/n x 2 x Psi x b, as plain DP.
* Stage 2, P_os+g (§5.2): as in stage 1 the reduce-scatter of a bucket starts from a backward hook as soon as its
  gradients exist, but the full gradients are then dropped; a rank keeps only its gradient slice. Same bytes.
* Stage 3, P_os+g+p (§5.3): parameters are sharded per unit (each transformer block, and one unit for the
  embedding and final LayerNorm); a unit's parameters are all-gathered before its forward, freed after, gathered
  again before its backward, and its gradients reduce-scattered; the next unit's gather is started early
  (prefetch) so that it overlaps compute. Bytes: (n-1)/n x 3 x Psi x b, 1.5x plain DP.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm, launch, trace
from course_lib.comm import Group, ring_factor
from course_lib.memory import resize_storage
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, count_params, final_params, make_optimizer
from course_lib.parallel.data import (
    BUCKET_MB,
    GRAD_ACCUM,
    OVERLAP,
    DataParallelStrategy,
    ReadyGroups,
    activation_bytes,
    backward_order,
    check_batch_split,
    split_into_buckets,
    split_like,
    train_loop,
)
from course_lib.parallel.interface import Option, Scheme


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


def _accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class ShardedOptimizer(DataParallelStrategy):
    """ZeRO stages 1 and 2: full parameters on every rank, optimizer state (and at stage 2 gradients) sharded."""

    def __init__(
        self, model: nn.Module, train: TrainConfig, stage: int, bucket_bytes: int, overlap: bool, group: Group = None
    ) -> None:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.stage, self.overlap, self.group = stage, overlap, group
        self.flats = [FlatShard(b, n, rank) for b in split_into_buckets(backward_order(model), bucket_bytes)]
        self.full = []  # the full parameter buffer of each bucket; the model's parameters are views into it
        self.shards = []  # this rank's slice of each buffer, as the parameters the optimizer updates
        self.full_grads = []  # stage 1: full gradient buffers, the model's .grad are views into them
        for flat in self.flats:
            buffer = flat.flatten([p.detach() for p in flat.params])
            flat.view_params_into(buffer)
            self.full.append(buffer)
            self.shards.append(nn.Parameter(buffer[flat.lo : flat.hi]))
            if stage == 1:
                grads = torch.zeros_like(buffer)
                for p, g in zip(flat.params, split_like(grads, flat.params), strict=True):
                    p.grad = g
                self.shards[-1].grad = grads[flat.lo : flat.hi]
                self.full_grads.append(grads)
        super().__init__(model, make_optimizer(self.shards, train))
        self._in_flight: list[tuple[int, torch.Tensor, comm.Handle]] = []
        self.ready = ReadyGroups([f.params for f in self.flats], self._reduce_scatter)
        self.ready.enabled = overlap

    def _reduce_scatter(self, i: int) -> None:
        flat = self.flats[i]
        grads = self.full_grads[i] if self.stage == 1 else flat.flatten([p.grad for p in flat.params])
        out = grads.new_empty(flat.shard_numel)
        with trace.tags(bucket=i):
            self._in_flight.append((i, out, comm.reduce_scatter(out, grads, group=self.group, async_op=True)))
        if self.stage == 2:
            for p in flat.params:
                p.grad = None  # the full gradient is no longer needed: only the slice is kept

    def no_sync(self):
        # Stage 1 keeps full gradients, so inner micro-steps can just accumulate them; stage 2 keeps only slices,
        # so it must reduce-scatter every micro-step.
        return self.ready.paused() if self.stage == 1 else super().no_sync()

    def finish_gradients(self) -> None:
        if not self.overlap:
            for i in range(len(self.flats)):
                self._reduce_scatter(i)
        n = dist.get_world_size(self.group)
        for i, out, handle in self._in_flight:
            handle.wait()
            out.div_(n)
            if self.stage == 1:
                self.shards[i].grad.copy_(out)
            else:
                _accumulate_grad(self.shards[i], out)
        self._in_flight = []

    def zero_grad(self) -> None:
        for grads in self.full_grads:
            grads.zero_()
        self.optimizer.zero_grad(set_to_none=False)

    def after_optimizer_step(self) -> None:
        handles = [
            comm.all_gather(full, shard.detach().clone(), group=self.group, async_op=True)
            for full, shard in zip(self.full, self.shards, strict=True)
        ]
        for h in handles:
            h.wait()


def fsdp_units(model: TinyGPT) -> list[list[nn.Parameter]]:
    """The trainable parameters of each FSDP unit: first the root (everything outside the blocks), then each block."""
    block_params = {id(p) for b in model.blocks for p in b.parameters()}
    root = [p for p in model.parameters() if p.requires_grad and id(p) not in block_params]
    return [root] + [[p for p in b.parameters() if p.requires_grad] for b in model.blocks]


class FullyShardedUnit:
    """One FSDP unit: a flat shard that persists, and a full buffer that exists only between gather and free."""

    def __init__(self, name: str, params: list[nn.Parameter], n: int, rank: int) -> None:
        self.name = name
        self.flat = FlatShard(params, n, rank)
        full = self.flat.flatten([p.detach() for p in params])
        self.shard = nn.Parameter(full[self.flat.lo : self.flat.hi].clone())
        self.flat.view_params_into(full)
        self.full = full
        self._nbytes = full.untyped_storage().nbytes()
        self._pending: comm.Handle | None = None
        self.gathered = True
        self.forward_started = 0.0
        self.free()

    def gather(self) -> None:
        """Start the all-gather of the full parameters, unless they are here or on their way."""
        if self.gathered or self._pending is not None:
            return
        resize_storage(self.full, self._nbytes)
        with trace.tags(unit=self.name):
            self._pending = comm.all_gather(self.full, self.shard.detach(), async_op=True)

    def ensure_gathered(self) -> None:
        """Block until the full parameters are here (gathering now if nobody started it)."""
        self.gather()
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self.gathered = True

    def free(self) -> None:
        resize_storage(self.full, 0)
        self.gathered = False


class FullyShardedDataParallel(DataParallelStrategy):
    """ZeRO stage 3 / FSDP over the tiny GPT: one unit per block plus a root unit (embedding, final LayerNorm)."""

    def __init__(self, model: TinyGPT, train: TrainConfig, prefetch: bool, reshard_after_forward: bool) -> None:
        n, rank = dist.get_world_size(), dist.get_rank()
        self.prefetch, self.reshard = prefetch, reshard_after_forward
        root, *blocks = fsdp_units(model)
        self.root = FullyShardedUnit("root", root, n, rank)
        self.blocks = [FullyShardedUnit(f"block{i}", params, n, rank) for i, params in enumerate(blocks)]
        self.units = [self.root, *self.blocks]
        super().__init__(model, make_optimizer([u.shard for u in self.units], train))
        self._in_flight: list[tuple[FullyShardedUnit, torch.Tensor, comm.Handle]] = []
        self.ready = ReadyGroups([u.flat.params for u in self.units], self._reduce_scatter)
        first, last = self._block(0), self._block(len(self.blocks) - 1)
        model.register_forward_pre_hook(lambda _m, _a: self._before_forward(self.root, first))
        model.register_forward_hook(lambda _m, _a, out: self._after_forward(self.root, out, last))
        for i, block in enumerate(model.blocks):
            unit, nxt, prev = self.blocks[i], self._block(i + 1), self._block(i - 1)
            block.register_forward_pre_hook(lambda _m, _a, u=unit, nx=nxt: self._before_forward(u, nx))
            block.register_forward_hook(lambda _m, _a, out, u=unit, pv=prev: self._after_forward(u, out, pv))

    def _block(self, i: int) -> FullyShardedUnit | None:
        return self.blocks[i] if 0 <= i < len(self.blocks) else None

    def _before_forward(self, unit: FullyShardedUnit, next_unit: FullyShardedUnit | None) -> None:
        unit.ensure_gathered()
        if self.prefetch and next_unit is not None:
            next_unit.gather()
        unit.forward_started = trace.now()

    def _after_forward(self, unit: FullyShardedUnit, out: torch.Tensor, backward_next: FullyShardedUnit | None):
        if unit is not self.root:  # the root unit's forward wraps the whole model, blocks included
            trace.record("compute", f"{unit.name} forward", unit.forward_started, trace.now(), unit=unit.name)
        if self.reshard:
            unit.free()
        if out.requires_grad:
            out.register_hook(lambda grad: self._before_backward(unit, backward_next))

    def _before_backward(self, unit: FullyShardedUnit, next_unit: FullyShardedUnit | None) -> None:
        unit.ensure_gathered()
        if self.prefetch and next_unit is not None:
            next_unit.gather()

    def _reduce_scatter(self, u: int) -> None:
        unit = self.units[u]
        grads = unit.flat.flatten([p.grad for p in unit.flat.params])
        for p in unit.flat.params:
            p.grad = None
        unit.free()
        out = grads.new_empty(unit.flat.shard_numel)
        with trace.tags(unit=unit.name):
            self._in_flight.append((unit, out, comm.reduce_scatter(out, grads, async_op=True)))

    def finish_gradients(self) -> None:
        n = dist.get_world_size()
        for unit, out, handle in self._in_flight:
            handle.wait()
            _accumulate_grad(unit.shard, out.div_(n))
        self._in_flight = []

    def full_params(self) -> dict[str, torch.Tensor]:
        """Gather every unit once more and return the full parameters (for the equivalence check)."""
        with trace.tags(phase="final"):
            for unit in self.units:
                unit.ensure_gathered()
        params = final_params(self.model)
        for unit in self.units:
            unit.free()
        return params


def train_zero(
    cfg: GPTConfig,
    train: TrainConfig,
    stage: int = 3,
    bucket_mb: float = 0.1,
    overlap: bool = True,
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    measure_memory: bool = True,
) -> dict:
    """Rank function: ZeRO stage 1, 2 or 3 training of the tiny GPT."""
    model = TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype).to(launch.rank_device())
    if stage in (1, 2):
        strategy = ShardedOptimizer(model, train, stage, int(bucket_mb * 1e6), overlap)
        report = train_loop(strategy, cfg, train, grad_accum, measure_memory)
        return {**report, "params": final_params(model)}
    if stage != 3:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage}")
    strategy = FullyShardedDataParallel(model, train, prefetch=overlap, reshard_after_forward=reshard_after_forward)
    report = train_loop(strategy, cfg, train, grad_accum, measure_memory)
    return {**report, "params": strategy.full_params()}


def flat_sizes(model: TinyGPT, n: int, stage: int, bucket_bytes: int) -> list[int]:
    """Padded element counts of the flat buffers a ZeRO stage lays out (for the predictions; no ranks needed)."""
    groups = fsdp_units(model) if stage == 3 else split_into_buckets(backward_order(model), bucket_bytes)
    return [FlatShard(g, n, 0).padded for g in groups]


# ------------------------------------------------------------------------------------------------ checks, formulas
RESHARD = Option(
    "reshard_after_forward", "keep gathered parameters from forward to backward", flag="--no-reshard", value=False
)


def _flat_sizes(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[int]:
    model = TinyGPT(cfg, dtype=train.torch_dtype)  # bucket boundaries depend on the element size
    return flat_sizes(model, world_size, o["stage"], int(o["bucket_mb"] * 1e6))


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """With e bytes per element and the flat buffers padded to a multiple of n (Pad elements in k buffers), a rank
    keeps 2e Pad/n + 4k of AdamW state (stage 1, §5.1), also only e Pad/n of gradients (stage 2, §5.2) and of
    parameters (stage 3, §5.3; frozen parameters stay whole), and the activations of one micro-batch."""
    sizes = _flat_sizes(world_size, cfg, train, o)
    model = TinyGPT(cfg)
    frozen = count_params(model, trainable_only=False) - count_params(model)
    e, n, stage, pad = train.torch_dtype.itemsize, world_size, o["stage"], sum(sizes)
    row = {
        "params": e * (pad // n if stage >= 3 else pad) + e * frozen,
        "grads": e * (pad // n if stage >= 2 else pad),
        "optimizer": 2 * e * pad // n + 4 * len(sizes),
        "activations": activation_bytes(world_size, cfg, train, o),
    }
    return [dict(row) for _ in range(world_size)]


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Stages 1 and 2 reduce-scatter the gradients and all-gather the updated parameters, (n-1)/n x e Pad each
    (stage 2 reduce-scatters every micro-batch); stage 3 all-gathers twice per micro-batch (forward and backward;
    once without resharding after forward) and reduce-scatters once."""
    n, k = world_size, o["grad_accum"]
    if n == 1:
        return [{}]
    part = ring_factor("all_gather", n) * train.torch_dtype.itemsize * sum(_flat_sizes(n, cfg, train, o))
    if o["stage"] == 3:
        gathers = 2 if o["reshard_after_forward"] else 1
        row = {"all_gather": gathers * k * part, "reduce_scatter": k * part}
    else:
        row = {"reduce_scatter": (k if o["stage"] == 2 else 1) * part, "all_gather": part}
    return [dict(row) for _ in range(n)]


def _scheme(stage: int, summary: str, options: tuple[Option, ...]) -> Scheme:
    train = functools.partial(train_zero, stage=stage)
    return Scheme(f"zero{stage}", summary, train, check_batch_split, predict_memory, predict_comm, options)


SCHEMES = (
    _scheme(1, "ZeRO-1: shard the optimizer state", (BUCKET_MB, OVERLAP, GRAD_ACCUM)),
    _scheme(2, "ZeRO-2: shard optimizer state and gradients", (BUCKET_MB, OVERLAP, GRAD_ACCUM)),
    _scheme(3, "ZeRO-3 / FSDP: shard parameters too, gather each block when it runs", (OVERLAP, GRAD_ACCUM, RESHARD)),
)
