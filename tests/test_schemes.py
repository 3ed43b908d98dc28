"""Every data-parallel scheme against one device, and its ledger against the formulas (CS336-style: 2 and 4 gloo
ranks, the tiny GPT with a tied and a frozen parameter, the same global batch as the single-device reference)."""

import functools

import pytest

from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import model_state_formula
from course_lib.model.gpt import TinyGPT, count_params
from course_lib.parallel.fsdp import unit_sizes
from course_lib.parallel.zero import bucket_sizes

VARIANTS = [
    ("dp", {"per_parameter": True, "overlap": False}),  # naive: one all-reduce per gradient, after backward
    ("dp", {}),  # bucketed, overlapped with backward
    ("dp", {"overlap": False, "grad_accum": 2}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero2", {"grad_accum": 2}),
    ("zero3", {}),
    ("zero3", {"reshard_after_forward": False, "overlap": False}),
]
IDS = [f"{s}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for s, o in VARIANTS]
STEPS = 3  # float32 runs; the ring bytes of a step and the ZeRO paper's states below are read off the same runs


@functools.cache
def float32_run(scheme: str, n: int, options: tuple = ()):
    """One float32 run of STEPS steps per scheme, options and world size, shared by the checks that read it."""
    return run_scheme(scheme, n, train=TrainConfig(steps=STEPS), **dict(options))


def rows(n: int, float32: bool) -> list:
    """Every variant on n ranks. Default set: the float64 ledger check on 4 ranks, every variant (2 ranks run the
    same code paths; the ring-bytes and ZeRO-paper checks below still run on 2 ranks); in float32 only the
    default-option runs, which the ring-bytes and ZeRO-paper checks read too (float64 checks every option at
    1e-10). The rest is the slow set."""
    out = []
    for (scheme, options), name in zip(VARIANTS, IDS, strict=True):
        slow = (n == 2 and not float32) or (float32 and options != {})
        out.append(pytest.param(scheme, options, n, id=f"{name}-{n}", marks=[pytest.mark.slow] * slow))
    return out


@pytest.mark.parametrize(("scheme", "options", "n"), rows(2, True) + rows(4, True))
def test_matches_one_device_in_float32(scheme, options, n):
    report = float32_run(scheme, n, tuple(options.items())).report
    assert report["max_abs_loss_diff"] <= 1e-5 * max(report["reference_losses"])
    assert report["rel_param_diff"] <= 1e-5
    assert report["losses"][-1] < report["losses"][0]


@pytest.mark.parametrize(("scheme", "options", "n"), rows(2, False) + rows(4, False))
def test_matches_one_device_in_float64_and_ledger_equals_formulas(scheme, options, n):
    run = run_scheme(scheme, n, train=TrainConfig(steps=2, dtype="float64"), **options)
    report = run.report
    assert report["max_abs_loss_diff"] <= 1e-10
    assert report["max_abs_param_diff"] <= 1e-10
    for rank, predicted in zip(report["ranks"], run.predicted_memory, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == run.predicted_comm[rank["rank"]]
        for cat in CATEGORIES:
            assert rank["memory"][cat] == predicted[cat], cat
        assert rank["memory"]["activations_peak"] == predicted["activations"]
        # At the end of a forward, the model states and that forward's activations are live together.
        assert rank["memory"]["peak"] >= sum(rank["memory"][c] for c in CATEGORIES) + predicted["activations"]


def padding(scheme: str, n: int) -> int:
    """Elements ZeRO adds so that each flat buffer splits evenly over n ranks (0 for plain DP)."""
    model = TinyGPT(GPTConfig())
    if scheme == "dp":
        return 0
    return sum(_buffers(scheme, n)) - count_params(model)


def _buffers(scheme: str, n: int) -> list[int]:
    """The padded flat buffers of a ZeRO scheme: buckets of 0.1 MB at stages 1 and 2, FSDP's units at stage 3."""
    return unit_sizes(TinyGPT(GPTConfig()), n) if scheme == "zero3" else bucket_sizes(TinyGPT(GPTConfig()), n)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_bytes_per_step_are_the_papers_multiples_of_psi(n):
    """DP, ZeRO-1 and ZeRO-2 send 2(n-1)/n x Psi x b per rank per step; ZeRO-3 sends 3(n-1)/n x Psi x b, with Psi
    the trainable parameters plus ZeRO's padding (at most n-1 elements per flat buffer)."""
    psi, b = count_params(TinyGPT(GPTConfig())), 4
    for scheme, multiple in (("dp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3)):
        run = float32_run(scheme, n)
        sent = sum(c["bytes"] for c in run.report["ranks"][0]["comm"].values())
        assert padding(scheme, n) <= 8 * (n - 1)
        assert sent == multiple * (n - 1) / n * (psi + padding(scheme, n)) * b, scheme


@pytest.mark.parametrize("n", [2, 4])
def test_model_states_follow_the_zero_paper(n):
    """The ZeRO paper's P_os, P_os+g, P_os+g+p in fp32 (params 4 Psi, grads 4 Psi, Adam 8 Psi, the sharded ones
    divided by N), with Psi including the padding, plus the frozen embedding and Adam's 4-byte step counters. The
    one place Psi has no padding: stage 1's full gradients, which are the module's own .grad, not flat buffers."""
    cfg = GPTConfig()
    psi = count_params(TinyGPT(cfg))
    frozen_bytes = 4 * cfg.seq * cfg.d_model
    for stage in (1, 2, 3):
        run = float32_run(f"zero{stage}", n)
        buffers = len(_buffers(f"zero{stage}", n))
        paper = model_state_formula(psi + padding(f"zero{stage}", n), "fp32", zero=stage, dp=n)
        for memory in (r["memory"] for r in run.report["ranks"]):
            assert memory["params"] == paper["params"] + frozen_bytes
            assert memory["grads"] == (4 * psi if stage == 1 else paper["grads"])
            assert memory["optimizer"] == paper["optimizer"] + 4 * buffers


def test_single_is_the_reference_exactly():
    report = run_scheme("single", 1, train=TrainConfig(steps=2)).report
    assert report["max_abs_loss_diff"] == 0.0 and report["max_abs_param_diff"] == 0.0
    assert report["ranks"][0]["comm"] == {}


def test_fsdp_is_zero3():
    assert run_scheme("fsdp", 2, train=TrainConfig(steps=1)).report["scheme"] == "zero3"


@pytest.mark.parametrize(
    ("scheme", "n", "options", "message"),
    [
        ("dp", 16, {}, "world size 16 is larger than the global batch of 8"),
        ("dp", 3, {}, "does not split evenly over 3 data-parallel ranks"),
        ("dp", 4, {"grad_accum": 4}, "ranks x 4 micro-batches; use a batch that is a multiple of 16"),
        ("dp", 2, {"bucket_mb": 0}, "bucket size must be positive, got 0 MB"),
        ("zero2", 2, {"bucket_mb": -1.0}, "bucket size must be positive"),
        ("zero3", 2, {"bucket_mb": 1.0}, "scheme 'zero3' takes no option"),
        ("dp", 2, {"grad_accum": 0}, "grad_accum must be at least 1"),
        ("single", 2, {}, "scheme 'single' runs on one rank"),
        ("tp9", 2, {}, "unknown scheme 'tp9'"),
    ],
)
def test_bad_input_is_refused_before_any_rank_starts(scheme, n, options, message):
    with pytest.raises(ValueError, match=message):
        run_scheme(scheme, n, train=TrainConfig(batch=8), **options)
