"""Mixed precision on real ranks: the measured bytes per parameter of each convention against the memory model,
16-bit gradients on the wire against the formulas, losses against one device in the same precision and against
fp32, fp16's loss scaler, and the settings that make no sense refused (2 gloo ranks, the tiny GPT, 1-4 steps)."""

import math

import pytest
import torch

from course_lib.harness import SCHEMES, run_scheme
from course_lib.ledgers import comm
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model import precision
from course_lib.model.config import PRECISIONS, GPTConfig, TrainConfig
from course_lib.model.formulas import model_state_formula
from course_lib.model.gpt import TinyGPT, build_model, count_params, synthetic_tokens, train_reference
from course_lib.model.precision import DP_TOLERANCE, LOSS_TOLERANCE, LossScaler, MixedPrecisionOptimizer
from course_lib.runtime import launch

# Every parameter trains (no frozen position table), so bytes per parameter need no correction for frozen ones.
CFG = GPTConfig(frozen_pos=False)
CONVENTIONS = (None, "mixed", "megatron", "no-master")
LAYOUTS = [("single", 1, 0), ("dp", 2, 0), ("zero1", 2, 1), ("zero2", 2, 2)]


def each_precision(scheme: str, cfg: GPTConfig, trains: list[TrainConfig], **options) -> list[dict]:
    """Rank function: train with ``scheme`` once per training setting; per run the memory of the last step and the
    bytes this rank sent in it, by collective."""
    out = []
    for train in trains:
        first = len(comm.records())
        report = SCHEMES[scheme].train(cfg, train, **options)
        last = [r for r in comm.records()[first:] if r.tags.get("step") == train.steps - 1]
        sent = {op: s["bytes"] for op, s in comm.summarize(last).items()}
        out.append({"memory": report["memory"], "comm": sent})
    return out


@pytest.mark.parametrize(("scheme", "n", "zero"), LAYOUTS, ids=[s for s, _, _ in LAYOUTS])
def test_measured_bytes_per_parameter_are_the_conventions_and_16_bit_gradients_halve_the_wire(scheme, n, zero):
    """Each rank's measured weights, gradients and optimizer state (less AdamW's 4-byte step counter per tensor it
    steps: one per parameter tensor, or per flat buffer under ZeRO) equal the memory model's convention exactly:
    16 (2 + 2 + 4 + 8), 18 (2 + 4 + 4 + 8), 12 (2 + 2 + 0 + 8) bytes per parameter, and fp32's 16 (4 + 4 + 8);
    ZeRO-1 2 + 2 + 12/N, ZeRO-2 2 + (2 + 12)/N. One flat buffer (bucket_mb None) of P elements, P even, so ZeRO
    pads nothing on 2 ranks. Each rank's bytes on the wire equal the scheme's prediction, and are half of fp32's in
    bf16; Megatron's fp32 main gradients are reduced at fp32's bytes (its bf16 weights all-gathered at half)."""
    trains = [TrainConfig(steps=1, precision=p) for p in CONVENTIONS]
    options = {} if scheme == "single" else {"bucket_mb": None}
    result = launch.run(each_precision, n, scheme, CFG, trains, **options)
    model = TinyGPT(CFG)
    P, tensors = count_params(model), (1 if zero else len(list(model.parameters())))
    assert count_params(model, trainable_only=False) == P and P % n == 0
    for i, train in enumerate(trains):
        convention = train.precision or "fp32"
        expected = model_state_formula(P, convention, zero=zero, dp=n)
        predicted = SCHEMES[scheme].predict_comm(n, CFG, train, SCHEMES[scheme].settings(options))
        for rank, runs in enumerate(result):
            measured = {cat: runs[i]["memory"][cat] for cat in CATEGORIES}
            measured["optimizer"] -= 4 * tensors
            assert measured == expected, (convention, rank)
            assert runs[i]["comm"] == predicted[rank], (convention, rank)
        if zero == 0:
            per_param = {cat: expected[cat] / P for cat in CATEGORIES}
            assert per_param == PRECISIONS[convention].bytes()
            assert sum(per_param.values()) == {"fp32": 16, "mixed": 16, "megatron": 18, "no-master": 12}[convention]
    fp32, mixed, megatron = (result[0][CONVENTIONS.index(p)]["comm"] for p in (None, "mixed", "megatron"))
    assert mixed == {op: sent / 2 for op, sent in fp32.items()}
    assert megatron == {op: sent / (2 if op == "all_gather" else 1) for op, sent in fp32.items()}
    if scheme == "dp":
        assert fp32 == {"all_reduce": 2 * (n - 1) / n * 4 * P}


