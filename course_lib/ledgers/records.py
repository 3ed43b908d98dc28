"""What the ledgers record, as plain data without torch: a collective's record (:class:`CommRecord`) and the bytes
its ring algorithm sends (:func:`ring_factor`; the table is in :mod:`course_lib.ledgers.comm`), and a rank's timeline
and program (:class:`Event`, :class:`Compute`, :class:`Issue`, :class:`Wait`; :mod:`course_lib.ledgers.trace`). The
modeled clock (:mod:`course_lib.cluster.clock`) and the planner read them, so they answer without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_factor(op: str, n: int) -> float:
    """Bytes a rank sends per byte of S for ``op`` in a group of ``n`` ranks (see the module table)."""
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0 if n > 1 else 0.0,
        "send": 1.0,
        "recv": 0.0,
        "barrier": 0.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(factors)}")
    return factors[op]


@dataclass
class CommRecord:
    """One collective or point-to-point call on one rank."""

    op: str
    group: str
    group_size: int
    ranks: tuple[int, ...]  # the group's members, as global ranks
    tensor_bytes: int
    sent_bytes: float
    start: float
    end: float
    async_op: bool = False
    peer: int | None = None
    tags: dict = field(default_factory=dict)
    through_host: bool = False  # its tensors were copied to host memory and back (see the module's docstring)
    number: int = 0  # its number among this rank's calls on the group (of this name), from 1
    # Its number among this rank's collectives on the group, point-to-point calls not counted (0 for send and recv):
    # every member of a group calls the group's collectives in one order, so one turn on two members is one
    # collective, where their numbers may differ (a pipeline's middle stage sends and receives twice as often).
    turn: int = 0
    given: str = ""  # what this rank gave it that every member must give alike (:func:`given`)


# Ops whose tensors every rank of the group must give alike: the same dtype and shape (all_to_all: the same dtype
# and row shape; its rows may be split unevenly). send and recv pair with a peer, not with the group.


KINDS = ("forward", "backward", "weight_grad", "recompute", "optimizer", "compute", "comm", "idle")


@dataclass
class Event:
    """One interval on one rank's timeline (seconds since the run's epoch)."""

    rank: int
    kind: str
    name: str
    start: float
    end: float
    tags: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Compute:
    """Work between two communication points: ``flops`` of matrix products (torch's FLOP formulas) and
    ``elementwise`` operations counted as one FLOP per output element (a floor for the rest)."""

    kind: str
    start: float
    end: float
    flops: int = 0
    elementwise: int = 0
    tags: dict = field(default_factory=dict)


@dataclass
class Issue:
    """The rank issued its comm record number ``record``."""

    record: int


@dataclass
class Wait:
    """The rank blocked until its comm record number ``record`` was done."""

    record: int
