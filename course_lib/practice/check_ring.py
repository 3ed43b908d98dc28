"""The check of the ring all-reduce exercise (:func:`course_lib.practice.write_it.ring_all_reduce`): real ranks (2 and 4
by default); every rank's result against ``dist.all_reduce``'s, exactly (integer-valued float64 sums have no
rounding), the ledger's bytes per rank against the ring's 2(n-1)/n S, exactly; the messages, read as they are sent,
against the ring's, step by step (the ring of Patarasuk & Yuan 2009: a reduce-scatter of n-1 steps, then an
all-gather of n-1).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from course_lib.ledgers import comm
from course_lib.practice.write_it_check import STUB, Feedback, hint_for_error, one_line, show_values
from course_lib.runtime import host, launch

RING_CHUNK = 3  # elements per chunk: the ring's tensor has 3n float64 elements on n ranks

RING = "ring all-reduce"


def ring_input(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s tensor on ``n`` ranks: 3n integer-valued float64 elements, so every sum is exact."""
    generator = torch.Generator().manual_seed(1000 * n + rank)
    return torch.randint(0, 100, (RING_CHUNK * n,), generator=generator).double()


@contextlib.contextmanager
def _recording_sends(log: list) -> Iterator[None]:
    """While inside, every ``comm.send`` / ``comm.isend`` also appends (destination, a copy of the message)."""
    send, isend = comm.send, comm.isend

    def recorded(original: Callable) -> Callable:
        def call(tensor: torch.Tensor, dst: int, group: comm.Group = None):
            log.append((dst, tensor.detach().cpu().clone()))
            return original(tensor, dst, group)

        return call

    comm.send, comm.isend = recorded(send), recorded(isend)
    try:
        yield
    finally:
        comm.send, comm.isend = send, isend


def measure_ring(fn: Callable) -> dict:
    """On each rank: ``dist.all_reduce`` of this rank's input (the expected sum, off the ledger), then the
    student's function on a copy, its messages read as they are sent; what the check compares."""
    n, rank, device = dist.get_world_size(), dist.get_rank(), launch.rank_device()
    tensor = ring_input(rank, n).to(device)
    expected = tensor.clone()
    dist.all_reduce(expected)
    first, sent = len(comm.records()), []
    with _recording_sends(sent):
        returned = fn(tensor)
    return {
        "result": tensor.cpu(),
        "expected": expected.cpu(),
        "returned": returned.detach().cpu() if isinstance(returned, torch.Tensor) else None,
        "sent": sent,
        "records": comm.records()[first:],
    }


def ring_messages(n: int) -> list[list[tuple[int, int, torch.Tensor, str]]]:
    """The ring's messages on ``n`` ranks, per rank and step: (destination, chunk, contents, what it holds)."""
    chunks = [list(ring_input(r, n).chunk(n)) for r in range(n)]
    out: list[list[tuple]] = [[] for _ in range(n)]
    for k in range(2 * (n - 1)):
        gather = k >= n - 1
        for r in range(n):
            c = (r + 1 - (k - n + 1)) % n if gather else (r - k) % n
            members = [str((r - j) % n) for j in range(k, -1, -1)]
            summed = "all ranks" if gather else f"rank{'s' if k else ''} {', '.join(members)}"
            out[r].append(((r + 1) % n, c, chunks[r][c].clone(), f"chunk {c} summed over {summed}"))
        for r in range(n):
            dst, c, message, _ = out[r][k]
            chunks[dst][c] = message if gather else chunks[dst][c] + message
    return out


def _step_name(k: int, n: int) -> str:
    return f"reduce-scatter step {k + 1} of {n - 1}" if k < n - 1 else f"all-gather step {k - n + 2} of {n - 1}"


def _first_wrong_message(measured: list[dict]) -> str | None:
    """The first (step, rank) whose message differs from the ring's, in words; None if every message matches."""
    n = len(measured)
    ring = ring_messages(n)
    for k in range(2 * (n - 1)):
        for r in range(n):
            sent, (dst, _, want, holds) = measured[r]["sent"], ring[r][k]
            at = f"at {_step_name(k, n)} (step {k + 1} of the ring's {2 * (n - 1)})"
            if k >= len(sent):
                unseen = " through comm.send/comm.isend" if not sent else ""
                return f"rank {r} sent {len(sent)} messages{unseen}; {at} it should send {holds} to rank {dst}"
            peer, got = sent[k]
            if peer != dst:
                return f"{at}, rank {r} sent to rank {peer}; every rank sends to its right neighbour, here rank {dst}"
            if got.numel() != want.numel():
                return f"{at}, rank {r} sent {got.numel()} elements; the ring sends one chunk of S/n = {want.numel()}"
            if not torch.equal(got.flatten().to(want.dtype), want):
                return (
                    f"values first differ {at}: rank {r} sent {show_values(got)}, the ring sends {holds}, "
                    f"{show_values(want)}"
                )
    return None


def _values_hint(measured: list[dict], wrong: list[int]) -> str:
    r = wrong[0]
    m = measured[r]
    if m["returned"] is not None and torch.equal(m["returned"].flatten(), m["expected"].flatten()):
        return (
            f"rank {r} returned the sum but left `tensor` as it was: all-reduce works in place, as dist.all_reduce "
            "does (write through views of its chunks, or copy into it)"
        )
    message = _first_wrong_message(measured)
    if message is not None:
        return message
    n = len(measured)
    got, want = m["result"].flatten().chunk(n), m["expected"].flatten().chunk(n)
    c = next(i for i in range(n) if not torch.equal(got[i], want[i]))
    return (
        f"every message matched the ring, but rank {r}'s chunk {c} ends as {show_values(got[c])} instead of "
        f"{show_values(want[c])}: look at what rank {r} does with the last chunks it receives (the all-gather "
        "stores them)"
    )


