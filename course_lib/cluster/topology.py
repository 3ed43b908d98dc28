"""Network topologies as data: which links join which endpoints, at what rate and latency, and the route a message
between two GPUs takes over them.

A topology is a directed graph: GPUs are the integers 0..n-1, switches are named tuples; every cable is two
:class:`Link` s, one per direction, each with its own bandwidth (bytes/s) and latency (seconds). Two shapes:

* :class:`FatTree`: NVLink domains (a DGX node of 8 GPUs, or a GB200 NVL72 rack of 72) on one NVLink switch each,
  every GPU with its own NIC to a leaf switch, leaves joined through a spine with ``oversubscription``:1 less
  bandwidth going up than coming in (Leiserson 1985, "Fat-trees: universal networks for hardware-efficient
  supercomputing"; the spine layer is drawn as one non-blocking switch, each leaf's uplinks as one link of their
  total rate). Rail-optimized: GPU i of every node shares leaf i ("rail" i), as in NVIDIA's DGX SuperPOD; a
  message between different rails of different nodes goes up through the spine (NCCL's PXN, which first moves it
  over NVLink to the GPU on the destination's rail, is not modeled).
  Today's two-level node/network of :mod:`course_lib.cluster.clock` is a fat-tree with one leaf (:func:`two_level`).
* :class:`Torus`: chips on a 2D/3D grid with wrap-around links to their neighbours, routed dimension by dimension,
  the shorter way around each ring (ties: the positive way), as TPU pods are (Jouppi et al. 2023, "TPU v4: An
  Optically Reconfigurable Supercomputer for Machine Learning", ISCA; Google Cloud TPU v4 and v5p docs).

Every profile (:data:`PROFILES`) carries its figures and, for each, where it comes from.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from math import prod

from course_lib.cluster.profiles import PROFILES as HARDWARE
from course_lib.cluster.profiles import HardwareProfile

Endpoint = int | tuple  # a GPU's index, or a switch's name

# The most GPUs the course models: eight times the 16,384 of Llama 3 405B, the largest training run with a published
# layout (a cluster of 100,000-200,000 GPUs has been built, but no layout trained on one is published). The planner
# lists every group of every layout it tries and a topology is built link by link, each about 10-20 us a GPU on one
# core: 131,072 GPUs plan in about 30 s (benchmarks/size_refusals.py); ten times more would take minutes.
MAX_GPUS = 131_072


def check_gpus(gpus: int, topology: str | None = None) -> None:
    """Refuse more GPUs than :data:`MAX_GPUS`, a cluster's for the planner or, given its name, a ``topology``'s,
    before anything is counted or built."""
    if gpus <= MAX_GPUS:
        return
    if topology is None:
        raise ValueError(
            f"{gpus:,} GPUs is more than the {MAX_GPUS:,} the planner takes (eight times Llama 3's 16,384, the "
            "largest run with a published layout; each GPU is counted in every group); use fewer GPUs"
        )
    raise ValueError(
        f"{topology} would have {gpus:,} GPUs, more than the {MAX_GPUS:,} a topology is built with (link by link; "
        "eight times Llama 3's 16,384); use fewer nodes or racks, or a smaller shape"
    )


@dataclass(frozen=True)
class Link:
    """One direction of a cable: the bytes/s it carries and the seconds a message spends crossing it."""

    src: Endpoint
    dst: Endpoint
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Where:
    """Where a group of GPUs sits: in words, whether that is the topology's fast place for a chatty group (one
    NVLink domain; a box of neighbouring chips on a torus), the slowest link a route between two members
    crosses (bytes/s, each way) and the most links such a route crosses (for a torus group that is not a box, the
    sum over axes of its two farthest members on each: a bound)."""

    what: str
    fast: bool
    slowest_link: float
    hops: int


@dataclass(kw_only=True)
class Topology:
    """GPUs 0..n_gpus-1 and switches joined by directed links; subclasses build ``links`` and say how to route."""

    name: str
    figures: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    n_gpus: int = field(default=0, init=False)
    links: dict[tuple[Endpoint, Endpoint], Link] = field(default_factory=dict, init=False, repr=False)

    def _add(self, a: Endpoint, b: Endpoint, bandwidth: float, latency: float) -> None:
        """A cable between ``a`` and ``b``: one link each way."""
        self.links[(a, b)] = Link(a, b, bandwidth, latency)
        self.links[(b, a)] = Link(b, a, bandwidth, latency)

    def hops(self, a: int, b: int) -> list[tuple[Endpoint, Endpoint]]:
        """The endpoints a message from GPU ``a`` to GPU ``b`` crosses, as (from, to) pairs."""
        raise NotImplementedError

    def route(self, a: int, b: int) -> list[Link]:
        """The links a message from GPU ``a`` to GPU ``b`` crosses, in order."""
        self.check_group([a, b])
        return [self.links[hop] for hop in self.hops(a, b)]

    def path(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth of the slowest link, summed latency) of the route from ``a`` to ``b``, alone on the network."""
        links = self.route(a, b)
        return min((lk.bandwidth for lk in links), default=float("inf")), sum(lk.latency for lk in links)

    def where(self, group: Sequence[int]) -> Where:
        """Where ``group`` sits on this topology (:class:`Where`), from its structure, not pair by pair."""
        raise NotImplementedError

    def levels(self) -> list[tuple[str, int]]:
        """The topology's levels, innermost first, as (name, GPUs along it): where a mesh's axes can be placed
        (:mod:`course_lib.cluster.placement`)."""
        raise NotImplementedError

    def check_group(self, group: Sequence[int]) -> list[int]:
        """The group as a list, or a one-line ValueError if a rank is outside the topology or repeated."""
        ranks = list(group)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.n_gpus)]
        if bad:
            raise ValueError(
                f"ranks {bad} do not fit {self.name}, which has GPUs 0..{self.n_gpus - 1}; "
                "use a smaller group or a bigger topology"
            )
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a group lists a rank twice: {ranks}; list each GPU once")
        return ranks


