"""The pick-the-parallelism exercise, graded by reasoning from the planner's numbers (:mod:`course_lib.plan`).

A student names a scheme in words ("data parallel", "TP in the node + DP", "FSDP", "3D") or in numbers
("tp=8 pp=4 dp=2"). The grader reads the scenario (model size, GPUs, GPUs per node, constraints), asks the planner
where the model fits (the lesson's decision tree on model states) and which layouts fit in memory and how fast they
are, and answers with a verdict and the reasons: memory per GPU against the GPU's, which links each group would use,
and how much slower a workable but worse choice is. The prompts live in ``exercises/``; the model answers, shown
after grading, apart in ``exercises/answers/``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.hardware import get_profile
from course_lib.memory import model_state_formula
from course_lib.plan import SHAPES, Candidate, describe, evaluate, in_shape, plan

EXERCISES = Path(__file__).resolve().parent.parent / "exercises"
# Beside the decision tree's shape, the lesson accepts FSDP where the model fits one node, and where it asks for FSDP
# a named ZeRO-1 or ZeRO-2 (data parallelism with sharded optimizer state) that fits.
ALSO_ACCEPTED = {"tp": {"fsdp"}, "fsdp": {"dp"}, "dp": set(), "3d": set()}
NAMES = SHAPES | {"pp": "pipeline parallelism alone"}


@dataclass
class Answer:
    """A student's answer: its shape and the sizes it gave (None where it gave none)."""

    shape: str
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None


@dataclass
class Feedback:
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


def parse(answer: str | dict) -> Answer:
    """Read an answer given in words or sizes; a ValueError says what could not be read."""
    if isinstance(answer, dict):
        sizes = {k: answer.get(k) for k in ("tp", "pp", "dp", "zero")}
        text = ""
    else:
        text = answer.lower()
        sizes = {
            k: int(m.group(1)) if (m := re.search(rf"\b{k}\s*[=:x]?\s*(\d+)", text)) else None
            for k in ("tp", "pp", "dp")
        }
        zero = re.search(r"zero[- ]?(\d)", text)
        sizes["zero"] = int(zero.group(1)) if zero else None
    fsdp = sizes["zero"] == 3 or any(w in text for w in ("fsdp", "fully sharded"))
    tp = (sizes["tp"] or 1) > 1 or bool(re.search(r"\btp\b|tensor", text)) and sizes["tp"] != 1
    pp = (sizes["pp"] or 1) > 1 or bool(re.search(r"\bpp\b|pipeline", text)) and sizes["pp"] != 1
    if "3d" in text:
        tp = pp = True
    if tp and pp:
        shape = "3d"
    elif tp:
        shape = "tp"
    elif pp:
        shape = "pp"
    elif fsdp:
        shape = "fsdp"
    elif sizes["dp"] or re.search(r"\bdp\b|data", text) or "zero" in text:
        shape = "dp"
    else:
        raise ValueError(
            f"could not read a scheme in {answer!r}: name one (data parallel, FSDP, TP in the node + DP, 3D) or "
            f"give sizes such as 'tp=8 pp=4 dp=2'"
        )
    return Answer(shape, sizes["tp"], sizes["pp"], sizes["dp"], 3 if fsdp else sizes["zero"])


def _fits_shape(c: Candidate, shape: str, per_node: int) -> bool:
    return c.tp == 1 and c.pp > 1 if shape == "pp" else in_shape(c, shape, per_node)


