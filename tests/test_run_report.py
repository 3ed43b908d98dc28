"""Every run says what it ran and whether it matched one device: the scheme's settings under its first line, each
rank's coordinates, a pipeline's measured bubble beside its plan's, and a last line with the verdict against the
tolerances of its dtype and precision (exit status 1 when it does not match)."""

import pytest

from course_lib.cli import main
from course_lib.cli.echo import layout_lines, settings_line, verdict_line
from course_lib.harness import run_scheme
from course_lib.ledgers.trace import Event, bubble_fraction
from course_lib.model import precision
from course_lib.model.config import TrainConfig
from course_lib.model.gpt import rel_param_diff, train_reference

PIPELINE = ["run", "pp", "--world-size", "2", "--schedule", "interleaved", "--microbatches", "4", "--chunks", "2",
            "--layers", "4", "--steps", "2"]  # fmt: skip


def test_a_pipeline_run_says_its_schedule_layout_bubble_and_verdict(capsys):
    assert main(PIPELINE) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pp on 2 gloo ranks")
    assert lines[1] == "  pp: schedule interleaved, microbatches 4, chunks 2"
    assert lines[2] == "  layout  rank 0: pp0   rank 1: pp1"
    # 2 ranks x 2 chunks, 4 microbatches: (p - 1) / (v m + p - 1) = 1 / 9 planned; measured on this clock
    assert lines[3].startswith("  bubble  planned 11.1% (the paper's formula 11.1%), measured ")
    assert lines[-1].startswith("matches one device: yes (max |loss diff| ") and "float32's tolerances" in lines[-1]


def test_a_run_beyond_its_tolerance_says_no_and_exits_1(capsys, monkeypatch):
    monkeypatch.setattr(precision, "FLOAT32_TOLERANCE", 1e-30)  # no float32 run lands this close
    assert main(["run", "dp", "--world-size", "2", "--steps", "1"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("matches one device: NO (max |loss diff| ") and "> 1e-30" in last


def test_the_tolerances_follow_the_dtype():
    report = {"max_abs_loss_diff": 2e-11, "max_abs_param_diff": 5e-11, "rel_param_diff": 1e-12,
              "reference_losses": [4.8]}  # fmt: skip
    in64 = precision.one_device_verdict(report, TrainConfig(dtype="float64"))
    assert in64["matches"] and in64["params"]["measure"] == "max |param diff|" and in64["loss"]["tolerance"] == 1e-10
    worse = precision.one_device_verdict(report | {"max_abs_param_diff": 2e-10}, TrainConfig(dtype="float64"))
    assert not worse["matches"] and worse["params"]["value"] == 2e-10
    in32 = precision.one_device_verdict(report | {"rel_param_diff": 2e-5}, TrainConfig())
    assert not in32["matches"]
    assert in32["params"] == {"measure": "relative param diff", "value": 2e-5, "tolerance": 1e-5}
    line = verdict_line({"verdict": in32, "dtype": "float32"})
    assert line == (
        "matches one device: NO (max |loss diff| 2e-11 <= 1e-05, relative param diff 2e-05 > 1e-05; "
        "float32's tolerances)"
    )


def test_mixed_precision_may_stray_from_one_device_as_far_as_16_bit_rounding_moves_one_device_from_fp32():
    train = TrainConfig(precision="mixed", half="bf16")
    run = run_scheme("dp", 2, train=train)
    v, fp32 = run.report["verdict"], precision.full_precision(train)
    drift = rel_param_diff(train_reference(train=train).params, train_reference(train=fp32).params)
    assert v["params"]["tolerance"] == pytest.approx(drift, rel=1e-12) and 0 < drift < 0.1
    assert v["loss"]["tolerance"] == pytest.approx(precision.DP_TOLERANCE * max(run.report["reference_losses"]))
    assert v["matches"] and 0 < v["params"]["value"] < v["params"]["tolerance"]
    assert "bf16 moves one device from fp32" in verdict_line(run.report)


@pytest.mark.slow
def test_twenty_steps_of_bf16_fsdp_still_match():
    """Parameters drift apart step by step under 16-bit rounding (2.7% after 20 steps of FSDP in bf16 on 4 ranks), so
    no fixed bound holds for long runs; one device's own drift from fp32 grows the same way."""
    run = run_scheme("fsdp", 4, train=TrainConfig(precision="mixed", half="bf16", steps=20))
    assert run.report["verdict"]["matches"], run.report["verdict"]


def test_settings_and_layout_read_in_words():
    assert settings_line("tp", {"sp": True, "async_tp": True, "measure_memory": True}) == (
        "  tp: sequence parallel, async TP"
    )
    assert settings_line("ep", {"measure_memory": True}) == "  ep: no settings"
    ranks = [{"rank": r, "coords": {"dp": r // 4, "pp": r // 2 % 2, "cp": 0, "tp": r % 2}} for r in range(8)]
    assert layout_lines({"ranks": ranks}) == [  # cp has size 1: every rank at 0, so left out
        "  layout  rank 0: dp0 pp0 tp0   rank 1: dp0 pp0 tp1   rank 2: dp0 pp1 tp0   rank 3: dp0 pp1 tp1",
        "          rank 4: dp1 pp0 tp0   rank 5: dp1 pp0 tp1   rank 6: dp1 pp1 tp0   rank 7: dp1 pp1 tp1",
    ]
    assert layout_lines({"ranks": [{"rank": 0, "coords": {"dp": 0}}]}) == []


def test_the_measured_bubble_is_each_ranks_idle_share_of_the_makespan():
    def passes(rank, *spans, step=1):
        kinds = ("forward", "backward", "weight_grad")
        return [Event(rank, kind, kind, a, b, {"step": step}) for kind, (a, b) in zip(kinds, spans, strict=False)]

    other_step = passes(0, (10, 20), step=0)  # not the step measured
    ranks = [passes(0, (0, 1), (3, 5)) + other_step, passes(1, (1, 2), (2, 4))]
    # makespan 0..5 on both ranks: 10 units; rank 0 works 3 (idle 1..3), rank 1 works 3 (idle 0..1 and 4..5)
    assert bubble_fraction(ranks, 1) == pytest.approx(1 - 6 / 10)
    with pytest.raises(ValueError, match="no forward or backward pass was recorded in step 7"):
        bubble_fraction(ranks, 7)


def test_every_schemes_settings_read_in_words():
    """What ``run`` prints under its first line, for every scheme with its defaults: each setting said, none as a
    Python repr (True, None) and none left out unless it says nothing (the memory meter, the tiny GPT's model)."""
    from course_lib.cli.echo import WORDS
    from course_lib.harness import SCHEMES

    for name, spec in SCHEMES.items():
        settings = spec.settings({})
        line = settings_line(name, settings)
        assert line.startswith(f"  {name}: ") and "True" not in line and "False" not in line and "None" not in line
        said = [k for k in settings if k not in WORDS or WORDS[k](settings[k]) is not None]
        assert line.count(",") == max(len(said) - 1, 0), (name, line)
