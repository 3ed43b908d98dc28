"""Shared helpers for the tests: rank functions live in the test modules (the launcher ships them by value).

And one rule for the whole session (``make test`` runs ``tests`` and ``notebooks`` together): a lesson that a browser
test runs top to bottom through JupyterLab's own menus (marked ``@pytest.mark.runs_notebook("NAME.ipynb")`` in
``tests/test_browser.py``, which fails on any error output) is not run a second time, cell by cell, by nbval: the
browser run checks every cell of it as nbval would. Where the browser tests do not run (no chromium, ``-m "not
browser"``, a ``-k`` that leaves them out), nbval runs every lesson.
"""

import os

import pytest
import torch

from course_lib import harness
from course_lib.runtime import launch


def process_alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` have deselected what they leave out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_in_browser = {mark.args[0] for item in items for mark in item.iter_markers("runs_notebook")}
    twice = [item for item in items if item.nodeid.split("::")[0].rsplit("/", 1)[-1] in run_in_browser]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]


@pytest.fixture(autouse=True, scope="session")
def measured_profiles_of_this_session(tmp_path_factory):
    """Measured hardware profiles (``course-lib calibrate``) go to a folder of the test session's own, not to the
    user's ``~/.course_lib/profiles``: no test sees a profile measured outside it, and none leaves one behind."""
    from course_lib.cluster.profiles import PROFILES_DIR_VARIABLE

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PROFILES_DIR_VARIABLE, str(tmp_path_factory.mktemp("profiles")))
        yield


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
    monkeypatch.setattr(harness, "train_reference", refuse)
