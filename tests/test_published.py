"""The planner's step-time model against 13 published runs: Narayanan et al. 2021's Table 1 (ten GPT models on up to
3,072 A100s) and Llama 3's Table 4 (405B on 8,192 and 16,384 H100s): each row's TFLOP/s per GPU, counted as its
source counts FLOPs, within 15% of the published figure, with one set of hardware assumptions per GPU generation."""

import dataclasses
import math

import pytest

from course_lib.cluster.profiles import ATTENTION_EFFICIENCY, MATMUL_EFFICIENCY, PROFILES
from course_lib.model.formulas import params_from_dims
from course_lib.planner.published import LLAMA3_2024, NARAYANAN_2021, ROWS, estimate, narayanan_flops

TOLERANCE = 0.15


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_estimated_tflops_per_gpu_within_15_percent_of_the_published(row):
    e = estimate(row)
    assert abs(e.ratio - 1) <= TOLERANCE, (
        f"{row.label}: estimated {e.tflops_per_gpu:.1f} TFLOP/s per GPU against the published "
        f"{row.tflops_per_gpu:g} ({e.ratio:.3f}x); {e.breakdown()}"
    )


def test_thirteen_rows_ten_on_a100s_three_on_h100s():
    assert len(NARAYANAN_2021) == 10 and len(LLAMA3_2024) == 3 and len(ROWS) == 13
    assert {r.hardware for r in NARAYANAN_2021} == {"a100"} and {r.hardware for r in LLAMA3_2024} == {"h100"}
    # No row carries an efficiency of its own: the profiles' one number per generation is all there is.
    fields = {f.name for f in dataclasses.fields(ROWS[0])}
    assert not {"efficiency", "matmul_efficiency", "attention_efficiency"} & fields
    for name in ("a100", "h100"):
        assert PROFILES[name].matmul_efficiency == MATMUL_EFFICIENCY[name]
        assert PROFILES[name].attention_efficiency == ATTENTION_EFFICIENCY[name]


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_rows_are_internally_consistent(row):
    printed = dict(row.printed)
    assert row.tp * row.cp * row.pp * row.dp == row.gpus
    m, rest = divmod(row.global_batch, row.dp * row.micro_batch)
    assert rest == 0 and m >= row.pp
    if row.schedule == "interleaved":  # Megatron-LM: microbatches in groups of p; v divides a stage's layers
        assert m % row.pp == 0 and math.ceil(row.model.layers / row.pp) % row.chunks == 0
    if row in NARAYANAN_2021:
        # Eq. (2) gives the printed parameter count; teraFLOP/s per GPU x GPUs the printed aggregate (rounded).
        assert row.model.params / 1e9 == pytest.approx(printed["params_billions"], abs=0.1)
        assert row.tflops_per_gpu * row.gpus / 1e3 == pytest.approx(printed["aggregate_pflops"], rel=0.01)
        assert row.peak_fraction == pytest.approx(row.tflops_per_gpu / 312, abs=0.006)  # "% of peak", 312 TFLOP/s
        assert row.model.params == params_from_dims(row.model.layers, row.model.hidden, 51200, 2048)
    else:
        # 16M tokens a batch, Batch size/DP sequences on each DP rank; MFU against the H100's ~989 TFLOP/s (row 2
        # prints 41% beside 400 TFLOP/s, 40.4% of 989: within a point).
        assert row.tokens_per_batch == printed["tokens_per_batch_m"] * 2**20
        assert row.global_batch // row.dp == printed["batch_per_dp"]
        assert row.peak_fraction == pytest.approx(row.tflops_per_gpu / 989, abs=0.01)


def test_the_long_context_row_uses_dp_8_where_the_table_prints_4():
    row = LLAMA3_2024[2]
    # Table 4 prints DP 4, which makes TP 8 x CP 16 x PP 16 x DP 4 = 8,192 GPUs, not the row's 16,384, and
    # 4 x 16 x 131,072 = 8M tokens a batch, not its 16M: DP 8 satisfies both, so the row is a slip for 8.
    assert dict(row.printed)["dp"] == 4 and row.dp == 8
    assert 8 * 16 * 16 * 4 * 2 == row.gpus == 16384 and 4 * 16 * 131072 * 2 == row.tokens_per_batch


def test_each_source_counts_its_own_flops():
    # Narayanan et al.: eq. (3), the recomputed forward and unmasked attention counted, on the estimated step.
    row = NARAYANAN_2021[-1]
    e = estimate(row)
    s, h, layers = 2048, 25600, 128
    assert narayanan_flops(row) == pytest.approx(
        96 * 3072 * s * layers * h**2 * (1 + s / (6 * h) + 51200 / (16 * layers * h))
    )
    assert e.tflops_per_gpu == pytest.approx(narayanan_flops(row) / e.candidate.step_time_s / 3072 / 1e12)
    # The planner's hardware FLOPs for that run are eq. (3) but for the learned positions' 6 s h a token.
    assert e.candidate.hardware_flops == pytest.approx(narayanan_flops(row), rel=1e-3)
    # Llama 3: the planner's model FLOPs, 6N + causal attention, no recompute.
    e = estimate(LLAMA3_2024[1])
    assert e.tflops_per_gpu == pytest.approx(e.candidate.tflops_per_gpu, rel=1e-12)
    assert e.candidate.hardware_flops == e.candidate.model_flops
