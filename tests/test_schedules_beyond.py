"""Schedules past ZB-H1: ZB-H2, ZB-V and DualPipeV as tables, checked and simulated against the papers' bubbles and
memory, compared action by action with PyTorch's own schedules, and run on real ranks against one device."""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from course_lib.cli import main
from course_lib.harness import run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, Layout, TrainConfig
from course_lib.parallel.schedule_sim import check, simulate
from course_lib.parallel.schedules import (
    COMPUTE,
    PIPELINE_SCHEDULES,
    V_SHAPED,
    Costs,
    bubble_formula,
    chunks_per_rank,
    compute_units,
    embedding_ranks,
    formula_holds,
    generate,
    idle_formula,
    peak_activations,
    stage_owner,
    tables_from_orders,
    virtual_stage,
)
from course_lib.planner.evaluate import evaluate_layout
from course_lib.planner.reasons import beyond_search
from course_lib.planner.search import plan

BEYOND = ("zb-h2", "zb-v", "dualpipev")
SIZES = [(2, 4), (3, 6), (4, 8), (4, 7), (5, 10)]
COSTS = [Costs(f, b, w) for f, b, w in itertools.product((0.5, 1, 2), (0.5, 1, 2), (0, 0.5, 1, 2))]
# Each schedule's closed form as the papers write it, per rank of p, in costs of a rank's whole stage.
CLOSED_FORM = {"zb-h2": lambda p, c: (p - 1) * c.f, "zb-v": lambda p, c: (p - 1) * c.f / 2}
# DualPipeV: DeepSeek's, less what the last rank's unpaired forward saves (idle_formula).
CLOSED_FORM["dualpipev"] = lambda p, c: ((p - 1) * (c.f + 2 * c.b - c.w) - min(c.f, (p - 1) * (c.b - c.f))) / 2


