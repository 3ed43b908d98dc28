"""Per-rank timeline: what each rank computed, communicated and waited for, on the wall clock.

Every rank keeps one list of :class:`Event` (forward, backward, weight-grad, optimizer, comm, idle). Spans are opened
with :func:`span`; tags (step, phase, layer, microbatch) set with :func:`tags` are attached to every event and comm
record opened inside. Times are seconds since the run's epoch, which the launcher shares between the ranks so that
their timelines line up. :func:`to_chrome_trace` writes all ranks to a Chrome-trace JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open.

Beside the events each rank keeps its *program*: in the order it ran, the compute between two communication
points (:class:`Compute`, with its FLOPs when :class:`FlopCounter` is on), each collective it issued
(:class:`Issue`) and each one it waited for (:class:`Wait`). :mod:`course_lib.hardware` replays programs on a
modeled cluster.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from course_lib.ledgers.records import KINDS, Compute, Event, Issue, Wait


class _Timeline:
    def __init__(self) -> None:
        self.rank = 0
        self.epoch = time.perf_counter()
        self.events: list[Event] = []
        self.tags: dict = {}
        self.program: list[Compute | Issue | Wait] = []
        self.kinds: list[str] = []  # the open spans' kinds, innermost last
        self.segment = Compute("compute", 0.0, 0.0)
        self.flops_total = 0  # everything FlopCounter has counted on this rank


_TIMELINE = _Timeline()


def reset(rank: int = 0, epoch: float | None = None) -> None:
    """Start an empty timeline for ``rank``; ``epoch`` is the perf_counter() value that is time zero."""
    _TIMELINE.rank = rank
    _TIMELINE.epoch = time.perf_counter() if epoch is None else epoch
    _TIMELINE.events = []
    _TIMELINE.tags = {}
    _TIMELINE.program = []
    _TIMELINE.kinds = []
    _TIMELINE.segment = Compute("compute", now(), now())
    _TIMELINE.flops_total = 0


def _next_segment() -> None:
    """Close the compute segment in progress (if it did anything) and open the next one."""
    seg, t = _TIMELINE.segment, now()
    if seg.flops or seg.elementwise:
        seg.end = t
        _TIMELINE.program.append(seg)
    _TIMELINE.segment = Compute(_TIMELINE.kinds[-1] if _TIMELINE.kinds else "compute", t, t, tags=dict(_TIMELINE.tags))


def issued(record: int) -> None:
    """Program order: comm record ``record`` was issued here (called by :mod:`course_lib.ledgers.comm`)."""
    _next_segment()
    _TIMELINE.program.append(Issue(record))


def waiting(record: int) -> None:
    """Program order: the rank blocks here until comm record ``record`` is done."""
    _next_segment()
    _TIMELINE.program.append(Wait(record))


def program() -> list[Compute | Issue | Wait]:
    """This rank's program so far (see the module docstring)."""
    _next_segment()
    return list(_TIMELINE.program)


class FlopCounter(TorchDispatchMode):
    """Counts the FLOPs of every operator into the compute segment in progress (``with FlopCounter(): ...``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seg, before = _TIMELINE.segment, _TIMELINE.segment.flops + _TIMELINE.segment.elementwise
        if func._overloadpacket in flop_registry:
            seg.flops += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        elif not func.is_view:
            seg.elementwise += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        _TIMELINE.flops_total += seg.flops + seg.elementwise - before
        return out


def now() -> float:
    """Seconds since this run's epoch."""
    return time.perf_counter() - _TIMELINE.epoch


def current_tags() -> dict:
    return dict(_TIMELINE.tags)


def events() -> list[Event]:
    """This rank's events so far, in the order they ended."""
    return list(_TIMELINE.events)


