"""What each scheme requires of its settings, checked before any rank starts: the batch splits over the ranks, a
tensor-parallel degree divides what it splits, the pipeline's schedule exists for its sizes and every stage gets a
layer, context parallelism's chunks divide the sequence, the experts split over their ranks, a grid's axes multiply to
the world size.

Each ``validate_*`` has the :data:`~course_lib.parallel.interface.Check` signature ``(world_size, cfg, train, o)``
(``o``: every setting of the scheme) and raises ``ValueError`` saying what to change. They live here, apart from the
schemes' torch code and without importing torch, so that the command line refuses an impossible run in a tenth of
a second with nothing started (:func:`course_lib.parallel.catalog.refuse`); the scheme modules take them from here,
through their cards.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from course_lib.model.stages import even_counts
from course_lib.parallel.schedules import SPLIT_BACKWARD, chunks_per_rank
from course_lib.parallel.schedules import validate as validate_schedule

if TYPE_CHECKING:
    from course_lib.model.config import GPTConfig, TrainConfig

AXES = ("dp", "pp", "cp", "tp")  # a grid's axes, outermost first (course_lib.parallel.mesh)
KV_METHODS = ("ring", "all-gather")  # how context parallelism brings K and V to every rank


# ------------------------------------------------------------------------------------------------ data parallel
def check_batch_split(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """dp, ZeRO and FSDP: every rank needs an equal share of the batch, in ``grad_accum`` equal micro-batches, and
    buckets a size."""
    bucket_mb, accum = o.get("bucket_mb"), o["grad_accum"]
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"bucket size must be positive, got {bucket_mb} MB; try 0.1 (or 25, PyTorch DDP's default)")
    if accum < 1:
        raise ValueError(f"grad_accum must be at least 1, got {accum}")
    if world_size > train.batch:
        raise ValueError(
            f"world size {world_size} is larger than the global batch of {train.batch} sequences: some ranks would "
            f"get no data. Use a batch of at least {world_size} or fewer ranks."
        )
    if train.batch % (world_size * accum):
        raise ValueError(
            f"the global batch of {train.batch} sequences does not split evenly over {world_size} data-parallel "
            f"ranks x {accum} micro-batches; use a batch that is a multiple of {world_size * accum}"
        )


def validate_single(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """single: one rank, the whole batch."""
    if world_size != 1:
        raise ValueError(f"scheme 'single' runs on one rank; pass world size 1, not {world_size}")
    check_batch_split(world_size, cfg, train, o)


# ------------------------------------------------------------------------------------------------ tensor parallel
def require_divides(tp: int, what: str, size: int) -> None:
    """Refuse a tensor-parallel degree that does not divide ``size`` (the ``what`` it splits)."""
    if size % tp:
        raise ValueError(
            f"tensor-parallel degree {tp} does not divide the {what} = {size}: each rank must get an equal share. "
            f"Use a degree that divides {size}."
        )


def check_tensor_parallel(cfg: GPTConfig, tp: int, sp: bool) -> None:
    """Refuse a degree that does not divide the heads, the MLP width, the vocabulary or (with SP) the sequence."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be at least 1, not {tp}")
    sizes = {"heads": cfg.heads, "MLP width (ffn_mult x d_model)": cfg.ffn_mult * cfg.d_model, "vocab": cfg.vocab}
    if sp:
        sizes["sequence length (sequence parallel)"] = cfg.seq
    for what, size in sizes.items():
        require_divides(tp, what, size)