@dataclass(kw_only=True)
class FatTree(Topology):
    """NVLink domains under leaf switches under a spine (module docstring); bandwidths per GPU and direction."""

    domains: int
    gpus_per_domain: int
    nvlink_bandwidth: float
    nvlink_latency: float  # GPU <-> NVLink switch; a GPU-to-GPU path in a domain crosses two
    nic_bandwidth: float
    nic_latency: float  # GPU <-> leaf
    spine_latency: float  # leaf <-> spine
    domains_per_leaf: int  # whose NICs share a leaf (per rail when rail_optimized)
    oversubscription: float = 1.0
    rail_optimized: bool = False

    def __post_init__(self) -> None:
        if self.domains < 1 or self.gpus_per_domain < 1 or self.domains_per_leaf < 1:
            raise ValueError(f"{self.name}: domains, GPUs per domain and domains per leaf must be at least 1")
        if self.domains % self.domains_per_leaf:
            raise ValueError(
                f"{self.name}: {self.domains} domains do not fill leaves of {self.domains_per_leaf}; "
                "use a multiple of domains_per_leaf"
            )
        if self.oversubscription < 1:
            raise ValueError(f"{self.name}: oversubscription must be at least 1 (1 = full bisection)")
        self.n_gpus = self.domains * self.gpus_per_domain
        check_gpus(self.n_gpus, self.name)
        for g in range(self.n_gpus):
            self._add(g, ("nvswitch", self.domain(g)), self.nvlink_bandwidth, self.nvlink_latency)
            self._add(g, self.leaf(g), self.nic_bandwidth, self.nic_latency)
        for leaf in {self.leaf(g) for g in range(self.n_gpus)}:
            self._add(leaf, ("spine",), self.uplink_bandwidth, self.spine_latency)

    @property
    def hosts_per_leaf(self) -> int:
        """NICs under one leaf: one per node on a rail, or every GPU of its nodes."""
        return self.domains_per_leaf * (1 if self.rail_optimized else self.gpus_per_domain)

    @property
    def uplink_bandwidth(self) -> float:
        """A leaf's bandwidth to the spine, each way: its hosts' NICs together over the oversubscription."""
        return self.hosts_per_leaf * self.nic_bandwidth / self.oversubscription

    def domain(self, gpu: int) -> int:
        return gpu // self.gpus_per_domain

    def leaf(self, gpu: int) -> tuple:
        rail = gpu % self.gpus_per_domain if self.rail_optimized else 0
        return ("leaf", rail, self.domain(gpu) // self.domains_per_leaf)

    def hops(self, a: int, b: int) -> list[tuple[Endpoint, Endpoint]]:
        if a == b:
            return []
        if self.domain(a) == self.domain(b):
            switch = ("nvswitch", self.domain(a))
            return [(a, switch), (switch, b)]
        if self.leaf(a) == self.leaf(b):
            return [(a, self.leaf(a)), (self.leaf(a), b)]
        return [(a, self.leaf(a)), (self.leaf(a), ("spine",)), (("spine",), self.leaf(b)), (self.leaf(b), b)]

    def where(self, group: Sequence[int]) -> Where:
        ranks = self.check_group(group)
        per_domain: dict[int, list[int]] = {}
        for r in ranks:
            per_domain.setdefault(self.domain(r), []).append(r)
        if len(per_domain) == 1:
            return Where(f"inside one NVLink domain of {self.gpus_per_domain} GPUs", True, self.nvlink_bandwidth, 2)
        counts = sorted({len(m) for m in per_domain.values()})
        spread = f"across {len(per_domain)} NVLink domains ({'-'.join(map(str, counts))} of the group in each)"
        # two members in different domains meet at their leaf if they share one, else through the spine: with
        # members in two domains or more, some such pair is on different leaves as soon as the group is
        if len({self.leaf(r) for r in ranks}) > 1:
            return Where(spread + ", through the spine", False, min(self.nic_bandwidth, self.uplink_bandwidth), 4)
        return Where(spread + ", under one leaf switch", False, self.nic_bandwidth, 2)

    def levels(self) -> list[tuple[str, int]]:
        return [("NVLink domain", self.gpus_per_domain), ("across domains", self.domains)]


@dataclass(kw_only=True)
class Torus(Topology):
    """Chips on a grid of ``shape`` with wrap-around links to their neighbours (a ring of two has one cable)."""

    shape: tuple[int, ...]
    n_gpus: int  # must be the shape's product
    link_bandwidth: float  # per link and direction
    hop_latency: float

    def __post_init__(self) -> None:
        if not self.shape or any(k < 1 for k in self.shape):
            raise ValueError(f"{self.name}: a torus shape is a tuple of sizes of at least 1, not {self.shape}")
        if prod(self.shape) != self.n_gpus:
            raise ValueError(
                f"{self.name}: a {'x'.join(map(str, self.shape))} torus has {prod(self.shape)} chips, not "
                f"{self.n_gpus}; make the shape's product the GPU count"
            )
        check_gpus(self.n_gpus, self.name)
        for g in range(self.n_gpus):
            for axis, k in enumerate(self.shape):
                if k > 1:
                    self._add(g, self.neighbour(g, axis, 1), self.link_bandwidth, self.hop_latency)

    def coords(self, gpu: int) -> tuple[int, ...]:
        """Row-major coordinates (the last axis varies fastest)."""
        return self._coords[gpu]

    @cached_property
    def _coords(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*(range(k) for k in self.shape)))

    def gpu(self, coords: Sequence[int]) -> int:
        index = 0
        for c, k in zip(coords, self.shape, strict=True):
            index = index * k + c % k
        return index

    def neighbour(self, gpu: int, axis: int, step: int) -> int:
        c = list(self.coords(gpu))
        c[axis] += step
        return self.gpu(c)

    def hops(self, a: int, b: int) -> list[tuple[Endpoint, Endpoint]]:
        """Dimension-order routing: axis 0 first; on each ring the shorter way, the positive way on a tie."""
        out, here = [], a
        for axis, k in enumerate(self.shape):
            ahead = (self.coords(b)[axis] - self.coords(here)[axis]) % k
            step, count = (1, ahead) if ahead <= k // 2 else (-1, k - ahead)
            for _ in range(count):
                nxt = self.neighbour(here, axis, step)
                out.append((here, nxt))
                here = nxt
        return out

    def box(self, group: Sequence[int]) -> dict[int, int]:
        """The group's extent on each axis it spans, if it is a box: on every axis either the whole ring or a run of
        m neighbouring chips short enough that every route between two of them stays inside the run (2(m-1) < k:
        no pair is half-way round, so dimension-order routing never leaves it); the other axes fixed. A group that
        spans whole rings only is a sub-torus. ValueError for any other group."""
        ranks = self.check_group(group)
        coords = [self.coords(r) for r in ranks]
        extents = {}
        for axis, k in enumerate(self.shape):
            held = {c[axis] for c in coords}
            if len(held) > 1:
                m = len(held)
                run = any(held == {(s + i) % k for i in range(m)} for s in held)
                if m < k and not (run and 2 * (m - 1) < k):
                    raise ValueError(
                        f"group {ranks[:8]}{'...' if len(ranks) > 8 else ''} is not a box of {self.name}: on axis "
                        f"{axis} it holds {sorted(held)[:8]}, neither the whole ring of {k} nor a run of fewer than "
                        f"{k // 2 + 1} neighbours; place it on whole rings or short runs"
                    )
                extents[axis] = m
        if len(ranks) != prod(extents.values()):
            raise ValueError(
                f"group {ranks[:8]}{'...' if len(ranks) > 8 else ''} is not a box of {self.name}: it has "
                f"{len(ranks)} chips, not the {prod(extents.values())} of its extents {extents}; take every chip "
                "of the rings and runs it spans"
            )
        return extents

    def where(self, group: Sequence[int]) -> Where:
        ranks = self.check_group(group)
        try:
            extents = self.box(ranks)
        except ValueError:
            extents = None
        coords = [self.coords(r) for r in ranks]
        hops = 0
        for axis, k in enumerate(self.shape):
            held = sorted({c[axis] for c in coords})
            hops += max((min((b - a) % k, (a - b) % k) for a in held for b in held), default=0)
        if extents is None:
            return Where(f"on {len(ranks)} scattered chips, not a box of neighbours", False, self.link_bandwidth, hops)
        if not extents:
            return Where("on one chip", True, float("inf"), 0)
        rings = [
            f"{'a ring of' if m == self.shape[a] else 'a run of'} {m} on axis {a}" for a, m in sorted(extents.items())
        ]
        return Where(f"on a box of neighbouring chips ({' x '.join(rings)})", True, self.link_bandwidth, hops)

    def levels(self) -> list[tuple[str, int]]:
        return [(f"torus axis {axis}", self.shape[axis]) for axis in reversed(range(len(self.shape)))]


