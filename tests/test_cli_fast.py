"""The command line says no, and helps, without torch and without starting a process (issues 36 and 37).

Every ``--help`` and every refusal of an argument runs here as a real ``python -m course_lib`` process, through a
probe (``runpy``, as ``-m`` does) that records, after the command has ended, whether torch was imported and which
child processes it left. A refused command answers in one line on standard error, naming the command as it was typed
(``python -m course_lib``), and leaves no process behind: the rank server starts only for a run that was accepted.
Speed is measured apart, in ``benchmarks/cli_refusals.py``. Sizes with suffixes (``7B``) are unit-tested here too.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.cli import build_parser, main
from course_lib.cli.common import gpu_count, param_count, program_name, token_count

COMMANDS = ["memory", "run", "demo", "schedule", "hardware", "calibrate", "plan", "goodput"]

PROBE = r"""
import json, os, runpy, sys

report = sys.argv.pop(1)
try:
    runpy.run_module("course_lib", run_name="__main__", alter_sys=True)
finally:
    children = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children += f.read().split()
    commands = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            commands.append(f.read().replace(b"\0", b" ").decode())
    with open(report, "w") as f:
        json.dump({"torch": "torch" in sys.modules, "children": commands}, f)
"""


def probe(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m course_lib ARGV`` as the probe runs it: the process, and what it had imported and left running."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(report), *argv], capture_output=True, text=True, timeout=120
    )
    return done, json.loads(report.read_text())


@pytest.mark.parametrize("argv", [[], *[[command] for command in COMMANDS]], ids=["(top)", *COMMANDS])
def test_every_help_answers_without_torch(argv, tmp_path):
    done, seen = probe(tmp_path, *argv, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(f"usage: python -m course_lib {' '.join(argv)}".rstrip()), done.stdout
    assert not seen["torch"] and seen["children"] == [], seen
    if argv:
        assert "\nexamples:\n  # " in done.stdout
    else:  # the sentence under the usage names every command
        assert all(command in done.stdout.split("\n\n")[1] for command in COMMANDS), done.stdout
    if argv == ["run"]:
        for group in ("what to run", "model and data", "schedule", "precision", "faults", "checkpoints", "output"):
            assert f"\n{group}" in done.stdout, group


REFUSED = [
    # (argv, exit status, what the one line says)
    ([], 2, "the following arguments are required: command"),
    (["train"], 2, "invalid choice: 'train'"),
    (["--version"], 2, "the following arguments are required: command"),
    (["memory", "--params", "7X"], 2, "argument --params: '7X' is not a number (a count such as 7B"),
    (["memory", "--params=-7B"], 2, "argument --params: must be a finite number greater than 0, got -7B"),
    (["memory", "--params", "7B", "more"], 2, "unrecognized arguments: more"),
    (["memory", "--params", "2e15"], 2, "argument --params: must be at most 1e+15"),
    (["memory", "--params", "7B", "--precision", "fp8"], 2, "invalid choice: 'fp8'"),
    (["memory", "--seq", "8.5"], 2, "argument --seq: must be a whole number of at least 1, got 8.5"),
    (["memory", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["run"], 2, "the following arguments are required: scheme"),
    (["run", "nope"], 2, "invalid choice: 'nope'"),
    (["run", "dp", "--steps", "0"], 2, "argument --steps: must be a whole number of at least 1"),
    (["run", "dp", "--backend", "mpi"], 2, "argument --backend: invalid choice: 'mpi'"),
    (["run", "dp", "--dtype", "float16"], 2, "argument --dtype: invalid choice: 'float16'"),
    (["run", "dp", "--bucket-mb", "-1"], 2, "argument --bucket-mb: must be a finite number greater than 0"),
    (["run", "dp", "--fault", "melt"], 2, "argument --fault: invalid choice: 'melt'"),
    (["run", "dp", "--seed", "-1"], 2, "argument --seed: must be a whole number of at least 0"),
    (["run", "dp", "--tp", "2"], 1, "run dp: --tp is not a setting of dp; it takes"),
    (["run", "dp", "--one-bucket", "--bucket-mb", "1"], 1, "--bucket-mb and --one-bucket both set bucket_mb"),
    (["run", "dp", "--kill-rank", "1"], 1, "a fault needs both --kill-rank R and --at-step K"),
    (["run", "dp", "--auto-resume"], 1, "--auto-resume resumes from the newest checkpoint in --checkpoint-dir D"),
    (["run", "dp", "--json", "/nonexistent/x.json"], 2, "--json /nonexistent/x.json: the folder /nonexistent"),
    (["demo", "--world-size", "0"], 2, "argument --world-size: must be a whole number of at least 1"),
    (["demo", "--steps", "x"], 2, "argument --steps: 'x' is not an integer"),
    (["demo", "--hardware", "h100"], 2, "unrecognized arguments: --hardware h100"),
    (["schedule", "--schedule", "zz"], 2, "argument --schedule: invalid choice: 'zz'"),
    (["schedule", "--stages", "0"], 2, "argument --stages: must be a whole number of at least 1"),
    (["schedule", "--w", "-1"], 2, "argument --w: must be a finite number of at least 0"),
    (["schedule", "--plot", "schedule.xyz"], 2, "--plot schedule.xyz: give a file name ending in one of"),
    (["plan"], 2, "the following arguments are required: --gpus"),
    (["plan", "--gpus", "0"], 2, "argument --gpus: must be a whole number of at least 1"),
    (["plan", "--gpus", "2.5"], 2, "argument --gpus: must be a whole number of at least 1, got 2.5"),
    (["plan", "--gpus", "1e9"], 2, "argument --gpus: must be at most 131,072 (eight times the largest published"),
    (["plan", "--gpus", "8", "--preset", "gpt5"], 2, "argument --preset: invalid choice: 'gpt5'"),
    (["plan", "--gpus", "8", "--schedule", "gpipe"], 2, "argument --schedule: invalid choice: 'gpipe'"),
    (["plan", "--gpus", "8", "--params", "nan"], 2, "argument --params: must be a finite number greater than 0"),
    (["goodput"], 2, "the following arguments are required: --gpus"),
    (["goodput", "--gpus", "-5"], 2, "argument --gpus: must be a whole number of at least 1, got -5"),
    (["goodput", "--gpus", "8", "--preset", "x"], 2, "argument --preset: invalid choice: 'x'"),
    (["goodput", "--gpus", "8", "--write-gbps", "0"], 2, "argument --write-gbps: must be a finite number"),
    (["hardware", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["hardware", "--json", "/nonexistent/h.json"], 2, "--json /nonexistent/h.json: the folder /nonexistent"),
    (["calibrate", "--links", "tpu"], 2, "argument --links: invalid choice: 'tpu'"),
    (["calibrate", "--out", "/nonexistent/p.json"], 2, "--out /nonexistent/p.json: the folder /nonexistent"),
]


def test_the_refusals_cover_every_command():
    assert len(REFUSED) >= 30
    assert {argv[0] for argv, _, _ in REFUSED if argv and not argv[0].startswith("-")} >= set(COMMANDS)


def _first_of_each_command(rows: list[tuple]) -> list:
    """The rows as parameters, the first of each command in the default set and the rest slow: every command's
    refusal path runs in a real process each time, the whole table in make test-slow (and CI), and every row in
    process in tests/test_bad_inputs.py's style."""
    seen: set[str] = set()
    params = []
    for argv, status, said in rows:
        command = argv[0] if argv else ""
        params.append(pytest.param(argv, status, said, marks=[pytest.mark.slow] * (command in seen)))
        seen.add(command)
    return params


