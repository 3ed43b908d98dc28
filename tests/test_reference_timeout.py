"""One timeout for a run, the one-device reference included: ``run_scheme(timeout=)`` (the command line's
``--timeout``) bounds the reference's training too, which before had 120 s whatever the run was given."""

import time

import pytest
import torch.distributed as dist
from torch import nn

from course_lib.harness import run_scheme
from course_lib.model.config import TrainConfig
from course_lib.runtime.launch import RankError

REFERENCE_SLEEP_S = 5.0


class SlowAlone(nn.Module):
    """A tiny language model that sleeps in its first forward when it trains alone (the reference's world of one),
    and not on the scheme's two ranks: only the reference is slow."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.slept = nn.Embedding(128, 8), False

    def forward(self, tokens, targets):
        if dist.is_initialized() and dist.get_world_size() == 1 and not self.slept:
            self.slept = True
            time.sleep(REFERENCE_SLEEP_S)
        logits = self.embed(tokens) @ self.embed.weight.T
        return nn.functional.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))


def test_the_reference_trains_within_the_runs_timeout():
    """The scheme's two ranks finish in a second or two; the reference (a world of one rank) sleeps past the run's
    3 s and is stopped there, named by where it was: not the 120 s it had before whatever the run was given."""
    with pytest.raises(RankError, match="did not finish within timeout=3 s") as err:
        run_scheme("dp", 2, train=TrainConfig(steps=1), model=SlowAlone, timeout=3)
    message = str(err.value)
    assert "rank 0:" in message and "rank 1:" not in message, message  # the reference's world of one
    assert "in forward" in message, message  # its stack: asleep in the model's forward


@pytest.mark.slow
def test_a_long_reference_finishes_within_a_long_timeout():
    ran = run_scheme("dp", 2, train=TrainConfig(steps=1), model=SlowAlone, timeout=REFERENCE_SLEEP_S + 30)
    assert ran.report["verdict"]["matches"]
