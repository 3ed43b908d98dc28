"""Tensor-parallel layers in a student's own model, as an assignment would test them (Shoeybi et al. 2019, §3):
``parallelize_module`` on an MLP and an attention block trains like the same model on one process (SGD and AdamW,
float64 and float32, 2 and 4 ranks), costs one all-reduce per colwise layer backward and one per rowwise layer
forward, gives the parameters that PyTorch's own DTensor tensor parallelism gives, and refuses bad plans."""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import parallel as torch_tp

from course_lib.ledgers import comm
from course_lib.model.gpt import rel_param_diff
from course_lib.parallel.data import broadcast_from_first
from course_lib.parallel.tensor_layers import (
    ColumnParallelLinear,
    ColwiseParallel,
    RowParallelLinear,
    RowwiseParallel,
    full_parameters,
    parallelize_module,
)
from course_lib.parallel.tensor_mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel
from course_lib.runtime import launch

D, HEADS, HIDDEN, BLOCKS, BATCH, SEQ, STEPS = 16, 4, 32, 2, 3, 8, 3
RTOL = {"float64": 1e-10, "float32": 1e-5}  # float64 elementwise, float32 whole-model: rel_diff


# ------------------------------------------------------------------------------------------- the student's model
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = D // HEADS
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))
        # The key bias's gradient is exactly zero (a constant added to a query's scores leaves the softmax alone), so
        # in floating point it is rounding noise that AdamW would blow up to steps of size lr: freeze it.
        self.k.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The number of heads comes from q's output (-1), not from HEADS: after the colwise split a rank holds
        # HEADS / t of them, and this same code runs its local heads.
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D), requires_grad=False)  # a frozen parameter
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.scale


