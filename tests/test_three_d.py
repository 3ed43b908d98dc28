"""3D and 4D parallelism on 8 CPU ranks: every composition trains like one device, each axis moves what its formula
says (tp inside stages, cp beside it, pp between them, dp across replicas, the tied embedding between first and last
stage, ep and edp for an MoE's experts folded over dp), and each rank holds the memory its prediction says."""

import dataclasses

import pytest
import torch

from course_lib.cluster.clock import replay
from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TinyGPT, within_capacity
from course_lib.parallel.three_d import predict_axis_traffic
from course_lib.runtime import launch

CFG = GPTConfig(layers=4)


def _slow(grid: dict):
    return pytest.param(grid, marks=pytest.mark.slow, id="-".join(f"{k}{v}" for k, v in grid.items()))


# The default set runs every feature of the grid at least once: SP, ZeRO-1 (padded, under PP and under TP), each
# schedule, a trained position embedding under SP and under ZeRO-1. The slow rows take no path the default set
# does not: the plain grid (also run in float32 below), SP and ZeRO-1 on 2 x 2 x 2 with frozen positions, and the
# interleaved and ZeRO-1-with-trained-positions grids the merged row runs together.
GRIDS = [
    _slow({"tp": 2, "pp": 2, "dp": 2}),
    _slow({"tp": 2, "pp": 2, "dp": 2, "sp": True}),
    _slow({"tp": 2, "pp": 2, "dp": 2, "zero": 1}),
    {"tp": 2, "pp": 4, "dp": 1, "schedule": "gpipe", "microbatches": 8},
    {"tp": 1, "pp": 2, "dp": 4, "schedule": "zb-h1", "microbatches": 2},
    {"tp": 2, "pp": 1, "dp": 4, "zero": 1, "microbatches": 2},  # ZeRO-1's buckets pad to a multiple of 4
    _slow({"tp": 1, "pp": 2, "dp": 4, "schedule": "interleaved", "microbatches": 2, "chunks": 2}),
    # A trained position embedding: SP sums its gradient over TP; ZeRO-1 buckets it where the optimizer takes it.
    {"tp": 2, "pp": 2, "dp": 2, "sp": True, "frozen_pos": False},
    _slow({"tp": 1, "pp": 2, "dp": 4, "zero": 1, "microbatches": 2, "frozen_pos": False}),
    # The two rows above in one run: ZeRO-1 buckets over two chunks per rank, the trained positions in the first.
    {"tp": 1, "pp": 2, "dp": 4, "schedule": "interleaved", "microbatches": 2, "chunks": 2, "zero": 1}
    | {"frozen_pos": False},
    # Uneven stages (Megatron-LM's first/last-stage layer counts): one layer and the embedding, three and the head.
    {"tp": 2, "pp": 2, "dp": 2, "stage_layers": (1, 3)},
]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_3d_trains_like_one_device_and_each_axis_moves_its_formula(grid):
    grid = dict(grid)
    cfg = GPTConfig(layers=4, frozen_pos=grid.pop("frozen_pos", True))
    run = run_scheme("3d", 8, cfg, TrainConfig(steps=2, dtype="float64"), **grid)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, sent, held in zip(run.report["ranks"], run.predicted_comm, run.predicted_memory, strict=True):
        assert rank["comm_by_axis"] == sent
        assert {c: rank["memory"][c] for c in CATEGORIES} == {c: held[c] for c in CATEGORIES}
        assert rank["memory"]["activations_peak"] == held["activations"]
        assert rank["memory"]["grads"] > 0, "the reported step must still hold its gradients"


@pytest.fixture(scope="module")
def float32_on_nodes():
    """2 x 2 x 2 in float32, replayed on H100s two to a node: one launch for the two tests below."""
    return run_scheme("3d", 8, CFG, TrainConfig(steps=3), tp=2, pp=2, dp=2, hardware="h100", gpus_per_node=2)


def test_3d_in_float32(float32_on_nodes):
    report = float32_on_nodes.report
    assert report["max_abs_loss_diff"] <= 1e-5 and report["rel_param_diff"] <= 1e-5
    assert [r["coords"] for r in report["ranks"]][5] == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}