def record(kind: str, name: str, start: float, end: float, tags_at_start: dict | None = None, **extra_tags) -> Event:
    """Append a finished event with the tags in force now, or ``tags_at_start`` for work that began under other
    tags (an async collective waited on later), plus ``extra_tags``."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; use one of {KINDS}")
    base = _TIMELINE.tags if tags_at_start is None else tags_at_start
    event = Event(_TIMELINE.rank, kind, name, start, end, {**base, **extra_tags})
    _TIMELINE.events.append(event)
    return event


@contextlib.contextmanager
def tags(**new_tags) -> Iterator[None]:
    """Attach tags (e.g. ``step=3, phase="backward"``) to every event and comm record opened inside."""
    saved = _TIMELINE.tags
    _TIMELINE.tags = {**saved, **new_tags}
    _next_segment()  # the segment in progress keeps the tags it started with; the next one gets the new ones
    try:
        yield
    finally:
        _TIMELINE.tags = saved
        _next_segment()


@contextlib.contextmanager
def span(kind: str, name: str = "", **span_tags) -> Iterator[None]:
    """Time the body as one event of ``kind``; the tags also apply to everything recorded inside. With a
    :class:`FlopCounter` running, the event's tags carry the FLOPs counted inside (``flops``)."""
    start, flops_before = now(), _TIMELINE.flops_total
    _TIMELINE.kinds.append(kind)
    try:
        with tags(**span_tags):
            yield
    finally:  # recorded however the body ends (a recomputation is stopped by an exception once it has enough)
        _TIMELINE.kinds.pop()
        _next_segment()
        counted = _TIMELINE.flops_total - flops_before
        record(kind, name or kind, start, now(), **span_tags, **({"flops": counted} if counted else {}))


def with_idle(rank_events: Sequence[Event]) -> list[Event]:
    """The events plus an ``idle`` event for every gap on the rank's timeline (nested spans are not gaps)."""
    ordered = sorted(rank_events, key=lambda e: e.start)
    out: list[Event] = []
    busy_until = None
    for event in ordered:
        if busy_until is not None and event.start > busy_until:
            out.append(Event(event.rank, "idle", "idle", busy_until, event.start))
        out.append(event)
        busy_until = event.end if busy_until is None else max(busy_until, event.end)
    return out


WORK = ("forward", "backward", "weight_grad", "recompute")  # a pipeline stage's own passes


def bubble_fraction(events_per_rank: Sequence[Sequence[Event]], step: int) -> float:
    """The measured bubble of ``step``: the share of the ranks' time, from the first rank's first pass to the last
    rank's last (the makespan), that no forward, backward, weight-gradient or recomputation pass covers. On this
    machine's clock, so a transfer counts as idle, as it does for a stage waiting on it (Huang et al. 2019, §2.2:
    the bubble is each stage's idle time)."""
    work = [[e for e in events if e.kind in WORK and e.tags.get("step") == step] for events in events_per_rank]
    passes = [e for events in work for e in events]
    if not passes:
        raise ValueError(f"no forward or backward pass was recorded in step {step}")
    makespan = max(e.end for e in passes) - min(e.start for e in passes)
    idle = sum(e.duration for events in work for e in with_idle(events) if e.kind == "idle")
    busy = sum(max(e.end for e in events) - min(e.start for e in events) for events in work if events) - idle
    return 1 - busy / (makespan * len(events_per_rank))


def to_chrome_trace(events_per_rank: Sequence[Sequence[Event]], path: str | Path | None = None) -> dict:
    """All ranks' events as a Chrome-trace dict (one track per rank); written to ``path`` when given."""
    trace_events: list[dict] = []
    for rank, rank_events in enumerate(events_per_rank):
        trace_events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for e in rank_events:
            trace_events.append(
                {
                    "name": e.name,
                    "cat": e.kind,
                    "ph": "X",
                    "ts": e.start * 1e6,
                    "dur": max(e.duration, 0.0) * 1e6,
                    "pid": 0,
                    "tid": rank,
                    "args": {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in e.tags.items()},
                }
            )
    trace = {"traceEvents": trace_events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace
