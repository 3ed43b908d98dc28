"""Tensor and sequence parallelism: layer, block and training equivalence, the ledger per layer, activation memory
per rank against the formulas, and the LayerNorm-gradient bug class of sequence parallelism."""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES, MemoryMeter
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import tiny_gpt_activation_bytes
from course_lib.model.gpt import Block, TinyGPT, synthetic_tokens
from course_lib.parallel.tensor import (
    TensorParallelGPT,
    TensorParallelStrategy,
    collectives_per_step,
    sequence_parallel_grad_bytes,
)
from course_lib.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear
from course_lib.parallel.tensor_mappings import gather_sequence
from course_lib.runtime import launch

CFG = GPTConfig()


def mlp_two_ways(sp):
    """Column- then row-parallel linear against two nn.Linear, outputs and gradients (float64)."""
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(8, 16, dtype=torch.float64), torch.nn.Linear(16, 8, dtype=torch.float64)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    reference = fc2(torch.relu(fc1(x)))
    reference.pow(2).sum().backward()

    col = ColumnParallelLinear(fc1.weight.chunk(t, 0)[r], fc1.bias.chunk(t, 0)[r], None, sp)
    row = RowParallelLinear(fc2.weight.chunk(t, 1)[r], fc2.bias, None, sp)
    mine = x.detach().chunk(t, 1)[r] if sp else x.detach()
    mine.requires_grad_(True)
    out = row(torch.relu(col(mine)))
    full = gather_sequence(out, None) if sp else out
    out.pow(2).sum().backward() if sp else full.pow(2).sum().backward()
    grad_x = x.grad.chunk(t, 1)[r] if sp else x.grad
    return {
        "out": (full - reference).abs().max().item(),
        "grad_x": (mine.grad - grad_x).abs().max().item(),
        "grad_w1": (col.weight.grad - fc1.weight.grad.chunk(t, 0)[r]).abs().max().item(),
        "grad_w2": (row.weight.grad - fc2.weight.grad.chunk(t, 1)[r]).abs().max().item(),
    }


def layers_and_blocks_two_ways() -> dict:
    """The MLP and the block, each without and with SP, in one world: one launch for the two tests below."""
    return {
        (kind, sp): fn(sp) for kind, fn in (("mlp", mlp_two_ways), ("block", block_two_ways)) for sp in (False, True)
    }


@functools.cache
def layers_and_blocks(t: int) -> launch.RunResult:
    return launch.run(layers_and_blocks_two_ways, t)


# One degree in the default set: 4 ranks (2 runs the same code); 2 is in the slow set.
DEGREES = [pytest.param(2, marks=pytest.mark.slow), 4]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", DEGREES)
def test_column_then_row_parallel_linear_equals_nn_linear(t, sp):
    for rank in layers_and_blocks(t):
        assert max(rank["mlp", sp].values()) < 1e-12, rank["mlp", sp]


