"""The estimates exercise: one number for each scenario of the lessons on experts, long context and failures (07,
08), graded with the course's own modules.

A student answers with a number, as text or as a number; :func:`read` takes it ("8", "about 25 min", "1.2e9",
"1,024", "462 MB", "4.6 x 10^8 bytes", "TP 8 x CP 16"), :func:`grade` computes the right value and answers right,
close or wrong with the formula and the numbers that decide. It never raises on an answer: one it cannot read is
"unreadable", with what it can read. The prompts live in ``exercises/estimates.json``, the model answers apart in
``exercises/answers/estimates.json``.

The scenarios, by the kind of number they ask for:

* ``nodes``: the nodes one expert-parallel group spans, DeepSeek-V3's EP 64 on 2,048 GPUs of 8 per node (DeepSeek-AI
  2024, §3.2: "64-way Expert Parallelism (EP) spanning 8 nodes"), each pipeline stage on whole nodes and an EP
  group ``ep`` consecutive ranks of its stage (:func:`course_lib.planner.layouts.groups`). A count, right only if exact;
  the usual slips (the group's GPUs, a stage's nodes) are named.
* ``bytes``: what one rank sends in one dispatch all-to-all for a microbatch: tokens x top-k x hidden x 1 byte
  (FP8, as DeepSeek-V3 dispatches; it combines in BF16, §3.3) x (ep-1)/ep, the copies that leave the rank under
  uniform routing
  (:func:`course_lib.planner.cost.dispatch_bytes`,
  :func:`course_lib.ledgers.comm.ring_factor`). Right within 1%, because leaving out the (ep-1)/ep moves it by 1.6%;
  close within 10% (MiB read as MB, 4,000 tokens for 4,096); factors of 2 to 8 (bf16, dispatch and combine
  together, fp32, no top-k, bits) are named.
* ``cp``: the smallest context-parallel degree that fits Llama 3 405B's 131,072-token sequences at TP 8 x PP 16 in
  a GPU's memory (Grattafiori et al. 2024, §3.3.2 and Table 4, where it is 16), among the degrees the planner
  considers (:func:`course_lib.planner.layouts.cp_degrees`), by the memory model
  (:func:`course_lib.model.formulas.memory_formula`). Right: that degree; close: the next one up, twice it, which
  fits but splits more than needed; wrong: a degree that does not fit, is not one (it must divide CP x DP), or is
  larger still.
* ``minutes``: a checkpoint interval for Llama 3 405B on 16,384 GPUs with Llama 3's failure rate (§3.3.4,
  :data:`course_lib.planner.goodput.LLAMA3`): Daly's optimum as :func:`course_lib.planner.goodput.choose_interval`
  computes it (Young 1974; Daly 2006). Right within ``right_within`` of it (25%), close within a factor ``close_factor``
  (2), because goodput is flat near the optimum (its slope is zero there): a quarter off costs under half a percentage
  point of goodput, a factor of 2 under 3 points; Young's first-order interval (5% longer here) is right too. The
  feedback shows the goodput at the student's interval beside the optimum's, and names the usual slips (seconds
  or hours for minutes, one GPU's MTBF for the job's, the per-GPU write speed past the storage's shared cap, and,
  with ``deduplicate``, each GPU's whole replica for its share of the deduplicated checkpoint, as lesson 08 §2
  describes DCP's writes).
"""

from __future__ import annotations

import math
import numbers
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from course_lib.ledgers.comm import ring_factor
from course_lib.model.config import Layout
from course_lib.model.formulas import memory_formula
from course_lib.planner.cost import dispatch_bytes
from course_lib.planner.goodput import LLAMA3, IntervalChoice, choose_interval, expected_goodput
from course_lib.planner.layouts import MIN_CP_TOKENS, cp_degrees, groups
from course_lib.planner.presets import make_model
from course_lib.practice import exercises

NAME = "estimates"
VERDICTS = ("right", "close", "wrong", "unreadable")
BYTES_RIGHT, BYTES_CLOSE = 0.01, 0.10  # relative tolerances of the bytes scenario (module docstring)
WIDTH = 116  # characters a line of feedback


def load() -> dict:
    """The exercise's prompts (``exercises/estimates.json``)."""
    return exercises.load(NAME)


def model_answers() -> dict:
    """The model answers (``exercises/answers/estimates.json``): read them after answering."""
    return exercises.model_answers(NAME)


