"""The modeled cluster a run asks for, checked before anything starts: a hardware profile, GPUs per node or a
topology, a forced collective algorithm, a placement of the mesh's axes (:class:`ClusterSettings`,
:func:`check_cluster`), and the topology resolved for a number of ranks (:func:`resolve_topology`). It imports no
torch, so the command line refuses a cluster that cannot be in one line with nothing started; the harness checks the
same before it launches ranks, and :func:`course_lib.cluster.clock.replay` replays a step on what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from course_lib.cluster import collectives
from course_lib.cluster import placement as placing
from course_lib.cluster.profiles import HardwareProfile, get_profile
from course_lib.cluster.topology import FatTree, Topology, Torus, from_spec, modeled


@dataclass(frozen=True)
class ClusterSettings:
    """The modeled cluster the last step is replayed on: a hardware profile, GPUs per node or a topology, a forced
    collective algorithm, a placement of the mesh's axes."""

    hardware: str | None = None
    gpus_per_node: int | None = None
    topology: Topology | str | None = None
    algorithm: str | None = None
    placement: str | None = None


def check_cluster(
    cluster: ClusterSettings, world_size: int, axes: tuple[str, ...] = ()
) -> tuple[HardwareProfile | None, Topology | None]:
    """Refuse a modeled cluster that cannot be, saying what to add or drop; returns its hardware profile and its
    topology resolved for ``world_size`` ranks (each None when not asked for). ``axes``: the run's mesh axes, which
    a placement may name (a placement of axes the run does not have would place nothing)."""
    profile = get_profile(cluster.hardware) if cluster.hardware is not None else None
    if cluster.gpus_per_node is not None and cluster.gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, not {cluster.gpus_per_node}")
    if cluster.gpus_per_node is not None and profile is None:
        raise ValueError("gpus_per_node shapes the modeled cluster's nodes, and only a hardware profile models one: "
                         "add hardware (e.g. h100)")  # fmt: skip
    if (cluster.topology is not None or cluster.algorithm is not None) and profile is None:
        raise ValueError(
            "a topology gives the modeled clock its links; its compute comes from a hardware profile: "
            "add hardware (e.g. h100)"
        )
    if (cluster.algorithm is not None or cluster.placement is not None) and cluster.topology is None:
        what = "an algorithm is forced" if cluster.algorithm is not None else "a placement puts the mesh's axes"
        raise ValueError(f"{what} on a topology's links; add a topology (e.g. h100-superpod)")
    if cluster.placement is not None:
        named = [axis for level in placing.parse(cluster.placement) for axis in level]
        missing = [axis for axis in named if axis not in axes]
        if missing:
            raise ValueError(
                f"the placement {cluster.placement!r} names {', '.join(missing)}, which this run's mesh does not have "
                f"(its axes: {', '.join(axes) or 'none, one rank'}); place only those"
            )
    if cluster.topology is None:
        return profile, None
    if cluster.gpus_per_node is not None:
        raise ValueError("the topology says which GPUs share a node; drop gpus_per_node")
    topology, _ = resolve_topology(cluster.topology, world_size, cluster.algorithm)
    return profile, topology


def resolve_topology(
    topology: Topology | str, world_size: int, algorithm: str | None = None, gpus: Sequence[int] | None = None
) -> tuple[Topology, list[int]]:
    """(the topology, each rank's GPU) for a replay of ``world_size`` ranks, or a one-line ValueError: a world
    larger than the topology, a bad placement, an unknown algorithm. ``topology``: a Topology or a profile spec."""
    topo = modeled(from_spec(topology) if isinstance(topology, str) else topology)
    if world_size > topo.n_gpus:
        raise ValueError(
            f"{world_size} ranks do not fit {topo.name}, which has {topo.n_gpus} GPUs; use a bigger topology "
            "(e.g. h100-superpod:4 for 4 nodes, tpu-v5p:4x4x4) or fewer ranks"
        )
    placed = list(range(world_size)) if gpus is None else list(gpus)
    if len(placed) != world_size:
        raise ValueError(f"gpus places {len(placed)} ranks, not the run's {world_size}; give one GPU per rank")
    topo.check_group(placed)
    known = sorted({a for algos in collectives.ALGORITHMS.values() for a in algos})
    if algorithm is not None and algorithm not in known:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {known}")
    needs = {"torus": Torus, "hierarchical": FatTree}.get(algorithm)
    if needs is not None and not isinstance(topo, needs):
        raise ValueError(
            f"the {algorithm} algorithm runs on a {needs.__name__}, and {topo.name} is not one; choose another"
        )
    return topo, placed
