"""Sizes checked before anything starts (issue 37 item 3): the tiny GPT's memory by formula against this machine's
available memory, the seed against torch's 64 bits, parameter counts and GPU counts against the course's bounds.
The command lines that hit them are rows of ``test_bad_inputs.py``."""

import math

import pytest
import torch

from course_lib import harness
from course_lib.cluster import topology
from course_lib.cluster.topology import MAX_GPUS, check_gpus, for_gpus, from_spec
from course_lib.model.config import DATA_SEED_STRIDE, TORCH_SEED_LIMIT, GPTConfig, TrainConfig, max_seed
from course_lib.model.formulas import MAX_PARAMS, check_params, memory_formula, tiny_gpt_memory, tiny_gpt_params
from course_lib.model.gpt import TinyGPT, synthetic_tokens
from course_lib.model.precision import convention
from course_lib.planner.layouts import divisors
from course_lib.planner.search import plan
from course_lib.runtime import host

CONFIGS = [
    GPTConfig(),
    GPTConfig(layers=3, d_model=32, heads=2, ffn_mult=2, vocab=50, seq=7),
    GPTConfig(experts=4, top_k=2),
    GPTConfig(frozen_pos=False, experts=3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_the_tiny_gpts_parameters_are_counted_exactly_without_building_it(cfg):
    model = TinyGPT(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert tiny_gpt_params(cfg) == {
        "trainable": sum(p.numel() for p in trainable),
        "frozen": frozen,
        "tensors": len(trainable),
    }


@pytest.mark.parametrize("train", [TrainConfig(), TrainConfig(dtype="float64"), TrainConfig(precision="mixed")])
def test_one_devices_states_by_formula_are_the_single_schemes_prediction(train):
    spec = harness.SCHEMES["single"]
    predicted = spec.predict_memory(1, GPTConfig(), train, spec.settings({}))[0]
    mine = tiny_gpt_memory(GPTConfig(), train.batch, convention(train))
    assert {k: mine[k] for k in ("params", "grads", "optimizer")} == {
        k: predicted[k] for k in ("params", "grads", "optimizer")
    }
    if "activations" in predicted:  # one dtype: the same formula of the whole batch
        assert mine["activations"] == predicted["activations"]


def test_the_largest_seed_is_the_largest_torch_takes_for_every_step():
    steps = 3
    largest = max_seed(steps)
    TrainConfig(steps=steps, seed=largest)
    synthetic_tokens(steps - 1, 1, GPTConfig(), largest)  # the last step's data seed is one torch takes
    assert (largest + 1) * DATA_SEED_STRIDE + steps - 1 > TORCH_SEED_LIMIT
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        torch.Generator().manual_seed(TORCH_SEED_LIMIT + 1)
    for seed in (largest + 1, 99999999999999999999999, -1):
        with pytest.raises(ValueError, match=f"seed must be a whole number from 0 to {largest:,}"):
            TrainConfig(steps=steps, seed=seed)


def test_available_memory_is_read_from_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   21000000 kB\n")
    monkeypatch.setattr(host, "MEMINFO", str(meminfo))
    monkeypatch.setattr(host, "memory_cgroups", lambda mountinfo, membership: [])
    assert host.available_memory() == 21000000 * 1024
    monkeypatch.setattr(host, "MEMINFO", str(tmp_path / "none"))
    assert host.available_memory() > 0  # the free pages, where there is no meminfo


def test_a_run_larger_than_the_memory_is_refused_before_any_rank(monkeypatch):
    available = 2 * host.RANK_MEMORY_BYTES + 1e8  # the reference fits, 4 ranks do not
    monkeypatch.setattr(host, "available_memory", lambda: available)
    cpu = harness.LaunchSettings(backend="gloo", device="cpu")
    with pytest.raises(ValueError, match=r"^4 ranks would need about 1\.7 GB \(421\.8 MB on the busiest rank by"):
        harness.validate("dp", 4, GPTConfig(), TrainConfig(), {}, cpu)
    harness.validate("dp", 2, GPTConfig(), TrainConfig(), {}, cpu)
    with pytest.raises(ValueError, match="the one-device reference would need about 198.6 GB by the course's memory"):
        harness.validate("dp", 2, GPTConfig(layers=100_000), TrainConfig(), {}, cpu)


def test_parameter_counts_stop_at_the_bound():
    check_params(MAX_PARAMS)
    memory_formula(MAX_PARAMS)
    for params in (MAX_PARAMS * 1.001, 1e300, math.inf, math.nan):
        with pytest.raises(ValueError, match="the course's formulas take at most 1e\\+15"):
            memory_formula(params)
        with pytest.raises(ValueError, match="the course's formulas take at most 1e\\+15"):
            plan(params, 8)


def test_divisors_are_every_divisor_in_order():
    for n in range(1, 3000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_gpu_counts_stop_at_the_bound():
    check_gpus(MAX_GPUS)
    check_gpus(MAX_GPUS, "h100-superpod")
    with pytest.raises(ValueError, match=f"{MAX_GPUS + 8:,} GPUs is more than the {MAX_GPUS:,}"):
        plan(7e9, MAX_GPUS + 8)
    with pytest.raises(ValueError, match="h100-superpod x99999999999 would have 799,999,999,992 GPUs, more than"):
        from_spec("h100-superpod:99999999999")
    with pytest.raises(ValueError, match="tpu-v5p 99999x99999x99999 would have 999,970,000,299,999 GPUs"):
        from_spec("tpu-v5p:99999x99999x99999")
    with pytest.raises(ValueError, match=f"tpu-v5p would have {MAX_GPUS + 1:,} GPUs"):
        for_gpus("tpu-v5p", MAX_GPUS + 1)
    with pytest.raises(ValueError, match="would have"):
        topology.Torus(name="t", shape=(MAX_GPUS + 1,), n_gpus=MAX_GPUS + 1, link_bandwidth=1.0, hop_latency=0.0)