def validate_tensor(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """tp and sp: the whole world is one tensor-parallel group."""
    check_tensor_parallel(cfg, world_size, o["sp"])


# ------------------------------------------------------------------------------------------------ pipeline parallel
def split_layers(layers: int, stages: int, counts: tuple[int, ...] = ()) -> list[range]:
    """Contiguous layer ranges for each stage: ``counts`` layers each when given (uneven stages, as Megatron-LM's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` make them), else as equal as
    possible (earlier stages get the extra layers)."""
    if counts and (len(counts) != stages or sum(counts) != layers or min(counts) < 1):
        raise ValueError(
            f"stage layers {','.join(map(str, counts))} must give each of the {stages} pipeline stages at least one "
            f"layer and all {layers} layers in all"
        )
    if stages > layers:
        raise ValueError(
            f"{stages} pipeline stages (ranks x chunks) for {layers} layers: every stage needs at least one layer. "
            f"Use at most {layers} stages or a deeper model."
        )
    sizes = counts or even_counts(layers, stages)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def check_pipeline(cfg: GPTConfig, batch: int, stages: int, o: dict) -> None:
    """The schedule exists for these sizes, every virtual stage gets a layer (uneven stages one chunk a rank), the
    batch splits into microbatches."""
    validate_schedule(o["schedule"], stages, o["microbatches"], o["chunks"])
    v = chunks_per_rank(o["schedule"], o["chunks"])
    if o["stage_layers"] and v > 1:
        raise ValueError(f"--stage-layers gives each rank one stage; {o['schedule']} runs {v} chunks a rank")
    split_layers(cfg.layers, stages * v, o["stage_layers"])
    if batch % o["microbatches"]:
        raise ValueError(f"the batch of {batch} sequences does not split into {o['microbatches']} equal microbatches")


def validate_pipeline(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """pp: one stage (or chunks of stages) per rank, the whole batch in microbatches."""
    check_pipeline(cfg, train.batch, world_size, o)


def pipeline_layers(world_size: int, o: dict) -> int:
    """The fewest layers a pipeline of ``world_size`` ranks needs: the uneven stages' sum, else one a virtual
    stage."""
    return sum(o["stage_layers"]) or world_size * chunks_per_rank(o["schedule"], o["chunks"])


# ------------------------------------------------------------------------------------------------ context parallel
def check_context_parallel(cfg: GPTConfig, cp: int, kv: str) -> None:
    """Refuse a group that cannot split the sequence into 2 x cp equal chunks, and an unknown ``kv``."""
    if kv not in KV_METHODS:
        raise ValueError(f"kv must be one of {sorted(KV_METHODS)}, not {kv!r}")
    if cp < 1 or cfg.seq % (2 * cp):
        raise ValueError(
            f"context parallelism over {cp} ranks cuts each sequence into 2 x {cp} = {2 * cp} equal chunks (rank r "
            f"holds chunks r and {2 * cp - 1}-r), but the sequence length {cfg.seq} is not a multiple of {2 * cp}; "
            f"use a sequence length that is a multiple of {2 * cp} or fewer ranks"
        )


def validate_context(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """cp: every rank sees every sequence, in ``grad_accum`` micro-batches."""
    check_context_parallel(cfg, world_size, o["kv"])
    if o["grad_accum"] < 1 or train.batch % o["grad_accum"]:
        raise ValueError(
            f"the batch of {train.batch} sequences does not split into grad_accum={o['grad_accum']} equal "
            f"micro-batches (every rank sees every sequence); use a grad_accum that divides {train.batch}"
        )


# ------------------------------------------------------------------------------------------------ expert parallel
def check_recompute(cfg: GPTConfig) -> None:
    """Refuse full recomputation of an MoE trained over ranks: backward would route the tokens again (a second
    gather of the counts and dispatch all-to-all per layer), bytes the course's routed prediction does not count."""
    if cfg.recompute == "full":
        raise ValueError(
            "full recompute of an MoE layer over several ranks routes its tokens again in backward (a second counts "
            "all-gather and all-to-all), which the course does not predict; use recompute 'selective' or 'none'"
        )


def validate_expert(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """ep: an MoE model whose experts and batch split evenly over the ranks, not fully recomputed."""
    if cfg.experts == 0:
        raise ValueError(
            "scheme 'ep' shards the experts of an MoE model, and this model is dense (experts=0); use "
            f"GPTConfig(experts=E) with E a multiple of the world size {world_size}"
        )
    if cfg.experts % world_size:
        raise ValueError(
            f"{cfg.experts} experts do not split evenly over {world_size} expert-parallel ranks; use a number of "
            f"experts that is a multiple of {world_size}, or a world size that divides {cfg.experts}"
        )
    check_recompute(cfg)
    check_batch_split(world_size, cfg, train, {**o, "grad_accum": 1})


# ------------------------------------------------------------------------------------------------ grids (3d)
def check_sizes(world_size: int, **sizes: int) -> dict[str, int]:
    """The sizes of every axis (1 when not given); their product must be the world size."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown axis {sorted(unknown)}; the mesh has {list(AXES)}")
    full = {axis: sizes.get(axis, 1) for axis in AXES}
    if any(v < 1 for v in full.values()):
        raise ValueError(f"every axis needs a size of at least 1, got {full}")
    product = math.prod(full.values())
    if product != world_size:
        shown = [axis for axis in AXES if axis == "dp" or full[axis] > 1]
        model = [axis for axis in reversed(shown) if axis != "dp"]  # the model-parallel axes, innermost first
        model_parallel = math.prod(full[axis] for axis in model)
        names = " x ".join(axis.upper() for axis in model)
        hint = (
            f"with {' x '.join(f'{axis.upper()} {full[axis]}' for axis in model)}, DP = {world_size // model_parallel}"
            if world_size % model_parallel == 0
            else f"{names} = {model_parallel} must divide {world_size}"
        )
        every = " x ".join(axis.upper() for axis in reversed(AXES))
        raise ValueError(
            f"{' x '.join(f'{axis.upper()} {full[axis]}' for axis in shown)} = {product} ranks, but the world has "
            f"{world_size}: {every} must equal the number of devices ({hint})."
        )
    return full


def grid_sizes(world_size: int, o: dict) -> dict[str, int]:
    """The grid's axis sizes from the settings (:func:`check_sizes`: their product must be the world size)."""
    return check_sizes(world_size, tp=o["tp"], cp=o["cp"], pp=o["pp"], dp=o["dp"])


def tokens_per_rank(cfg: GPTConfig, tp: int, cp: int, sp: bool) -> int:
    """Tokens of each sequence a grid rank's activations cover between layers: s/C, and /T under SP."""
    return cfg.seq // cp // (tp if sp else 1)


def grid_layers(world_size: int, o: dict) -> int:
    """The fewest layers a grid's pipeline needs (:func:`pipeline_layers` over its ``pp`` ranks)."""
    return pipeline_layers(o["pp"], o)


def validate_3d(world_size: int, cfg: GPTConfig, train: TrainConfig, o: dict) -> None:
    """3d: a grid whose axes multiply to the world size, each axis's own rules, and the rules of their mix."""
    grid_sizes(world_size, o)
    check_experts(cfg, o)
    check_context_parallel(cfg, o["cp"], o["kv"])
    check_tensor_parallel(cfg, o["tp"], False)
    if o["sp"] and tokens_per_rank(cfg, 1, o["cp"], False) % o["tp"]:
        raise ValueError(
            f"sequence parallelism splits each rank's {cfg.seq // o['cp']} tokens of a sequence (its share of "
            f"{cfg.seq} over CP {o['cp']}) over TP {o['tp']}, which does not divide them; use a sequence length "
            f"that is a multiple of {o['cp'] * o['tp']} (and of {2 * o['cp']}), or drop sp"
        )
    if o["zero"] not in (0, 1):
        raise ValueError(f"a 3D run shards optimizer state with ZeRO-1 at most (zero 0 or 1), not {o['zero']}")
    if train.batch % o["dp"]:
        raise ValueError(f"the batch of {train.batch} sequences does not split over {o['dp']} data-parallel replicas")
    if o["schedule"] in SPLIT_BACKWARD and (o["tp"] > 1 or o["cp"] > 1):
        raise ValueError(
            f"{o['schedule']} with tensor or context parallelism: the course's W pass is a second backward over the "
            "retained graph, which would repeat every TP collective and ring step of the stage; use gpipe, 1f1b or "
            "interleaved, or tp 1 and cp 1"
        )
    check_pipeline(cfg, train.batch // o["dp"], o["pp"], o)


def check_experts(cfg: GPTConfig, o: dict) -> None:
    """An expert-parallel grid the course builds and that trains like one device (see
    :mod:`course_lib.parallel.three_d`'s docstring)."""
    ep, m = o["ep"], o["microbatches"]
    if not cfg.experts:
        if ep != 1:
            raise ValueError(
                f"ep {ep} splits the experts of an MoE model, and this model is dense (experts=0); give it experts "
                f"(GPTConfig(experts=E), --experts E, with E a multiple of {ep}) or use ep 1"
            )
        return
    if o["tp"] > 1 or o["cp"] > 1:
        raise ValueError(
            f"an MoE model in the grid runs with tp 1 and cp 1, not tp {o['tp']} and cp {o['cp']}: the course splits "
            "no expert over tensor-parallel ranks (Megatron's expert tensor parallelism), and a context-parallel "
            "rank's tokens are chunks of every sequence, not the block of the batch in token order that capacity "
            "and the all-to-all's rows assume; use tp 1 and cp 1, with the experts split over ep of the dp ranks"
        )
    check_recompute(cfg)
    if ep < 1 or o["dp"] % ep:
        raise ValueError(
            f"ep {ep} is carved out of the data-parallel ranks (Megatron's MoE parallel folding): it must divide "
            f"dp {o['dp']}; use an ep that divides {o['dp']}"
        )
    if cfg.experts % ep:
        raise ValueError(
            f"{cfg.experts} experts do not split evenly over {ep} expert-parallel ranks; use a number of experts "
            f"that is a multiple of {ep}, or an ep that divides {cfg.experts}"
        )
    if o["zero"]:
        raise ValueError(
            "ZeRO-1 with experts: the experts' optimizer states would shard over the expert-data-parallel group, "
            "which the course does not build; use zero 0"
        )
    if o["schedule"] in SPLIT_BACKWARD:
        raise ValueError(
            f"{o['schedule']} with experts: the course's W pass is a second backward over the retained graph, which "
            "would repeat the MoE layers' all-to-alls; use gpipe, 1f1b or interleaved"
        )
    if m > 1 and (cfg.capacity_factor is not None or cfg.aux_loss_coef):
        raise ValueError(
            f"with {m} microbatches each microbatch routes on its own (as in Megatron: routing and balance loss per "
            f"micro-batch), but the one-device reference caps each expert and takes the balance loss's f_i over the "
            f"whole batch, which exists only once every microbatch has run, and f_i x P_i does not add up over "
            f"microbatches (capacity_factor={cfg.capacity_factor}, aux_loss_coef={cfg.aux_loss_coef}); use a "
            "dropless model without balance loss (capacity_factor None and aux_loss_coef 0: --aux-loss-coef 0, "
            "no --capacity-factor), or microbatches 1"
        )
    stages = o["pp"] * chunks_per_rank(o["schedule"], o["chunks"])
    if cfg.aux_loss_coef and stages > 1:
        raise ValueError(
            f"a balance loss (aux_loss_coef={cfg.aux_loss_coef}) in a pipeline of {stages} stages: "
            "each stage's MoE layers would add a second loss to a backward that carries only the last stage's; "
            "use aux_loss_coef 0 (--aux-loss-coef 0), or pp 1 and chunks 1"
        )
