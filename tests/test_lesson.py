"""The core lesson (notebooks/00_lesson.ipynb) keeps what the source lesson holds: its parameters cell, the five
schemes each run, the synthesis table, the decision tree whose leaves name the deep dives, the seven self-check
questions with their answers, scenarios a-d graded, Parts B and C answered, and the nine flashcards; its check cells
stay folded. Runs nothing heavy: the notebook itself runs under nbval."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.practice.flashcards import load_deck  # noqa: E402
from course_lib.ui.lesson_figures import DECISION_LEAVES, leaf_for, plot_decision_tree  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_lesson.ipynb"
DEEP_DIVES = ("02_data_parallel", "03_zero_fsdp", "04_tensor_parallel", "05_pipeline_parallel", "06_3d_parallelism")


@pytest.fixture(scope="module")
def cells() -> list[dict]:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"]


def _text(cells: list[dict], kind: str) -> str:
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == kind)


def test_one_parameters_cell_with_backend_and_world_size(cells):
    tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1
    assert 'backend = "auto"' in "".join(tagged[0]["source"]) and "world_size = 4" in "".join(tagged[0]["source"])


def test_no_outputs_stored_and_check_cells_folded(cells):
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    checks = [c for c in code if "".join(c["source"]).startswith("# Check")]
    assert len(checks) >= 10
    assert all(c["metadata"].get("jupyter", {}).get("source_hidden") for c in checks)


def test_credits_the_source(cells):
    assert "adapted from Stanford CS336 (Spring 2025), lectures 7-8 on parallelism" in _text(cells, "markdown")


def test_every_scheme_runs_for_real(cells):
    code = _text(cells, "code")
    for scheme in ("dp", "tp", "sp", "pp", "zero1", "zero3", "3d"):
        assert re.search(rf'run_scheme\("{scheme}", n\b', code), scheme
    assert "max_abs_loss_diff" in code


def test_the_synthesis_table_and_the_tree_with_its_links(cells):
    prose = _text(cells, "markdown")
    assert "| scheme | what it splits | what it communicates, how often | where it fits | its limit |" in prose
    for row in ("| DP |", "| FSDP / ZeRO |", "| TP |", "| PP |", "| 3D |"):
        assert row in prose
    assert "lf.plot_decision_tree(" in _text(cells, "code")
    for notebook in (*DEEP_DIVES, "07_experts_and_context"):
        assert f"({notebook}.ipynb)" in prose


def test_the_seven_self_check_questions_each_with_an_answer(cells):
    prose = _text(cells, "markdown")
    section = prose.split("### Self-check")[1].split("### Pick the parallelism")[0]
    numbers = re.findall(r"^\*\*(\d)\. .+\?\*\*$", section, flags=re.M)
    assert numbers == [str(i) for i in range(1, 8)]
    assert section.count("<details><summary>Show answer</summary>") == 7 == section.count("</details>")


def test_scenarios_a_to_d_graded_and_parts_b_c_answered(cells):
    code = _text(cells, "code")
    answers = re.search(r"my_answers = \{(.*?)\}", code, flags=re.S).group(1)
    assert re.findall(r'"([a-d])":', answers) == ["a", "b", "c", "d"]
    assert "grade(key, answer)" in code
    prose = _text(cells, "markdown")
    for part in ("**Part A.**", "**Part B.**", "**Part C.**"):
        assert part in prose
    assert prose.count("<details><summary>Show a model answer</summary>") == 2


def test_the_nine_practice_flashcards_in_the_widget(cells):
    code = _text(cells, "code")
    assert 'if "practice" in card.tags' in code and "deck_widget(cards)" in code
    assert len([c for c in load_deck() if "practice" in c.tags]) == 9


def test_where_next_lists_the_deep_dives_in_order(cells):
    section = _text(cells, "markdown").split("## 7. Where next")[1]
    names = re.findall(r"\[(\d\d\w*)\]", section)
    assert names == sorted(names) and len(names) >= 12
    assert all((NOTEBOOK.parent / f"{name}.ipynb").is_file() for name in names)
    assert set(DEEP_DIVES) <= set(names)


def test_decision_tree_leaves_name_the_five_deep_dives():
    fig = plot_decision_tree({"1B": 1e9, "30B": 30e9, "200B": 200e9})
    texts = [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    leaf_texts = [t for t in texts if "->" in t]
    assert len(leaf_texts) == len(DECISION_LEAVES) == 4
    for notebook in DEEP_DIVES:
        assert any(notebook in t for t in leaf_texts), notebook
    assert any("1B: 16 GB" in t for t in texts) and any("200B: 3,200 GB" in t for t in texts)


@pytest.mark.parametrize(("params", "leaf"), [(1e9, "dp"), (30e9, "node"), (200e9, "3d"), (5e9, "dp"), (40e9, "node")])
def test_leaf_for_follows_sixteen_bytes_per_parameter(params, leaf):
    assert leaf_for(params) == leaf
