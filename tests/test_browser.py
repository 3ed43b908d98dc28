"""In the browser: JupyterLab runs the lessons through its own menus, and the explorers show what their code asks for
(issue 20, item 6). Playwright drives the system's chromium; JupyterLab serves a copy of the notebooks, so running
them never writes into the checkout. Screenshots and JupyterLab's log land in ``out/browser/``.

Select these tests with ``pytest -m browser`` (``-m "not browser"`` leaves them out). A test that runs a whole lesson
is marked ``runs_notebook``, and nbval then leaves that lesson to it (``tests/conftest.py``).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("browser tests need chromium on PATH (Debian: apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright (pip install -e '.[test]')")

from course_lib.parallel.schedules import Costs, bubble_formula  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "out" / "browser"
LESSON_COSTS = Costs(1, 1, 1)  # lesson 05's costs, where its schedule explorer starts
FIGURE_ONE = [120.0, 31.4, 16.6, 1.9]  # the ZeRO paper's Figure 1: 7.5B parameters, 64 GPUs, mixed precision
RUN_TIMEOUT_MS = 300_000  # a lesson's cells, ranks included, on a loaded 2-core machine
UI_TIMEOUT_MS = 60_000
# JupyterLab settings for a test: no autosave, every cell in the DOM (no windowing), no news prompt.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
# The labels of a widget's controls whose text does not fit their box (shown cut off, with an ellipsis).
CUT_LABELS_JS = """widget => [...widget.querySelectorAll('.widget-label, .widget-label-basic')]
    .filter(label => label.scrollWidth > label.clientWidth + 1).map(label => label.textContent)"""


def _processes() -> dict[int, tuple[int, str]]:
    """Every process on the machine, as ps lists them: pid -> (parent pid, state)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True, check=True).stdout
    rows = (line.split() for line in out.splitlines())
    return {int(pid): (int(ppid), stat) for pid, ppid, stat, *_ in rows}


def _descendants(pid: int) -> set[int]:
    """The live (not zombie) processes below ``pid``."""
    table = _processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (parent, stat) in table.items() if parent in frontier and not stat.startswith("Z")}
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    table = _processes()
    return {p for p in pids if p in table and not table[p][1].startswith("Z")}


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    """Wait up to ``seconds`` for ``pids`` to exit; the ones still alive."""
    deadline = time.monotonic() + seconds
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    browser: object  # playwright's Browser

    def open(self, page, notebook: str) -> None:
        """Open ``notebook`` alone (a reset workspace) and wait until its kernel is started and idle."""
        page.goto(f"{self.url}/lab/tree/{notebook}?reset&token={self.token}")
        sync_api.expect(page.locator("#jp-main-statusbar")).to_contain_text("| Idle", timeout=UI_TIMEOUT_MS)

    def stop_kernels(self) -> None:
        """End every session (and its kernel), as closing the notebooks with Shut Down Kernel would."""
        api = f"{self.url}/api/sessions"
        with urllib.request.urlopen(f"{api}?token={self.token}", timeout=10) as response:
            sessions = json.load(response)
        for session in sessions:
            request = urllib.request.Request(f"{api}/{session['id']}?token={self.token}", method="DELETE")
            urllib.request.urlopen(request, timeout=30).close()


def _start_lab(workdir: Path, log) -> tuple[subprocess.Popen, str, str]:
    """JupyterLab on 127.0.0.1 serving ``workdir/notebooks``, with :data:`LAB_SETTINGS`, in a session of its own."""
    settings = workdir / "settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
    )
    command = [
        str(Path(sys.executable).parent / "jupyter"),
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={workdir / 'notebooks'}",
    ] + (["--allow-root"] if os.geteuid() == 0 else [])
    lab = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).close()
            return lab, url, token
        except OSError:
            if lab.poll() is not None or time.monotonic() > deadline:
                lab.kill()
                raise RuntimeError(f"JupyterLab did not start; see {log.name}") from None
            time.sleep(0.5)


