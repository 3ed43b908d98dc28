"""The timeline: spans, tags, idle gaps and the Chrome-trace export (pure Python, no ranks)."""

import json

import pytest

from course_lib.ledgers import trace


def test_spans_carry_tags_and_nest():
    trace.reset(rank=3)
    with trace.tags(step=1):
        with trace.span("forward", layer=0):
            pass
        with trace.span("backward"):
            trace.record("comm", "all_reduce", trace.now(), trace.now(), bytes=8)
    events = trace.events()
    assert [e.kind for e in events] == ["forward", "comm", "backward"]
    assert events[0].tags == {"step": 1, "layer": 0} and events[0].rank == 3
    assert events[1].tags == {"step": 1, "bytes": 8}
    assert events[2].start <= events[1].start <= events[1].end <= events[2].end
    assert trace.current_tags() == {}


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown event kind"):
        trace.record("lunch", "x", 0.0, 1.0)


def test_gaps_become_idle_and_nested_spans_do_not():
    e = trace.Event
    events = [e(0, "forward", "f", 0.0, 1.0), e(0, "comm", "c", 0.2, 0.5), e(0, "backward", "b", 1.5, 2.0)]
    idle = [x for x in trace.with_idle(events) if x.kind == "idle"]
    assert [(x.start, x.end) for x in idle] == [(1.0, 1.5)]


def test_chrome_trace_has_one_track_per_rank(tmp_path):
    e = trace.Event
    per_rank = [[e(0, "forward", "f", 0.0, 0.001)], [e(1, "comm", "all_reduce", 0.001, 0.003, {"step": 0})]]
    path = tmp_path / "trace.json"
    trace.to_chrome_trace(per_rank, path)
    data = json.loads(path.read_text())
    complete = [x for x in data["traceEvents"] if x["ph"] == "X"]
    assert [(x["tid"], x["cat"], x["ts"], x["dur"]) for x in complete] == [
        (0, "forward", 0.0, 1000.0),
        (1, "comm", 1000.0, pytest.approx(2000.0)),
    ]
    names = {x["tid"]: x["args"]["name"] for x in data["traceEvents"] if x["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1"}