@dataclass
class Feedback:
    """The verdict ("right", "close", "wrong" or "unreadable"), its sentence, the reasons with their numbers, the
    answer as read and the right value (None where there is none), and the model answer."""

    verdict: str
    headline: str
    reasons: list[str] = field(default_factory=list)
    answer: float | None = None
    expected: float | None = None
    model_answer: str = ""

    @property
    def correct(self) -> bool:
        return self.verdict == "right"

    def __str__(self) -> str:
        lines = [_fill(self.headline, subsequent_indent="  ")]
        lines += [_fill(r, initial_indent="  - ", subsequent_indent="    ") for r in self.reasons]
        if self.model_answer:
            lines.append(_fill(f"Model answer: {self.model_answer}", subsequent_indent="  "))
        return "\n".join(lines)


def _fill(text: str, **indents: str) -> str:
    """``text`` wrapped to ``WIDTH``, never inside a hyphenated word (all-to-all)."""
    return textwrap.fill(text, WIDTH, break_on_hyphens=False, **indents)


# ------------------------------------------------------------------------------------------------ reading
class Unreadable(ValueError):
    """An answer :func:`read` cannot take; its message says why."""


@dataclass(frozen=True)
class Reading:
    """A number read from an answer, in the scenario's unit, and how it was read."""

    value: float
    note: str


@dataclass(frozen=True)
class _Kind:
    """What a kind of scenario reads: its unit, the other units it converts (factor to the unit), and a pattern
    whose one group is the number it asks for among several."""

    unit: str
    units: dict[str, float]
    label: str | None = None


_B = {"b": 1, "byte": 1, "bytes": 1, "bit": 1 / 8, "bits": 1 / 8}
_B |= dict.fromkeys(("k", "kb", "kilobyte", "kilobytes", "thousand"), 1e3)
_B |= dict.fromkeys(("m", "mb", "megabyte", "megabytes", "million", "mio"), 1e6)
_B |= dict.fromkeys(("g", "gb", "gigabyte", "gigabytes", "billion", "bn"), 1e9)
_B |= dict.fromkeys(("t", "tb", "terabyte", "terabytes", "trillion"), 1e12)
_B |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MIN = dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1 / 60)
_MIN |= dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 1.0)
_MIN |= dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 60.0)
_MIN |= dict.fromkeys(("d", "day", "days"), 24 * 60.0)
KINDS = {
    "nodes": _Kind("nodes", {}, r"(\d+)\s*nodes?\b"),
    "cp": _Kind("CP", {}, r"\b(?:cp|context[\s_-]*parallel\w*)(?:[\s_-]*(?:degree|size))?\s*(?:=|:|of|is)?\s*(\d+)"),
    "bytes": _Kind("bytes", _B),
    "minutes": _Kind("minutes", _MIN),
}
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-\s*)?(?P<mantissa>\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s*e\s*(?P<exp>[-+]?\d+)|\s*[x*\u00d7\u00b7]\s*10\s*(?:\^|\*\*)\s*(?P<exp10>[-+]?\d+)"
    r"|\s*(?:\^|\*\*)\s*(?P<power>[-+]?\d+))?(?:\s*(?P<unit>[a-z]+))?",
    re.IGNORECASE,
)
_RESULT = re.compile(r"=|\u2248|=>|->|\u2192")  # what follows the last of these is the result
EXAMPLES = "one number, with a unit if you like: '8', '4.6e8 bytes', '462 MB', 'about 25 min', 'CP 16'"


def read(answer: object, kind: str) -> Reading:
    """The number an answer gives, in the unit of ``kind`` (a key of :data:`KINDS`): a number as it is; in text,
    the number a label names ("CP 16", "8 nodes"), else the one after the last "=" (a worked formula), else the
    only one, with its unit converted ("1,100 s", "0.46 GB", "2^30"; none: the kind's unit). An
    :class:`Unreadable` (a ValueError) says why it cannot."""
    k = KINDS[kind]
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        try:
            value = float(answer)
        except (OverflowError, ValueError):
            raise Unreadable("it is too large to be a number of this kind") from None
        return Reading(_finite(value), f"Read as {_shown(value, k)}.")
    if not isinstance(answer, str):
        raise Unreadable(f"an answer is a number or text, not {type(answer).__name__}")
    text = answer.replace("\u2212", "-").replace("\u2013", "-")
    labelled = re.findall(k.label, text, re.IGNORECASE) if k.label else []
    if len(set(labelled)) == 1:
        value = _finite(float(labelled[0]))
        return Reading(value, f"Read as {_shown(value, k)}.")
    parts = _RESULT.split(text)
    found = list(_NUMBER.finditer(parts[-1])) or list(_NUMBER.finditer(text))
    if not found:
        raise Unreadable("there is no number in it")
    if len(found) > 1:
        shown = ", ".join(m.group("mantissa") for m in found[:4])
        raise Unreadable(f"it has {len(found)} numbers ({shown}); give one (for a range, its middle)")
    value, unit = _value(found[0], k)
    return Reading(value, f"Read as {_shown(value, k)}{unit}.")


