"""Context parallelism: the sequence split over the ranks of a context-parallel group, attention by ring attention
(Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", §3) or by all-gathering K
and V (Llama 3, Grattafiori et al. 2024, "The Llama 3 Herd of Models", §3.3.2).

Every rank keeps all parameters and the whole batch of sequences, but only its share of each sequence's tokens.
Everything outside attention is token-wise, so it runs on a rank's own tokens (the position embedding at each
token's *global* position); only attention needs the other tokens' keys and values:

* **ring** (default): each rank's K/V block travels once around the ring, N-1 send/recv steps; at each step a rank
  attends its queries to the block it holds and merges the partial result with the log-sum-exp (online-softmax)
  rule of FlashAttention (Dao et al. 2022, §3.1; Milakov & Gimelshein 2018): with partial outputs o1, o2 normalised
  over their own keys and log-sum-exps l1, l2, l = log(e^l1 + e^l2) and o = e^(l1-l) o1 + e^(l2-l) o2.
* **all-gather**: every rank all-gathers every K/V block and attends its queries to the whole sequence at once,
  as Llama 3 did for its long-context phase (cheap with grouped-query attention's few K/V heads).

**Causal load balance.** With the causal mask, a rank holding the sequence's last tokens would attend to N times
more keys than the first rank. So the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r (one
early, one late; the "zigzag" layout of ring-flash-attention and PyTorch's context parallel; Brandon et al. 2023,
"Striped Attention", balance by striping tokens instead): every rank then computes 2N+1 chunk-by-chunk blocks. Per
pair of (query chunk i, key chunk m): m < i is a full block, m = i the diagonal (causal mask), m > i skipped.

**Backward.** Each ring step is a pair of differentiable operators, :class:`PostRing` and :class:`WaitRing`:
forward, the first posts the send of the block in hand to the next rank and the receive of the previous rank's, the
attention to the block in hand runs, and the second waits (Liu et al. 2023, §3: communication overlapped with
blockwise compute); backward, :class:`WaitRing` posts the send of the received block's gradient back to the
previous rank and the receive of the gradient of the block it sent on, the attention backward of the block in hand
runs, and :class:`PostRing` waits. So autograd differentiates the blockwise attention and the merge as ordinary
operators, and dK/dV travel the ring backwards: per layer and per pass N-1 messages of 2 x (b, s/N, h), the backward
exactly mirroring the forward, each in flight while the rank computes (the program records the compute between
each Issue and its Wait, so :func:`course_lib.cluster.clock.replay` hides it). The price of this design against Liu et
al.'s own backward (which re-circulates K/V instead): each rank keeps every K/V block it received for backward, the
whole sequence's K and V, as the all-gather variant does too. The all-gather variant's backward is a reduce-scatter
of the gathered blocks' gradients to their owners.

**Loss.** Each rank's loss is the mean cross-entropy of its own b x s/N tokens; all ranks hold equally many, so
the mean of the ranks' means is the single device's mean, and averaging the gradients over the group (the
data-parallel all-reduce, :class:`course_lib.parallel.data.DataParallel`, one bucket after backward) gives exactly
the single device's gradient.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from course_lib.ledgers import comm, trace
from course_lib.ledgers.comm import Group, ring_factor
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import adamw_state_bytes
from course_lib.model.gpt import TinyGPT, count_params, final_params, make_optimizer
from course_lib.parallel import catalog
from course_lib.parallel.checks import check_context_parallel
from course_lib.parallel.data import DataParallel, Replicated, accumulate, train_loop
from course_lib.parallel.tensor import TensorParallelGPT
from course_lib.parallel.tensor_mappings import all_gather_along, ring_peer
from course_lib.runtime import launch


def chunks_of(rank: int, n: int) -> tuple[int, int]:
    """The two of the 2n sequence chunks that rank ``rank`` of ``n`` holds: one early, one late."""
    return rank, 2 * n - 1 - rank


def local_positions(seq: int, rank: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens, its two chunks in order, out of a sequence of ``seq``."""
    c = seq // (2 * n)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of(rank, n)])


