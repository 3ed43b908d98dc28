"""The comm ledger: every collective of the course goes through this thin layer and is recorded.

Each call records its op, group (the axis name), the tensor's size S in bytes, the bytes this rank puts on the
wire under the ring algorithm as NCCL's performance notes count them ("bus bytes"), its wall start and end, and the
tags in force (step, phase, layer, microbatch). The ring factors, for a group of n ranks:

=================  ===============  ==========================================
op                 bytes sent       S is
=================  ===============  ==========================================
all_reduce         2(n-1)/n * S     the tensor reduced
reduce_scatter     (n-1)/n * S      the full (unscattered) input
all_gather         (n-1)/n * S      the full (gathered) output
all_to_all         (n-1)/n * S      the input (exactly: the rows sent to others)
broadcast          S                the tensor (NCCL counts S for every rank)
send / recv        S / 0            the message
=================  ===============  ==========================================

(Patarasuk & Yuan 2009 for the ring all-reduce; NCCL-tests "PERFORMANCE.md" for bus bandwidth.)

gloo moves host memory: of CUDA tensors it takes only all-reduce and broadcast (PyTorch's backend table), and NCCL
refuses two ranks on one GPU. So that several gloo ranks can compute on one GPU, a collective over gloo on tensors
outside host memory goes through host copies: the tensors are copied to the host, the collective runs on the
copies, and the copies it wrote are copied back when it completes (at ``wait()`` for an async one). The record says
so (``through_host``). :data:`THROUGH_HOST` sends every collective that way, on the CPU too, which is how the
path is tested without a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from course_lib.ledgers import trace
from course_lib.ledgers.records import CommRecord, ring_factor

ReduceOp = dist.ReduceOp
Group = dist.ProcessGroup | None  # None: the whole world
THROUGH_HOST = False  # True: every collective's tensors go through host copies, as CUDA tensors do under gloo


_ALIKE_ON_EVERY_RANK = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier")


# told (what the rank does, in words; the collective's record; whether the rank is now blocked in it)
StatusSink = Callable[[str, CommRecord, bool], None]


class _Ledger:
    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.calls: dict[str, int] = {}  # collectives this rank has issued on each group, by the group's name
        self.turns: dict[str, int] = {}  # the same without the point-to-point calls (CommRecord.turn)
        self.status_sink: StatusSink | None = None


_LEDGER = _Ledger()
_GROUP_NAMES: dict = {}
_GROUP_RANKS: dict = {}  # global ranks of each group, looked up once instead of at every collective


def reset() -> None:
    """Forget this rank's records (the launcher calls it when a rank starts)."""
    _LEDGER.records = []
    _LEDGER.calls = {}
    _LEDGER.turns = {}


def records() -> list[CommRecord]:
    """This rank's comm records so far, in call order."""
    return list(_LEDGER.records)


def set_status_sink(sink: StatusSink | None) -> None:
    """Have ``sink`` told which collective this rank enters, waits for and leaves: in words, with its
    :class:`CommRecord` (op, group, members, number, turn, what the rank gave) and whether the rank is blocked in
    it (the launcher's hang watchdog and its reports, which compare what the ranks gave one collective)."""
    _LEDGER.status_sink = sink


def new_group(ranks: Sequence[int], name: str) -> dist.ProcessGroup:
    """A process group over ``ranks`` whose records carry the axis ``name`` (every rank must call it)."""
    group = dist.new_group(list(ranks))
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        _GROUP_NAMES[group] = name
        _GROUP_RANKS[group] = tuple(ranks)
    return group


