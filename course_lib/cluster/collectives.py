"""Collective algorithms and their cost on a topology, in the alpha-beta model.

A message of ``b`` bytes over a route costs alpha + b / B: alpha the route's summed latency, B its slowest link's
bandwidth, as long as no other message of the same step shares a link. Ring, tree, hierarchical and torus assume
that (true for groups listed in node order, or whole rings of a torus); where a group's order makes a step's
messages share a link, their formula is a lower bound and :mod:`course_lib.cluster.linksim` gives the time with the
sharing. The all-to-all formulas count the sharing (exact for groups with the same number of ranks per domain and
per leaf). ``nbytes`` is the buffer one rank holds:
the tensor an all-reduce reduces, the input of a reduce-scatter, the output of an all-gather, the rows an all-to-all
sends (a 1/n share to each rank, itself included). Compute (the reduction's additions) is not counted.

* **ring** (all-reduce, reduce-scatter, all-gather): n-1 steps per half, each rank sending nbytes/n to the next;
  2(n-1)(alpha + nbytes/(nB)) for an all-reduce. Its bandwidth term is the least any all-reduce can have on a ring
  of links (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC);
  alpha and B are the ring's slowest hop's.
* **tree**: a binomial-tree reduce then broadcast, 2 ceil(log2 n) (alpha_k + nbytes/B_k), level k's pairs
  2^k apart (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH",
  IJHPCA: the short-message algorithms). Latency-bound messages gain: log2 n steps instead of n-1. NCCL's
  double binary tree (Sanders, Speck & Traff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction and
  scan", Parallel Computing) pipelines halves of the buffer down two complementary trees to approach the ring's
  bandwidth; that pipelining is not modeled here. A broadcast is the tree's second half alone, from the group's
  first rank.
* **hierarchical** (fat-tree, a group spanning domains with d members each): reduce-scatter on a ring inside each
  domain, all-reduce of the 1/d shard on d rings across domains (one per local rank, i.e. per rail), all-gather
  inside: 2(d-1)(alpha_in + nbytes/(d B_in)) + 2(N-1)(alpha_out + nbytes/(dN B_out)). Only 1/d of the buffer
  crosses the slow network (NCCL's inter-node rings; Thakur et al. 2005 for the reduce-scatter + all-gather
  split, due to Rabenseifner).
* **torus** all-reduce: dimension by dimension, a bidirectional ring per axis (half the shard each way round, on
  the axis' two links of every chip), reduce-scatter over the axes, all-gather back: sum over axes of
  2(k-1)(alpha + s/(2kB)), s the shard entering the axis, divided by k after it (a ring of two has one cable, so
  s/(kB), and a pair of neighbours in a longer ring the same); a reduce-scatter or all-gather alone is one half.
  (Chan, Heimlich, Purkayastha & van de Geijn 2007, "Collective communication: theory, practice, and
  experience", CCPE, multidimensional bucket algorithms; Google's TPU pods, Jouppi et al. 2023.)
* **all-to-all**: every pair's message in flight at once, each link shared equally by the messages crossing it.
  On a fat-tree the busiest links are a GPU's NIC (its messages leaving the domain) and a leaf's uplink (its GPUs'
  messages leaving the leaf): the bisection, where oversubscription bites. On a torus (a box of whole rings and
  short runs) the busiest link of a whole ring of k chips carries f(f+1)/2 x n/k messages, f = k // 2
  (dimension-order routing, ties the positive way), of a run of m floor(m/2) ceil(m/2) x n/m; the longest message
  crosses f (or m-1) hops per axis. Scattered chips (not a box) have no closed form: every link's messages are
  counted (numpy), as the link-level simulation does message by message.
* **p2p**: the route's latency (hops x hop latency on a torus) + nbytes / its slowest link.

:func:`choose` picks the fastest applicable algorithm for a collective, group and size, as NCCL's tuner picks the
algorithm its cost model predicts fastest (tree for small messages, ring or hierarchical for large ones across
nodes; torus-native on a torus), or times a forced one; it says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil, log2

import numpy as np

from course_lib.cluster.topology import FatTree, Topology, Torus

ALGORITHMS = {
    "all_reduce": ("ring", "tree", "hierarchical", "torus"),
    "reduce_scatter": ("ring", "torus"),
    "all_gather": ("ring", "torus"),
    "all_to_all": ("all_to_all",),
    "broadcast": ("tree",),
    "send": ("p2p",),
}

WHY = {
    "ring": "bandwidth-bound: each rank sends the least bytes any all-reduce can (Patarasuk & Yuan 2009)",
    "tree": "latency-bound: log2(n) message latencies per half instead of the ring's n-1 (Thakur et al. 2005)",
    "hierarchical": "only 1/d of the buffer crosses the slow network, the rest moves over NVLink",
    "torus": "every chip's links on each axis carry half the shard each way at once",
    "all_to_all": "every pair's message at once; the busiest link (NIC, leaf uplink or torus link) sets the time",
    "p2p": "one message along its route",
}


@dataclass(frozen=True)
class Choice:
    """An algorithm's modeled time for one collective, its name, and why it was used."""

    time_s: float
    algorithm: str
    why: str


