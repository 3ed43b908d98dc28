"""A link-level simulation of the collective algorithms, independent of their formulas
(:mod:`course_lib.cluster.collectives`).

Each algorithm is written as what it does: a list of steps, each a list of messages (source GPU, destination GPU,
bytes), built from the algorithm's definition, not from its cost. :func:`simulate` moves every step's messages over
the topology's routes at once: a link crossed by k messages of the step gives each 1/k of its bandwidth, a message
runs at the rate of its most-shared link and pays every link's latency on its route; a step ends when its last
message arrives, and the next starts then (steps are synchronous, as in the algorithms' definitions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from course_lib.cluster.collectives import domains_of, torus_rings, tree_levels
from course_lib.cluster.topology import FatTree, Topology, Torus

Message = tuple[int, int, float]  # source GPU, destination GPU, bytes


def simulate(topology: Topology, steps: Sequence[Sequence[Message]]) -> float:
    """The completion time of ``steps`` on ``topology``, with contention inside each step."""
    total = 0.0
    for step in steps:
        routes = [topology.route(src, dst) for src, dst, _ in step]
        load = Counter(link for route in routes for link in route)
        finish = [
            sum(link.latency for link in route) + nbytes / min(link.bandwidth / load[link] for link in route)
            for route, (_, _, nbytes) in zip(routes, step, strict=True)
            if route
        ]
        total += max(finish, default=0.0)
    return total


def ring_schedule(group: Sequence[int], nbytes: float, op: str = "all_reduce") -> list[list[Message]]:
    """Every rank sends a 1/n chunk to the next rank of the group, n-1 times per half (two halves: all-reduce)."""
    n = len(group)
    halves = 2 if op == "all_reduce" else 1
    step = [(group[i], group[(i + 1) % n], nbytes / n) for i in range(n)]
    return [step] * (halves * (n - 1)) if n > 1 else []


def tree_steps(group: Sequence[int], nbytes: float, op: str = "all_reduce") -> list[list[Message]]:
    """Up a binomial tree (children send their whole partial sums to their parents), then down it (a broadcast:
    only down, from the group's first rank)."""
    up = [[(group[c], group[p], nbytes) for c, p in level] for level in tree_levels(len(group))]
    down = [[(p, c, size) for c, p, size in level] for level in reversed(up)]
    return up + down if op == "all_reduce" else down


def hierarchical_steps(topology: FatTree, group: Sequence[int], nbytes: float) -> list[list[Message]]:
    """A ring reduce-scatter inside every domain at once, rings across domains (one per local rank) over the
    1/d shards, a ring all-gather inside."""
    members = domains_of(topology, group)
    n_dom, d = len(members), len(members[0])
    inside = [(m[i], m[(i + 1) % d], nbytes / d) for m in members for i in range(d)]
    across = [(members[j][i], members[(j + 1) % n_dom][i], nbytes / d / n_dom) for j in range(n_dom) for i in range(d)]
    return [inside] * (d - 1) + [across] * (2 * (n_dom - 1)) + [inside] * (d - 1)


def torus_steps(topology: Torus, group: Sequence[int], nbytes: float, op: str = "all_reduce") -> list[list[Message]]:
    """Axis by axis, every chip sends half its chunk to each of its two ring neighbours in the group (a pair: both
    halves to the other chip), k-1 times (reduce-scatter, the shard shrinking k-fold per axis); then the same back
    in reverse axis order (all-gather). An all-reduce is both halves."""
    ranks = topology.check_group(group)
    members = set(ranks)
    scatter, shard = [], nbytes
    for axis, k in torus_rings(topology, ranks).items():
        chunk = shard / k / 2
        step = []
        for r in ranks:
            ahead = topology.neighbour(r, axis, 1)
            ahead = ahead if ahead in members else topology.neighbour(r, axis, -1)  # the end of a pair
            behind = topology.neighbour(r, axis, -1)
            behind = behind if behind in members else ahead
            step += [(r, ahead, chunk), (r, behind, chunk)]
        scatter.append([step] * (k - 1))
        shard /= k
    halves = {"reduce_scatter": scatter, "all_gather": scatter[::-1], "all_reduce": scatter + scatter[::-1]}[op]
    return [step for steps in halves for step in steps]


def all_to_all_steps(group: Sequence[int], nbytes: float) -> list[list[Message]]:
    """One step: every rank's 1/n share to every other rank, all in flight together."""
    return [[(a, b, nbytes / len(group)) for a in group for b in group if a != b]]


def steps_for(topology: Topology, op: str, algorithm: str, group: Sequence[int], nbytes: float) -> list[list[Message]]:
    """The message schedule of ``algorithm`` running ``op`` (the algorithms of :data:`collectives.ALGORITHMS`)."""
    group = topology.check_group(group)
    if algorithm == "ring":
        return ring_schedule(group, nbytes, op)
    if algorithm == "tree":
        return tree_steps(group, nbytes, op)
    if algorithm == "hierarchical":
        return hierarchical_steps(topology, group, nbytes)
    if algorithm == "torus":
        return torus_steps(topology, group, nbytes, op)
    if algorithm == "all_to_all":
        return all_to_all_steps(group, nbytes)
    if algorithm == "p2p":
        return [[(group[0], group[1], nbytes)]]
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of ring, tree, hierarchical, torus, all_to_all, p2p")