def test_axis_traffic_formula_by_hand_for_one_rank():
    """Rank 0 of 2 x 2 x 2, fp32, batch 8, 4 microbatches (1 sequence each), the first stage (layers 0 and 1)."""
    s, h, v, e = CFG.seq, CFG.d_model, CFG.vocab, 4
    traffic = predict_axis_traffic(
        CFG,
        TrainConfig(),
        {"tp": 2, "cp": 1, "pp": 2, "dp": 2, "kv": "ring", "zero": 0, "sp": False, "ep": 1}
        | {"schedule": "1f1b", "microbatches": 4, "chunks": 1, "stage_layers": ()},
        0,
    )
    S = e * 1 * s * h  # one microbatch's activations
    assert traffic["tp"] == 4 * (2 * 4 + 1) * (2 * 1 / 2) * S  # per microbatch: 2 layers x 4 all-reduces + embedding
    assert traffic["pp"] == 4 * S  # it sends each microbatch's activations forward once
    assert traffic["embedding"] == e * v // 2 * h  # its half of the tied embedding's gradient, all-reduced in 2
    assert traffic["dp"] > 0


def test_the_grid_on_nodes_puts_each_axis_on_its_link(float32_on_nodes):
    run = float32_on_nodes
    # Two GPUs per node: each TP pair shares a node; PP and DP groups span nodes.
    inside = replay(run.result.programs, run.result.comm, "h100", gpus_per_node=8).summary()
    assert run.report["modeled"]["comm_s"] > inside["comm_s"]
    assert run.report["bubble_fraction"] == run.report["modeled"]["bubble_fraction"]


GRIDS_4D = [
    {"tp": 2, "cp": 2, "pp": 1, "dp": 2, "microbatches": 2},
    _slow({"tp": 2, "cp": 2, "pp": 2, "dp": 1}),  # the row below with SP
    {"tp": 2, "cp": 2, "pp": 2, "dp": 1, "sp": True},
    {"tp": 1, "cp": 2, "pp": 2, "dp": 2, "kv": "all-gather", "zero": 1, "microbatches": 2},
]


