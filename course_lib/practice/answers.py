"""Reading a student's answer to the pick-the-parallelism exercise (:mod:`course_lib.practice.exercises`): :func:`parse`
turns words or sizes into an :class:`Answer`, :func:`describe_answer` says how it was read.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SHARDING = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer state"}
FAMILY_NAMES = {
    "dp": "plain data parallelism (DDP: a whole copy of the model on every GPU)",
    "sharded": "data parallelism with ZeRO sharding",
    "tp": "tensor parallelism (TP inside a node, DP over the rest)",
    "pp": "pipeline parallelism (PP, DP over the rest, no TP)",
    "3d": "TP with PP (DP over the rest)",
}
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
