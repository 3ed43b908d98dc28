"""The pick-the-parallelism grader: a table of answers people write, each with its verdict (right, also right, or
wrong with the key reason, which carries the number that decides), the reading of synonyms, sizes and negations,
and no answer that makes it raise."""

import random
import string

import pytest

from course_lib.practice.answers import parse
from course_lib.practice.exercises import grade, load, model_answers

RIGHT, ALSO = "right", "also right"

# (scenario, answer, verdict): RIGHT, ALSO, or a piece of the verdict of a wrong answer (its key reason).
TABLE = [
    # a: 1B on one node of 8: the states (16 GB) fit one GPU.
    ("a", "Data parallelism alone", RIGHT),
    ("a", "dp=8", RIGHT),
    ("a", "DDP", RIGHT),
    ("a", "DistributedDataParallel", RIGHT),
    ("a", "neither TP nor PP: DDP", RIGHT),
    ("a", "DP, not TP", RIGHT),
    ("a", "FSDP", ALSO),  # as fast as DP here (1.00x): within the planner's 10%
    ("a", "ZeRO-1", ALSO),
    ("a", "HSDP", ALSO),  # one node: FSDP
    ("a", "pipeline, no TP", ALSO),  # TP 1 x PP 2 x DP 4 at 1.00x
    ("a", "tp=8", "2.18x the fastest estimate"),
    ("a", "3D", "there is only one node (8 GPUs)"),
    ("a", "8x4x2", "TP 8 x PP 4 x DP 2 = 64, but there are 8 GPUs"),
    ("a", "tp=16", "every size must divide the 8 GPUs, and TP 16 does not"),
    # b: 30B on one node: 480 GB of states fit the node (640 GB), not a GPU.
    ("b", "Tensor parallelism within the node", RIGHT),
    ("b", "TP in the node + DP", RIGHT),
    ("b", "Megatron TP", RIGHT),
    ("b", "tp=8", RIGHT),  # the lesson's shape at any size; 1.27x, said in the verdict
    ("b", "FSDP", ALSO),  # the lesson's alternative, with full recompute
    ("b", "ZeRO stage 3", ALSO),
    ("b", "HSDP", ALSO),
    ("b", "tp=2 pp=2 dp=2", ALSO),  # the fastest estimate
    ("b", "data parallel", "needs 481 GB per GPU (with full recompute), more than the GPU's 80 GB"),
    ("b", "pipeline", "1.29x the fastest estimate"),
    ("b", "3D", "there is only one node (8 GPUs)"),
    ("b", "TP across nodes", "there is only one node (8 GPUs)"),
    ("b", "tp=16", "every size must divide the 8 GPUs"),
    # c: 200B on 8 nodes: 3.2 TB of states exceed a node.
    ("c", "3D: TP within nodes, PP across nodes, DP on top", RIGHT),
    ("c", "tp=8 pp=4 dp=2", RIGHT),
    ("c", "8x4x2", RIGHT),
    ("c", "tp8/pp4/dp2", RIGHT),
    ("c", "tp = 8, pp = 4, dp = 2", RIGHT),
    ("c", "TP 8, PP 4", RIGHT),
    ("c", "8-way TP, 4-way PP", RIGHT),
    ("c", "TP 8 x PP 8 x DP 1", RIGHT),  # 61 GB per GPU, 1.09x: as fast as the planner's choice
    ("c", "Megatron TP with pipeline across nodes and ZeRO-1 data parallel", RIGHT),
    ("c", "TP in the node + DP", "needs 94 GB per GPU (with full recompute), more than the GPU's 80 GB"),
    ("c", "tp 8 pp 2 dp 2", "TP 8 x PP 2 x DP 2 = 32, but there are 64 GPUs"),
    ("c", "tp=16 pp=2 dp=2", "at 50 GB/s per GPU instead of NVLink's 450 (a TP group of 16 spans nodes of 8 GPUs)"),
    ("c", "TP across nodes, PP inside", "at 50 GB/s per GPU instead of NVLink's 450"),
    ("c", "FSDP", "4.95x the fastest estimate"),
    ("c", "pipeline", "1.29x the fastest estimate"),
    ("c", "pp=64", "PP 64 does not split the model's 96 layers"),
    ("c", "HSDP", "HSDP does not fit: it needs 408 GB per GPU"),
    # d: 13B on 2 nodes, no TP or PP: 208 GB of states.
    ("d", "FSDP / ZeRO", RIGHT),
    ("d", "ZeRO-3 over all 16", RIGHT),
    ("d", "ZeRO", RIGHT),
    ("d", "DeepSpeed ZeRO", RIGHT),
    ("d", "ZeRO stage 3", RIGHT),  # 4.60x the fastest estimate (ZeRO-1), said in the verdict
    ("d", "sharded data parallel", RIGHT),
    ("d", "ZeRO-1", RIGHT),
    ("d", "ZeRO-2", RIGHT),
    ("d", "HSDP", RIGHT),
    ("d", "FSDP, no TP or PP", RIGHT),
    ("d", "FSDP without pipeline", RIGHT),
    ("d", {"dp": 16, "zero": 1}, RIGHT),
    ("d", "data parallelism", "needs 209 GB per GPU (with full recompute), more than the GPU's 80 GB"),
    ("d", "DP, not TP", "Plain data parallelism does not fit"),
    ("d", "DDP", "Plain data parallelism does not fit"),
    ("d", "tensor parallel + DP", "it ruled out tensor and pipeline parallelism, and this answer uses TP"),
    ("d", "3D", "this answer uses TP and PP"),
    ("d", "no TP or PP", "it only says what not to use"),
    # e: 7B on one node: 112 GB of states.
    ("e", "TP inside the node", RIGHT),
    ("e", "ZeRO-1", ALSO),
    ("e", "ZeRO-2", ALSO),
    ("e", "FSDP", ALSO),
    ("e", "no TP, PP or CP, just ZeRO-2", ALSO),
    ("e", "tp=1 pp=2 dp=4", ALSO),
    ("e", "DP (no ZeRO)", "needs 113 GB per GPU"),
    ("e", "3D", "there is only one node (8 GPUs)"),
    # f: 70B on 8 nodes: 1.1 TB of states.
    ("f", "3D", RIGHT),
    ("f", "tp=8 pp=8 dp=1", RIGHT),
    ("f", "TP in the node + DP", "1.21x the fastest estimate"),
    ("f", "FSDP", "4.96x the fastest estimate"),
    ("f", "data parallel", "Plain data parallelism does not fit"),
    # g: 1.3B on 8 nodes: 21 GB of states.
    ("g", "Data parallelism alone, over all 64 GPUs", RIGHT),
    ("g", "ZeRO", ALSO),
    ("g", "PP 8 x DP 8", ALSO),  # the fastest estimate; the planner keeps DP, 1.09x, within its 10%
    ("g", "ZeRO-2", "1.81x the fastest estimate"),
    ("g", "HSDP", "the planner does not time HSDP"),
    ("g", "3D", "1.17x the fastest estimate"),
    ("g", "dp=32", "TP 1 x PP 1 x DP 32 = 32, but there are 64 GPUs"),
    # h: 30B on 2 nodes, no TP or PP: 480 GB of states.
    ("h", "FSDP / ZeRO-3 with recompute", RIGHT),
    ("h", "ZeRO", RIGHT),
    ("h", "HSDP", RIGHT),
    ("h", "ZeRO-1", "needs 144 GB per GPU"),
    ("h", "ZeRO-2", "needs 88 GB per GPU"),
    ("h", "FSDP with 1F1B", "this answer uses PP"),
    # unreadable: a verdict that says so, never an exception
    ("a", "more GPUs", "it names no scheme"),
    ("a", "", "it names no scheme"),
    ("a", "ZeRO-5", "ZeRO has stages 1, 2 and 3"),
    ("a", "tp=0", "sizes are whole numbers of at least 1"),
    ("a", "TP, no TP", "it asks for TP and for no TP"),
    ("a", "2D", "say which two"),
    ("a", "context parallel", "context and expert parallelism are not part of it"),
]