@pytest.mark.parametrize("grid", GRIDS_4D, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_context_parallel_grid_trains_like_one_device_and_each_axis_moves_its_formula(grid):
    """TP x CP (x PP x DP): float64 to 1e-12 of one device; every rank's bytes per axis, tp, cp, pp, embedding and
    the gradients' dp-cp group (dp or cp alone when the other is 1), exactly as predicted; its model states too."""
    run = run_scheme("3d", 8, CFG, TrainConfig(steps=2, dtype="float64"), **grid)
    assert run.report["max_abs_loss_diff"] <= 1e-12 and run.report["max_abs_param_diff"] <= 1e-12
    grads = "dp-cp" if grid["dp"] > 1 else "cp"
    for rank, sent, held in zip(run.report["ranks"], run.predicted_comm, run.predicted_memory, strict=True):
        assert rank["comm_by_axis"] == sent
        assert sent["cp"] > 0 and sent[grads] > 0
        assert {c: rank["memory"][c] for c in CATEGORIES} == {c: held[c] for c in CATEGORIES}


def test_context_parallel_grid_with_trained_positions_in_float32():
    """Each CP rank's position rows get gradients from its own global positions only; averaged over dp-cp."""
    cfg = GPTConfig(layers=4, frozen_pos=False)
    report = run_scheme("3d", 8, cfg, TrainConfig(steps=3), tp=2, cp=2, pp=1, dp=2, microbatches=2).report
    assert report["max_abs_loss_diff"] <= 1e-5 and report["rel_param_diff"] <= 1e-5
    assert report["losses"][-1] < report["losses"][0]
    assert [r["coords"] for r in report["ranks"]][6] == {"dp": 1, "pp": 0, "cp": 1, "tp": 0}


def test_context_parallel_axis_traffic_by_hand_for_one_rank():
    """Rank 0 of TP 2 x CP 2 x DP 2, fp32, batch 8, 4 microbatches (1 sequence each, 16 of its 32 tokens)."""
    s, h, e, layers = CFG.seq, CFG.d_model, 4, CFG.layers
    o = {"tp": 2, "cp": 2, "pp": 1, "dp": 2, "kv": "ring", "zero": 0, "sp": False, "ep": 1}
    traffic = predict_axis_traffic(
        CFG, TrainConfig(), o | {"schedule": "1f1b", "microbatches": 4, "chunks": 1, "stage_layers": ()}, 0
    )
    S = e * 1 * (s // 2) * h  # one microbatch's activations, this rank's half of the tokens
    assert traffic["tp"] == 4 * (layers * 4 + 2) * (2 * 1 / 2) * S + 4 * 3 * (2 * 1 / 2) * e * (s // 2)
    block = e * 2 * 1 * (s // 2) * (h // 2)  # K and V of its 16 tokens and 2 of the 4 heads
    assert traffic["cp"] == 4 * layers * 2 * (2 - 1) * block  # per microbatch and layer: one send each way
    replicated = 6 * h * layers + 2 * h  # LayerNorms and row-parallel biases, whole on both TP ranks
    tp_shard = (sum(p.numel() for p in TinyGPT(CFG).parameters() if p.requires_grad) - replicated) // 2 + replicated
    assert traffic["dp-cp"] == 2 * 3 / 4 * e * tp_shard  # every gradient, averaged over the 4 ranks of dp x cp
    assert set(traffic) == {"tp", "cp", "dp-cp"}


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"tp": 2, "pp": 2, "dp": 1}, "DP 1 x PP 2 x TP 2 = 4 ranks, but the world has 8.*with TP 2 x PP 2, DP = 2"),
        ({"tp": 2, "pp": 2, "dp": 2, "zero": 3}, "ZeRO-1 at most"),
        ({"tp": 2, "pp": 2, "dp": 2, "schedule": "zb-h1"}, "zb-h1 with tensor or context parallelism"),
        ({"tp": 1, "cp": 2, "pp": 2, "dp": 2, "schedule": "zb-h1"}, "zb-h1 with tensor or context parallelism"),
        ({"tp": 1, "pp": 8, "dp": 1, "microbatches": 8}, "8 pipeline stages \\(ranks x chunks\\) for 4 layers"),
        ({"tp": 2, "pp": 8, "dp": 1}, "TP x PP = 16 must divide 8"),
        ({"tp": 1, "pp": 2, "dp": 4}, "does not split into 4 equal microbatches"),
        (
            {"tp": 2, "cp": 2, "pp": 2, "dp": 2},
            "DP 2 x PP 2 x CP 2 x TP 2 = 16 ranks, but the world has 8: TP x CP x PP x DP must equal the number of "
            "devices \\(with TP 2 x CP 2 x PP 2, DP = 1\\)",
        ),
        ({"tp": 2, "cp": 3, "pp": 1, "dp": 1}, "TP x CP = 6 must divide 8"),
        ({"tp": 1, "cp": 8, "pp": 1, "dp": 1, "seq": 24}, "sequence length 24 is not a multiple of 16"),
        ({"tp": 8, "cp": 1, "pp": 1, "dp": 1}, "tensor-parallel degree 8 does not divide the heads = 4"),
        ({"tp": 4, "cp": 2, "pp": 1, "dp": 1, "sp": True, "seq": 36}, "each rank's 18 tokens .* over TP 4"),
        ({"tp": 2, "cp": 2, "pp": 1, "dp": 2, "kv": "allgather"}, "kv must be one of \\['all-gather', 'ring'\\]"),
    ],
)
def test_impossible_grids_are_refused_before_any_rank_starts(grid, message, monkeypatch):
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a rank started"))
    cfg = GPTConfig(layers=4, seq=grid.pop("seq", CFG.seq))
    with pytest.raises(ValueError, match=message):
        run_scheme("3d", 8, cfg, **grid)


