"""The pick-the-parallelism exercise, graded by reasoning from the planner's numbers (:mod:`course_lib.planner`).

A student names a scheme in words or sizes; :func:`course_lib.practice.answers.parse` reads it into an
:class:`~course_lib.practice.answers.Answer` (the reading rules are that module's), :func:`grade` answers with a
verdict and the numbers behind it. The prompts live in ``exercises/``; the model answers, shown after
grading, apart in ``exercises/answers/``.

**Grading** (:func:`grade`), in this order, each refusal stating the fact or number that decides:

1. constraint: a team that ruled out TP and PP (``no_model_parallel``) gets no TP or PP;
2. sizes: each divides the GPUs, they multiply to the GPUs, PP splits the layers, TP divides the heads, and TP
   stays inside a node: a TP group across nodes would run its all-reduces over the network, not NVLink;
3. nodes: "3D" (PP across nodes) on one node: there is only one node;
4. memory: the answer's layouts are costed as the planner costs them, without recompute, then, if none fits, with
   selective, then full recompute (the lesson's FSDP on scenario b needs it); none fits: the smallest per GPU
   against the GPU's memory;
5. the lesson's answers: a layout that fits is right, at any sizes and any speed, if it has the decision tree's
   shape (plain DP where the states fit one GPU; TP without PP where they fit a node; TP with PP, any DP, where
   they do not: TP 8 x PP 8 x DP 1 on scenario c; sharded DP for a team without TP/PP) or is the alternative the
   lesson names, sharded data parallelism where the tree says TP or FSDP: any ZeRO stage, FSDP or HSDP. The
   feedback says how much slower than the fastest estimate it is and which part of the step makes it so (ZeRO-3
   on scenario d: 4.6x, its exposed DP traffic);
6. anything else that fits is right if its estimated step is within the planner's ``CLOSE`` (10%) of the fastest
   estimate that keeps the constraint, the margin within which the planner cannot tell layouts apart (FSDP on
   scenario a, TP 2 x PP 2 x DP 2 on b, PP 8 x DP 8 on g); slower is refused with the factor and the part of the
   step that makes it (bubble, exposed DP traffic, TP all-reduces, recompute). HSDP, which the planner does not
   time, is right only by rule 5 (on one node it is FSDP, and graded as FSDP).

An answer in words is graded at its fastest layout that fits. "Right" is the decision tree's shape, "Also right"
anything else accepted, with the lesson's answer beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from course_lib.cluster.profiles import get_profile
from course_lib.model.config import (
    RECOMPUTE_MODES,  # tried in this order, as the planner does
    Layout,
)
from course_lib.model.formulas import model_state_formula
from course_lib.planner.evaluate import evaluate
from course_lib.planner.layouts import CLOSE, SHAPES, Candidate, Plan, describe, layouts, splits_layers
from course_lib.planner.reasons import placement_sentences
from course_lib.planner.search import plan
from course_lib.practice.answers import EXAMPLES, Answer, UnreadableAnswer, describe_answer, parse

EXERCISES = Path(__file__).resolve().parents[2] / "exercises"
TREE_FAMILY = {"dp": "dp", "tp": "tp", "fsdp": "sharded", "3d": "3d"}  # the decision tree's shape, as a family
TIME_PARTS = {
    "compute_s": "compute",  # with recompute, the forward again
    "tp_comm_s": "TP all-reduces",
    "bubble_s": "the pipeline bubble",
    "pp_comm_s": "pipeline sends",
    "dp_comm_exposed_s": "data-parallel traffic not hidden behind compute",
    "cp_comm_exposed_s": "the CP ring",
    "ep_comm_s": "all-to-alls",
}
HSDP_UNTIMED = (
    "Not here: the planner does not time HSDP, so it counts only where the lesson itself shards data parallelism "
    "(model states over one GPU but within a node, or a team without TP or PP)."
)


@dataclass
class Feedback:
    """A verdict (its first words: "Right.", "Also right.", or why not), the reasons with their numbers, and the
    model answer."""

    correct: bool
    verdict: str
    reasons: list[str] = field(default_factory=list)
    model_answer: str = ""

    def __str__(self) -> str:
        lines = [self.verdict] + [f"  - {r}" for r in self.reasons]
        return "\n".join(lines + ([f"Model answer: {self.model_answer}"] if self.model_answer else []))


def load(name: str = "pick_the_parallelism") -> dict:
    """The exercise's prompts (``exercises/NAME.json``)."""
    return json.loads((EXERCISES / f"{name}.json").read_text())


