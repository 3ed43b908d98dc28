"""Distributed cells (course_lib.runtime.cells) driven through a real IPython kernel, as a notebook drives them.

One kernel and one pair of ranks serve the whole module; the last tests stop the ranks, then restart the kernel with
ranks running.
"""

from __future__ import annotations

import base64
import os
import re
import threading
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

WORLD = 2


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid from Linux's /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True for a process that exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def live_descendants(root: int) -> list[int]:
    """The live processes below ``root``, read from /proc."""
    parents = {
        int(d.name): stat[1] for d in Path("/proc").iterdir() if d.name.isdigit() and (stat := _stat(int(d.name)))
    }
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += sorted(frontier)
    return sorted(pid for pid in found if alive(pid))


class Kernel:
    """A kernel and a way to run one cell in it: its text output (an image shown as ``<image/png>``, its bytes kept
    in ``pngs``) and its error, if any."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env)
        self.pid = self.manager.provisioner.process.pid
        self.pngs: list[bytes] = []

    def run(self, code: str, timeout: float = 60.0) -> tuple[str, str | None]:
        msg_id = self.client.execute(code)
        out, error, self.pngs = [], None, []
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "execute_result":
                out.append(content["data"]["text/plain"] + "\n")
            elif kind == "display_data" and "image/png" in content["data"]:
                out.append("<image/png>\n")
                self.pngs.append(base64.b64decode(content["data"]["image/png"]))
            elif kind == "error":
                error = "\n".join(content["traceback"])
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out), error

    def ok(self, code: str) -> str:
        out, error = self.run(code)
        assert error is None, error
        return out

    def live_descendants(self) -> list[int]:
        return live_descendants(self.pid)

    def restart(self) -> None:
        """Restart the kernel as Jupyter's restart button does: a shutdown request, then a new kernel process."""
        self.manager.restart_kernel(now=False)
        self.client.wait_for_ready(timeout=60)
        self.pid = self.manager.provisioner.process.pid

    def shutdown(self, now: bool = True) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=now)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.ok("%load_ext course_lib\nfrom course_lib import comm, launch\nfrom course_lib.runtime import cells\n"
         "import torch")
    k.baseline = k.live_descendants()  # the forkserver, started when course_lib loaded
    out = k.ok(f"%ranks start {WORLD} --timeout 10")
    assert f"{WORLD} ranks up (gloo)" in out
    yield k
    if k.manager.is_alive():
        k.shutdown()


def test_state_persists_per_rank(kernel):
    kernel.ok("%%ranks\nx = 10 * rank")
    assert kernel.ok("%%ranks\nx += 1\nx") == "[rank 0]\nOut: 1\n[rank 1]\nOut: 11\ncomm: nothing communicated\n"
    assert kernel.ok("%%ranks 1\nprint('only me', x)") == "[rank 1]\nonly me 11\ncomm: nothing communicated\n"
    assert kernel.ok("%%ranks\nprint('same')") == "[ranks 0,1]\nsame\ncomm: nothing communicated\n"


def test_get_put_round_trip(kernel):
    kernel.ok("%ranks put sent = {'a': [1, 2.5], 't': torch.arange(3)}")
    kernel.ok("%%ranks\nback = (sent['a'], sent['t'] * (rank + 1))")
    kernel.ok(
        "got = %ranks get back\n"
        "assert [g[0] for g in got] == [[1, 2.5]] * 2, got\n"
        "assert [g[1].tolist() for g in got] == [[0, 1, 2], [0, 2, 4]], got"
    )
    out, error = kernel.run("%ranks get missing")
    assert "NameError: name 'missing' is not defined on rank 0" in error
    kernel.ok("%%ranks\nimport threading\nlock = threading.Lock()")
    out, error = kernel.run("%ranks get lock")
    assert "TypeError on rank 0: cannot pickle '_thread.lock' object" in error, error
    assert kernel.ok("%%ranks\nrank") == "[rank 0]\nOut: 0\n[rank 1]\nOut: 1\ncomm: nothing communicated\n"


CODE = """\
t = torch.arange(12, dtype=torch.float64) + rank
comm.all_reduce(t)
parts = torch.zeros(2 * world_size, dtype=torch.float32)
comm.all_gather(parts, torch.ones(2) * rank)
b = torch.full((2,), float(rank), dtype=torch.float32)
comm.broadcast(b, src=0)
if rank == 0:
    comm.send(b, 1)
elif rank == 1:
    comm.recv(b, 0)
"""


