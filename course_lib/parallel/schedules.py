"""Pipeline schedules as data: per-rank tables of actions, generated in pure Python, and the papers' closed forms.

A pipeline of ``p`` ranks runs ``m`` microbatches through ``v * p`` *virtual stages*, v chunks per rank, placed by
:func:`virtual_stage`: in a loop chunk c of rank r is stage c*p + r (Narayanan et al. 2021, §2.2; v = 1 without
interleaving), in a V (ZB-V, DualPipeV) rank r holds stages r and 2p-1-r. An action is F (forward of a microbatch
through a stage), B (backward: input gradient, plus the weight gradient unless the schedule splits it off), W (the
weight gradient alone, zero-bubble schedules), or a point-to-point transfer of an activation (SEND_F / RECV_F) or
of its gradient (SEND_B / RECV_B); neighbouring stages on one rank (the turn of a V) need no transfer.

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
* ``1f1b``: p-r-1 warm-up forwards, then one forward one backward, then the remaining backwards, so a rank never
  holds more than p microbatches' activations (Narayanan et al. 2021, PipeDream-Flush, §2.1).
* ``interleaved``: 1F1B over v chunks per rank, microbatches in groups of p (Narayanan et al. 2021, §2.2).
* ``zb-h1``: 1F1B's forwards and input-gradient backwards, with each weight-gradient pass W deferred to fill the
  time a rank would otherwise wait (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1, ZB-H1).
* ``zb-h2``: ZB-H1 with 2(p-r)-1 warm-up forwards and up to 2p-1 microbatches in flight: each stage idles only
  (p-1)T_F, the floor of any pipeline (§3.1, ZB-H2).
* ``zb-v``: two chunks per rank in a V, F, B and W in Qi et al.'s handcrafted order (§6, ZB-V): at 1F1B's memory,
  (p-1)T_F/2 of idle with equal costs.
* ``dualpipev``: DeepSeek's DualPipe cut in half (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1; the
  order of deepseek-ai/DualPipe's ``dualpipev.py``): the V, with a forward of one chunk paired with the full
  backward of the other, which DualPipe overlaps and the course's CPU ranks run one after the other (but the last
  rank's first such pair, which DeepSeek runs apart).

The same tables drive :mod:`course_lib.parallel.schedule_sim` (``simulate``: makespan, idle and bubble per stage,
peak microbatches in flight; ``check``: every dependency respected, each peer's messages received in the order it
sends them, no deadlock) and the executor in :mod:`course_lib.parallel.pipeline`. :func:`idle_formula` and
:func:`bubble_formula` give the papers' closed forms where they are this table's (:func:`formula_holds`),
:func:`peak_activations` their memory.
ZB-V and DualPipeV are PyTorch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` action by action (F, its I as
our B, W, a full backward, DualPipeV's overlapped pairs: :func:`compute_units`), ZB-H1 (at equal costs) runs
``ScheduleInterleavedZeroBubble``'s compute order (``tests/test_schedules_beyond.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
# What the planner costs (all but GPipe): its search ranks the first three
# (:func:`course_lib.planner.layouts.pipeline_schedules`); the others it evaluates for a given layout and beside its
# choice (:func:`course_lib.planner.reasons.beyond_search`). Here, beside the rest, for ``plan``'s torch-free parser.
PIPELINE_SCHEDULES = SCHEDULES[1:]
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v", "dualpipev")  # the schedules whose tables have W actions
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V
COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One entry of a rank's table. ``chunk`` is the rank's model chunk and ``stage`` the virtual stage it holds
    (:func:`virtual_stage`); on one rank the chunk decides the stage, so equality leaves ``stage`` out. A transfer's
    stage is its own rank's: the sender's on a SEND, the receiver's on a RECV."""

    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    chunk: int = 0
    peer: int | None = None  # the other rank of a transfer
    stage: int = field(default=0, compare=False)

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


def chunks_per_rank(schedule: str, chunks: int = 1) -> int:
    """Model chunks each rank holds: 2 for a V-shaped schedule, which fixes them (``chunks`` 1, the default, or 2,
    what it holds; :func:`validate` refuses others), else ``chunks``."""
    return 2 if schedule in V_SHAPED else chunks