def model_answers(name: str = "pick_the_parallelism") -> dict:
    """The model answers (``exercises/answers/NAME.json``): read them after answering."""
    return json.loads((EXERCISES / "answers" / f"{name}.json").read_text())


# ------------------------------------------------------------------------------------------------ the scenario
@dataclass(frozen=True)
class _Scenario:
    """A scenario and the planner's answer to it (cached: :func:`_scenario`)."""

    id: str
    spec: dict
    exercise: str
    choice: Plan  # the planner's choice within the constraint; its candidates[0] is the fastest estimate

    @property
    def gpus(self) -> int:
        return self.spec["gpus"]

    @property
    def per_node(self) -> int:
        return self.spec["gpus_per_node"]

    @property
    def constrained(self) -> bool:
        return self.spec.get("no_model_parallel", False)

    @property
    def fastest(self) -> Candidate:
        return self.choice.candidates[0]


@cache
def _scenarios(exercise: str) -> dict[str, dict]:
    return {s["id"]: s for s in load(exercise)["scenarios"]}


@cache
def _scenario(exercise: str, scenario_id: str) -> _Scenario:
    s = _scenarios(exercise)[scenario_id]
    choice = plan(s["params"], s["gpus"], s["gpus_per_node"], no_model_parallel=s.get("no_model_parallel", False))
    return _Scenario(scenario_id, s, exercise, choice)


@cache
def _pool(exercise: str, scenario_id: str, recompute: str) -> tuple[Candidate, ...]:
    """Every layout the planner enumerates for the scenario (TP and PP allowed), costed with ``recompute``."""
    p = _scenario(exercise, scenario_id).choice
    shapes = layouts(p.model, p.gpus, p.gpus_per_node, p.global_batch, p.micro_batch, False)
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.precision)
    return tuple(evaluate(p.model, shape._replace(recompute=recompute), *args) for shape in shapes)


@cache
def _hsdp(exercise: str, scenario_id: str, recompute: str) -> Candidate:
    """HSDP's memory per GPU: ZeRO-3 over one node's GPUs with the same microbatches per rank (its step is not
    timed: the planner has no cost for the replicas' all-reduce)."""
    p = _scenario(exercise, scenario_id).choice
    m, node = p.global_batch // (p.gpus * p.micro_batch), p.gpus_per_node
    layout = Layout(1, 1, node, 3, m, recompute=recompute, micro_batch=p.micro_batch)
    return evaluate(p.model, layout, node, p.network, p.gpu_mem_bytes, node * m * p.micro_batch, p.precision)


