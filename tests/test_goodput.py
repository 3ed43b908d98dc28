"""The goodput model: Young's and Daly's intervals (Daly's worked example), the closed form against hand-derived
values and against a seeded failure simulation, Llama 3's interruption counts, and checkpoint sizes from the memory
model for Llama 3 405B at its published layout."""

import json
import math

import numpy as np
import pytest

from course_lib.cli import main
from course_lib.model.config import Layout
from course_lib.planner.goodput import (
    LLAMA3,
    checkpoint_bytes_per_rank,
    checkpoint_seconds,
    choose_interval,
    cluster_mtbf,
    daly_interval,
    deduplicated_checkpoint_bytes,
    expected_goodput,
    job_mtbf,
    simulate_goodput,
    training_state_bytes,
    young_interval,
)
from course_lib.planner.reasons import published_candidate
from course_lib.planner.search import plan

MINUTE, HOUR = 60.0, 3600.0
LLAMA3_405B = 405_853_388_800  # parameters of the released checkpoint


# ------------------------------------------------------------------------------------------------ intervals


def test_young_is_the_square_root_of_twice_cost_times_mtbf():
    # 2 x 300 s x 10,800 s = 6,480,000 s^2, whose root is 2,545.58 s
    assert young_interval(300, 3 * HOUR) == pytest.approx(2545.584, abs=1e-3)
    assert young_interval(5 * MINUTE, 24 * HOUR) == pytest.approx(120 * MINUTE)  # sqrt(2 x 5 x 1440) = 120 min


def test_daly_worked_example():
    # Daly 2006: restart 10 min, checkpoint 5 min; M = 24 h -> 117 min, M = 6 h -> 57 min (restart does not enter).
    assert abs(daly_interval(5 * MINUTE, 24 * HOUR) / MINUTE - 117) < 1
    assert abs(daly_interval(5 * MINUTE, 6 * HOUR) / MINUTE - 57) < 1
    # By hand for 6 h: 60 min x (1 + sqrt(5/720)/3 + (5/720)/9) - 5 min = 56.713 min.
    assert daly_interval(5 * MINUTE, 6 * HOUR) / MINUTE == pytest.approx(56.713, abs=1e-3)
    assert daly_interval(3 * HOUR, HOUR) == HOUR  # delta >= 2M: checkpoint once per MTBF


@pytest.mark.parametrize("delta, mtbf", [(5 * MINUTE, 24 * HOUR), (5 * MINUTE, 6 * HOUR), (54.4, 3.09 * HOUR)])
def test_daly_interval_maximises_the_expected_goodput(delta, mtbf):
    d = daly_interval(delta, mtbf)
    grid = np.linspace(0.3, 3, 27001) * d
    best = grid[np.argmax(expected_goodput(grid, delta, 10 * MINUTE, mtbf))]
    assert best == pytest.approx(d, rel=0.01)
    assert young_interval(delta, mtbf) > d  # Young's first order overshoots by about delta


# ------------------------------------------------------------------------------------------------ the closed form


def test_expected_goodput_by_hand():
    m = 1000.0
    tau = m * math.log(2)  # e^{tau/M} - 1 = 1, so goodput = tau / M = ln 2
    assert expected_goodput(tau, 0, 0, m) == pytest.approx(math.log(2), rel=1e-12)
    assert expected_goodput(tau, 0, m * math.log(2), m) == pytest.approx(math.log(2) / 2, rel=1e-12)  # e^{R/M} = 2
    # checkpoint time in the exponent: tau + delta = M ln 2 with tau = delta -> goodput (M ln 2 / 2) / M
    assert expected_goodput(tau / 2, tau / 2, 0, m) == pytest.approx(math.log(2) / 2, rel=1e-12)
    # no failures: tau / (tau + delta)
    assert expected_goodput(3600, 400, 600, 1e15) == pytest.approx(0.9, rel=1e-9)
    # first order for tau, delta, R << M: 1 - delta/tau - tau/(2M) - R/M
    g = expected_goodput(100, 1, 1, 1e6)
    assert g == pytest.approx(1 - 1 / 100 - 100 / 2e6 - 1 / 1e6, abs=2e-4)


