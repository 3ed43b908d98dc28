"""The command line: JSON contracts of memory, run and demo, and clear errors."""

import json
import os
import subprocess
import sys

import pytest

from course_lib.cli import main
from course_lib.model.config import GPTConfig
from course_lib.model.gpt import TinyGPT, count_params
from course_lib.parallel.zero import bucket_sizes


def run_json(capsys, *argv):
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_seven_billion_fp32_is_112_gb(capsys):
    data = run_json(capsys, "memory", "--params", "7e9", "--precision", "fp32")
    assert data["bytes_per_device"]["total"] == 112e9
    assert data["params"] == 7_000_000_000
    assert set(data["bytes_per_device"]) == {"params", "grads", "optimizer", "activations", "total", "stage"}


def test_memory_from_dims_with_activations(capsys):
    data = run_json(
        capsys,
        "memory",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--vocab",
        "128",
        "--seq",
        "32",
        "--micro-batch",
        "2",
        "--tp",
        "2",
        "--sp",
        "--zero",
        "1",
        "--dp",
        "4",
        "--attention",
        "materialized",
    )
    per_device = data["bytes_per_device"]
    total = count_params(TinyGPT(GPTConfig()), trainable_only=False)  # the same dims as the tiny GPT
    assert data["params"] == total
    norms = (2 * 2 + 1) * 2 * 64  # LayerNorm weights and biases, two per layer and a final one: whole on each TP rank
    assert per_device["optimizer"] == 8 * ((total - norms) / 2 + norms) / 4
    s, b, h, v = 32, 2, 64, 128  # per layer Korthikanti's count under SP; outside: ids, mask, head input, logits
    outside = (8 * s * b + s * b * h + 4 * s * b * h + 4 * s * b * v) / 2
    assert per_device["activations"] == 2 * s * b * h / 2 * (34 + 5 * 4 * s / h) + outside