def _value(m: re.Match, k: _Kind) -> tuple[float, str]:
    """The number a match gives in the kind's unit, and a note on the unit it converted."""
    try:
        x = float(m.group("mantissa").replace(",", ""))
        if m.group("exp") or m.group("exp10"):
            x *= 10.0 ** int(m.group("exp") or m.group("exp10"))
        if m.group("power"):
            x **= int(m.group("power"))
    except (OverflowError, ValueError, ZeroDivisionError):
        raise Unreadable("the number is too large or too small to read") from None
    x = _finite(-x if m.group("sign") else x)
    unit = m.group("unit") or ""
    factor = k.units.get(unit.lower(), 1.0)
    note = f" (from {_number(x)} {unit})" if factor != 1.0 else ""
    return _finite(x * factor), note


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise Unreadable(f"{value} is not a finite number")
    return value


def _number(x: float) -> str:
    """A number as a person writes it: from 1,000 on whole, with thousands separators (up to 1e15), else to 4
    significant digits."""
    return f"{x:,.0f}" if abs(x) < 1e15 and (abs(x) >= 1e3 or x == round(x)) else f"{x:.4g}"


def _shown(value: float, k: _Kind) -> str:
    return f"CP {_number(value)}" if k.unit == "CP" else f"{_number(value)} {k.unit}"


# ------------------------------------------------------------------------------------------------ grading
@dataclass(frozen=True)
class _Judged:
    verdict: str
    headline: str
    reasons: list[str]


def grade(scenario_id: str, answer: object) -> Feedback:
    """Grade one answer against the value the course's modules compute (module docstring); the feedback states
    the formula and the numbers that decide. Never raises on an answer; an unknown scenario is a ValueError."""
    spec = _scenarios().get(scenario_id)
    if spec is None:
        raise ValueError(f"no scenario {scenario_id!r}; the scenarios are {sorted(_scenarios())}")
    key = model_answers()["scenarios"].get(scenario_id, {}).get("text", "")
    expected, working, judge = _SOLVERS[spec["kind"]](scenario_id)
    try:
        reading = read(answer, spec["kind"])
    except Unreadable as e:
        shown = repr(answer) if len(repr(answer)) <= 60 else repr(answer)[:57] + "..."
        return Feedback("unreadable", f"Could not read {shown}: {e}. Write {EXAMPLES}.", [], None, expected, key)
    judged = judge(reading.value)
    reasons = [reading.note] + judged.reasons + working
    return Feedback(judged.verdict, judged.headline, reasons, reading.value, expected, key)


@cache
def _scenarios() -> dict[str, dict]:
    return {s["id"]: s for s in load()["scenarios"]}


def _whole(value: float, what: str) -> _Judged | None:
    """A refusal for a count that is not a whole number of at least 1."""
    if value >= 1 and value == round(value):
        return None
    return _Judged("wrong", f"Wrong: {what} is a whole number of at least 1, not {_number(value)}.", [])


def _slips(value: float, slips: list[tuple[float, str]], tolerance: float) -> list[str]:
    """The known slips ``value`` matches within ``tolerance`` (relative), each (the value it gives, why)."""
    return [f"{why} ({_number(v)})." for v, why in slips if v > 0 and abs(value / v - 1) <= tolerance]


Solved = tuple[float, list[str], Callable[[float], _Judged]]  # the right value, its working, the judge