def test_mixed_precision_stays_near_one_device_and_near_fp32():
    """DP on 2 ranks in bf16: the losses stay within DP_TOLERANCE of one device in the same precision (the
    all-reduce rounds where one device does not) and within LOSS_TOLERANCE of fp32, and differ from fp32's (8
    significant bits cannot give fp32's numbers); the one-rank scheme is the reference exactly."""
    report = run_scheme("dp", 2, cfg=CFG, train=TrainConfig(steps=3, precision="mixed")).report
    assert _relative_gap(report["losses"], report["reference_losses"]) <= DP_TOLERANCE
    assert _relative_gap(report["losses"], report["precision"]["fp32_losses"]) <= LOSS_TOLERANCE
    assert report["losses"] != report["precision"]["fp32_losses"]
    assert report["precision"]["max_abs_loss_diff_vs_fp32"] > 0
    single = run_scheme("single", 1, cfg=CFG, train=TrainConfig(steps=2, precision="megatron")).report
    assert single["max_abs_loss_diff"] == 0.0 and single["max_abs_param_diff"] == 0.0


def _relative_gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))


def test_fp16_skips_the_steps_that_overflow_and_trains_on():
    """The initial loss scale is chosen so that rank 0's scaled gradient of step 0 cannot fit fp16 (its largest fp32
    value times the scale is 2 to 4 times fp16's largest, 65504): step 0 is skipped, the scale halves at each
    skipped step and stays otherwise (1000 clean steps before it doubles), every rank reports the same, and the
    later steps train."""
    model = build_model(CFG, TrainConfig())
    tokens, targets = (t[:4] for t in synthetic_tokens(0, TrainConfig().batch, CFG))  # rank 0's share of step 0
    model(tokens, targets).backward()
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    scale = 2.0 ** (math.ceil(math.log2(torch.finfo(torch.float16).max / largest)) + 1)
    train = TrainConfig(steps=5, precision="mixed", half="fp16", initial_scale=scale)
    run = run_scheme("dp", 2, cfg=CFG, train=train)
    reports = [(r["loss_scale"], r["skipped_steps"]) for r in run.result]
    assert reports == [reports[0]] * 2 and run.report["precision"]["skipped_steps"] == reports[0][1]
    scales, skipped = reports[0]
    assert scales[0] == scale and 0 in skipped and len(skipped) < train.steps
    assert all(after == (before / 2 if k in skipped else before) for k, (before, after) in enumerate(pairs(scales)))
    assert run.report["losses"][-1] < run.report["losses"][0]
    assert _relative_gap(run.report["losses"], run.report["reference_losses"]) <= DP_TOLERANCE
    # In one process: a skipped step leaves every weight as it was.
    skipped_once = train_reference(CFG, TrainConfig(steps=1, precision="mixed", half="fp16", initial_scale=scale))
    initial = dict(build_model(CFG, train).named_parameters())
    assert all(torch.equal(value, initial[name]) for name, value in skipped_once.params.items())


def pairs(values: list[float]) -> list[tuple[float, float]]:
    return list(zip(values, values[1:], strict=False))


class LoudGPT(TinyGPT):
    """A loss in units a million times too large: its fp16 gradients overflow without a loss scaler."""

    def forward(self, tokens, targets=None):
        return super().forward(tokens, targets) * 1e6


def test_fp16_without_a_scaler_stops_where_it_overflows_and_bf16_does_not():
    def loud():
        return LoudGPT(GPTConfig())

    fp16 = TrainConfig(steps=1, precision="mixed", half="fp16", loss_scale=None)
    with pytest.raises(FloatingPointError, match=r"^fp16 gradients overflowed at step 0 with no loss scaler: use "):
        run_scheme("single", 1, train=fp16, model=loud, in_process=True)
    bf16 = run_scheme("single", 1, train=TrainConfig(steps=1, precision="mixed"), model=loud, in_process=True)
    assert math.isfinite(bf16.report["losses"][0])