def ring_blocks(n: int, balanced: bool = True) -> list[list[tuple[int, int, int, str]]]:
    """What ring attention computes, per rank: (ring step, query chunk, key chunk, "full" or "diagonal") for every
    chunk-by-chunk block of the causal mask it attends, the sequence in 2n chunks. At step t rank r holds the K/V
    of rank (r - t) mod n. ``balanced``: rank r holds chunks r and 2n-1-r (:func:`chunks_of`); else the contiguous
    chunks 2r and 2r+1, whose last rank computes 4n-1 blocks against the first's 3."""
    held = [chunks_of(r, n) if balanced else (2 * r, 2 * r + 1) for r in range(n)]
    return [
        [
            (t, i, m, "full" if m < i else "diagonal")
            for t in range(n)
            for i in held[r]
            for m in held[(r - t) % n]
            if m <= i
        ]
        for r in range(n)
    ]


def sequence_shard(x: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of (batch, seq, ...) ``x``: chunks r and 2n-1-r of each sequence, (batch, seq/n, ...)."""
    return x.index_select(1, local_positions(x.shape[1], rank, n, x.device))


class RingStep:
    """One ring step's send and receive in flight, shared by the two operators that start and finish it."""

    def __init__(self, group: Group) -> None:
        self.group, self.layer = group, trace.current_tags().get("layer")
        self.handles: list[comm.Handle] = []

    def post(self, x: torch.Tensor, offset: int, direction: str) -> torch.Tensor:
        """Post the send of ``x`` to the rank ``offset`` ahead on the ring and the receive of what the rank
        ``offset`` behind sends; returns the receive buffer, to be read only after :meth:`wait`."""
        x, out = x.contiguous(), torch.empty_like(x)
        with trace.tags(direction=direction, **({"layer": self.layer} if self.layer is not None else {})):
            self.handles = [
                comm.isend(x, ring_peer(self.group, offset), self.group),
                comm.irecv(out, ring_peer(self.group, -offset), self.group),
            ]
        return out

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []


class PostRing(torch.autograd.Function):
    """Start a ring step: forward, post the send of a K/V block to the next rank and the receive of the previous
    rank's (the result is filled once :class:`WaitRing` has waited); backward, wait for the gradient that
    :class:`WaitRing`'s backward posted: this block's gradient, from the rank it was sent to."""

    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return step.post(x, 1, "forward")

    @staticmethod
    def backward(ctx, grad):
        ctx.step.wait()
        return grad, None


class WaitRing(torch.autograd.Function):
    """Finish a ring step: forward, wait until the block :class:`PostRing` posted has arrived; backward, post the
    send of its gradient back to the previous rank and the receive of the gradient of the block this rank sent on,
    which :class:`PostRing`'s backward waits for."""

    @staticmethod
    def forward(ctx, received, step):
        ctx.step = step
        step.wait()
        return received

    @staticmethod
    def backward(ctx, grad):
        return ctx.step.post(grad, -1, "backward"), None


class GatherKV(torch.autograd.Function):
    """All-gather every rank's K/V block along dim 0 (rank order) forward; reduce-scatter the gradient to the
    blocks' owners backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.layer = group, trace.current_tags().get("layer")
        with trace.tags(direction="forward"):
            return all_gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        with trace.tags(direction="backward", layer=ctx.layer):
            comm.reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


Partial = tuple[torch.Tensor, torch.Tensor]  # (output normalised over its keys, log-sum-exp of its scores)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, future: torch.Tensor | None = None) -> Partial:
    """Attention of (already scaled) queries ``q`` to the keys ``k`` alone, ``future`` masking the pairs a query may
    not see: the softmax-weighted values and the log-sum-exp of each query's scores (FlashAttention's m + log l)."""
    scores = q @ k.transpose(-2, -1)
    if future is not None:
        scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return (scores - lse).exp() @ v, lse


def merge(a: Partial, b: Partial) -> Partial:
    """Two partial attentions of the same queries over disjoint keys, as one over their union (online softmax)."""
    lse = torch.logaddexp(a[1], b[1])
    return a[0] * (a[1] - lse).exp() + b[0] * (b[1] - lse).exp(), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Causal attention of this rank's tokens to the whole sequence, each rank holding chunks r and 2N-1-r of it
    (:func:`sequence_shard`): q, k, v are (batch, heads, 2c, head_dim); the K/V blocks go around the ring in N-1
    steps and each query chunk merges the blocks it may see (Liu et al. 2023, §3).

    Each step overlaps its communication with compute, as Liu et al. do (§3, "overlapping communication with
    computation"): the next block's send and receive are posted (:class:`PostRing`) before the attention to the
    block in hand and waited for after it (:class:`WaitRing`). Backward mirrors it: a block's gradient is posted
    before the attention backward of the block the rank held one step earlier and waited for after it, because
    autograd runs, among the nodes ready, the one created last first (here: the wait's backward, which posts)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    diagonal = torch.ones(q.shape[-2] // 2, q.shape[-2] // 2, dtype=torch.bool, device=q.device).triu(1)
    kv = torch.stack([k, v])
    done: list[Partial | None] = [None, None]  # per local query chunk
    for step in range(n):
        if step < n - 1:
            in_flight = RingStep(group)
            incoming = PostRing.apply(kv, in_flight)
        held = zip(kv[0].chunk(2, -2), kv[1].chunk(2, -2), chunks_of((r - step) % n, n), strict=True)
        for k_chunk, v_chunk, m in held:
            for slot, (q_chunk, i) in enumerate(zip(q.chunk(2, -2), chunks_of(r, n), strict=True)):
                if m <= i:
                    block = attend_block(q_chunk, k_chunk, v_chunk, diagonal if m == i else None)
                    done[slot] = block if done[slot] is None else merge(done[slot], block)
        if step < n - 1:
            kv = WaitRing.apply(incoming, in_flight)
    return torch.cat([out for out, _ in done], dim=-2)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Causal attention of this rank's tokens to the whole sequence after all-gathering every rank's K and V
    (Llama 3 §3.3.2); the mask compares global positions, so the gathered keys need no reordering."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    seq = n * q.shape[-2]
    kv = GatherKV.apply(torch.stack([k, v]), group)  # (2n, ...): K and V of rank 0, of rank 1, ...
    keys, values = (kv[i::2].movedim(0, 2).flatten(2, 3) for i in (0, 1))  # (batch, heads, seq, head_dim)
    q_pos = local_positions(seq, r, n, q.device)
    k_pos = torch.cat([local_positions(seq, j, n, q.device) for j in range(n)])
    out, _ = attend_block(q * (1.0 / math.sqrt(q.shape[-1])), keys, values, k_pos > q_pos[:, None])
    return out


ATTENTION = {"ring": ring_attention, "all-gather": all_gather_attention}


class GlobalPositions:
    """For a model of the tiny GPT's family (:class:`course_lib.model.gpt.TinyGPT`) whose blocks attend over a
    context-parallel group (:func:`attend_over`): its tokens' position embeddings at their global positions."""

    cfg: GPTConfig
    pos_emb: torch.Tensor
    cp: int
    cp_rank: int

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.pos_emb[local_positions(self.cfg.seq, self.cp_rank, self.cp, tokens.device)]