# ------------------------------------------------------------------------------------------------ EP nodes
@cache
def _solve_nodes(scenario_id: str) -> Solved:
    s = _scenarios()[scenario_id]
    per_node, stage = s["gpus_per_node"], s["gpus"] // s["pp"]
    # A stage's ranks placed on whole nodes, in the course's order; its EP groups as planner.layouts.groups makes them.
    ep_groups = groups(1, 1, stage, 1, s["ep"])["ep"]
    nodes = max(len({r // per_node for r in g}) for g in ep_groups)
    working = [
        f"A pipeline stage is {s['gpus']:,} / PP {s['pp']} = {stage} GPUs, {stage // per_node} whole nodes of "
        f"{per_node}; an EP group is {s['ep']} consecutive GPUs of it: {s['ep']} / {per_node} = {nodes} nodes "
        f"(DeepSeek-V3 §3.2: 'spanning 8 nodes'). Its all-to-alls cross the network, so DeepSeek sends each token "
        f"to at most 4 of those nodes (§3.2.2).",
    ]
    slips = [
        (s["ep"], "That is the GPUs in an EP group, not its nodes"),
        (stage // per_node, f"That is a whole stage's nodes ({stage} GPUs), which holds {stage // s['ep']} EP groups"),
        (s["gpus"] // per_node, "That is every node of the run"),
        (1, f"An EP group of {s['ep']} GPUs cannot fit one node of {per_node}"),
    ]

    def judge(value: float) -> _Judged:
        refusal = _whole(value, "a number of nodes")
        if refusal:
            return refusal
        if value == nodes:
            return _Judged("right", "Right.", [])
        return _Judged("wrong", f"Wrong: one EP group spans {nodes} nodes.", _slips(value, slips, 0.0))

    return nodes, working, judge


# ------------------------------------------------------------------------------------------------ EP bytes
@cache
def _solve_bytes(scenario_id: str) -> Solved:
    s = _scenarios()[scenario_id]
    model = make_model(preset=s["preset"])
    layout = Layout(tp=s["tp"], pp=1, dp=s["ep"], zero=0, microbatches=1, cp=s["cp"], ep=s["ep"])  # TP, CP count
    handed = dispatch_bytes(model, layout, s["micro_batch"], s["value_bytes"])
    leave = ring_factor("all_to_all", s["ep"])
    sent = handed * leave
    tokens, k, h = s["micro_batch"] * model.seq // (s["tp"] * s["cp"]), model.experts.top_k, model.hidden
    working = [
        f"A rank's {tokens:,} tokens x top-{k} x {h:,} values x {s['value_bytes']} byte (FP8) = {handed:,.0f} bytes "
        "handed to the "
        f"all-to-all; under uniform routing ({s['ep']}-1)/{s['ep']} of the copies go to other ranks: "
        f"{handed:,.0f} x {s['ep'] - 1}/{s['ep']} = {sent:,.0f} bytes ({sent / 1e6:.0f} MB) sent.",
    ]
    slips = [
        (handed, f"That is all {k} copies of each token; {1 - leave:.2%} of them go to the rank's own experts"),
        (sent * 1e6 / 2**20, "That is the answer in MiB (2^20 bytes) written as MB"),
        (2 * sent, "That is twice it: 2 bytes a value (bf16), as the combine returns; DeepSeek-V3 dispatches in FP8"),
        (3 * sent, "That is dispatch and combine together: 1 byte a value out (FP8), 2 back (BF16)"),
        (4 * sent, "That is 4 bytes a value (fp32)"),
        (sent / k, f"That is one copy a token; each token goes to its top-{k} experts"),
        (sent * (k + 1) / k, "That counts the shared expert, which runs where the token is and is not sent"),
        (8 * sent, "That is bits, not bytes"),
    ]

    def judge(value: float) -> _Judged:
        off = value / sent - 1
        where = f"{_number(value)} bytes is {abs(off):.1%} {'above' if off > 0 else 'below'} {sent:,.0f}"
        hints = _slips(value, slips, BYTES_RIGHT)
        if abs(off) <= BYTES_RIGHT:
            return _Judged("right", "Right.", [f"{where}: within {BYTES_RIGHT:.0%}."])
        if abs(off) <= BYTES_CLOSE:
            headline = f"Close: {where}: within {BYTES_CLOSE:.0%}, but not the {BYTES_RIGHT:.0%} that counts as right."
            return _Judged("close", headline, hints)
        return _Judged("wrong", f"Wrong: {where}, more than the {BYTES_CLOSE:.0%} that counts as close.", hints)

    return sent, working, judge


# ------------------------------------------------------------------------------------------------ CP degree
@cache
def _memory(scenario_id: str, cp: int) -> float:
    """Bytes on the busiest GPU of the scenario's layout at context-parallel degree ``cp``
    (:func:`course_lib.model.formulas.memory_formula`, as the planner evaluates a layout)."""
    s = _scenarios()[scenario_id]
    model = make_model(preset=s["preset"])
    dp = s["gpus"] // (s["tp"] * s["pp"] * cp)
    layout = Layout(
        tp=s["tp"], pp=s["pp"], dp=dp, zero=s["zero"], cp=cp, sp=s["tp"] > 1, recompute=s["recompute"],
        micro_batch=s["micro_batch"],
    )  # fmt: skip
    return memory_formula(model.params, s["precision"], layout, **model.memory_shape())["total"]


@cache
def _solve_cp(scenario_id: str) -> Solved:
    s = _scenarios()[scenario_id]
    model = make_model(preset=s["preset"])
    ranks, limit = s["gpus"] // (s["tp"] * s["pp"]), s["gpu_memory_gb"]
    memory = {cp: _memory(scenario_id, cp) / 1e9 for cp in range(1, ranks + 1) if ranks % cp == 0}
    degrees = cp_degrees(model, ranks)
    smallest = min(cp for cp in degrees if memory[cp] <= limit)
    below = max((cp for cp in degrees if cp < smallest), default=None)
    table = ", ".join(f"CP {cp}: {memory[cp]:.1f} GB" for cp in degrees)
    working = [
        f"CP x DP = {s['gpus']:,} / (TP {s['tp']} x PP {s['pp']}) = {ranks}; the memory model's busiest GPU (ZeRO-"
        f"{s['zero']} over DP x CP, activations split by CP): {table}.",
        f"The smallest that fits {limit} GB is CP {smallest}"
        + (f"; CP {below} needs {memory[below]:.1f} GB." if below else ".")
        + f" Llama 3 used CP {model.published['cp']} (Table 4).",
    ]

    def judge(value: float) -> _Judged:
        refusal = _whole(value, "a CP degree")
        if refusal:
            return refusal
        cp = int(value)
        if cp not in memory:
            return _Judged("wrong", f"Wrong: CP must divide CP x DP = {ranks}, and {cp} does not.", [])
        if memory[cp] > limit:
            return _Judged("wrong", f"Wrong: CP {cp} needs {memory[cp]:.1f} GB per GPU, more than {limit} GB.", [])
        if cp == smallest:
            return _Judged("right", "Right.", [f"CP {cp} needs {memory[cp]:.1f} GB per GPU, within {limit} GB."])
        short = [] if cp in degrees else [f"CP {cp} leaves {model.seq // cp:,} tokens a rank, fewer than the "
                                          f"planner's minimum of {MIN_CP_TOKENS:,}."]  # fmt: skip
        verdict = "close" if cp == 2 * smallest else "wrong"
        return _Judged(
            verdict,
            f"{verdict.capitalize()}: CP {cp} fits ({memory[cp]:.1f} GB per GPU), but it is {cp // smallest}x the "
            f"smallest that does, CP {smallest} ({memory[smallest]:.1f} GB): more ranks pass K and V round the ring "
            "than needed.",
            short,
        )

    return smallest, working, judge


# ------------------------------------------------------------------------------------------------ interval
def _written(deduplicate: bool) -> str:
    """How each GPU's share of the checkpoint is counted, in words."""
    return "every tensor once, spread over the GPUs" if deduplicate else "its whole replica"


@cache
def _interval(scenario_id: str) -> IntervalChoice:
    """:func:`course_lib.planner.goodput.choose_interval` for the scenario, as ``python -m course_lib goodput``
    runs it."""
    return _interval_of(scenario_id, _scenarios()[scenario_id]["deduplicate"])


@cache
def _interval_of(scenario_id: str, deduplicate: bool) -> IntervalChoice:
    """The scenario's interval with each GPU writing its share of a deduplicated checkpoint, or its whole replica."""
    s = _scenarios()[scenario_id]
    return choose_interval(
        s["preset"], s["gpus"], mtbf_gpu_s=LLAMA3.mtbf_gpu_hours() * 3600, write_bandwidth=s["write_gbps"] * 1e9,
        restart_s=s["restart_min"] * 60, storage_bandwidth=s["storage_tbps"] * 1e12, deduplicate=deduplicate,
    )  # fmt: skip


@cache
def _solve_minutes(scenario_id: str) -> Solved:
    s = _scenarios()[scenario_id]
    c = _interval(scenario_id)
    best, right, close = c.daly_s / 60, s["right_within"], s["close_factor"]
    per_gpu = min(s["write_gbps"] * 1e9, s["storage_tbps"] * 1e12 / s["gpus"])

    def goodput(minutes: float) -> float:
        seconds = min(minutes * 60, sys.float_info.max)  # an absurd answer's goodput is 0, not an overflow
        return expected_goodput(seconds, c.checkpoint_s, s["restart_min"] * 60, c.mtbf_job_s)

    def points(*factors: float) -> float:
        """The most goodput lost, in percentage points, at these multiples of the optimum."""
        return 100 * (c.goodput - min(goodput(best * f) for f in factors))

    replica = _interval_of(scenario_id, not s["deduplicate"])  # the other way of writing, for the slip
    working = [
        f"A checkpoint: {c.checkpoint_bytes / 1e9:.2f} GB a GPU ({_written(s['deduplicate'])}) at "
        f"min({s['write_gbps']} GB/s, {s['storage_tbps']} TB/s / {s['gpus']:,}) = {per_gpu / 1e6:.1f} MB/s takes "
        f"delta = {c.checkpoint_s:.1f} s. The job's MTBF: "
        f"M = {LLAMA3.days} days x 24 h / {LLAMA3.unexpected} = {c.mtbf_job_s / 3600:.2f} h.",
        f"Young: sqrt(2 delta M) = {c.young_s / 60:.1f} min; Daly (the course's optimum): {best:.1f} min, expected "
        f"goodput {c.goodput:.1%}.",
        f"Right within {right:.0%} ({best * (1 - right):.1f} to {best * (1 + right):.1f} min), because goodput is "
        f"flat at its optimum: there it loses at most {points(1 - right, 1 + right):.2f} points; close within a "
        f"factor of {close:g} ({best / close:.1f} to {best * close:.1f} min), at most {points(1 / close, close):.1f}.",
    ]
    slow_write = c.checkpoint_s * per_gpu / (s["write_gbps"] * 1e9)  # delta at the per-GPU bandwidth alone
    slips = [
        (best * 60, "That is the optimum in seconds; write it with 's', or in minutes"),
        (best / 60, "That is the optimum in hours; write it with 'h', or in minutes"),
        (c.young_s / 60 / math.sqrt(2), "That is sqrt(delta M), without Young's factor 2"),
        (c.young_s / 60 * math.sqrt(s["gpus"]), f"That uses one GPU's MTBF, {s['gpus']:,} times the job's"),
        (
            math.sqrt(2 * slow_write * c.mtbf_job_s) / 60,
            f"That writes at {s['write_gbps']} GB/s per GPU, but the storage's shared {s['storage_tbps']} TB/s "
            f"allows {per_gpu / 1e6:.1f} MB/s each",
        ),
        (
            replica.daly_s / 60,
            f"That writes {replica.checkpoint_bytes / 1e9:.2f} GB a GPU ({_written(not s['deduplicate'])}), but "
            f"the checkpoint is {c.checkpoint_bytes / 1e9:.2f} GB a GPU ({_written(s['deduplicate'])})",
        ),
    ]

    def judge(minutes: float) -> _Judged:
        if minutes <= 0:
            return _Judged("wrong", f"Wrong: an interval is a positive time, not {_number(minutes)} min.", [])
        ratio, g, shown = minutes / best, goodput(minutes), _number(minutes)
        lost = [
            f"At {shown} min ({ratio:.2f}x the optimum) the expected goodput is {g:.1%}, against {c.goodput:.1%} at "
            f"{best:.1f} min: {100 * (c.goodput - g):.2f} points lost."
        ]
        if abs(ratio - 1) <= right:
            return _Judged("right", f"Right: within {right:.0%} of {best:.1f} min.", lost)
        if 1 / close <= ratio <= close:
            headline = f"Close: {shown} min is within a factor of {close:g} of the optimum, {best:.1f} min."
            return _Judged("close", headline, lost + _slips(minutes, slips, right / 2))
        headline = f"Wrong: {shown} min is more than a factor of {close:g} from the optimum, {best:.1f} min."
        return _Judged("wrong", headline, lost + _slips(minutes, slips, right / 2))

    return best, working, judge


_SOLVERS: dict[str, Callable[[str], Solved]] = {
    "nodes": _solve_nodes,
    "bytes": _solve_bytes,
    "cp": _solve_cp,
    "minutes": _solve_minutes,
}
