"""Expert parallelism for the MoE tiny GPT (Lepikhin et al. 2020, "GShard", §2.2-3; Fedus et al. 2021, "Switch
Transformers", §2.1-2.2 and Fig. 4; DeepSeek-AI 2024, "DeepSeek-V3", §3.2-3.4 for EP folded over DP).

The world's n ranks are one expert-parallel group: rank r holds experts r E/n .. (r+1) E/n - 1 of every MoE layer
and a replica of everything else (attention, LayerNorms, embeddings, the routers). Each rank takes its 1/n of the
batch, as data parallelism does, and the dense gradients are averaged over the same ranks after backward: EP folded
over DP, as DeepSeek-V3 trains. Per MoE layer and step:

1. route the rank's tokens (top-k, gates);
2. all-gather the per-expert counts, one row per rank (n x E integers): every rank then knows the split sizes of
   both all-to-alls, the global f_i of the balance loss and, with a capacity factor, which assignments the batch
   drops (torchtitan exchanges the counts with an all-to-all instead, which gives a rank only its own experts'
   column: enough for the splits, but not for f_i or for capacity over the whole batch);
3. dispatch: all-to-all the token rows, sorted by expert, to the ranks that own their experts (uneven splits);
4. run the local experts on what arrived; combine: all-to-all the outputs back (the same splits, swapped), and sum
   them with the gates at their tokens. Backward runs the two all-to-alls again in reverse.

Exactly the single-device step, by three choices:

* **Loss scaling.** Rank r's loss is its share's mean cross-entropy, and the reference's is the mean over the n
  shares. A dense parameter's gradient on rank r is that of rank r's loss alone, and the all-reduce averages them,
  as in DP. An expert's gradient, though, already sums every rank's loss (their tokens came to it through the
  all-to-all, and the gradients went back the same way), so it is divided by n instead of all-reduced.
* **Balance loss over the global batch.** f_i comes from the all-gathered counts, the same on every rank; P_i is
  linear in the tokens and carries the gradient, so each rank uses the mean probability of its own tokens: the mean
  over ranks of alpha E sum_i f_i P_i(rank) is the reference's alpha E sum_i f_i P_i, value and gradient, with no
  collective on the probabilities. (A rank's own loss is therefore not the reference's; their mean is.)
* **Capacity over the global batch.** The reference keeps each expert's first C assignments in token order; the
  global order is rank 0's tokens, then rank 1's, ... (each rank's share is a block of rows), so a rank keeps an
  assignment if the earlier ranks' counts for that expert plus its position among its own stay below C. Every rank
  computes this from the gathered counts before dispatching, so a dropped token is never sent.

Micro-batches would route and cap per micro-batch, not per batch, so the scheme takes no ``grad_accum``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import adamw_state_bytes
from course_lib.model.gpt import MoE, Routing, TinyGPT, count_params, final_params, make_optimizer, within_capacity
from course_lib.parallel import catalog
from course_lib.parallel.data import DataParallelStrategy, all_reduce_grads, train_loop
from course_lib.runtime import launch


def exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group) -> torch.Tensor:
    """Rows of ``x`` to the group's ranks, ``input_splits[j]`` of them to rank j, and ``output_splits[j]`` rows from
    rank j (one all-to-all)."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), output_splits, input_splits, group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`exchange` forward; backward sends the rows' gradients back where the rows came from."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        with trace.tags(direction="forward"):
            return exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        with trace.tags(direction="backward"):
            return exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def local_experts(experts: int, rank: int, world_size: int) -> range:
    """The experts rank ``rank`` of ``world_size`` holds: a contiguous block of E/n."""
    per = experts // world_size
    return range(rank * per, (rank + 1) * per)


def rows_between(kept: torch.Tensor, ranks: int) -> torch.Tensor:
    """The token rows each source rank sends each destination rank, (source, destination), from the kept
    assignments per (source rank, expert) of a group of ``ranks``: one row per assignment, to the rank holding the
    expert (:func:`local_experts`); the diagonal is what stays on its rank."""
    return kept.unflatten(1, (ranks, -1)).sum(2)