def virtual_stage(schedule: str, rank: int, chunk: int, p: int) -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds, of ``chunks_per_rank x p``.

    In a loop (every schedule but the V-shaped ones) chunk c of rank r is stage c p + r (Narayanan et al. 2021,
    §2.2), so a microbatch goes round the ranks v times. In a V (ZB-V, DualPipeV) rank r holds stages r and
    2p-1-r: a microbatch goes down the ranks and back up, the turn (stages p-1 and p) is on the last rank, which
    passes it on without a transfer, and the first and the last stage are both on rank 0."""
    if schedule in V_SHAPED:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_owner(schedule: str, stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual ``stage``: the inverse of :func:`virtual_stage`."""
    if schedule in V_SHAPED:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def embedding_ranks(schedule: str, p: int, chunks: int = 1) -> list[int]:
    """The pipeline ranks holding the first and the last stage, which share the tied embedding: two ranks that sum
    its gradient, or one (a single rank, or a V: rank 0 holds both ends and its two uses add up in one ``.grad``)."""
    return sorted({0, stage_owner(schedule, chunks_per_rank(schedule, chunks) * p - 1, p)[0]})


def check_v_chunks(schedule: str, chunks: int) -> None:
    """Refuse chunks a V-shaped schedule does not hold: it fixes 2 a rank (ZB-V, Qi et al. 2023, §6; DualPipeV, as
    PyTorch's ``ScheduleDualPipeV`` takes 2 stages a rank), so 1 (the default) or 2."""
    if schedule in V_SHAPED and chunks not in (1, 2):
        raise ValueError(
            f"{schedule} holds 2 chunks per rank, in a V (rank r holds stages r and 2p-1-r): give --chunks 2 or "
            f"leave out --chunks {chunks}"
        )


def validate(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Refuse, before any rank starts, a schedule that cannot run with these sizes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(f"stages, microbatches and chunks must be at least 1, got {stages}, {microbatches}, {chunks}")
    cells = stages * microbatches * chunks_per_rank(schedule, chunks)
    if cells > MAX_CELLS:
        raise ValueError(
            f"{stages} stages x {microbatches} microbatches x {chunks_per_rank(schedule, chunks)} chunks = "
            f"{cells:,} forward passes to lay out; the course's tables stop at {MAX_CELLS:,} (about a second to build "
            "and check). The bubble formulas hold for any size: use fewer stages or microbatches to see the table."
        )
    check_v_chunks(schedule, chunks)
    if chunks > 1 and schedule not in ("interleaved", *V_SHAPED):
        raise ValueError(f"--chunks {chunks} needs the interleaved schedule, not {schedule!r}")
    if schedule == "dualpipev" and microbatches < 2 * stages:
        raise ValueError(
            f"dualpipev needs at least 2p = {2 * stages} microbatches on {stages} ranks (DeepSeek's DualPipeV: rank 0 "
            f"warms up with 2p-1 forwards of its first chunk before its steady pairs), got {microbatches}; use "
            f"--microbatches {2 * stages} or more"
        )
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
    """The costs a table is planned with when none are given: F = B, and for the schedules that split the
    backward (whose W placement may depend on them) W = F as well, as in Qi et al.'s analysis. The executor runs
    these tables."""
    return Costs(1.0, 1.0, 1.0 if schedule in SPLIT_BACKWARD else 0.0)


def generate(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs | None = None
) -> list[list[Action]]:
    """The per-rank action tables of ``schedule`` (compute actions with their transfers)."""
    return tables_from_orders(schedule, stages, compute_units(schedule, stages, microbatches, chunks, costs), chunks)


def compute_units(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs | None = None
) -> list[list[list[tuple]]]:
    """Each rank's compute order in units, each a list of (kind, microbatch, chunk) that runs between two waits for
    transfers (:class:`_Order`): one action, a full backward (B and its W), or DualPipeV's pair of an F and a full
    backward, which DualPipe overlaps. :func:`generate` adds the transfers."""
    validate(schedule, stages, microbatches, chunks)
    costs = costs or default_costs(schedule)
    p, m = stages, microbatches
    if schedule == "gpipe":
        order = [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))] for _ in range(p)]
    elif schedule == "1f1b":
        order = [_one_f_one_b(r, p, m) for r in range(p)]
    elif schedule == "interleaved":
        order = [_interleaved(r, p, m, chunks) for r in range(p)]
    elif schedule == "zb-h1":
        order = _zero_bubble(p, m, costs, [p - r - 1 for r in range(p)], p)
    elif schedule == "zb-h2":
        order = _zero_bubble(p, m, costs, [2 * (p - r) - 2 for r in range(p)], 2 * p - 1)
    elif schedule == "zb-v":
        order = [_zb_v(r, p, m) for r in range(p)]
    else:
        order = [_dualpipe_v(r, p, m) for r in range(p)]
    return [_units(rank_order) for rank_order in order]


