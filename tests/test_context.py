"""Context parallelism: ring and all-gather attention against full causal attention, the cp scheme against one
device (both variants), its ledger against the formulas (bytes per rank, activations per rank), the ring's
communication overlapped with its compute, and bad settings refused before any rank starts."""

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from course_lib.cluster.clock import replay
from course_lib.cluster.profiles import get_profile
from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.ledgers.trace import Compute, Issue, Wait
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.model.formulas import tiny_gpt_activation_bytes
from course_lib.model.gpt import causal_attention
from course_lib.parallel.context import ATTENTION, kv_block_bytes, local_positions, sequence_shard
from course_lib.runtime import launch

CFG = GPTConfig()


def _heads_shard(x: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Rank r's tokens of a (batch, heads, seq, head_dim) tensor."""
    return sequence_shard(x.transpose(1, 2), r, n).transpose(1, 2)


def attention_two_ways(kv: str) -> list[float]:
    """This rank's output and q/k/v gradients of ring (or all-gather) attention against full causal attention on
    one process, for random float64 q, k, v and a random weighting of the output."""
    r, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 3, 16, 5, dtype=torch.float64, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference = causal_attention(*full)
    (reference * w).sum().backward()
    mine = [_heads_shard(t, r, n).requires_grad_(True) for t in (q, k, v)]
    out = ATTENTION[kv](*mine)
    (out * _heads_shard(w, r, n)).sum().backward()
    diffs = [(out - _heads_shard(reference, r, n)).abs().max().item()]
    return diffs + [(m.grad - _heads_shard(f.grad, r, n)).abs().max().item() for m, f in zip(mine, full, strict=True)]


@pytest.mark.parametrize("kv", list(ATTENTION))
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])  # 4: a ring of 3 hops, 2 of 1
def test_attention_over_the_group_equals_full_causal_attention(kv, n):
    for diffs in launch.run(attention_two_ways, n, kv):
        assert max(diffs) <= 1e-12, diffs


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_ranks_chunks_cover_the_sequence_once_early_and_late(n):
    positions = [local_positions(32, r, n) for r in range(n)]
    assert sorted(torch.cat(positions).tolist()) == list(range(32))
    c = 32 // (2 * n)
    assert [p[0].item() // c for p in positions] == list(range(n))
    assert [p[-1].item() // c for p in positions] == [2 * n - 1 - r for r in range(n)]


VARIANTS = [
    (2, "ring", 1, True),
    (4, "ring", 1, True),
    (2, "all-gather", 1, True),
    (4, "all-gather", 1, True),
    (2, "ring", 2, True),
    (4, "ring", 1, False),  # a trained position embedding: each rank's rows get gradients from its positions
]
IDS = [f"cp{n}-{kv}-accum{a}{'' if frozen else '-trained-positions'}" for n, kv, a, frozen in VARIANTS]
# The default set: each kv on 4 ranks (the ring with trained positions), accumulation on 2; the others are slow.
SLOW_VARIANTS = {(2, "ring", 1, True), (4, "ring", 1, True), (2, "all-gather", 1, True)}


@pytest.mark.parametrize(
    ("n", "kv", "grad_accum", "frozen_pos"),
    [
        pytest.param(*v, id=i, marks=pytest.mark.slow if v in SLOW_VARIANTS else ())
        for v, i in zip(VARIANTS, IDS, strict=True)
    ],
)
def test_matches_one_device_in_float64_and_ledger_equals_formulas(n, kv, grad_accum, frozen_pos):
    cfg, train = GPTConfig(frozen_pos=frozen_pos), TrainConfig(steps=2, dtype="float64")
    run = run_scheme("cp", n, cfg, train, kv=kv, grad_accum=grad_accum)
    report = run.report
    assert report["max_abs_loss_diff"] <= 1e-10
    assert report["max_abs_param_diff"] <= 1e-10
    one_device = tiny_gpt_activation_bytes(CFG, 8 // grad_accum, 8)["total"]
    for rank, predicted in zip(report["ranks"], run.predicted_memory, strict=True):
        assert rank["coords"] == {"cp": rank["rank"]}
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == run.predicted_comm[rank["rank"]]
        for cat in CATEGORIES:
            assert rank["memory"][cat] == predicted[cat], cat
        assert rank["memory"]["activations_peak"] == predicted["activations"]
        assert predicted["activations"] < one_device


@pytest.mark.parametrize("kv", list(ATTENTION))
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_matches_one_device_in_float32(kv, n):
    report = run_scheme("cp", n, train=TrainConfig(steps=3), kv=kv).report
    assert report["max_abs_loss_diff"] <= 1e-5 * max(report["reference_losses"])
    assert report["rel_param_diff"] <= 1e-5
    assert report["losses"][-1] < report["losses"][0]


@pytest.fixture(scope="module")
def one_step():
    """One float32 step of the ring on 2 and on 4 ranks, replayed on H100s: one launch each for the three tests
    below."""
    return {n: run_scheme("cp", n, train=TrainConfig(steps=1), hardware="h100") for n in (2, 4)}


@pytest.mark.parametrize("n", [2, 4])
def test_the_ring_passes_each_kv_block_n_minus_1_times_per_layer_and_direction(n, one_step):
    run = one_step[n]
    block = kv_block_bytes(CFG, 8, n, 4)  # 2 x (b, s/N, h) float32: this rank's K and V of one layer
    assert block == 4 * 2 * 8 * (32 // n) * 64
    ahead = {"forward": 1, "backward": -1}  # K/V go to the next rank, their gradients back to the previous one
    for rank, records in enumerate(run.result.comm):
        sends = Counter(
            (r.tags["layer"], r.tags["direction"], r.peer, r.tensor_bytes) for r in records if r.op == "send"
        )
        assert sends == {
            (layer, d, (rank + ahead[d]) % n, block): n - 1
            for layer in range(CFG.layers)
            for d in ("forward", "backward")
        }


def test_activations_per_rank_fall_with_the_group(one_step):
    """Measured on rank 0: the token-wise activations fall as 1/N, the kept K/V of the whole sequence does not."""
    peaks = {n: run.report["ranks"][0]["memory"]["activations_peak"] for n, run in one_step.items()}
    one_device = tiny_gpt_activation_bytes(CFG, 8)["total"]
    assert one_device / 2 < peaks[2] < 0.7 * one_device
    assert one_device / 4 < peaks[4] < 0.45 * one_device


@pytest.mark.parametrize(
    ("world_size", "cfg", "train", "options", "message"),
    [
        (3, CFG, TrainConfig(), {}, r"2 x 3 = 6 equal chunks .* sequence length 32 is not a multiple of 6"),
        (4, GPTConfig(seq=36), TrainConfig(), {}, r"sequence length 36 is not a multiple of 8"),
        (2, CFG, TrainConfig(), {"kv": "allgather"}, r"kv must be one of \['all-gather', 'ring'\], not 'allgather'"),
        (2, CFG, TrainConfig(batch=6), {"grad_accum": 4}, r"batch of 6 sequences does not split into grad_accum=4"),
    ],
)
def test_bad_settings_are_refused_before_any_rank_starts(world_size, cfg, train, options, message, monkeypatch):
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match=message):
        run_scheme("cp", world_size, cfg, train, **options)


def test_ring_attention_overlaps_each_step_with_compute_and_the_modeled_clock_hides_it(one_step):
    """Every ring send and receive (K/V forward, their gradients backward) is issued before the attention of the
    block in hand and waited for after it, so the program has compute between each Issue and its Wait; replayed on
    a device whose compute is slow against its links (100 GFLOP/s, a CPU core's order), every ring message hides
    behind compute: the exposed comm is no more than the gradient all-reduce's alone."""
    run = one_step[4]
    for program, records in zip(run.result.programs, run.result.comm, strict=True):
        ring = {i for i, rec in enumerate(records) if rec.op in ("send", "recv") and "direction" in rec.tags}
        assert len(ring) == 2 * 2 * (4 - 1) * CFG.layers  # send and recv, forward and backward, N-1 steps, layers
        issued_at = {e.record: k for k, e in enumerate(program) if isinstance(e, Issue) and e.record in ring}
        for k, entry in enumerate(program):
            if isinstance(entry, Wait) and entry.record in ring:
                between = program[issued_at[entry.record] : k]
                assert any(isinstance(e, Compute) and e.flops > 0 for e in between), records[entry.record].tags
    slow = dataclasses.replace(get_profile("h100"), peak_flops={"bf16": 1e11})
    modeled = replay(run.result.programs, run.result.comm, slow)
    for numbers, events in zip(modeled.ranks, modeled.events, strict=True):
        step = [e for e in events if e.kind == "comm" and e.tags.get("step") == 0]
        ring_s = sum(e.duration for e in step if "direction" in e.tags)
        all_reduce_s = sum(e.duration for e in step if e.name == "all_reduce")
        assert ring_s > all_reduce_s > 0
        assert numbers.exposed_comm_s <= all_reduce_s < numbers.comm_s