def test_the_dynamic_scaler_halves_on_overflow_and_doubles_after_a_window():
    scaler = LossScaler(8.0, window=2)
    assert [scaler.update(overflow) for overflow in (True, False, False, False, True)] == [True] + [False] * 3 + [True]
    assert scaler.scales == [8.0, 4.0, 4.0, 8.0, 8.0] and scaler.skipped == [0, 4] and scaler.scale == 4.0
    fixed = LossScaler(1024.0, dynamic=False)
    assert fixed.update(True) and fixed.scale == 1024.0 and fixed.skipped == [0]
    with pytest.raises(FloatingPointError, match="even at the smallest loss scale 1"):
        LossScaler(1.0).update(True)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"precision": "fp8"}, r"precision must be None \(every tensor in dtype\) or one of \['mixed', 'megatron'"),
        ({"precision": "deepspeed"}, "or one of"),
        ({"half": "fp16"}, "set up mixed precision: give precision too"),
        ({"loss_scale": "dynamic"}, "give precision too"),
        ({"precision": "mixed", "half": "fp8"}, r"half must be one of \['bf16', 'fp16'\]"),
        ({"precision": "mixed", "dtype": "float64"}, "keeps fp32 master weights and moments: use dtype='float32'"),
        ({"precision": "mixed", "loss_scale": 1024.0}, "bf16 has fp32's exponent range and needs no loss scaling"),
        ({"precision": "mixed", "half": "fp16", "loss_scale": 0}, "loss_scale must be 'dynamic', None"),
        ({"precision": "mixed", "half": "fp16", "loss_scale": "static"}, "loss_scale must be"),
        ({"precision": "mixed", "half": "fp16", "initial_scale": -1.0}, "initial_scale must be a number greater"),
        ({"precision": "mixed", "half": "fp16", "loss_scale": 8.0, "initial_scale": 4.0}, "use it with loss_scale="),
    ],
)
def test_nonsense_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


@pytest.mark.parametrize(
    ("scheme", "settings", "message"),
    [
        ("tp", {"precision": "mixed"}, r"precision 'mixed' runs under schemes \['single', 'dp', 'zero1', 'zero2', "),
        ("zero3", {"precision": "megatron"}, r"\['single', 'dp', 'zero1', 'zero2'\], not under 'zero3'"),
    ],
)
def test_schemes_without_it_are_refused_before_any_rank_starts(scheme, settings, message, nothing_may_start):
    with pytest.raises(ValueError, match=message):
        run_scheme(scheme, 2, train=TrainConfig(**settings))


def test_a_mixed_precision_checkpoint_is_refused(tmp_path, nothing_may_start):
    with pytest.raises(ValueError, match="checkpoints hold fp32 AdamW state per parameter"):
        run_scheme("dp", 2, train=TrainConfig(precision="mixed"), checkpoint_dir=str(tmp_path), checkpoint_every=1)


def test_the_optimizer_takes_16_bit_parameters_only():
    with pytest.raises(ValueError, match=r"one 16-bit type \(bf16, fp16\), got \['torch.float32'\]: cast the model"):
        MixedPrecisionOptimizer(TinyGPT(CFG).parameters(), lr=1e-3)
    assert precision.find(torch.optim.AdamW(TinyGPT(CFG).parameters())) is None


LOUD_FILE = """
from course_lib.model.config import GPTConfig
from course_lib.model.gpt import TinyGPT


class Loud(TinyGPT):
    def forward(self, tokens, targets=None):
        return super().forward(tokens, targets) * 1e6


def build():
    return Loud(GPTConfig())
"""


def test_the_command_line_says_an_fp16_overflow_without_a_scaler_in_one_line(tmp_path, capsys):
    from course_lib.cli import main

    (tmp_path / "loud.py").write_text(LOUD_FILE)
    argv = ["run", "dp", "--world-size", "2", "--steps", "1", "--precision", "mixed", "--half", "fp16"]
    assert main([*argv, "--loss-scale", "none", "--model", f"{tmp_path / 'loud.py'}:build"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fp16 gradients overflowed at step 0 with no loss scaler" in err