class AllToAllDispatcher:
    """Tokens to the ranks that own their experts and back, by all-to-all (Megatron-core's
    ``MoEAlltoAllTokenDispatcher``); the counts by all-gather (see the module docstring).

    ``counts_group`` (default: ``group``) is the group whose counts decide capacity and the balance loss's f_i: a
    grid gathers them over all its data-parallel shares (:mod:`course_lib.parallel.three_d`), of which the EP group
    ``group`` must be consecutive rows. ``rank`` is this rank's row of the gathered counts."""

    def __init__(self, experts: int, group: Group = None, counts_group: Group = None) -> None:
        self.group, self.n = group, dist.get_world_size(group)
        self.counts_group = group if counts_group is None else counts_group
        self.rank, me = dist.get_rank(self.counts_group), dist.get_rank(group)
        self.first = self.rank - me  # the row of the EP group's first rank
        if counts_group is not None:
            rows = [dist.get_group_rank(counts_group, r) for r in dist.get_process_group_ranks(group)]
            if rows != list(range(self.first, self.first + self.n)):
                raise ValueError(f"the EP group's ranks are rows {rows} of the counts, not consecutive ones in order")
        self.local = local_experts(experts, me, self.n)

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every rank's assignments per expert, (ranks of ``counts_group``, E); forward only, tagged ``counts``."""
        out = counts.new_empty((dist.get_world_size(self.counts_group), counts.numel()))
        with trace.tags(phase="counts"):
            comm.all_gather(out.view(-1), counts, self.counts_group)
        return out

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The rows of this rank's kept assignments, sorted by expert, sent to their experts' ranks; returns the rows
        that arrived here (by source rank, then expert), the local expert of each, and the plan to send them back."""
        order = routing.expert.argsort(stable=True)
        kept = routing.kept[self.first : self.first + self.n]  # the EP group's rows, (source, expert)
        per_rank = rows_between(kept, self.n)
        me = self.rank - self.first
        send, receive = per_rank[me].tolist(), per_rank[:, me].tolist()
        rows = AllToAll.apply(x[routing.token[order]], receive, send, self.group)
        mine = kept[:, self.local.start : self.local.stop]
        expert = torch.arange(self.local.start, self.local.stop, device=x.device).repeat(self.n)
        return rows, expert.repeat_interleave(mine.reshape(-1)), (order, send, receive)

    def combine(self, rows: torch.Tensor, plan: tuple) -> torch.Tensor:
        """The inverse of :meth:`dispatch`: ``rows`` back to their source ranks, in the routing's order."""
        order, send, receive = plan
        back = AllToAll.apply(rows, send, receive, self.group)
        return back[order.argsort()]

    def expert_outputs(self, moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        rows, expert, plan = self.dispatch(x, routing)
        return self.combine(moe.run_experts(rows, expert), plan)


def shard_experts(moe: MoE, group: Group = None, counts_group: Group = None) -> None:
    """Keep only this rank's experts of ``moe`` (under their single-device names) and dispatch by all-to-all over
    ``group`` (counts gathered over ``counts_group``, default ``group``: see :class:`AllToAllDispatcher`)."""
    moe.dispatcher = AllToAllDispatcher(moe.cfg.experts, group, counts_group)
    for e in range(moe.cfg.experts):
        if e not in moe.dispatcher.local:
            del moe.experts[str(e)]


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the MoE layers' experts (each on one rank only)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def split_experts(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``model``'s trainable parameters outside the experts (dense: replicated, averaged like data parallelism's),
    and its experts' (:func:`expert_params`)."""
    experts = expert_params(model)
    held = {id(p) for p in experts}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in held], experts


def finish_expert_gradients(experts: list[nn.Parameter], replicas: Group | None, shares: int) -> None:
    """The experts' gradients after backward: the all-to-all has already summed into them the losses of the ranks
    whose tokens they took, so sum them over the ``replicas`` holding the same experts (the expert-data-parallel
    group; None when each expert has one copy), then divide by the ``shares`` the batch was split into, as an
    average of the ranks' losses would (see the module docstring)."""
    if replicas is not None:
        all_reduce_grads(experts, replicas)
    for p in experts:
        p.grad.div_(shares)


class RoutingLog:
    """What the MoE layers of a module routed, step by step: in ``steps``, per step the counts of every forward
    pass of an MoE layer (ranks of its counts' group x experts), in the order they ran (per microbatch, per layer).
    A forward hook records each; :meth:`end_step` closes the step."""

    def __init__(self, module: nn.Module) -> None:
        self.steps: list[list] = []
        self._step: list = []
        for moe in (m for m in module.modules() if isinstance(m, MoE)):
            moe.register_forward_hook(self._record)

    def _record(self, moe: MoE, args, out) -> None:
        self._step.append(moe.counts.tolist())

    def end_step(self) -> None:
        self.steps.append(self._step)
        self._step = []


class ExpertParallelStrategy(DataParallelStrategy):
    """After backward: average the dense gradients over the ranks; divide the experts' by n (see the module
    docstring: the all-to-all has already summed every rank's contribution into them)."""

    def __init__(self, model: TinyGPT, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.coords = {"ep": dist.get_rank()}
        self.dense, self.experts = split_experts(model)
        self.routing = RoutingLog(model)  # per step, per layer: assignments per (source rank, expert)

    def finish_gradients(self) -> None:
        self.routing.end_step()
        all_reduce_grads(self.dense, average=True)
        finish_expert_gradients(self.experts, None, dist.get_world_size())


def train_expert_parallel(cfg: GPTConfig, train: TrainConfig, measure_memory: bool = True) -> dict:
    """Rank function: the MoE tiny GPT with this rank's experts, its share of the batch. Besides the usual report,
    ``counts``: per step and layer, the assignments per (source rank, expert) before capacity, the same on every
    rank; the all-to-all bytes follow from them (:func:`all_to_all_bytes`), and the load per expert."""
    model = TinyGPT(cfg, train.seed, train.torch_dtype).to(launch.rank_device())
    for block in model.blocks:
        shard_experts(block.mlp)
    strategy = ExpertParallelStrategy(model, make_optimizer(model.parameters(), train))
    report = train_loop(strategy, cfg, train, measure_memory=measure_memory)
    return {**report, "params": final_params(model), "counts": strategy.routing.steps}


# ------------------------------------------------------------------------------------------------ checks, formulas
def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Every rank holds the dense parameters and E/n of each layer's experts, with their gradients and AdamW
    states. No activations: what the experts save depends on how many tokens the router sends each rank."""
    model = TinyGPT(cfg)
    dense, experts = split_experts(model)
    share = cfg.experts // world_size
    held = sum(p.numel() for p in dense) + sum(p.numel() for p in experts) // cfg.experts * share
    tensors = len(dense) + len(experts) // cfg.experts * share
    frozen = count_params(model, trainable_only=False) - count_params(model)
    row = adamw_state_bytes(train.torch_dtype.itemsize, held, frozen, tensors)
    return [dict(row) for _ in range(world_size)]


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """The collectives that do not depend on the routing: per MoE layer the all-gather of n x E int64 counts, and
    the all-reduce of the dense gradients, 2(n-1)/n x their bytes. The all-to-alls follow from the router's counts:
    :func:`routed_comm`."""
    model, n = TinyGPT(cfg), world_size
    dense = count_params(model) - sum(p.numel() for p in expert_params(model))
    row = {
        "all_gather": ring_factor("all_gather", n) * cfg.layers * n * cfg.experts * 8,
        "all_reduce": ring_factor("all_reduce", n) * dense * train.torch_dtype.itemsize,
    }
    return [dict(row) for _ in range(n)]


def all_to_all_bytes(counts: list, cfg: GPTConfig, train: TrainConfig, ep: int | None = None) -> list[float]:
    """Each row's (source rank's) all-to-all bytes in a step whose layers routed ``counts`` (per layer, source rank
    x expert: one step of what the rank function reports). Capacity is over all the rows; the EP groups are blocks
    of ``ep`` consecutive rows (default: one group of all of them). Rank r sends the rows of its kept assignments
    owned by other ranks of its EP group (dispatch) and the rows they sent it (combine), d_model elements each;
    backward sends the same again, reversed."""
    row_bytes = cfg.d_model * train.torch_dtype.itemsize
    sources = len(counts[0])
    n = ep or sources
    sent = [0.0] * sources
    for layer in counts:
        kept = within_capacity(torch.tensor(layer), cfg)
        for first in range(0, sources, n):
            per_rank = rows_between(kept[first : first + n], n)
            for r in range(n):
                away = per_rank[r].sum() - per_rank[r, r]
                arrived = per_rank[:, r].sum() - per_rank[r, r]
                sent[first + r] += 2 * float(away + arrived) * row_bytes
    return sent


def routed_comm(results: list[dict], cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Each rank's all-to-all bytes in the last step, from the counts its ranks report (:func:`all_to_all_bytes`)."""
    return [{"all_to_all": sent} for sent in all_to_all_bytes(results[0]["counts"][-1], cfg, train)]


SCHEMES = (
    catalog.scheme(
        "ep",
        "MoE experts split over the ranks, tokens sent to them by all-to-all",
        train_expert_parallel,
        predict_memory,
        predict_comm,
        routed_comm=routed_comm,
    ),
)