BLOCK_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise"}
BLOCK_PLAN |= {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
PLAN = {f"blocks.{i}.{name}": style for i in range(BLOCKS) for name, style in BLOCK_PLAN.items()}


def data(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, BATCH, SEQ, D, generator=g, dtype=dtype).unbind(0)


def optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6, foreach=False)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, dtype: torch.dtype) -> float:
    x, y = data(i, dtype)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def rel_diff(mine: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """float64: the largest elementwise |mine - want| / |want| (what allclose's rtol bounds); float32: the relative
    difference of the whole model, ||mine - want|| / ||want||, since AdamW turns the rounding noise of a gradient near
    its eps into visible steps of single weights (see ``course_lib.model.gpt.rel_param_diff``)."""
    want = {k: p.detach() for k, p in want.items()}
    if dtype == torch.float32:
        return rel_param_diff(mine, want)
    assert mine.keys() == want.keys()
    return max(((mine[k] - want[k]).abs() / want[k].abs()).max().item() for k in want)


# ----------------------------------------------------------------------------------------------- rank functions
def train_two_ways() -> dict:
    """Train Net on one process and split over the world, compare after every step; and the ledger of a step."""
    diffs, ledgers = {}, []
    for dtype in (torch.float64, torch.float32):
        for name in ("sgd", "adamw"):
            single = Net(dtype=dtype)
            model = parallelize_module(Net(dtype=dtype), PLAN)
            assert isinstance(model.blocks[1].mlp.fc1, ColumnParallelLinear)
            assert not model.blocks[0].attn.k.bias.requires_grad and not model.scale.requires_grad
            opts = optimizer(single, name), optimizer(model, name)
            worst = 0.0
            for i in range(STEPS):
                before = len(comm.records())
                loss = step(model, opts[1], i, dtype)
                ledgers.append(Counter((r.op, r.tags["direction"], r.tensor_bytes) for r in comm.records()[before:]))
                worst = max(worst, abs(loss - step(single, opts[0], i, dtype)) / loss)
                worst = max(worst, rel_diff(full_parameters(model), dict(single.named_parameters()), dtype))
            diffs[str(dtype).removeprefix("torch."), name] = worst
    return {"diffs": diffs, "ledgers": ledgers}


def every_check() -> dict:
    """The three rank functions of this file's equivalence tests in one world (each test reads its part)."""
    return {"train": train_two_ways(), "layers": layers_two_ways(), "pytorch": ours_and_pytorchs()}


@functools.cache
def world(t: int) -> launch.RunResult:
    """One launch of t ranks for the training, drop-in layer and PyTorch checks."""
    return launch.run(every_check, t)


# One degree in the default set: 2 ranks, two heads each (4, a head each, runs the same code); 4 is in the slow set.
DEGREES = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("t", DEGREES)
def test_a_parallelized_model_trains_like_one_process(t):
    for rank in (checks["train"] for checks in world(t)):
        for (dtype, _), diff in rank["diffs"].items():
            assert diff <= RTOL[dtype], rank["diffs"]
        # Per block and step: f all-reduces the gradient of q's, k's, v's and fc1's input in backward, g the output
        # of out and fc2 in forward (2 per colwise/rowwise pair; fusing q, k, v into one layer, as Megatron does,
        # would save 2). Every one carries a (batch, seq, d) activation; the optimizer steps need none.
        for i, ledger in enumerate(rank["ledgers"]):
            act = (8 if i < 2 * STEPS else 4) * BATCH * SEQ * D  # float64 runs first, then float32
            assert ledger == {("all_reduce", "forward", act): 2 * BLOCKS, ("all_reduce", "backward", act): 4 * BLOCKS}


def layers_two_ways() -> None:
    """Drop-in layers, f and g by hand, unshard and broadcast, against nn.Linear (float64, outputs and gradients)."""
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(D, HIDDEN, dtype=torch.float64), nn.Linear(HIDDEN, D, dtype=torch.float64)
    x = torch.randn(BATCH, SEQ, D, dtype=torch.float64, requires_grad=True)
    fc2(F.gelu(fc1(x))).square().sum().backward()

    # gather_output=True and input_is_parallel=False make each layer a drop-in nn.Linear on its own.
    col = ColumnParallelLinear.from_linear(fc1, gather_output=True)
    row = RowParallelLinear.from_linear(fc2, input_is_parallel=False)
    mine = x.detach().requires_grad_(True)
    out = row(F.gelu(col(mine)))
    out.square().sum().backward()
    torch.testing.assert_close(out, fc2(F.gelu(fc1(x))), rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, x.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(col.weight.grad, fc1.weight.grad.chunk(t, 0)[r], rtol=1e-12, atol=0)
    torch.testing.assert_close(row.weight.grad, fc2.weight.grad.chunk(t, 1)[r], rtol=1e-12, atol=0)
    for layer, linear in ((col, fc1), (row, fc2)):
        whole = layer.unshard()
        assert isinstance(whole, nn.Linear) and torch.equal(whole.weight, linear.weight)
        assert torch.equal(whole.bias, linear.bias)

    # The same MLP by hand with the public f and g: shards of the weights, one all-reduce each way.
    w1, b1, w2 = fc1.weight.chunk(t, 0)[r], fc1.bias.chunk(t, 0)[r], fc2.weight.chunk(t, 1)[r]
    mine = x.detach().requires_grad_(True)
    h = F.gelu(F.linear(copy_to_tensor_parallel(mine), w1, b1))
    (reduce_from_tensor_parallel(F.linear(h, w2)) + fc2.bias).square().sum().backward()
    torch.testing.assert_close(mine.grad, x.grad, rtol=1e-12, atol=0)

    # A model built from another seed on every rank is made identical by broadcasting rank 0's parameters.
    model = Net(seed=r)
    broadcast_from_first(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(Net(seed=0).named_parameters())[name], rtol=0, atol=0)


@pytest.mark.parametrize("t", DEGREES)
def test_layers_are_drop_in_linears_and_f_g_work_by_hand(t):
    assert [checks["layers"] for checks in world(t)] == [None] * t  # its assertions ran on every rank


def ours_and_pytorchs() -> float:
    """The same Net through our parallelize_module and PyTorch's (DTensor), AdamW in float64: parameters each step."""
    n = dist.get_world_size()
    ours = parallelize_module(Net(), PLAN)
    styles = {"colwise": torch_tp.ColwiseParallel(), "rowwise": torch_tp.RowwiseParallel()}
    theirs = torch_tp.parallelize_module(
        Net(), DeviceMesh("cpu", list(range(n))), {k: styles[v] for k, v in PLAN.items()}
    )
    opts = optimizer(ours, "adamw"), optimizer(theirs, "adamw")
    worst = 0.0
    for i in range(STEPS):
        step(ours, opts[0], i, torch.float64)
        step(theirs, opts[1], i, torch.float64)
        full = {k: p.full_tensor() if isinstance(p, DTensor) else p for k, p in theirs.named_parameters()}
        worst = max(worst, rel_diff(full_parameters(ours), full, torch.float64))
    return worst


@pytest.mark.parametrize("t", DEGREES)
def test_the_same_plan_through_pytorch_gives_the_same_parameters(t):
    for diff in (checks["pytorch"] for checks in world(t)):
        assert diff <= RTOL["float64"]


def refusals() -> None:
    model = Net()
    model.blocks[1].mlp.fc1 = nn.Linear(D, 6, dtype=torch.float64)  # 6 features do not split over 4 ranks
    bad = [
        ({"blocks.0.mlp.fc3": "colwise"}, r"'blocks.0.mlp.fc3' names no submodule of Net; its nn.Linear .*fc1"),
        ({"blocks.0.mlp": "colwise"}, r"is a MLP, not an nn.Linear.*\['blocks.0.mlp.fc1', 'blocks.0.mlp.fc2'\]"),
        ({"blocks.0.mlp.fc1": "columnwise"}, r"has style 'columnwise'; use 'colwise' or 'rowwise'"),
        ({"blocks.0.mlp.fc1": torch_tp.ColwiseParallel()}, r"course_lib's ColwiseParallel\(\).*not PyTorch's"),
        ({"blocks.0.mlp.fc2": "rowwise"}, r"no colwise layer in the plan has 32 output features.*input_is_parallel"),
        (
            {"blocks.0.attn.q": "colwise", "blocks.1.mlp.fc1": ColwiseParallel()},
            r"'blocks.1.mlp.fc1': tensor-parallel degree 4 does not divide the out_features .* = 6",
        ),
    ]
    for plan, message in bad:
        with pytest.raises(ValueError, match=message):
            parallelize_module(model, plan)
        assert not any(isinstance(m, ColumnParallelLinear | RowParallelLinear) for m in model.modules())
    parallelize_module(model, {"blocks.0.mlp.fc2": RowwiseParallel(input_is_parallel=False)})  # splits its input
    assert isinstance(model.blocks[0].mlp.fc2, RowParallelLinear)


def test_bad_plans_are_refused_with_what_to_change():
    launch.run(refusals, 4)