def test_memory_human_output_prints_decimal_gb(capsys):
    assert main(["memory", "--params", "7e9"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "112.000 GB" in out


def test_memory_without_a_size_is_an_error():
    with pytest.raises(SystemExit, match="give --preset NAME, --params N"):
        main(["memory"])


def test_run_dp_json_has_the_contract(capsys, tmp_path):
    data = run_json(capsys, "run", "dp", "--world-size", "2", "--steps", "2", "--plot", str(tmp_path))
    assert {
        "scheme",
        "world_size",
        "params",
        "steps",
        "losses",
        "reference_losses",
        "max_abs_loss_diff",
        "max_abs_param_diff",
        "ranks",
    } <= set(data)
    assert data["scheme"] == "dp" and data["world_size"] == 2 and len(data["losses"]) == 2
    rank = data["ranks"][1]
    assert rank["rank"] == 1 and rank["coords"] == {"dp": 1}
    assert {"params", "grads", "optimizer", "activations_peak", "peak"} <= set(rank["memory"])
    assert rank["comm"]["all_reduce"]["bytes"] == 4 * data["params"]
    assert 0 < rank["wall_s"] < data["wall_s"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dp_n2_comm.png",
        "dp_n2_memory.png",
        "dp_n2_timeline.png",
        "dp_n2_trace.json",
    ]


def test_run_with_bad_sizes_is_a_clear_error():
    with pytest.raises(SystemExit, match="does not split evenly over 3"):
        main(["run", "dp", "--world-size", "3"])


def test_demo_prints_its_table(capsys, tmp_path):
    """The command end to end, one step per scheme (its figures: tests/test_plots.py), in this process: the console
    script's own start (``python -m course_lib``, which warms the rank server once the arguments are accepted) runs
    in the subprocess tests below, a launching command among them. Every scheme matches one device; sizes are in kB
    and MB; the MoE row is explained; the cross-scheme figure is drawn from the same reports."""
    from course_lib.cli.demo import save_summary, table

    assert main(["demo", "--steps", "1", "--world-size", "2", "--json", str(tmp_path / "demo.json")]) == 0
    out = capsys.readouterr().out
    reports = json.loads((tmp_path / "demo.json").read_text())["schemes"]
    schemes = {r["scheme"] for r in reports}
    rows = {words[0]: words for words in map(str.split, out.splitlines()) if words[1:2] and words[1].isdigit()}
    assert set(rows) == schemes and all(row[2] == "yes" for row in rows.values())
    assert rows["dp"][1] == "2" and rows["dp"][6] in ("kB", "MB")  # states per rank, in decimal units
    assert "ep trains another model, a mixture of experts" in out
    assert out.splitlines()[: len(table(reports, 1, "float32"))] == table(reports, 1, "float32")
    assert save_summary(reports, str(tmp_path)) == str(tmp_path / "summary.png") and (tmp_path / "summary.png").exists()


@pytest.mark.slow
def test_the_same_command_runs_under_torchrun(tmp_path):
    """(Slow: the default set runs the command under torchrun, its JSON with the reference's difference and rank 1's
    ledger checked, in tests/test_checkpoint.py::test_torchrun_restarts_the_job_from_its_last_checkpoint.)"""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out_file = tmp_path / "dp.json"
    subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "-m",
            "course_lib",
            "run",
            "dp",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--backend",
            "gloo",
            "--json",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data = json.loads(out_file.read_text())
    assert data["world_size"] == 2 and data["max_abs_loss_diff"] <= 1e-5
    assert data["ranks"][1]["comm"]["all_reduce"]["bytes"] == 4 * data["params"]


@pytest.mark.parametrize("scheme", ["zero1", "zero2", pytest.param("zero3", marks=pytest.mark.slow), "fsdp"])
def test_run_zero_stages_match_one_device(capsys, scheme):
    data = run_json(capsys, "run", scheme, "--world-size", "4", "--steps", "2")
    assert data["scheme"] == ("zero3" if scheme == "fsdp" else scheme)
    assert data["max_abs_loss_diff"] <= 1e-5 and data["rel_param_diff"] <= 1e-5


def test_run_flags_reach_the_scheme(capsys):
    naive = run_json(capsys, "run", "dp", "--world-size", "2", "--steps", "1", "--per-parameter", "--no-overlap")
    bucketed = run_json(capsys, "run", "dp", "--world-size", "2", "--steps", "1", "--bucket-mb", "1")
    accum = run_json(capsys, "run", "zero2", "--world-size", "2", "--steps", "1", "--grad-accum", "2")
    assert naive["ranks"][0]["comm"]["all_reduce"]["calls"] > bucketed["ranks"][0]["comm"]["all_reduce"]["calls"] == 1
    buckets = len(bucket_sizes(TinyGPT(GPTConfig()), 2))
    assert accum["ranks"][0]["comm"]["reduce_scatter"]["calls"] == 2 * buckets  # every micro-batch, every bucket
    with pytest.raises(SystemExit):  # refused by the parser (test_bad_numbers_and_paths_are_one_line_...)
        main(["run", "dp", "--bucket-mb", "0"])
    with pytest.raises(SystemExit, match="--bucket-mb is not a setting of zero3"):
        main(["run", "zero3", "--bucket-mb", "1"])


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_memory_reproduces_the_zero_paper_for_every_stage(capsys, stage, gb):
    data = run_json(capsys, "memory", "--params", "7.5e9", "--precision", "mixed", "--zero", str(stage), "--dp", "64")
    assert data["bytes_per_device"]["total"] == gb * 1e9


@pytest.mark.parametrize("dp", [1, 8, 1000])
def test_memory_zero_stages_for_any_psi_and_degree(capsys, dp):
    psi = 3e9
    for stage, expected in enumerate([16 * psi, 4 * psi + 12 * psi / dp, 2 * psi + 14 * psi / dp, 16 * psi / dp]):
        data = run_json(
            capsys, "memory", "--params", "3e9", "--precision", "mixed", "--zero", str(stage), "--dp", str(dp)
        )
        assert data["bytes_per_device"]["total"] == pytest.approx(expected, rel=1e-12)


def test_run_with_hardware_adds_the_modeled_section(capsys):
    data = run_json(
        capsys, "run", "dp", "--world-size", "2", "--steps", "2", "--hardware", "h100", "--gpus-per-node", "1"
    )
    modeled = data["modeled"]
    assert set(modeled) == {
        "hardware",
        "gpus_per_node",
        "step_time_s",
        "compute_s",
        "comm_s",
        "exposed_comm_s",
        "bubble_fraction",
    }
    assert modeled["hardware"] == "h100" and modeled["gpus_per_node"] == 1
    assert 0 < modeled["compute_s"] < modeled["step_time_s"]
    # A modeled run defaults to a model large enough that compute shows beside communication (the tiny GPT's
    # compute was 0.1% of the step).
    assert modeled["compute_s"] / modeled["step_time_s"] > 0.05
    assert data["params"] == count_params(TinyGPT(GPTConfig(d_model=256, seq=128)))
    assert all({"step_time_s", "exposed_comm_s", "bubble_fraction"} <= set(r["modeled"]) for r in data["ranks"])
    with pytest.raises(SystemExit, match="unknown hardware 'tpu'"):
        main(["run", "dp", "--hardware", "tpu"])


def test_hardware_lists_profiles_with_sources(capsys):
    data = run_json(capsys, "hardware")
    assert {"h100", "a100", "pcie"} <= set(data)
    assert data["h100"]["gpus_per_node"] == 8 and data["h100"]["sources"]


@pytest.mark.parametrize("scheme", [pytest.param("tp", marks=pytest.mark.slow), "sp"])  # sp takes tp's path and more
def test_run_tensor_parallel_matches_one_device(capsys, scheme):
    data = run_json(capsys, "run", scheme, "--tp", "4", "--steps", "2")
    assert data["scheme"] == scheme and data["world_size"] == 4
    assert data["max_abs_loss_diff"] <= 1e-5 and data["rel_param_diff"] <= 1e-5
    assert data["ranks"][3]["coords"] == {"tp": 3}
    with pytest.raises(SystemExit, match="tensor-parallel degree 3 does not divide the heads = 4"):
        main(["run", scheme, "--tp", "3"])
    with pytest.raises(SystemExit, match="--world-size 4 but --tp 2; both give the number of ranks"):
        main(["run", scheme, "--tp", "2", "--world-size", "4"])


def test_schedule_command_answers_with_bubble_makespan_and_actions(capsys, tmp_path):
    data = run_json(
        capsys,
        "schedule",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--plot",
        str(tmp_path / "s.png"),
    )
    assert data["bubble_fraction"] == pytest.approx(3 / 11) and data["makespan"] == 22
    assert data["peak_inflight"] == [4, 3, 2, 1]
    assert data["actions"][3][:3] == ["RECV_F0<-2", "F0", "B0"] and (tmp_path / "s.png").exists()
    zb = run_json(capsys, "schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--w", "1")
    assert zb["bubble_fraction"] == pytest.approx(zb["bubble_formula"]) == pytest.approx(3 / 27)
    with pytest.raises(SystemExit, match="not a multiple of 4"):
        main(["schedule", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6", "--chunks", "2"])


def test_schedule_command_gives_no_zb_h1_formula_where_it_does_not_hold(capsys):
    # W = 3 outlasts the waits it would fill: Qi et al.'s closed form gives a negative bubble there; the simulated
    # table idles 3 units per stage of 43, 7%.
    argv = ["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--w", "3"]
    data = run_json(capsys, *argv)
    assert data["bubble_formula"] is None and data["bubble_fraction"] == pytest.approx(3 / 43)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bubble fraction 0.0698 (formula: none here; Qi et al.'s ZB-H1 closed form holds" in out and "-0." not in out


@pytest.mark.slow  # run pp's bubble lines: tests/test_run_report.py; the modeled bubble: lesson 05 §7
def test_run_pp_reports_its_bubble(capsys):
    data = run_json(
        capsys,
        "run",
        "pp",
        "--world-size",
        "2",
        "--schedule",
        "gpipe",
        "--microbatches",
        "2",
        "--steps",
        "2",
        "--hardware",
        "h100",
    )
    assert data["max_abs_loss_diff"] <= 1e-5 and data["pipeline"]["planned_bubble_fraction"] == pytest.approx(1 / 3)
    assert data["bubble_fraction"] == data["modeled"]["bubble_fraction"] > 0
    with pytest.raises(SystemExit, match="fewer than 4"):
        main(["run", "pp", "--world-size", "4", "--schedule", "interleaved", "--microbatches", "2", "--chunks", "2"])


def cli(*argv, stdin=None, timeout=30):
    return subprocess.run(
        [sys.executable, "-m", "course_lib", *argv], capture_output=True, text=True, timeout=timeout, input=stdin
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "dp", "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: the folder /nonexistent does"),
    ],
)
def test_bad_numbers_and_paths_are_one_line_before_any_rank_starts(argv, message):
    """As a real process sees it (tests/test_bad_inputs.py holds the whole table, in process)."""
    done = cli(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["hardware"],  # the one BrokenPipeError handler in main serves every command
        pytest.param(["run", "dp", "--world-size", "2", "--steps", "1"], marks=pytest.mark.slow),
    ],
    ids=["hardware", "run"],
)
def test_json_into_a_closed_pipe_ends_quietly(argv):
    """``--json - | head -1``: the reader leaves early; no BrokenPipeError traceback. One handler in ``main`` serves
    every command; the default set checks it on a command that launches ranks, the slow set on one that does not."""
    done = subprocess.run(
        f"{sys.executable} -m course_lib {' '.join(argv)} --json - | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == "{\n" and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr


def test_run_takes_the_model_sizes(capsys):
    data = run_json(capsys, "run", "tp", "--tp", "2", "--hidden", "32", "--heads", "2", "--seq", "16", "--steps", "1")
    assert data["params"] == count_params(TinyGPT(GPTConfig(d_model=32, heads=2, seq=16)))
    assert data["max_abs_loss_diff"] < 1e-5
    with pytest.raises(SystemExit, match="heads=3 must divide d_model=64"):
        main(["run", "tp", "--tp", "2", "--heads", "3"])


def test_a_rank_failure_is_the_rank_error_alone(monkeypatch, capsys):
    """The CLI prints the RankError (which rank, why, its own traceback), not the launcher's stack above it."""
    from course_lib import harness
    from course_lib.runtime import launch

    def fails(*args, **kwargs):
        raise launch.RankError("rank 1 of 2 raised ValueError: broken on purpose")

    monkeypatch.setattr(harness, "run_scheme", fails)
    assert main(["run", "dp", "--world-size", "2"]) == 1
    out, err = capsys.readouterr()
    assert err == "course-lib run: rank 1 of 2 raised ValueError: broken on purpose\n" and out == ""


def test_a_result_that_cannot_be_written_still_reaches_standard_output(capsys):
    """... and the command exits 1, so a script or a CI step knows the file is not there."""
    assert main(["schedule", "--stages", "2", "--microbatches", "2", "--json", "/dev/full"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("course-lib: could not write /dev/full (No space left on device); the JSON follows")
    data, _ = json.JSONDecoder().raw_decode(out)  # the JSON first, then the usual human lines
    assert data["bubble_fraction"] == pytest.approx(1 / 3)


def test_run_single_starts_no_process(monkeypatch, capsys):
    """One rank needs no launcher: it trains in this process, beside the reference, and matches it exactly."""
    from course_lib.runtime import launch

    def refuse(*args, **kwargs):
        raise AssertionError("run single started a rank process")

    monkeypatch.setattr(launch, "_run_local", refuse)
    data = run_json(capsys, "run", "single", "--steps", "2")
    assert data["world_size"] == 1 and data["max_abs_loss_diff"] == 0 and data["max_abs_param_diff"] == 0
    assert data["ranks"][0]["memory"]["grads"] > 0 and data["ranks"][0]["wall_s"] > 0


def test_ctrl_c_is_one_line_and_the_shells_status(monkeypatch, capsys):
    from course_lib import harness

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "run_scheme", interrupted)
    assert main(["run", "dp", "--world-size", "2"]) == 130
    assert capsys.readouterr().err == "course-lib run: interrupted (Ctrl-C); no rank is left running\n"


RANK_FAILURE = """rank 1 of 2 raised RuntimeError: broken on rank 1

--- traceback of rank 1 ---
Traceback (most recent call last):
  File "/repo/course_lib/parallel/data.py", line 335, in accumulate
    loss = strategy.model(x, y) / grad_accum
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
  File "/home/me/my_model.py", line 9, in forward
    raise RuntimeError("broken on rank 1")
RuntimeError: broken on rank 1

other ranks:
  rank 0: raised RuntimeError: Connection reset by peer during step 0"""


def test_a_ranks_failure_is_its_first_line_and_its_own_innermost_frames():
    from course_lib.cli import short_failure

    assert short_failure(RANK_FAILURE).splitlines() == [
        "rank 1 of 2 raised RuntimeError: broken on rank 1",
        '  /home/me/my_model.py, line 9, in forward: raise RuntimeError("broken on rank 1")',
        "  /repo/course_lib/parallel/data.py, line 335, in accumulate: loss = strategy.model(x, y) / grad_accum",
        "  (--traceback: the whole traceback, and what the other ranks were doing)",
    ]
    stalled = "rank 1 of 2 stalled in all_reduce #3 on world for 20 s\n  rank 0: busy in forward"
    assert short_failure(stalled) == stalled  # no traceback: already what to read


def test_run_traceback_prints_the_whole_failure(monkeypatch, capsys):
    from course_lib import harness
    from course_lib.runtime.launch import RankError

    def fails(*args, **kwargs):
        raise RankError(RANK_FAILURE)

    monkeypatch.setattr(harness, "run_scheme", fails)
    assert main(["run", "dp", "--world-size", "2", "--traceback"]) == 1
    assert capsys.readouterr().err == f"course-lib run: {RANK_FAILURE}\n"
    assert main(["run", "dp", "--world-size", "2"]) == 1
    assert "(--traceback: the whole traceback" in capsys.readouterr().err