@pytest.mark.parametrize(
    ("argv", "status", "said"), _first_of_each_command(REFUSED), ids=[" ".join(a) or "(nothing)" for a, _, _ in REFUSED]
)
def test_a_refusal_is_one_line_without_torch_or_a_process(argv, status, said, tmp_path):
    done, seen = probe(tmp_path, *argv)
    assert done.returncode == status and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert said in done.stderr, done.stderr
    if status == 2:  # argparse's refusals name the command as it was typed, and where its help is
        command = " ".join(["python -m course_lib", *argv[:1]]) if argv and argv[0] in COMMANDS else None
        assert done.stderr.startswith(f"{command or 'python -m course_lib'}: error: ")
        assert done.stderr.rstrip().endswith(f"(see: {command or 'python -m course_lib'} --help)")
    assert not seen["torch"], "torch was imported to refuse a command line"
    assert seen["children"] == [], f"a refused command left processes: {seen['children']}"


BROKEN_MODEL = """
import torch
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, targets):
        return self.w.sum() * float("nan")


def make():
    return Broken()
"""


def test_a_run_refused_after_the_rank_server_started_leaves_it_stopped(tmp_path):
    """The one refusal that needs torch: a student's model is built and its first loss computed (here NaN) after
    the rank server started warming beside it (every scheme setting is refused before, without torch:
    tests/test_bad_inputs.py); the refusal ends the server at once instead of leaving it importing."""
    (tmp_path / "broken.py").write_text(BROKEN_MODEL)
    done, seen = probe(tmp_path, "run", "dp", "--world-size", "2", "--model", f"{tmp_path / 'broken.py'}:make")
    assert done.returncode == 1 and "loss on the first batch is nan" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not [c for c in seen["children"] if "forkserver" in c], seen["children"]


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert sorted(commands) == sorted(COMMANDS)
    silent = [
        f"{name} {action.option_strings or action.dest}"
        for name, command in commands.items()
        for action in command._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert silent == []


def test_every_example_in_every_help_parses():
    """The examples each ``--help`` shows are command lines its parser accepts."""
    for name in COMMANDS:
        assert 2 <= len(examples(name)) <= 4, name
        for argv in examples(name):
            assert build_parser().parse_args([name, *argv]).command == name


def examples(name: str) -> list[list[str]]:
    """The command lines of ``name``'s examples, as its ``--help`` shows them (after the command's name)."""
    parser = build_parser()
    command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return [shlex.split(line.split("%(prog)s", 1)[1]) for line in command.epilog.splitlines() if "%(prog)s" in line]


@pytest.mark.parametrize("name", ["memory", "schedule", "hardware", "plan", "goodput"])
def test_the_examples_of_the_commands_that_start_no_rank_run(name, tmp_path, monkeypatch, capsys):
    """(run's and demo's examples parse, above; tests/test_cli.py runs commands like them.)"""
    monkeypatch.chdir(tmp_path)  # schedule's example draws into out/
    for argv in examples(name):
        assert main([name, *argv]) == 0, argv
        assert capsys.readouterr().out


def test_demo_help_names_no_flag_it_does_not_take():
    parser = build_parser()
    demo = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["demo"]
    flags = {flag for action in demo._actions for flag in action.option_strings}
    named = {word.strip("(),;:.") for word in demo.format_help().split() if word.startswith("--")}
    assert named <= flags, named - flags


def test_the_program_is_named_as_it_was_typed():
    assert program_name("/anywhere/site-packages/course_lib/__main__.py") == "python -m course_lib"
    assert program_name("/anywhere/.venv/bin/course-lib") == "course-lib"
    assert program_name("/anywhere/site-packages/pytest/__main__.py") == "course-lib"  # in-process callers


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (param_count, "7B", 7e9),
        (param_count, "7b", 7e9),
        (param_count, "175e9", 175e9),
        (param_count, "1.5T", 1.5e12),
        (param_count, "70M", 70e6),
        (param_count, "8K", 8e3),
        (param_count, "1.5G", 1.5e9),
        (param_count, "1e15", 1e15),
        (gpu_count, "16K", 16_000),
        (gpu_count, "16384", 16_384),
        (gpu_count, "1.1k", 1_100),
        (token_count, "8K", 8_000),
        (token_count, "128k", 128_000),
    ],
)
def test_a_size_takes_a_suffix(parse, text, value):
    assert parse(text) == value and type(parse(text)) is type(value)