def two_level(profile: HardwareProfile, nodes: int) -> FatTree:
    """Today's modeled clock as a topology: nodes of ``profile.gpus_per_node`` on NVLink under one switch, paths
    with the profile's latencies (half on each of a path's two links)."""
    figures = {
        "gpus_per_domain": profile.gpus_per_node,
        "nvlink_bandwidth": profile.intra_bandwidth,
        "nvlink_latency": profile.intra_latency_s / 2,
        "nic_bandwidth": profile.inter_bandwidth,
        "nic_latency": profile.inter_latency_s / 2,
    }
    source = f"course_lib.cluster.profiles.PROFILES[{profile.name!r}]: " + "; ".join(profile.sources)
    return FatTree(
        name=f"{profile.name} x{nodes} (two-level)",
        domains=nodes,
        spine_latency=0.0,
        domains_per_leaf=nodes,
        figures=figures,
        sources=dict.fromkeys(figures, source),
        **figures,
    )


def h100_two_level(nodes: int = 2) -> FatTree:
    """The ``h100`` hardware profile's nodes, as the modeled clock sees them today."""
    return two_level(HARDWARE["h100"], nodes)


def _profile(name: str, domains: int, figures: dict, sources: dict, rail_optimized: bool = False) -> FatTree:
    """A fat-tree profile: its ``figures`` (the FatTree's sizes and rates) and a source for each."""
    return FatTree(
        name=name, domains=domains, rail_optimized=rail_optimized, figures=figures, sources=sources, **figures
    )


