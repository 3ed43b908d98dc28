"""The README's "Your own model and your own script", run as written: its ``my_model.py`` and ``train_mine.py``
saved side by side, the script run from their folder (in this process, whose rank server is warm), and the
``run dp --model`` command line, so that the README cannot drift from the library."""

import re
import runpy
import shlex
from pathlib import Path

from course_lib.cli import main

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Your own model and your own script"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start + len(SECTION))]


def block_before(label: str, language: str) -> str:
    """The first fenced ``language`` block after ``label`` in the section."""
    rest = section()[section().index(label) :]
    return re.search(rf"```{language}\n(.*?)```", rest, re.S).group(1)


def test_the_script_trains_like_one_process_with_each_wrapper(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(block_before("`my_model.py`", "python"))
    (tmp_path / "train_mine.py").write_text(block_before("`train_mine.py`", "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(tmp_path)  # as python puts a script's folder first
    runpy.run_path("train_mine.py", run_name="__main__")  # in this process: the rank server is warm already
    out = capsys.readouterr().out
    lines = re.findall(r"rank (\d), +(\w+): (\S+) from one process", out)
    assert sorted((rank, wrapper) for rank, wrapper, _ in lines) == [
        (rank, wrapper) for rank in "01" for wrapper in ("dp", "fsdp", "zero")
    ], out
    assert all(float(apart) <= 1e-6 for _, _, apart in lines), out


def test_the_command_line_trains_my_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(block_before("`my_model.py`", "python"))
    (command,) = [line for line in block_before("Train it", "bash").splitlines() if "--model" in line]
    words = shlex.split(command)
    assert words[:3] == [".venv/bin/python", "-m", "course_lib"]
    monkeypatch.chdir(tmp_path)
    assert main(words[3:]) == 0
    differences = re.search(r"max \|loss diff\| (\S+)\s+max \|param diff\| (\S+)", capsys.readouterr().out)
    assert differences is not None and max(float(x) for x in differences.groups()) <= 1e-5
