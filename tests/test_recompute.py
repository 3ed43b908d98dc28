"""Activation recomputation run for real: every scheme still equals one device, the saved activations each rank
measures equal the exact tiny-GPT formula (and the at-scale formula's terms), the collectives and FLOPs the
recomputed forward adds equal their predictions, and a mode a model has nothing for is refused in one line."""

import pytest
import torch
from torch import nn

from course_lib.cluster.profiles import get_profile
from course_lib.harness import run_scheme
from course_lib.ledgers import trace
from course_lib.ledgers.memory import MemoryMeter
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import activation_bytes_per_layer, tiny_gpt_activation_bytes
from course_lib.model.gpt import TinyGPT, synthetic_tokens
from course_lib.model.recompute import apply, extra_flops_per_layer

CASES = [
    ("dp", 2, {}),
    ("tp", 2, {}),
    ("sp", 2, {}),
    ("sp", 2, {"async_tp": True}),
    ("pp", 2, {"schedule": "1f1b"}),
    ("pp", 2, {"schedule": "zb-h1"}),
    ("pp", 2, {"schedule": "zb-v"}),
    ("cp", 2, {}),
    ("3d", 4, {"tp": 2, "pp": 2, "dp": 1, "sp": True}),
]


# The default set runs every scheme and schedule above, and each mode where the scheme does something of its own
# with it: full in tensor and sequence parallelism (their recomputed all-reduces, all-gathers, asynchronous ones),
# both in context parallelism (each runs the ring again and keeps its own activations); the rest alternate between
# the modes. The other rows are slow.
DEFAULT_MODES = {
    "dp-{}": ("selective",),
    "tp-{}": ("full",),
    "sp-{}": ("selective", "full"),
    "sp-{'async_tp': True}": ("full",),
    "pp-{'schedule': '1f1b'}": ("full",),
    "pp-{'schedule': 'zb-h1'}": ("selective",),
    "pp-{'schedule': 'zb-v'}": ("full",),
    "cp-{}": ("selective", "full"),
    "3d-{'tp': 2, 'pp': 2, 'dp': 1, 'sp': True}": ("full",),
}
assert set(DEFAULT_MODES) == {f"{c[0]}-{c[2]}" for c in CASES}


@pytest.mark.parametrize(
    ("scheme", "n", "options", "mode"),
    [
        pytest.param(
            *case,
            mode,
            id=f"{case[0]}-{case[2]}-{mode}",
            marks=() if mode in DEFAULT_MODES[f"{case[0]}-{case[2]}"] else pytest.mark.slow,
        )
        for case in CASES
        for mode in ("selective", "full")
    ],
)
def test_recomputed_schemes_equal_one_device_and_their_ledgers(scheme, n, options, mode):
    cfg = GPTConfig(layers=4 if scheme in ("pp", "3d") else 2, recompute=mode)
    run = run_scheme(scheme, n, cfg=cfg, train=TrainConfig(steps=2, dtype="float64"), **options)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, memory, sent in zip(run.report["ranks"], run.predicted_memory, run.predicted_comm, strict=True):
        comm = rank["comm_by_axis"] if scheme == "3d" else {op: c["bytes"] for op, c in rank["comm"].items()}
        assert comm == sent
        assert rank["memory"]["activations_peak"] == memory["activations"]


def _saved_bytes(cfg: GPTConfig, batch: int) -> int:
    model = TinyGPT(cfg, dtype=torch.float64)
    with MemoryMeter(model) as meter:
        model(*synthetic_tokens(0, batch, cfg)).backward()
    return meter.report().activations_peak


