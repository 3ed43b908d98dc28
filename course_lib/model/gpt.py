"""The reference model every scheme is checked against: a tiny GPT, its synthetic data and a single-device trainer.

The model is a pre-LayerNorm decoder (Radford et al. 2019) small enough that a step takes milliseconds on one CPU
core: token embedding tied to the output head, a position embedding that can be frozen (so every scheme must cope
with a parameter that has no gradient), and ``layers`` blocks of causal self-attention and a 4x GELU MLP, or with
``experts`` > 0 a mixture of experts in place of each MLP (:class:`MoE`). Its initialisation depends only on the
seed, so every rank of every scheme builds the same model. The data is a deterministic token stream (no downloads)
with structure the model can learn, so losses fall over a few steps.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.ledgers import trace
from course_lib.model import precision
from course_lib.model.config import DATA_SEED_STRIDE, GPTConfig, TrainConfig
from course_lib.model.recompute import apply as apply_recompute
from course_lib.model.recompute import recompute


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v over (batch, heads, seq, head_dim) tensors (Vaswani et al. 2017)."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    scores = (q * (1.0 / math.sqrt(head_dim))) @ k.transpose(-2, -1)
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.selective = cfg.recompute == "selective"  # recompute the scores in backward from q, k and v
        # No bias here (as in PaLM and Llama): the key bias would get an exactly-zero gradient (adding a constant to
        # every score of a query leaves the softmax unchanged), so in floating point its gradient is rounding noise,
        # which Adam's normalised update turns into steps of size lr that no two summation orders agree on.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # What mixes the tokens, (q, k, v) -> output over (batch, heads, seq, head_dim): the one place context
        # parallelism changes (it puts ring attention here, course_lib.parallel.context).
        self.attend = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes come from qkv's output, so a tensor-parallel rank holding ``heads`` of them runs this code too (and,
        # under sequence parallelism, the whole sequence gathered by qkv). Head-major copies, so that what the
        # attention matmuls save does not depend on the batch size.
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2).contiguous() for t in self.qkv(x).chunk(3, -1))
        mixed = recompute(self.attend, q, k, v) if self.selective else self.attend(q, k, v)
        return self.proj(mixed.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass
class Routing:
    """Where a batch's tokens go: the kept (token, expert) assignments in token order, with their gates; and the
    assignments per expert before (``counts``) and after (``kept``) capacity, one row per source rank (one row on
    one device)."""

    expert: torch.Tensor
    token: torch.Tensor
    gate: torch.Tensor
    counts: torch.Tensor
    kept: torch.Tensor


def expert_capacity(cfg: GPTConfig, tokens: int) -> int:
    """Assignments an expert takes per batch of ``tokens``: ceil(tokens x top_k / experts x capacity_factor)
    (Fedus et al. 2021, §2.2)."""
    return math.ceil(tokens * cfg.top_k / cfg.experts * cfg.capacity_factor)


def within_capacity(counts: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """The assignments kept of ``counts`` (source rank x expert, the ranks' tokens in this order making the batch):
    each expert keeps the batch's first :func:`expert_capacity` in token order and drops the rest; all without a
    capacity factor."""
    if cfg.capacity_factor is None:
        return counts
    capacity = expert_capacity(cfg, int(counts.sum()) // cfg.top_k)
    before = counts.cumsum(0) - counts  # the assignments of earlier ranks' tokens
    return (capacity - before).clamp(min=0).minimum(counts)


class LocalDispatcher:
    """Every expert on this device: the reference's dispatch (see :class:`MoE`)."""

    rank = 0

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.unsqueeze(0)

    def expert_outputs(self, moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return moe.run_experts(x[routing.token], routing.expert)


class MoE(nn.Module):
    """A mixture of ``experts`` MLPs in place of a block's MLP (Shazeer et al. 2017, §2; Fedus et al. 2021 "Switch
    Transformers", §2.1-2.2; Lepikhin et al. 2020 "GShard", §2.2).

    A linear router gives each token probabilities p = softmax(W x) over the experts; the token goes to its
    ``top_k`` most probable. Its gates: with top-1 the probability itself (Switch, §2.1, so the router learns from
    the task loss too); with top-k > 1 the k probabilities renormalised to sum to 1 (GShard's top-2, Mixtral). The
    output is the gate-weighted sum of the chosen experts' outputs.

    Capacity (``capacity_factor``): each expert takes at most :func:`expert_capacity` assignments of the batch,
    first come first served in token order (a token's k choices are distinct experts); a dropped assignment
    contributes zero, so a token dropped by all its experts passes through the block on the residual alone
    (Switch, §2.2).

    Load balancing (Switch, §2.2, eq. 4-6): ``aux_loss`` = alpha x E x sum_i f_i x P_i, f_i the fraction of the
    batch's assignments routed to expert i (before capacity; no gradient) and P_i the mean router probability of
    expert i. Uniform routing gives alpha; :class:`TinyGPT` adds every layer's to the training loss.

    ``dispatcher`` decides where tokens meet their experts: :class:`LocalDispatcher` here, all-to-all between
    ranks in :mod:`course_lib.parallel.expert` (Megatron-core's token dispatchers). ``counts`` keeps the last
    batch's assignments per (source rank, expert).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(cfg) for e in range(cfg.experts)})
        self.dispatcher = LocalDispatcher()
        self.aux_loss: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def route(self, probs: torch.Tensor) -> Routing:
        """Top-k experts and gates of each token (rows of ``probs``), and which assignments capacity keeps."""
        k, experts = self.cfg.top_k, self.cfg.experts
        top, chosen = probs.topk(k, dim=-1)
        gates = top / top.sum(-1, keepdim=True) if k > 1 else top
        expert = chosen.reshape(-1)
        counts = self.dispatcher.gather_counts(torch.bincount(expert, minlength=experts))
        kept = within_capacity(counts, self.cfg)
        position = F.one_hot(expert, experts).cumsum(0).gather(1, expert.unsqueeze(1)).squeeze(1) - 1
        keep = position < kept[self.dispatcher.rank, expert]
        token = torch.arange(probs.shape[0], device=probs.device).repeat_interleave(k)
        return Routing(expert[keep], token[keep], gates.reshape(-1)[keep], counts, kept)

    def balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """alpha x E x sum_i f_i x P_i with f from ``counts`` (all source ranks) and P from these ``probs``."""
        f = counts.sum(0).to(probs.dtype) / counts.sum()
        return self.cfg.aux_loss_coef * self.cfg.experts * (f * probs.mean(0)).sum()

    def run_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its expert (``expert`` holds their indices); every expert runs, if on no rows, so
        that each gets a gradient every step."""
        out = rows.new_zeros(rows.shape)
        for name, mlp in self.experts.items():
            mine = (expert == int(name)).nonzero().squeeze(1)
            out = out.index_copy(0, mine, mlp(rows[mine]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        routing = self.route(probs)
        self.aux_loss, self.counts = self.balance_loss(probs, routing.counts), routing.counts
        weighted = self.dispatcher.expert_outputs(self, flat, routing) * routing.gate.unsqueeze(1)
        return torch.zeros_like(flat).index_add(0, routing.token, weighted).reshape(x.shape)


class Block(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(.)): one transformer layer (its MLP a :class:`MoE` with experts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.experts else MLP(cfg)
        self.full_recompute = cfg.recompute == "full"  # keep only the input, run the layer again in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self.layer, x) if self.full_recompute else self.layer(x)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final LayerNorm, output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.seq, cfg.d_model), requires_grad=not cfg.frozen_pos)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.to(dtype)
        init_weights(self, seed)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """The position embeddings of token ids (batch, seq): rows 0 .. seq-1 (a context-parallel rank, which holds
        some of each sequence's tokens, reads the rows of their global positions)."""
        return self.pos_emb[: tokens.shape[1]]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> the residual stream (batch, seq, d_model) the first block reads."""
        return self.tok_emb(tokens) + self.positions(tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits (batch, seq, vocab), through the head tied to the embedding."""
        return self.ln_f(x) @ self.tok_emb.weight.T

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last block's output -> the mean cross-entropy against ``targets``."""
        logits = self.logits(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            with trace.tags(layer=i):
                x = block(x)
        return x

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for token ids (batch, seq), or with ``targets`` the training loss: the mean cross-entropy, plus
        with experts every layer's load-balancing loss (Switch, §2.2)."""
        x = self.hidden(tokens)
        if targets is None:
            return self.logits(x)
        loss = self.output_loss(x, targets)
        return loss + sum(block.mlp.aux_loss for block in self.blocks) if self.cfg.experts else loss

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self(tokens, targets)  # through __call__, so that module hooks (FSDP's) run


def init_weights(model: nn.Module, seed: int) -> None:
    """N(0, 0.02) weights, zero biases, unit LayerNorm gains; drawn in parameter-name order from ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(0.02).to(p.dtype))


def count_params(model: nn.Module, trainable_only: bool = True) -> int:
    """Parameters counted once each (tied ones once); only those that train unless ``trainable_only=False``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def synthetic_tokens(step: int, batch: int, cfg: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (inputs, targets), each (batch, seq) token ids, the same on every rank.

    Each sequence follows x[t+1] = (a * x[t] + c) mod vocab from a random start, with one token in eight replaced
    by noise, so there is a rule to learn and the loss falls from ln(vocab).
    """
    gen = torch.Generator().manual_seed(seed * DATA_SEED_STRIDE + step)
    tokens = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (batch,), generator=gen)
    for t in range(cfg.seq):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % cfg.vocab
    noise = torch.rand(batch, cfg.seq + 1, generator=gen) < 0.125
    tokens[noise] = torch.randint(cfg.vocab, (int(noise.sum()),), generator=gen)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def make_optimizer(params: Iterable[nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (Loshchilov & Hutter 2019), with the settings every scheme uses; under
    mixed precision over fp32 copies of them (:func:`course_lib.model.precision.optimizer_class`)."""
    return precision.optimizer_class(train)([p for p in params if p.requires_grad], **optimizer_settings(train))


def optimizer_settings(train: TrainConfig) -> dict:
    """AdamW's keyword arguments in every scheme (one code path per step: ``foreach=False``)."""
    return {"lr": train.lr, "weight_decay": train.weight_decay, "eps": train.adam_eps, "foreach": False}


@dataclass
class TrainResult:
    """Per-step losses and the final parameters (by name, detached, on CPU)."""

    losses: list[float]
    params: dict[str, torch.Tensor]


def final_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


ModelFactory = Callable[[], nn.Module]


def build_model(cfg: GPTConfig, train: TrainConfig, model: ModelFactory | None = None) -> nn.Module:
    """The tiny GPT of ``cfg``; or, given a factory, the student's own model: ``model()`` called with torch's
    generator seeded by ``train.seed`` (so every rank and the reference build the same weights) and cast to
    ``train.dtype``. Either one maps ``(tokens, targets)``, (batch, seq) token ids of :func:`synthetic_tokens`, to
    the mean loss. ``cfg.recompute`` applies to either (:func:`course_lib.model.recompute.apply` for the student's);
    under mixed precision it is then held in the 16-bit type (:func:`course_lib.model.precision.prepare`)."""
    if model is None:
        return precision.prepare(TinyGPT(cfg, seed=train.seed, dtype=train.torch_dtype), train)
    torch.manual_seed(train.seed)
    return precision.prepare(apply_recompute(model().to(train.torch_dtype), cfg.recompute), train)


def check_model(cfg: GPTConfig, train: TrainConfig, model: ModelFactory) -> nn.Module:
    """Refuse, before any rank starts, a factory whose model the harness cannot train, saying what it must be;
    returns the model it built to check."""
    contract = (
        "a function (or class) taking no arguments that returns an nn.Module whose forward(tokens, targets) returns "
        "the mean loss"
    )
    if isinstance(model, nn.Module):
        raise ValueError(
            f"model must be {contract}; got a {type(model).__name__} instance: pass the class, or a function that "
            f"builds it (lambda: {type(model).__name__}(...)), so that every rank builds its own"
        )
    if not callable(model):
        raise ValueError(f"model must be {contract}; got a {type(model).__name__}")
    try:
        built = build_model(replace(cfg, recompute="none"), train, model)
    except Exception as err:
        raise ValueError(f"building your model failed: {type(err).__name__}: {err}") from err
    apply_recompute(built, cfg.recompute)  # refuses a recompute mode the model has nothing for
    if not isinstance(built, nn.Module):
        raise ValueError(f"model() returned a {type(built).__name__}; it must return {contract.split(' returns ')[1]}")
    if not any(p.requires_grad for p in built.parameters()):
        raise ValueError(f"your {type(built).__name__} has no trainable parameter: there is nothing to train")
    tokens, targets = synthetic_tokens(0, 1, cfg, train.seed)
    try:
        loss = built(tokens, targets)
    except Exception as err:
        raise ValueError(
            f"your {type(built).__name__} failed on a batch: model(tokens, targets), both of shape "
            f"{tuple(tokens.shape)} (int64 token ids below vocab={cfg.vocab}), raised {type(err).__name__}: {err}"
        ) from err
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"your {type(built).__name__}'s forward(tokens, targets) must return the mean loss, a scalar tensor "
            f"with a gradient; it returned {got}"
        )
    if torch.isnan(loss):  # an infinite one may be 16-bit overflow, which the loss scaler's report names
        raise ValueError(
            f"your {type(built).__name__}'s loss on the first batch is nan: a loss that is not a number cannot be "
            "trained (look for a log of 0, 0/0 or inf - inf)"
        )
    return built


@contextlib.contextmanager
def _importing(spec: str, where: str) -> Iterator[None]:
    """Any way importing the student's module can fail, as one ValueError naming the file and line: a syntax error,
    an exception while its top level runs (its innermost line in the module's files), or a ``sys.exit``."""
    try:
        yield
    except SyntaxError as err:
        raise ValueError(f"--model {spec!r}: {err.filename}, line {err.lineno}: {err.msg} (a syntax error)") from None
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {where}: {err}") from None
    except SystemExit as err:
        raise ValueError(
            f"--model {spec!r}: importing {where} called sys.exit({err.code!r}); a model file must not exit when it is "
            "imported: put its script part under `if __name__ == \"__main__\":`"
        ) from None
    except Exception as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_LIBRARY)]
        at = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
        raise ValueError(f"--model {spec!r}: importing {where} raised {type(err).__name__}: {err}{at}") from None


_LIBRARY = ("<frozen", str(Path(importlib.__file__).parent), str(Path(__file__).parent))  # not the student's frames


def load_factory(spec: str) -> ModelFactory:
    """The model factory named by ``FILE.py:NAME`` or ``package.module:NAME`` (the command line's ``--model``)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--model {spec!r}: give FILE.py:NAME or package.module:NAME, e.g. my_model.py:build")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"--model {spec!r}: there is no file {where}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[path.stem] = module  # so that its functions travel to the ranks by value
        with _importing(spec, where):
            loader.loader.exec_module(module)
    else:
        with _importing(spec, where):
            module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"--model {spec!r}: {where} defines no {name!r}")
    return getattr(module, name)


def train_reference(
    cfg: GPTConfig = GPTConfig(),
    train: TrainConfig = TrainConfig(),
    device: torch.device | str = "cpu",
    model: ModelFactory | None = None,
) -> TrainResult:
    """Train on one device: the ground truth that every parallel scheme must reproduce (the tiny GPT, or the
    student's ``model``, see :func:`build_model`), in the run's precision: the forward under autocast and the loss
    scaled for backward under mixed precision (:mod:`course_lib.model.precision`)."""
    device = torch.device(device)
    module = build_model(cfg, train, model).to(device)
    optimizer = make_optimizer(module.parameters(), train)
    losses = []
    for step in range(train.steps):
        tokens, targets = synthetic_tokens(step, train.batch, cfg, train.seed)
        with precision.autocast(optimizer, device):
            loss = module(tokens.to(device), targets.to(device))
        precision.scaled(loss, optimizer).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return TrainResult(losses, final_params(module))


def _same_names(a: dict, b: dict) -> None:
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))}")


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute elementwise difference between two parameter sets with the same names."""
    _same_names(a, b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def rel_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters together (2-norm): the relative error of the whole model.

    In float32 this, not the elementwise difference, is the meaningful measure after Adam steps: Adam divides by
    sqrt(v) + eps, so a weight whose gradient is near eps moves by a sizeable fraction of lr whatever its size, and
    rounding noise in g of 1e-10 (another summation order) changes that move visibly (see TrainConfig.adam_eps).
    """
    _same_names(a, b)
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)
    den = sum((b[k].double() ** 2).sum() for k in a)
    return (num / den).sqrt().item()
