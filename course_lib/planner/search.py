"""The parallelism planner's search: which TP x CP x PP x DP x EP (and ZeRO stage, pipeline schedule) to train a
model with on a cluster (:func:`plan`), and why.

First the lesson's decision tree, on model states alone (16 bytes per parameter with mixed-precision Adam;
:func:`course_lib.planner.layouts.tree_shape`):

* they fit one GPU: data parallelism alone;
* they fit one node: tensor parallelism inside the node, data parallelism across nodes (or FSDP/ZeRO-3 over all
  GPUs for a team that wants no model parallelism);
* bigger than a node: 3D, TP inside nodes (NVLink), PP across nodes, DP on top.

Then every layout (:func:`course_lib.planner.layouts.layouts`) is evaluated
(:func:`course_lib.planner.evaluate.evaluate`: memory per GPU, step time, MFU) and those that fit are ranked by
step time, without recompute, then with selective recompute, then with context parallelism, until one fits: like
selective recompute, CP is a last resort for memory, as Llama 3 brought it in only for its 128K-token stage. The
decision tree's shape is kept unless another layout is more than ``CLOSE`` faster; the reasons for the choice come
from :func:`course_lib.planner.reasons.explain`."""

from __future__ import annotations

from course_lib.cluster.network import Network
from course_lib.cluster.profiles import get_profile
from course_lib.cluster.topology import Topology
from course_lib.planner.evaluate import check_settings, evaluate_splits, network
from course_lib.planner.layouts import CLOSE, Candidate, Plan, describe, in_shape, layouts, tree_shape
from course_lib.planner.presets import DEFAULT_GLOBAL_BATCH, Model, as_model
from course_lib.planner.reasons import explain, format_bytes


def plan(
    model: Model | str | float,
    gpus: int,
    gpus_per_node: int | None = None,
    gpu_mem_bytes: float | None = None,
    hardware: str = "h100",
    global_batch: int | None = None,
    micro_batch: int = 1,
    precision: str = "mixed",
    no_model_parallel: bool = False,
    topology: str | Topology | None = None,
) -> Plan:
    """Plan ``model`` (a :class:`Model`, a preset name or a parameter count) on ``gpus`` GPUs. GPUs per node and
    memory default to the ``hardware`` profile's; the global batch (sequences) to the preset's published one, else
    ``DEFAULT_GLOBAL_BATCH``. Selective recompute is used only if nothing fits without it, context parallelism only
    if nothing fits without it even with selective recompute (:func:`_tries`). With ``topology`` (a profile name
    of :mod:`course_lib.cluster.topology`, sized to the GPUs unless given ``NAME:SIZE``, or a Topology of ``gpus`` GPUs)
    the traffic is timed on its links (:mod:`course_lib.cluster.network`), TP may grow to its fast domain (an NVL72
    rack, a whole torus) and the reasons say where each group sits; compute and memory stay the hardware profile's."""
    model = as_model(model)
    profile = get_profile(hardware)
    net = network(profile, gpus, gpus_per_node, topology)
    per_node = net.domain
    gpu_mem = gpu_mem_bytes or profile.memory_bytes
    batch = global_batch or model.global_batch or DEFAULT_GLOBAL_BATCH
    check_settings(gpus, per_node, batch, micro_batch, precision)
    tries, without_cp = _tries(model, gpus, net, gpu_mem, batch, micro_batch, precision, no_model_parallel)
    ranked = tries[-1]
    shape = tree_shape(model, gpus, per_node, gpu_mem, precision, no_model_parallel)
    chosen, tree_best = _choose(ranked, shape, per_node)
    result = Plan(
        **vars(chosen),
        model=model,
        hardware=profile.name,
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_mem_bytes=gpu_mem,
        global_batch=batch,
        micro_batch=micro_batch,
        precision=precision,
        shape=shape,
        candidates=ranked,
        topology=net.topology.name if net.topology else None,
        network=net,
    )
    result.reasons = explain(result, profile, tree_best, tries[0][0], without_cp)
    return result


def _tries(
    model: Model,
    gpus: int,
    net: Network,
    gpu_mem: float,
    batch: int,
    micro_batch: int,
    precision: str,
    no_mp: bool,
) -> tuple[list[list[Candidate]], list[Candidate] | None]:
    """The ranked candidates of each try, the last one's first fitting: without CP, then (if nothing fits) with
    it, as Llama 3 added CP only for 128K-token sequences; in each, without recompute, then selective. Also, if CP
    was needed, the last try without it (empty: no layout without CP splits the batch)."""
    tries: list[list[Candidate]] = []
    for context in (False, True):
        shapes = layouts(model, gpus, net.domain, batch, micro_batch, no_mp, context)
        for recompute in ("none", "selective") if shapes else ():
            args = (gpus, net, gpu_mem, batch, precision)
            tries.append(
                _rank([evaluate_splits(model, layout._replace(recompute=recompute), *args) for layout in shapes])
            )
            if tries[-1][0].fits:
                return tries, (tries[-3] if len(tries) > 2 else []) if context else None
    if not tries:
        raise ValueError(
            f"no layout of {gpus} GPUs splits a global batch of {batch} sequences into micro-batches of "
            f"{micro_batch} per DP rank (at least one per pipeline stage): change the batch or the GPUs"
        )
    raise ValueError(_nothing_fits(model, tries[-1][0], gpu_mem))


def _rank(cands: list[Candidate]) -> list[Candidate]:
    """Those that fit, fastest first (ties: lower ZeRO stage, less model parallelism), then the rest by memory."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: (c.step_time_s, c.zero, c.tp * c.pp))
    return fitting + sorted((c for c in cands if not c.fits), key=lambda c: c.memory_per_gpu_bytes)


def _nothing_fits(model: Model, smallest: Candidate, gpu_mem: float) -> str:
    return (
        f"nothing fits in {format_bytes(gpu_mem)} per GPU, even with selective recompute and context parallelism: the "
        f"smallest layout, {describe(smallest)}, needs {format_bytes(smallest.memory_per_gpu_bytes)}, "
        f"{format_bytes(smallest.memory_per_gpu_bytes - gpu_mem)} more than a GPU has; add GPUs (or recompute fully)"
    )


def _choose(ranked: list[Candidate], shape: str, gpus_per_node: int) -> tuple[Candidate, Candidate | None]:
    """The fastest layout of the tree's shape if within ``CLOSE`` of the fastest, else the fastest; and the
    fastest of the tree's shape (None if none fits)."""
    best = ranked[0]
    tree = next((c for c in ranked if c.fits and in_shape(c, shape, gpus_per_node)), None)
    if tree is not None and tree.step_time_s <= best.step_time_s * (1 + CLOSE):
        return tree, tree
    return best, tree