@pytest.mark.parametrize(("scenario", "answer", "expected"), TABLE)
def test_the_table_of_answers(scenario, answer, expected):
    feedback = grade(scenario, answer)
    if expected == RIGHT:
        assert feedback.correct and feedback.verdict.startswith("Right."), str(feedback)
    elif expected == ALSO:
        assert feedback.correct and feedback.verdict.startswith("Also right."), str(feedback)
    else:
        assert not feedback.correct and expected in feedback.verdict, str(feedback)
    assert feedback.model_answer and any("of model states (16 bytes each" in r for r in feedback.reasons)


def test_the_table_covers_every_scenario_and_verdict():
    assert len(TABLE) >= 60 and {s for s, _, _ in TABLE} == {s["id"] for s in load()["scenarios"]}
    assert {RIGHT, ALSO} < {e for _, _, e in TABLE}


@pytest.mark.parametrize(
    ("answer", "read"),
    [
        ("DDP", ("dp", 1, 1, None, None, False)),
        ("data-parallel, no sharding", ("dp", 1, 1, None, {0}, False)),
        ("FSDP", ("sharded", 1, 1, None, {3}, False)),
        ("fully sharded data parallel", ("sharded", 1, 1, None, {3}, False)),
        ("ZeRO-2", ("sharded", 1, 1, None, {2}, False)),
        ("zero=1", ("sharded", 1, 1, None, {1}, False)),
        ("DeepSpeed ZeRO stage 2", ("sharded", 1, 1, None, {2}, False)),
        ("DeepSpeed ZeRO", ("sharded", 1, 1, None, {1, 2, 3}, False)),
        ("ZeRO, not ZeRO-3", ("sharded", 1, 1, None, {1, 2}, False)),
        ("sharded data parallel", ("sharded", 1, 1, None, {1, 2, 3}, False)),
        ("HSDP", ("sharded", 1, 1, None, {3}, True)),
        ("hybrid sharding", ("sharded", 1, 1, None, {3}, True)),
        ("FSDP, no TP or PP", ("sharded", 1, 1, None, {3}, False)),
        ("without TP or PP, FSDP", ("sharded", 1, 1, None, {3}, False)),
        ("TP and PP not needed, ZeRO-1", ("sharded", 1, 1, None, {1}, False)),
        ("Megatron TP", ("tp", None, 1, None, None, False)),
        ("tensor parallel, no pipeline", ("tp", None, 1, None, None, False)),
        ("TP 8, no DP", ("tp", 8, 1, 1, None, False)),
        ("pipeline, no TP", ("pp", 1, None, None, None, False)),
        ("tp=1 pp=8 dp=8", ("pp", 1, 8, 8, None, False)),
        ("3D", ("3d", None, None, None, None, False)),
        ("8x4x2", ("3d", 8, 4, 2, None, False)),
        ("8 \u00d7 4 \u00d7 2", ("3d", 8, 4, 2, None, False)),
        ("tp8/pp4/dp2", ("3d", 8, 4, 2, None, False)),
        ("tp=8 pp=4 dp=2", ("3d", 8, 4, 2, None, False)),
        ("TP 8, PP 4", ("3d", 8, 4, None, None, False)),
        ("TP of 8 x PP of 4 with ZeRO-1", ("3d", 8, 4, None, {1}, False)),
        ("TP 8 + FSDP", ("tp", 8, 1, None, None, False)),  # ZeRO-3 with TP: the planner's stages instead
        ({"tp": 8, "pp": 4, "dp": 2}, ("3d", 8, 4, 2, None, False)),
        ({"zero": 3}, ("sharded", 1, 1, None, {3}, False)),
    ],
)
def test_synonyms_sizes_and_negations_are_read(answer, read):
    a = parse(answer)
    assert (a.family, a.tp, a.pp, a.dp, a.stages, a.hsdp) == read