def test_async_checkpoint_costs_the_stall_in_the_exponent_and_the_write_as_a_factor():
    m = 1000.0
    tau = m * math.log(2) - 20  # tau + stall = M ln 2
    sync_20 = expected_goodput(tau, 20, 0, m)
    assert sync_20 == pytest.approx(tau / m, rel=1e-12)
    # e^{delta/M} = 2 when the write takes M ln 2 (it fits in an interval of M): half of a 20 s stall's goodput
    halved = expected_goodput(m, m * math.log(2), 0, m, async_checkpoint=True, stall_s=20)
    assert halved == pytest.approx(expected_goodput(m, 20, 0, m) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="before the next snapshot"):
        expected_goodput(tau, m * math.log(2), 0, m, async_checkpoint=True, stall_s=20)  # write longer than tau
    assert expected_goodput(700, 500, 0, m, True, 20) == pytest.approx(
        700 / (m * math.exp(0.5) * math.expm1(0.72)), rel=1e-12
    )
    # no background write: the same as a synchronous checkpoint that takes the stall
    assert expected_goodput(700, 0, 60, m, True, 20) == pytest.approx(expected_goodput(700, 20, 60, m))
    # PyTorch's blog: a 7B save stalled 148.8 s synchronously, 6.3 s asynchronously; at M = 3 h, R = 10 min:
    mtbf = 3 * HOUR
    sync = expected_goodput(daly_interval(148.8, mtbf), 148.8, 600, mtbf)
    asyn = expected_goodput(daly_interval(6.3, mtbf), 148.8, 600, mtbf, True, 6.3)
    assert asyn > sync + 0.05


# ------------------------------------------------------------------------------------------------ simulation


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize(
    "interval, mtbf", [(600, 3 * HOUR), (1800, 3 * HOUR), (3600, HOUR), (900, 6 * HOUR), (1200, 1200)]
)
def test_simulation_agrees_with_the_formula(interval, mtbf, asynchronous):
    args = (interval, 300, 600, mtbf)
    sim = simulate_goodput(*args, work_s=100 * interval, seed=7, runs=300, async_checkpoint=asynchronous, stall_s=20)
    expected = expected_goodput(*args, async_checkpoint=asynchronous, stall_s=20)
    assert sim.mean == pytest.approx(expected, rel=0.02)
    assert sim.stderr < 0.01 * sim.mean  # the 2% is several standard errors
    assert sim.failures > 0


def test_simulated_optimum_is_dalys():
    delta, restart, mtbf = 300, 600, 3 * HOUR
    d = daly_interval(delta, mtbf)
    factors = np.array([0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0])
    # the same seed gives every interval the same failure times (common random numbers)
    g = np.array([simulate_goodput(f * d, delta, restart, mtbf, 100 * d, seed=3, runs=300).mean for f in factors])
    assert factors[np.argmax(g)] == 1.0
    c = np.polyfit(np.log(factors), g, 2)
    assert math.exp(-c[1] / (2 * c[0])) == pytest.approx(1.0, abs=0.1)  # the fitted vertex within 10%


def test_simulation_is_seeded_and_async_without_a_write_is_sync():
    a = simulate_goodput(1800, 300, 600, 3 * HOUR, 100 * 1800, seed=1, runs=50)
    assert a == simulate_goodput(1800, 300, 600, 3 * HOUR, 100 * 1800, seed=1, runs=50)
    assert a != simulate_goodput(1800, 300, 600, 3 * HOUR, 100 * 1800, seed=2, runs=50)
    b = simulate_goodput(1800, 0, 600, 3 * HOUR, 100 * 1800, seed=1, runs=50, async_checkpoint=True, stall_s=300)
    assert b.mean == pytest.approx(a.mean, rel=1e-12)
    # no failures within reach: work over work plus checkpoints, with a last segment shorter than the interval
    c = simulate_goodput(1000, 10, 0, 1e15, 2500, seed=0, runs=2)
    assert c.mean == pytest.approx(2500 / 2530, rel=1e-12) and c.failures == 0


# ------------------------------------------------------------------------------------------------ failures


