"""FSDP around a module that is not the tiny GPT, as an outside assignment would check it (CS336 style): a small
model with an embedding tied to its output head, a frozen parameter and a frozen bias, built on 2, 3 and 4 gloo
ranks each seeded differently; after every step the full parameters must equal training the same model in one
process on the whole batch (float64 to 1e-10, float32 to 1e-5), and PyTorch's own ``fully_shard``, in PyTorch's loop
(``backward(); step()``) and with ``finish_gradient_synchronization()`` called as well (the same parameters, the same
bytes). Then the course's
ZeRO-3 scheme, which is the same wrapper around the tiny GPT, against the harness and its formulas."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from course_lib.harness import SCHEMES, run_scheme
from course_lib.ledgers import trace
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import TrainConfig
from course_lib.parallel import fsdp
from course_lib.parallel.fsdp import FullyShardedDataParallel
from course_lib.runtime import launch

VOCAB, WIDTH, BATCH, STEPS, SEED = 20, 8, 24, 3, 1  # 24 rows split evenly over 2, 3 and 4 ranks x 2 micro-batches


class TiedMLP(nn.Module):
    """Tokens through an embedding tied to the output head and a frozen scale, plus features through an MLP whose
    last bias is frozen, then a LayerNorm; with ``norm_trains`` False the LayerNorm runs without autograd, so it and
    the MLP get no gradient (the embedding still gets one, through the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5, requires_grad=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.mlp[2].bias.requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.norm_trains = True

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale + self.mlp(features)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.norm_trains):
            x = self.norm(x)
        return self.head(x)


def mlp_layers_and_head(model: TiedMLP) -> list[nn.Module]:
    """A custom policy: each Linear of the MLP its own unit (one with a frozen bias), and the tied head, which
    must give its weight to the root."""
    return [model.mlp[0], model.mlp[2], model.head]


NORM_OFF = {"nowhere": (), "everywhere": (0, 1, 2, 3), "on rank 0": (0,)}  # ranks where the LayerNorm gets no gradient
# name: (dtype, micro-batches, where the LayerNorm gets no gradient, wrapper options, calls of
# finish_gradient_synchronization per step; 0: PyTorch's loop)
VARIANTS = {
    "default": (torch.float64, 1, "nowhere", {}, 0),
    "default-finish-twice": (torch.float64, 1, "nowhere", {}, 2),
    "custom-policy-keep-no-prefetch-accum": (
        torch.float64,
        2,
        "nowhere",
        {"units": mlp_layers_and_head, "reshard_after_forward": False, "prefetch": False},
        1,
    ),
    "float32-no-prefetch": (torch.float32, 1, "nowhere", {"prefetch": False}, 0),
    "compute-float64-over-float32": (
        torch.float32,
        1,
        "nowhere",
        {"units": mlp_layers_and_head, "compute_dtype": torch.float64},
        0,
    ),
    "find-unused": (torch.float64, 1, "everywhere", {"find_unused_parameters": True}, 0),
    # Other ranks' units complete earlier: the reduce-scatters must still pair up. Gathering in backward would not
    # (rank 0 never runs the LayerNorm's backward), hence no resharding and no prefetching.
    "find-unused-on-rank-0": (
        torch.float64,
        1,
        "on rank 0",
        {"find_unused_parameters": True, "reshard_after_forward": False, "prefetch": False},
        0,
    ),
}


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (BATCH,), generator=gen)
    features = torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64).to(dtype)
    return tokens, features, (3 * tokens + 1) % VOCAB


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)


def rows(tensors: tuple[torch.Tensor, ...], part: int, parts: int) -> list[torch.Tensor]:
    size = tensors[0].shape[0] // parts
    return [t[part * size : (part + 1) * size] for t in tensors]