def test_cell_ledger_equals_launch_run(kernel):
    """The ledger of a cell is the records the same code makes through launch.run, and its bytes the ring's:
    all_reduce 2(n-1)/n * 96 B = 96, all_gather (n-1)/n * 16 B = 8, broadcast 8 B, then rank 0 sends 8 B to rank 1:
    120 B from rank 0 and 112 B from rank 1 for n = 2."""
    out = kernel.ok("%%ranks\n" + CODE)
    assert out.startswith(
        "comm: [rank 0] all_reduce x1, all_gather x1, broadcast x1, send x1; "
        "[rank 1] all_reduce x1, all_gather x1, broadcast x1, recv x1; sent rank 0 120 B, rank 1 112 B; "
    ), out
    kernel.ok(
        f"CODE = {CODE!r}\n"
        "def same_code():\n"
        "    import torch.distributed as dist\n"
        "    ns = dict(rank=dist.get_rank(), world_size=dist.get_world_size(), dist=dist, comm=comm, torch=torch)\n"
        "    exec(CODE, ns)\n"
        f"res = launch.run(same_code, {WORLD}, backend='gloo')\n"
        "key = lambda recs: [(r.op, r.group, r.group_size, r.ranks, r.tensor_bytes, r.sent_bytes) for r in recs]\n"
        "cell = cells.session().cells[-1]\n"
        f"assert [key(cell.records[r]) for r in range({WORLD})] == [key(recs) for recs in res.comm], (cell, res.comm)\n"
        "assert [sum(r.sent_bytes for r in recs) for recs in res.comm] == [120.0, 112.0]"
    )
    table = kernel.ok("%ranks ledger").splitlines()
    assert [row.split(None, 1)[1] for row in table[-5:]] == [
        "all_reduce          1  0: 96 B, 1: 96 B",
        "all_gather          1  0: 8 B, 1: 8 B",
        "broadcast           1  0: 8 B, 1: 8 B",
        "send                1  0: 8 B, 1: 0 B",
        "recv                1  0: 0 B, 1: 0 B",
    ]


def test_exception_shows_the_rank_and_leaves_ranks_usable(kernel):
    out, error = kernel.run("%%ranks\nkept = rank\nif rank == 1:\n    raise ValueError('boom')")
    assert "CellError: [rank 1] raised:" in error and "ValueError: boom" in error and "<ranks cell" in error
    assert "[rank 0]" not in error
    t = kernel.ok("%%ranks\nt = torch.ones(1)\ncomm.all_reduce(t)\n(kept, t.item())")
    assert t.startswith("[rank 0]\nOut: (0, 2.0)\n[rank 1]\nOut: (1, 2.0)\n")


def test_skipped_collective_ends_at_the_timeout_and_restarts(kernel):
    old = kernel.ok("print(cells.session().pids)")
    started = time.monotonic()
    out, error = kernel.run("%%ranks --timeout 1.5\nif rank == 0:\n    comm.all_reduce(torch.ones(2))")
    took = time.monotonic() - started
    assert took < 1.5 + 5, took  # the timeout, then a restart of two ranks
    assert "the cell did not finish within timeout=1.5 s:" in error
    assert "rank 0: waiting" in error and "in all_reduce" in error
    assert "rank 1: finished, without calling all_reduce #" in error  # the culprit named, not just "finished"
    assert "on world, which rank 0 waits in: this rank skipped a collective every rank must call" in error
    assert "The 2 ranks were restarted: their variables are gone." in error
    for pid in eval(old):
        assert not alive(pid)
    assert kernel.ok("%%ranks\nt = torch.ones(1)\ncomm.all_reduce(t)\nt.item()").startswith("[ranks 0,1]\nOut: 2.0\n")


def test_a_dead_rank_or_an_interrupt_restarts_the_ranks(kernel):
    out, error = kernel.run("%%ranks 1\nimport os\nos._exit(3)")
    assert (
        "the cell lost rank 1:\n  rank 0: finished\n  rank 1: exited with code 3 without returning a result\n" in error
    )
    assert "The 2 ranks were restarted: their variables are gone." in error
    threading.Timer(0.5, kernel.manager.interrupt_kernel).start()
    started = time.monotonic()
    out, error = kernel.run("%%ranks\nimport time\ntime.sleep(30)")
    assert time.monotonic() - started < 5
    assert "the cell was interrupted\nThe 2 ranks were restarted: their variables are gone." in error, error
    assert kernel.ok("%%ranks\nrank") == "[rank 0]\nOut: 0\n[rank 1]\nOut: 1\ncomm: nothing communicated\n"