def test_a_v_places_stages_r_and_2p_minus_1_minus_r_and_puts_both_ends_on_rank_0():
    p = 4
    assert [[virtual_stage("zb-v", r, c, p) for c in (0, 1)] for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [[virtual_stage("interleaved", r, c, p) for c in (0, 1)] for r in range(p)] == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    for schedule in ("interleaved", "zb-v"):
        assert all(
            stage_owner(schedule, virtual_stage(schedule, r, c, p), p) == (r, c) for r in range(p) for c in (0, 1)
        )
    assert embedding_ranks("zb-v", p) == embedding_ranks("dualpipev", p) == [0]
    assert embedding_ranks("1f1b", p) == embedding_ranks("interleaved", p, 2) == [0, 3]
    assert embedding_ranks("1f1b", 1) == [0]
    # The turn of the V is on the last rank: its two chunks hand over in memory, no transfer between them.
    last = generate("zb-v", p, 8)[p - 1]
    assert {(a.kind, a.peer) for a in last if a.peer is not None} == {
        ("RECV_F", 2),
        ("SEND_B", 2),
        ("SEND_F", 2),
        ("RECV_B", 2),
    }
    assert chunks_per_rank("dualpipev") == 2 and chunks_per_rank("interleaved", 3) == 3


@pytest.mark.parametrize("schedule", V_SHAPED)
def test_a_v_takes_the_2_chunks_it_holds_and_refuses_other_counts(schedule, tmp_path):
    assert generate(schedule, 4, 8, 2) == generate(schedule, 4, 8)
    check(generate(schedule, 4, 8, chunks=2), 8, 2)
    for chunks in (3, 4):
        with pytest.raises(ValueError, match=f"^{schedule} holds 2 chunks per rank, in a V .*: give --chunks 2 or "):
            generate(schedule, 4, 8, chunks)
    out = tmp_path / "v.json"
    assert main(["schedule", "--schedule", schedule, "--chunks", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["chunks"] == 2 and data["actions"] == [[str(a) for a in t] for t in generate(schedule, 4, 8)]


@pytest.mark.parametrize("schedule", BEYOND)
def test_the_closed_form_is_given_exactly_where_it_is_the_simulated_idle(schedule):
    shown = outside = 0
    for (p, m), costs in itertools.product(SIZES, COSTS):
        if schedule == "dualpipev" and m < 2 * p:
            continue
        tables = generate(schedule, p, m, costs=costs)
        check(tables, m, chunks_per_rank(schedule))
        sim = simulate(tables, costs)
        assert max(sim.idle) == pytest.approx(min(sim.idle), abs=1e-12), "every rank does the same work"
        idle = idle_formula(schedule, p, m, costs=costs)
        if idle is None:
            outside += sim.idle[0] != pytest.approx(CLOSED_FORM[schedule](p, costs))
            continue
        shown += 1
        assert sim.idle == pytest.approx([idle] * p, abs=1e-12), (p, m, costs)
        assert sim.bubble_fraction == pytest.approx(bubble_formula(schedule, p, m, costs=costs), rel=1e-12)
    # The closed form is given in many cases, and the range is needed: outside it, it is not the table's idle.
    assert shown >= 20 and outside >= 10, (shown, outside)
    assert formula_holds(schedule, 4, 8, Costs(1, 1, 1)), "the papers' own setting, F = B = W"


def test_deepseek_v3_table_in_its_own_terms():
    """DeepSeek-V3 §3.2.1, Table 2 (per chunk, B the full backward): 1F1B (PP-1)(F+B), ZB1P (PP-1)(F+B-2W),
    DualPipeV (PP/2-1)(F&B+B-3W) with F&B = F+B here (the pair runs one after the other), less the F the last rank
    runs unpaired while its first gradient is on its way, min(F, (PP/2-1)(B-W-F)); PP+1 chunks in flight."""
    for p, f, b, w, unpaired in [
        (4, 1, 2, 1, 0),
        (3, 1, 2, 0.5, 1),
        (4, 1, 3, 1, 1),
        (6, 0.5, 1, 0.5, 0),
        (4, 1, 2.25, 1, 0.75),
    ]:
        one = Costs(f, b - w, w)  # a rank holds one chunk: B = input gradient + W
        assert simulate(generate("1f1b", p, 4 * p), one).idle[0] == pytest.approx((p - 1) * (f + b))
        assert simulate(generate("zb-h1", p, 4 * p, costs=one), one).idle[0] == pytest.approx((p - 1) * (f + b - 2 * w))
        two = Costs(2 * f, 2 * (b - w), 2 * w)  # a rank holds two chunks of PP = 2p: its stage costs twice a chunk
        sim = simulate(generate("dualpipev", p, 4 * p, costs=two), two)
        assert unpaired == min(f, (p - 1) * (b - w - f))
        assert sim.idle[0] == pytest.approx((2 * p / 2 - 1) * ((f + b) + b - 3 * w) - unpaired)
        assert max(sim.peak_inflight) == 2 * p + 1, "PP+1 chunks' activations"


def test_dualpipev_runs_the_last_ranks_first_forward_unpaired_half_a_forward_sooner():
    """DeepSeek's dualpipev.py: "we don't overlap these two chunks to further reduce bubble size". With B = 2F the
    step ends F/2 (one chunk's forward) sooner than with the pair; with B = F the idle is the same."""
    p, m = 4, 10
    units = compute_units("dualpipev", p, m)
    last = units[p - 1]
    assert last[8:11] == [[("F", 4, 0)], [("B", 0, 1), ("W", 0, 1)], [("F", 4, 1), ("B", 0, 0), ("W", 0, 0)]]
    paired = tables_from_orders("dualpipev", p, [*units[:-1], [*last[:8], last[8] + last[9], *last[10:]]])
    check(paired, m, 2)
    for costs, sooner in ((Costs(1, 2, 1), 0.5), (Costs(1, 1, 1), 0)):
        ours, theirs = simulate(generate("dualpipev", p, m, costs=costs), costs), simulate(paired, costs)
        assert theirs.makespan - ours.makespan == sooner
        assert ours.idle[0] == idle_formula("dualpipev", p, m, costs=costs)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1", *BEYOND])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (3, 9)])
def test_peak_activations_is_the_simulated_peak(schedule, p, m):
    v = 2 if schedule == "interleaved" else 1
    if schedule == "interleaved" and m % p:
        return
    peaks = simulate(generate(schedule, p, m, v)).peak_inflight
    assert max(peaks) / chunks_per_rank(schedule, v) == peak_activations(schedule, p, m, v)
    if schedule in ("zb-h2", "dualpipev"):  # every rank holds as much as the first
        assert len(set(peaks)) == 1


def test_zb_h2_trades_memory_for_the_floor_that_zb_h1_reaches_only_with_equal_costs():
    p, m = 4, 8
    for costs in (Costs(1, 1, 1), Costs(1, 2, 1), Costs(2, 2, 1)):
        h1, h2 = (simulate(generate(s, p, m, costs=costs), costs) for s in ("zb-h1", "zb-h2"))
        assert h2.idle[0] == (p - 1) * costs.f <= h1.idle[0] == (p - 1) * (costs.f + costs.b - costs.w)
        assert (max(h1.peak_inflight), max(h2.peak_inflight)) == (p, 2 * p - 1)
    # Equal costs: the same idle, placed differently. ZB-H2's first rank idles only at the end of the step.
    sim = simulate(generate("zb-h2", p, m, costs=Costs(1, 1, 1)), Costs(1, 1, 1))
    starts = [s for s, _, _ in sim.busy[0]]
    assert starts == list(range(len(starts))) and sim.busy[0][-1][1] == sim.makespan - (p - 1)


def test_receives_follow_each_peers_send_order_and_the_checker_sees_when_not():
    tables = generate("zb-v", 4, 8)
    # Rank 1 gets activations of chunk 0 and gradients of chunk 1 from rank 0: some arrive before they are needed.
    recvs = [a for a in tables[1] if a.kind.startswith("RECV") and a.peer == 0]
    sends = [a for a in tables[0] if a.kind.startswith("SEND") and a.peer == 1]
    assert [(a.kind[-1], a.microbatch) for a in recvs] == [(a.kind[-1], a.microbatch) for a in sends]
    swapped = list(tables[1])
    i = next(i for i, (a, b) in enumerate(itertools.pairwise(swapped)) if a in recvs and b in recvs)
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    with pytest.raises(ValueError, match="rank 1 receives .* from rank 0 before .* the receive would take the wrong"):
        check([tables[0], swapped, *tables[2:]], 8, 2)
    with pytest.raises(ValueError, match=r"rank 1 runs F0 \(stage 1\) before its input from stage 0"):
        check([tables[0], [a for a in tables[1] if a.kind != "RECV_F" or a.microbatch], *tables[2:]], 8, 2)


def test_zb_v_with_fewer_microbatches_than_its_pattern_drops_the_missing_ones():
    """ZB-V is laid out for 2p-1 microbatches; with fewer (as PyTorch does) the others' actions are left out, which
    stays free of deadlock but idles more. It needs no minimum."""
    for m in (1, 2, 3):
        tables = generate("zb-v", 4, m)
        check(tables, m, 2)
        assert simulate(tables, Costs(1, 1, 1)).idle[0] > idle_formula("zb-v", 4, 7, costs=Costs(1, 1, 1))


# ------------------------------------------------------------------------------------------- PyTorch's own tables
def torch_order(cls: type, p: int, m: int, local: int) -> list[list[tuple]]:
    """PyTorch's per-rank compute order, built by the schedule class itself from stand-in stages (nothing runs):
    (kind, microbatch, stage) in our letters, its I as our B, its full backward B as our B and W."""
    stages = [SimpleNamespace(num_stages=local * p, group_size=p, group_rank=0, submod=None) for _ in range(local)]
    ours = {"F": ("F",), "I": ("B",), "W": ("W",), "B": ("B", "W")}
    return [
        [
            (kind, action.microbatch_index, action.stage_index)
            for action in cls(stages, m).pipeline_order[r]
            if action is not None
            for kind in ours[action.computation_type.value]
        ]
        for r in range(p)
    ]


def our_order(schedule: str, p: int, m: int, chunks: int = 1) -> list[list[tuple]]:
    return [[(a.kind, a.microbatch, a.stage) for a in t if a.kind in COMPUTE] for t in generate(schedule, p, m, chunks)]


def without_w(order: list[list[tuple]]) -> list[list[tuple]]:
    return [[a for a in rank if a[0] != "W"] for rank in order]


def pytorch_v_table(name: str, p: int, m: int) -> list[list[str]]:
    """PyTorch's per-rank table of ``name``, a schedule class that holds 2 stages per rank in a V, built by the class
    from stand-in stages (nothing runs), in its notation: ``{stage}F{mb}``, ``I`` (input gradient), ``W``, ``B`` (a
    full backward), ``(..F..;..B..)OVERLAP_F_B``; the empty slots (None) that ZB-V keeps for timing left out."""
    cls = getattr(torch_schedules, name, None)
    if cls is None:
        pytest.skip(f"the installed torch {torch.__version__} has no torch.distributed.pipelining {name}")
    stages = [SimpleNamespace(num_stages=2 * p, group_size=p, group_rank=0, submod=None) for _ in range(2)]
    order = cls(stages, m).pipeline_order
    return [[str(a) for a in order[r] if a is not None] for r in range(p)]


def our_v_table(schedule: str, p: int, m: int) -> list[list[str]]:
    """Our units (:func:`compute_units`) in PyTorch's notation: a lone B (its W deferred) is its I, a B with its W
    its full backward B, an F with a full backward its overlapped pair."""

    def name(r: int, unit: list[tuple]) -> str:
        (kind, mb, chunk), stage = unit[0], virtual_stage(schedule, r, unit[0][2], p)
        if [a[0] for a in unit] == ["F", "B", "W"] and unit[1][1:] == unit[2][1:]:
            return f"({stage}F{mb};{virtual_stage(schedule, r, unit[1][2], p)}B{unit[1][1]})OVERLAP_F_B"
        if [a[0] for a in unit] == ["B", "W"] and unit[1][1:] == (mb, chunk):
            return f"{stage}B{mb}"
        return f"{stage}{'I' if kind == 'B' else kind}{mb}" if len(unit) == 1 else repr(unit)

    return [[name(r, unit) for unit in units] for r, units in enumerate(compute_units(schedule, p, m))]


V_SIZES = [(4, 10), (2, 4), (4, 8), (8, 16), (3, 7), (5, 13), (1, 2)]  # DualPipeV takes m >= 2p; PyTorch's test: 4 x 10


@pytest.mark.parametrize(
    ("name", "schedule", "p", "m"),
    [("ScheduleDualPipeV", "dualpipev", p, m) for p, m in V_SIZES]
    + [("ScheduleZBVZeroBubble", "zb-v", p, m) for p, m in [*V_SIZES, (3, 5), (4, 3)]],
)
def test_the_v_schedules_are_pytorchs_action_by_action(name, schedule, p, m):
    """DualPipeV as ScheduleDualPipeV (both from DeepSeek's dualpipev.py: its overlapped pairs, full backwards and
    the last rank's unpaired first F and B), ZB-V as ScheduleZBVZeroBubble (Qi et al.'s order, its I and W), every
    rank's every action in the same order. ZB-V with fewer than 2p-1 microbatches leaves out the same actions."""
    theirs, ours = pytorch_v_table(name, p, m), our_v_table(schedule, p, m)
    for r in range(p):
        assert ours[r] == theirs[r], f"rank {r} of {p}, {m} microbatches"


def test_zb_h1_runs_pytorchs_compute_order():
    """ZB-H1 as ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P), with the equal costs our ZB-H1 is
    planned with: the same F, B and W on every rank in the same order."""
    for p, m in [(2, 4), (4, 8), (4, 6), (3, 9), (4, 4)]:
        assert our_order("zb-h1", p, m) == torch_order(torch_schedules.ScheduleInterleavedZeroBubble, p, m, 1), (p, m)


def test_the_interleaved_and_gpipe_tables_are_pytorchs_too():
    """PyTorch's full backward shows as B and W; ours is one B in these schedules."""
    for p, m in [(2, 4), (4, 8), (4, 12)]:
        theirs = torch_order(torch_schedules.ScheduleInterleaved1F1B, p, m, 2)
        assert our_order("interleaved", p, m, 2) == without_w(theirs)
        # LoopedBFS with one stage per rank is GPipe.
        assert our_order("gpipe", p, m) == without_w(torch_order(torch_schedules.ScheduleLoopedBFS, p, m, 1))


def swaps(theirs: list[list[tuple]], ours: list[list[tuple]]) -> list[str]:
    """Per rank whose orders differ, the first difference: "rank r: PyTorch runs X before Y, ours Y before X"."""
    out = []
    for r, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is not None:
            x, y = (f"{k}{mb} (stage {s})" for k, mb, s in (a[first], b[first]))
            out.append(f"rank {r}: PyTorch runs {x} before {y}, ours {y} before {x}")
    return out


def test_with_fewer_microbatches_than_stages_pytorchs_zb_h1_defers_ws_by_rank_and_ours_fills_waits():
    """ScheduleInterleavedZeroBubble (one stage per rank) holds rank r's first W until r backwards have run, also
    when m < p, where our ZB-H1 runs a deferred W whenever the rank would wait: the same forwards, backwards and
    W's in the same order, only some W's earlier in ours; with equal costs the same idle and the same peak."""
    expected = {
        (4, 3): [
            "rank 1: PyTorch runs B1 (stage 1) before W0 (stage 1), ours W0 (stage 1) before B1 (stage 1)",
            "rank 2: PyTorch runs B2 (stage 2) before W0 (stage 2), ours W0 (stage 2) before B2 (stage 2)",
        ],
        (4, 2): [
            "rank 1: PyTorch runs B1 (stage 1) before W0 (stage 1), ours W0 (stage 1) before B1 (stage 1)",
            "rank 2: PyTorch runs B1 (stage 2) before W0 (stage 2), ours W0 (stage 2) before B1 (stage 2)",
        ],
        (3, 2): ["rank 1: PyTorch runs B1 (stage 1) before W0 (stage 1), ours W0 (stage 1) before B1 (stage 1)"],
    }
    costs = Costs(1, 1, 1)
    for (p, m), named in expected.items():
        theirs, ours = torch_order(torch_schedules.ScheduleInterleavedZeroBubble, p, m, 1), our_order("zb-h1", p, m)
        assert swaps(theirs, ours) == named
        for kind in COMPUTE:
            assert [[a for a in rank if a[0] == kind] for rank in theirs] == [
                [a for a in r if a[0] == kind] for r in ours
            ]
        tables = tables_from_orders("zb-h1", p, [[(k, mb, 0) for k, mb, _ in rank] for rank in theirs])
        check(tables, m)
        pytorch, own = simulate(tables, costs), simulate(generate("zb-h1", p, m), costs)
        assert (pytorch.idle, pytorch.peak_inflight) == (own.idle, own.peak_inflight)


def warmup(order: list[tuple]) -> int:
    """The forwards a rank runs before its first backward, checking that after them it runs one backward and one
    forward in turn until the forwards run out, then the backwards."""
    forwards, backwards = [a for a in order if a[0] == "F"], [a for a in order if a[0] == "B"]
    w = next(i for i, a in enumerate(order) if a[0] == "B")
    steady = [x for pair in zip(backwards, forwards[w:], strict=False) for x in pair]
    assert order == forwards[:w] + steady + backwards[len(forwards) - w :]
    return w


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 6), (4, 4)])
def test_pytorchs_interleaved_zero_bubble_warms_up_with_one_forward_less_per_hop_than_megatron(p, m):
    """ScheduleInterleavedZeroBubble with 2 stages per rank is not our interleaved 1F1B (Megatron-LM's order): the
    forwards and the backwards (its I) come in the same order on every rank, but rank r runs (v-1)p + p-r
    forwards before its first backward where Megatron runs (v-1)p + 2(p-1-r) + 1 (both at most v m), then both
    take turns: ZB-H1's warm-up, whose deferred W's fill what the missing forwards leave. Ours does not split W
    from B."""
    v = 2
    theirs, ours = (
        without_w(torch_order(torch_schedules.ScheduleInterleavedZeroBubble, p, m, v)),
        our_order("interleaved", p, m, v),
    )
    for r in range(p):
        for kind in "FB":
            assert [a for a in theirs[r] if a[0] == kind] == [a for a in ours[r] if a[0] == kind]
        assert warmup(theirs[r]) == min((v - 1) * p + p - r, v * m)
        assert warmup(ours[r]) == min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m)
    assert theirs != ours or p * v >= v * m