def train_wrapped(dtype: torch.dtype, accum: int, norm_off: str, options: dict, finish_calls: int) -> dict:
    """This rank's FSDP training: the full parameters after every step, and what the units held mid-step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED + rank)  # every rank builds different weights: the wrapper must broadcast rank 0's
    model = TiedMLP().to(dtype)
    model.norm_trains = rank not in NORM_OFF[norm_off]
    wrapped = FullyShardedDataParallel(model, **options)
    shards = {id(unit.shard) for unit in wrapped.units}
    module_params = {id(p) for p in model.parameters()}
    ours = {id(p) for p in wrapped.parameters()}
    optimizer = adamw(wrapped.parameters())
    params, gathered_after_forward, output_dtypes = [], [], set()
    for step in range(STEPS):
        mine = rows(batch(step, dtype), rank, n)
        for micro in range(accum):
            tokens, features, targets = rows(mine, micro, accum)
            with trace.tags(step=step):
                logits = wrapped(tokens, features)
                output_dtypes.add(str(logits.dtype))
                gathered_after_forward.append([unit.gathered for unit in wrapped.units])
                (F.cross_entropy(logits, targets) / accum).backward()
        for _ in range(finish_calls):
            wrapped.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
        params.append(wrapped.full_params())
    return {
        "params": params,
        "units": [unit.name for unit in wrapped.units],
        "parameters_are_the_shards": ours == shards and not ours & module_params,
        "gathered_after_forward": gathered_after_forward,
        "gathered_after_step": any(unit.gathered for unit in wrapped.units),
        "output_dtypes": output_dtypes,
    }


def unused_error() -> str:
    """The message backward itself raises on every rank when a parameter got no gradient."""
    torch.manual_seed(SEED + dist.get_rank())
    model = TiedMLP().double()
    model.norm_trains = False
    wrapped = FullyShardedDataParallel(model)
    tokens, features, targets = rows(batch(0, torch.float64), dist.get_rank(), dist.get_world_size())
    with pytest.raises(RuntimeError) as error:
        F.cross_entropy(wrapped(tokens, features), targets).backward()
    return str(error.value)


def train_fully_shard() -> list[dict[str, torch.Tensor]]:
    """PyTorch's FSDP2 on the default policy's units (the MLP, the LayerNorm, the root), float64, all ranks seeded
    alike (``fully_shard`` does not broadcast)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = TiedMLP().double()
    for unit in (model.mlp, model.norm, model):
        fully_shard(unit)
    optimizer = adamw(model.parameters())
    params = []
    for step in range(STEPS):
        tokens, features, targets = rows(batch(step, torch.float64), rank, n)
        F.cross_entropy(model(tokens, features), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
        params.append({name: p.detach().clone() for name, p in full.items()})
    return params


def rank_checks() -> dict:
    variants = {}
    for name, variant in VARIANTS.items():
        with trace.tags(variant=name):
            variants[name] = train_wrapped(*variant)
    return {
        "variants": variants,
        "unused_error": unused_error(),
        "fully_shard": train_fully_shard(),
    }


@functools.cache
def ranks(n: int) -> launch.RunResult:
    """One world of n ranks for all the checks (each launch costs a second or two)."""
    return launch.run(rank_checks, n)


def one_process(dtype: torch.dtype, norm_off: str, options: dict, n: int) -> list[dict[str, torch.Tensor]]:
    """The same model (rank 0's weights) on the whole batch in this process: a copy cast to the compute dtype runs
    forward and backward, and a gradient that never came counts as zero (as find_unused_parameters has it). When
    the LayerNorm trains on some ranks only, rank r's rows run as rank r does, each block's loss divided by n."""
    torch.manual_seed(SEED)
    model = TiedMLP().to(dtype)
    optimizer = adamw(model.parameters())
    compute_dtype = options.get("compute_dtype")
    blocks = n if norm_off == "on rank 0" else 1
    params = []
    for step in range(STEPS):
        compute = copy.deepcopy(model).to(compute_dtype) if compute_dtype else model
        for r in range(blocks):
            tokens, features, targets = rows(batch(step, dtype), r, blocks)
            compute.norm_trains = r not in NORM_OFF[norm_off]
            logits = compute(tokens, features.to(compute_dtype or dtype))
            (F.cross_entropy(logits, targets) / blocks).backward()
        for p, q in zip(model.parameters(), compute.parameters(), strict=True):
            if p.requires_grad:
                p.grad = torch.zeros_like(p) if q.grad is None else q.grad.to(dtype)
        optimizer.step()
        optimizer.zero_grad()
        params.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return params


def assert_same(got: list[dict], want: list[dict], dtype: torch.dtype) -> float:
    """Every step's parameters equal (float64: 1e-10, float32: 1e-5, relative); returns the largest difference."""
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    worst = 0.0
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=tolerance, atol=tolerance, msg=name)
            worst = max(worst, (mine[name] - theirs[name]).abs().max().item())
    return worst


