"""Pipeline parallelism: schedule tables checked and simulated in pure Python against the papers' bubbles, then
executed on real ranks against one device, with the ledger and memory against the predictions."""

import itertools
import json

import pytest

from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel.catalog import layer_counts
from course_lib.parallel.pipeline import split_layers
from course_lib.parallel.schedule_sim import check, simulate
from course_lib.parallel.schedules import Action, Costs, bubble_formula, bubble_ratio, generate

CFG = GPTConfig(layers=4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3)])
def test_gpipe_and_1f1b_bubbles_are_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    for costs in (Costs(1, 1, 0), Costs(1, 2, 0), Costs(1, 1, 1)):
        tables = generate(schedule, p, m)
        check(tables, m)
        sim = simulate(tables, costs)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
        assert bubble_formula(schedule, p, m) == pytest.approx(sim.bubble_fraction, rel=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 6, 4)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    tables = generate("interleaved", p, m, v)
    check(tables, m, v)
    assert simulate(tables).bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


@pytest.mark.parametrize("costs", [Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 1, 1), Costs(1, 1, 0.5)])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_idles_p_minus_1_times_tf_plus_tb_minus_tw(costs, p, m):
    tables = generate("zb-h1", p, m, costs=costs)
    check(tables, m)
    sim = simulate(tables, costs)
    assert sim.idle == pytest.approx([(p - 1) * (costs.f + costs.b - costs.w)] * p, rel=1e-12)
    assert sim.bubble_fraction == pytest.approx(bubble_formula("zb-h1", p, m, costs=costs), rel=1e-12)
    assert max(sim.peak_inflight) <= p, "ZB-H1 keeps 1F1B's peak memory"


def test_gpipe_keeps_every_microbatch_in_flight_and_1f1b_at_most_p():
    p, m = 4, 8
    assert simulate(generate("gpipe", p, m)).peak_inflight == [m] * p
    assert simulate(generate("1f1b", p, m)).peak_inflight == [p - r for r in range(p)]


def test_the_checker_catches_broken_tables():
    tables = generate("1f1b", 2, 2)
    swapped = [list(t) for t in tables]
    f, b = swapped[1].index(Action("F", 0)), swapped[1].index(Action("B", 0))
    swapped[1][f], swapped[1][b] = swapped[1][b], swapped[1][f]
    with pytest.raises(ValueError, match="before the forward it differentiates"):
        check(swapped, 2)
    # Rank 0 waits for a gradient before sending the activation that produces it: a deadlock.
    order = [a for a in tables[0] if a.kind != "SEND_F"]
    deadlock = [order + [a for a in tables[0] if a.kind == "SEND_F"], tables[1]]
    with pytest.raises(ValueError, match="the tables deadlock: rank 0 waits at RECV_B0<-1"):
        check(deadlock, 2)
    with pytest.raises(ValueError, match="unmatched transfers"):
        check([tables[0], [a for a in tables[1] if a.kind != "SEND_B"]], 2)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "message"),
    [
        ("interleaved", 4, 2, 2, "2 microbatches is fewer than 4"),
        ("interleaved", 4, 6, 2, "6 microbatches is not a multiple of 4"),
        ("1f1b", 4, 8, 2, "--chunks 2 needs the interleaved schedule"),
        ("interleaved", 4, 8, 1, "needs at least 2 chunks"),
        ("pipedream", 4, 8, 1, "unknown schedule 'pipedream'"),
        ("dualpipev", 4, 7, 1, "dualpipev needs at least 2p = 8 microbatches on 4 ranks"),
        ("dualpipev", 1, 1, 1, "at least 2p = 2 microbatches"),
        ("zb-v", 4, 8, 3, "zb-v holds 2 chunks per rank, in a V .*: give --chunks 2 or leave out --chunks 3"),
        ("dualpipev", 4, 8, 3, "leave out --chunks 3"),
        ("dualpipe", 4, 8, 1, "unknown schedule 'dualpipe'"),
    ],
)
def test_schedules_that_cannot_run_are_refused(schedule, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        generate(schedule, p, m, v)


def test_more_stages_than_layers_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="6 pipeline stages \\(ranks x chunks\\) for 4 layers"):
        split_layers(4, 6)
    with pytest.raises(ValueError, match="8 pipeline stages"):
        run_scheme("pp", 4, CFG, schedule="interleaved", microbatches=4, chunks=2)
    with pytest.raises(ValueError, match="does not split into 3 equal microbatches"):
        run_scheme("pp", 2, CFG, microbatches=3)