def _units(order: list) -> list[list[tuple]]:
    """A rank's order with each lone (kind, microbatch, chunk) made a unit of its own."""
    return [u if isinstance(u, list) else [u] for u in order]


def tables_from_orders(schedule: str, stages: int, orders: list[list], chunks: int = 1) -> list[list[Action]]:
    """The tables of per-rank compute orders, each entry a (kind, microbatch, chunk) or a unit, a list of them
    that runs between two waits (:class:`_Order`): the transfers added where the schedule's placement puts
    neighbouring stages on different ranks, and each rank's receives in the order its peers send."""
    p, v = stages, chunks_per_rank(schedule, chunks)
    return _in_send_order([_with_transfers(schedule, r, p, v, _units(order)) for r, order in enumerate(orders)])


def _one_f_one_b(r: int, p: int, m: int, warmup: int | None = None) -> list[tuple]:
    """1F1B's order: ``warmup`` forwards (p-r-1 by default), then one forward one backward, then the backwards."""
    warmup = min(p - r - 1 if warmup is None else warmup, m)
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


def _zero_bubble(p: int, m: int, costs: Costs, warmups: list[int], limit: int) -> list[list[tuple]]:
    """Qi et al. 2023's handcrafted schedules (§3.1) as one greedy: rank r follows 1F1B's order with ``warmups[r]``
    warm-up forwards and B split from W, runs its next F or B as soon as its input is there, and its oldest
    deferred W whenever it would otherwise wait, or before an F that would put more than ``limit`` microbatches'
    activations in flight (a W frees them).

    * ZB-H1: 1F1B's warm-up and limit p, 1F1B's peak: every stage idles (p-1)(T_F+T_B-T_W), a third of 1F1B's with
      equal costs (rank r defers at most r W's).
    * ZB-H2: warm-up 2(p-r)-2, so that rank r runs 2(p-r)-1 forwards before its first B, and limit 2p-1: with at
      least 2p-1 microbatches and W's long enough to fill the waits (:func:`formula_holds`), each stage idles only
      (p-1)T_F, the least any schedule can (the last stage cannot start before the first microbatch has crossed
      p-1 stages), also where B costs more than W and ZB-H1 idles (p-1)(T_F+T_B-T_W); for up to 2p-1 microbatches
      in flight on every rank."""
    plan = [_one_f_one_b(r, p, m, warmups[r]) for r in range(p)]
    out: list[list[tuple]] = [[] for _ in range(p)]
    ready: dict = {}  # (kind, microbatch, stage) -> time its output reaches the next rank
    clock, pc, deferred, live = [0.0] * p, [0] * p, [[] for _ in range(p)], [0] * p

    def weight(r: int) -> None:
        out[r].append(("W", deferred[r].pop(0), 0))
        clock[r] += costs.w
        live[r] -= 1

    while any(pc[r] < len(plan[r]) or deferred[r] for r in range(p)):
        for r in range(p):
            if pc[r] == len(plan[r]):
                while deferred[r]:
                    weight(r)
                continue
            kind, mb, _ = plan[r][pc[r]]
            need = (
                ("F", mb, r - 1) if kind == "F" and r > 0 else ("B", mb, r + 1) if kind == "B" and r < p - 1 else None
            )
            start = ready.get(need, None) if need else clock[r]
            if need and start is None:
                continue  # the producer has not run yet; come back to this rank
            if deferred[r] and (start > clock[r] or (kind == "F" and live[r] >= limit)):
                weight(r)
                continue
            clock[r] = max(clock[r], start) + (costs.f if kind == "F" else costs.b)
            out[r].append((kind, mb, 0))
            ready[(kind, mb, r)] = clock[r]
            live[r] += kind == "F"
            if kind == "B":
                deferred[r].append(mb)
            pc[r] += 1
    return out


