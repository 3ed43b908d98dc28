"""The pick-the-parallelism exercise, graded by reasoning from the planner's numbers (:mod:`course_lib.plan`).

A student names a scheme in words or sizes; :func:`parse` reads it into an :class:`Answer`, :func:`grade` answers
with a verdict and the numbers behind it. The prompts live in ``exercises/``; the model answers, shown after
grading, apart in ``exercises/answers/``.

**Reading** (:func:`parse`; case does not matter):

* schemes: plain data parallelism ("DP", "DDP", "data parallel", "DistributedDataParallel"); sharded data
  parallelism: "ZeRO-k", "ZeRO stage k", "zero=k", "DeepSpeed ZeRO" or "ZeRO" (any stage), "FSDP" / "fully
  sharded" (ZeRO-3), "HSDP" / "hybrid sharded" (FSDP inside a node, replicas across nodes), "sharded data
  parallel" (any stage), "sharded optimizer" (ZeRO-1); TP ("TP", "tensor parallel", "Megatron TP"); PP ("PP",
  "pipeline", "GPipe", "1F1B"); "3D" (TP inside nodes, PP across nodes, so TP x PP is more than a node; DP on
  top); "model parallelism" (TP and PP, mostly in "no model parallelism"); "TP across nodes";
* sizes: "tp=8 pp=4 dp=2", "tp8/pp4/dp2", "TP 8, PP 4", "TP of 8", "8-way TP", and "8x4x2", read as TP x PP x DP
  (the feedback says so); a size of 1 means the axis is off; an axis left out is the rest of the GPUs (DP) or off;
* negation: "no", "not", "without", "neither ... nor", "instead of", "don't use", ... negate the scheme right after
  them and the ones joined to it by "or", "nor" or "/" (by "and" or "," only while they are of the same kind:
  "no TP, PP or CP" but "without TP or PP, FSDP"); "not needed", "none", "unnecessary" after a scheme negate it.
  "No TP" sets TP 1, "no ZeRO" / "no sharding" plain DP;
* anything else (a contradiction, context or expert parallelism, "2D", an impossible ZeRO stage) is unreadable:
  the feedback says what and shows what can be read. :func:`grade` never raises on an answer.

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
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from course_lib.hardware import get_profile
from course_lib.memory import model_state_formula
from course_lib.plan import (
    CLOSE,
    SHAPES,
    Candidate,
    Layout,
    Plan,
    describe,
    evaluate,
    layouts,
    placement_sentences,
    plan,
    splits_layers,
)

EXERCISES = Path(__file__).resolve().parent.parent / "exercises"
RECOMPUTE = ("none", "selective", "full")  # tried in this order, as the planner does
TREE_FAMILY = {"dp": "dp", "tp": "tp", "fsdp": "sharded", "3d": "3d"}  # the decision tree's shape, as a family
SHARDING = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer state"}
FAMILY_NAMES = {
    "dp": "plain data parallelism (DDP: a whole copy of the model on every GPU)",
    "sharded": "data parallelism with ZeRO sharding",
    "tp": "tensor parallelism (TP inside a node, DP over the rest)",
    "pp": "pipeline parallelism (PP, DP over the rest, no TP)",
    "3d": "TP with PP (DP over the rest)",
}
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
EXAMPLES = (
    "name a scheme (data parallel, DDP, FSDP, ZeRO-2, HSDP, TP in the node + DP, pipeline, 3D; 'FSDP, no TP or PP') "
    "or give sizes such as 'tp=8 pp=4 dp=2' or '8x4x2' (TP x PP x DP)"
)


class UnreadableAnswer(ValueError):
    """An answer :func:`parse` cannot read; its message says what and what it can read."""


@dataclass(frozen=True)
class Answer:
    """A student's answer: its family ("dp", "sharded", "tp", "pp", "3d"), the sizes it gave (None: not given),
    the ZeRO stages it allows (None: any the planner has), HSDP, whether it named 3D or TP across nodes, and notes
    on how it was read."""

    family: str
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    stages: frozenset[int] | None = None
    hsdp: bool = False
    named_3d: bool = False
    tp_across: bool = False
    notes: tuple[str, ...] = ()


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


# ------------------------------------------------------------------------------------------------ reading
_AXIS = r"(tp|pp|dp|tensor|pipeline|data)"
_PAR = r"(?:[\s_-]*(?:model[\s_-]*)?parallel\w*)?"
_SEP = r"[\s_=:-]*"
TOKENS = {  # first match at a position wins, so longer phrases come first
    "product": r"(?<![\d.])\d+(?:\s*[x*]\s*\d+)+(?![\d.]|\s*(?:gpus?|nodes?)\b)",
    "way": rf"\b(\d+)[\s-]*way\s+{_AXIS}\w*{_PAR}",
    "size": rf"\b{_AXIS}{_PAR}(?:[\s_-]*(?:size|degree|dim|group))?\s*(?:=|:|of|x)?\s*(-?\d+(?:\.\d+)?)\b"
    r"(?!\s*(?:gpus?|nodes?|b\b|billion))",
    "postneg": r"\b(?:(?:is|are)\s+)?(?:not\s+(?:needed|required|used|necessary|wanted)|(?:is|are)n'?t\s+needed|"
    r"unnecessary|unneeded|none|off|disabled)\b",
    "neg": r"\b(?:no\s+need\s+for|instead\s+of|rather\s+than|(?:do|does|did)\s*n[o']?t\s+(?:use|need|want)|"
    r"don'?t\s+(?:use|need|want)|without|w/o|not|no|never|neither|except|excluding|avoid\w*|skip\w*)\b",
    "tp_across": rf"\b(?:tp|tensor){_PAR}\s+(?:across|between|spanning|over)\s+(?:the\s+|all\s+|several\s+|two\s+|"
    r"multiple\s+)?nodes\b",
    "pp": r"\bpp\b|\bpipelin\w*" + _PAR + r"|\bpipe\b|\bgpipe\b|\b1f1b\b|\bpipedream\w*|\bzero[\s_-]*bubble\w*|"
    r"\bzb[\s_-]*(?:h[12]|v)\b|\bdualpipe\w*|\binterleaved\b|\binter[\s_-]*layer\w*" + _PAR,
    "zero": rf"\b(?:deepspeed[\s_-]*)?zero(?:{_SEP}(?:stage|s)?{_SEP}(\d+))?(?:\+\+)?",
    "deepspeed": rf"\bdeepspeed(?:{_SEP}stage{_SEP}(\d+))?",
    "hsdp": r"\bhsdp\b|\bhybrid[\s_-]*shard\w*(?:[\s_-]*data[\s_-]*parallel\w*)?",
    "fsdp": r"\bfsdp\d?\b|\bfully[\s_-]*shard\w*(?:[\s_-]*data[\s_-]*parallel\w*)?",
    "shard1": r"\boptimi[sz]er[\s_-]*(?:states?[\s_-]*)?(?:shard|partition)\w*|\bshard\w*[\s_-]*optimi[sz]er\w*",
    "tp": r"\btp\b|\btensor(?:[\s_-]*(?:model[\s_-]*)?parallel\w*|[\s_-]*(?:slicing|shard\w*))?|"
    r"\bintra[\s_-]*layer\w*" + _PAR,
    "shard": r"\bshard\w*(?:[\s_-]*(?:data[\s_-]*parallel\w*|dp|ddp))?",
    "dp": r"\bddp\b|\bdistributed[\s_-]*data[\s_-]*parallel\w*|\bdata[\s_-]*parallel\w*|\bdp\b|\bdata\b|"
    r"\breplica\w*",
    "mp": r"\bmodel[\s_-]*parallel\w*|\bmp\b",
    "3d": r"\b3[\s-]?d\b" + _PAR + r"|\bthree[\s_-]*d(?:imensional)?\b" + _PAR + r"|\ball\s+three\b",
    "2d": r"\b2[\s-]?d\b|\btwo[\s_-]*d(?:imensional)?\b",
    "cp": r"\bcp\b|\bcontext[\s_-]*parallel\w*|\bring[\s_-]*attention\b|\bulysses\b",
    "ep": r"\bep\b|\bexpert[\s_-]*parallel\w*|\bmoe\b|\bmixture[\s_-]*of[\s_-]*experts\b",
}
KINDS = list(TOKENS)
_PATTERNS = {kind: re.compile(pattern) for kind, pattern in TOKENS.items()}
_SCAN = re.compile("|".join(f"(?P<k{i}>{TOKENS[kind]})" for i, kind in enumerate(KINDS)))
GROUP = {"tp": "mp", "tp_across": "mp", "pp": "mp", "mp": "mp", "3d": "mp", "2d": "mp", "cp": "mp", "ep": "mp"}
GROUP |= dict.fromkeys(("zero", "deepspeed", "hsdp", "fsdp", "shard1", "shard"), "shard") | {"dp": "dp"}
FILLER = set(
    "any either the a an of use using used need needed for to extra additional other more kind kinds type types "
    "sort at all parallel parallelism parallelization its".split()
)
HARD, SOFT = {"or", "nor", "/", "|"}, {",", "and", "&"}


@dataclass
class _Reading:
    """What the scan found: the schemes named (kind -> stage or None) and negated, the sizes, notes."""

    named: dict[str, set[int | None]] = field(default_factory=dict)
    negated: dict[str, set[int | None]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, kind: str, stage: int | None, negated: bool) -> None:
        (self.negated if negated else self.named).setdefault(kind, set()).add(stage)

    def size(self, axis: str, value: str) -> None:
        if not re.fullmatch(r"-?\d+", value) or int(value) < 1:
            raise UnreadableAnswer(f"sizes are whole numbers of at least 1, not {axis.upper()} {value}")
        if self.sizes.get(axis, int(value)) != int(value):
            raise UnreadableAnswer(f"{axis.upper()} is given twice, as {self.sizes[axis]} and {value}")
        self.sizes[axis] = int(value)


def _gap(text: str) -> str:
    """How the text between two schemes joins them: 'filler', 'hard' (or, nor, /), 'soft' (and, a comma) or
    'break' (anything else)."""
    words = re.findall(r"[a-z']+|[^\sa-z']", text)
    if any(w not in FILLER | HARD | SOFT for w in words):
        return "break"
    return "hard" if HARD & set(words) else "soft" if SOFT & set(words) else "filler"


def _scan(text: str) -> _Reading:
    """Schemes, sizes and negations, left to right (the module docstring's reading rules)."""
    read = _Reading()
    pending, scope, run, last = False, None, [], 0  # a negation waiting; the negated run's group; positive run
    for found in _SCAN.finditer(text):
        kind, gap = KINDS[int(found.lastgroup[1:])], _gap(text[last : found.start()])
        m, last = _PATTERNS[kind].fullmatch(found.group()), found.end()  # its own groups
        if kind in ("product", "way", "size"):
            _sizes(read, kind, m)
            pending, scope, run = False, None, []
        elif kind == "neg" or (kind == "postneg" and not (run and gap == "filler")):
            pending, scope, run = True, None, []
        elif kind == "postneg":
            for k, stage in run:
                read.named[k].discard(stage)
                read.add(k, stage, True)
            run = []
        else:
            stage = _stage(kind, m)
            same = scope == GROUP[kind]
            negated = (pending and gap == "filler") or (
                scope is not None and (gap == "hard" or (gap in ("soft", "filler") and same))
            )
            read.add(kind, stage, negated)
            if negated:
                scope, pending, run = scope or GROUP[kind], False, []
            else:
                scope, pending = None, False
                run = run + [(kind, stage)] if gap != "break" else [(kind, stage)]
    read.named = {k: v for k, v in read.named.items() if v}
    return read


def _stage(kind: str, m: re.Match) -> int | None:
    """The ZeRO stage a sharding scheme names (None: any)."""
    if kind in ("fsdp", "hsdp"):
        return 3
    if kind == "shard1":
        return 1
    digits = next((g for g in m.groups() if g and g.isdigit()), None) if kind in ("zero", "deepspeed") else None
    if digits is not None and int(digits) > 3:
        raise UnreadableAnswer(f"ZeRO has stages 1, 2 and 3 (0 is plain data parallelism), not {digits}")
    return int(digits) if digits is not None else None


def _sizes(read: _Reading, kind: str, m: re.Match) -> None:
    """Sizes from '8x4x2' (TP x PP x DP), '8-way TP' or 'tp=8'."""
    if kind == "product":
        numbers = re.findall(r"\d+", m.group())
        if len(numbers) != 3:
            raise UnreadableAnswer(f"'{m.group()}' has {len(numbers)} sizes; give three, TP x PP x DP, such as 8x4x2")
        for axis, value in zip(("tp", "pp", "dp"), numbers, strict=True):
            read.size(axis, value)
        read.notes.append(f"'{m.group()}' read as TP {numbers[0]} x PP {numbers[1]} x DP {numbers[2]}.")
        return
    groups = [g for g in m.groups() if g is not None]
    value, axis = (groups[0], groups[1]) if kind == "way" else (groups[-1], groups[0])
    read.size({"tensor": "tp", "pipeline": "pp", "data": "dp"}.get(axis, axis), value)


def parse(answer: str | dict) -> Answer:
    """Read an answer in words or sizes (or a dict of ``tp``, ``pp``, ``dp``, ``zero``): the module docstring's
    rules. An :class:`UnreadableAnswer` (a ValueError) says what could not be read."""
    if isinstance(answer, dict):
        return _from_dict(answer)
    if not isinstance(answer, str):
        raise UnreadableAnswer(f"an answer is text or a dict of sizes, not {type(answer).__name__}")
    text = answer.lower().replace("\u00d7", "x").replace("\u2013", "-").replace("\u2014", "-")
    return _interpret(_scan(text))


def _from_dict(answer: dict) -> Answer:
    unknown = set(answer) - {"tp", "pp", "dp", "zero"}
    if unknown:
        raise UnreadableAnswer(f"unknown keys {sorted(map(str, unknown))}: give tp, pp, dp and zero")
    read = _Reading()
    for axis in ("tp", "pp", "dp"):
        if answer.get(axis) is not None:
            read.size(axis, str(answer[axis]))
    if answer.get("zero") is not None:
        zero = str(answer["zero"])
        if zero not in ("0", "1", "2", "3"):
            raise UnreadableAnswer(f"zero is a ZeRO stage, 0 to 3, not {zero}")
        read.add("zero", int(zero), False)
    return _interpret(read)


def _axis(read: _Reading, axis: str, on_words: tuple[str, ...]) -> int | None:
    """The size of TP or PP: given, 1 if negated, None if named without a size (or not named: then 1)."""
    size, words = read.sizes.get(axis), [k for k in on_words if k in read.named]
    off = axis in read.negated or "mp" in read.negated
    if off and ((size or 1) > 1 or words):
        raise UnreadableAnswer(f"it asks for {axis.upper()} and for no {axis.upper()}")
    if size is not None or off:
        return size or 1
    return None if words else 1


def _interpret(read: _Reading) -> Answer:
    """The :class:`Answer` the scan's schemes and sizes make (module docstring)."""
    unsupported = [k for k in ("cp", "ep", "2d") if k in read.named]
    if unsupported:
        raise UnreadableAnswer(
            "it names 2D (say which two: TP + DP, PP + DP or TP + PP)"
            if unsupported == ["2d"]
            else "this exercise is about TP, PP, DP and ZeRO/FSDP; context and expert parallelism are not part of it"
        )
    tp = _axis(read, "tp", ("tp", "tp_across", "3d"))
    pp = _axis(read, "pp", ("pp", "3d"))
    stages, notes = _stages(read), list(read.notes)
    dp = read.sizes.get("dp", 1 if "dp" in read.negated and not stages - {0} and (tp != 1 or pp != 1) else None)
    if tp != 1 and pp != 1:
        family = "3d"
    elif tp != 1 or pp != 1:
        family = "tp" if tp != 1 else "pp"
    elif stages - {0}:
        family = "sharded"
    elif "dp" in read.named or read.sizes or stages:
        family = "dp"
    elif read.negated:
        raise UnreadableAnswer("it only says what not to use; say what to use too")
    else:
        raise UnreadableAnswer(
            "'model parallelism' does not say which: TP or PP" if read.named else "it names no scheme"
        )
    if family in ("tp", "pp", "3d") and 3 in stages:
        notes.append("ZeRO-3 is left out: the planner does not combine it with TP or PP.")
        stages -= {3}
    return Answer(
        family,
        tp if family in ("tp", "3d") else 1,
        pp if family in ("pp", "3d") else 1,
        dp,
        stages or None,
        hsdp=family == "sharded" and "hsdp" in read.named,
        named_3d="3d" in read.named and "tp" not in read.sizes and "pp" not in read.sizes,
        tp_across="tp_across" in read.named,
        notes=tuple(notes),
    )


def _stages(read: _Reading) -> frozenset[int]:
    """The ZeRO stages the answer allows: those named (or 1-3 for a sharding without a stage), less those negated;
    {0} (plain DP) if it only negates sharding; empty if it says nothing of sharding."""
    named = set().union(*(v for k, v in read.named.items() if GROUP[k] == "shard"))
    negated = set().union(*(v for k, v in read.negated.items() if GROUP[k] == "shard"))
    given = {s for s in named if s is not None} or ({1, 2, 3} if named else set())
    excluded = {1, 2, 3} if None in negated else {s for s in negated if s is not None}
    if named and not given - excluded:
        raise UnreadableAnswer("it asks for sharding and for no sharding")
    return frozenset(given - excluded) if named else frozenset({0} if negated else ())


def describe_answer(ans: Answer) -> str:
    """How the grader read the answer, in a sentence."""
    if ans.family == "dp":
        text = FAMILY_NAMES["dp"]
    elif ans.family == "sharded":
        text = "HSDP: FSDP (ZeRO-3) inside each node, replicas across nodes" if ans.hsdp else _sharding(ans.stages)
    else:
        sizes = [f"TP {ans.tp or 'any'}", f"PP {ans.pp or 'any'}", f"DP {ans.dp or 'the rest'}"]
        zero = f", ZeRO stage {' or '.join(map(str, sorted(ans.stages)))}" if ans.stages else ""
        across = "; TP across nodes" if ans.tp_across else "; PP across nodes" if ans.named_3d else ""
        text = f"{FAMILY_NAMES[ans.family]}: {' x '.join(sizes)}{zero}{across}"
    return " ".join([f"Read as {text}."] + list(ans.notes))


def _sharding(stages: frozenset[int]) -> str:
    if len(stages) > 1:
        return f"{FAMILY_NAMES['sharded']}, stage {' or '.join(map(str, sorted(stages)))} (graded at the fastest)"
    stage = next(iter(stages))
    fsdp = " (FSDP)" if stage == 3 else ""
    return f"data parallelism with ZeRO-{stage} sharding{fsdp}: {SHARDING[stage]} split over the GPUs"


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
    args = (p.gpus, p.network, p.gpu_mem_bytes, p.global_batch, p.micro_batch, p.precision, recompute)
    return tuple(evaluate(p.model, shape, *args) for shape in shapes)


@cache
def _hsdp(exercise: str, scenario_id: str, recompute: str) -> Candidate:
    """HSDP's memory per GPU: ZeRO-3 over one node's GPUs with the same microbatches per rank (its step is not
    timed: the planner has no cost for the replicas' all-reduce)."""
    p = _scenario(exercise, scenario_id).choice
    m, node = p.global_batch // (p.gpus * p.micro_batch), p.gpus_per_node
    args = (node, p.network, p.gpu_mem_bytes, node * m * p.micro_batch, p.micro_batch, p.precision, recompute)
    return evaluate(p.model, Layout(1, 1, node, 3, m), *args)


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
    for recompute in RECOMPUTE:
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
