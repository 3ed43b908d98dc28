"""Notebook 10's checks: each fails the stub and plausible wrong solutions with the hint their measurement gives,
and passes the model solution. The ring all-reduce runs its functions in one 2-rank and one 4-rank launch."""

import math

import pytest
import torch
import torch.distributed as dist

from course_lib.ledgers import comm
from course_lib.practice import check_dispatch, check_merge, check_ring, check_schedule, write_it
from course_lib.practice import write_it_check as wc
from course_lib.runtime import launch

ANSWERS = wc.model_answers()


# ------------------------------------------------------------------------------------------- 1. ring all-reduce
def whole_tensor_to_everyone(tensor):
    """Every rank sends its whole tensor to every other rank and adds up what arrives: right values."""
    n, r = dist.get_world_size(), dist.get_rank()
    total, arrived = tensor.clone(), torch.empty_like(tensor)
    for offset in range(1, n):
        sending = comm.isend(tensor, (r + offset) % n)
        comm.recv(arrived, (r - offset) % n)
        sending.wait()
        total += arrived
    tensor.copy_(total)


def adds_in_the_all_gather(tensor):
    """The ring, but the all-gather adds the arriving chunk instead of storing it."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks, arrived = tensor.view(-1).chunk(n), torch.empty(tensor.numel() // n, dtype=tensor.dtype)
    for k in range(2 * (n - 1)):
        send, into = ((r - k) % n, (r - k - 1) % n) if k < n - 1 else ((r + n - k) % n, (r + n - 1 - k) % n)
        sending = comm.isend(chunks[send], (r + 1) % n)
        comm.recv(arrived, (r - 1) % n)
        sending.wait()
        chunks[into].add_(arrived)


def with_the_collective(tensor):
    comm.all_reduce(tensor)


RING_FUNCTIONS = (ANSWERS.ring_all_reduce, whole_tensor_to_everyone, adds_in_the_all_gather, with_the_collective)


def _measure_each(*functions):  # one argument each, so that each travels to the ranks by value
    return [check_ring.measure_ring(fn) for fn in functions]


@pytest.fixture(scope="module")
def ring_runs():
    """Every function of RING_FUNCTIONS measured on 2 and on 4 ranks: {n: [per function, every rank's dict]}."""
    runs = {n: launch.run(_measure_each, n, *RING_FUNCTIONS) for n in (2, 4)}
    return {n: [[rank[i] for rank in run] for i in range(len(RING_FUNCTIONS))] for n, run in runs.items()}


@pytest.mark.parametrize("n", [2, 4])
def test_the_model_ring_passes_with_the_rings_bytes_exactly(ring_runs, n):
    feedback = check_ring.judge_ring(ring_runs[n][0])
    assert feedback.passed, feedback
    size = 8 * check_ring.RING_CHUNK * n
    assert feedback.numbers["sent_bytes"] == [2 * (n - 1) / n * size] * n == [feedback.numbers["formula_bytes"]] * n


def test_sending_the_whole_tensor_passes_on_2_ranks_and_fails_on_4_by_its_bytes(ring_runs):
    assert check_ring.judge_ring(ring_runs[2][1]).passed  # (n-1) S = 2(n-1)/n S when n = 2
    feedback = check_ring.judge_ring(ring_runs[4][1])
    assert not feedback.passed and feedback.numbers["wrong_ranks"] == []
    assert feedback.hint.startswith("rank 0 sent 288 B in 3 messages: its whole tensor to each of the n-1 others")
    assert "2(n-1)/n S = 144 B" in feedback.hint


def test_adding_in_the_all_gather_names_the_step_and_rank_or_the_chunk(ring_runs):
    two, four = (check_ring.judge_ring(ring_runs[n][2]) for n in (2, 4))
    assert not two.passed and two.hint.startswith("every message matched the ring, but rank 0's chunk 0 ends as")
    assert not four.passed
    assert four.hint.startswith("values first differ at all-gather step 2 of 3 (step 5 of the ring's 6): rank 0 sent")
    assert "the ring sends chunk 0 summed over all ranks" in four.hint


def test_a_collective_is_refused_though_its_values_are_right(ring_runs):
    feedback = check_ring.judge_ring(ring_runs[2][3])
    assert not feedback.passed and feedback.numbers["wrong_ranks"] == []
    assert feedback.hint == "your function called all_reduce: write the ring from send and recv alone"


def test_the_stub_fails_with_the_rank_and_its_exception_and_never_raises():
    feedback = check_ring.check_ring_all_reduce(write_it.ring_all_reduce, world_sizes=(1,))
    assert not feedback.passed
    assert feedback.measured.startswith("on 1 rank: rank 0 of 1 raised NotImplementedError: write the ring")
    assert feedback.hint == wc.STUB


DEADLOCK = (
    "the run did not finish within timeout=10 s:\n"
    "  rank 0: waiting 8.1 s, in send #1 on world with rank 1 (24 B, tags {})\n"
    "  rank 1: waiting 8.1 s, in send #1 on world with rank 0 (24 B, tags {})\n"
    "If the work is simply slow, allow it more time"
)
PEER_RETURNED = "rank 1 of 2 raised RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:20376.\n..."


@pytest.mark.parametrize(
    "message, measured, hint",
    [
        (DEADLOCK, "rank 0: waiting 8.1 s, in send #1", "every rank waits in a blocking send"),
        (PEER_RETURNED, "on 2 ranks: rank 1 of 2 raised RuntimeError", "that rank was still waiting to receive"),
        (
            "rank 1 of 2 raised IndexError: chunk 7\ntraceback",
            "on 2 ranks: rank 1 of 2 raised IndexError: chunk 7",
            "fix",
        ),
    ],
)
def test_a_crashed_or_hung_run_names_the_rank_and_gets_its_hint(message, measured, hint):
    feedback = check_ring.crashed_run(check_ring.RING, 2, launch.RankError(message))
    assert not feedback.passed and measured in feedback.measured and feedback.hint.startswith(hint)
    assert "traceback" not in feedback.measured


def test_the_ring_messages_sum_to_all_reduce():
    for n in (2, 3, 4):
        total = sum(check_ring.ring_input(r, n) for r in range(n))
        last = check_ring.ring_messages(n)
        for r in range(n):
            dst, c, message, _ = last[r][-1]
            assert torch.equal(message, total.chunk(n)[c]) and dst == (r + 1) % n


def test_bad_world_sizes_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_sizes must be positive integers"):
        check_ring.check_ring_all_reduce(ANSWERS.ring_all_reduce, world_sizes=(2, 0))


# --------------------------------------------------------------------------------------------- 2. 1F1B table
def gpipe(p, m):
    """All forwards, then all backwards, each at its earliest step."""
    table = [[""] * (2 * (m + p - 1)) for _ in range(p)]
    for s in range(p):
        for i in range(m):
            table[s][s + i] = f"F{i}"
            table[s][m + p - 1 + i + (p - 1 - s)] = f"B{i}"
    return table


def packed(p, m):
    """1F1B's order on each stage, but packed from step 0 as if no stage waited for another."""
    return [[op for op in row if op] for row in ANSWERS.one_f_one_b(p, m)]


def one_step_late(p, m):
    return [[""] + row for row in ANSWERS.one_f_one_b(p, m)]


def short_warmup(p, m):
    """One warm-up forward fewer than 1F1B's, each op at its earliest step: dependencies and memory kept, a bigger
    bubble."""
    orders = []
    for s in range(p):
        warmup = max(min(p - s - 2, m), 0)
        order = [f"F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            order += [f"F{warmup + i}", f"B{i}"]
        orders.append(order + [f"B{i}" for i in range(m - warmup, m)])
    step = {}  # (op, stage) -> its step; the stages in turn, each as far as its inputs allow
    while len(step) < 2 * p * m:
        for s in range(p):
            for op in orders[s][sum(k[1] == s for k in step) :]:
                need = (op, s - 1) if op[0] == "F" else (op, s + 1) if s < p - 1 else ("F" + op[1:], s)
                if need not in step and not (op[0] == "F" and s == 0):
                    break
                after = max((t for (_, stage), t in step.items() if stage == s), default=-1)
                step[op, s] = max(after, step.get(need, -1)) + 1
    table = [[""] * (1 + max(step.values())) for _ in range(p)]
    for (op, s), t in step.items():
        table[s][t] = op
    return table


def test_the_model_table_passes_with_the_formulas_bubble():
    feedback = check_schedule.check_one_f_one_b(ANSWERS.one_f_one_b)
    assert feedback.passed, feedback
    for (p, m), numbers in feedback.numbers.items():
        assert numbers["steps"] == 2 * (m + p - 1)
        assert math.isclose(numbers["bubble"], (p - 1) / (m + p - 1), rel_tol=0, abs_tol=1e-15)
        assert numbers["peak"] == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize(
    "fn, hint",
    [
        (write_it.one_f_one_b, wc.STUB),
        (
            gpipe,
            "stage 0, step 2: F2 makes 3 microbatches' activations held at once; 1F1B holds at most p-s = 2 on stage "
            "0, so a backward comes before this forward (this row runs all its forwards first, as GPipe does)",
        ),
        (packed, "stage 1, step 0: F0 runs before stage 0's F0, which runs at step 0"),
        (one_step_late, "stage 0 waits until step 1 to run F0, which could run at step 0: put each op at the earliest"),
        (short_warmup, "stage 0 idles at step 1, where 1F1B runs F1: its order is min(p-s-1, m) warm-up forwards"),
        (lambda p, m: [["F0B0"]] * p, "stage 0, step 0: 'F0B0' is not one op"),
        (lambda p, m: [[]], "the table has 1 rows; it needs one row per stage, 2"),
        (lambda p, m: [[f"F{i}" for i in range(m)]] * p, "stage 0 runs B0 never"),
    ],
)
def test_a_wrong_table_fails_with_the_first_broken_rule(fn, hint):
    feedback = check_schedule.check_one_f_one_b(fn)
    assert not feedback.passed and feedback.hint.startswith(hint), feedback


def test_the_short_warmup_keeps_the_rules_but_not_the_bubble():
    measured = check_schedule.check_one_f_one_b(short_warmup).measured
    assert measured.startswith("p=2, m=3: 12 steps, a bubble of 0.5000; 1F1B: 2(m+p-1) = 8 steps")


# ------------------------------------------------------------------------------------------ 3. MoE dispatch
def counts_tokens(choices, experts, capacity_factor=None):
    n = len(choices)
    return [[int(((c // (experts // n)) == d).any(1).sum()) for d in range(n)] for c in choices]


def ignores_capacity(choices, experts, capacity_factor=None):
    return ANSWERS.dispatch_counts(choices, experts, None)


def transposed(choices, experts, capacity_factor=None):
    return torch.tensor(ANSWERS.dispatch_counts(choices, experts, capacity_factor)).T


def capacity_per_rank(choices, experts, capacity_factor=None):
    """Each rank caps its pairs per expert on its own, at a capacity from its own tokens."""
    if capacity_factor is None:
        return ANSWERS.dispatch_counts(choices, experts)
    n, k = len(choices), choices[0].shape[1]
    capacity = math.ceil(len(choices[0]) * k / experts * capacity_factor)
    kept = [[min(int((c == e).sum()), capacity) for e in range(experts)] for c in choices]
    return [[sum(row[d * experts // n : (d + 1) * experts // n]) for d in range(n)] for row in kept]


def test_the_model_counts_pass_and_the_cases_drop_pairs():
    feedback = check_dispatch.check_dispatch_counts(ANSWERS.dispatch_counts)
    assert feedback.passed, feedback
    assert "(11 pairs dropped)" in feedback.measured and "(4 pairs dropped)" in feedback.measured


@pytest.mark.parametrize(
    "fn, first, named",
    [
        (write_it.dispatch_counts, "", wc.STUB),
        (counts_tokens, "rank 0 -> rank 0: you count 7 rows, the course 11", "you counted tokens"),
        (ignores_capacity, "rank 1 -> rank 0: you count 7 rows, the course 6", "you kept every pair"),
        (transposed, "rank 0 -> rank 1: you count 10 rows, the course 5", "your table is transposed"),
        (capacity_per_rank, "rank 0 -> rank 0: you count 4 rows, the course 5", "you capped each rank on its own"),
        (lambda c, e, f=None: [[0]], "", "return counts[src][dst] for every pair of ranks"),
    ],
)
def test_a_wrong_count_fails_naming_the_first_pair_and_the_mistake(fn, first, named):
    feedback = check_dispatch.check_dispatch_counts(fn)
    assert not feedback.passed and feedback.hint.startswith(first) and named in feedback.hint, feedback


# ---------------------------------------------------------------------------------- 4. ring attention's merge
def exponentials(a, b):
    """Right on paper: e^l overflows float64 once the log-sum-exps pass 709."""
    (oa, la), (ob, lb) = a, b
    total = la.exp() + lb.exp()
    return (oa * la.exp() + ob * lb.exp()) / total, total.log()


def larger_lse(a, b):
    (oa, la), (ob, lb) = a, b
    lse = torch.maximum(la, lb)
    return oa * (la - lse).exp() + ob * (lb - lse).exp(), lse


def plain_average(a, b):
    return (a[0] + b[0]) / 2, torch.logaddexp(a[1], b[1])


def swapped(a, b):
    (oa, la), (ob, lb) = a, b
    lse = torch.logaddexp(la, lb)
    return oa * (lb - lse).exp() + ob * (la - lse).exp(), lse


def test_the_model_merge_passes_in_every_case_to_1e_10():
    feedback = check_merge.check_merge_partials(ANSWERS.merge_partials)
    assert feedback.passed, feedback
    partials, want = check_merge.merge_inputs(check_merge.MERGE_CASES[1])
    assert want[1].max() > 709  # the case the exponentials overflow on


@pytest.mark.parametrize(
    "fn, measured, hint",
    [
        (write_it.merge_partials, "two blocks: merge 1 raised NotImplementedError", wc.STUB),
        (exponentials, "two blocks, scores in the hundreds", "the merge returned inf or NaN where the log-sum-exps"),
        (larger_lse, "two blocks: largest error", "the log-sum-exp is off: yours is max(l_a, l_b)"),
        (plain_average, "two blocks: largest error", "the output is off: yours is (o_a + o_b) / 2"),
        (swapped, "two blocks: largest error", "the output is off: yours is the weights swapped"),
        (lambda a, b: a, "two blocks: largest error", "the log-sum-exp is off"),
        (lambda a, b: None, "two blocks: merge 1 returned NoneType", "return the pair (out, lse)"),
    ],
)
def test_a_wrong_merge_fails_saying_which_part_is_off(fn, measured, hint):
    feedback = check_merge.check_merge_partials(fn)
    assert not feedback.passed and feedback.measured.startswith(measured) and hint in feedback.hint, feedback


def test_the_model_answers_are_kept_out_of_the_students_module():
    assert ANSWERS.__file__ == str(wc.ANSWERS) and ANSWERS.__name__ == "write_it_answers"
    assert not any(getattr(value, "__module__", None) == ANSWERS.__name__ for value in vars(write_it).values())
    assert not any(getattr(value, "__module__", None) == ANSWERS.__name__ for value in vars(wc).values())
