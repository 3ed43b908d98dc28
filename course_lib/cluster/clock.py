"""The modeled clock: replay what the ranks really did on a modeled GPU cluster.

Every rank's program (:mod:`course_lib.ledgers.trace`: compute segments with their counted FLOPs, and the collectives it
issued and waited for, in order) is replayed by a small discrete-event simulation:

* compute takes FLOPs / (peak x ``efficiency``) on the rank's own clock;
* a collective starts when every member of its group has issued it and the group's previous collective is done
  (a communicator runs its collectives in order), and takes the ring time on the slowest link of the group:
  (bytes a rank sends) / (link bandwidth) + (ring steps) x (link latency), the link being NVLink-class when all
  members share a node and the inter-node network otherwise (ranks fill nodes in order, ``gpus_per_node`` each);
  an all-to-all (expert parallelism's dispatch and combine) takes the bytes its busiest member sends to its n-1
  peers over that link, plus n-1 latencies (:func:`collective_time`);
* a point-to-point message starts when both the send and the receive are posted;
* with a ``topology`` (:mod:`course_lib.cluster.topology`), each collective and message is instead timed by
  :func:`course_lib.cluster.collectives.choose` on it: the group's ranks mapped to GPUs (in order, or by ``gpus``), the
  algorithm the fastest for its size, as NCCL picks, or a forced one (:func:`time_on_topology`). The topology
  supplies the links only; compute still runs at the hardware profile's peak;
* a rank that waits for a collective blocks until it is done; an async collective overlaps the compute issued
  between it and its wait.

Per rank the replay reports, for one step, the modeled timeline (the same event kinds as the wall clock), the step
time, compute, comm (time its collectives were moving data), exposed comm (time blocked while data moved), idle
(time blocked waiting for other ranks) and the bubble fraction idle / step time.

The profiles it runs on (peaks, links, the measured ones) are :mod:`course_lib.cluster.profiles`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from course_lib.cluster import collectives
from course_lib.cluster.profiles import HardwareProfile, get_profile
from course_lib.cluster.settings import resolve_topology
from course_lib.cluster.topology import Topology, Where
from course_lib.ledgers.records import CommRecord, Compute, Event, Issue, Wait


def ring_latency_steps(op: str, n: int) -> int:
    """Latency terms a collective pays: n-1 steps per reduce-scatter or all-gather half (a ring), n-1 for an
    all-to-all (one message to each of the n-1 peers), one per message."""
    if op in ("send", "recv"):
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def link(profile: HardwareProfile, ranks, gpus_per_node: int) -> tuple[float, float, bool]:
    """(bandwidth, latency, spans nodes) of the slowest link a group of global ranks uses."""
    spans = len({r // gpus_per_node for r in ranks}) > 1
    if spans:
        return profile.inter_bandwidth, profile.inter_latency_s, True
    return profile.intra_bandwidth, profile.intra_latency_s, False


def collective_time(op: str, sent_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """The bytes one rank sends over the link's bandwidth, plus one latency per step (:func:`ring_latency_steps`).

    For a ring collective the bytes are the ring's (:func:`course_lib.ledgers.comm.ring_factor`). For an all-to-all they
    are what the rank sends to its n-1 peers (uneven under routing: the ledger records each rank's own rows sent to
    others, and :func:`replay` times the group by its busiest sender); the group's slowest link bounds it, so an
    all-to-all whose group spans nodes runs at the inter-node bandwidth (GShard, Lepikhin et al. 2021, §3.2;
    DeepSeek-V3 §3.2.2: across nodes over InfiniBand, 3.2x slower than NVLink on H800s)."""
    return sent_bytes / bandwidth + ring_latency_steps(op, n) * latency


@dataclass(frozen=True)
class Timed:
    """How the clock timed one collective on a topology: its kind, its group as GPUs, the buffer one rank holds
    (``nbytes``, as :mod:`course_lib.cluster.collectives` means it), the algorithm, its time, the slowest link any two
    members' route crosses (bytes/s) and why the algorithm was used."""

    op: str
    gpus: tuple[int, ...]
    nbytes: float
    algorithm: str
    time_s: float
    slowest_link: float
    why: str


@dataclass
class ModeledRank:
    """One rank's modeled step: its span, compute, time with data in flight (``comm_s``: the union of its
    transfers, so a ring step's send and receive, which run at once, count once), the part of it the rank waited
    for (``exposed_comm_s``), idle time and its share of the span."""

    rank: int
    step_time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    idle_s: float
    bubble_fraction: float


