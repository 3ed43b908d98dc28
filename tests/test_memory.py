"""The memory ledger: formulas against the papers' numbers, and the meter against exact counts."""

import pytest
import torch
from conftest import needs_cuda

from course_lib.ledgers.memory import MemoryMeter, model_state_bytes
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import (
    activation_bytes_per_layer,
    memory_formula,
    model_state_formula,
    params_from_dims,
    tiny_gpt_activation_bytes,
)
from course_lib.model.gpt import TinyGPT, count_params, make_optimizer, synthetic_tokens


def test_sixteen_bytes_per_parameter():
    assert memory_formula(7e9)["total"] == 112e9
    assert sum(model_state_formula(7e9, "mixed").values()) == 112e9
    assert model_state_formula(1, "fp32") == {"params": 4, "grads": 4, "optimizer": 8}
    assert model_state_formula(1, "mixed") == {"params": 2, "grads": 2, "optimizer": 12}


@pytest.mark.parametrize(("stage", "total"), [(0, 120e9), (1, 31.40625e9), (2, 16.640625e9), (3, 1.875e9)])
def test_zero_stages_reproduce_figure_one_of_the_zero_paper(stage, total):
    # Rajbhandari et al. 2020, Figure 1: psi = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB.
    assert sum(model_state_formula(7.5e9, "mixed", zero=stage, dp=64).values()) == total


def test_tensor_and_pipeline_degrees_divide_model_states():
    assert model_state_formula(8e9, tp=2, pp=4) == model_state_formula(1e9)


def test_bad_formula_inputs_are_named():
    with pytest.raises(ValueError, match="precision must be one of"):
        model_state_formula(1, "fp8")
    with pytest.raises(ValueError, match="zero stage must be 0, 1, 2 or 3"):
        model_state_formula(1, zero=4)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        model_state_formula(1, tp=0)
    with pytest.raises(ValueError, match="activations need all of"):
        memory_formula(1, layers=2)
    with pytest.raises(ValueError, match="recompute must be one of"):
        activation_bytes_per_layer(1, 1, 1, 1, recompute="some")


def test_korthikanti_table_two():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B dims, one sequence
    base = s * b * h * (34 + 5 * a * s / h)
    stored = {"attention": "materialized"}  # Korthikanti counts the (heads, s, s) scores as stored
    assert activation_bytes_per_layer(s, b, h, a, **stored) == base
    assert activation_bytes_per_layer(s, b, h, a, tp=8, **stored) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, **stored) == pytest.approx(base / 8)
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, recompute="selective", **stored) == pytest.approx(
        34 * s * b * h / 8
    )
    assert activation_bytes_per_layer(s, b, h, a, recompute="full", **stored) == 2 * s * b * h
    # With t = 1 sequence parallelism changes nothing.
    assert activation_bytes_per_layer(s, b, h, a, tp=1, sp=True, **stored) == base


def test_flash_attention_keeps_what_selective_recompute_keeps():
    """The default: FlashAttention never stores the scores, Korthikanti's selective recompute for free."""
    s, b, h, a = 2048, 1, 12288, 96
    for tp, sp in ((1, False), (8, False), (8, True)):
        flash = activation_bytes_per_layer(s, b, h, a, tp=tp, sp=sp)
        selective = activation_bytes_per_layer(
            s, b, h, a, tp=tp, sp=sp, recompute="selective", attention="materialized"
        )
        assert flash == selective
    assert activation_bytes_per_layer(s, b, h, a) == 34 * s * b * h


def test_parameter_count_from_dims_matches_the_model():
    for cfg in (GPTConfig(), GPTConfig(layers=3, d_model=48, heads=6, vocab=96, seq=16, ffn_mult=2)):
        model = TinyGPT(cfg)
        assert params_from_dims(cfg.layers, cfg.d_model, cfg.vocab, cfg.seq, cfg.ffn_mult) == count_params(
            model, trainable_only=False
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "cfg", [GPTConfig(), GPTConfig(layers=3, seq=16, vocab=96, d_model=48, heads=6)], ids=["default", "other"]
)
@pytest.mark.parametrize("batch", [1, 4])
def test_measured_activations_equal_the_exact_formula(cfg, dtype, batch):
    model = TinyGPT(cfg, dtype=dtype)
    tokens, targets = synthetic_tokens(0, batch, cfg)
    with MemoryMeter(model) as meter:
        loss = model.loss(tokens, targets)
        after_forward = meter.activations
        loss.backward()
    expected = tiny_gpt_activation_bytes(cfg, batch, dtype.itemsize)["total"]
    assert after_forward == expected
    assert meter.activations_peak == expected
    assert meter.activations == 0, "backward frees every saved tensor"


def test_model_states_are_sixteen_bytes_per_trainable_parameter():
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    optimizer = make_optimizer(model.parameters(), TrainConfig())
    tokens, targets = synthetic_tokens(0, 2, cfg)
    model.loss(tokens, targets).backward()
    optimizer.step()
    state = model_state_bytes(model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    P = sum(p.numel() for p in trainable)
    frozen = count_params(model, trainable_only=False) - P
    assert frozen == cfg.seq * cfg.d_model
    assert state == {"params": 4 * (P + frozen), "grads": 4 * P, "optimizer": 8 * P + 4 * len(trainable)}


def test_tied_weights_count_once():
    model = TinyGPT(GPTConfig())
    assert model_state_bytes(model)["params"] == 4 * count_params(model, trainable_only=False)


def test_peak_counts_what_is_live_at_once():
    with MemoryMeter() as meter:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(2000)  # 8000 B -> 12000 live
        del a
        c = torch.empty(500)  # 2000 B -> 10000 live
        view = b[:10]  # a view allocates nothing
        b.add_(1)  # in place allocates nothing
    assert meter.peak == 12000
    assert meter.live == 10000
    del b, c, view
    assert meter.live == 0


@needs_cuda
def test_cuda_allocator_peak_is_reported_beside_the_meter():
    device = torch.device("cuda", 0)
    cfg = GPTConfig()
    model = TinyGPT(cfg).to(device)
    tokens, targets = (t.to(device) for t in synthetic_tokens(0, 4, cfg))
    with MemoryMeter(model, device=device) as meter:
        model.loss(tokens, targets).backward()
    report = meter.report()
    assert report.activations_peak == tiny_gpt_activation_bytes(cfg, 4)["total"]
    assert report.cuda_peak >= report.peak > 0