def block_two_ways(sp):
    r, t = dist.get_rank(), dist.get_world_size()
    reference_model = TinyGPT(CFG, dtype=torch.float64)
    model = TensorParallelGPT(CFG, dtype=torch.float64, sp=sp)
    x = torch.randn(2, CFG.seq, CFG.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_x = x.clone().requires_grad_(True)
    reference = reference_model.blocks[0](ref_x)
    reference.square().sum().backward()
    mine = (x.chunk(t, 1)[r] if sp else x).clone().requires_grad_(True)
    out = model.blocks[0](mine)
    out.square().sum().backward()
    full = gather_sequence(out.detach(), None) if sp else out.detach()
    want_grad = ref_x.grad.chunk(t, 1)[r] if sp else ref_x.grad
    ln_grad = model.blocks[0].ln1.weight.grad.clone()
    if sp:
        dist.all_reduce(ln_grad)  # under SP each rank holds the LayerNorm gradient of its shard
    return (
        (full - reference).abs().max().item(),
        (mine.grad - want_grad).abs().max().item(),
        (ln_grad - reference_model.blocks[0].ln1.weight.grad).abs().max().item(),
    )


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("t", DEGREES)
def test_a_block_equals_the_reference_block(t, sp):
    assert isinstance(TinyGPT(CFG).blocks[0], Block)
    for rank in layers_and_blocks(t):
        out, grad, ln = rank["block", sp]
        assert out < 1e-12 and grad < 1e-12 and ln < 1e-12


@functools.cache
def float32_run(scheme: str, t: int):
    """Three float32 steps: the training check reads the result, the collectives check reads its step 0."""
    return run_scheme(scheme, t, train=TrainConfig(steps=3))


# Each scheme in both dtypes in the default set: float32 (the frozen position table) on 2 ranks, on the runs the
# collectives check reads too; float64 (a trained position table) with the ledger on 4. The rest is slow.
@pytest.mark.parametrize("scheme", ["tp", "sp"])
@pytest.mark.parametrize("t", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_matches_one_device_in_float32(scheme, t):
    fp32 = float32_run(scheme, t).report
    assert fp32["max_abs_loss_diff"] <= 1e-5 and fp32["rel_param_diff"] <= 1e-5


@pytest.mark.parametrize("scheme", ["tp", "sp"])
@pytest.mark.parametrize("t", DEGREES)
def test_training_matches_one_device_in_float64_and_ledger_equals_formulas(scheme, t):
    # A trained position embedding too: under SP each rank adds the rows of its sequence shard, so TP sums them.
    run = run_scheme(scheme, t, GPTConfig(frozen_pos=False), TrainConfig(steps=2, dtype="float64"))
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, predicted in zip(run.report["ranks"], run.predicted_memory, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == run.predicted_comm[rank["rank"]]
        assert all(rank["memory"][c] == predicted[c] for c in CATEGORIES)
        assert rank["memory"]["activations_peak"] == predicted["activations"]
        assert rank["coords"] == {"tp": rank["rank"]}


@pytest.mark.parametrize("t", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_per_layer_are_two_forward_and_two_backward(t):
    per_layer = {}
    for scheme in ("tp", "sp"):
        run = float32_run(scheme, t)
        records = [r for r in run.result.comm[0] if r.tags.get("step") == 0]
        seen = Counter((r.tags.get("layer"), r.tags.get("direction"), r.op, r.tensor_bytes) for r in records)
        sp_sum = [(None, None, "all_reduce", sequence_parallel_grad_bytes(CFG, 4, CFG.layers))] * (scheme == "sp")
        assert seen == Counter(collectives_per_step(CFG, 8, 4, scheme == "sp") + sp_sum)
        per_layer[scheme] = {
            d: sum(r.sent_bytes for r in records if r.tags.get("layer") == 0 and r.tags.get("direction") == d)
            for d in ("forward", "backward")
        }
        layer0 = Counter((r.tags["direction"], r.op) for r in records if r.tags.get("layer") == 0)
        if scheme == "tp":
            assert layer0 == {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
        else:
            assert layer0 == {
                ("forward", "all_gather"): 2,
                ("forward", "reduce_scatter"): 2,
                ("backward", "reduce_scatter"): 2,
                ("backward", "all_gather"): 4,
            }
    S = 4 * 8 * CFG.seq * CFG.d_model
    assert per_layer["tp"]["forward"] == per_layer["sp"]["forward"] == 2 * 2 * (t - 1) / t * S
    # Backward: SP's pairs cost what TP's all-reduces cost, plus one all-gather per column-parallel linear to
    # rebuild the input it kept sharded.
    assert per_layer["sp"]["backward"] == per_layer["tp"]["backward"] + 2 * (t - 1) / t * S


def activations(sp):
    model = TensorParallelGPT(CFG, sp=sp)
    tokens, targets = synthetic_tokens(0, 4, CFG)
    with MemoryMeter(model) as meter:
        model.loss(tokens, targets)
    return meter.activations_peak


@pytest.mark.parametrize("t", [1, pytest.param(2, marks=pytest.mark.slow), 4])  # 1: nothing split; 2 as 4
def test_activation_bytes_per_rank_equal_the_formula(t):
    tp, sp = launch.run(lambda: (activations(False), activations(True)), t)[0]  # one world for both
    assert tp == tiny_gpt_activation_bytes(CFG, 4, tp=t)["total"]
    assert sp == tiny_gpt_activation_bytes(CFG, 4, tp=t, sp=True)["total"]
    per_layer = {sp: tiny_gpt_activation_bytes(CFG, 4, tp=t, sp=sp)["per_layer"] for sp in (False, True)}
    one_device = tiny_gpt_activation_bytes(CFG, 4)["per_layer"]
    s, b, h = CFG.seq, 4, CFG.d_model
    replicated = 4 * (4 * s * b * h + 4 * s * b) + s * s  # LayerNorm inputs and stats, column inputs, the mask
    # TP alone: the part between the column- and row-parallel linears shrinks by t, the rest stays whole.
    assert per_layer[False] == replicated + (one_device - replicated) // t
    # TP + SP: everything but the (tiny, boolean) causal mask shrinks by t.
    assert per_layer[True] == (one_device - s * s) // t + s * s


def layernorm_grads(sync):
    model = TensorParallelGPT(CFG, sp=True)
    strategy = TensorParallelStrategy(model, TrainConfig())
    tokens, targets = synthetic_tokens(0, 4, CFG)
    model.loss(tokens, targets).backward()
    if sync:
        strategy.finish_gradients()
    return [p.grad.clone() for p in model.sequence_parallel_params()]


@pytest.mark.parametrize("t", DEGREES)
def test_replicated_parameters_get_identical_gradients_on_every_rank(t):
    def same_on_all(ranks):
        return all(torch.equal(a, b) for other in ranks[1:] for a, b in zip(ranks[0], other, strict=True))

    synced, forgotten = zip(*launch.run(lambda: (layernorm_grads(True), layernorm_grads(False)), t), strict=True)
    assert same_on_all(synced)
    # The production bug class: forget the sum and every rank's LayerNorms train on their own shard.
    assert not same_on_all(forgotten)


@pytest.mark.parametrize(
    ("cfg", "t", "scheme", "message"),
    [
        (GPTConfig(heads=4), 3, "tp", "tensor-parallel degree 3 does not divide the heads = 4"),
        (GPTConfig(heads=8, d_model=64, vocab=100), 8, "tp", "does not divide the vocab = 100"),
        (GPTConfig(seq=30, heads=2, d_model=64), 4, "sp", "does not divide the heads = 2"),
        (GPTConfig(seq=30), 4, "sp", "does not divide the sequence length \\(sequence parallel\\) = 30"),
    ],
)
def test_sizes_that_do_not_divide_are_named(cfg, t, scheme, message):
    with pytest.raises(ValueError, match=message):
        run_scheme(scheme, t, cfg=cfg)


def test_a_tensor_parallel_group_across_nodes_pays_the_bandwidth_ratio():
    from course_lib.cluster.clock import replay, ring_latency_steps
    from course_lib.cluster.profiles import PROFILES

    run = run_scheme("tp", 4, train=TrainConfig(steps=1), hardware="h100", gpus_per_node=4)
    h100 = PROFILES["h100"]
    inside = run.modeled
    across = replay(run.result.programs, run.result.comm, "h100", gpus_per_node=2)
    steps = sum(ring_latency_steps(r.op, 4) for r in run.result.comm[0] if r.tags.get("step") == 0)
    bandwidth_inside = inside.ranks[0].comm_s - steps * h100.intra_latency_s
    bandwidth_across = across.ranks[0].comm_s - steps * h100.inter_latency_s
    assert bandwidth_across == pytest.approx(bandwidth_inside * h100.intra_bandwidth / h100.inter_bandwidth, rel=1e-9)
    assert inside.ranks[0].compute_s == pytest.approx(across.ranks[0].compute_s, rel=1e-12)
    assert across.step_time_s > inside.step_time_s
    assert across.summary()["exposed_comm_s"] > inside.summary()["exposed_comm_s"]