# ------------------------------------------------------------------------------------------------ grading
def grade(scenario_id: str, answer: str | dict, exercise: str = "pick_the_parallelism") -> Feedback:
    """Grade one answer; the feedback explains the verdict with the planner's numbers (module docstring). Never
    raises on an answer; an unknown scenario is a ValueError."""
    if scenario_id not in _scenarios(exercise):
        raise ValueError(f"no scenario {scenario_id!r}; the scenarios are {sorted(_scenarios(exercise))}")
    sc = _scenario(exercise, scenario_id)
    key = model_answers(exercise)["scenarios"].get(scenario_id, "")
    try:
        ans = parse(answer)
    except UnreadableAnswer as e:
        shown = repr(answer) if len(repr(answer)) <= 60 else repr(answer)[:57] + "..."
        return Feedback(False, f"Could not read {shown}: {e}. What it reads: {EXAMPLES}.", [_where(sc)], key)
    reasons = [describe_answer(ans), _where(sc)]
    if ans.hsdp and sc.gpus <= sc.per_node:
        reasons.append(f"There is only one node, so HSDP has one replica: FSDP over its {sc.gpus} GPUs, graded so.")
        ans = replace(ans, hsdp=False)
    refusal = _constraint(ans, sc) or _sizes_problem(ans, sc) or _one_node(ans, sc)
    if refusal:
        return Feedback(False, refusal, reasons + [_lesson(sc)], key)
    mine = _mine(ans, sc)
    if mine is None:
        return Feedback(False, "The planner has no layout with those sizes here.", reasons + [_lesson(sc)], key)
    if not mine.fits:
        return _too_big(ans, sc, mine, reasons, key)
    return _fits(ans, sc, mine, reasons, key)


def _where(sc: _Scenario) -> str:
    gpu, node = sc.choice.gpu_mem_bytes, min(sc.per_node, sc.gpus)
    return (
        f"{sc.spec['params'] / 1e9:g}B parameters take {_size(_states(sc))} of model states (16 bytes each with "
        f"mixed-precision Adam); one GPU holds {_size(gpu)}, a node of {node} GPUs, {_size(gpu * node)}."
    )


def _states(sc: _Scenario) -> float:
    return sum(model_state_formula(sc.spec["params"], sc.choice.precision).values())


def _lesson(sc: _Scenario) -> str:
    """The decision tree's answer and the number it rests on."""
    states, gpu, node = _size(_states(sc)), sc.choice.gpu_mem_bytes, min(sc.per_node, sc.gpus) * sc.choice.gpu_mem_bytes
    why = {
        "dp": f"{states} of model states fit one {_size(gpu)} GPU",
        "tp": f"{states} of model states exceed one GPU but fit the node's {_size(node)}",
        "fsdp": f"{states} of model states exceed one GPU, and the team wants no TP or PP",
        "3d": f"{states} of model states exceed a node's {_size(node)}",
    }[sc.choice.shape]
    return f"The lesson's answer: {SHAPES[sc.choice.shape]}, as {why}."


def _size(x: float) -> str:
    return f"{x / 1e12:.1f} TB" if x >= 1e12 else f"{x / 1e9:.0f} GB"


def _constraint(ans: Answer, sc: _Scenario) -> str:
    if not sc.constrained or ans.family in ("dp", "sharded"):
        return ""
    used = " and ".join(a for a, size in (("TP", ans.tp), ("PP", ans.pp)) if size != 1)
    return f"Not for this team: it ruled out tensor and pipeline parallelism, and this answer uses {used}."


def _sizes_problem(ans: Answer, sc: _Scenario) -> str:
    """Sizes that cannot make a layout here, the first reason found (module docstring, rule 2)."""
    sizes = {"TP": ans.tp, "PP": ans.pp, "DP": ans.dp}
    known = {k: v for k, v in sizes.items() if v is not None}
    bad = next((f"{k} {v}" for k, v in known.items() if sc.gpus % v), None)
    if bad:
        return f"Those sizes do not work here: every size must divide the {sc.gpus} GPUs, and {bad} does not."
    if (ans.tp or 1) > sc.per_node or ans.tp_across:
        return _tp_across(ans, sc)
    product = 1
    for v in known.values():
        product *= v
    if (len(known) == 3 and product != sc.gpus) or product > sc.gpus:
        text = " x ".join(f"{k} {v}" for k, v in known.items())
        return f"Those sizes do not work here: {text} = {product}, but there are {sc.gpus} GPUs."
    model = sc.choice.model
    if ans.pp and not splits_layers(model.layers, ans.pp):
        return (
            f"Those sizes do not work here: PP {ans.pp} does not split the model's {model.layers} layers into "
            f"stages of equal size (at most 3 of them one layer shorter)."
        )
    if ans.tp and model.heads % ans.tp:
        return f"Those sizes do not work here: TP {ans.tp} does not divide the model's {model.heads} heads."
    return ""


