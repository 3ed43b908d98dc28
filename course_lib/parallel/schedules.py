"""Pipeline schedules as data: per-rank tables of actions, generated, checked and simulated in pure Python.

A pipeline of ``p`` ranks runs ``m`` microbatches through ``v * p`` *virtual stages*: rank r holds model chunks
c = 0 .. v-1, chunk c of rank r being stage c*p + r (Narayanan et al. 2021, §2.2; v = 1 without interleaving). An
action is F (forward of a microbatch through a stage), B (backward: input gradient, plus the weight gradient unless
the schedule splits it off), W (the weight gradient alone, zero-bubble schedules), or a point-to-point transfer of
an activation (SEND_F / RECV_F) or of its gradient (SEND_B / RECV_B).

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
* ``1f1b``: p-r-1 warm-up forwards, then one forward one backward, then the remaining backwards, so a rank never
  holds more than p microbatches' activations (Narayanan et al. 2021, PipeDream-Flush, §2.1).
* ``interleaved``: 1F1B over v chunks per rank, microbatches in groups of p (Narayanan et al. 2021, §2.2).
* ``zb-h1``: 1F1B's forwards and input-gradient backwards, with each weight-gradient pass W deferred to fill the
  time a rank would otherwise wait (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1, ZB-H1).

The same tables drive :func:`simulate` (makespan, idle and bubble per stage, peak microbatches in flight),
:func:`check` (every dependency respected, no deadlock) and the executor in :mod:`course_lib.parallel.pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    chunk: int = 0
    peer: int | None = None  # the other rank of a transfer

    def __str__(self) -> str:
        where = f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}" if self.peer is not None else ""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "") + where


@dataclass(frozen=True)
class Costs:
    """Time units of a forward, a backward (input gradient) and a weight-gradient pass of one stage."""

    f: float = 1.0
    b: float = 1.0
    w: float = 0.0


MAX_CELLS = 16_384  # stages x microbatches x chunks: 64 x 256 builds, checks and simulates in about a second


def validate(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Refuse, before any rank starts, a schedule that cannot run with these sizes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"stages, microbatches and chunks must be at least 1, got {stages}, {microbatches}, {chunks}")
    if stages * microbatches * chunks > MAX_CELLS:
        raise ValueError(
            f"{stages} stages x {microbatches} microbatches x {chunks} chunks = {stages * microbatches * chunks:,} "
            f"forward passes to lay out; the course's tables stop at {MAX_CELLS:,} (about a second to build and "
            "check). The bubble formulas hold for any size: use fewer stages or microbatches to see the table."
        )
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"--chunks {chunks} needs the interleaved schedule, not {schedule!r}")
    if schedule == "interleaved":
        if chunks < 2:
            raise ValueError("the interleaved schedule needs at least 2 chunks per rank (--chunks 2)")
        if microbatches < stages or microbatches % stages:
            raise ValueError(
                f"the interleaved schedule sends microbatches through the ranks in groups of p = {stages}: "
                f"{microbatches} microbatches is {'fewer than' if microbatches < stages else 'not a multiple of'} "
                f"{stages}. Use a multiple of {stages}."
            )


def default_costs(schedule: str) -> Costs:
    """The costs a table is planned with when none are given: F = B, and for ZB-H1 (whose W placement depends on
    them) W = F as well, as in Qi et al.'s analysis. The executor runs these tables."""
    return Costs(1.0, 1.0, 1.0 if schedule == "zb-h1" else 0.0)


def generate(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs | None = None
) -> list[list[Action]]:
    """The per-rank action tables of ``schedule`` (compute actions with their transfers)."""
    validate(schedule, stages, microbatches, chunks)
    costs = costs or default_costs(schedule)
    p, m = stages, microbatches
    if schedule == "gpipe":
        order = [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))] for _ in range(p)]
    elif schedule == "1f1b":
        order = [_one_f_one_b(r, p, m) for r in range(p)]
    elif schedule == "interleaved":
        order = [_interleaved(r, p, m, chunks) for r in range(p)]
    else:
        order = _zero_bubble_h1(p, m, costs)
    return [_with_transfers(r, p, chunks, rank_order) for r, rank_order in enumerate(order)]


def _one_f_one_b(r: int, p: int, m: int) -> list[tuple]:
    warmup = min(p - r - 1, m)
    out = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i, 0), ("B", i, 0)]
    return out + [("B", i, 0) for i in range(m - warmup, m)]