def test_one_device_keeps_what_the_formulas_say():
    """Exact bytes on one device, and the at-scale terms: full keeps each layer's input, sbh elements (Korthikanti's
    2sbh bytes in 16 bits); selective drops exactly the scores and the causal mask (his 5as^2b is the scores with
    their softmax input and dropout mask, which the tiny GPT does not keep)."""
    s, b, h, a, e = 32, 4, 64, 4, 8
    saved = {mode: _saved_bytes(GPTConfig(recompute=mode), b) for mode in ("none", "selective", "full")}
    for mode, measured in saved.items():
        assert measured == tiny_gpt_activation_bytes(GPTConfig(recompute=mode), b, e)["total"]
    layers = GPTConfig().layers
    at_scale_full = activation_bytes_per_layer(s, b, h, a, recompute="full")  # bytes in 16 bits
    assert saved["full"] - tiny_gpt_activation_bytes(GPTConfig(), b, e)["outside_layers"] == (
        layers * at_scale_full * e // 2
    )
    assert saved["none"] - saved["selective"] == layers * (e * a * s * s * b + s * s)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_recomputed_forward_costs_the_predicted_flops(mode):
    """Backward's recompute spans count exactly :func:`extra_flops_per_layer` per layer in matrix products: PyTorch's
    checkpoint stops at the layer's last saved tensor, so the MLP's second matmul (full) and the product with V
    (selective) are not run again."""
    cfg = GPTConfig(layers=3, recompute=mode)
    model = TinyGPT(cfg, dtype=torch.float64)
    trace.reset()
    with trace.FlopCounter():
        model(*synthetic_tokens(0, 4, cfg)).backward()
    recomputed = [seg for seg in trace.program() if seg.kind == "recompute"]
    assert sum(seg.flops for seg in recomputed) == cfg.layers * extra_flops_per_layer(cfg, 4)
    assert sum(e.kind == "recompute" for e in trace.events()) == cfg.layers


def test_tensor_parallel_ranks_recompute_their_share_on_the_modeled_clock():
    """Each of 2 sequence-parallel ranks recomputes 1/2 of every layer's matmuls, with the layer's collectives
    (tagged as recompute spans' work), and the modeled clock charges it: the step is longer than without."""
    train = TrainConfig(steps=1, dtype="float64")
    runs = {
        mode: run_scheme("sp", 2, cfg=GPTConfig(recompute=mode), train=train, hardware="h100")
        for mode in ("none", "full")
    }
    cfg, rate = GPTConfig(recompute="full"), get_profile("h100").peak_flops["bf16"] * 0.5
    for r, program in enumerate(runs["full"].result.programs):
        recomputed = [seg for seg in program if getattr(seg, "kind", None) == "recompute"]
        assert sum(seg.flops for seg in recomputed) == cfg.layers * extra_flops_per_layer(cfg, train.batch, tp=2)
        extra_s = sum(seg.flops + seg.elementwise for seg in recomputed) / rate
        compute_s = [run.modeled.ranks[r].compute_s for run in (runs["none"], runs["full"])]
        assert compute_s[1] - compute_s[0] == pytest.approx(extra_s, rel=1e-9)
    assert runs["full"].modeled.step_time_s > runs["none"].modeled.step_time_s


class Stack(nn.Module):
    """A student's model: an embedding, layers in an nn.ModuleList (one with attention), a tied head."""

    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True) if attention else None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.attn is not None:
            x = x + self.attn(x, x, x, need_weights=False)[0]
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy((x @ self.embed.weight.T).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_students_model_recomputes_and_trains_as_before(mode):
    tokens, targets = synthetic_tokens(0, 4, GPTConfig())
    grads = {}
    for m in ("none", mode):
        torch.manual_seed(0)
        model = apply(Stack(), m)
        model(tokens, targets).backward()
        grads[m] = {name: p.grad for name, p in model.named_parameters()}
    assert grads["none"].keys() == grads[mode].keys()  # the parameters keep their names
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads[mode][name], grad, rtol=0, atol=1e-6)
    train = TrainConfig(steps=2, dtype="float64")
    run = run_scheme("dp", 2, cfg=GPTConfig(recompute=mode), train=train, model=Stack)
    assert run.report["max_abs_param_diff"] <= 1e-12


def test_selective_recompute_needs_attention_and_full_a_layer_list():
    with pytest.raises(ValueError, match="has no attention module .* use recompute='full' or 'none'"):
        run_scheme("dp", 2, cfg=GPTConfig(recompute="selective"), model=lambda: Stack(attention=False))
    with pytest.raises(ValueError, match="keeps no layers in an nn.ModuleList"):
        apply(nn.Sequential(nn.Linear(2, 2)), "full")
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full"):
        GPTConfig(recompute="partial")
    with pytest.raises(ValueError, match="full recompute of an MoE layer over several ranks"):
        run_scheme("ep", 2, cfg=GPTConfig(experts=4, recompute="full"))
