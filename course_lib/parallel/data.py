"""Data parallelism: every rank holds the whole model, takes its slice of the global batch, and the gradients are
all-reduced and averaged so that every replica takes the same optimizer step (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", §3).

* naive (§3.2.1): one all-reduce per gradient, after backward.
* bucketed with overlap (§3.2.2-3.2.3): gradients are grouped into buckets of about ``bucket_mb``; a hook on each
  parameter notices when a bucket's last gradient is ready and starts its all-reduce at once, while backward goes
  on computing earlier layers; a callback autograd runs at the end of backward waits for all of them, so that
  ``loss.backward()`` returns with the gradients averaged, as with PyTorch's DDP.
* gradient accumulation (§3.2.4, ``no_sync``): inner micro-steps only accumulate local gradients; the last one syncs.

Per step each rank sends 2(n-1)/n x (gradient bytes), however the gradients are grouped. This file also holds the
training loop every scheme shares (:func:`train_loop`), and the schemes ``single`` and ``dp``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.ledgers.memory import MemoryMeter
from course_lib.model import precision
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import tiny_gpt_activation_bytes
from course_lib.model.gpt import (
    ModelFactory,
    build_model,
    count_params,
    final_params,
    make_optimizer,
    synthetic_tokens,
)
from course_lib.parallel import catalog
from course_lib.runtime import checkpoint, faults, launch


def batch_shard(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """A copy of rows ``rank*B/n .. (rank+1)*B/n`` of a global batch of B rows (a rank holds only its own)."""
    rows = tokens.shape[0] // world_size
    return tokens[rank * rows : (rank + 1) * rows].clone()


def split_into_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive groups of parameters whose gradients take at most ``bucket_bytes`` each (a larger one gets its
    own), in the gradients' dtype (fp32 main gradients: :func:`course_lib.model.precision.grad_dtype`)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes; try --bucket-mb 0.1")
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * precision.grad_dtype(p).itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def split_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive pieces of ``flat`` shaped like ``tensors`` (the inverse of concatenating them)."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def all_reduce_grads(params: list[nn.Parameter], group: Group = None, average: bool = False) -> None:
    """Sum (or average) the gradients of ``params`` over ``group`` in one flat all-reduce."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    comm.all_reduce(flat, group=group)
    if average:
        flat.div_(dist.get_world_size(group))
    for p, summed in zip(params, split_like(flat, params), strict=True):
        p.grad.copy_(summed)


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, last layer first: roughly the order in which backward produces their gradients."""
    return [p for p in reversed(list(model.parameters())) if p.requires_grad]


class ReadyGroups:
    """Calls ``on_ready(i)`` during backward as soon as every parameter of ``groups[i]`` has its gradient, and
    remembers which parameters got one since the last :meth:`reset` (``arrived``, by ``id``).

    Built on ``register_post_accumulate_grad_hook``, which fires once a leaf's gradient for this backward is
    complete (a tied parameter's two uses are summed first). ``enabled = False`` silences it (``no_sync``).
    """

    def __init__(self, groups: list[list[nn.Parameter]], on_ready: Callable[[int], None] | None = None) -> None:
        self.groups, self.on_ready = groups, on_ready
        self.enabled = True
        self.arrived: set[int] = set()
        self._missing = [len(g) for g in groups]
        for i, group in enumerate(groups):
            for p in group:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._arrived(i, p))

    def _arrived(self, i: int, p: nn.Parameter) -> None:
        if not self.enabled:
            return
        self.arrived.add(id(p))
        self._missing[i] -= 1
        if self._missing[i] == 0:
            self._missing[i] = len(self.groups[i])
            if self.on_ready is not None:
                self.on_ready(i)

    def partly_arrived(self) -> set[int]:
        """The groups some but not all of whose parameters got their gradient since the last call."""
        return {i for i, missing in enumerate(self._missing) if missing != len(self.groups[i])}

    def reset(self) -> None:
        """Forget this step's arrivals (after the gradients were synchronized, or a step was abandoned)."""
        self.arrived.clear()
        self._missing = [len(g) for g in self.groups]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No calls inside the ``with`` body (inner micro-steps of gradient accumulation)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was


class EndOfBackward:
    """Calls ``callback`` at the end of every backward pass that runs through a watched output, before
    ``backward()`` returns: autograd's final callback (``Variable._execution_engine.queue_callback``), queued by a
    hook on the output's gradient as that backward begins, once however many outputs it runs through. PyTorch's DDP
    finishes its all-reduces from such a callback (Li et al. 2020, §3.2.3), and its FSDP its post-backward work. An
    error the callback raises comes out of ``backward()`` as it is."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback, self.queued = callback, False

    def watch(self, output) -> None:
        """Hook every tensor in ``output`` (nested in tuples, lists, dicts) that requires grad. A forward starts
        afresh: a backward that raised before its end never ran its callback."""
        self.queued = False
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue)

    def _queue(self, _grad: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.queued = False
        self.callback()


class DataParallelStrategy:
    """What a data-parallel scheme adds to plain training; the loop in :func:`train_loop` calls these in order."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.coords = {"dp": dist.get_rank()}  # where this rank sits, for reports

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inner micro-steps of gradient accumulation: keep gradients local (nothing to do by default)."""
        yield

    def finish_gradients(self) -> None:
        """After the step's last backward: every rank must hold the averaged gradients it needs."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)


def broadcast_from_first(module: nn.Module | Iterable[torch.Tensor], group: Group = None) -> None:
    """Copy the group's first rank's parameters and buffers of ``module`` (or the ``tensors``) to every rank of
    ``group`` (as DDP does when it wraps a module), one broadcast per dtype, so that ranks that built their models
    differently start equal."""
    tensors = [*module.parameters(), *module.buffers()] if isinstance(module, nn.Module) else list(module)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with trace.tags(phase="init"), torch.no_grad():
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = list({id(t): t for t in tensors if t.dtype == dtype}.values())  # a tied tensor once
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            comm.broadcast(flat, src, group)
            for t, value in zip(same, split_like(flat, same), strict=True):
                t.copy_(value)


def no_gradient_error(names: list[str], consequence: str, remedy: str) -> RuntimeError:
    """The error of a wrapper that met trainable parameters without a gradient (PyTorch's DDP refuses them too)."""
    return RuntimeError(
        f"trainable parameter(s) {', '.join(dict.fromkeys(names))} got no gradient in this step, so {consequence}. "
        f"Make every trainable parameter take part in the loss, freeze the unused ones (requires_grad=False), or "
        f"{remedy}."
    )


class DataParallel(nn.Module):
    """Data parallelism around any module (Li et al. 2020, §3; PyTorch's ``DistributedDataParallel``), used as
    PyTorch's is: ``loss = model(x, y); loss.backward(); optimizer.step()``.

    At construction rank 0's parameters and buffers are broadcast to the group. Gradients are averaged in buckets of
    about ``bucket_mb`` megabytes (10^6 bytes; ``None``: one bucket for all), in backward order, or with
    ``per_parameter`` one all-reduce per gradient (§3.2.1); each bucket is divided by the n ranks before it is
    all-reduced, as PyTorch's DDP and Megatron-LM's ``gradient_scaling_factor`` do, so that a sum of fp16 gradients
    cannot overflow where one rank's does not (for n a power of two, bit for bit the sum divided). With ``overlap``
    a bucket's all-reduce starts from a backward hook as soon as its last gradient exists (§3.2.2-3.2.3); otherwise
    all start once backward has computed every gradient. Either way backward finishes the synchronization itself,
    from autograd's final callback (:meth:`_end_backward`, §3.2.3), so ``backward()`` returns with every rank's
    gradients averaged; :meth:`finish_gradient_synchronization`, which some assignments ask for, then has nothing
    left to do. Inside :meth:`no_sync` backward only accumulates (§3.2.4). Gradients are all-reduced in their own
    dtype: a bf16 one puts half of fp32's bytes on the wire, and an fp32 main gradient
    (:func:`course_lib.model.precision.grad_of`) fp32's.

    A trainable parameter that got no gradient in a backward is an error naming it, raised by that ``backward()``,
    unless ``find_unused_parameters``, which counts its gradient as zero (and then starts every all-reduce after
    backward, in the same order on every rank, since a rank cannot know during backward which gradients will never
    come).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_mb: float | None = 25.0,
        per_parameter: bool = False,
        overlap: bool = True,
        find_unused_parameters: bool = False,
        group: Group = None,
    ) -> None:
        super().__init__()
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(f"bucket size must be positive or None (one bucket), got {bucket_mb} MB")
        self.module, self.group, self.world = module, group, dist.get_world_size(group)
        broadcast_from_first(module, group)
        params = backward_order(module)
        bucket_bytes = math.inf if bucket_mb is None else bucket_mb * 1e6
        self.buckets = [[p] for p in params] if per_parameter else split_into_buckets(params, bucket_bytes)
        self.find_unused_parameters = find_unused_parameters
        self.overlap = overlap and not find_unused_parameters
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._in_flight: dict[int, tuple[torch.Tensor, comm.Handle]] = {}
        self.ready = ReadyGroups(self.buckets, self._launch if self.overlap else None)
        self.end_of_backward = EndOfBackward(self._end_backward)

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        self.end_of_backward.watch(output)
        return output

    def no_sync(self):
        """Inner micro-steps of gradient accumulation: no all-reduce, gradients add up locally; the first backward
        after the ``with`` body averages them all (§3.2.4)."""
        return self.ready.paused()

    def _launch(self, i: int) -> None:
        flat = torch.cat([precision.grad_of(p).reshape(-1) for p in self.buckets[i]]).div_(self.world)
        with trace.tags(bucket=i):
            self._in_flight[i] = flat, comm.all_reduce(flat, group=self.group, async_op=True)

    def _end_backward(self) -> None:
        """Autograd's last act in a backward outside :meth:`no_sync`: start every bucket's all-reduce that backward
        did not (all of them without overlap), wait for each and write the averages into ``.grad``. On the timeline
        a ``grad_sync`` span at the end of backward; its collectives are tagged ``phase="grad_sync"``."""
        if not self.ready.enabled:
            return  # no_sync: the gradients add up locally
        missing = [p for bucket in self.buckets for p in bucket if id(p) not in self.ready.arrived]
        self.ready.reset()
        if missing and not self.find_unused_parameters:
            self._in_flight = {}
            raise no_gradient_error(
                [self._names.get(id(p), "?") for p in missing],
                "their buckets cannot be all-reduced",
                "pass find_unused_parameters=True to count their gradients as zero",
            )
        with trace.span("compute", "grad_sync", phase="grad_sync"):
            for p in missing:
                if precision.grad_of(p) is None:
                    precision.set_grad(p, torch.zeros_like(p, dtype=precision.grad_dtype(p)))
            for i in range(len(self.buckets)):
                if i not in self._in_flight:
                    self._launch(i)
            for i in sorted(self._in_flight):
                flat, handle = self._in_flight[i]
                handle.wait()
                for p, averaged in zip(self.buckets[i], split_like(flat, self.buckets[i]), strict=True):
                    precision.grad_of(p).copy_(averaged)
            self._in_flight = {}

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do, and nothing sent: every ``backward()`` outside :meth:`no_sync` has already averaged
        the gradients (:meth:`_end_backward`). Kept for training loops written for a wrapper that needs the call
        (CS336's assignment asks for one); calling it once, twice or never gives the same step."""


class Replicated(DataParallelStrategy):
    """The shared step's hooks for a :class:`DataParallel` model: accumulation under its ``no_sync``; its backward
    synchronizes the gradients, so the grad_sync phase has nothing left to do."""

    def no_sync(self):
        return self.model.no_sync()


def micro_batches(tokens: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` equal row slices (copies) of a rank's batch."""
    return [batch_shard(tokens, k, count) for k in range(count)]


def accumulate(strategy: DataParallelStrategy, grad_accum: int, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward and backward of a rank's batch in ``grad_accum`` micro-batches (loss scaled by 1/grad_accum, all but
    the last under ``no_sync``); returns the batch's loss. Under mixed precision the forward runs under autocast and
    backward starts from the loss times the loss scale (:func:`course_lib.model.precision.autocast`, ``scaled``)."""
    device, loss_sum, optimizer = launch.rank_device(), 0.0, strategy.optimizer
    pairs = zip(micro_batches(tokens, grad_accum), micro_batches(targets, grad_accum), strict=True)
    for k, (x, y) in enumerate(pairs):
        quiet = strategy.no_sync() if k < grad_accum - 1 else contextlib.nullcontext()
        with quiet, trace.tags(microbatch=k):
            with trace.span("forward"), precision.autocast(optimizer, device):
                loss = strategy.model(x.to(device), y.to(device)) / grad_accum
            with trace.span("backward"):
                precision.scaled(loss, optimizer).backward()
        loss_sum += loss.item()
    return loss_sum


def train_loop(
    strategy: DataParallelStrategy,
    cfg: GPTConfig,
    train: TrainConfig,
    grad_accum: int = 1,
    measure_memory: bool = True,
    data_rank: int | None = None,
    data_size: int | None = None,
    run_batch: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
) -> dict:
    """Train ``strategy.model`` on this rank's share of each global batch; returns this rank's report. Every scheme
    trains through this one step body.

    Each step: ``run_batch(tokens, targets)`` runs forward and backward of the rank's batch and returns its loss
    (default: :func:`accumulate` over ``grad_accum`` micro-batches; a pipeline runs its schedule), then the
    strategy's gradient sync and the optimizer step (a ZeRO optimizer's all-gathers the parameters after it, in the
    ``param_sync`` phase) with the strategy's ``zero_grad``; under fp16 with a loss scaler a step whose gradients
    overflowed is skipped, and the report adds each step's ``loss_scale`` and the ``skipped_steps``.
    ``measure_memory`` runs the last step (the one reported) under a :class:`MemoryMeter`, whose per-operator
    bookkeeping roughly doubles a CPU step; benchmarks turn it off. The batch is split over ``data_size``
    data-parallel ranks (default: all ranks), this rank taking share ``data_rank``. Each step tells the launcher it
    began (:func:`launch.began_step`) and passes the points where an injected fault may fire
    (:func:`course_lib.runtime.faults.reach`: forward, grad_sync, optimizer).

    Checkpoints (:mod:`course_lib.runtime.checkpoint`), when the run has a plan (``run_scheme(checkpoint_dir=,
    checkpoint_every=, resume=)``): a resume loads the model's and optimizer's state before the first step and
    trains ``range(start, steps)``, ``start`` being the checkpoint's step (the data is a function of the step, so
    that is the data position); after step k's optimizer step the state is saved if the plan says so ((k+1) % K
    == 0), outside the step's tags and memory meter, by a :class:`course_lib.runtime.checkpoint.Saver` (in the
    background with an asynchronous plan), whose ``timings`` the report carries as ``checkpoint_saves``. ``losses`` are
    those of the steps that ran.
    """
    rank = dist.get_rank() if data_rank is None else data_rank
    n = dist.get_world_size() if data_size is None else data_size
    run_batch = run_batch or functools.partial(accumulate, strategy, grad_accum)
    device, optimizer = launch.rank_device(), strategy.optimizer
    losses, plan = [], checkpoint.active()
    start = checkpoint.load(plan.resume, strategy.model, optimizer) if plan and plan.resume else 0
    saver = checkpoint.Saver(plan, strategy.model, optimizer) if plan and plan.directory else None
    for step in range(start, train.steps):
        tokens, targets = (batch_shard(t, rank, n) for t in synthetic_tokens(step, train.batch, cfg, train.seed))
        metered = measure_memory and step == train.steps - 1  # the reported step
        meter = MemoryMeter(strategy.model, optimizer, device=device) if metered else None
        launch.began_step(step)
        with trace.tags(step=step), meter or contextlib.nullcontext():
            faults.reach(step, "forward")
            losses.append(run_batch(tokens, targets))
            faults.reach(step, "grad_sync")
            with trace.tags(phase="grad_sync"):
                strategy.finish_gradients()
            faults.reach(step, "optimizer")
            with trace.span("optimizer"):
                optimizer.step()
                strategy.zero_grad()
            launch.sync(device)
        if saver is not None:
            saver.after_step(step)
    report = {"losses": losses, "memory": meter.report().as_dict() if meter else None, "coords": strategy.coords}
    report |= precision.scaling_report(optimizer)
    if saver is not None:
        saver.finish()
        report["checkpoint_saves"] = saver.timings
    return report


def train_data_parallel(
    cfg: GPTConfig,
    train: TrainConfig,
    bucket_mb: float | None = 0.1,
    per_parameter: bool = False,
    overlap: bool = True,
    grad_accum: int = 1,
    measure_memory: bool = True,
    model: ModelFactory | None = None,
) -> dict:
    """Rank function: the tiny GPT (or the student's ``model``) in :class:`DataParallel` (one rank: trained as it
    is). ``per_parameter`` without ``overlap`` is the naive scheme: one all-reduce per gradient, after backward."""
    model = build_model(cfg, train, model).to(launch.rank_device())
    if dist.get_world_size() == 1:
        strategy = DataParallelStrategy(model, make_optimizer(model.parameters(), train))
    else:
        ddp = DataParallel(model, bucket_mb, per_parameter, overlap)
        strategy = Replicated(ddp, make_optimizer(ddp.parameters(), train))
    report = train_loop(strategy, cfg, train, grad_accum, measure_memory)
    return {**report, "params": final_params(model)}


# ------------------------------------------------------------------------------------------------ checks, formulas
def activation_bytes(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> int:
    """Saved activations of one micro-batch of this rank's share of the batch
    (:func:`course_lib.model.formulas.tiny_gpt_activation_bytes`)."""
    micro = train.batch // (world_size * o["grad_accum"])
    return tiny_gpt_activation_bytes(cfg, micro, train.torch_dtype.itemsize)["total"]


def on_every_rank(states: dict, world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """The same predicted ``states`` for every rank, with the activations of one micro-batch where a formula
    gives them: the dense tiny GPT's in one dtype (:func:`activation_bytes`); a student's model has none, what an
    MoE's experts save depends on the routing, and under autocast the saved tensors mix 16-bit and fp32 ones, so for
    those only the states."""
    row = dict(states)
    if o.get("model") is None and not cfg.experts and train.precision is None:
        row["activations"] = activation_bytes(world_size, cfg, train, o)
    return [dict(row) for _ in range(world_size)]


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Every rank holds the whole model: with P trainable and F frozen parameters in T trainable tensors, at the
    run's bytes per element (:func:`course_lib.model.precision.convention`: in fp32 4 for a weight and a gradient and 8
    of AdamW state; in mixed precision 2, 2 and 12 with the master copy), weights of P + F, gradients of P, optimizer
    state of P and AdamW's 4-byte step counter per tensor; and the activations of one micro-batch."""
    model = build_model(cfg, train, o.get("model"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = count_params(model, trainable_only=False) - count_params(model)
    numel = sum(p.numel() for p in trainable)
    row = precision.state_bytes(train, numel + frozen, numel, numel, len(trainable))
    return on_every_rank(row, world_size, cfg, train, o)


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank all-reduces every gradient once per step, 2(n-1)/n x eP bytes, however they are bucketed, e the
    gradients' bytes per element: half of fp32's in bf16 or fp16, fp32's for Megatron's main gradients."""
    if world_size == 1:
        return [{}]  # one data-parallel rank has nothing to synchronise
    e = precision.convention(train).grads
    sent = ring_factor("all_reduce", world_size) * e * count_params(build_model(cfg, train, o.get("model")))
    return [{"all_reduce": sent} for _ in range(world_size)]


SCHEMES = (
    catalog.scheme(
        "single", "one rank, the whole batch: the baseline", train_data_parallel, predict_memory, predict_comm
    ),
    catalog.scheme(
        "dp",
        "replicate the model, split the batch, all-reduce gradients",
        train_data_parallel,
        predict_memory,
        predict_comm,
    ),
)