def test_llama3_interruptions_give_a_job_mtbf_of_three_hours():
    assert LLAMA3.job_hours == 54 * 24 == 1296
    assert LLAMA3.mtbf_job_hours() == pytest.approx(1296 / 419) == pytest.approx(3.0931, abs=1e-4)
    assert LLAMA3.mtbf_job_hours(unexpected_only=False) == pytest.approx(2.7811, abs=1e-4)  # 1296 / 466
    assert cluster_mtbf(1296, 419) == LLAMA3.mtbf_job_hours()
    # per GPU: 16,384 x 3.0931 h = 50,677 h, about 5.8 years
    assert LLAMA3.mtbf_gpu_hours() == pytest.approx(50_677.0, abs=0.1)
    assert LLAMA3.mtbf_gpu_hours() / (365 * 24) == pytest.approx(5.785, abs=1e-3)
    # Table 5's slip: 148 faulty GPUs are 35.3% of the 419 unexpected interruptions, not the printed 30.1%
    assert round(100 * LLAMA3.faulty_gpu_share, 1) == 35.3 and LLAMA3.printed_faulty_gpu_share == 0.301


def test_job_mtbf_scales_inversely_with_gpus():
    gpu = LLAMA3.mtbf_gpu_hours()
    assert job_mtbf(gpu, LLAMA3.gpus) == pytest.approx(LLAMA3.mtbf_job_hours())
    assert job_mtbf(gpu, 8192) == pytest.approx(2 * LLAMA3.mtbf_job_hours())  # half the GPUs, twice the MTBF
    assert job_mtbf(gpu, 131_072) * 60 == pytest.approx(23.2, abs=0.05)  # 8x the GPUs: 23 minutes


# ------------------------------------------------------------------------------------------------ checkpoint size


def test_llama3_405b_checkpoint_per_rank_at_its_published_layout():
    layout = Layout(tp=8, pp=16, dp=128, zero=1, microbatches=16)
    ckpt = checkpoint_bytes_per_rank("llama3-405b", layout)
    # The first stage's rank: a 16th of the layers and the 128,256 x 16,384 embedding over TP 8, a 16th of the
    # RMSNorm weights whole: 3,400,791,040 parameters.
    embedding, norms = 128256 * 16384, (2 * 126 + 1) * 16384
    shard = ((LLAMA3_405B - 2 * embedding - norms) / 16 + embedding) / 8 + norms / 16
    assert shard == 3_400_791_040
    assert ckpt["params"] == 2 * shard == 6_801_582_080  # bf16 weights, whole on every DP replica
    assert ckpt["optimizer"] == 12 * shard / 128 == 318_824_160  # fp32 master + 2 moments, ZeRO over DP 128
    assert ckpt["total"] == 7_120_406_240
    # The planner evaluates the published layout with Llama 3's own split, 7,8,...,8,7 (§3.3.2): its busiest rank is
    # on stage 1, 8 layers over TP 8 and their norms whole, and holds the states its checkpoint counts (and more:
    # grads, activations).
    c = published_candidate(plan("llama3-405b", 16_384))
    assert (c.tp, c.pp, c.dp, c.stage_layers) == (8, 16, 128, (7, *[8] * 14, 7))
    stage_1 = 8 * (LLAMA3_405B - 2 * embedding - norms) / 126 / 8 + 2 * 8 * 16384
    split = checkpoint_bytes_per_rank("llama3-405b", c)
    assert split["params"] == 2 * stage_1 and split["optimizer"] == 12 * stage_1 / 128
    assert c.memory["params"] + c.memory["optimizer"] == split["total"] < c.memory["total"]
    # each replica's bytes written once, spread evenly: 14 bytes x 405.85B / 16,384 ranks
    dedup = checkpoint_bytes_per_rank("llama3-405b", layout, deduplicate=True)
    assert dedup["total"] == 14 * LLAMA3_405B / 16_384 == 346_798_550