def test_a_collective_given_other_shapes_is_named(kernel):
    """The ranks' all-reduce of 2 and 3 elements: gloo fails it on one rank, which goes back to its loop, and leaves
    the other waiting for ever. The cell ends after a second of that wait, not at its timeout (10 s), and its error
    leads with the collective and what each rank sent (its number counts the earlier cells' collectives too)."""
    started = time.monotonic()
    out, error = kernel.run("%%ranks\ncomm.all_reduce(torch.ones(2 + rank))")
    assert time.monotonic() - started < 5, "a collective the ranks disagree on ends the cell before its timeout"
    assert re.search(
        r"CellError: all_reduce #\d+ on group world: rank 0 sent float32 \[2\], rank 1 sent float32 \[3\]: the "
        r"tensors must have the same shape and dtype on every rank\nthe cell stalled in a collective its ranks "
        r"disagree on:\n",
        error,
    ), error
    # gloo takes a broadcast into a larger tensor without a word: the cell's ledgers name it; the next cell's own
    # error is not blamed on it
    out, error = kernel.run("%%ranks\ncomm.broadcast(torch.ones(2 + rank), src=0)")
    assert re.search(
        r"CellError: broadcast #\d+ on group world: rank 0 sent float32 \[2\], rank 1 sent float32 \[3\]: the "
        r"tensors must have the same shape and dtype on every rank\nThe cell ended without an error, but what that "
        r"collective wrote is wrong on some rank.",
        error,
    ), error
    out, error = kernel.run("%%ranks\nif rank == 1:\n    raise ValueError('unrelated')")
    assert "ValueError: unrelated" in error and "sent float32" not in error, error


def test_bad_input_is_a_usage_error_before_any_rank_starts(kernel):
    for line, says in [
        ("%ranks start 0", "say how many ranks to start"),
        ("%ranks start 2 --timeout -1", "positive number of seconds"),
        ("%%ranks 0,5\n1", "ranks must be among 0..1"),
        ("%ranks put 1x=2", "NAME a Python name"),
        ("%ranks frobnicate", "unknown %ranks command"),
    ]:
        out, error = kernel.run(line)
        shown = out + (error or "")
        assert "UsageError" in shown and says in shown, (line, shown)


def test_figures_drawn_on_ranks_show_under_each_rank(kernel):
    """Each rank's open figure comes back as one PNG under its label, in rank order (rank 1's twice as wide); the
    ranks draw with Agg (plt.show() does nothing there: the figure is sent when the cell ends) and keep no figure
    open."""
    out = kernel.ok(
        "%%ranks\nimport matplotlib.pyplot as plt\nplt.figure(figsize=(2 + 2 * rank, 2))\nplt.plot([0, rank])\n"
        "plt.show()\nprint('drawn')"
    )
    assert out == "[ranks 0,1]\ndrawn\n[rank 0]\n<image/png>\n[rank 1]\n<image/png>\ncomm: nothing communicated\n"
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in kernel.pngs)
    width = [int.from_bytes(png[16:20], "big") for png in kernel.pngs]  # the PNG header's width field
    assert 1.5 * width[0] < width[1] < 2.5 * width[0], width
    out = kernel.ok("%%ranks\n(plt.get_backend(), plt.get_fignums())")
    assert out == "[ranks 0,1]\nOut: ('agg', [])\ncomm: nothing communicated\n"


def wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    """The processes among ``pids`` still alive after waiting up to ``seconds`` for all to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_stop_leaves_no_process(kernel):
    """Counts the kernel's processes with ranks running and after %ranks stop."""
    assert len(kernel.live_descendants()) == len(kernel.baseline) + WORLD
    kernel.ok("%ranks stop")
    assert kernel.live_descendants() == kernel.baseline


def test_kernel_restart_leaves_no_process(kernel):
    """Last: ranks running, the kernel restarted as Jupyter's button does it: its ranks and its forkserver end. A
    shutdown is the same request to the kernel (only its ``restart`` flag differs), so this stands for both."""
    kernel.ok(f"%ranks start {WORLD}")
    pids = eval(kernel.ok("print(cells.session().pids)"))
    assert len(kernel.live_descendants()) == len(kernel.baseline) + WORLD
    kernel.restart()
    assert not wait_gone(pids + kernel.baseline)
