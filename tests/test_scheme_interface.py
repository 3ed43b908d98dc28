"""The scheme interface (course_lib/parallel/interface.py): every registered scheme implements it consistently, the
harness and the command line hold no scheme-specific code, and a new scheme (tests/toy_scheme.py) needs nothing
but its module and one registry line to run, be checked and be predicted."""

import ast
import inspect
import json
from pathlib import Path

import pytest
import toy_scheme  # tests/ is on sys.path (pytest's rootdir-less test modules)

from course_lib import cli, harness
from course_lib.harness import SCHEMES, run_scheme
from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.parallel import catalog

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def with_toy(monkeypatch):
    """The one registry line and the catalog's card: what adding tests/toy_scheme.py to SCHEME_MODULES and its
    card to parallel/catalog.py's CARDS does."""
    for spec in toy_scheme.SCHEMES:
        monkeypatch.setitem(SCHEMES, spec.name, spec)
    monkeypatch.setitem(catalog.CARDS, toy_scheme.CARD.name, toy_scheme.CARD)


def test_a_new_scheme_runs_through_the_harness_equal_to_one_device_and_to_its_formulas(with_toy):
    run = run_scheme("gather_dp", 4, train=TrainConfig(steps=2, dtype="float64"), grad_accum=2)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    for rank, sent, held in zip(run.report["ranks"], run.predicted_comm, run.predicted_memory, strict=True):
        assert {op: c["bytes"] for op, c in rank["comm"].items()} == sent
        assert {c: rank["memory"][c] for c in CATEGORIES} == {c: held[c] for c in CATEGORIES}
        assert rank["memory"]["activations_peak"] == held["activations"]
    dp = run_scheme("dp", 4, train=TrainConfig(steps=1, dtype="float64"))
    gathered, reduced = (r.predicted_comm[0] for r in (run, dp))
    assert gathered["all_gather"] == 2 * reduced["all_reduce"]  # (n-1) vs 2(n-1)/n copies, n = 4


def test_a_new_scheme_is_on_the_command_line_with_its_options_and_checks(with_toy, capsys):
    assert cli.main(["run", "gather_dp", "--world-size", "2", "--steps", "1", "--grad-accum", "2", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"] == "gather_dp" and report["options"] == {"grad_accum": 2}
    assert report["max_abs_loss_diff"] <= 1e-5
    with pytest.raises(SystemExit, match="--per-parameter is not a setting of gather_dp; it takes --dp, --grad-accum"):
        cli.main(["run", "gather_dp", "--per-parameter"])
    with pytest.raises(SystemExit, match="does not split evenly over 3 data-parallel ranks"):
        cli.main(["run", "gather_dp", "--world-size", "3"])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_implements_the_interface(name):
    spec = SCHEMES[name]
    keywords = inspect.signature(spec.train).parameters
    assert {o.name for o in spec.options} <= set(keywords), "an option that the rank function does not take"
    settings = spec.settings({})
    world_size = spec.grid_size(settings) or 2
    cfg = GPTConfig(layers=spec.layers_needed(world_size, settings) if spec.layers_needed else 2, **spec.model_settings)
    train = TrainConfig()
    spec.validate(world_size, cfg, train, settings)
    memory = spec.predict_memory(world_size, cfg, train, settings)
    comm = spec.predict_comm(world_size, cfg, train, settings)
    assert len(memory) == len(comm) == world_size
    # An MoE model's activations depend on how many tokens the router sends each rank: no formula, no row entry.
    predicted = {*CATEGORIES} if cfg.experts else {*CATEGORIES, "activations"}
    assert all(set(row) == predicted for row in memory)
    assert spec.summary


def test_an_option_a_scheme_does_not_take_is_refused_naming_those_it_does():
    with pytest.raises(ValueError, match=r"scheme 'pp' takes no option\(s\) \['grad_accum'\]; it takes \['chunks'"):
        harness.validate("pp", 2, GPTConfig(), TrainConfig(), {"grad_accum": 2})


@pytest.mark.parametrize(
    "path",
    ["course_lib/harness.py", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "course_lib/cli").glob("*.py"))],
)
def test_the_harness_and_the_command_line_branch_on_no_scheme(path):
    """No ``if spec.name == "pp"`` or ``scheme in ("pp", "3d")``: no comparison in either file names a scheme."""
    tree = ast.parse((ROOT / path).read_text())
    named = [
        node.value
        for compare in ast.walk(tree)
        if isinstance(compare, ast.Compare)
        for node in ast.walk(compare)
        if isinstance(node, ast.Constant) and node.value in SCHEMES
    ]
    assert named == [], f"{path} branches on schemes {named}"