@dataclass
class ModeledRun:
    """The replay: each rank's modeled events (all steps) and its numbers for ``step``; ``step_time_s`` is the
    step's makespan over all ranks."""

    hardware: str
    gpus_per_node: int | None  # None on a topology whose GPUs are not in nodes (a torus)
    step: int | None
    step_time_s: float
    events: list[list[Event]]
    ranks: list[ModeledRank]
    topology: str | None = None
    collectives: list[Timed] = field(default_factory=list)  # on a topology: each collective of ``step`` once
    placement: dict[str, Where] = field(default_factory=dict)  # on a topology: each group's worst-placed group

    @property
    def algorithms(self) -> dict[str, dict[str, int]]:
        """On a topology: per collective kind, how many of ``step``'s collectives each algorithm ran."""
        out: dict[str, dict[str, int]] = {}
        for (op, algorithm), count in sorted(Counter((t.op, t.algorithm) for t in self.collectives).items()):
            out.setdefault(op, {})[algorithm] = count
        return out

    def summary(self) -> dict:
        """The JSON section ``modeled``: the step's makespan; compute, comm, exposed comm and bubble fraction
        averaged over the ranks; on a topology, its name and the algorithms the clock used."""
        mean = {
            key: sum(getattr(r, key) for r in self.ranks) / len(self.ranks)
            for key in ("compute_s", "comm_s", "exposed_comm_s", "bubble_fraction")
        }
        out = {"hardware": self.hardware, "gpus_per_node": self.gpus_per_node, "step_time_s": self.step_time_s, **mean}
        if self.topology is not None:
            out |= {
                "topology": self.topology,
                "algorithms": self.algorithms,
                "placement": {name: asdict(where) for name, where in self.placement.items()},
            }
        return out

    def per_rank(self) -> list[dict]:
        return [asdict(r) for r in self.ranks]


def _match(records_per_rank: list[list[CommRecord]]) -> tuple[list[list[tuple]], dict]:
    """A key per record, equal on every rank taking part in the same collective (the k-th call on a group, or
    the k-th message from one rank to another), and for each key the members' record indices."""
    keys, members = [], defaultdict(dict)
    for rank, records in enumerate(records_per_rank):
        count: dict = defaultdict(int)
        mine = []
        for i, rec in enumerate(records):
            if rec.op in ("send", "recv"):
                group = ("p2p", *((rank, rec.peer) if rec.op == "send" else (rec.peer, rank)))
            else:
                group = ("group", *rec.ranks)
            key = (group, count[group])
            count[group] += 1
            mine.append(key)
            members[key][rank] = i
        keys.append(mine)
    return keys, members


def replay(
    programs: list[list],
    records: list[list[CommRecord]],
    hardware: str | HardwareProfile = "h100",
    gpus_per_node: int | None = None,
    efficiency: float = 0.5,
    precision: str = "bf16",
    step: int | None = -1,
    topology: Topology | str | None = None,
    algorithm: str | None = None,
    gpus: Sequence[int] | None = None,
) -> ModeledRun:
    """Replay the ranks' programs on ``hardware``; report ``step`` (-1: the last; None: the whole run).

    With ``topology`` (a :class:`course_lib.cluster.topology.Topology` or a profile such as ``"h100-superpod:4"``, see
    :func:`course_lib.cluster.topology.from_spec`), rank r runs on GPU ``gpus[r]`` (default: GPU r) and every collective
    is timed on the topology (:func:`time_on_topology`), with ``algorithm`` forced where it can run; the nodes are the
    topology's, so ``gpus_per_node`` is not given. Compute still runs at the profile's peak."""
    profile = hardware if isinstance(hardware, HardwareProfile) else get_profile(hardware)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], not {efficiency}")
    rate = profile.peak_flops[precision] * efficiency
    keys, members = _match(records)
    if topology is None:
        if gpus is not None or algorithm is not None:
            raise ValueError("gpus and algorithm place and time collectives on a topology; give a topology too")
        per_node = gpus_per_node or profile.gpus_per_node
        if per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, not {per_node}")
        seconds = _on_nodes(profile, per_node, records, members)
    else:
        if gpus_per_node is not None:
            raise ValueError("the topology says which GPUs share a node; drop gpus_per_node (place ranks with gpus)")
        topo, placed = resolve_topology(topology, len(programs), algorithm, gpus)
        per_node = getattr(topo, "gpus_per_domain", None)
        timed = _time_all(topo, placed, records, members, algorithm)
        seconds = {key: t.time_s for key, t in timed.items()}.__getitem__
    events, blocked = _simulate(programs, records, keys, rate, seconds)
    chosen = _last_step(programs) if step == -1 else step
    stepped = [e for rank_events in events for e in rank_events if chosen is None or e.tags.get("step") == chosen]
    makespan = max(e.end for e in stepped) - min(e.start for e in stepped) if stepped else 0.0
    ranks = [_metrics(r, events[r], blocked[r], chosen) for r in range(len(programs))]
    if topology is None:
        return ModeledRun(profile.name, per_node, chosen, makespan, events, ranks)
    in_step = [t for key, t in timed.items() if chosen is None or _step_of(key, records, members) == chosen]
    placement = _placement(topo, placed, records, members)
    return ModeledRun(profile.name, per_node, chosen, makespan, events, ranks, topo.name, in_step, placement)


