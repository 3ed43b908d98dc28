"""Pipeline schedule tables run in pure Python: :func:`simulate` times them with given costs (makespan, idle and
bubble per rank, peak microbatches in flight), :func:`check` proves them sound (every microbatch through every
stage once, in dependency order, each peer's messages received in the order it sends them, no deadlock).

The tables are :mod:`course_lib.parallel.schedules`'s; the executor on real ranks is
:mod:`course_lib.parallel.pipeline`. A receive waits for its send and a send does not wait (as ``isend``), so the
simulated idle is the bubble the papers count: GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021, §2.2),
the interleaved schedule (§2.2.2), ZB-H1, ZB-H2 and ZB-V (Qi et al. 2023, §3.1, §6) and DualPipeV (DeepSeek-AI
2024, §3.2.1), which :func:`course_lib.parallel.schedules.idle_formula` gives in closed form where it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.parallel.schedules import COMPUTE, Action, Costs, sends_in_order, transfer_key


@dataclass
class Simulation:
    """The table run with given costs: per rank its busy intervals, idle time and peak microbatches in flight."""

    makespan: float
    busy: list[list[tuple]]  # per rank: (start, end, action)
    idle: list[float]
    bubble_fraction: float  # idle / makespan, averaged over ranks
    peak_inflight: list[int]  # (microbatch, chunk) pairs between their F and their last backward pass
    deadlocked: list[tuple] = field(default_factory=list)  # (rank, action it waits at) if it could not finish


def simulate(tables: list[list[Action]], costs: Costs | None = None, split_backward: bool | None = None) -> Simulation:
    """Run the tables: compute takes its cost, a RECV waits for its SEND, a SEND does not wait (as isend).

    Costs (default ``Costs()``: F = B = 1, W = 0) are per stage of one rank; with v chunks per rank each chunk's
    action costs 1/v of them. B costs ``costs.b`` when the table has W actions, else ``costs.b + costs.w`` (the
    whole backward).
    """
    costs = costs or Costs()
    if split_backward is None:
        split_backward = any(a.kind == "W" for t in tables for a in t)
    v = 1 + max((a.chunk for t in tables for a in t), default=0)
    cost = {"F": costs.f / v, "B": (costs.b if split_backward else costs.b + costs.w) / v, "W": costs.w / v}
    p = len(tables)
    clock, pc = [0.0] * p, [0] * p
    sent: dict = {}
    busy: list[list[tuple]] = [[] for _ in range(p)]
    inflight, peak = [set() for _ in range(p)], [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(tables[r]):
                a = tables[r][pc[r]]
                if a.kind.startswith("RECV"):
                    key = transfer_key(a)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif a.kind.startswith("SEND"):
                    sent[transfer_key(a)] = clock[r]
                else:
                    busy[r].append((clock[r], clock[r] + cost[a.kind], a))
                    clock[r] += cost[a.kind]
                    if a.kind == "F":
                        inflight[r].add((a.microbatch, a.chunk))
                        peak[r] = max(peak[r], len(inflight[r]))
                    elif a.kind == ("W" if split_backward else "B"):  # its activations are freed
                        inflight[r].discard((a.microbatch, a.chunk))
                pc[r] += 1
                progress = True
    stuck = [(r, tables[r][pc[r]]) for r in range(p) if pc[r] < len(tables[r])]
    makespan = max(clock) if clock else 0.0
    idle = [makespan - sum(e - s for s, e, _ in rank_busy) for rank_busy in busy]
    return Simulation(makespan, busy, idle, sum(idle) / (p * makespan) if makespan else 0.0, peak, stuck)


def check(tables: list[list[Action]], microbatches: int, chunks: int = 1) -> None:
    """Raise ValueError unless every (microbatch, stage) is run forward and backward exactly once, on its rank, in
    dependency order (an F after its input arrived or was made on the rank, a B after the gradient of its output,
    a W after its B), every RECV has its SEND, each rank receives a peer's messages in the order the peer sends
    them, and the tables cannot deadlock."""
    last = max((a.stage for t in tables for a in t), default=0)
    for r, table in enumerate(tables):
        done, arrived = [], set()
        for a in table:
            if a.kind.startswith("RECV"):
                arrived.add(transfer_key(a))
            if a.kind in COMPUTE:
                if (a.kind, a.microbatch, a.chunk) in done:
                    raise ValueError(f"rank {r} runs {a} twice")
                if a.kind == "B" and ("F", a.microbatch, a.chunk) not in done:
                    raise ValueError(f"rank {r} runs {a} before the forward it differentiates")
                if a.kind == "W" and ("B", a.microbatch, a.chunk) not in done:
                    raise ValueError(f"rank {r} runs {a} before its B")
                needs = _needs(a, last)
                if needs is not None and needs not in arrived:
                    raise ValueError(f"rank {r} runs {a} (stage {a.stage}) before its input from stage {needs[2]}")
                done.append((a.kind, a.microbatch, a.chunk))
                if a.kind != "W":
                    arrived.add((a.kind, a.microbatch, a.stage))
        kinds = {"F", "B"} | ({"W"} if any(d[0] == "W" for d in done) else set())
        want = {(k, mb, c) for k in kinds for mb in range(microbatches) for c in range(chunks)}
        if set(done) != want:
            missing = sorted(want - set(done))[:3]
            raise ValueError(f"rank {r} does not run every microbatch through its chunks; missing e.g. {missing}")
    sends = {transfer_key(a) for t in tables for a in t if a.kind.startswith("SEND")}
    recvs = {transfer_key(a) for t in tables for a in t if a.kind.startswith("RECV")}
    if sends != recvs:
        raise ValueError(f"unmatched transfers: {sorted(sends ^ recvs)[:3]}")
    for (src, dst), keys in sends_in_order(tables).items():
        received = [transfer_key(a) for a in tables[dst] if a.kind.startswith("RECV") and a.peer == src]
        if received != keys:
            first = next(i for i, (x, y) in enumerate(zip(received, keys, strict=True)) if x != y)
            raise ValueError(
                f"rank {dst} receives {received[first]} from rank {src} before {keys[first]}, which rank {src} sends "
                "first: the receive would take the wrong tensor"
            )
    stuck = simulate(tables).deadlocked
    if stuck:
        raise ValueError("the tables deadlock: " + ", ".join(f"rank {r} waits at {a}" for r, a in stuck))


def _needs(a: Action, last: int) -> tuple | None:
    """The output an F or B needs first: the previous stage's activation, or the next stage's gradient."""
    if a.kind == "F" and a.stage > 0:
        return ("F", a.microbatch, a.stage - 1)
    if a.kind == "B" and a.stage < last:
        return ("B", a.microbatch, a.stage + 1)
    return None
