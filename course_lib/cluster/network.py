"""The links the planner times its groups' traffic on (:mod:`course_lib.planner`).

By default, the modeled clock's two levels (lessons 00 and 06): nodes of ``gpus_per_node`` GPUs with the hardware
profile's NVLink and network rates, every collective a ring on its group's slowest link, as
:func:`course_lib.cluster.clock.collective_time` times it, the planner's rank-0 groups standing for all of their axis
(with nodes of a size that divides the groups, or that they divide, every group of an axis sits alike).

With a ``topology`` (:mod:`course_lib.cluster.topology`), rank r on GPU r (the planner numbers ranks as the mesh does,
TP innermost, so the default placement of :mod:`course_lib.cluster.placement`), every group of the axis is timed by
:func:`course_lib.cluster.collectives.choose` on its GPUs, the algorithm NCCL would pick, and the slowest group stands
for the axis: on a 72-GPU NVL72 rack an EP group of 64 fits rack 0, but the next one straddles two racks, and every
group waits for its slowest peer. Groups alike up to the names of their domains and leaves (a fat-tree), or up to
a shift (a torus), cost the same and are timed once. The hardware profile still gives compute and memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from course_lib.cluster import collectives
from course_lib.cluster.clock import collective_time, link
from course_lib.cluster.profiles import HardwareProfile
from course_lib.cluster.topology import FatTree, Topology, Torus, Where
from course_lib.ledgers.records import ring_factor

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass(frozen=True)
class Network:
    """A hardware profile's nodes, or a topology's links (module docstring); ``time`` and ``where`` of an axis
    take all of its groups, as lists of ranks."""

    profile: HardwareProfile
    gpus_per_node: int
    topology: Topology | None = None
    _timed: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    _shapes: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def domain(self) -> int:
        """GPUs a tensor-parallel group may span and stay on the fast links: a node; a topology's NVLink domain
        (a node, an NVL72 rack); a whole torus, every chip of which is on the same links."""
        if isinstance(self.topology, FatTree):
            return self.topology.gpus_per_domain
        if isinstance(self.topology, Torus):
            return self.topology.n_gpus
        return self.gpus_per_node

    def time(self, op: str, groups: tuple[tuple[int, ...], ...], size: float) -> float:
        """Seconds for ``op`` on a tensor of ``size`` bytes (comm.py's S; a send: the message, passed along each
        group in order) on the axis' slowest group."""
        if self.topology is None:
            bandwidth, latency, _ = link(self.profile, groups[0], self.gpus_per_node)
            n = len(groups[0])
            return collective_time(op, ring_factor(op, n) * size, n, bandwidth, latency)
        return max(self._time_one(op, g, size) for g in self._distinct(groups))

    def where(self, groups: tuple[tuple[int, ...], ...]) -> dict:
        """Where the axis' groups sit: their size, whether one spans nodes (leaves the fast domain) and its
        slowest link's bandwidth per GPU; on a topology also the worst group's :class:`Where` in words and hops."""
        if self.topology is None:
            bandwidth, _, spans = link(self.profile, groups[0], self.gpus_per_node)
            return {"size": len(groups[0]), "spans_nodes": spans, "bandwidth": bandwidth}
        worst = min((self.topology.where(g) for g in self._distinct(groups)), key=_rank_where)
        return {
            "size": len(groups[0]),
            "spans_nodes": not worst.fast,
            "bandwidth": worst.slowest_link,
            "where": worst.what,
            "hops": worst.hops,
        }

    def _time_one(self, op: str, group: Sequence[int], size: float) -> float:
        key = (op, self._shape(group), size)
        if key not in self._timed:
            if op == "send":
                pairs = zip(group, group[1:], strict=False)
                self._timed[key] = max((collectives.p2p(self.topology, a, b, size) for a, b in pairs), default=0.0)
            else:
                self._timed[key] = collectives.choose(self.topology, op, group, size).time_s
        return self._timed[key]

    def _distinct(self, groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
        """One group of each shape (:meth:`_shape`), found once per axis' groups."""
        if groups not in self._shapes:
            seen: dict[tuple, Sequence[int]] = {}
            for g in groups:
                seen.setdefault(self._shape(g), g)
            self._shapes[groups] = list(seen.values())
        return self._shapes[groups]

    def _shape(self, group: Sequence[int]) -> tuple:
        """The group up to what changes no cost: on a fat-tree, which members share a domain and which a leaf
        (every domain, and every leaf, alike); on a torus, the members' coordinates shifted to start at 0."""
        topo = self.topology
        if isinstance(topo, Torus):
            origin = topo.coords(group[0])
            return tuple(
                tuple((c - o) % k for c, o, k in zip(topo.coords(g), origin, topo.shape, strict=True)) for g in group
            )
        domains: dict[int, int] = {}
        leaves: dict[tuple, int] = {}
        return tuple(
            (domains.setdefault(topo.domain(g), len(domains)), leaves.setdefault(topo.leaf(g), len(leaves)))
            for g in group
        )


def _rank_where(w: Where) -> tuple:
    """Worst first: off the fast place, the slowest link, the most hops."""
    return (w.fast, w.slowest_link, -w.hops)
