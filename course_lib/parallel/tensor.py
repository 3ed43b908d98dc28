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
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import comm, launch, trace
from course_lib.comm import Group, ring_factor
from course_lib.memory import adamw_state_bytes, tiny_gpt_activation_bytes
from course_lib.models import GPTConfig, TinyGPT, TrainConfig, count_params, make_optimizer
from course_lib.parallel.data import DataParallelStrategy, all_reduce_grads, train_loop
from course_lib.parallel.interface import Scheme


def _direction(ctx, direction: str):
    """Tags for a collective inside an autograd Function: the layer it belongs to and the pass."""
    return trace.tags(direction=direction, **({"layer": ctx.layer} if ctx.layer is not None else {}))


def _remember_layer(ctx) -> None:
    ctx.layer = trace.current_tags().get("layer")


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, op=op, group=group)
    return out


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h): all-gather along the sequence."""
    t = dist.get_world_size(group)
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x.detach().contiguous(), group=group)  # autograd is handled by the callers' Functions
    return out.unflatten(0, (t, x.shape[0])).transpose(0, 1).flatten(1, 2)


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


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, sp: bool
) -> torch.Tensor:
    """x W_r^T + b_r for this rank's output columns; x arrives whole (through f) or as sequence shards (SP)."""
    if sp:
        return GatherSequenceLinear.apply(x, weight, bias, group)
    return F.linear(CopyToTensorParallel.apply(x, group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """A linear layer holding this rank's output columns (rows of the weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, sp: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sp)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (g: all-reduce, or reduce-scatter to sequence shards under SP), then + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, group: Group, sp: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())
        self.group, self.sp = group, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        reduce = ReduceScatterToSequence if self.sp else ReduceFromTensorParallel
        return reduce.apply(partial, self.group) + self.bias


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
    """The tiny GPT with every block split over a tensor-parallel group (and, with ``sp``, its sequence).

    It is built from the same seed as the reference and then split, so rank r holds exactly its shard of the
    reference's weights under the reference's parameter names.
    """

    def __init__(
        self, cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32, group: Group = None, sp: bool = False
    ) -> None:
        super().__init__(cfg, seed, dtype)
        t, r = dist.get_world_size(group), dist.get_rank(group)
        check_tensor_parallel(cfg, t, sp)
        self.group, self.sp, self.tp, self.tp_rank = group, sp, t, r
        h, v = cfg.d_model, cfg.vocab
        self.vocab_lo = r * v // t
        with torch.no_grad():
            self.tok_emb.weight = nn.Parameter(self.tok_emb.weight[self.vocab_lo : self.vocab_lo + v // t].clone())
            for block in self.blocks:
                attn, mlp = block.attn, block.mlp
                heads = _shard(attn.qkv.weight.unflatten(0, (3, h)), 1, r, t).flatten(0, 1)  # [q_r; k_r; v_r]
                attn.qkv = ColumnParallelLinear(heads, None, group, sp)
                attn.proj = RowParallelLinear(_shard(attn.proj.weight, 1, r, t), attn.proj.bias, group, sp)
                attn.heads = cfg.heads // t
                mlp.fc1 = ColumnParallelLinear(
                    _shard(mlp.fc1.weight, 0, r, t), _shard(mlp.fc1.bias, 0, r, t), group, sp
                )
                mlp.fc2 = RowParallelLinear(_shard(mlp.fc2.weight, 1, r, t), mlp.fc2.bias, group, sp)

    def _positions(self, seq: int) -> torch.Tensor:
        """The position embeddings of this rank's tokens: all of them, or its sequence shard under SP."""
        pos = self.pos_emb[:seq]
        return pos.chunk(self.tp, 0)[self.tp_rank] if self.sp else pos

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup summed over the group (all-reduce, or reduce-scatter to sequence shards)."""
        mine = (tokens >= self.vocab_lo) & (tokens < self.vocab_lo + self.tok_emb.weight.shape[0])
        local = F.embedding((tokens - self.vocab_lo) * mine, self.tok_emb.weight) * mine.unsqueeze(-1)
        with trace.tags(layer="embedding"):
            reduce = ReduceScatterToSequence if self.sp else ReduceFromTensorParallel
            return reduce.apply(local, self.group) + self._positions(tokens.shape[1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, (batch, seq, vocab / t)."""
        with trace.tags(layer="head"):  # the tied output head: a column-parallel linear over the vocabulary
            return column_parallel_linear(self.ln_f(x), self.tok_emb.weight, None, self.group, self.sp)

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(x)
        with trace.tags(layer="loss"):
            return VocabParallelCrossEntropy.apply(logits, targets, self.vocab_lo, self.group)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        return sequence_parallel_params(self)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under the reference's names (all-gathers the shards; every rank must call it)."""
        return {name: unshard(name, p, self.group, self.cfg.d_model) for name, p in self.named_parameters()}


def unshard(name: str, p: torch.Tensor, group: Group, hidden: int) -> torch.Tensor:
    """The whole parameter ``name`` from this rank's shard ``p`` (all-gathers over the tensor-parallel group)."""
    split, t = sharding(name), dist.get_world_size(group)
    if split == "rows":
        full = _gather(p, group).flatten(0, 1)
    elif split == "columns":
        full = _gather(p, group).permute(1, 0, 2).flatten(1, 2)
    elif split == "heads":  # (t, 3, h/t, h) -> (3, t, h/t, h) -> (3h, h)
        full = _gather(p, group).unflatten(1, (3, hidden // t)).transpose(0, 1).flatten(0, 2)
    else:
        full = p.detach()
    return full.detach().cpu().clone()


def sequence_parallel_params(module: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters applied to sequence shards (LayerNorms, row-parallel biases): under SP each rank's
    gradient covers its shard only, so the tensor-parallel group must sum them."""
    rows = [m.bias for m in module.modules() if isinstance(m, RowParallelLinear)]
    norms = [p for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    return rows + norms


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
) -> list[tuple]:
    """Every collective a tensor-parallel rank makes in one step of one batch, as (layer, direction, op, tensor
    bytes); by default the whole model, or a pipeline stage's ``layers`` with the embedding if ``first`` and the
    head and loss if ``last``.

    Per layer: TP, all-reduces of the (b, s, h) activations, 2 forward (after each row-parallel linear) and 2
    backward (before each column-parallel linear). SP: each becomes an all-gather or reduce-scatter of the same
    size (S = e b s h, the whole sequence), plus, in backward, an all-gather per column-parallel linear to rebuild
    the input it kept sharded. Outside: the embedding, the tied head, the cross-entropy's three all-reduces of
    e b s bytes, and under SP one all-reduce of the sequence-parallel parameters' gradients.
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
    out = [(i, d, op, S) for i in layers for d, op in layer]
    out += [
        (where, d, op, S) for where, d, op in ends if (where == "embedding" and first) or (where == "head" and last)
    ]
    out += [("loss", "forward", "all_reduce", small)] * 3 * last
    return out


def sequence_parallel_grad_bytes(cfg: GPTConfig, element_size: int, layers: int, last: bool = True) -> int:
    """Bytes of the gradients SP sums over the group after backward: per layer two LayerNorms (4h) and two
    row-parallel biases (2h), and the final LayerNorm (2h) on the stage that holds it."""
    return element_size * (6 * cfg.d_model * layers + 2 * cfg.d_model * last)


def _shard(w: torch.Tensor, dim: int, r: int, t: int) -> torch.Tensor:
    return w.chunk(t, dim)[r].clone()


def _gather(p: torch.Tensor, group: Group) -> torch.Tensor:
    t = dist.get_world_size(group)
    out = p.new_empty((t, *p.shape))
    with trace.tags(phase="final"):
        comm.all_gather(out.view(t * p.shape[0], *p.shape[1:]), p.detach().contiguous(), group=group)
    return out


def check_tensor_parallel(cfg: GPTConfig, tp: int, sp: bool) -> None:
    """Refuse a degree that does not divide the heads, the MLP width, the vocabulary or (with SP) the sequence."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be at least 1, not {tp}")
    sizes = {"heads": cfg.heads, "MLP width (ffn_mult x d_model)": cfg.ffn_mult * cfg.d_model, "vocab": cfg.vocab}
    if sp:
        sizes["sequence length (sequence parallel)"] = cfg.seq
    for what, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"tensor-parallel degree {tp} does not divide the {what} = {size}: each rank must get an equal "
                f"share. Use a degree that divides {size}."
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


def train_tensor_parallel(cfg: GPTConfig, train: TrainConfig, sp: bool = False, measure_memory: bool = True) -> dict:
    """Rank function: the whole world is one tensor-parallel group; every rank sees the whole batch."""
    model = TensorParallelGPT(cfg, train.seed, train.torch_dtype, sp=sp).to(launch.rank_device())
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
    """Every collective of :func:`collectives_per_step` in ring accounting, and under SP the all-reduce of the
    sequence-parallel gradients (:func:`sequence_parallel_grad_bytes`)."""
    e, t, row = train.torch_dtype.itemsize, world_size, {}
    for *_, op, nbytes in collectives_per_step(cfg, train.batch, e, o["sp"]):
        row[op] = row.get(op, 0.0) + ring_factor(op, t) * nbytes
    if o["sp"]:
        row["all_reduce"] += ring_factor("all_reduce", t) * sequence_parallel_grad_bytes(cfg, e, cfg.layers)
    return [dict(row) for _ in range(world_size)]


def _scheme(name: str, summary: str, sp: bool) -> Scheme:
    train = functools.partial(train_tensor_parallel, sp=sp)
    return Scheme(name, summary, train, validate, predict_memory, predict_comm, axes=("tp",))


SCHEMES = (
    _scheme("tp", "Megatron tensor parallel: split every layer's matmuls", sp=False),
    _scheme("sp", "tensor + sequence parallel: shard the rest along the sequence", sp=True),
)