def _bytes_hint(sent: list[float], counts: list[int], formula: float, size: int) -> str:
    n = len(sent)
    r = next(i for i in range(n) if sent[i] != formula)
    said = f"rank {r} sent {sent[r]:g} B in {counts[r]} messages"
    ring = f"the ring sends 2(n-1) = {2 * (n - 1)} chunks of S/n = {size // n} B, 2(n-1)/n S = {formula:g} B"
    if counts[r] == 0:
        return (
            f"the ledger saw no send from rank {r}: call comm.send or comm.isend (torch.distributed's own are not "
            f"recorded); {ring}"
        )
    if sent[r] == (n - 1) * size:
        return f"{said}: its whole tensor to each of the n-1 others; {ring}, whatever n is"
    return f"{said}; {ring}"


def judge_ring(measured: list[dict]) -> Feedback:
    """Judge one run of :func:`measure_ring` (every rank's dict, in rank order): collectives used, every rank's
    result against dist.all_reduce's, the ledger's bytes per rank against 2(n-1)/n S."""
    n = len(measured)
    size = measured[0]["expected"].numel() * measured[0]["expected"].element_size()
    formula = 2 * (n - 1) / n * size
    sent = [sum(rec.sent_bytes for rec in m["records"] if rec.op == "send") for m in measured]
    counts = [sum(rec.op == "send" for rec in m["records"]) for m in measured]
    wrong = [r for r, m in enumerate(measured) if not torch.equal(m["result"], m["expected"])]
    collectives = sorted({rec.op for m in measured for rec in m["records"]} - {"send", "recv"})
    measurement = (
        f"{n} ranks, S = {size} B: the result equals dist.all_reduce's on {n - len(wrong)} of {n} ranks; the ledger "
        f"has {counts} sends per rank, [{', '.join(f'{b:g}' for b in sent)}] B (the ring: 2(n-1)/n S = {formula:g} B)"
    )
    numbers = {"ranks": n, "S": size, "sent_bytes": sent, "formula_bytes": formula, "wrong_ranks": wrong}
    if collectives:
        hint = f"your function called {', '.join(collectives)}: write the ring from send and recv alone"
    elif wrong:
        hint = _values_hint(measured, wrong)
    elif any(b != formula for b in sent):
        hint = _bytes_hint(sent, counts, formula, size)
    else:
        return Feedback(RING, True, measurement, numbers=numbers)
    return Feedback(RING, False, measurement, hint, numbers)


def crashed_run(exercise: str, n: int, error: launch.RankError) -> Feedback:
    """Feedback for a run that ended in a :class:`course_lib.runtime.launch.RankError`: its first line, and for a run
    that hung, where each rank waited."""
    lines, ranks = str(error).splitlines(), f"{n} rank{'s' if n > 1 else ''}"
    waiting = [line.strip() for line in lines if re.match(r"\s+rank \d+: ", line)]
    numbers = {"error": str(error)}
    if "did not finish" in lines[0]:
        measured = f"on {ranks}, {lines[0].rstrip(':')}: " + "; ".join(waiting)
        if waiting and all(" in send " in line for line in waiting):
            hint = (
                "every rank waits in a blocking send: gloo's send returns only once the peer receives, and every "
                "peer is sending too. Post the send with comm.isend, receive with comm.recv, then wait() the send"
            )
        else:
            hint = "a rank waits for a message no rank sends: each receive needs a matching send from that peer"
        return Feedback(exercise, False, measured, hint, numbers)
    if "Connection closed by peer" in lines[0]:
        hint = (
            "that rank was still waiting to receive when its peer had returned: each receive needs a matching send "
            "from that peer, and every rank takes the same steps"
        )
    else:
        hint = hint_for_error(lines[0]) + (
            "" if hint_for_error(lines[0]) == STUB else " (the rank's traceback: .numbers['error'])"
        )
    return Feedback(exercise, False, f"on {ranks}: {lines[0]}", hint, numbers)


def check_ring_all_reduce(
    fn: Callable[[torch.Tensor], None],
    world_sizes: Sequence[int] = (2, 4),
    backend: str = "auto",
    timeout: float = 10.0,
) -> Feedback:
    """Run ``fn`` on each world size in turn (:func:`course_lib.practice.write_it.ring_all_reduce` says what it
    computes) and judge it (:func:`judge_ring`); the first size that fails is the feedback."""
    sizes = list(world_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"world_sizes must be positive integers, such as (2, 4), not {world_sizes!r}")
    if launch.resolve_backend(backend, max(sizes)) == "gloo":
        host.check_world_size(max(sizes))
    passed = []
    for n in sizes:
        try:
            run = launch.run(measure_ring, n, fn, backend=backend, timeout=timeout)
        except launch.RankError as error:
            return crashed_run(RING, n, error)
        except Exception as error:  # the function could not be sent to the ranks (cloudpickle)
            measured = f"the ranks could not start your function: {one_line(error)}"
            return Feedback(RING, False, measured, "define it at the top level of a cell or a file")
        feedback = judge_ring(list(run))
        if not feedback.passed:
            return feedback
        passed.append(feedback)
    measured = "; ".join(f.measured for f in passed)
    return Feedback(RING, True, measured, numbers={f.numbers["ranks"]: f.numbers for f in passed})
