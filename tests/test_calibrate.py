"""``course-lib calibrate``: the device at hand measured as a hardware profile, found by name like the published
ones, and the modeled clock's compute beside a measured training step on that device. Each test runs on the CPU and,
where there is one, on a CUDA GPU (the same assertions; skipped with the reason on a machine without one)."""

import json
import math
import re

import pytest
import torch

from course_lib.cli import main
from course_lib.cluster import calibrate
from course_lib.cluster.profiles import get_profile, load_profile, measured_dir, save_profile
from course_lib.model.config import GPTConfig, TrainConfig

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
# A measurement with round numbers, so that a test of the profile and the clock does not depend on the timing.
FIXED = calibrate.Measured(
    device="cpu",
    device_name="Test CPU, 2 threads",
    matmul_flops={"bf16": 4e11, "fp32": 2e11},
    matmul_side={"bf16": 512, "fp32": 256},
    matmul_by_side={"bf16": {256: 3e11, 512: 4e11}, "fp32": {256: 2e11, 512: 1.5e11}},
    attention_flops=1e11,
    memory_bandwidth=4e10,
    memory_bytes=16e9,
    torch_version=torch.__version__,
    date="2026-11-24",
)


@pytest.mark.parametrize("device", DEVICES)
def test_a_quick_measurement_keeps_the_best_matmul_size(device):
    m = calibrate.measure(device, quick=True)
    assert m.device.startswith(device) and m.device_name
    for key in ("bf16", "fp32"):
        rates = m.matmul_by_side[key]
        assert set(rates) == set(calibrate.SETTINGS["quick"]["sides"])
        assert m.matmul_flops[key] == max(rates.values()) == rates[m.matmul_side[key]] > 0
    assert m.attention_flops > 0 and m.memory_bandwidth > 0 and m.memory_bytes > 0


def test_a_measured_profile_takes_its_rates_and_copies_only_the_links():
    profile, h100 = calibrate.as_profile(FIXED), get_profile("h100")
    assert profile.name == "measured-test-cpu"
    assert profile.peak_flops == FIXED.matmul_flops and profile.matmul_efficiency == 1.0
    assert profile.attention_efficiency == 1e11 / 4e11
    assert (profile.hbm_bandwidth, profile.memory_bytes) == (4e10, 16e9)
    links = ("gpus_per_node", "intra_bandwidth", "intra_latency_s", "inter_bandwidth", "inter_latency_s")
    assert all(getattr(profile, f) == getattr(h100, f) for f in links)
    assert "measured" in profile.description and any("no link" in s for s in profile.sources)
    assert calibrate.as_profile(FIXED, "laptop", links="pcie").intra_bandwidth == get_profile("pcie").intra_bandwidth
    for bad in ("h100", "../elsewhere", "a b"):
        with pytest.raises(ValueError, match=f"cannot name a measured profile '{re.escape(bad)}'"):
            calibrate.as_profile(FIXED, bad)
    assert calibrate.published_match(FIXED) is None
    named = calibrate.Measured(**{**vars(FIXED), "device_name": "NVIDIA H100 80GB HBM3"})
    assert calibrate.published_match(named) == h100


def test_a_saved_profile_is_found_by_name_and_by_path(tmp_path):
    profile = calibrate.as_profile(FIXED, "my-laptop")
    path = save_profile(profile)
    assert path == measured_dir() / "my-laptop.json"
    assert get_profile("my-laptop") == profile == get_profile(str(path))
    with pytest.raises(ValueError, match=r"unknown hardware 'my-laptp'.*measured: \[.*'my-laptop'"):
        get_profile("my-laptp")
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="broken.json is not a hardware profile .*calibrate"):
        load_profile(broken)
    (measured_dir() / "notes.json").write_text("[1, 2]")  # not a profile: left out of the list, not an error
    assert get_profile("my-laptop") == profile


def test_the_clock_charges_a_measured_step_as_its_formula_says():
    profile, cfg = calibrate.as_profile(FIXED), GPTConfig()
    c = calibrate.compare_step(profile, cfg, TrainConfig(steps=3))
    assert c.measured_s > 0 and c.precision == "fp32" and c.itemsize == 4
    # A training step's matrix products are three forwards' (the backward takes two: the gradients of both inputs).
    b, s, h, a, v, L = 8, cfg.seq, cfg.d_model, cfg.heads, cfg.vocab, cfg.layers
    forward = L * (2 * b * s * 12 * h * h + 4 * b * a * s * s * (h // a)) + 2 * b * s * h * v
    assert c.flops == 3 * forward
    assert c.elementwise > 0
    assert c.modeled_s == pytest.approx((c.flops + c.elementwise) / 2e11, rel=1e-12)
    assert c.roofline_s == pytest.approx(c.flops / 2e11 + 3 * 4 * c.elementwise / 4e10, rel=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_on_the_device_is_timed_and_modeled(device):
    profile = calibrate.as_profile(calibrate.measure(device, quick=True))
    [c] = calibrate.compare_models(profile, device, quick=True)
    assert c.label == "tiny GPT" and math.isfinite(c.measured_s) and c.measured_s > 0
    assert 0 < c.modeled_s < c.roofline_s  # the roofline charges the element-wise work at the (slower) copy rate


def test_what_compare_step_cannot_time_is_refused():
    profile = calibrate.as_profile(FIXED)
    with pytest.raises(ValueError, match="give steps >= 3"):
        calibrate.compare_step(profile, GPTConfig(), TrainConfig(steps=2))
    with pytest.raises(ValueError, match="train in float32, or in mixed precision with bf16"):
        calibrate.compare_step(profile, GPTConfig(), TrainConfig(steps=3, dtype="float64"))
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        calibrate.resolve_device("gpu")


def test_the_command_writes_a_profile_that_run_plan_and_hardware_use(capsys):
    assert main(["calibrate", "--quick", "--name", "this-machine"]) == 0
    out = capsys.readouterr().out
    assert "matmul bf16" in out and "copy" in out and "use it with --hardware this-machine" in out
    assert "tiny GPT" in out and "measured" in out and "modeled" in out
    saved = json.loads((measured_dir() / "this-machine.json").read_text())
    assert saved["name"] == "this-machine" and saved["matmul_efficiency"] == 1.0

    assert main(["hardware"]) == 0
    assert "this-machine (measured, in " in capsys.readouterr().out
    assert main(["run", "single", "--steps", "1", "--hardware", "this-machine", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["modeled"]["hardware"] == "this-machine"
    assert main(["plan", "--params", "1e9", "--gpus", "8", "--hardware", "this-machine", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == "this-machine"

    assert main(["calibrate", "--quick", "--no-train", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == [] and data["profile"]["peak_flops"] == data["measured"]["matmul_flops"]