class _Order:
    """A rank's order being written chunk by chunk, in units: each action takes the next microbatch of its (kind,
    chunk); a unit is what runs between two waits for transfers, one action, or a full backward (B and its W), or
    an F paired with a full backward (:func:`_dualpipe_v`). A unit's receives come before it and its sends after."""

    def __init__(self) -> None:
        self.units: list[list[tuple]] = []
        self.next: Counter = Counter()
        self.weights: deque = deque()  # chunks of the B's whose W is deferred, oldest first

    def take(self, kind: str, chunk: int) -> tuple:
        self.next[kind, chunk] += 1
        return (kind, self.next[kind, chunk] - 1, chunk)

    def run(self, kind: str, chunk: int) -> None:
        self.units.append([self.take(kind, chunk)])

    def backward(self, chunk: int, defer_weight: bool, paired_forward: tuple | None = None) -> None:
        """B, with its W in the same unit (a full backward) or deferred to :meth:`deferred_weight`;
        ``paired_forward``: an F that runs first in the same unit."""
        unit = ([paired_forward] if paired_forward else []) + [self.take("B", chunk)]
        if defer_weight:
            self.weights.append(chunk)
        else:
            unit.append(self.take("W", chunk))
        self.units.append(unit)

    def deferred_weight(self) -> None:
        if self.weights:
            self.run("W", self.weights.popleft())