def _on_nodes(
    profile: HardwareProfile, per_node: int, records: list[list[CommRecord]], members: dict
) -> Callable[[tuple], float]:
    """Without a topology, a collective's seconds by its key: what its busiest member sends, over the slowest link
    of its group when ranks fill nodes of ``per_node`` in order (:func:`link`, :func:`collective_time`)."""

    def seconds(key: tuple) -> float:
        ranks = key[0][1:]
        bandwidth, latency, _ = link(profile, ranks, per_node)
        sent = max(records[r][i].sent_bytes for r, i in members[key].items())
        op = records[ranks[0]][members[key][ranks[0]]].op
        return collective_time(op, sent, len(ranks), bandwidth, latency)

    return seconds


def _simulate(
    programs: list[list],
    records: list[list[CommRecord]],
    keys: list[list[tuple]],
    rate: float,
    seconds: Callable[[tuple], float],
) -> tuple[list[list[Event]], list[list[tuple]]]:
    """The discrete-event run (module docstring): compute at ``rate`` FLOP/s on each rank's clock; a collective
    starts once every member issued it and its group's previous one is done, and lasts ``seconds(key)``; a wait
    blocks until its collective is done. Each rank's events, and its blocked spans as (tags, wait start, data start,
    end); a rank left waiting for a collective some member never issued is a RuntimeError naming it."""
    n = len(programs)
    arrived: dict = defaultdict(dict)  # key -> {rank: time it issued}
    done: dict = {}  # key -> (start, end) of the data movement
    group_free: dict = defaultdict(float)  # a group's collectives run one after another
    clock, pc = [0.0] * n, [0] * n
    events: list[list[Event]] = [[] for _ in range(n)]
    blocked: list[list[tuple]] = [[] for _ in range(n)]

    def try_start(key) -> None:
        group = key[0]
        if len(arrived[key]) < len(group[1:]):
            return
        start = max(max(arrived[key].values()), group_free[group])
        done[key] = (start, start + seconds(key))
        group_free[group] = done[key][1]

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(programs[r]):
                entry = programs[r][pc[r]]
                if isinstance(entry, Compute):
                    took = (entry.flops + entry.elementwise) / rate
                    events[r].append(Event(r, entry.kind, entry.kind, clock[r], clock[r] + took, entry.tags))
                    clock[r] += took
                elif isinstance(entry, Issue):
                    arrived[keys[r][entry.record]][r] = clock[r]
                    try_start(keys[r][entry.record])
                elif isinstance(entry, Wait):
                    key = keys[r][entry.record]
                    if key not in done:
                        break  # blocked until the other members issue it
                    start, end = done[key]
                    rec = records[r][entry.record]
                    events[r].append(
                        Event(r, "comm", rec.op, start, end, {**rec.tags, "group": rec.group, "bytes": rec.sent_bytes})
                    )
                    blocked[r].append((rec.tags, clock[r], start, end))
                    clock[r] = max(clock[r], end)
                pc[r] += 1
                progress = True
    stuck = [r for r in range(n) if pc[r] < len(programs[r])]
    if stuck:
        waits = {r: records[r][programs[r][pc[r]].record] for r in stuck}
        raise RuntimeError(
            "the replay deadlocked: "
            + "; ".join(f"rank {r} waits for {w.op} on {w.group} {w.ranks}" for r, w in waits.items())
            + ", which some member never issued"
        )
    return events, blocked


def _placement(topology: Topology, placed: list[int], records: list[list[CommRecord]], members: dict) -> dict:
    """For each named group (an axis: tp, pp, dp, ...), where its worst-placed group sits on the topology: the
    one with the slowest link, then the most hops (:meth:`course_lib.cluster.topology.Topology.where`)."""
    out: dict[str, Where] = {}
    seen: dict[tuple, Where] = {}
    for key, where in members.items():
        rank, index = next(iter(where.items()))
        name = records[rank][index].group
        gpus = tuple(placed[r] for r in key[0][1:])
        if gpus not in seen:
            seen[gpus] = topology.where(gpus)
        here = seen[gpus]
        if name not in out or (here.slowest_link, -here.hops) < (out[name].slowest_link, -out[name].hops):
            out[name] = here
    return out