def _tp_across(ans: Answer, sc: _Scenario) -> str:
    if sc.gpus <= sc.per_node:
        return f"TP across nodes needs several nodes, and there is only one node ({sc.gpus} GPUs) here."
    profile = get_profile(sc.choice.hardware)
    group = f" (a TP group of {ans.tp} spans nodes of {sc.per_node} GPUs)" if ans.tp else ""
    return (
        f"TP stays inside a node: across nodes its all-reduces, several in every layer, would run at "
        f"{profile.inter_bandwidth / 1e9:g} GB/s per GPU instead of NVLink's {profile.intra_bandwidth / 1e9:g}{group}."
    )


def _one_node(ans: Answer, sc: _Scenario) -> str:
    if ans.named_3d and sc.gpus <= sc.per_node:
        return (
            f"3D puts pipeline stages across nodes, and there is only one node ({sc.gpus} GPUs) here: TP, PP and DP "
            f"all sit inside it."
        )
    return ""


def _matches(c: Candidate, ans: Answer, sc: _Scenario) -> bool:
    """Layout ``c`` is one the answer describes."""
    shape = {
        "dp": c.tp == c.pp == 1,
        "sharded": c.tp == c.pp == 1,
        "tp": c.tp > 1 and c.pp == 1,
        "pp": c.tp == 1 and c.pp > 1,
        "3d": c.tp > 1 and c.pp > 1 and (not ans.named_3d or c.tp * c.pp > sc.per_node),
    }[ans.family]
    stages = ans.stages if ans.stages is not None else {0} if ans.family == "dp" else None
    sizes = all(getattr(ans, k) in (None, getattr(c, k)) for k in ("tp", "pp", "dp"))
    return shape and sizes and (stages is None or c.zero in stages)


def _mine(ans: Answer, sc: _Scenario) -> Candidate | None:
    """The answer's fastest layout that fits, at the least recompute that lets one fit; if none fits, its
    smallest with full recompute; None if it describes no layout."""
    smallest = None
    for recompute in RECOMPUTE_MODES:
        if ans.hsdp:
            cands = [_hsdp(sc.exercise, sc.id, recompute)]
        else:
            cands = [c for c in _pool(sc.exercise, sc.id, recompute) if _matches(c, ans, sc)]
        if not cands:
            return None
        fits = [c for c in cands if c.fits]
        if fits:
            return min(fits, key=lambda c: (c.step_time_s, c.zero))
        smallest = min(cands, key=lambda c: c.memory_per_gpu_bytes)
    return smallest


def _name(ans: Answer, sc: _Scenario) -> str:
    if ans.hsdp:
        return "HSDP"
    if ans.family == "sharded":
        return "FSDP" if ans.stages == {3} else "Sharded data parallelism"
    return {"dp": "Plain data parallelism", "tp": "TP", "pp": "PP alone", "3d": "TP with PP"}[ans.family]


def _too_big(ans: Answer, sc: _Scenario, mine: Candidate, reasons: list[str], key: str) -> Feedback:
    gpu = sc.choice.gpu_mem_bytes
    smallest = "it" if ans.hsdp else f"its smallest layout, {describe(mine, zero0=False)},"
    return Feedback(
        False,
        f"{_name(ans, sc)} does not fit: {smallest} needs {mine.memory_per_gpu_bytes / 1e9:.0f} GB per GPU (with "
        f"full recompute), more than the GPU's {gpu / 1e9:.0f} GB.",
        reasons + [_lesson(sc), _choice(sc)],
        key,
    )