_LATENCY_NOTE = (
    "assumed, not a published per-link figure: of the order of NCCL-tests small-message times, as the hardware "
    "profiles' latencies"
)


def h100_superpod(nodes: int = 4) -> FatTree:
    """DGX H100 nodes on a rail-optimized, non-blocking InfiniBand NDR fat-tree, as in a DGX SuperPOD: scalable
    units of 32 nodes, or, for a node count that is not a multiple of 32, of its largest divisor that divides 32."""
    per_leaf = math.gcd(nodes, 32)
    figures = {
        "gpus_per_domain": 8,
        "nvlink_bandwidth": 450e9,
        "nic_bandwidth": 50e9,
        "domains_per_leaf": per_leaf,  # a leaf per rail per scalable unit
        "oversubscription": 1.0,
        "nvlink_latency": 1e-6,
        "nic_latency": 2.5e-6,
        "spine_latency": 0.5e-6,
    }
    sources = {
        "gpus_per_domain": "NVIDIA DGX H100 user guide: 8x H100 SXM5 per system on NVLink 4 / NVSwitch",
        "nvlink_bandwidth": "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU, both directions "
        "together, i.e. 450 GB/s each way",
        "nic_bandwidth": "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s NDR InfiniBand for the compute "
        "fabric, one per GPU (50 GB/s each way)",
        "domains_per_leaf": "NVIDIA DGX SuperPOD (H100) reference architecture: scalable units of 32 DGX H100, one "
        "leaf per rail (GPU index) per unit, rail-optimized (NVIDIA docs, 'rail-optimized network topology'); "
        "the 32 could not be checked against a stored copy of the reference architecture",
        "oversubscription": "NVIDIA HGX/DGX reference architectures: the compute fabric is a 'full non-blocking "
        "fat tree' (docs.nvidia.com/enterprise-reference-architectures, Networking Physical Topologies)",
        "nvlink_latency": _LATENCY_NOTE,
        "nic_latency": _LATENCY_NOTE,
        "spine_latency": _LATENCY_NOTE,
    }
    return _profile(f"h100-superpod x{nodes}", nodes, figures, sources, rail_optimized=True)