def _interleaved(r: int, p: int, m: int, v: int) -> list[tuple]:
    """Megatron's interleaved order: the k-th forward is microbatch (k // (p v)) p + k % p of chunk (k // p) % v."""
    total = m * v

    def forward(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


def _zero_bubble_h1(p: int, m: int, costs: Costs) -> list[list[tuple]]:
    """1F1B with B split into B (input gradient) and W: a rank runs its next F or B as soon as it can, and its
    oldest deferred W whenever it would otherwise wait. Rank r defers at most r W's (the first stage none), so no
    rank holds more than p microbatches' activations, 1F1B's peak, while every stage idles only
    (p-1)(T_F+T_B-T_W) (Qi et al. §3.1)."""
    plan = [[a if a[0] == "F" else ("B", a[1], 0) for a in _one_f_one_b(r, p, m)] for r in range(p)]
    out: list[list[tuple]] = [[] for _ in range(p)]
    ready: dict = {}  # (kind, microbatch, stage) -> time its output reaches the next rank
    clock, pc, deferred = [0.0] * p, [0] * p, [[] for _ in range(p)]
    while any(pc[r] < len(plan[r]) or deferred[r] for r in range(p)):
        for r in range(p):
            if pc[r] == len(plan[r]):
                while deferred[r]:
                    out[r].append(("W", deferred[r].pop(0), 0))
                    clock[r] += costs.w
                continue
            kind, mb, _ = plan[r][pc[r]]
            need = (
                ("F", mb, r - 1) if kind == "F" and r > 0 else ("B", mb, r + 1) if kind == "B" and r < p - 1 else None
            )
            start = ready.get(need, None) if need else clock[r]
            if need and start is None:
                continue  # the producer has not run yet; come back to this rank
            if deferred[r] and start > clock[r]:
                out[r].append(("W", deferred[r].pop(0), 0))
                clock[r] += costs.w
                continue
            clock[r] = max(clock[r], start) + (costs.f if kind == "F" else costs.b)
            out[r].append((kind, mb, 0))
            ready[(kind, mb, r)] = clock[r]
            if kind == "B":
                deferred[r].append(mb)
                if len(deferred[r]) > r:
                    out[r].append(("W", deferred[r].pop(0), 0))
                    clock[r] += costs.w
            pc[r] += 1
    return out


def _with_transfers(r: int, p: int, v: int, order: list[tuple]) -> list[Action]:
    """Put a RECV before each compute action that needs another rank's output and a SEND after each one whose
    output another rank needs."""
    last = v * p - 1
    out = []
    for kind, mb, chunk in order:
        stage = chunk * p + r
        if kind == "F" and stage > 0:
            out.append(Action("RECV_F", mb, chunk, (stage - 1) % p))
        if kind == "B" and stage < last:
            out.append(Action("RECV_B", mb, chunk, (stage + 1) % p))
        out.append(Action(kind, mb, chunk))
        if kind == "F" and stage < last:
            out.append(Action("SEND_F", mb, chunk, (stage + 1) % p))
        if kind == "B" and stage > 0:
            out.append(Action("SEND_B", mb, chunk, (stage - 1) % p))
    return out


@dataclass
class Simulation:
    """The table run with given costs: per rank its busy intervals, idle time and peak microbatches in flight."""

    makespan: float
    busy: list[list[tuple]]  # per rank: (start, end, action)
    idle: list[float]
    bubble_fraction: float  # idle / makespan, averaged over ranks
    peak_inflight: list[int]  # (microbatch, chunk) pairs between their F and their last backward pass
    deadlocked: list[tuple] = field(default_factory=list)  # (rank, action it waits at) if it could not finish


def simulate(tables: list[list[Action]], costs: Costs = Costs(), split_backward: bool | None = None) -> Simulation:
    """Run the tables: compute takes its cost, a RECV waits for its SEND, a SEND does not wait (as isend).

    Costs are per stage of one rank; with v chunks per rank each chunk's action costs 1/v of them. B costs
    ``costs.b`` when the table has W actions, else ``costs.b + costs.w`` (the whole backward).
    """
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
                    key = _transfer_key(a, r, p)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                elif a.kind.startswith("SEND"):
                    sent[_transfer_key(a, r, p)] = clock[r]
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


def _transfer_key(a: Action, r: int, p: int) -> tuple:
    """The same key on the SEND and on its RECV: what moves, which microbatch, from which virtual stage."""
    if a.kind in ("SEND_F", "SEND_B"):
        stage = a.chunk * p + r
    else:  # a receive names the sender's stage
        stage = a.chunk * p + r + (-1 if a.kind == "RECV_F" else 1)
    return (a.kind[-1], a.microbatch, stage)


def check(tables: list[list[Action]], microbatches: int, chunks: int = 1) -> None:
    """Raise ValueError unless every (microbatch, stage) is run forward and backward exactly once, on its rank, in
    dependency order, every RECV has its SEND, and the tables cannot deadlock."""
    p = len(tables)
    for r, table in enumerate(tables):
        done = []
        for a in table:
            if a.kind in COMPUTE:
                if (a.kind, a.microbatch, a.chunk) in done:
                    raise ValueError(f"rank {r} runs {a} twice")
                if a.kind == "B" and ("F", a.microbatch, a.chunk) not in done:
                    raise ValueError(f"rank {r} runs {a} before the forward it differentiates")
                if a.kind == "W" and ("B", a.microbatch, a.chunk) not in done:
                    raise ValueError(f"rank {r} runs {a} before its B")
                done.append((a.kind, a.microbatch, a.chunk))
        kinds = {"F", "B"} | ({"W"} if any(d[0] == "W" for d in done) else set())
        want = {(k, mb, c) for k in kinds for mb in range(microbatches) for c in range(chunks)}
        if set(done) != want:
            missing = sorted(want - set(done))[:3]
            raise ValueError(f"rank {r} does not run every microbatch through its chunks; missing e.g. {missing}")
    sends = {_transfer_key(a, r, p) for r, t in enumerate(tables) for a in t if a.kind.startswith("SEND")}
    recvs = {_transfer_key(a, r, p) for r, t in enumerate(tables) for a in t if a.kind.startswith("RECV")}
    if sends != recvs:
        raise ValueError(f"unmatched transfers: {sorted(sends ^ recvs)[:3]}")
    stuck = simulate(tables).deadlocked
    if stuck:
        raise ValueError("the tables deadlock: " + ", ".join(f"rank {r} waits at {a}" for r, a in stuck))


ZB_H1_RANGE = (
    "Qi et al.'s ZB-H1 closed form holds for this table when m >= p and F and B are whole multiples of W (or W = 0): "
    "then every wait a deferred W fills is a whole number of W's; elsewhere only the simulation tells"
)


def zb_h1_formula_holds(stages: int, microbatches: int, costs: Costs) -> bool:
    """Whether :func:`bubble_formula`'s ZB-H1 closed form is this module's ZB-H1 table's idle time
    (``ZB_H1_RANGE``). Qi et al. 2023 (§3.1) derive it for T_W no more than T_F and T_B, with at least p
    microbatches; the greedy table here places a deferred W in a rank's wait only whole, so a wait that is not a
    whole number of W's is overrun (W > F or B: the idle grows back towards 1F1B's) or left part empty. Checked
    against :func:`simulate` over a grid of p, m, F, B and W in ``tests/test_pipeline.py``."""
    if costs.w == 0:
        return True
    if microbatches < stages or costs.w > costs.b:
        return False
    return all(abs(x / costs.w - round(x / costs.w)) < 1e-9 for x in (costs.f, costs.b))


def bubble_formula(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs = Costs()
) -> float | None:
    """The idle fraction the papers give: (p-1)/(m+p-1) for GPipe and 1F1B (whatever F and B cost),
    (p-1)/(v m+p-1) interleaved (Narayanan et al. 2021, §2.2.2), and for ZB-H1 an idle (p-1)(T_F+T_B-T_W) per
    stage over a step of m(T_F+T_B+T_W) plus that idle (Qi et al. 2023, §3.1), where that closed form holds
    (:func:`zb_h1_formula_holds`); None where it does not (the simulation is the answer there)."""
    p, m = stages, microbatches
    if schedule == "interleaved":
        return (p - 1) / (chunks * m + p - 1)
    if schedule == "zb-h1":
        if not zb_h1_formula_holds(p, m, costs):
            return None
        idle = (p - 1) * (costs.f + costs.b - costs.w)
        return idle / (m * (costs.f + costs.b + costs.w) + idle)
    return (p - 1) / (m + p - 1)


def formula_text(formula: float | None) -> str:
    """How the command line and the schedule explorer show :func:`bubble_formula`: "formula: 0.2727", or why
    there is none (never a negative bubble)."""
    if formula is None:
        return "formula: none here; " + ZB_H1_RANGE
    return f"formula: {formula:.4f}"


def bubble_ratio(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs = Costs()
) -> float | None:
    """A stage's idle time over its busy time, the factor the planner multiplies a stage's work by: (p-1)/m for
    1F1B, (p-1)/(v m) interleaved, (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) for ZB-H1; :func:`bubble_formula`'s
    fraction f as f / (1 - f). None where the closed form does not hold."""
    f = bubble_formula(schedule, stages, microbatches, chunks, costs)
    return None if f is None else f / (1 - f)