def group_name(group: Group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _GROUP_NAMES.get(group, "group")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def given(op: str, tensors: Sequence[torch.Tensor]) -> str:
    """What a rank gives ``op`` that every rank of the group must give alike, in words: the dtype and shape of the
    tensor it sends (the last of ``tensors``: the input of reduce_scatter, all_gather and all_to_all), with ``*``
    for all_to_all's rows; ``""`` for barrier and for the point-to-point ops, whose peers need not match."""
    if op not in _ALIKE_ON_EVERY_RANK or not tensors:
        return ""
    sent = tensors[-1]
    shape = [str(size) for size in sent.shape]
    if op == "all_to_all" and shape:
        shape[0] = "*"
    return f"{str(sent.dtype).removeprefix('torch.')} [{', '.join(shape)}]"


class Handle:
    """An async collective in flight; :meth:`wait` blocks until it is done, copies back what went through host
    memory and closes its ledger record."""

    def __init__(self, work, record: CommRecord, index: int, describe: str, copy_back) -> None:
        self._work = work
        self._record = record
        self._index = index
        self._describe = describe
        self._copy_back = copy_back
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        trace.waiting(self._index)
        _tell(f"waiting for {self._describe}", self._record, blocked=True)
        self._work.wait()
        self._copy_back()
        _finish(self._record, self._describe)
        self._done = True


def _through_host(group: Group, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a collective on ``tensors`` goes through host copies: over gloo, with a tensor outside host memory
    (or always, with :data:`THROUGH_HOST`)."""
    if not tensors:
        return False
    return THROUGH_HOST or (
        any(t.device.type != "cpu" for t in tensors) and dist.get_backend(group) == dist.Backend.GLOO
    )


def _nothing_to_copy_back() -> None:
    """The copy-back of a collective that ran on its own tensors."""


def _staged(
    group: Group, tensors: Sequence[torch.Tensor], written: Sequence[int]
) -> tuple[Sequence[torch.Tensor], Callable[[], None]]:
    """The tensors the collective runs on, and what copies its results back: host copies of ``tensors`` when they
    go through host memory, the ``written`` ones copied back into the originals; else ``tensors`` themselves."""
    if not _through_host(group, tensors):
        return tensors, _nothing_to_copy_back
    copies = [t.detach().to("cpu", copy=True) for t in tensors]

    def copy_back() -> None:
        with torch.no_grad():
            for i in written:
                tensors[i].copy_(copies[i])

    return copies, copy_back


def _tell(status: str, rec: CommRecord, blocked: bool) -> None:
    if _LEDGER.status_sink is not None:
        _LEDGER.status_sink(status, rec, blocked)


def _finish(rec: CommRecord, describe: str) -> None:
    rec.end = trace.now()
    trace.record("comm", rec.op, rec.start, rec.end, rec.tags, group=rec.group, bytes=rec.sent_bytes)
    _tell(f"finished {describe}", rec, blocked=False)


def _call(
    op: str,
    group: dist.ProcessGroup | None,
    tensor_bytes: int,
    issue: Callable[..., object],
    async_op: bool,
    tensors: Sequence[torch.Tensor] = (),
    written: Sequence[int] = (),
    peer: int | None = None,
    sent_bytes: float | None = None,
) -> Handle | None:
    """Record the call, then ``issue(*tensors)``; ``written`` are the indices of the tensors it writes (both are
    what :func:`_staged` needs to run it on host copies)."""
    n = dist.get_world_size(group)
    run_on, copy_back = _staged(group, tensors, written)
    if group is None:
        members = range(dist.get_world_size())
    else:
        members = _GROUP_RANKS.get(group) or dist.get_process_group_ranks(group)
    name = group_name(group)
    number = _LEDGER.calls[name] = _LEDGER.calls.get(name, 0) + 1
    turn = 0 if peer is not None else _LEDGER.turns.get(name, 0) + 1
    if turn:
        _LEDGER.turns[name] = turn
    rec = CommRecord(
        op=op,
        group=name,
        group_size=n,
        ranks=tuple(members),
        tensor_bytes=tensor_bytes,
        sent_bytes=ring_factor(op, n) * tensor_bytes if sent_bytes is None else sent_bytes,
        start=trace.now(),
        end=float("nan"),
        async_op=async_op,
        peer=peer,
        tags=trace.current_tags(),
        through_host=run_on is not tensors,
        number=number,
        turn=turn,
        given=given(op, tensors),
    )
    _LEDGER.records.append(rec)
    index = len(_LEDGER.records) - 1
    where = f" with rank {peer}" if peer is not None else ""
    describe = f"{op} #{number} on {rec.group}{where} ({tensor_bytes} B, tags {rec.tags})"
    trace.issued(index)
    if not async_op:
        trace.waiting(index)
    _tell(f"in {describe}", rec, blocked=not async_op)
    work = issue(*run_on)
    if async_op:
        _tell(f"issued {describe}", rec, blocked=False)
        return Handle(work, rec, index, describe, copy_back)
    copy_back()
    _finish(rec, describe)
    return None


def all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp = ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Handle | None:
    """Reduce ``tensor`` over the group, in place, on every rank."""
    return _call(
        "all_reduce",
        group,
        _nbytes(tensor),
        lambda t: dist.all_reduce(t, op, group, async_op),
        async_op,
        (tensor,),
        (0,),
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Handle | None:
    """Reduce ``input`` (n equal chunks along dim 0) over the group; rank i keeps chunk i in ``output``."""
    return _call(
        "reduce_scatter",
        group,
        _nbytes(input),
        lambda out, inp: dist.reduce_scatter_single(out, inp, op, group, async_op),
        async_op,
        (output, input),
        (0,),
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False) -> Handle | None:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` on every rank."""
    return _call(
        "all_gather",
        group,
        _nbytes(output),
        lambda out, inp: dist.all_gather_single(out, inp, group, async_op),
        async_op,
        (output, input),
        (0,),
    )


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> Handle | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    return _call(
        "broadcast",
        group,
        _nbytes(tensor),
        lambda t: dist.broadcast(t, src, group, async_op),
        async_op,
        (tensor,),
        (0,),
    )


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> Handle | None:
    """Rank i sends its j-th slice of ``input`` (dim 0) to rank j; uneven slices via the split sizes."""
    n = dist.get_world_size(group)
    rows = input.shape[0] if input.dim() else 1
    row_bytes = _nbytes(input) // rows if rows else 0
    me = dist.get_rank(group)
    kept_rows = input_split_sizes[me] if input_split_sizes is not None else rows // n
    return _call(
        "all_to_all",
        group,
        _nbytes(input),
        lambda out, inp: dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group, async_op),
        async_op,
        (output, input),
        (0,),
        sent_bytes=float((rows - kept_rows) * row_bytes),
    )


def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    _call("send", group, _nbytes(tensor), lambda t: dist.send(t, dst, group), False, (tensor,), peer=dst)


def recv(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """Receive into ``tensor`` from global rank ``src`` (blocking)."""
    _call("recv", group, _nbytes(tensor), lambda t: dist.recv(t, src, group), False, (tensor,), (0,), peer=src)


def isend(tensor: torch.Tensor, dst: int, group: Group = None) -> Handle:
    """Start sending ``tensor`` to global rank ``dst``; ``wait()`` the handle before reusing the tensor."""
    return _call("send", group, _nbytes(tensor), lambda t: dist.isend(t, dst, group), True, (tensor,), peer=dst)


def irecv(tensor: torch.Tensor, src: int, group: Group = None) -> Handle:
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` the handle before reading it."""
    return _call("recv", group, _nbytes(tensor), lambda t: dist.irecv(t, src, group), True, (tensor,), (0,), peer=src)


def barrier(group: Group = None) -> None:
    """Wait until every rank of the group gets here."""
    _call("barrier", group, 0, lambda: dist.barrier(group), False)


def summarize(recs: Iterable[CommRecord], by: str = "op") -> dict:
    """Calls, sent bytes and tensor bytes per ``by`` key: ``"op"``, ``"group"`` or a tag name such as ``"step"``."""
    out: dict = defaultdict(lambda: {"calls": 0, "bytes": 0.0, "tensor_bytes": 0})
    for r in recs:
        key = getattr(r, by) if by in ("op", "group") else r.tags.get(by)
        out[key]["calls"] += 1
        out[key]["bytes"] += r.sent_bytes
        out[key]["tensor_bytes"] += r.tensor_bytes
    return dict(out)
