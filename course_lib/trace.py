"""Per-rank timeline: what each rank computed, communicated and waited for, on the wall clock.

Every rank keeps one list of :class:`Event` (forward, backward, weight-grad, optimizer, comm, idle). Spans are opened
with :func:`span`; tags (step, phase, layer, microbatch) set with :func:`tags` are attached to every event and comm
record opened inside. Times are seconds since the run's epoch, which the launcher shares between the ranks so that
their timelines line up. :func:`to_chrome_trace` writes all ranks to a Chrome-trace JSON that Perfetto
(ui.perfetto.dev) and chrome://tracing open.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("forward", "backward", "weight_grad", "optimizer", "compute", "comm", "idle")


@dataclass
class Event:
    """One interval on one rank's timeline (seconds since the run's epoch)."""

    rank: int
    kind: str
    name: str
    start: float
    end: float
    tags: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class _Timeline:
    def __init__(self) -> None:
        self.rank = 0
        self.epoch = time.perf_counter()
        self.events: list[Event] = []
        self.tags: dict = {}


_TIMELINE = _Timeline()


def reset(rank: int = 0, epoch: float | None = None) -> None:
    """Start an empty timeline for ``rank``; ``epoch`` is the perf_counter() value that is time zero."""
    _TIMELINE.rank = rank
    _TIMELINE.epoch = time.perf_counter() if epoch is None else epoch
    _TIMELINE.events = []
    _TIMELINE.tags = {}


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
    try:
        yield
    finally:
        _TIMELINE.tags = saved


@contextlib.contextmanager
def span(kind: str, name: str = "", **span_tags) -> Iterator[None]:
    """Time the body as one event of ``kind``; the tags also apply to everything recorded inside."""
    start = now()
    with tags(**span_tags):
        yield
    record(kind, name or kind, start, now(), **span_tags)


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