def test_checkpoint_seconds_are_capped_by_the_storage():
    size = 6_638_715_100
    assert checkpoint_seconds(size, 2e9) == pytest.approx(3.319, abs=1e-3)  # alone at 2 GB/s
    # 16,384 ranks share 2 TB/s (Tectonic's sustained rate): 122 MB/s each, 54.4 s
    assert (
        checkpoint_seconds(size, 2e9, 16_384, 2e12)
        == pytest.approx(size * 16_384 / 2e12)
        == pytest.approx(54.384, abs=1e-3)
    )
    assert checkpoint_seconds(size, 1e8, 16_384, 2e12) == pytest.approx(size / 1e8)  # the rank's own link is less


def test_choose_interval_for_llama3_405b_on_16k_gpus():
    c = choose_interval("llama3-405b", 16_384, LLAMA3.mtbf_gpu_hours() * HOUR, 2e9, 600, storage_bandwidth=2e12)
    assert c.layout.startswith("TP 8 x PP 16 x DP 128")
    assert c.checkpoint_bytes == 6_674_735_104  # stage 1's rank under Llama 3's split (test above)
    assert c.checkpoint_s == pytest.approx(6_674_735_104 * 16_384 / 2e12)  # 54.7 s: the storage's 2 TB/s shared
    assert c.mtbf_job_s == pytest.approx(1296 * HOUR / 419)  # 11,135 s
    assert c.daly_s == pytest.approx(daly_interval(c.checkpoint_s, c.mtbf_job_s))
    assert 17 < c.daly_s / MINUTE < 18.5  # ~ sqrt(2 x 55 s x 3.1 h) - a little
    intervals, goodputs = zip(*c.table, strict=True)
    assert intervals[int(np.argmax(goodputs))] == c.daly_s and max(goodputs) == c.goodput
    assert 0.85 < c.goodput < 0.86
    # asynchronous, stalling 6.3 s: a shorter interval and more goodput
    a = choose_interval(
        "llama3-405b", 16_384, LLAMA3.mtbf_gpu_hours() * HOUR, 2e9, 600, storage_bandwidth=2e12, stall_s=6.3
    )
    assert a.daly_s == pytest.approx(daly_interval(6.3, a.mtbf_job_s)) and a.daly_s < c.daly_s
    assert a.goodput > c.goodput + 0.05


def test_lesson_08_interval_is_the_deduplicated_checkpoints():
    """Lesson 08's section 5 times the checkpoint its section 2 describes: DCP writes each tensor once, spread over
    the ranks, so a rank writes the training state (14 bytes a parameter in mixed precision: bf16 weights, fp32
    master weights and two moments) over 16,384, not its whole replica (6.67 GB, a 55 s write, 18 min, 86%)."""
    state = training_state_bytes("llama3-405b")
    assert state["params"] == 2 * LLAMA3_405B and state["optimizer"] == 12 * LLAMA3_405B
    assert training_state_bytes("llama3-405b", "fp32")["total"] == 12 * LLAMA3_405B  # lesson 08 section 2's count
    share = deduplicated_checkpoint_bytes("llama3-405b", 16_384)
    assert share == state["total"] / 16_384 == 346_798_550  # about 0.35 GB a rank
    c = choose_interval(
        "llama3-405b", 16_384, LLAMA3.mtbf_gpu_hours() * HOUR, 2e9, 600, storage_bandwidth=2e12, deduplicate=True
    )
    assert c.checkpoint_bytes == share
    assert c.checkpoint_s == pytest.approx(share * 16_384 / 2e12) == pytest.approx(2.841, abs=1e-3)
    assert c.daly_s == pytest.approx(daly_interval(c.checkpoint_s, c.mtbf_job_s))
    assert 4.1 < c.daly_s / MINUTE < 4.3 and 0.92 < c.goodput < 0.94
    whole = choose_interval("llama3-405b", 16_384, LLAMA3.mtbf_gpu_hours() * HOUR, 2e9, 600, storage_bandwidth=2e12)
    assert whole.checkpoint_bytes == 6_674_735_104 and not 4.1 < whole.daly_s / MINUTE < 4.3  # the slip it fixed
    # in every layout of the 16,384 GPUs the share is the same: the state once, over all ranks
    for layout in (Layout(8, 16, 128, 1, 16), Layout(1, 1, 16_384, 0, 1), Layout(8, 1, 2048, 3, 1)):
        assert checkpoint_bytes_per_rank("llama3-405b", layout, deduplicate=True)["total"] == share
    with pytest.raises(ValueError, match="gpus must be a whole number"):
        deduplicated_checkpoint_bytes("llama3-405b", 0)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf])
