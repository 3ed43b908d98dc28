"""Shared helpers for the tests: rank functions live in the test modules (the launcher ships them by value)."""

import os

import pytest
import torch

from course_lib import launch, schemes


def process_alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where rank functions drop their pid, so a test can check that no rank outlived the run."""
    return tmp_path


def read_pids(folder) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("*.pid"))]


def write_pid(folder, rank: int) -> None:
    (folder / f"{rank}.pid").write_text(str(os.getpid()))


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Any rank (or reference) started fails the test: the refusal must come before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank (or the reference) started for a command line that should have been refused")

    monkeypatch.setattr(launch, "_run_local", refuse)
    monkeypatch.setattr(schemes, "train_reference", refuse)