def gb200_nvl72(racks: int = 2) -> FatTree:
    """GB200 NVL72 racks: 72 GPUs in one NVLink 5 domain each, one 400 Gb/s InfiniBand NIC per GPU between racks."""
    figures = {
        "gpus_per_domain": 72,
        "nvlink_bandwidth": 900e9,
        "nic_bandwidth": 50e9,
        "domains_per_leaf": racks,
        "oversubscription": 1.0,
        "nvlink_latency": 1e-6,
        "nic_latency": 2.5e-6,
        "spine_latency": 0.5e-6,
    }
    sources = {
        "gpus_per_domain": "NVIDIA GB200 NVL72 product page: 36 Grace CPUs and 72 Blackwell GPUs in one NVLink "
        "domain per rack",
        "nvlink_bandwidth": "NVIDIA GB200 NVL72 product page: fifth-generation NVLink, 1.8 TB/s GPU-to-GPU per GPU "
        "(both directions together; 130 TB/s per rack = 72 x 1.8), i.e. 900 GB/s each way",
        "nic_bandwidth": "MLCommons inference v6.1 results, Crusoe GB200-NVL72 system description: 4x ConnectX-7 "
        "per 4-GPU tray, i.e. one 400 Gb/s NIC per GPU (800 Gb/s ConnectX-8 comes with GB300)",
        "domains_per_leaf": "assumed: rail-optimized as NVIDIA's reference architectures, GPU i of every rack "
        "modeled on rail leaf i (a real leaf's port count caps how many racks share it)",
        "oversubscription": "assumed non-blocking, as NVIDIA's reference architectures build the compute fabric",
        "nvlink_latency": _LATENCY_NOTE,
        "nic_latency": _LATENCY_NOTE,
        "spine_latency": _LATENCY_NOTE,
    }
    return _profile(f"gb200-nvl72 x{racks}", racks, figures, sources, rail_optimized=True)


def ethernet_2to1(nodes: int = 4) -> FatTree:
    """8-GPU NVLink nodes, one 400 GbE RoCE NIC per GPU, two nodes per top-of-rack switch, 2:1 oversubscribed above."""
    figures = {
        "gpus_per_domain": 8,
        "nvlink_bandwidth": 450e9,
        "nic_bandwidth": 50e9,
        "domains_per_leaf": 2,
        "oversubscription": 2.0,
        "nvlink_latency": 1e-6,
        "nic_latency": 4e-6,
        "spine_latency": 1e-6,
    }
    sources = {
        "gpus_per_domain": "HGX H100 8-GPU board (NVIDIA H100 datasheet)",
        "nvlink_bandwidth": "NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s both directions together",
        "nic_bandwidth": "NVIDIA HGX AI factory reference architecture: one 400 Gb/s BlueField-3 SuperNIC per GPU",
        "domains_per_leaf": "assumed, an illustrative build: 16 GPU ports down per top-of-rack switch",
        "oversubscription": "assumed, an illustrative build: 2:1, a common way to save spine switches; no single "
        "published cluster",
        "nvlink_latency": _LATENCY_NOTE,
        "nic_latency": _LATENCY_NOTE + " (RoCE a little slower than InfiniBand: assumed)",
        "spine_latency": _LATENCY_NOTE,
    }
    return _profile(f"ethernet-2to1 x{nodes}", nodes, figures, sources)


