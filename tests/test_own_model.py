"""The course's schemes on a student's own model: ``run_scheme(..., model=factory)`` and ``run --model FILE:NAME``
train it on real ranks, compare it with the same model on one process, and measure its memory and bytes beside the
predictions, which come from that model's own parameters; a factory the harness cannot train is refused before any
rank starts, saying what it must be."""

import json

import pytest
import torch
from torch import nn

from course_lib.cli import main
from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig

VOCAB = GPTConfig().vocab


class BagOfEmbeddings(nn.Module):
    """A student's language model: no attention, a tied embedding, a frozen scale, a frozen bias; the tiny GPT's
    (tokens, targets) -> mean loss contract."""

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
        self.mix[2].bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(width), requires_grad=False)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.mix(x.cumsum(1) / torch.arange(1, x.shape[1] + 1).unsqueeze(-1)) * self.scale
        return nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


CASES = [("single", 1, {}), ("dp", 2, {}), ("zero1", 3, {}), ("zero2", 2, {"grad_accum": 2}), ("zero3", 4, {})]


@pytest.mark.parametrize(("scheme", "n", "options"), CASES, ids=[c[0] for c in CASES])
def test_a_students_model_trains_as_on_one_process_with_measured_ledgers(scheme, n, options):
    train = TrainConfig(steps=2, batch=12, dtype="float64")
    run = run_scheme(scheme, n, train=train, model=BagOfEmbeddings, in_process=n == 1, **options)
    assert run.report["max_abs_param_diff"] < 1e-12 and run.report["max_abs_loss_diff"] < 1e-12
    assert run.report["params"] == sum(p.numel() for p in BagOfEmbeddings().parameters() if p.requires_grad)
    assert set(run.report["reference_losses"]) != {run.report["reference_losses"][0]}  # it trained
    for rank, predicted, sent in zip(run.report["ranks"], run.predicted_memory, run.predicted_comm, strict=True):
        assert {c: rank["memory"][c] for c in CATEGORIES} == predicted  # no activation formula for this model
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent


def test_a_scheme_for_the_tiny_gpt_only_says_which_take_your_model():
    with pytest.raises(ValueError, match=r"scheme 'tp' trains the course's tiny GPT only; .*\['single', 'dp', 'zero1'"):
        run_scheme("tp", 2, model=BagOfEmbeddings)


class TiedByHand(nn.Module):
    """The output head is the embedding's weight, used outside the embedding's forward."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)

    def forward(self, tokens, targets):
        logits = self.embed(tokens) @ self.embed.weight.T
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def test_fsdp_names_a_parameter_used_outside_its_unit():
    with pytest.raises(RuntimeError, match=r"TiedByHand used a parameter that FSDP had freed \(units not gathered"):
        run_scheme("zero3", 2, model=TiedByHand)


class Logits(BagOfEmbeddings):
    def forward(self, tokens, targets):
        return self.embed(tokens)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (BagOfEmbeddings(), "model must be a function .*; got a BagOfEmbeddings instance: pass the class"),
        (lambda: torch.zeros(3), "model\\(\\) returned a Tensor; it must return an nn.Module"),
        (lambda: nn.Linear(2, 2).requires_grad_(False), "your Linear has no trainable parameter"),
        (lambda: nn.Linear(2, 2), r"your Linear failed on a batch: model\(tokens, targets\), both of shape \(1, 32\)"),
        (Logits, r"must return the mean loss, a scalar tensor with a gradient; it returned a tensor of shape \(1, 32"),
    ],
    ids=["an-instance", "not-a-module", "frozen", "wrong-forward", "logits"],
)
def test_a_model_the_harness_cannot_train_is_refused_up_front(factory, message):
    with pytest.raises(ValueError, match=message):
        run_scheme("dp", 2, model=factory)


MODEL_FILE = """
import torch
from torch import nn


class Unigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(128))

    def forward(self, tokens, targets):
        return nn.functional.cross_entropy(self.logits.expand(targets.numel(), -1), targets.reshape(-1))


def build():
    return Unigram()
"""


def test_the_command_line_trains_a_model_from_a_file(tmp_path, capsys):
    path = tmp_path / "student_model.py"  # not importable by the ranks: the factory travels by value
    path.write_text(MODEL_FILE)
    assert main(["run", "zero2", "--model", f"{path}:build", "--world-size", "2", "--steps", "2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == 128 and data["max_abs_loss_diff"] <= 1e-6
    assert data["ranks"][0]["comm"]["reduce_scatter"]["bytes"] == 4 * 128 / 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("student_model.py", "give FILE.py:NAME or package.module:NAME"),
        ("nowhere.py:build", "there is no file nowhere.py"),
        ("{path}:make", "defines no 'make'"),
        ("no_such_package.models:build", "cannot import no_such_package.models"),
        ("{dir}/syntax.py:build", "syntax.py, line 2: invalid syntax (a syntax error)"),
        ("{dir}/raises.py:build", "raised ZeroDivisionError: division by zero ({dir}/raises.py, line 3)"),
        ("{dir}/exits.py:build", "importing {dir}/exits.py called sys.exit(3); a model file must not exit"),
        ("{dir}/imports.py:build", "cannot import {dir}/imports.py: No module named 'no_such_package'"),
    ],
)
def test_a_bad_model_flag_is_one_line(tmp_path, capsys, spec, message):
    """Every way a model file can fail to import is one line naming the file (and its line), before any rank."""
    (tmp_path / "student_model.py").write_text(MODEL_FILE)
    (tmp_path / "syntax.py").write_text("import torch\ndef build(:\n    pass\n")
    (tmp_path / "raises.py").write_text("import torch\n\nSCALE = 1 / 0\n")
    (tmp_path / "exits.py").write_text("import sys\n\nsys.exit(3)\n")
    (tmp_path / "imports.py").write_text("import no_such_package\n")
    with pytest.raises(SystemExit) as stop:
        main(["run", "dp", "--model", spec.format(path=tmp_path / "student_model.py", dir=tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message.format(dir=tmp_path) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


class NanLoss(nn.Module):
    """A model whose loss is NaN from the first batch (a log of 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 8)

    def forward(self, tokens, targets):
        return (self.embed(tokens).sum() * torch.log(torch.zeros(()))).mean() * 0


class Diverges(nn.Module):
    """A model that trains one step, then its loss becomes NaN (as a diverging run's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.calls = nn.Embedding(128, 8), 0

    def forward(self, tokens, targets):
        self.calls += 1
        logits = self.embed(tokens) @ self.embed.weight.T
        loss = nn.functional.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))
        return loss * (float("nan") if self.calls > 1 else 1.0)  # each rank's model: step 0 finite, then NaN


def test_a_loss_that_is_not_finite_is_one_line_saying_where(capsys):
    with pytest.raises(ValueError, match="your NanLoss's loss on the first batch is nan: a loss that is not a number"):
        run_scheme("dp", 2, model=NanLoss)
    with pytest.raises(ValueError, match=r"dp: the loss is not finite from step 1 on \(\[[0-9.]+, nan"):
        run_scheme("dp", 2, train=TrainConfig(steps=2), model=Diverges)