@pytest.mark.parametrize(
    ("parse", "text", "said"),
    [
        (param_count, "0", "must be a finite number greater than 0, got 0"),
        (param_count, "-7B", "must be a finite number greater than 0, got -7B"),
        (param_count, "nan", "must be a finite number greater than 0"),
        (param_count, "infB", "must be a finite number greater than 0"),
        (param_count, "0.5", "must be at least 1, got 0.5"),
        (param_count, "2e15", "must be at most 1e+15"),
        (param_count, "1e999999999T", "must be at most 1e+15"),
        (param_count, "7X", "'7X' is not a number"),
        (param_count, "B", "'B' is not a number"),
        (param_count, "", "'' is not a number"),
        (gpu_count, "0K", "must be a whole number of at least 1"),
        (gpu_count, "1.5", "must be a whole number of at least 1, got 1.5"),
        (gpu_count, "1.0001K", "must be a whole number of at least 1"),
        (gpu_count, "11M", "must be at most 131,072"),
        (token_count, "2G", "must be at most 1e+09"),
    ],
)
def test_a_size_refuses_what_is_no_count(parse, text, said):
    with pytest.raises(argparse.ArgumentTypeError, match="^" + said.replace("+", r"\+").replace("(", r"\(")):
        parse(text)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "dp", "--layers", "10000000"], "run dp: the one-device reference would need about"),  # 20 TB
        (["demo", "--layers", "10000000"], "demo: the one-device reference would need about"),
        (["run", "dp", "--seed", "99999999999999999999999"], "run dp: seed must be a whole number from 0 to"),
    ],
)
def test_a_model_this_machine_cannot_hold_or_a_bad_seed_is_refused_without_torch(argv, said, tmp_path):
    """The sizes the model's own formulas refuse (issue 37: a run that climbed past 13 GB, ranks that died on a seed)
    answer before torch is imported, like the argument-level refusals."""
    done, seen = probe(tmp_path, *argv)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not seen["torch"], "torch was imported to refuse a command line"
    assert seen["children"] == [], f"a refused command left processes: {seen['children']}"


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--gpus", "64", "--preset", "llama3-8b"],
        ["goodput", "--gpus", "1024"],
        *[  # the same torch-free modules, in make test-slow
            pytest.param(argv, marks=pytest.mark.slow)
            for argv in (
                ["memory", "--preset", "llama3-8b", "--tp", "2"],
                ["hardware"],
                ["schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8"],
            )
        ],
    ],
    ids=lambda argv: argv[0],
)
def test_the_commands_that_train_nothing_never_import_torch(argv, tmp_path):
    """The planner, the memory formulas, the schedules and the modeled cluster are torch-free: these commands answer
    in a few tenths of a second (architecture.md, "Interfaces"; a schedule's figure draws with the ui's plots, which
    import torch)."""
    done, seen = probe(tmp_path, *argv)
    assert done.returncode == 0, done.stderr
    assert not seen["torch"] and seen["children"] == [], seen