def attend_over(model: TinyGPT, group: Group, kv: str) -> None:
    """Make every block of ``model`` attend over the context-parallel ``group`` by ``kv`` ("ring" or
    "all-gather"); the model learns its place in the group (``cp``, ``cp_rank``)."""
    model.cp, model.cp_rank = dist.get_world_size(group), dist.get_rank(group)
    check_context_parallel(model.cfg, model.cp, kv)
    for block in model.blocks:
        block.attn.attend = functools.partial(ATTENTION[kv], group=group)


class ContextParallelGPT(GlobalPositions, TinyGPT):
    """The tiny GPT on this rank's share of each sequence (:func:`sequence_shard`), all parameters whole: the
    position embedding read at global positions, attention by ``kv`` ("ring" or "all-gather") over ``group``."""

    def __init__(
        self, cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32, group: Group = None, kv: str = "ring"
    ) -> None:
        super().__init__(cfg, seed, dtype)
        attend_over(self, group, kv)


class TensorContextParallelGPT(GlobalPositions, TensorParallelGPT):
    """The tensor-parallel GPT (:class:`course_lib.parallel.tensor.TensorParallelGPT`, over ``group``) on this
    rank's share of each sequence: its heads of every block attend over the context-parallel ``cp_group``, so a
    rank holds its TP shard of the heads and its CP chunks of the tokens; under ``sp`` the TP group further splits
    those tokens (Megatron-LM's composition of TP, SP and CP; Llama 3 §3.3.2)."""

    def __init__(
        self,
        cfg: GPTConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        group: Group = None,
        sp: bool = False,
        cp_group: Group = None,
        kv: str = "ring",
    ) -> None:
        super().__init__(cfg, seed, dtype, group, sp)
        attend_over(self, cp_group, kv)