def grade(scenario_id: str, answer: str | dict, exercise: str = "pick_the_parallelism") -> Feedback:
    """Grade one answer; the feedback explains the verdict with the planner's numbers."""
    scenarios = {s["id"]: s for s in load(exercise)["scenarios"]}
    if scenario_id not in scenarios:
        raise ValueError(f"no scenario {scenario_id!r}; the scenarios are {sorted(scenarios)}")
    s = scenarios[scenario_id]
    ans = parse(answer)
    per_node, no_mp = s["gpus_per_node"], s.get("no_model_parallel", False)
    best = plan(s["params"], s["gpus"], per_node, no_model_parallel=no_mp)
    full = plan(s["params"], s["gpus"], per_node) if no_mp else best  # every layout, for explaining
    gpu = best.gpu_mem_bytes
    profile = get_profile(best.hardware)
    states = sum(model_state_formula(s["params"], "mixed").values())
    key = model_answers(exercise)["scenarios"].get(scenario_id, "")
    where = (
        f"{s['params'] / 1e9:g}B parameters take {states / 1e9:.0f} GB of model states (16 bytes each with mixed-"
        f"precision Adam); one GPU holds {gpu / 1e9:.0f} GB, one node of {min(per_node, s['gpus'])} "
        f"{gpu * min(per_node, s['gpus']) / 1e9:.0f} GB"
    )
    reasons = [where]
    if no_mp and ans.shape in ("tp", "pp", "3d"):
        return Feedback(
            False,
            "Not for this team: it ruled out tensor and pipeline parallelism.",
            reasons + [f"Within that constraint: {NAMES[best.shape]}."],
            key,
        )
    problem = _check_sizes(ans, s, per_node, profile)
    if problem:
        return Feedback(False, f"Those sizes do not work here: {problem}", reasons, key)
    mine = _layouts_of(ans, s, per_node, full)
    if not any(c.fits for c in mine):
        need = min((c.memory_per_gpu_bytes for c in mine), default=None)
        why = f"the smallest such layout needs {need / 1e9:.0f} GB per GPU" if need else "no such layout exists"
        return Feedback(
            False,
            f"{NAMES[ans.shape][0].upper() + NAMES[ans.shape][1:]} does not fit: {why}, more than {gpu / 1e9:.0f} GB.",
            reasons + [f"What fits: {NAMES[best.shape]}, {describe(best, zero0=False)}."],
            key,
        )
    fastest = next(c for c in mine if c.fits)
    if ans.shape == best.shape or ans.shape in ALSO_ACCEPTED[best.shape]:
        verdict = (
            "Right." if ans.shape == best.shape else f"Also right (the planner's first choice: {NAMES[best.shape]})."
        )
        return Feedback(
            True,
            verdict,
            reasons + [f"{describe(fastest, zero0=False)} fits: {_memory(fastest, gpu)}."] + best.reasons[2:],
            key,
        )
    slower = fastest.step_time_s / best.step_time_s
    return Feedback(
        False,
        f"It would run, but it is not the right first choice: {_why_not(ans.shape, best.shape)}",
        reasons
        + [
            f"Yours at its best, {describe(fastest, zero0=False)}: {_memory(fastest, gpu)}, an estimated step "
            f"{slower:.2f}x the planner's choice ({describe(best, zero0=False)})."
        ],
        key,
    )


def _layouts_of(ans: Answer, s: dict, per_node: int, full) -> list[Candidate]:
    """The layouts of the student's shape (and sizes), evaluated as the planner would plan them: for data-parallel
    shapes with recompute if nothing fits without it, as the planner does."""
    source = full
    if ans.shape in ("dp", "fsdp"):
        try:
            source = plan(s["params"], s["gpus"], per_node, no_model_parallel=True)
        except ValueError:
            source = full
    mine = [c for c in source.candidates if _fits_shape(c, ans.shape, per_node) and _same_sizes(c, ans)]
    if ans.shape in ("dp", "fsdp") and not any(c.fits for c in mine):  # last resort: recompute every layer
        layouts = [(c.tp, c.pp, c.dp, c.zero, c.microbatches) for c in mine]
        mine = [
            evaluate(
                full.model,
                layout,
                full.gpus,
                full.network,
                full.gpu_mem_bytes,
                full.global_batch,
                full.micro_batch,
                full.precision,
                "full",
            )
            for layout in layouts
        ]
        mine.sort(key=lambda c: (not c.fits, c.step_time_s))
    return mine


def _same_sizes(c: Candidate, ans: Answer) -> bool:
    """The layout has the sizes the student gave; plain data parallelism means no sharding unless a ZeRO stage
    is named."""
    zero = 0 if ans.shape == "dp" and ans.zero is None else ans.zero
    return all(getattr(ans, k) in (None, getattr(c, k)) for k in ("tp", "pp", "dp")) and zero in (None, c.zero)


def _check_sizes(ans: Answer, s: dict, per_node: int, profile) -> str:
    given = [v for v in (ans.tp, ans.pp, ans.dp) if v]
    if ans.tp and ans.pp and ans.dp and ans.tp * ans.pp * ans.dp != s["gpus"]:
        return f"TP {ans.tp} x PP {ans.pp} x DP {ans.dp} = {ans.tp * ans.pp * ans.dp}, but there are {s['gpus']} GPUs."
    if given and any(s["gpus"] % v for v in given):
        return f"every size must divide the {s['gpus']} GPUs."
    if ans.tp and ans.tp > per_node:
        return (
            f"a TP group of {ans.tp} spans nodes of {per_node} GPUs: its all-reduces, several in every layer, would "
            f"run at {profile.inter_bandwidth / 1e9:g} GB/s per GPU instead of NVLink's "
            f"{profile.intra_bandwidth / 1e9:g}."
        )
    return ""


def _memory(c: Candidate, gpu: float) -> str:
    extra = f", with {c.recompute} recompute" if c.recompute != "none" else ""
    return f"{c.memory_per_gpu_bytes / 1e9:.1f} GB per GPU of {gpu / 1e9:.0f}{extra}"


def _why_not(mine: str, best: str) -> str:
    if best == "dp":
        return "the model fits one GPU, so plain data parallelism is simplest; splitting it only adds communication."
    if mine == "pp":
        return "pipeline stages alone mean a long pipeline with a big bubble; inside a node, TP uses the fast links."
    if mine == "3d":
        return "the model fits inside one node, so pipeline stages only add a bubble and complexity."
    if mine == "fsdp" and best == "3d":
        return (
            "the model does not fit a node: FSDP would gather every layer's parameters across nodes, over the "
            "slow links, for every microbatch."
        )
    return f"the lesson's answer here is {NAMES[best]}."
