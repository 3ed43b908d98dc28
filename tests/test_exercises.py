"""The pick-the-parallelism grader: the lesson's answers to scenarios a-d are accepted, wrong ones rejected with a
reason that carries the planner's numbers."""

import pytest

from course_lib.exercises import grade, load, model_answers, parse


@pytest.mark.parametrize(
    ("scenario", "answer"),
    [
        ("a", "Data parallelism alone"),
        ("a", "dp=8"),
        ("b", "Tensor parallelism within the node"),
        ("b", "TP in the node + DP"),
        ("b", "FSDP"),  # the lesson: a reasonable alternative
        ("c", "3D: TP within nodes, PP across nodes, DP on top"),
        ("c", "tp=8 pp=4 dp=2"),
        ("d", "FSDP / ZeRO"),
        ("d", "ZeRO-3 over all 16"),
    ],
)
def test_the_lessons_answers_are_accepted(scenario, answer):
    feedback = grade(scenario, answer)
    assert feedback.correct, str(feedback)
    assert "GB of model states" in feedback.reasons[0] and feedback.model_answer


@pytest.mark.parametrize(
    ("scenario", "answer", "why"),
    [
        ("a", "FSDP", "fits one GPU, so plain data parallelism is simplest"),
        ("a", "tp=8", "fits one GPU"),
        ("b", "data parallel", "does not fit: the smallest such layout needs 481 GB per GPU"),
        ("b", "tp=16", "every size must divide the 8 GPUs"),
        ("c", "TP in the node + DP", "does not fit"),
        ("c", "tp 8 pp 2 dp 2", "= 32, but there are 64 GPUs"),
        ("c", "tp=16 pp=2 dp=2", "spans nodes of 8 GPUs"),
        ("d", "tensor parallel + DP", "ruled out tensor and pipeline parallelism"),
        ("d", "data parallelism", "does not fit: the smallest such layout needs 209 GB"),
    ],
)
def test_wrong_answers_are_rejected_with_a_reason(scenario, answer, why):
    feedback = grade(scenario, answer)
    assert not feedback.correct
    assert why in str(feedback), str(feedback)


def test_reasons_quote_memory_per_gpu_and_links():
    right = grade("c", "3D")
    assert any("GB per GPU of 80" in r for r in right.reasons)
    assert any("inside a node (450 GB/s per GPU)" in r for r in right.reasons)
    slower = grade("a", "tp=8")
    assert "estimated step" in str(slower) and "x the planner's choice" in str(slower)


def test_answers_in_words_and_numbers_are_read():
    assert parse("Data parallelism alone").shape == "dp"
    assert parse("TP in node + DP across").shape == "tp"
    assert parse("3D").shape == "3d"
    assert parse({"tp": 8, "pp": 4, "dp": 2}).shape == "3d"
    assert parse("tp=1 pp=8 dp=8").shape == "pp"
    assert parse("ZeRO-3").shape == "fsdp" and parse("ZeRO-1").zero == 1
    with pytest.raises(ValueError, match="could not read a scheme"):
        parse("more GPUs")
    with pytest.raises(ValueError, match="no scenario 'z'"):
        grade("z", "dp")


def test_prompts_and_model_answers_are_kept_apart():
    prompts, answers = load(), model_answers()
    assert {s["id"] for s in prompts["scenarios"]} == set(answers["scenarios"]) >= {"a", "b", "c", "d"}
    assert {r["id"] for r in prompts["reasoning"]} == set(answers["reasoning"]) == {"B", "C"}
    assert all("answer" not in s for s in prompts["scenarios"])
