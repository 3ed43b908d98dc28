"""The MoE tiny GPT (router, top-k, capacity, balance loss) on hand-checked cases, and expert parallelism against
one device: 2 and 4 gloo ranks, float64 to 1e-10 and float32 to 1e-5, every rank's all-to-all bytes against the
prediction from the router's counts, its model states against the formula, and bad settings refused."""

import json

import pytest
import torch
import torch.distributed as dist

from course_lib.harness import reference_run, run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import MoE, TinyGPT, synthetic_tokens, within_capacity
from course_lib.parallel.expert import all_to_all_bytes, local_experts, shard_experts
from course_lib.runtime import launch

SMALL = GPTConfig(d_model=8, heads=1, ffn_mult=2, experts=2, capacity_factor=1.0)


def test_the_moe_reference_trains():
    losses = reference_run(GPTConfig(experts=4, top_k=2), TrainConfig(steps=3)).losses  # kept for the fp32 test
    assert losses[-1] < losses[0]


def test_top1_gates_are_the_probabilities_and_capacity_drops_later_tokens():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]])
    routing = MoE(SMALL).route(probs)  # 4 tokens x top-1 / 2 experts x 1.0: capacity 2; token 2 is expert 0's third
    assert routing.counts.tolist() == [[3, 1]] and routing.kept.tolist() == [[2, 1]]
    assert routing.token.tolist() == [0, 1, 3] and routing.expert.tolist() == [0, 0, 1]
    assert routing.gate.tolist() == [probs[0, 0].item(), probs[1, 0].item(), probs[3, 1].item()]


def test_topk_gates_are_renormalised_over_the_chosen_experts():
    cfg = GPTConfig(d_model=8, heads=1, experts=3, top_k=2)
    routing = MoE(cfg).route(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    assert routing.expert.tolist() == [0, 1] and routing.token.tolist() == [0, 0]
    assert routing.gate.tolist() == [0.5 / 0.8, 0.3 / 0.8]


def test_capacity_is_over_the_batch_in_token_order_across_source_ranks():
    cfg = GPTConfig(d_model=8, heads=1, experts=2, capacity_factor=0.5)  # 12 tokens: capacity ceil(12/2*0.5) = 3
    counts = torch.tensor([[2, 2], [3, 1], [2, 2]])
    assert within_capacity(counts, cfg).tolist() == [[2, 2], [1, 1], [0, 0]]


def test_a_dropped_token_gets_zero_from_the_layer():
    moe = MoE(SMALL)
    x = torch.rand(4, 8) + 0.1  # first feature positive: with this router every token picks expert 0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0
    out = moe(x)
    gates = moe.router(x).softmax(-1)[:, 0]
    assert moe.counts.tolist() == [[4, 0]]
    assert torch.equal(out[2:], torch.zeros(2, 8))  # capacity 2: tokens 2 and 3 dropped
    assert torch.equal(out[:2], moe.experts["0"](x[:2]) * gates[:2, None])


def test_the_balance_loss_is_alpha_under_uniform_routing_and_is_in_the_training_loss():
    cfg = GPTConfig(d_model=8, heads=1, experts=4, aux_loss_coef=0.01)
    moe = MoE(cfg)
    assert moe.balance_loss(torch.full((8, 4), 0.25), torch.tensor([[2, 2, 2, 2]])).item() == pytest.approx(0.01)
    skewed = moe.balance_loss(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2), torch.tensor([[2, 0, 0, 0]]))
    assert skewed.item() == pytest.approx(0.01 * 4 * 0.5, rel=1e-7)  # all to expert 0, P_0 = 0.5
    model, (tokens, targets) = TinyGPT(GPTConfig(experts=4)), synthetic_tokens(0, 2, GPTConfig())
    loss = model(tokens, targets)
    aux = [block.mlp.aux_loss for block in model.blocks]
    assert loss.item() == (model.output_loss(model.hidden(tokens), targets) + aux[0] + aux[1]).item()
    assert all(a > 0 for a in aux)


def _dispatch_and_combine(cfg: GPTConfig) -> dict:
    """Route random tokens on this rank, dispatch them to their experts' ranks and combine them back unchanged."""
    rank, n = dist.get_rank(), dist.get_world_size()
    moe = MoE(cfg).double()
    shard_experts(moe)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, cfg.d_model, generator=gen, dtype=torch.float64)[rank]
    probs = torch.rand(n, 16, cfg.experts, generator=gen, dtype=torch.float64)[rank].softmax(-1)
    routing = moe.route(probs)
    rows, expert, plan = moe.dispatcher.dispatch(x, routing)
    back = moe.dispatcher.combine(rows, plan)
    return {
        "x": x,
        "token": routing.token,
        "expert_of": routing.expert,
        "rows": rows,
        "expert": expert,
        "round_trip": torch.equal(back, x[routing.token]),
        "counts": routing.counts,
        "kept": routing.kept,
    }


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])  # 4: every rank sends to 3 others
def test_dispatch_sends_each_token_to_its_experts_rank_and_combine_returns_it_exactly(n):
    cfg = GPTConfig(d_model=8, heads=1, experts=8, top_k=2, capacity_factor=0.75)
    ranks = launch.run(_dispatch_and_combine, n, cfg)
    assert ranks[0]["kept"].sum() < ranks[0]["counts"].sum()  # capacity dropped some
    for r, got in enumerate(ranks):
        assert got["round_trip"]
        expected_rows, expected_expert = [], []
        for source in ranks:  # by source rank, then by local expert, each in token order
            for e in local_experts(cfg.experts, r, n):
                tokens = source["token"][source["expert_of"] == e]
                expected_rows.append(source["x"][tokens])
                expected_expert += [e] * len(tokens)
        assert torch.equal(got["rows"], torch.cat(expected_rows))
        assert got["expert"].tolist() == expected_expert