def _zb_v(r: int, p: int, m: int) -> list[list[tuple]]:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §6; the V-ZB building block of Qi et al. 2024,
    "Pipeline Parallelism with Controllable Memory"), for p ranks with chunks 0 (stage r) and 1 (stage 2p-1-r):

    * warm-up: 2(p-r)-1 forwards of chunk 0, then r times F of chunk 1 and F of chunk 0, then p-r times F, B and W
      of chunk 1;
    * steady: F (while microbatches remain), B and W of chunk 0, then F, B and W of chunk 1;
    * cool-down: r times B of chunk 0 and B of chunk 1, p-r times B of chunk 0 and its oldest deferred W, then the
      remaining W's of chunk 1, then of chunk 0.

    The pattern is laid out for at least 2p-1 microbatches; with fewer, the actions of the missing ones are left
    out (which keeps the order free of deadlock; PyTorch's ScheduleZBVZeroBubble does the same). A rank keeps at
    most 2p chunk-microbatches of activations, p microbatches of a whole stage: 1F1B's peak."""
    n, o = max(m, 2 * p - 1), _Order()
    for _ in range(2 * (p - r) - 1):
        o.run("F", 0)
    for _ in range(r):
        o.run("F", 1)
        o.run("F", 0)
    for _ in range(p - r):
        for kind in "FBW":
            o.run(kind, 1)
    while o.next["F", 1] < o.next["F", 0] or o.next["F", 0] < n:
        if o.next["F", 0] < n:
            o.run("F", 0)
        for kind, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            o.run(kind, chunk)
    for _ in range(r):
        o.run("B", 0)
        o.run("B", 1)
    for _ in range(p - r):
        o.run("B", 0)
        o.run("W", 0)
    for chunk in (1, 0):
        while o.next["W", chunk] < n:
            o.run("W", chunk)
    return [[a for a in unit if a[1] < m] for unit in o.units if any(a[1] < m for a in unit)]


def _dualpipe_v(r: int, p: int, m: int) -> list[list[tuple]]:
    """DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1, DualPipe "cut in half"; the order of
    ``dualpipev.py`` in deepseek-ai/DualPipe), for p ranks with chunks 0 (stage r) and 1 (stage 2p-1-r) and
    m >= 2p microbatches, in its eight steps:

    1. 2(p-r-1) forwards of chunk 0; 2. r+1 times F of chunk 0, F of chunk 1; 3. p-r-1 times B of chunk 1 (its W
    deferred), a deferred W, F of chunk 1; 4. m-2p+r+1 times the pairs "F chunk 0 & B chunk 1", "F chunk 1 & B
    chunk 0", except that the last rank runs its first "F chunk 0" and "B chunk 1" apart (``dualpipev.py``: "we
    don't overlap these two chunks to further reduce bubble size"; PyTorch's ``ScheduleDualPipeV`` too); 5. p-r-1
    times B of chunk 1, "F chunk 1 & B chunk 0"; 6. r+1 times B of chunk 1, B of chunk 0, deferring W's from the
    middle one on; 7. p-r-1 times a deferred W, B of chunk 0 (W deferred); 8. r+1 deferred W's.

    A pair "F & B" is one forward and one full backward that DualPipe overlaps on a GPU (one's communication behind
    the other's compute); on the course's CPU ranks they run one after the other, F first, as DualPipeV does
    without an ``overlapped_forward_backward``. A full backward is a B with its W right after it."""
    o = _Order()

    def pair(forward: int, backward: int) -> None:
        o.backward(backward, defer_weight=False, paired_forward=o.take("F", forward))

    for _ in range(2 * (p - r - 1)):
        o.run("F", 0)
    for _ in range(r + 1):
        o.run("F", 0)
        o.run("F", 1)
    for _ in range(p - r - 1):
        o.backward(1, defer_weight=True)
        o.deferred_weight()
        o.run("F", 1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the last rank's first F of chunk 0 and B of chunk 1, apart: a smaller bubble
            o.run("F", 0)
            o.backward(1, defer_weight=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - r - 1):
        o.backward(1, defer_weight=False)
        pair(1, 0)
    defer = False
    for i in range(r + 1):
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        o.backward(1, defer)
        defer = defer or (i == (r + 1) // 2 and r % 2 == 0)
        o.backward(0, defer)
    for _ in range(p - r - 1):
        o.deferred_weight()
        o.backward(0, defer_weight=True)
    for _ in range(r + 1):
        o.deferred_weight()
    return o.units


def _with_transfers(schedule: str, r: int, p: int, v: int, units: list[list[tuple]]) -> list[Action]:
    """Put RECVs before each unit (:class:`_Order`; one compute action in most schedules) for the inputs its
    actions need from other ranks, and SENDs after it for the outputs other ranks need; a neighbouring stage on
    the same rank (the turn of a V) needs no transfer."""
    last = v * p - 1
    out = []
    for unit in units:
        recvs, computes, sends = [], [], []
        for kind, mb, chunk in unit:
            stage = virtual_stage(schedule, r, chunk, p)
            before = stage_owner(schedule, stage - 1, p)[0] if stage > 0 else r
            after = stage_owner(schedule, stage + 1, p)[0] if stage < last else r
            if kind == "F" and before != r:
                recvs.append(Action("RECV_F", mb, chunk, before, stage))
            if kind == "B" and after != r:
                recvs.append(Action("RECV_B", mb, chunk, after, stage))
            computes.append(Action(kind, mb, chunk, None, stage))
            if kind == "F" and after != r:
                sends.append(Action("SEND_F", mb, chunk, after, stage))
            if kind == "B" and before != r:
                sends.append(Action("SEND_B", mb, chunk, before, stage))
        out += recvs + computes + sends
    return out


def transfer_key(a: Action) -> tuple:
    """The same key on the SEND and on its RECV: what moves, which microbatch, from which virtual stage."""
    if a.kind in ("SEND_F", "SEND_B"):
        return (a.kind[-1], a.microbatch, a.stage)
    return (a.kind[-1], a.microbatch, a.stage + (-1 if a.kind == "RECV_F" else 1))  # a receive names the sender's


def sends_in_order(tables: list[list[Action]]) -> dict[tuple[int, int], list[tuple]]:
    """Per (sender, receiver) pair of ranks, the keys of the messages in the order the sender sends them."""
    sent: dict[tuple[int, int], list[tuple]] = {}
    for r, table in enumerate(tables):
        for a in table:
            if a.kind.startswith("SEND"):
                sent.setdefault((r, a.peer), []).append(transfer_key(a))
    return sent


def _in_send_order(tables: list[list[Action]]) -> list[list[Action]]:
    """Move receives earlier so that each rank takes the messages from each peer in the order the peer sends them.

    Between two ranks, NCCL and gloo match a receive with the oldest unmatched send, and every message of a
    pipeline has the same shape, so a receive out of order would silently take another microbatch's tensor. In a
    loop each pair of ranks carries the messages of one direction in an order both agree on; in a V, rank r sends
    rank r+1 both the activations going down the V and the gradients of its second chunk, in compute order, which
    rank r+1 may need the other way round. Its receive of a message is therefore preceded by the receives of all
    the peer sent before it (they have arrived by then: no new wait, the same simulated time), so an activation
    can be received a little before its F needs it."""
    sent = sends_in_order(tables)
    out = []
    for r, table in enumerate(tables):
        queues = {src: deque(keys) for (src, dst), keys in sent.items() if dst == r}
        receive = {transfer_key(a): a for a in table if a.kind.startswith("RECV")}
        taken: set = set()
        ordered = []
        for a in table:
            if not a.kind.startswith("RECV"):
                ordered.append(a)
                continue
            key = transfer_key(a)
            while key not in taken:
                earlier = queues[a.peer].popleft()
                ordered.append(receive[earlier])
                taken.add(earlier)
        out.append(ordered)
    return out


FORMULA_RANGES = {
    "zb-h1": "Qi et al.'s ZB-H1 closed form holds for this table when m >= p and F and B are whole multiples of W "
    "(or W = 0): then every wait a deferred W fills is a whole number of W's; elsewhere only the simulation tells",
    "zb-h2": "ZB-H2's (p-1)F holds for this table when m >= 2p-1 and W > 0, with W >= F/2 and B <= F, or W >= F and "
    "B <= 2F (checked over a grid of costs): then the deferred W's fill every wait; elsewhere only the simulation "
    "tells",
    "zb-v": "ZB-V's (p-1)F/2 holds for this table when m >= 2p-1, B = F and F/2 <= W <= F (Qi et al. lay it out for "
    "F = B = W); elsewhere only the simulation tells",
    "dualpipev": "DualPipeV's bubble (DeepSeek's, less the last rank's unpaired forward) holds for this table when "
    "the backward B takes at least as long as F and as W; elsewhere only the simulation tells",
}


def formula_holds(schedule: str, stages: int, microbatches: int, costs: Costs) -> bool:
    """Whether :func:`idle_formula`'s closed form is this module's table's idle time (``FORMULA_RANGES``; always
    for GPipe, 1F1B and the interleaved schedule). Each range is checked against
    :func:`course_lib.parallel.schedule_sim.simulate` over a grid of p, m, F, B and W in the tests.

    ZB-H1: Qi et al. 2023 (§3.1) derive it for T_W no more than T_F and T_B, with at least p microbatches; the
    greedy table here places a deferred W in a rank's wait only whole, so a wait that is not a whole number of W's
    is overrun (W > F or B: the idle grows back towards 1F1B's) or left part empty. ZB-H2 reaches its floor where
    the deferred W's are long enough to fill the waits of the tail. ZB-V is laid out for equal costs. DualPipeV's
    formula assumes a backward at least as long as the other passes."""
    p, m, f, b, w = stages, microbatches, costs.f, costs.b, costs.w
    if schedule == "zb-h1":
        if w == 0:
            return True
        return m >= p and w <= b and all(abs(x / w - round(x / w)) < 1e-9 for x in (f, b))
    if schedule == "zb-h2":
        return m >= 2 * p - 1 and w > 0 and ((2 * w >= f and b <= f) or (w >= f and b <= 2 * f))
    if schedule == "zb-v":
        return m >= 2 * p - 1 and b == f and f / 2 <= w <= f
    if schedule == "dualpipev":
        return b >= f and b >= w
    return True


def idle_formula(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs = Costs()
) -> float | None:
    """The idle time of every rank in one step, as the papers give it, with F, B and W the costs of a rank's whole
    stage (B the input gradient alone where W is split off; F, B and W of one of v chunks are 1/v of them). Each
    rank does the same work, m(F+B+W), so the idle time is the makespan's excess over it. None where the closed
    form is not this table's (:func:`formula_holds`).

    * GPipe, 1F1B: (p-1)(F+B+W) (Huang et al. 2019; Narayanan et al. 2021, §2.2.1); DeepSeek-V3's Table 2 writes
      (PP-1)(F+B) with B the full backward.
    * Interleaved: (p-1)(F+B+W)/v (Narayanan et al. 2021, §2.2.2).
    * ZB-H1: (p-1)(F+B-W) (Qi et al. 2023, §3.1); DeepSeek-V3's ZB1P, (PP-1)(F+B-2W) with B the full backward.
    * ZB-H2: (p-1)F, the least any schedule can idle: the last stage cannot start before the first microbatch has
      crossed p-1 stages (Qi et al. 2023, §3.1: "zero bubble" once the optimizer step is not a global barrier).
    * ZB-V: (p-1)F/2, the least a V can idle: the last rank waits for p-1 chunks of half a stage (Qi et al. 2023,
      §6).
    * DualPipeV: (PP/2-1)(F&B+B-3W) over PP = 2p chunks of half a stage, B the full backward, F&B the pair of a
      forward and a full backward, which DualPipe overlaps and the course runs one after the other (F&B = F+B):
      (p-1)(F+2B-W)/2 with this function's F, B and W (DeepSeek-AI 2024, §3.2.1 and Table 2), less
      min(F, (p-1)(B-F))/2: the last rank's first forward of chunk 0 (F/2), which DeepSeek's ``dualpipev.py`` runs
      apart from its backward, no longer waits with it for the gradient (the simulated idle: half a stage's
      forward once B >= F + F/(p-1), nothing with B = F)."""
    p, m, v = stages, microbatches, chunks_per_rank(schedule, chunks)
    f, b, w = costs.f, costs.b, costs.w
    if not formula_holds(schedule, p, m, costs):
        return None
    if schedule == "dualpipev":
        return ((p - 1) * (f + 2 * b - w) - min(f, (p - 1) * (b - f))) / 2
    return (p - 1) * {
        "gpipe": f + b + w,
        "1f1b": f + b + w,
        "interleaved": (f + b + w) / v,
        "zb-h1": f + b - w,
        "zb-h2": f,
        "zb-v": f / 2,
    }[schedule]


def bubble_formula(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs = Costs()
) -> float | None:
    """The idle fraction of a step, :func:`idle_formula`'s idle I over m(F+B+W) + I: (p-1)/(m+p-1) for GPipe and
    1F1B whatever F, B and W cost, (p-1)/(v m+p-1) interleaved; None where the closed form does not hold (the
    simulation is the answer there)."""
    idle = idle_formula(schedule, stages, microbatches, chunks, costs)
    if idle is None:
        return None
    return idle / (microbatches * (costs.f + costs.b + costs.w) + idle)


def formula_text(formula: float | None, schedule: str) -> str:
    """How the command line and the schedule explorer show :func:`bubble_formula`: "formula: 0.2727", or why
    there is none (never a negative bubble)."""
    if formula is None:
        return "formula: none here; " + FORMULA_RANGES[schedule]
    return f"formula: {formula:.4f}"


def bubble_ratio(
    schedule: str, stages: int, microbatches: int, chunks: int = 1, costs: Costs = Costs()
) -> float | None:
    """A stage's idle time over its busy time, the factor the planner multiplies a stage's work by: (p-1)/m for
    1F1B, (p-1)/(v m) interleaved, (p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) for ZB-H1; :func:`bubble_formula`'s
    fraction f as f / (1 - f). None where the closed form does not hold."""
    f = bubble_formula(schedule, stages, microbatches, chunks, costs)
    return None if f is None else f / (1 - f)


def peak_activations(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The most microbatches' activations of a whole stage any rank holds at once, as the papers count them:
    1F1B's p (GPipe's m), the interleaved schedule's p + (p-1)/v (Narayanan et al. 2021, §2.2.2: 1 + (p-1)/(p v)
    times 1F1B's), ZB-H1's p, ZB-H2's 2p-1 (Qi et al. 2023, §3.1), ZB-V's p (2p chunks of half a stage, §6) and
    DualPipeV's p + 1/2 (DeepSeek's PP+1 chunks, Table 2), each at most one per microbatch: the peak of
    ``schedule_sim.simulate``'s in-flight count over the chunks of a stage, with enough microbatches."""
    p, m, v = stages, microbatches, chunks_per_rank(schedule, chunks)
    peak = {
        "gpipe": m,
        "1f1b": p,
        "interleaved": p + (p - 1) / v,
        "zb-h1": p,
        "zb-h2": 2 * p - 1,
        "zb-v": p,
        "dualpipev": p + 1 / 2,
    }[schedule]
    return min(peak, m)
