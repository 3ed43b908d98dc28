"""The reference model and data: deterministic, learnable, with a tied and a frozen parameter."""

import pytest
import torch

from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.gpt import TinyGPT, max_param_diff, synthetic_tokens, train_reference


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = TinyGPT(GPTConfig(), seed=1), TinyGPT(GPTConfig(), seed=1), TinyGPT(GPTConfig(), seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_embedding_is_tied_and_position_embedding_frozen():
    model = TinyGPT(GPTConfig())
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names), "the output head is the token embedding"
    assert not model.pos_emb.requires_grad
    tokens, targets = synthetic_tokens(0, 2, GPTConfig())
    model.loss(tokens, targets).backward()
    assert model.pos_emb.grad is None and model.tok_emb.weight.grad is not None


def test_data_is_deterministic_and_shaped():
    cfg = GPTConfig()
    x1, y1 = synthetic_tokens(3, 4, cfg, seed=5)
    x2, y2 = synthetic_tokens(3, 4, cfg, seed=5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (4, cfg.seq)
    assert torch.equal(x1[:, 1:], y1[:, :-1]), "targets are the inputs shifted by one"
    assert not torch.equal(synthetic_tokens(4, 4, cfg, seed=5)[0], x1)


def test_reference_trainer_learns_and_is_reproducible():
    train = TrainConfig(steps=6)
    first, second = train_reference(GPTConfig(), train), train_reference(GPTConfig(), train)
    assert first.losses == second.losses and max_param_diff(first.params, second.params) == 0.0
    assert first.losses[-1] < first.losses[0] - 0.3
    assert abs(first.losses[0] - torch.log(torch.tensor(128.0)).item()) < 0.3, "starts near ln(vocab)"


def test_float64_reference_agrees_with_float32():
    a = train_reference(GPTConfig(), TrainConfig(steps=2))
    b = train_reference(GPTConfig(), TrainConfig(steps=2, dtype="float64"))
    assert a.losses == pytest.approx(b.losses, abs=1e-5)


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="heads=5 must divide d_model=64"):
        GPTConfig(heads=5)
    with pytest.raises(ValueError, match="layers must be at least 1"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="dtype must be"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match="parameter names differ"):
        max_param_diff({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
