"""Each bug hunt fails the equivalence harness (and leaves a clue in the ledger) until fixed, and passes after."""

import pytest
import torch.nn.functional as F

from course_lib.ledgers import comm
from course_lib.parallel.data import all_reduce_grads
from course_lib.parallel.tensor_mappings import ReduceFromTensorParallel
from course_lib.practice import bughunts
from course_lib.practice.bughunts import BUGS, check_fix, hunt, matches_one_device


def fixed_row_forward(self, x):
    """What a student writes: sum the partial outputs over the group (Megatron's g), then add the bias."""
    return ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group) + self.bias


def fixed_finish_gradients(self):
    all_reduce_grads(self.model.sequence_parallel_params(), self.model.group)


def fixed_tied_embedding(stages, group):
    for stage in stages.values():
        if (stage.first or stage.last) and group is not None:
            comm.all_reduce(stage.tok_emb.weight.grad, group=group)
            return


FIXES = {
    "tp-forgets-allreduce": fixed_row_forward,
    "sp-layernorm-grads": fixed_finish_gradients,
    "pp-tied-embedding": fixed_tied_embedding,
}


def layer0_forward_ops(run):
    return sorted(
        r.op
        for r in run.result.comm[0]
        if r.tags.get("step") == 0 and r.tags.get("layer") == 0 and r.tags.get("direction") == "forward"
    )


@pytest.fixture(scope="module")
def broken():
    """Each hunt's broken run, run once for the tests that read it."""
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = hunt(name)
        return runs[name]

    return get


@pytest.fixture(scope="module")
def fixed():
    """check_fix of each hunt with the fix above: its verdict, and the run it made (kept by a spy on ``hunt`` that
    returns what the real one does), each made once."""
    results = {}

    def get(name: str):
        if name not in results:
            made = []

            def recording(*args, **kwargs):
                made.append(hunt(*args, **kwargs))
                return made[-1]

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(bughunts, "hunt", recording)
                verdict = check_fix(name, FIXES[name])
            [run] = made
            results[name] = verdict, run
        return results[name]

    return get


def test_every_hunt_fails_until_fixed_and_passes_after(broken, fixed):
    assert set(FIXES) == set(BUGS)
    for name in FIXES:
        assert not matches_one_device(broken(name)), name
        (ok, note), _ = fixed(name)
        assert ok, f"{name}: {note}"


def test_the_ledger_shows_the_clue(broken, fixed):
    # TP: layer 0 makes no all-reduce forward (it should make two).
    assert layer0_forward_ops(broken("tp-forgets-allreduce")) == []
    assert layer0_forward_ops(fixed("tp-forgets-allreduce")[1]) == ["all_reduce", "all_reduce"]
    # SP: no gradient sum over the TP group after backward.
    phases = {r.tags.get("phase") for r in broken("sp-layernorm-grads").result.comm[0]}
    assert "sp_grad_sync" not in phases
    # PP: the first and last stage never talk on the embedding group.
    assert "embedding" not in {r.group for r in broken("pp-tied-embedding").result.comm[0]}


def test_a_wrong_fix_is_told_so():
    ok, note = check_fix("tp-forgets-allreduce", lambda self, x: F.linear(x, self.weight) * 2 + self.bias)
    assert not ok and note.startswith("not yet")