# One world size in the default set: 3, the one whose shards need padding (2 and 4 divide every unit of TiedMLP, so
# they run the same code without it); 2 and 4 are in the slow set.
WORLD_SIZES = [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_any_module_trains_as_in_one_process_after_every_step(n, variant):
    dtype, accum, norm_off, options, _ = VARIANTS[variant]
    reference = one_process(dtype, norm_off, options, n)
    for rank in ranks(n):
        got = rank["variants"][variant]
        assert_same(got["params"], reference, dtype)
        assert got["parameters_are_the_shards"]
        assert not got["gathered_after_step"]
        if norm_off == "nowhere":  # a unit whose output needs no gradient is freed after forward anyway
            keep = not options.get("reshard_after_forward", True)
            assert all(all(units) == keep and any(units) == keep for units in got["gathered_after_forward"])
        assert got["output_dtypes"] == {str(options.get("compute_dtype", dtype))}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_calling_finish_as_well_sends_nothing_more(n):
    """PyTorch's loop and the same loop calling finish_gradient_synchronization twice per step: the same
    collectives, op for op and byte for byte."""

    def sent(records, variant):
        return [(rec.op, rec.tags.get("unit"), rec.sent_bytes) for rec in records if rec.tags.get("variant") == variant]

    for records in ranks(n).comm:
        assert sent(records, "default-finish-twice") == sent(records, "default") != []


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_prefetch_starts_the_next_units_all_gather_before_a_unit_computes(n):
    result = ranks(n)
    for variant, prefetch in (("default", True), ("float32-no-prefetch", False)):
        tags = {"variant": variant, "step": 0}.items()
        for events, records in zip(result.events, result.comm, strict=True):
            mlp = next(e for e in events if e.name == "mlp forward" and e.tags.items() >= tags)
            norm = next(
                r for r in records if r.op == "all_gather" and r.tags.get("unit") == "norm" and r.tags.items() >= tags
            )
            assert (norm.start < mlp.start) == prefetch
            assert (norm.start >= mlp.end) == (not prefetch)


def test_tied_weights_go_to_the_root_and_units_without_trainable_parameters_are_dropped():
    model = TiedMLP()
    default = fsdp.shard_plan(model, fsdp.children_with_params)
    assert [(name, [p.shape for p in params]) for name, _, params in default] == [
        ("root", [(VOCAB, WIDTH)]),  # the tied embedding/head; the frozen scale stays whole, in no unit
        ("mlp", [(2 * WIDTH, WIDTH), (2 * WIDTH,), (WIDTH, 2 * WIDTH)]),  # not the frozen bias
        ("norm", [(WIDTH,), (WIDTH,)]),
    ]
    custom = fsdp.shard_plan(model, mlp_layers_and_head)
    assert [name for name, _, _ in custom] == ["root", "mlp.0", "mlp.2"]  # the head gave its weight to the root
    assert [id(p) for p in custom[0][2]] == [id(model.embed.weight), id(model.norm.weight), id(model.norm.bias)]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_a_parameter_without_gradient_is_an_error_naming_it_on_every_rank(n):
    for rank in ranks(n):
        assert "mlp.0.weight, mlp.0.bias, mlp.2.weight, norm.weight, norm.bias got no gradient" in rank["unused_error"]
        assert "find_unused_parameters=True" in rank["unused_error"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_pytorch_fully_shard_gives_the_same_parameters(n):
    reference = one_process(torch.float64, "nowhere", {}, n)
    for rank in ranks(n):
        assert_same(rank["fully_shard"], reference, torch.float64)
        assert_same(rank["fully_shard"], rank["variants"]["default"]["params"], torch.float64)


@pytest.fixture
def zero3(monkeypatch):
    """Registers the wrapper's scheme as the registry line will."""
    monkeypatch.setitem(SCHEMES, "zero3", fsdp.SCHEMES[0])


@pytest.mark.parametrize(
    ("n", "options"), [(2, {}), (4, {"reshard_after_forward": False, "overlap": False, "grad_accum": 2})]
)
def test_course_zero3_matches_one_device_and_its_formulas(zero3, n, options):
    run = run_scheme("zero3", n, train=TrainConfig(steps=2, dtype="float64"), **options)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, sent, held in zip(run.report["ranks"], run.predicted_comm, run.predicted_memory, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent
        assert {c: rank["memory"][c] for c in CATEGORIES} == {c: held[c] for c in CATEGORIES}
        assert rank["memory"]["activations_peak"] == held["activations"]
