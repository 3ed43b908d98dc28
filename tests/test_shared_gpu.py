"""Several gloo ranks on one device: gloo moves host memory only, so a collective on CUDA tensors goes through host
copies (course_lib.ledgers.comm). The schemes then still equal one device, and every collective says it went through
host memory. On the CPU the path is forced (comm.THROUGH_HOST); with a GPU, the ranks share it (device="cuda")."""

import pytest
import torch

from course_lib.harness import run_scheme
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.runtime import launch

WAYS = {
    "cpu-through-host": {"patch": ("course_lib.ledgers.comm", "THROUGH_HOST", True)},
    "ranks-sharing-a-gpu": {"device": "cuda", "backend": "gloo"},
}
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Together these issue every kind of collective: TP's (sequence-parallel) gathers and reductions, pipeline sends,
# DP's all-reduces, CP's ring of asynchronous sends and EP's all-to-alls.
SCHEMES = [
    ("3d", 8, GPTConfig(layers=4), {"tp": 2, "pp": 2, "dp": 2, "sp": True}),
    ("cp", 2, GPTConfig(), {}),
    ("ep", 2, GPTConfig(experts=4, top_k=2), {}),
]


@pytest.mark.parametrize("way", [pytest.param(w, marks=NEEDS_GPU) if "gpu" in w else w for w in WAYS])
@pytest.mark.parametrize(("scheme", "n", "cfg", "options"), SCHEMES, ids=[s[0] for s in SCHEMES])
def test_collectives_through_host_memory_still_equal_one_device(way, scheme, n, cfg, options):
    run = run_scheme(scheme, n, cfg, TrainConfig(steps=2, dtype="float64"), **WAYS[way], **options)
    assert run.report["max_abs_loss_diff"] <= 1e-10 and run.report["max_abs_param_diff"] <= 1e-10
    assert run.report["device"] == ("cuda" if "gpu" in way else "cpu")
    records = [rec for rank in run.result.comm for rec in rank]
    assert records and all(rec.through_host for rec in records)


def test_where_ranks_compute_is_checked_before_any_starts():
    assert launch.compute_device("gloo") == "cpu" and launch.compute_device("gloo", "cpu") == "cpu"
    assert launch.compute_device("nccl") == "cuda"
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', not 'tpu'"):
        launch.compute_device("gloo", "tpu")
    with pytest.raises(ValueError, match="NCCL ranks compute on their GPUs: use backend 'gloo'"):
        launch.compute_device("nccl", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' needs a CUDA GPU, and this machine has none"):
            launch.compute_device("gloo", "cuda")