MOE = {  # name: model settings
    "top1-dropless": {"experts": 4},
    "top2-capacity": {"experts": 8, "top_k": 2, "capacity_factor": 0.5},
}


# The default set: each model once, dropless on 2 ranks (where the bytes tie) and capacity on 4 (where they do not).
@pytest.mark.parametrize(
    ("n", "moe"),
    [
        (2, "top1-dropless"),
        pytest.param(2, "top2-capacity", marks=pytest.mark.slow),
        pytest.param(4, "top1-dropless", marks=pytest.mark.slow),
        (4, "top2-capacity"),
    ],
)
def test_ep_matches_one_device_in_float64_and_its_ledger_equals_the_predictions(moe, n):
    cfg, train = GPTConfig(**MOE[moe]), TrainConfig(steps=2, dtype="float64")
    run = run_scheme("ep", n, cfg, train)
    report, counts = run.report, run.result[0]["counts"]
    assert report["max_abs_loss_diff"] <= 1e-10
    assert report["max_abs_param_diff"] <= 1e-10
    assert all(value["counts"] == counts for value in run.result)  # gathered: the same on every rank
    assert len(counts) == train.steps and all(len(step) == cfg.layers for step in counts)
    last = counts[-1]
    kept = sum(within_capacity(torch.tensor(layer), cfg).sum().item() for layer in last)
    assert (kept < 2 * 256 * cfg.top_k) == (cfg.capacity_factor is not None)  # capacity dropped some, or none
    dispatch = all_to_all_bytes(last, cfg, train)
    # Uneven routing, uneven bytes; on two ranks each sends away what the other receives, and back, so they tie.
    assert (len(set(dispatch)) > 1) == (n > 2)
    for rank, predicted in zip(report["ranks"], run.predicted_memory, strict=True):
        measured = {op: c["bytes"] for op, c in rank["comm"].items()}
        assert run.predicted_comm[rank["rank"]]["all_to_all"] == dispatch[rank["rank"]]
        assert measured == run.predicted_comm[rank["rank"]]
        for cat in CATEGORIES:
            assert rank["memory"][cat] == predicted[cat], cat
        assert "activations" not in predicted


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_ep_matches_one_device_in_float32(n):
    report = run_scheme("ep", n, GPTConfig(experts=4, top_k=2), TrainConfig(steps=3)).report
    assert report["max_abs_loss_diff"] <= 1e-5 * max(report["reference_losses"])
    assert report["rel_param_diff"] <= 1e-5
    assert report["losses"][-1] < report["losses"][0]


@pytest.mark.parametrize(
    ("n", "cfg", "train", "message"),
    [
        (2, {}, {}, r"scheme 'ep' shards the experts of an MoE model, and this model is dense \(experts=0\)"),
        (4, {"experts": 6}, {}, "6 experts do not split evenly over 4 expert-parallel ranks"),
        (2, {"experts": 2}, {"batch": 3}, "does not split evenly over 2 data-parallel ranks"),
    ],
)
def test_ep_refuses_bad_settings_before_any_rank_starts(n, cfg, train, message):
    with pytest.raises(ValueError, match=message):
        run_scheme("ep", n, GPTConfig(**cfg), TrainConfig(**train))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"experts": -1}, "experts must be 0 \\(a dense MLP\\) or a number of experts, got -1"),
        ({"top_k": 2}, "route tokens to experts, but this model is dense"),
        ({"experts": 2, "top_k": 3}, "top_k=3 must be between 1 and experts=2"),
        ({"experts": 2, "top_k": 0}, "top_k=0 must be between 1 and experts=2"),
        ({"experts": 2, "capacity_factor": 0.0}, "capacity_factor must be a positive number"),
        ({"experts": 2, "aux_loss_coef": -0.1}, "aux_loss_coef must be 0 or more"),
    ],
)
def test_moe_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**settings)


def test_run_ep_on_the_command_line_prints_the_load_per_expert_and_what_capacity_kept(capsys):
    from course_lib.cli import main

    argv = ["run", "ep", "--world-size", "2", "--experts", "4", "--top-k", "1", "--capacity-factor", "1.0"]
    assert main([*argv, "--dtype", "float64", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 experts top-1" in out and "routed -> kept by capacity" in out
    layers = [line.split(":", 1)[1] for line in out.splitlines() if line.strip().startswith("layer ")]
    assert len(layers) == 2
    for line in layers:  # 8 x 32 tokens, top-1 over 4 experts at factor 1.0: each keeps at most 64
        routed, kept = (json.loads(side) for side in line.split("->"))
        assert sum(routed) == 256 and all(k == min(r, 64) for r, k in zip(routed, kept, strict=True))