# --------------------------------------------------------------------------------------------- the planner, the CLI
def test_the_planner_offers_them_beside_its_choice_with_bubble_and_activations():
    assert set(PIPELINE_SCHEDULES) >= set(BEYOND)
    chosen = plan("gpt3-175b", 1536)
    others = {c.schedule: c for c in beyond_search(chosen)}
    assert set(others) == set(BEYOND) and "Past ZB-H1, not ranked by the search: ZB-H2" in " ".join(chosen.reasons)
    p, m = chosen.pp, chosen.microbatches
    layout = Layout(tp=chosen.tp, pp=p, dp=chosen.dp, zero=chosen.zero, sp=True)
    base = evaluate_layout("gpt3-175b", 1536, layout).memory["activations"]
    for schedule, c in others.items():
        assert c.bubble_fraction == pytest.approx(bubble_formula(schedule, p, m, costs=Costs(1, 1, 1)))
        assert c.memory["activations"] == pytest.approx(base * peak_activations(schedule, p, m) / p)
    assert others["zb-v"].memory["activations"] == pytest.approx(base) and others["zb-v"].bubble_fraction < (
        others["zb-h2"].bubble_fraction
    )


def test_the_schedule_command_draws_a_v(tmp_path):
    out, png = tmp_path / "zbv.json", tmp_path / "v.png"
    assert main(["schedule", "--schedule", "zb-v", "--w", "1", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["bubble_fraction"] == pytest.approx(data["bubble_formula"]) == pytest.approx(1.5 / 25.5)
    assert data["actions"][3][:4] == ["RECV_F0<-2", "F0", "F0.1", "SEND_F0.1->2"]  # the turn, in memory
    assert png.stat().st_size > 10_000


# --------------------------------------------------------------------------------------------------- real ranks
CFG = GPTConfig(layers=8)
# Each schedule once on 4 ranks in the default set; their 2-rank runs take the same paths and are slow.
RUNS = [
    pytest.param("zb-v", 2, 4, marks=pytest.mark.slow),
    ("zb-v", 4, 8),
    pytest.param("dualpipev", 2, 4, marks=pytest.mark.slow),
    ("dualpipev", 4, 8),
    ("zb-h2", 4, 8),
]


@pytest.mark.parametrize(("schedule", "p", "m"), RUNS)
def test_they_train_like_one_device_with_the_predicted_bytes(schedule, p, m):
    run = run_scheme("pp", p, CFG, TrainConfig(steps=2, dtype="float64"), schedule=schedule, microbatches=m)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, memory, sent in zip(run.report["ranks"], run.predicted_memory, run.predicted_comm, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent
        assert all(rank["memory"][c] == memory[c] for c in CATEGORIES)
        assert rank["memory"]["activations_peak"] == memory["activations"]
    if schedule in V_SHAPED:  # rank 0 holds both ends of the tied embedding: nothing to all-reduce
        assert "all_reduce" not in run.report["ranks"][0]["comm"]


# Float32 through a V once in the default set (DualPipeV, whose tables hold the most); ZB-V's is slow.
@pytest.mark.parametrize("schedule", [pytest.param("zb-v", marks=pytest.mark.slow), "dualpipev"])
def test_float32_v_matches_one_device(schedule):
    report = run_scheme("pp", 4, CFG, TrainConfig(steps=3), schedule=schedule, microbatches=8).report
    assert report["max_abs_loss_diff"] <= 1e-5 and report["rel_param_diff"] <= 1e-5


def test_a_v_in_the_grid_trains_like_one_device():
    run = run_scheme(
        "3d", 4, CFG, TrainConfig(steps=2, dtype="float64"), tp=1, pp=2, dp=2, schedule="zb-v", microbatches=2
    )
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, memory, sent in zip(run.report["ranks"], run.predicted_memory, run.predicted_comm, strict=True):
        assert rank["comm_by_axis"] == sent
        assert rank["memory"]["activations_peak"] == memory["activations"]
    assert all("embedding" not in row for row in run.predicted_comm)
