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
column-parallel linear becomes t-1 ring steps, the chunk in hand multiplied while the next one travels; the
reduce-scatter after a row-parallel linear passes running sums around the ring, each rank computing its part of the
next chunk while the sum of that chunk travels to it. Backward does the same with the mirrored collectives. Each
step is an ``isend``/``irecv`` pair issued before the matmul and waited for after it, so the modeled clock
(:func:`course_lib.cluster.clock.replay`) overlaps them; a rank sends t-1 messages of S/t, the ring collective's (t-1)/t
of S. The embedding's reduce-scatter (no matmul beside it) and its backward all-gather stay collectives.

This module is the scheme: :class:`TensorParallelGPT`, its vocabulary-parallel embedding and cross-entropy, the rank
function, and the checks and predictions. The layers it is built from, which also split a student's own model with
PyTorch's names (``parallelize_module``), are :mod:`course_lib.parallel.tensor_layers`; f, g, SP's operators and
async TP's ring collectives are :mod:`course_lib.parallel.tensor_mappings`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.ledgers import trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import adamw_state_bytes, tiny_gpt_activation_bytes
from course_lib.model.gpt import TinyGPT, count_params, make_optimizer
from course_lib.parallel import catalog
from course_lib.parallel.checks import check_tensor_parallel
from course_lib.parallel.data import DataParallelStrategy, all_reduce_grads, train_loop
from course_lib.parallel.interface import Scheme
from course_lib.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_async_tp,
    column_parallel_linear,
)
from course_lib.parallel.tensor_mappings import (
    ReduceFromTensorParallel,
    ReduceScatterToSequence,
    all_reduce,
    direction_tags,
    gather_param,
    shard_of,
)
from course_lib.runtime import launch
from course_lib.runtime.checkpoint_state import Box, Held, whole


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary rows [lo, hi) (Megatron's _VocabParallelCrossEntropy)."""

    @staticmethod
    def forward(ctx, logits, targets, lo, group):
        ctx.layer = None
        with direction_tags(ctx, "forward"):
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
                heads = shard_of(attn.qkv.weight.unflatten(0, (3, h)), 1, r, t).flatten(0, 1)  # [q_r; k_r; v_r]
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
        """This rank's shards for :mod:`course_lib.runtime.checkpoint`, each placed in its one-device parameter."""
        return [
            Held(name, p, *placement(name, p.shape, self.tp_rank, self.tp))
            for name, p in self.named_parameters()
            if p.requires_grad
        ]


def unshard(name: str, p: torch.Tensor, group: Group, hidden: int) -> torch.Tensor:
    """The whole parameter ``name`` from this rank's shard ``p`` (all-gathers over the tensor-parallel group)."""
    split, t = sharding(name), dist.get_world_size(group)
    if split == "rows":
        full = gather_param(p, 0, group)
    elif split == "columns":
        full = gather_param(p, 1, group)
    elif split == "heads":  # [q_0; k_0; v_0; q_1; ...] -> (t, 3, h/t, h) -> (3, t, h/t, h) -> (3h, h)
        full = gather_param(p, 0, group).unflatten(0, (t, 3, hidden // t)).transpose(0, 1).flatten(0, 2)
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
    bytes (:func:`course_lib.parallel.tensor_mappings.ring_all_gather`, ``ring_reduce_scatter``); a rank sends
    (t-1) S/t, what the ring collective sends."""
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


def placement(name: str, shard: tuple[int, ...], r: int, t: int) -> tuple[tuple[int, ...], tuple[Box, ...]]:
    """The one-device shape of parameter ``name`` and where rank ``r`` of ``t``'s shard of shape ``shard`` sits in
    it, as :class:`course_lib.runtime.checkpoint_state.Box` boxes: one for ``rows`` (a block of rows) and ``columns`` (a
    block of columns), three for ``heads`` (the fused qkv's [q_r; k_r; v_r]: rows r h/t .. (r+1) h/t of each of q, k
    and v), the whole tensor when it is not split."""
    shard = tuple(shard)
    split = sharding(name)
    if split is None or t == 1:
        return shard, whole(shard)
    zeros = (0,) * len(shard)
    if split == "heads":
        third = shard[0] // 3  # h/t rows of each of q, k, v
        blocks = tuple(Box((j * third, 0), (j * third * t + r * third, 0), (third, shard[1])) for j in range(3))
        return (3 * third * t, shard[1]), blocks
    dim = 0 if split == "rows" else 1
    shape = tuple(n * t if d == dim else n for d, n in enumerate(shard))
    at = tuple(r * n if d == dim else 0 for d, n in enumerate(shard))
    return shape, (Box(zeros, at, shard),)


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """A rank holds 1/t of every split matrix (and of the vocabulary), LayerNorms and row-parallel biases whole,
    with AdamW's states for them, and the activations of the whole batch as
    :func:`course_lib.model.formulas.tiny_gpt_activation_bytes` counts them for one rank of t (and under SP)."""
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


def _scheme(name: str, summary: str, sp: bool) -> Scheme:
    return catalog.scheme(name, summary, functools.partial(train_tensor_parallel, sp=sp), predict_memory, predict_comm)


SCHEMES = (
    _scheme("tp", "Megatron tensor parallel: split every layer's matmuls", sp=False),
    _scheme("sp", "tensor + sequence parallel: shard the rest along the sequence", sp=True),
)
