"""Failure injection on real ranks: a fault plan makes one rank raise, exit, die by SIGKILL or hang at a chosen step
of any scheme; the caller gets a RankError naming the rank and the step within the timeout, and no rank outlives it.
"""

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from multiprocessing import forkserver as mp_forkserver

import pytest
from conftest import process_alive

from course_lib.cli import main
from course_lib.harness import run_scheme
from course_lib.model.config import TrainConfig
from course_lib.runtime import faults, launch
from course_lib.runtime.faults import Fault
from course_lib.runtime.forkserver import warm

STALL_S = 2.0
TRAIN = TrainConfig(steps=3)

# What the caller reads when rank 1 fails at the start of step 2, by kind.
EXPECTED = {
    "raise": "rank 1 of 2 raised InjectedFault: injected fault: rank 1 at step 2 (forward)",
    "exit": f"rank 1 of 2 exited with code {faults.EXIT_CODE} without returning a result during step 2 (last: ",
    "kill": "rank 1 of 2 was killed by signal SIGKILL during step 2 (last: ",
    "hang": "rank 1: busy outside any collective during step 2 (last: ",
}


def _server_children() -> set[int]:
    """The live processes the rank server has forked (the ranks of the runs under way)."""
    server = mp_forkserver._forkserver._forkserver_pid
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                if int(ppid) == server and state != "Z":
                    children.add(int(entry))
    return children


@contextlib.contextmanager
def ranks_seen() -> Iterator[set[int]]:
    """The pids of every rank started inside the block, gathered by polling the rank server's children."""
    warm()
    while mp_forkserver._forkserver._forkserver_pid is None:
        time.sleep(0.01)
    seen: set[int] = set()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.update(_server_children())
            done.wait(0.01)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def failed_run(scheme: str, fault: Fault, world_size: int = 2, train: TrainConfig = TRAIN) -> tuple[str, float]:
    """Run ``scheme`` with ``fault``; return the RankError's text and the seconds to it, having checked that every
    rank of the run was seen and none is left."""
    started = time.perf_counter()
    with ranks_seen() as pids, pytest.raises(launch.RankError) as err:
        run_scheme(scheme, world_size, train=train, fault=fault, timeout=60, stall_timeout=STALL_S)
    elapsed = time.perf_counter() - started
    assert len(pids) == world_size, f"expected {world_size} ranks, saw {sorted(pids)}"
    assert not any(process_alive(pid) for pid in pids), "a rank outlived its run"
    if fault.kind == "raise":
        assert isinstance(err.value.__cause__, faults.InjectedFault)
    return str(err.value), elapsed


def check_named_in_time(kind: str, message: str, elapsed: float) -> None:
    """What the caller reads when rank 1 of 2 fails with ``kind`` at the start of step 2, and how soon."""
    assert EXPECTED[kind] in message, message
    if kind == "hang":  # found by the stall detector, not the 60 s timeout
        assert message.startswith(f"rank 1 of 2 held the run up: ranks [0] waited over {STALL_S:g} s"), message
        assert STALL_S <= elapsed < STALL_S + 5, elapsed
    else:
        assert elapsed < 10, elapsed
    if kind == "raise":
        assert "in train_loop" in message, "the rank's traceback shows where the fault fired"


# Every kind runs on dp in the default set: "raise" here, "exit" and "hang" in the tests below that read more of the
# same run's message (test_a_fault_at_a_later_step_..., test_a_hung_rank_shows_where_it_was), "kill" from the command
# line (test_the_command_line_kills_a_rank_...). pp adds a death and a hang that its peer meets in a point-to-point
# receive rather than a collective. The rest of the product is slow.
SLOW = pytest.mark.slow
KIND_AND_SCHEME = [
    pytest.param("raise", "dp", id="raise-dp"),
    pytest.param("exit", "dp", id="exit-dp", marks=SLOW),
    pytest.param("kill", "dp", id="kill-dp", marks=SLOW),
    pytest.param("hang", "dp", id="hang-dp", marks=SLOW),
    pytest.param("raise", "pp", id="raise-pp", marks=SLOW),
    pytest.param("exit", "pp", id="exit-pp", marks=SLOW),
    pytest.param("kill", "pp", id="kill-pp"),
    pytest.param("hang", "pp", id="hang-pp"),
]
assert {kind for kind, _ in (p.values for p in KIND_AND_SCHEME)} == set(faults.KINDS)