def _fits(ans: Answer, sc: _Scenario, mine: Candidate, reasons: list[str], key: str) -> Feedback:
    """A layout that fits: right if it is the lesson's answer or within ``CLOSE`` of the fastest estimate (rules 5
    and 6); HSDP has no step time (None)."""
    ratio = None if ans.hsdp else mine.step_time_s / sc.fastest.step_time_s
    if ratio is None:
        reasons = reasons + [f"HSDP fits: {_memory(mine, sc)}.", _hsdp_links(sc)]
    else:
        reasons = reasons + [f"{describe(mine, zero0=False)} fits: {_memory(mine, sc)}.", _speed(mine, sc, ratio)]
        reasons += placement_sentences(mine.placement)
    if _lesson_answer(ans, sc) or (ratio is not None and ratio <= 1 + CLOSE):
        return Feedback(True, _right(ans, sc, ratio), reasons + [_choice(sc)], key)
    verdict = (
        HSDP_UNTIMED
        if ratio is None
        else f"It fits, but it is slow here: an estimated step {ratio:.2f}x the fastest estimate, more than the "
        f"planner's {CLOSE:.0%}; {_slower(mine, sc)}."
    )
    return Feedback(False, verdict, reasons + [_lesson(sc), _choice(sc)], key)


def _right(ans: Answer, sc: _Scenario, ratio: float | None) -> str:
    slow = ratio is not None and ratio > 1 + CLOSE
    note = f" It is not the fastest: an estimated step {ratio:.2f}x the fastest estimate." if slow else ""
    if ans.family == TREE_FAMILY[sc.choice.shape]:
        return "Right." + note
    return f"Also right. The lesson's first choice: {SHAPES[sc.choice.shape]}.{note}"


def _memory(c: Candidate, sc: _Scenario) -> str:
    extra = f", with {c.recompute} recompute" if c.recompute != "none" else ""
    return f"{c.memory_per_gpu_bytes / 1e9:.1f} GB per GPU of {sc.choice.gpu_mem_bytes / 1e9:.0f}{extra}"


def _speed(c: Candidate, sc: _Scenario, ratio: float) -> str:
    fastest = sc.fastest
    text = (
        f"Estimated step {c.step_time_s:.3g} s, {ratio:.2f}x the fastest estimate ({describe(fastest, zero0=False)}, "
        f"{fastest.step_time_s:.3g} s)"
    )
    return text + (f", within the planner's {CLOSE:.0%}." if ratio <= 1 + CLOSE else f"; {_slower(c, sc)}.")


def _slower(c: Candidate, sc: _Scenario) -> str:
    """The part of the step that makes ``c`` slower than the fastest estimate."""
    fastest = sc.fastest
    part = max(c.time, key=lambda k: c.time[k] - fastest.time[k])
    again = f", with {c.recompute} recompute," if part == "compute_s" and c.recompute != "none" else ""
    return f"mostly {TIME_PARTS[part]}{again} ({c.time[part]:.3g} s against {fastest.time[part]:.3g} s)"


def _lesson_answer(ans: Answer, sc: _Scenario) -> bool:
    """The answer is the lesson's: the decision tree's shape, or sharded DP where the lesson offers it (rule 5)."""
    return ans.family == TREE_FAMILY[sc.choice.shape] or (ans.family == "sharded" and sc.choice.shape in ("tp", "fsdp"))


def _hsdp_links(sc: _Scenario) -> str:
    profile = get_profile(sc.choice.hardware)
    return (
        f"Its ZeRO-3 groups of {sc.per_node} sit inside a node ({profile.intra_bandwidth / 1e9:g} GB/s per GPU); "
        f"its {sc.gpus // sc.per_node} replicas all-reduce across nodes ({profile.inter_bandwidth / 1e9:g} GB/s per "
        f"GPU). The planner does not time HSDP."
    )


def _choice(sc: _Scenario) -> str:
    b = sc.choice
    return (
        f"The planner's choice{' within the constraint' if sc.constrained else ''}: {describe(b, zero0=False)} "
        f"({_memory(b, sc)}, {b.step_time_s:.3g} s)."
    )