RUNS = [
    (s, p, m, v)
    for s, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))
    for p in (2, 4)
    for m in (1, 2, 4, 8)
    if (s != "interleaved" or (m % p == 0 and p * v <= CFG.layers))
]
# The default set runs every schedule on 2 and 4 ranks with one microbatch, fewer than, as many as and more than
# the ranks (interleaved: the fewest it takes, where the warm-up is cut short, and more); the other rows are slow.
DEFAULT_RUNS = {
    ("gpipe", 2, 1, 1),
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 2, 1),
    ("1f1b", 2, 4, 1),
    ("zb-h1", 4, 1, 1),
    ("zb-h1", 4, 4, 1),
    ("zb-h1", 2, 8, 1),
    ("interleaved", 2, 2, 2),
    ("interleaved", 2, 8, 2),
}
assert DEFAULT_RUNS <= set(RUNS)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [pytest.param(*run, marks=() if run in DEFAULT_RUNS else pytest.mark.slow) for run in RUNS],
)
def test_every_schedule_trains_like_one_device(schedule, p, m, v):
    run = run_scheme("pp", p, CFG, TrainConfig(steps=2, dtype="float64"), schedule=schedule, microbatches=m, chunks=v)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, memory, sent in zip(run.report["ranks"], run.predicted_memory, run.predicted_comm, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent
        assert all(rank["memory"][c] == memory[c] for c in CATEGORIES)
        assert rank["memory"]["activations_peak"] == memory["activations"]


UNEVEN = (1, 2, 2, 3)  # Megatron-Bridge's uneven-PP memory test: one layer on the first stage, three on the last


def test_uneven_stages_train_like_one_device_and_hold_what_their_layers_say():
    """A stage with fewer layers (Megatron-LM's first/last-stage layer counts; BLOOM-176B's first and last stage one
    block short, for the embedding and the head): the same step as one device, and each rank's parameters,
    gradients, optimizer state and 1F1B activation peak are what its prediction says. Stage i keeps p - i
    microbatches of its layers in flight (Narayanan et al. 2021), so the second stage, 3 x 2 layers, keeps more
    activations than the last, 1 x 3, and more parameters sit on the last than on the first."""
    cfg = GPTConfig(layers=sum(UNEVEN))
    run = run_scheme("pp", 4, cfg, TrainConfig(steps=2, dtype="float64"), microbatches=4, stage_layers=UNEVEN)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    ranks = run.report["ranks"]
    for rank, memory, sent in zip(ranks, run.predicted_memory, run.predicted_comm, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent
        assert all(rank["memory"][c] == memory[c] for c in CATEGORIES)
        assert rank["memory"]["activations_peak"] == memory["activations"]
    even = run_scheme("pp", 4, cfg, TrainConfig(steps=1, dtype="float64"), microbatches=4).predicted_memory
    assert [m["params"] for m in run.predicted_memory] != [m["params"] for m in even]
    peaks = [rank["memory"]["activations_peak"] for rank in ranks]
    assert peaks[1] > peaks[3] and ranks[3]["memory"]["params"] > ranks[0]["memory"]["params"]


def test_uneven_stages_are_cut_as_given_and_refused_where_they_do_not_fit():
    assert split_layers(8, 4, UNEVEN) == [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    with pytest.raises(ValueError, match="stage layers 1,2,2,2 must give each of the 4 pipeline stages"):
        run_scheme("pp", 4, GPTConfig(layers=8), stage_layers=(1, 2, 2, 2))
    with pytest.raises(ValueError, match="stage layers 4,4 must give each of the 4 pipeline stages"):
        run_scheme("pp", 4, GPTConfig(layers=8), stage_layers=(4, 4))
    with pytest.raises(ValueError, match="--stage-layers gives each rank one stage; interleaved runs 2 chunks"):
        run_scheme("pp", 2, GPTConfig(layers=8), schedule="interleaved", chunks=2, stage_layers=(4, 4))
    with pytest.raises(ValueError, match="one per pipeline stage"):
        layer_counts("1,two")
    with pytest.raises(ValueError, match="at least one layer"):
        layer_counts("0,4")
    assert layer_counts("1,2,2,3") == UNEVEN


def test_the_command_line_runs_uneven_stages(capsys):
    """``--stage-layers 1,3`` reaches the scheme through the catalog, and the model gets the 4 layers it names."""
    from course_lib.cli import main

    assert main(["run", "pp", "--pp", "2", "--stage-layers", "1,3", "--steps", "1", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["options"] == {"stage_layers": [1, 3]}
    first, last = (rank["memory"]["params"] for rank in data["ranks"])
    assert last > first  # three layers and the tied head against one layer and the embedding


P32, M32 = 4, 8


@pytest.fixture(scope="module")
def float32_runs():
    """GPipe and 1F1B in float32 on 4 ranks with 8 microbatches, run once for the two tests below."""
    train = TrainConfig(steps=3)
    return {s: run_scheme("pp", P32, CFG, train, schedule=s, microbatches=M32) for s in ("gpipe", "1f1b")}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_float32_pipeline_matches_one_device(schedule, float32_runs):
    report = float32_runs[schedule].report
    assert report["max_abs_loss_diff"] <= 1e-5 and report["rel_param_diff"] <= 1e-5


def test_first_stage_keeps_m_microbatches_under_gpipe_and_p_under_1f1b(float32_runs):
    peaks = {s: run.report["ranks"][0]["memory"]["activations_peak"] for s, run in float32_runs.items()}
    assert peaks["gpipe"] == peaks["1f1b"] * M32 // P32


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (5, 7)])
def test_zb_h1_formula_is_given_only_where_it_is_the_simulated_bubble(p, m):
    shown = 0
    for f, b, w in itertools.product((0.5, 1, 1.5, 2), (0.5, 1, 2, 3), (0, 0.5, 1, 2, 3)):
        costs = Costs(f, b, w)
        sim = simulate(generate("zb-h1", p, m, costs=costs), costs)
        formula = bubble_formula("zb-h1", p, m, costs=costs)
        assert formula is None or formula == pytest.approx(sim.bubble_fraction, rel=1e-12), (f, b, w)
        shown += formula is not None
    assert shown and (bubble_formula("zb-h1", p, m, costs=Costs(1, 1, 1)) is None) == (m < p)


def test_zb_h1_has_no_closed_form_where_w_outlasts_the_waits():
    # W = 3 > F = B = 1: Qi et al.'s (p-1)(F+B-W) would be a negative idle; the table idles (p-1)(F+B-min(F,B,W)).
    costs = Costs(1, 1, 3)
    sim = simulate(generate("zb-h1", 4, 8, costs=costs), costs)
    assert sim.idle == [3.0] * 4 and sim.bubble_fraction == pytest.approx(3 / 43)
    assert bubble_formula("zb-h1", 4, 8, costs=costs) is None and bubble_ratio("zb-h1", 4, 8, costs=costs) is None
    assert bubble_formula("zb-h1", 4, 3, costs=Costs(1, 1, 1)) is None  # fewer microbatches than stages
    assert bubble_formula("zb-h1", 4, 3, costs=Costs(1, 1, 0)) == pytest.approx(3 / 6)  # no W: 1F1B's


def test_bubble_ratio_is_idle_over_busy():
    assert bubble_ratio("1f1b", 16, 16) == pytest.approx(15 / 16)
    assert bubble_ratio("interleaved", 16, 16, 8) == pytest.approx(15 / 128)
    assert bubble_ratio("zb-h1", 16, 16, costs=Costs(1, 1, 1)) == pytest.approx(15 / 48)
    assert bubble_ratio("zb-h1", 16, 16, costs=Costs(1, 2, 1)) == pytest.approx(15 * 2 / (16 * 4))