def context_parallel_batch(strategy: Replicated, grad_accum: int, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Forward and backward of this rank's tokens of the whole batch (:func:`course_lib.parallel.data.accumulate`);
    returns the mean loss over them."""
    r, n = dist.get_rank(), dist.get_world_size()
    return accumulate(strategy, grad_accum, sequence_shard(tokens, r, n), sequence_shard(targets, r, n))


def train_context_parallel(
    cfg: GPTConfig, train: TrainConfig, kv: str = "ring", grad_accum: int = 1, measure_memory: bool = True
) -> dict:
    """Rank function: the whole world is one context-parallel group; every rank sees every sequence of the batch,
    its own tokens of each; the gradients are averaged over the group after backward (one bucket)."""
    model = ContextParallelGPT(cfg, train.seed, train.torch_dtype, kv=kv).to(launch.rank_device())
    ddp = DataParallel(model, bucket_mb=None, overlap=False)
    strategy = Replicated(ddp, make_optimizer(ddp.parameters(), train))
    strategy.coords = {"cp": model.cp_rank}
    run_batch = functools.partial(context_parallel_batch, strategy, grad_accum)
    report = train_loop(strategy, cfg, train, grad_accum, measure_memory, data_rank=0, data_size=1, run_batch=run_batch)
    return {**report, "params": final_params(model)}


# ------------------------------------------------------------------------------------------------ checks, formulas
def kv_block_bytes(cfg: GPTConfig, micro_batch: int, world_size: int, element_size: int, tp: int = 1) -> int:
    """One rank's stacked K and V of one layer for one micro-batch: 2 x (b, s/N, h) elements (h/t of them: the
    rank's heads, inside a tensor-parallel group of ``tp``)."""
    return element_size * 2 * micro_batch * cfg.seq // world_size * cfg.d_model // tp


def kv_traffic(cfg: GPTConfig, micro_batch: int, n: int, element_size: int, kv: str, passes: int, tp: int = 1) -> dict:
    """Bytes a rank of a context-parallel group of ``n`` sends, by op, for ``passes`` forward and backward passes of
    one layer over micro-batches of ``micro_batch`` sequences, with B = :func:`kv_block_bytes`: ring, N-1 sends of B
    forward and N-1 of their gradients backward (receives send nothing); all-gather, an all-gather of the N blocks
    (N B bytes) forward and a reduce-scatter of their gradients backward, each (N-1)/N x N B. Recomputation
    (selective or full, ``cfg.recompute``) runs the forward's K/V passes again in backward."""
    block = kv_block_bytes(cfg, micro_batch, n, element_size, tp)
    forwards = 1 + (cfg.recompute != "none")
    if kv == "ring":
        return {"send": float((forwards + 1) * (n - 1) * block * passes), "recv": 0.0} if n > 1 else {}
    gathered = ring_factor("all_gather", n) * n * block * passes
    return {"all_gather": forwards * gathered, "reduce_scatter": gathered}


def _ring_slot_elements(blocks: int, b: int, heads: int, c: int, h: int) -> int:
    """Elements autograd keeps for one query chunk of c tokens that merges ``blocks`` c x c blocks: per block its
    scores and their exponentials (b a c^2 each) and log-sum-exp (b a c); per merge the two rescaling factors
    (2 b a c) and the two outputs it rescales (2 b c h), and from the second merge on the merged log-sum-exp it
    starts from (b a c)."""
    return (
        blocks * (2 * b * heads * c * c + b * heads * c)
        + (blocks - 1) * (2 * b * heads * c + 2 * b * c * h)
        + (max(blocks - 2, 0) * b * heads * c)
    )


def context_parallel_activation_bytes(
    cfg: GPTConfig, micro_batch: int, element_size: int, n: int, rank: int, kv: str
) -> int:
    """Exact saved-activation bytes of one forward of the tiny GPT on rank ``rank`` of ``n`` context-parallel ranks
    (what :class:`course_lib.ledgers.memory.MemoryMeter` measures), with L = s/N local tokens.

    Token-wise parts, as :func:`course_lib.model.formulas.tiny_gpt_activation_bytes` counts them for L tokens: per layer
    13Lbh + 4Lb elements outside the attention core (LayerNorms, qkv and projection inputs, the MLP), outside the
    layers the token ids, final LayerNorm, head input, log-softmax and loss (and, when the position embedding
    trains, the L int64 global positions its lookup keeps). Attention per layer: the scaled queries
    Lbh and the whole sequence's K and V, 2sbh (every received or gathered block is kept for backward); then
    all-gather: the L x s scores and their exponentials (2 a L s b), the log-sum-exp a L b and the L x s boolean
    mask; ring: for each local query chunk the blocks it merges (:func:`_ring_slot_elements`; chunk i sees i+1
    blocks, so rank r's two chunks merge r+1 and 2N-r), and the c x c diagonal mask.

    Recomputation (``cfg.recompute``): ``selective`` keeps the attention core's local q, k and v (3Lbh) in place of
    all of the above, ``full`` a layer's input (Lbh).
    """
    s, b, h, a, v, e = cfg.seq, micro_batch, cfg.d_model, cfg.heads, cfg.vocab, element_size
    local, mask = s // n, 0
    if cfg.recompute == "full":
        per_layer = local * b * h
    elif cfg.recompute == "selective":
        per_layer = 16 * local * b * h + 4 * local * b
    elif kv == "ring":
        c = local // 2
        per_layer = 13 * local * b * h + 4 * local * b + local * b * h + 2 * s * b * h
        per_layer += sum(_ring_slot_elements(i + 1, b, a, c, h) for i in chunks_of(rank, n))
        mask = c * c
    else:
        per_layer = 13 * local * b * h + 4 * local * b + local * b * h + 2 * s * b * h
        per_layer += 2 * a * local * s * b + a * local * b
        mask = local * s
    ids = 2 * 8 * b * local + 8 * local * (not cfg.frozen_pos)  # tokens, targets; positions for a trained pos_emb
    outside = ids + e * (2 * local * b * h + 2 * local * b + local * b * v + 1)
    return cfg.layers * (e * per_layer + mask) + outside


def predict_memory(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Every rank holds the whole model and AdamW's state for it (as data parallelism does), and the activations
    of one micro-batch of its tokens (:func:`context_parallel_activation_bytes`)."""
    model, e = TinyGPT(cfg), train.torch_dtype.itemsize
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = count_params(model, trainable_only=False) - count_params(model)
    row = adamw_state_bytes(e, count_params(model), frozen, len(trainable))
    micro = train.batch // o["grad_accum"]
    return [
        row | {"activations": context_parallel_activation_bytes(cfg, micro, e, world_size, r, o["kv"])}
        for r in range(world_size)
    ]


def predict_comm(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> list[dict]:
    """Per rank and step, for each layer and micro-batch, the K/V traffic of :func:`kv_traffic`; then the
    all-reduce of the gradients, 2(N-1)/N x e P."""
    n, e, accum = world_size, train.torch_dtype.itemsize, o["grad_accum"]
    row = kv_traffic(cfg, train.batch // accum, n, e, o["kv"], cfg.layers * accum)
    row["all_reduce"] = ring_factor("all_reduce", n) * e * count_params(TinyGPT(cfg))
    return [dict(row) for _ in range(n)]


SCHEMES = (
    catalog.scheme(
        "cp",
        "context parallel: split every sequence, ring attention (or all-gather) for K and V",
        train_context_parallel,
        predict_memory,
        predict_comm,
    ),
)