def _worst(topology: Topology, pairs: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(slowest bandwidth, longest latency) over the routes of ``pairs``."""
    paths = [topology.path(a, b) for a, b in pairs if a != b]
    return min(p[0] for p in paths), max(p[1] for p in paths)


def ring(topology: Topology, group: Sequence[int], nbytes: float, op: str = "all_reduce") -> float:
    """Ring reduce-scatter, all-gather, or both (all-reduce), in the order the group lists its ranks."""
    g = topology.check_group(group)
    n = len(g)
    if n == 1:
        return 0.0
    bandwidth, latency = _worst(topology, [(g[i], g[(i + 1) % n]) for i in range(n)])
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * (latency + nbytes / n / bandwidth)


def tree_levels(n: int) -> list[list[tuple[int, int]]]:
    """A binomial tree's reduce levels over group positions 0..n-1: (child, parent) pairs 2^k apart."""
    return [[(i, i - 2**k) for i in range(n) if i % 2 ** (k + 1) == 2**k] for k in range(ceil(log2(n)) if n > 1 else 0)]


def tree(topology: Topology, group: Sequence[int], nbytes: float, op: str = "all_reduce") -> float:
    """Binomial-tree reduce then broadcast (a broadcast: the second half alone): per level, the slowest pair's
    latency plus the whole buffer."""
    g = topology.check_group(group)
    halves = 2 if op == "all_reduce" else 1
    total = 0.0
    for level in tree_levels(len(g)):
        bandwidth, latency = _worst(topology, [(g[a], g[b]) for a, b in level])
        total += halves * (latency + nbytes / bandwidth)
    return total


def domains_of(topology: FatTree, group: Sequence[int]) -> list[list[int]]:
    """The group's members per NVLink domain, or ValueError unless every domain holds the same number."""
    by_domain: dict[int, list[int]] = {}
    for r in topology.check_group(group):
        by_domain.setdefault(topology.domain(r), []).append(r)
    members = [by_domain[d] for d in sorted(by_domain)]
    if len({len(m) for m in members}) != 1:
        raise ValueError(
            f"hierarchical needs the same number of ranks in every domain of {topology.name}, not "
            f"{[len(m) for m in members]}"
        )
    return members


def hierarchical(topology: Topology, group: Sequence[int], nbytes: float) -> float:
    """Reduce-scatter inside each domain, all-reduce across domains per local rank, all-gather inside."""
    if not isinstance(topology, FatTree):
        raise ValueError(f"hierarchical all-reduce needs NVLink domains (a FatTree), not {topology.name}")
    members = domains_of(topology, group)
    n_dom, d = len(members), len(members[0])
    if n_dom < 2 or d < 2:
        raise ValueError(
            f"hierarchical needs a group over at least two domains with at least two ranks in each, not {n_dom} x {d}"
        )
    b_in, a_in = _worst(topology, [(m[i], m[(i + 1) % d]) for m in members for i in range(d)])
    b_out, a_out = _worst(
        topology, [(members[j][i], members[(j + 1) % n_dom][i]) for j in range(n_dom) for i in range(d)]
    )
    return 2 * (d - 1) * (a_in + nbytes / d / b_in) + 2 * (n_dom - 1) * (a_out + nbytes / (d * n_dom) / b_out)


def torus(topology: Topology, group: Sequence[int], nbytes: float, op: str = "all_reduce") -> float:
    """Bidirectional rings axis by axis: reduce-scatter down the axes, all-gather back up them (an all-reduce is
    both; each half alone is a reduce-scatter or an all-gather). Each axis the group spans must be a whole ring or
    a pair of neighbours (one cable, as a ring of two)."""
    if not isinstance(topology, Torus):
        raise ValueError(f"the torus all-reduce needs a Torus, not {topology.name}")
    total, shard = 0.0, nbytes
    for k in torus_rings(topology, group).values():
        per_step = shard / (2 * k) if k > 2 else shard / k  # a pair: both halves on its one cable
        total += (k - 1) * (topology.hop_latency + per_step / topology.link_bandwidth)
        shard /= k
    return 2 * total if op == "all_reduce" else total


def torus_rings(topology: Torus, group: Sequence[int]) -> dict[int, int]:
    """The rings the torus algorithm runs on, per axis: the group's box (:meth:`Torus.box`) if each of its
    extents is the whole ring or a pair, else ValueError (a longer run has no wrap-around link)."""
    extents = topology.box(group)
    runs = {axis: m for axis, m in extents.items() if m not in (2, topology.shape[axis])}
    if runs:
        raise ValueError(
            f"the torus algorithm needs whole rings (or pairs) on every axis it spans, and the group holds runs "
            f"{runs} of rings {[topology.shape[a] for a in runs]} on {topology.name}; use ring or tree"
        )
    return extents


def all_to_all(topology: Topology, group: Sequence[int], nbytes: float) -> float:
    """Every rank sends nbytes/n to every other at once; the most-shared link on the longest route sets the time."""
    if isinstance(topology, Torus):
        return _torus_all_to_all(topology, group, nbytes)
    if isinstance(topology, FatTree):
        return _fat_tree_all_to_all(topology, group, nbytes)
    raise ValueError(f"no all-to-all model for {topology.name}")


def _torus_all_to_all(topology: Torus, group: Sequence[int], nbytes: float) -> float:
    """On a box (:meth:`Torus.box`), the busiest link of an axis carries L x n/m of the messages, the axis' m
    members per line times the n/m lines that route through it: L = f(f+1)/2 on a whole ring (f = k // 2, ties
    the positive way), floor(m/2) ceil(m/2) across the middle of a run of m; the longest message crosses f or m-1
    hops per axis, through each axis' busiest link. Chips that are not a box have no closed form here: their time
    is counted link by link (:func:`_scattered`)."""
    n = len(group)
    if n == 1:
        return 0.0
    try:
        extents = topology.box(group)
    except ValueError:  # scattered chips: no closed form; count every link's messages
        return _scattered(topology, group, nbytes)
    hops, load = 0, 0.0
    for axis, m in extents.items():
        far = topology.shape[axis] // 2 if m == topology.shape[axis] else m - 1
        line = far * (far + 1) / 2 if m == topology.shape[axis] else (m // 2) * ((m + 1) // 2)
        hops, load = hops + far, max(load, line * n / m)
    return hops * topology.hop_latency + nbytes / n * load / topology.link_bandwidth


def _scattered(topology: Torus, group: Sequence[int], nbytes: float) -> float:
    """An all-to-all over chips that are not a box: every message routed dimension by dimension (ties the positive
    way), each link's messages counted, each message at its busiest link's share plus its hops' latency; the
    slowest message is the time. Counted with array arithmetic, axis by axis and hop by hop (what
    :func:`course_lib.cluster.linksim.simulate` does message by message, and is tested against)."""
    shape = np.array(topology.shape)
    coords = np.array([topology.coords(g) for g in group])
    n = len(group)
    src, dst = np.divmod(np.arange(n * n), n)
    src, dst = coords[src[src != dst]], coords[dst[src != dst]]
    hops = np.zeros(len(src), dtype=int)
    legs = []  # per axis: the links each message crosses on it, hop by hop, and the load of every link
    for axis, k in enumerate(topology.shape):
        here = np.concatenate([dst[:, :axis], src[:, axis:]], axis=1)  # earlier axes already done
        ahead = (dst[:, axis] - src[:, axis]) % k
        forward = ahead <= k // 2
        length = np.where(forward, ahead, k - ahead)
        others = np.delete(here, axis, axis=1)
        line = np.ravel_multi_index(others.T, np.delete(shape, axis)) if others.shape[1] else np.zeros_like(ahead)
        crossed = list(_hop_links(line, forward, src[:, axis], length, k))
        load = np.zeros((int(np.prod(np.delete(shape, axis))), 2, k), dtype=int)  # link p -> p +- 1, by p
        for _, link in crossed:
            np.add.at(load, link, 1)
        legs.append((crossed, load))
        hops += length
    busiest = np.zeros(len(src), dtype=int)
    for crossed, load in legs:
        for on, link in crossed:
            busiest[on] = np.maximum(busiest[on], load[link])
    return float(np.max(hops * topology.hop_latency + nbytes / n * busiest / topology.link_bandwidth))


def _hop_links(line: np.ndarray, forward: np.ndarray, start: np.ndarray, length: np.ndarray, k: int):
    """Hop by hop along one torus axis: which messages still move (a mask) and the link each crosses, as an index
    (line, direction, position the link leaves) into a table of that axis' links."""
    for step in range(int(length.max(initial=0))):
        on = length > step
        at = (start[on] + np.where(forward[on], step, -step)) % k
        yield on, (line[on], (~forward[on]).astype(int), at)


def _fat_tree_all_to_all(topology: FatTree, group: Sequence[int], nbytes: float) -> float:
    """Three kinds of message: inside a domain (NVLink, d-1 per GPU link), under the same leaf (the NIC, shared by
    the b + c messages leaving the domain), across leaves (also a leaf uplink, shared by L x c messages)."""
    g = topology.check_group(group)
    n, size = len(g), nbytes / len(g)
    same_domain = max(sum(topology.domain(o) == topology.domain(r) for o in g) - 1 for r in g)
    leaving_leaf = max(
        sum(topology.leaf(o) != topology.leaf(r) and topology.domain(o) != topology.domain(r) for o in g) for r in g
    )
    via_nic = n - 1 - same_domain
    per_leaf = max(sum(topology.leaf(o) == leaf for o in g) for leaf in {topology.leaf(r) for r in g})
    times = []
    if same_domain:
        times.append(2 * topology.nvlink_latency + size * same_domain / topology.nvlink_bandwidth)
    if via_nic > leaving_leaf:
        times.append(2 * topology.nic_latency + size * via_nic / topology.nic_bandwidth)
    if leaving_leaf:
        share = max(via_nic / topology.nic_bandwidth, per_leaf * leaving_leaf / topology.uplink_bandwidth)
        times.append(2 * (topology.nic_latency + topology.spine_latency) + size * share)
    return max(times, default=0.0)


def p2p(topology: Topology, src: int, dst: int, nbytes: float) -> float:
    """One message: its route's latency (hop count x hop latency on a torus) plus nbytes over its slowest link."""
    bandwidth, latency = topology.path(src, dst)
    return latency + nbytes / bandwidth if src != dst else 0.0


def cost(topology: Topology, op: str, algorithm: str, group: Sequence[int], nbytes: float) -> float:
    """The formula's time for ``algorithm`` running ``op``, or ValueError if it does not apply."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; choose one of {sorted(ALGORITHMS)}")
    if algorithm not in ALGORITHMS[op]:
        known = sorted({a for algos in ALGORITHMS.values() for a in algos})
        what = "unknown algorithm" if algorithm not in known else f"{op} has no algorithm"
        raise ValueError(f"{what} {algorithm!r}; for {op} choose one of {list(ALGORITHMS[op])}")
    if algorithm == "ring":
        return ring(topology, group, nbytes, op)
    if algorithm == "tree":
        return tree(topology, group, nbytes, op)
    if algorithm == "hierarchical":
        return hierarchical(topology, group, nbytes)
    if algorithm == "torus":
        return torus(topology, group, nbytes, op)
    if algorithm == "all_to_all":
        return all_to_all(topology, group, nbytes)
    if len(group) != 2:
        raise ValueError(f"a send has two ends (source, destination), not {len(group)}")
    return p2p(topology, group[0], group[1], nbytes)


def applicable(topology: Topology, op: str, group: Sequence[int], nbytes: float = 1.0) -> dict[str, float]:
    """The time of every algorithm that can run ``op`` on this group and topology, or ValueError with why none can."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; choose one of {sorted(ALGORITHMS)}")
    topology.check_group(group)
    times, reasons = {}, []
    for name in ALGORITHMS[op]:
        try:
            times[name] = cost(topology, op, name, group, nbytes)
        except ValueError as err:
            reasons.append(str(err))
    if not times:
        raise ValueError(f"no algorithm can run {op} here: " + "; ".join(reasons))
    return times


def choose(topology: Topology, op: str, group: Sequence[int], nbytes: float, algorithm: str | None = None) -> Choice:
    """The fastest applicable algorithm by its formula (or the forced one), its time and why."""
    if algorithm is not None:
        return Choice(cost(topology, op, algorithm, group, nbytes), algorithm, f"forced; {WHY[algorithm]}")
    times = applicable(topology, op, group, nbytes)
    best = min(times, key=times.get)
    others = ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in times.items() if name != best)
    return Choice(times[best], best, WHY[best] + (f"; beats {others}" if others else ""))