MOE = GPTConfig(layers=2, experts=4, top_k=2)
EP_GRIDS = [
    # One microbatch: counts over all four dp ranks, so capacity drops and the balance loss's f_i are the batch's.
    (4, {"capacity_factor": 1.0}, {"tp": 1, "pp": 1, "dp": 4, "ep": 2, "microbatches": 1}),
    # Microbatches route on their own: dropless, no balance loss. Two replicas of each expert, summed over edp.
    (8, {"aux_loss_coef": 0.0}, {"tp": 1, "pp": 2, "dp": 4, "ep": 2, "microbatches": 2}),
    # EP over all of DP (the ep scheme's layout): one copy of each expert, no edp group.
    (4, {"top_k": 1, "capacity_factor": 1.25}, {"tp": 1, "pp": 1, "dp": 4, "ep": 4, "microbatches": 1}),
]


@pytest.mark.parametrize(("world", "moe", "grid"), EP_GRIDS, ids=["ep2-dp4-capacity", "ep2-pp2-dp4", "ep4-dp4-top1"])
def test_expert_parallel_grid_trains_like_one_device_and_each_axis_moves_its_formula(world, moe, grid):
    """EP folded over DP (x PP): float64 to 1e-12 of one device; every rank's bytes per axis as predicted, the ep
    axis's all-to-alls from the counts its ranks report; its model states, E/ep experts per layer, too."""
    cfg = dataclasses.replace(MOE, **moe)
    run = run_scheme("3d", world, cfg, TrainConfig(steps=2, dtype="float64"), **grid)
    assert run.report["max_abs_loss_diff"] <= 1e-12 and run.report["max_abs_param_diff"] <= 1e-12
    for rank, sent, held in zip(run.report["ranks"], run.predicted_comm, run.predicted_memory, strict=True):
        assert rank["comm_by_axis"] == sent
        assert sent["ep"] > 0 and sent["dp"] > 0
        assert sent["edp"] > 0 if grid["dp"] > grid["ep"] else "edp" not in sent
        assert {c: rank["memory"][c] for c in CATEGORIES} == {c: held[c] for c in CATEGORIES}
    routed = [torch.tensor(c) for r in run.result for c in r["routings"][-1]]
    assert len(routed) == grid["microbatches"] * world * cfg.layers // grid["pp"]
    assert all(c.shape == (grid["dp"] if grid["microbatches"] == 1 else grid["ep"], cfg.experts) for c in routed)
    if cfg.capacity_factor is not None:  # the cap bit: the batch-wide counts decided what was dropped
        assert any((within_capacity(c, cfg) < c).any() for c in routed)


@pytest.mark.parametrize(
    ("moe", "grid", "message"),
    [
        ({"experts": 0, "top_k": 1}, {"ep": 2}, "ep 2 splits the experts of an MoE model, and this model is dense"),
        ({"experts": 3, "top_k": 1}, {"ep": 2}, "3 experts do not split evenly over 2 expert-parallel ranks"),
        ({}, {"ep": 4, "pp": 4, "dp": 2}, "ep 4 is carved out of the data-parallel ranks .* must divide dp 2"),
        ({}, {"tp": 2, "dp": 2}, "runs with tp 1 and cp 1, not tp 2 and cp 1"),
        ({}, {"cp": 2, "dp": 2}, "runs with tp 1 and cp 1, not tp 1 and cp 2"),
        ({}, {"zero": 1}, "ZeRO-1 with experts"),
        ({}, {"schedule": "zb-h1"}, "zb-h1 with experts"),
        ({"capacity_factor": 1.25}, {}, "with 2 microbatches each microbatch routes on its own"),
        ({"aux_loss_coef": 0.01}, {}, "with 2 microbatches each microbatch routes on its own"),
        ({"aux_loss_coef": 0.01}, {"microbatches": 1}, "a balance loss \\(aux_loss_coef=0.01\\) in a pipeline of 2"),
    ],
)
def test_impossible_expert_grids_are_refused_before_any_rank_starts(moe, grid, message, monkeypatch):
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a rank started"))
    cfg = dataclasses.replace(MOE, **{"aux_loss_coef": 0.0} | moe)
    with pytest.raises(ValueError, match=message):
        run_scheme("3d", 8, cfg, **({"tp": 1, "pp": 2, "dp": 4, "ep": 2, "microbatches": 2} | grid))
