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


def norm_and_embedding(model: TiedMLP) -> list[nn.Module]:
    """Parameters kept whole on every rank: the LayerNorm's and the embedding's (tied to the head, so the root is
    left with nothing and dropped)."""
    return [model.norm, model.embed]


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
        {"units": mlp_layers_and_head, "compute_dtype": torch.float64, "replicate": norm_and_embedding},
        0,
    ),
    "find-unused": (torch.float64, 1, "everywhere", {"find_unused_parameters": True}, 0),
    "replicate-norm-and-embedding": (torch.float64, 2, "nowhere", {"replicate": norm_and_embedding}, 0),
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
        if step == 0:
            pieces = {
                name: (p.detach().clone(), p.grad if p.grad is None else p.grad.clone())
                for name, p in model.named_parameters()
                if p.requires_grad
            }
            full_grads = wrapped.full_grads()
        optimizer.step()
        optimizer.zero_grad()
        params.append(wrapped.full_params())
    return {
        "params": params,
        "pieces": pieces,  # after step 0's backward: each trainable parameter and its .grad, as this rank has them
        "full_grads": full_grads,
        "module_params": {name: p.detach().clone() for name, p in model.named_parameters()},  # after training
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


def train_fully_shard() -> dict:
    """PyTorch's FSDP2 on the default policy's units (the MLP, the LayerNorm, the root), float64, all ranks seeded
    alike (``fully_shard`` does not broadcast): the full parameters after every step, and after step 0's backward
    each gradient whole (``full_tensor()``) and whether every ``.grad`` (a DTensor) has its parameter's shape."""
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
        if step == 0:
            trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            grads = {name: p.grad.full_tensor().clone() for name, p in trainable}
            own_shapes = all(p.grad.shape == p.shape for _, p in trainable)
        optimizer.step()
        optimizer.zero_grad()
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
        params.append({name: p.detach().clone() for name, p in full.items()})
    return {"params": params, "grads": grads, "grads_have_their_parameters_shapes": own_shapes}


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


def one_process(dtype: torch.dtype, norm_off: str, options: dict, n: int) -> tuple[list[dict], dict]:
    """The same model (rank 0's weights) on the whole batch in this process: a copy cast to the compute dtype runs
    forward and backward, and a gradient that never came counts as zero (as find_unused_parameters has it). When
    the LayerNorm trains on some ranks only, rank r's rows run as rank r does, each block's loss divided by n.
    Returns the parameters after every step and step 0's gradients."""
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
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
        params.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return params, grads


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
    reference, _ = one_process(dtype, norm_off, options, n)
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
    kept = fsdp.replicated_params(model, norm_and_embedding)
    assert [id(p) for p in kept] == [id(model.embed.weight), id(model.norm.weight), id(model.norm.bias)]
    assert [name for name, _, _ in fsdp.shard_plan(model, fsdp.children_with_params, kept)] == ["mlp"]
    custom = fsdp.shard_plan(model, mlp_layers_and_head)
    assert [name for name, _, _ in custom] == ["root", "mlp.0", "mlp.2"]  # the head gave its weight to the root
    assert [id(p) for p in custom[0][2]] == [id(model.embed.weight), id(model.norm.weight), id(model.norm.bias)]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_a_parameter_without_gradient_is_an_error_naming_it_on_every_rank(n):
    for rank in ranks(n):
        assert "mlp.0.weight, mlp.0.bias, mlp.2.weight, norm.weight, norm.bias got no gradient" in rank["unused_error"]
        assert "find_unused_parameters=True" in rank["unused_error"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_pytorch_fully_shard_gives_the_same_parameters_and_gradients(n):
    reference, grads = one_process(torch.float64, "nowhere", {}, n)
    for rank in ranks(n):
        theirs = rank["fully_shard"]
        assert_same(theirs["params"], reference, torch.float64)
        assert_same(theirs["params"], rank["variants"]["default"]["params"], torch.float64)
        assert theirs["grads_have_their_parameters_shapes"]
        assert_same([theirs["grads"], rank["variants"]["default"]["full_grads"]], [grads, grads], torch.float64)


def _concatenated_pieces(result: launch.RunResult, variant: str, which: int) -> dict[str, torch.Tensor]:
    """Every rank's piece of each parameter (``which`` 0) or of its gradient (1), end to end in rank order."""
    names = result[0]["variants"][variant]["pieces"]
    return {name: torch.cat([r["variants"][variant]["pieces"][name][which] for r in result]) for name in names}


def _replicated_names(options: dict) -> set[str]:
    model = TiedMLP()
    kept = {id(p) for p in fsdp.replicated_params(model, options.get("replicate"))}
    return {name for name, p in model.named_parameters() if id(p) in kept}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_after_backward_every_parameter_has_its_gradient_of_its_own_shape(n, variant):
    """Outside forward and backward each module parameter is this rank's piece of its flattened values (whole when
    replicated) and its .grad that piece of the averaged gradient, in the shards' dtype (float32 under a float64
    compute dtype); every rank's pieces end to end make the whole, and full_grads() gathers it: one process's
    gradients on the whole batch. Replicated parameters' gradients are whole and the same on every rank."""
    dtype, _, norm_off, options, _ = VARIANTS[variant]
    _, reference = one_process(dtype, norm_off, options, n)
    torch.manual_seed(SEED)
    initial = {name: p.detach() for name, p in TiedMLP().to(dtype).named_parameters()}  # rank 0's, broadcast
    kept = _replicated_names(options)
    result = ranks(n)
    first = result[0]["variants"][variant]
    values, grads = _concatenated_pieces(result, variant, 0), _concatenated_pieces(result, variant, 1)
    for rank in result:
        got = rank["variants"][variant]
        assert got["pieces"].keys() == reference.keys() == got["full_grads"].keys()
        for name, (value, grad) in got["pieces"].items():
            assert grad.shape == value.shape and grad.dtype == value.dtype == dtype, name
            assert value.shape == reference[name].shape if name in kept else value.dim() == 1, name
            if name in kept:
                assert torch.equal(value, initial[name]) and torch.equal(grad, first["full_grads"][name]), name
        assert_same([got["full_grads"]], [reference], dtype)
    for name in reference.keys() - kept:
        assert torch.equal(values[name], initial[name].flatten()), name
        assert torch.equal(grads[name], first["full_grads"][name].flatten()), name


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_replicated_parameters_stay_whole_equal_on_every_rank_and_are_all_reduced(n):
    """replicate= keeps the LayerNorm and the tied embedding whole on every rank, trained as in one process; a step
    sends what ZeRO-3 sends for the one sharded unit left (the MLP: two all-gathers and a reduce-scatter per
    micro-batch, (n-1)/n of its padded bytes each) and one all-reduce of the replicas' gradients, 2(n-1)/n of
    theirs, per micro-batch; replicas are never gathered."""
    variant = "replicate-norm-and-embedding"
    dtype, accum, norm_off, options, _ = VARIANTS[variant]
    reference, _ = one_process(dtype, norm_off, options, n)
    kept = _replicated_names(options)
    assert kept == {"embed.weight", "norm.weight", "norm.bias"}
    model = TiedMLP()
    ((name, _, sharded),) = fsdp.shard_plan(
        model, fsdp.children_with_params, fsdp.replicated_params(model, norm_and_embedding)
    )
    assert name == "mlp"
    padded, whole = -(-sum(p.numel() for p in sharded) // n) * n, sum(reference[-1][k].numel() for k in kept)
    result = ranks(n)
    for rank, records in zip(result, result.comm, strict=True):
        got = rank["variants"][variant]
        assert got["units"] == ["replicated", "mlp"]
        for k in kept:
            assert torch.equal(got["module_params"][k], result[0]["variants"][variant]["module_params"][k])
            torch.testing.assert_close(got["module_params"][k], reference[-1][k], rtol=1e-10, atol=1e-10)
        for step in range(STEPS):
            sent: dict[tuple[str, str], float] = {}
            for rec in records:
                if rec.tags.get("variant") == variant and rec.tags.get("step") == step:
                    key = (rec.op, rec.tags.get("unit"))
                    sent[key] = sent.get(key, 0) + rec.sent_bytes
            assert sent == {
                ("all_gather", "mlp"): 2 * accum * (n - 1) / n * 8 * padded,
                ("reduce_scatter", "mlp"): accum * (n - 1) / n * 8 * padded,
                ("all_reduce", "replicated"): accum * 2 * (n - 1) / n * 8 * whole,
            }


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
