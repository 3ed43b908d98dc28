"""3D parallelism: tensor parallelism inside each pipeline stage, a pipeline across stages, data parallelism (or
ZeRO-1) over replicas of the whole pipeline (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §3, PTD-P).

Each rank sits at (dp, pp, tp) on a :class:`course_lib.mesh.Mesh`. It builds the tensor-parallel model over its TP
group, keeps the layers of its pipeline stage(s), takes its data-parallel share of every global batch and runs the
schedule with its pipeline neighbours. After the schedule: the sequence-parallel gradients are summed over TP, the
tied embedding's gradient between the first and the last stage, and every gradient averaged over DP (or
reduce-scattered to ZeRO-1 shards); then the optimizer steps. Each collective is recorded under its axis.
"""

from __future__ import annotations

import contextlib

from torch import nn

from course_lib import comm, launch, trace
from course_lib.memory import MemoryMeter
from course_lib.mesh import AXES, axis_groups, build_mesh
from course_lib.models import GPTConfig, TrainConfig, make_optimizer, synthetic_tokens
from course_lib.parallel.data import all_reduce_grads, batch_shard
from course_lib.parallel.pipeline import build_stages, run_schedule, sum_tied_embedding
from course_lib.parallel.schedules import generate
from course_lib.parallel.tensor import TensorParallelGPT, sequence_parallel_params, unshard
from course_lib.parallel.zero import ShardedOptimizer

ZERO1_BUCKET_BYTES = int(0.1e6)  # ZeRO-1's flat buffers over the data-parallel axis


def train_3d(
    cfg: GPTConfig,
    train: TrainConfig,
    tp: int = 2,
    pp: int = 2,
    dp: int = 2,
    zero: int = 0,
    sp: bool = False,
    schedule: str = "1f1b",
    microbatches: int = 4,
    chunks: int = 1,
    measure_memory: bool = True,
) -> dict:
    """Rank function: the world is a dp x pp x tp grid; see the module docstring."""
    mesh = build_mesh(dp=dp, pp=pp, tp=tp)
    tied = None  # the 2-rank group of this pipeline's first and last stage (every rank creates every such group)
    for pipeline in axis_groups("pp", mesh.sizes):
        group = comm.new_group([pipeline[0], pipeline[-1]], "embedding") if pp > 1 else None
        if pipeline == mesh.members["pp"]:
            tied = group
    device = launch.rank_device()
    model = TensorParallelGPT(cfg, train.seed, train.torch_dtype, group=mesh.groups["tp"], sp=sp).to(device)
    stage_rank = mesh.coords["pp"]
    stages = build_stages(model, stage_rank, pp, chunks)
    held = nn.ModuleList(stages.values())
    sharded = (
        ShardedOptimizer(held, train, 1, ZERO1_BUCKET_BYTES, overlap=False, group=mesh.groups["dp"]) if zero else None
    )
    optimizer = sharded.optimizer if sharded else make_optimizer(held.parameters(), train)
    table = generate(schedule, pp, microbatches, chunks)[stage_rank]
    local_batch = train.batch // dp
    shape = (local_batch // microbatches, cfg.seq // tp if sp else cfg.seq, cfg.d_model)
    holds_last = stage_rank == pp - 1
    sp_params, all_params = sequence_parallel_params(held), list(held.parameters())
    losses = []
    for step in range(train.steps):
        meter = MemoryMeter(held, optimizer, device=device) if measure_memory and step == train.steps - 1 else None
        with trace.tags(step=step), meter or contextlib.nullcontext():
            mine = [batch_shard(t, mesh.coords["dp"], dp) for t in synthetic_tokens(step, train.batch, cfg, train.seed)]
            step_losses = run_schedule(
                table,
                stages,
                mine,
                microbatches,
                shape,
                train.torch_dtype,
                peers=mesh.members["pp"],
                group=mesh.groups["pp"],
            )
            with trace.tags(phase="grad_sync"):
                if sp:
                    all_reduce_grads(sp_params, mesh.groups["tp"])
                sum_tied_embedding(stages, tied)
                if sharded:
                    sharded.finish_gradients()
                else:
                    all_reduce_grads(all_params, mesh.groups["dp"], average=True)
            with trace.span("optimizer"):
                optimizer.step()
                # Keep the gradient buffers (set_to_none would free them before the meter reads the step).
                sharded.zero_grad() if sharded else optimizer.zero_grad(set_to_none=False)
            if sharded:
                with trace.tags(phase="param_sync"):
                    sharded.after_optimizer_step()
            launch.sync(device)
        losses.append(sum(step_losses))
    params = {
        name: unshard(name, p, mesh.groups["tp"], cfg.d_model)
        for s in stages.values()
        for name, p in s.reference_names().items()
    }
    return {
        "losses": losses if holds_last else None,
        "memory": meter.report().as_dict() if meter else None,
        "coords": {axis: mesh.coords[axis] for axis in AXES},
        "params": params,
    }