def test_bad_times_are_refused(bad):
    with pytest.raises(ValueError, match="mtbf_s must be a finite number of seconds greater than 0"):
        expected_goodput(600, 60, 60, bad)
    with pytest.raises(ValueError, match="interval_s must be"):
        simulate_goodput(bad, 60, 60, 3600, 36000)
    with pytest.raises(ValueError, match="checkpoint_s must be"):
        daly_interval(bad, 3600)
    with pytest.raises(ValueError, match="write_bandwidth must be"):
        checkpoint_seconds(1e9, bad)


def test_other_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="restart_s must be a finite number of seconds at least 0"):
        expected_goodput(600, 60, -1, 3600)
    with pytest.raises(ValueError, match="interruptions must be a whole number"):
        cluster_mtbf(1296, 0)
    with pytest.raises(ValueError, match="gpus must be a whole number"):
        job_mtbf(1000.0, 0)
    with pytest.raises(ValueError, match="runs must be"):
        simulate_goodput(600, 60, 60, 3600, 36000, runs=1)
    with pytest.raises(ValueError, match="too many to simulate"):
        simulate_goodput(1e6, 60, 60, 100, 1e7)
    with pytest.raises(ValueError, match="storage_bandwidth"):
        checkpoint_seconds(1e9, 1e9, 8, math.nan)


# ------------------------------------------------------------------------------------------------ command line


def test_goodput_command_json_and_text(capsys):
    """By default each tensor once, spread over the ranks (lesson 08's checkpoint); --whole-replica as before."""
    assert main(["goodput", "--gpus", "16384", "--storage-tbps", "2", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint_bytes"] == deduplicated_checkpoint_bytes("llama3-405b", 16_384)
    assert main(["goodput", "--gpus", "16384", "--storage-tbps", "2", "--whole-replica", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint_bytes"] == 6_674_735_104 and out["checkpoint_s"] == pytest.approx(54.679, abs=1e-3)
    assert out["mtbf_gpu_hours"] == pytest.approx(16_384 * 1296 / 419)
    assert out["daly_s"] == pytest.approx(daly_interval(out["checkpoint_s"], out["mtbf_job_s"]))
    assert main(["goodput", "--gpus", "16384", "--storage-tbps", "2", "--stall-s", "6.3", "--whole-replica"]) == 0
    text = capsys.readouterr().out
    assert "6.67 GB per rank (its whole holding, replicas included)" in text
    assert "in the background (stall 6.3 s)" in text and "goodput" in text


# flag -> (a bad value, what the one-line refusal says); each goes after "goodput --gpus 16384"
BAD_FLAGS = {
    "--mtbf-gpu-hours": ("nan", "must be a finite number greater than 0"),
    "--write-gbps": ("0", "must be a finite number greater than 0"),
    "--restart-min": ("-1", "must be a finite number of at least 0"),
    "--stall-s": ("0", "must be a finite number greater than 0"),
    "--storage-tbps": ("inf", "must be a finite number greater than 0"),
    "--preset": ("gpt5", "invalid choice: 'gpt5'"),
}
BAD_GOODPUT = [
    ([*"goodput --gpus 16384".split(), flag, value], f"{flag}: {says}") for flag, (value, says) in BAD_FLAGS.items()
]
BAD_GOODPUT += [
    (["goodput"], "the following arguments are required: --gpus"),
    (["goodput", "--gpus", "0"], "--gpus: must be a whole number of at least 1"),
    (["goodput", "--gpus", "12", "--preset", "llama3-8b"], "goodput: 12 GPUs are not a whole number of 8-GPU"),
]


@pytest.mark.parametrize("argv, expected", BAD_GOODPUT, ids=[" ".join(a) for a, _ in BAD_GOODPUT])
def test_goodput_command_refuses_bad_input_in_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    code = stop.value.code
    out, err = capsys.readouterr()
    message = code if isinstance(code, str) else err
    assert code not in (0, None) and out == "" and message.strip().count("\n") == 0
    assert expected in message, message