def tpu_v5p(shape: tuple[int, ...] = (4, 4, 4)) -> Torus:
    """A TPU v5p slice: a 3D torus of chips (one 4x4x4 cube by default), six ICI links per chip. A shape of one or
    two axes builds a ring or a 2-D torus of the same chips, for pictures (:mod:`course_lib.ui.network_pictures`);
    a run or a plan models only real slices (:func:`modeled`)."""
    figures = {"link_bandwidth": 100e9, "hop_latency": 1e-6}
    sources = {
        "link_bandwidth": "Google Cloud TPU v5p docs: bidirectional ICI bandwidth 1200 GB/s per chip, 3D torus "
        "(all 4x4x4 and larger slices are full tori); spread over a chip's six links, 200 GB/s per link both ways "
        "together, 100 GB/s each way (the split is ours: the docs give the per-chip total)",
        "hop_latency": "assumed, not published: about a microsecond per ICI hop",
    }
    return Torus(
        name=f"tpu-v5p {'x'.join(map(str, shape))}",
        shape=tuple(shape),
        n_gpus=prod(shape),
        figures=figures,
        sources=sources,
        **figures,
    )


def modeled(topology: Topology) -> Topology:
    """``topology`` if a run or a plan may be modeled on it; a TPU v5p torus of other than three axes (a picture's
    simplification, no machine) refused in one line. A small slice may have sides of 1 or 2 (2x2x1)."""
    if isinstance(topology, Torus) and topology.name.startswith("tpu-v5p") and len(topology.shape) != 3:
        sides = "x".join(map(str, topology.shape))
        raise ValueError(
            f"a TPU v5p slice is a 3-D torus: give three sides, e.g. tpu-v5p:4x4x4 or tpu-v5p:{sides}x1, not {sides}"
        )
    return topology


PROFILES: dict[str, Callable[..., Topology]] = {
    "h100-superpod": h100_superpod,
    "gb200-nvl72": gb200_nvl72,
    "tpu-v5p": tpu_v5p,
    "ethernet-2to1": ethernet_2to1,
    "h100-two-level": h100_two_level,
}


def get_topology(name: str, **size) -> Topology:
    """A profile by name, sized by its builder's keyword (``nodes``, ``racks`` or ``shape``)."""
    if name not in PROFILES:
        raise ValueError(f"unknown topology {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name](**size)


def for_gpus(spec: str, gpus: int) -> Topology:
    """A profile from ``NAME:SIZE`` as :func:`from_spec` reads it, or ``NAME`` sized to ``gpus``: that many GPUs
    in whole nodes or racks, or, for a torus, the most cube-like shape of sides that are multiples of 4 (as TPU
    v5p slices are), else of any sides (:func:`_cube_like`)."""
    if ":" in spec or spec not in PROFILES:
        return from_spec(spec)
    check_gpus(gpus, spec)
    keyword = next(iter(inspect.signature(PROFILES[spec]).parameters))
    if keyword == "shape":
        return get_topology(spec, shape=_cube_like(gpus))
    per = get_topology(spec).gpus_per_domain
    if gpus % per:
        raise ValueError(f"{gpus} GPUs are not whole {keyword} of {per} on {spec}: give a multiple of {per}")
    return get_topology(spec, **{keyword: gpus // per})


def _cube_like(n: int) -> tuple[int, int, int]:
    """Sides c >= b >= a with a b c = n, multiples of 4 if some are, the ratio c/a the smallest; the shortest
    ring last, the axis consecutive chips run along, so a small chatty group (TP) is a whole ring."""
    shapes = [
        (a, b, n // (a * b))
        for a in range(1, n + 1)
        if n % a == 0
        for b in range(a, n // a + 1)
        if (n // a) % b == 0 and n // (a * b) >= b
    ]
    fours = [s for s in shapes if all(k % 4 == 0 for k in s)]
    a, b, c = min(fours or shapes, key=lambda s: (s[2] / s[0], s))
    return c, b, a


def from_spec(spec: str) -> Topology:
    """A profile from ``NAME`` (its default size) or ``NAME:SIZE``, SIZE its nodes or racks (``h100-superpod:2``)
    or a torus shape (``tpu-v5p:2x4x4``), as the command line's ``--topology`` gives it."""
    name, _, size = spec.partition(":")
    if not size:
        return get_topology(name)
    if name not in PROFILES:
        return get_topology(name)  # the unknown-name error
    keyword = next(iter(inspect.signature(PROFILES[name]).parameters))
    try:
        numbers = tuple(int(k) for k in size.split("x"))
    except ValueError:
        numbers = ()
    if not numbers or (keyword != "shape" and len(numbers) != 1):
        example = "4x4x4" if keyword == "shape" else "4"
        raise ValueError(f"bad size {size!r} in topology {spec!r}: give {keyword}, e.g. {name}:{example}")
    return get_topology(name, **{keyword: numbers if keyword == "shape" else numbers[0]})