def _stop_lab(lab: subprocess.Popen, url: str, token: str) -> set[int]:
    """Shut JupyterLab and its kernels down (kill what is left: its process group, and its kernels, which run in
    sessions of their own); the processes that did not end by themselves."""
    below = _descendants(lab.pid)
    try:
        urllib.request.urlopen(urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST"), timeout=10)
        lab.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    left = _wait_gone(below | {lab.pid}, 10)
    _kill(left)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(lab.pid, signal.SIGKILL)
    lab.wait(timeout=30)
    return left


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    """JupyterLab and chromium, both stopped afterwards; fails if either left a process behind."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    workdir = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", workdir / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    before = _descendants(os.getpid())
    with open(ARTIFACTS / "jupyterlab.log", "w") as log:
        server, url, token = _start_lab(workdir, log)
        try:
            with sync_api.sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM)
                try:
                    yield Lab(url, token, browser)
                finally:
                    browser.close()
        finally:
            lab_left = _stop_lab(server, url, token)
    ours_left = _wait_gone(_descendants(os.getpid()) - before, 10)
    _kill(ours_left)
    assert not lab_left, f"JupyterLab's processes {sorted(lab_left)} outlived its shutdown (killed)"
    assert not ours_left, f"processes {sorted(ours_left)} outlived the browser (killed)"


@pytest.fixture
def page(lab, request):
    """A fresh browser page; the console errors it logs (and its uncaught exceptions) are in ``page.errors``.
    A screenshot of the whole page is saved after the test, named after it."""
    context = lab.browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.errors = []
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    page.on("pageerror", lambda error: page.errors.append(f"uncaught: {error}"))
    try:
        yield page
        page.screenshot(path=ARTIFACTS / f"{request.node.name}.png")
    finally:
        context.close()
        lab.stop_kernels()


def _run_all(page) -> None:
    """Run > Run All Cells, then wait until every code cell shown has run and the kernel is idle. A collapsed cell
    (``source_hidden``) shows a placeholder whose prompt (also ``jp-InputPrompt``) never gets a number: skipped."""
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    page.wait_for_function(
        """() => [...document.querySelectorAll(
                '.jp-Notebook .jp-CodeCell .jp-InputPrompt:not(.jp-Placeholder-prompt)')]
            .every(prompt => /^\\[\\d+\\]:$/.test(prompt.textContent.trim()))""",
        timeout=RUN_TIMEOUT_MS,
    )
    sync_api.expect(page.locator("#jp-main-statusbar")).to_contain_text("| Idle", timeout=UI_TIMEOUT_MS)


def _assert_clean(page) -> None:
    """No cell printed an error (or anything to stderr) and every widget rendered."""
    errors = page.locator('.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    assert errors.count() == 0, "\n---\n".join(errors.all_inner_texts())
    text = page.locator(".jp-Notebook").inner_text()
    assert "Loading widget..." not in text and "Error displaying widget" not in text


def _widget(page, call: str):
    """The widget shown by the code cell whose source contains ``call``."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=call))
    sync_api.expect(cell).to_have_count(1)
    widget = cell.locator(".widget-interact")
    # The kernel renders it after the cell's computation: allow for a loaded machine (a timing, not a speed target).
    sync_api.expect(widget).to_be_visible(timeout=30_000)
    return widget


def _control(widget, label: str):
    """The control of ``widget`` described by ``label``."""
    return widget.locator(".widget-inline-hbox", has=widget.page.get_by_text(label, exact=True))


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def _code_cell(page, call: str):
    """The code cell whose source contains ``call``."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=call))
    sync_api.expect(cell).to_have_count(1)
    return cell


@pytest.mark.runs_notebook("00_collectives.ipynb")
def test_lesson_00_ranks_cells_show_each_ranks_output_and_the_cells_ledger_line(lab, page):
    import nbformat
    import torch

    nb = nbformat.read(ROOT / "notebooks" / "00_collectives.ipynb", as_version=4)
    parameters = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    n = int(re.search(r"^world_size = (\d+)$", parameters, flags=re.M).group(1))
    lab.open(page, "00_collectives.ipynb")
    _run_all(page)
    _assert_clean(page)
    built_cell = _code_cell(page, "x = torch.arange(4.0")
    built = built_cell.locator(".jp-OutputArea")
    for r in range(n):  # every rank holds its own x: one block per rank
        sync_api.expect(built).to_contain_text(f"[rank {r}]\nOut: {torch.arange(4.0) + 10 * r!r}")
    sync_api.expect(built).to_contain_text("comm: nothing communicated")
    reduced_cell = _code_cell(page, "comm.all_reduce(x)")
    reduced = reduced_cell.locator(".jp-OutputArea")
    total = sum(torch.arange(4.0) + 10 * r for r in range(n))  # every rank holds the sum: one collapsed block
    sync_api.expect(reduced).to_contain_text(f"[ranks {','.join(map(str, range(n)))}]\nOut: {total!r}")
    sync_api.expect(reduced).to_contain_text(f"comm: all_reduce x1; {2 * (n - 1) / n * 16:,.0f} B sent by each rank;")
    built_cell.screenshot(path=ARTIFACTS / "00_ranks_cell_per_rank.png")
    reduced_cell.screenshot(path=ARTIFACTS / "00_ranks_cell_all_reduce.png")
    assert page.errors == []


@pytest.mark.runs_notebook("03_zero_fsdp.ipynb")
def test_zero_explorer_shows_figure_one_like_its_check_cell(lab, page):
    lab.open(page, "03_zero_fsdp.ipynb")
    _run_all(page)
    _assert_clean(page)
    widget = _widget(page, "zero_memory_explorer(params=7.5e9")
    widget.screenshot(path=ARTIFACTS / "03_zero_explorer.png")
    assert widget.evaluate(CUT_LABELS_JS) == []
    assert _control(widget, "Ψ (billions)").locator(".widget-readout").inner_text() == "7.5"
    assert _control(widget, "N (devices)").locator(".widget-readout").inner_text() == "64"
    printed = widget.locator(".widget-output").get_by_text("model states per device (GB):").inner_text()
    # The check cell is collapsed (source_hidden): JupyterLab shows only its first line, in a placeholder.
    placeholder = page.locator(".jp-InputPlaceholder", has_text="the paper's Figure 1 numbers")
    check = page.locator(".jp-CodeCell", has=placeholder)
    checked = ast.literal_eval(check.locator(".jp-OutputArea-output").inner_text().strip())
    assert _numbers(printed) == checked == FIGURE_ONE
    assert page.errors == []


@pytest.mark.runs_notebook("05_pipeline_parallel.ipynb")
def test_schedule_explorer_redraws_and_disables_chunks_outside_interleaved(lab, page):
    lab.open(page, "05_pipeline_parallel.ipynb")
    _run_all(page)
    _assert_clean(page)
    widget = _widget(page, 'schedule_explorer("1f1b"')
    widget.screenshot(path=ARTIFACTS / "05_schedule_explorer_1f1b.png")
    assert widget.evaluate(CUT_LABELS_JS) == []
    chunks = _control(widget, "chunks v").locator(".noUi-target")
    stages = int(_control(widget, "stages p").locator(".widget-readout").inner_text())
    microbatches = int(_control(widget, "microbatches m").locator(".widget-readout").inner_text())
    figure = widget.locator(".widget-output img")
    sync_api.expect(chunks).to_have_attribute("disabled", "true")
    for schedule, chunks_state in (("interleaved", "enabled"), ("gpipe", "disabled")):
        shown = figure.get_attribute("src")
        widget.locator("select").select_option(schedule)
        sync_api.expect(figure).not_to_have_attribute("src", shown)
        formula = bubble_formula(schedule, stages, microbatches, 2 if schedule == "interleaved" else 1, LESSON_COSTS)
        sync_api.expect(widget.locator(".widget-output")).to_contain_text(f"the paper's formula: {formula:.4f}")
        if chunks_state == "enabled":
            sync_api.expect(chunks).not_to_have_attribute("disabled", re.compile(".*"))
        else:
            sync_api.expect(chunks).to_have_attribute("disabled", "true")
        widget.screenshot(path=ARTIFACTS / f"05_schedule_explorer_{schedule}.png")
    assert page.errors == []


def _run_cell(page, call: str) -> None:
    """Run only the code cell whose source contains ``call`` (its cell needs no other), as Run > Run Selected Cell."""
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text=call))
    cell.locator(".jp-InputPrompt").click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run Selected Cell and Do not Advance").click()


def test_planner_form_changes_its_layout_with_the_gpus_and_enables_the_parameter_count_only_for_it(lab, page):
    from course_lib.planner.layouts import describe
    from course_lib.planner.search import plan

    lab.open(page, "06_3d_parallelism.ipynb")
    _run_cell(page, "planner_form(")
    widget = _widget(page, "planner_form(")
    sync_api.expect(widget.locator(".widget-output img")).to_be_visible()
    _assert_clean(page)
    widget.screenshot(path=ARTIFACTS / "06_planner_form.png")
    assert widget.evaluate(CUT_LABELS_JS) == []
    output = widget.locator(".widget-output")
    sync_api.expect(output).to_contain_text(describe(plan("llama3-70b", 512)) + ",")  # the lesson's call
    figure = output.locator("img").get_attribute("src")
    gpus = _control(widget, "GPUs").locator("input")
    gpus.fill("64")
    gpus.press("Enter")
    assert describe(plan("llama3-70b", 64)) != describe(plan("llama3-70b", 512))
    sync_api.expect(output).to_contain_text(describe(plan("llama3-70b", 64)) + ",")
    sync_api.expect(output.locator("img")).not_to_have_attribute("src", figure)
    widget.screenshot(path=ARTIFACTS / "06_planner_form_64_gpus.png")
    params = _control(widget, "Ψ (billions)").locator(".noUi-target")
    sync_api.expect(params).to_have_attribute("disabled", "true")
    widget.locator("select").select_option("parameter count")
    sync_api.expect(params).not_to_have_attribute("disabled", re.compile(".*"))
    sync_api.expect(output).to_contain_text("30.0B parameters")
    assert page.errors == []


def test_flashcards_flip_and_next_change_the_card(lab, page):
    from course_lib.practice.flashcards import load_deck

    deck = load_deck()
    lab.open(page, "09_practice.ipynb")
    _run_cell(page, "deck_widget(deck)")
    cell = page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea", has_text="deck_widget(deck)"))
    widget = cell.locator(".jp-OutputArea-output .widget-vbox").first
    sync_api.expect(widget).to_be_visible(timeout=30_000)
    _assert_clean(page)
    first = deck[0]
    sync_api.expect(widget).to_contain_text(first.question)
    assert first.answer not in widget.inner_text()
    widget.screenshot(path=ARTIFACTS / "09_flashcards_question.png")
    widget.get_by_role("button", name="Flip", exact=True).click()
    sync_api.expect(widget).to_contain_text(first.answer)
    widget.screenshot(path=ARTIFACTS / "09_flashcards_answer.png")
    widget.get_by_role("button", name="Next", exact=True).click()
    sync_api.expect(widget).to_contain_text(deck[1].question)
    sync_api.expect(widget).not_to_contain_text(first.question)
    widget.screenshot(path=ARTIFACTS / "09_flashcards_next.png")
    assert page.errors == []