def test_feedback_says_how_it_read_the_answer_and_quotes_the_numbers():
    sizes = grade("c", "8x4x2")
    assert "'8x4x2' read as TP 8 x PP 4 x DP 2" in sizes.reasons[0]
    assert any("73.6 GB per GPU of 80" in r for r in sizes.reasons)
    assert any("The TP group of 8 sits inside a node (450 GB/s per GPU)" in r for r in sizes.reasons)
    assert any("The pipeline of 4 spans nodes (50 GB/s per GPU)" in r for r in sizes.reasons)
    zero2 = grade("e", "ZeRO-2")
    assert "data parallelism with ZeRO-2 sharding" in zero2.reasons[0] and "alone" not in zero2.reasons[0]
    fsdp_d = grade("d", "ZeRO stage 3")
    assert "4.60x the fastest estimate" in fsdp_d.verdict
    assert any("data-parallel traffic not hidden behind compute" in r for r in fsdp_d.reasons)
    assert any("The planner's choice within the constraint: TP 1 x PP 1 x DP 16, ZeRO-1" in r for r in fsdp_d.reasons)


ODD = [
    "",
    " ",
    "?",
    "no",
    "not not not",
    "tp=",
    "tp=-3",
    "tp=2.5",
    "x" * 10_000,
    "8x8",
    "8x4x2x1",
    "tp=99999999999999999999999",
    "ZeRO-",
    "ZeRO-0",
    "stage 3",
    "\u2603 FSDP \u2603",
    "TP/PP/DP/CP/EP",
    "no TP, TP",
    "3D, no PP",
    "FSDP, no FSDP",
    "none",
    "model parallel",
    "MoE",
    "(((",
]


@pytest.mark.parametrize("answer", ODD + [None, 3, ["tp"], {"tp": "x"}, {"foo": 1}, {"tp": -1}, {"zero": 7}])
def test_no_answer_makes_it_raise(answer):
    for scenario in "abcdefgh":
        feedback = grade(scenario, answer)
        if feedback.verdict.startswith("Could not read"):
            assert not feedback.correct and "'tp=8 pp=4 dp=2'" in feedback.verdict


def test_random_text_never_raises():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " " * 10
    words = ["tp", "pp", "dp", "no", "not", "or", "and", ",", "FSDP", "ZeRO", "3D", "x", "=", "8", "2", "stage"]
    for i in range(300):
        text = (
            "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
            if i % 2
            else " ".join(rng.choices(words, k=rng.randint(1, 8)))
        )
        assert isinstance(grade("abcdefgh"[i % 8], text).correct, bool)


def test_an_unknown_scenario_is_a_value_error():
    with pytest.raises(ValueError, match="no scenario 'z'"):
        grade("z", "dp")


def test_prompts_and_model_answers_are_kept_apart():
    prompts, answers = load(), model_answers()
    assert {s["id"] for s in prompts["scenarios"]} == set(answers["scenarios"]) >= {"a", "b", "c", "d"}
    assert {r["id"] for r in prompts["reasoning"]} == set(answers["reasoning"]) == {"B", "C"}
    assert all("answer" not in s for s in prompts["scenarios"])
