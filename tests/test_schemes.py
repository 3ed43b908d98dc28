"""Equivalence with one device, and the ledger against the formulas, for the schemes of the foundation."""

import pytest

from course_lib.memory import CATEGORIES
from course_lib.models import GPTConfig, TrainConfig
from course_lib.schemes import run_scheme


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_matches_one_device_in_float32(n):
    report = run_scheme("dp", n, train=TrainConfig(steps=3)).report
    assert report["max_abs_loss_diff"] <= 1e-5
    # Adam divides by sqrt(v): rounding noise of order 1e-7 in a gradient near zero moves a weight by up to ~1e-4.
    assert report["max_abs_param_diff"] <= 5e-4
    assert report["losses"][-1] < report["losses"][0]


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_matches_one_device_in_float64(n):
    report = run_scheme("dp", n, train=TrainConfig(steps=3, dtype="float64")).report
    assert report["max_abs_loss_diff"] <= 1e-10
    assert report["max_abs_param_diff"] <= 1e-10


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_ledger_equals_the_formulas(n):
    run = run_scheme("dp", n, cfg=GPTConfig(), train=TrainConfig(steps=2))
    P = run.report["params"]
    for rank, predicted in zip(run.report["ranks"], run.predicted_memory, strict=True):
        assert rank["comm"] == {"all_reduce": {"calls": 27, "bytes": 2 * (n - 1) / n * 4 * P}}
        measured = rank["memory"]
        for cat in CATEGORIES:
            assert measured[cat] == predicted[cat], cat
        assert measured["activations_peak"] == predicted["activations"]
        # At the end of the last forward, model states and every activation are live together.
        assert measured["peak"] >= sum(measured[c] for c in CATEGORIES) + measured["activations_peak"]
    # Model states: 16 bytes per trainable parameter, plus the frozen position embedding and Adam's step counters.
    frozen = GPTConfig().seq * GPTConfig().d_model
    states = sum(run.report["ranks"][0]["memory"][c] for c in CATEGORIES)
    assert states == 16 * P + 4 * frozen + 4 * 27


def test_single_is_the_reference_exactly():
    report = run_scheme("single", 1, train=TrainConfig(steps=2)).report
    assert report["max_abs_loss_diff"] == 0.0 and report["max_abs_param_diff"] == 0.0
    assert report["ranks"][0]["comm"] == {}


@pytest.mark.parametrize(
    ("scheme", "n", "batch", "message"),
    [
        ("dp", 16, 8, "world size 16 is larger than the global batch of 8"),
        ("dp", 3, 8, "does not split evenly over 3 data-parallel ranks"),
        ("single", 2, 8, "scheme 'single' runs on one rank"),
        ("tp9", 2, 8, "unknown scheme 'tp9'"),
    ],
)
def test_bad_input_is_refused_before_any_rank_starts(scheme, n, batch, message):
    with pytest.raises(ValueError, match=message):
        run_scheme(scheme, n, train=TrainConfig(batch=batch))