@pytest.mark.parametrize(("kind", "scheme"), KIND_AND_SCHEME)
def test_each_kind_of_fault_is_named_in_time_and_leaves_no_rank(kind, scheme):
    message, elapsed = failed_run(scheme, Fault(1, 2, kind))
    check_named_in_time(kind, message, elapsed)


def test_a_fault_between_collectives_names_its_step():
    """Rank 0 of ZeRO-3 dies before its optimizer step of step 1, its gradients of step 1 reduce-scattered: its peer
    has gone on into step 2, where it waits for rank 0's all-gather."""
    message, _ = failed_run("zero3", Fault(0, 1, "kill", "optimizer"))
    head, _, peer = message.splitlines()[:3]
    assert head.startswith("rank 0 of 2 was killed by signal SIGKILL during step 1 (last: finished reduce_scatter #")
    assert "tags {'step': 1," in head, head
    assert peer.startswith("  rank 1: raised RuntimeError") and "during step 2 (last: waiting for all_gather" in peer


def test_a_fault_at_a_later_step_leaves_the_earlier_steps_done():
    """Rank 1 dies as step 2 begins, after the last collective of step 1: as many as a whole 2-step run makes."""
    clean = run_scheme("dp", 2, train=TrainConfig(steps=2), timeout=60)
    done = [record for record in clean.result.comm[1] if record.group == "world"]
    message, elapsed = failed_run("dp", Fault(1, 2, "exit"))
    check_named_in_time("exit", message, elapsed)
    head = message.splitlines()[0]
    assert "during step 2" in head and f"finished {done[-1].op} #{len(done)} on world" in head, (head, len(done))
    assert "'step': 1" in head


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (lambda: Fault(-1, 0), "a fault's rank must be a whole number of at least 0, not -1"),
        (lambda: Fault(0, 1.5), "a fault's step must be a whole number of at least 0, not 1.5"),
        (lambda: Fault(0, 0, "segfault"), "unknown fault kind 'segfault'"),
        (lambda: Fault(0, 0, phase="backward"), "unknown fault phase 'backward'"),
        (lambda: run_scheme("dp", 2, fault=Fault(2, 0)), "cannot fail rank 2: the run's ranks are 0 to 1"),
        (
            lambda: run_scheme("dp", 2, train=TRAIN, fault=Fault(0, 3)),
            "cannot fail at step 3: the run's steps are 0 to 2",
        ),
        (lambda: run_scheme("single", 1, fault=Fault(0, 0), in_process=True), "not into this process"),
    ],
)
def test_a_fault_that_cannot_fire_is_refused_before_any_rank_starts(fault, message, monkeypatch):
    monkeypatch.setattr(launch, "_run_local", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match=re.escape(message)):
        fault()


def test_the_command_line_kills_a_rank_and_says_where(capsys):
    argv = ["run", "dp", "--world-size", "2", "--steps", "2", "--kill-rank", "1", "--at-step", "1"]
    with ranks_seen() as pids:
        assert main([*argv, "--stall-timeout", "3"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("course-lib run: rank 1 of 2 was killed by signal SIGKILL during step 1 (last: "), err
    assert len(pids) == 2 and not any(process_alive(pid) for pid in pids)


def test_a_hung_rank_shows_where_it_was():
    """On a stall the launcher asks the ranks holding the run up for their Python stacks (faulthandler) and ends its
    message with them: here the hang inside the fault's own frame, called from the training loop."""
    message, elapsed = failed_run("dp", Fault(1, 2, "hang"))
    check_named_in_time("hang", message, elapsed)
    where = message.split("where rank 1 was (faulthandler, most recent call first):", 1)[1]
    assert "in _hang" in where and "in train_loop" in where