def _step_of(key: tuple, records: list[list[CommRecord]], members: dict) -> int | None:
    rank, index = next(iter(members[key].items()))
    return records[rank][index].tags.get("step")


def choose_args(recs: list[CommRecord]) -> tuple[str, float]:
    """A collective's records as :func:`course_lib.cluster.collectives.choose` takes it: its op and the buffer one rank
    holds. The ledger's tensor bytes are that buffer for an all-reduce, a reduce-scatter (its input), an
    all-gather (its output), a broadcast and a message; an all-to-all is timed by its busiest sender, as the
    buffer of n equal shares that sends as many bytes to the others; a barrier is an all-reduce of nothing."""
    op, n = recs[0].op, recs[0].group_size
    if op in ("send", "recv"):
        return "send", float(max(r.tensor_bytes for r in recs))
    if op == "barrier":
        return "all_reduce", 0.0
    if op == "all_to_all":
        return op, max(r.sent_bytes for r in recs) * n / (n - 1) if n > 1 else 0.0
    return op, float(max(r.tensor_bytes for r in recs))


def time_on_topology(
    topology: Topology, op: str, group: Sequence[int], nbytes: float, algorithm: str | None = None
) -> Timed:
    """One collective on a topology's GPUs ``group``, timed by :func:`course_lib.cluster.collectives.choose`:
    ``algorithm`` where it can run this op on this group, otherwise the fastest that can (its ``why`` then does not say
    forced)."""
    choice = None
    if algorithm in collectives.ALGORITHMS.get(op, ()):
        try:
            choice = collectives.choose(topology, op, group, nbytes, algorithm)
        except ValueError:
            choice = None  # not on this group (hierarchical inside one domain, torus on a fat-tree)
    choice = choice or collectives.choose(topology, op, group, nbytes)
    slowest = min((topology.path(a, b)[0] for a in group for b in group if a != b), default=float("inf"))
    return Timed(op, tuple(group), nbytes, choice.algorithm, choice.time_s, slowest, choice.why)


def _time_all(
    topology: Topology, placed: list[int], records: list[list[CommRecord]], members: dict, algorithm: str | None
) -> dict[tuple, Timed]:
    """Every collective every member issued, timed on the topology before the replay starts (so a group that
    cannot run there is an error before any event); the same collective shape is timed once."""
    timed, cache = {}, {}
    for key, where in members.items():
        ranks = key[0][1:]
        if len(where) < len(ranks):
            continue  # some member never issued it: the replay names the deadlock
        op, nbytes = choose_args([records[r][i] for r, i in where.items()])
        shape = (op, tuple(placed[r] for r in ranks), nbytes)
        if shape not in cache:
            cache[shape] = time_on_topology(topology, *shape, algorithm)
        timed[key] = cache[shape]
    if algorithm is not None and timed and all(t.algorithm != algorithm for t in timed.values()):
        raise ValueError(
            f"the {algorithm} algorithm can run none of this run's collectives on {topology.name} (see "
            "course_lib.cluster.collectives.ALGORITHMS: hierarchical needs groups over several NVLink domains, torus a "
            "torus); choose another, or none"
        )
    return timed


def _last_step(programs: list[list]) -> int | None:
    steps = [e.tags["step"] for prog in programs for e in prog if isinstance(e, Compute) and "step" in e.tags]
    return max(steps) if steps else None


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _metrics(rank: int, events: list[Event], blocked: list[tuple], step: int | None) -> ModeledRank:
    def in_step(tags: dict) -> bool:
        return step is None or tags.get("step") == step

    mine = [e for e in events if in_step(e.tags)]
    if not mine:
        return ModeledRank(rank, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    span = max(e.end for e in mine) - min(e.start for e in mine)
    exposed = idle = 0.0
    for tags, wait_start, data_start, end in blocked:
        if in_step(tags) and end > wait_start:
            idle += max(0.0, min(data_start, end) - wait_start)
            exposed += end - max(wait_start, data_start)
    return ModeledRank(
        rank,
        step_time_s=span,
        compute_s=sum(e.duration for e in mine if e.kind != "comm"),
        comm_s=_covered([(e.start, e.end) for e in mine if e.kind == "comm"]),
        exposed_comm_s=exposed,
        idle_s=idle,
        bubble_fraction=idle / span if span else 0.0,
    )
