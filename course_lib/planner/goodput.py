"""Goodput: how much of a run's wall time is useful work, given random failures and periodic checkpoints.

The model (Young 1974; Daly 2006). Failures of the job arrive as a Poisson process of mean time between failures
``M`` (exponential gaps, so memoryless), at any moment, whatever the job is doing. Every ``tau`` seconds of work
the job writes a checkpoint that takes ``delta`` seconds; a failure sends it back to its last complete checkpoint
after a restart of ``R`` seconds (rescheduling, loading), which a failure can interrupt too. Goodput is the
fraction of wall time that became committed work:

* :func:`young_interval`, :func:`daly_interval`: the interval that maximises it;
* :func:`expected_goodput`: the closed form, for synchronous and asynchronous checkpoints;
* :func:`simulate_goodput`: the same run walked on a modeled clock against random failure times, to check it;
* :func:`cluster_mtbf`, :func:`job_mtbf`, :data:`LLAMA3`: where ``M`` comes from (Llama 3's 54 days on 16,384
  GPUs, Grattafiori et al. 2024, §3.3.4 and Table 5);
* :func:`training_state_bytes`, :func:`deduplicated_checkpoint_bytes`, :func:`checkpoint_bytes_per_rank`,
  :func:`checkpoint_seconds`: where ``delta`` comes from (the parameters and optimizer states a checkpoint holds,
  each rank's share of the write, over a write bandwidth);
* :func:`choose_interval`: all of it for one model on one cluster, the lesson's worked example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from course_lib.model.config import Layout
from course_lib.model.formulas import model_state_formula, stage_shape
from course_lib.planner.layouts import describe
from course_lib.planner.presets import Model, make_model
from course_lib.planner.reasons import published_candidate, published_gpus
from course_lib.planner.search import plan

# ------------------------------------------------------------------------------------------------ checks


def _check(name: str, value, allow_zero: bool = False) -> np.ndarray:
    """``value`` as an array, refused unless finite and greater than 0 (or at least 0 with ``allow_zero``)."""
    try:
        arr = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {value!r}") from None
    if not np.all(np.isfinite(arr)) or not np.all(arr >= 0 if allow_zero else arr > 0):
        wanted = "at least 0" if allow_zero else "greater than 0"
        raise ValueError(f"{name} must be a finite number of seconds {wanted}, not {value!r}")
    return arr


def _out(x: np.ndarray) -> float | np.ndarray:
    return float(x) if np.ndim(x) == 0 else x


# ------------------------------------------------------------------------------------------------ intervals


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval, sqrt(2 delta M) (J. W. Young, "A first order approximation to the
    optimum checkpoint interval", Communications of the ACM 17(9), 1974): the first-order balance between the
    time spent writing checkpoints, delta / tau of the run, and the work lost to a failure, tau / 2 per failure
    on average, i.e. tau / (2M) of the run."""
    delta, m = _check("checkpoint_s", checkpoint_s), _check("mtbf_s", mtbf_s)
    return _out(np.sqrt(2 * delta * m))


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (J. T. Daly, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", Future Generation Computer Systems 22(3), 2006, eq. 37):

        tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta   for delta < 2M,
        tau = M                                                                          otherwise.

    It approximates the maximum of :func:`expected_goodput` (the restart time does not move it). Daly's worked
    example, restart 10 min and delta 5 min: M = 24 h gives 117 min, M = 6 h gives 57 min."""
    delta, m = _check("checkpoint_s", checkpoint_s), _check("mtbf_s", mtbf_s)
    x = delta / (2 * m)
    with np.errstate(invalid="ignore"):
        tau = np.sqrt(2 * delta * m) * (1 + np.sqrt(x) / 3 + x / 9) - delta
    return _out(np.where(delta < 2 * m, tau, m))


# ------------------------------------------------------------------------------------------------ goodput


def expected_goodput(
    interval_s: float | np.ndarray,
    checkpoint_s: float,
    restart_s: float,
    mtbf_s: float,
    async_checkpoint: bool = False,
    stall_s: float = 0.0,
) -> float | np.ndarray:
    """The expected fraction of wall time spent on work that is kept, for exponential failures (Daly 2006, §3).

    Synchronous checkpoints. The run is a chain of segments, tau of work then delta of checkpoint. A segment is
    kept only if no failure falls in its s = tau + delta seconds; a failure at time x < s costs x, then a restart
    of R (which a failure may interrupt too: it takes M (e^{R/M} - 1) on average), then the segment from its
    start. With X ~ Exp(M), the expected time E of a segment solves E = E[min(X, s)] + P(X < s) (M (e^{R/M} - 1)
    + E), whose solution is Daly's

        E = M e^{R/M} (e^{(tau + delta)/M} - 1),        goodput = tau / E.

    Asynchronous checkpoints (``async_checkpoint``; PyTorch's ``dcp.async_save``). Training stops only for the
    snapshot, ``stall_s`` = sigma (a copy to host memory); the write, ``checkpoint_s`` = delta, runs in the
    background while the next segment trains, and the checkpoint counts only once written: a failure during the
    write loses that checkpoint, and the run goes back to the one before. Assumed: the write ends before the next
    snapshot (delta <= tau), and a restart loads the last complete checkpoint. After a checkpoint completes, the
    run is delta into its next segment, so the next one completes tau + sigma later if nothing fails; after a
    restart it needs tau + sigma + delta without a failure. Every completion returns to the first state, so the
    expected time per tau of work is (1 - e^{-(tau+sigma)/M}) (M + M (e^{R/M} - 1) + M e^{R/M} (e^{(tau+sigma+
    delta)/M} - 1)), i.e.

        E = M e^{R/M} e^{delta/M} (e^{(tau + sigma)/M} - 1),        goodput = tau / E:

    the stall takes the checkpoint's place in the exponent and the write costs only the factor e^{delta/M} (the
    chance it is caught by a failure), so the best interval is :func:`daly_interval` of the stall. With sigma =
    delta_sync and delta = 0 it is the synchronous formula. (``stall_s`` is ignored without ``async_checkpoint``.)

    ``interval_s`` may be an array (a curve for a plot); the rest are numbers of seconds, refused unless finite and
    positive (``checkpoint_s``, ``restart_s``, ``stall_s``: at least 0).
    """
    tau = _check("interval_s", interval_s)
    delta = _check("checkpoint_s", checkpoint_s, allow_zero=True)
    r = _check("restart_s", restart_s, allow_zero=True)
    m = _check("mtbf_s", mtbf_s)
    sigma = _check("stall_s", stall_s, allow_zero=True)
    if async_checkpoint:
        if np.any(delta > tau):
            raise ValueError(
                f"an asynchronous write of {checkpoint_s:g} s must end before the next snapshot: give an interval "
                f"of at least the write time (interval_s >= checkpoint_s), not {interval_s!r}"
            )
        blocking, background = sigma, delta
    else:
        blocking, background = delta, 0.0
    with np.errstate(over="ignore"):
        wall = m * np.exp((r + background) / m) * np.expm1((tau + blocking) / m)
    return _out(tau / wall)


@dataclass(frozen=True)
class SimulatedGoodput:
    """The outcome of :func:`simulate_goodput`: ``mean``, total work over total wall time of all runs (what the
    closed form predicts, tau over the expected time per segment); ``stderr``, its standard error (delta method
    over the runs); ``failures``, the mean failures a run met; ``wall_s``, the mean wall time of a run."""

    mean: float
    stderr: float
    runs: int
    failures: float
    wall_s: float


def failure_times(mtbf_s: float, runs: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` failure times for each of ``runs`` runs: a Poisson process of mean gap ``mtbf_s``."""
    return np.cumsum(rng.exponential(mtbf_s, size=(runs, count)), axis=1)


def simulate_goodput(
    interval_s: float,
    checkpoint_s: float,
    restart_s: float,
    mtbf_s: float,
    work_s: float,
    seed: int = 0,
    runs: int = 200,
    async_checkpoint: bool = False,
    stall_s: float = 0.0,
) -> SimulatedGoodput:
    """Monte Carlo of ``runs`` runs of ``work_s`` seconds of work, walked on a modeled clock against failure times
    drawn in advance (a Poisson process of mean gap ``mtbf_s``, from ``numpy.random.default_rng(seed)``; the same
    seed gives every interval the same failures, so intervals compare without that noise).

    A run does its work in segments of ``interval_s`` (the last one shorter if the work does not divide), each
    followed by a checkpoint as :func:`expected_goodput` describes (synchronous: the job waits ``checkpoint_s``;
    asynchronous: it waits ``stall_s`` and the write of ``checkpoint_s`` overlaps the next segment). From a start
    or restart at time t0 with k checkpoints kept, checkpoint k + i is complete at t0 + i (tau + blocking) +
    background, and the run is done when the last one is. The next failure time f decides: if it falls after the
    end, the run ends; else the checkpoints complete by f are kept, the clock goes to f, and the restart of
    ``restart_s`` begins, itself repeated while failures fall inside it. All runs advance together, one failure per
    step (vectorised over runs). The run ends with its last checkpoint written, so the asynchronous case carries
    one write, about delta, more than the closed form's steady state: give runs of many segments.
    """
    tau, delta, r, m, work, sigma = _simulation_seconds(interval_s, checkpoint_s, restart_s, mtbf_s, work_s, stall_s)
    if not (isinstance(runs, int | np.integer) and runs >= 2):
        raise ValueError(f"runs must be a whole number of at least 2 (for a standard error), not {runs!r}")
    segments = math.ceil(work / tau - 1e-9)
    last = work - (segments - 1) * tau
    chunk = _failures_to_draw(work, tau, delta, r, m, async_checkpoint, sigma)
    blocking, background = (sigma, delta) if async_checkpoint else (delta, 0.0)
    rng = np.random.default_rng(seed)
    fails = failure_times(m, runs, chunk, rng)

    period = tau + blocking  # from a snapshot's end to the next one's, without failures
    t = np.zeros(runs)  # the clock
    start = np.zeros(runs)  # when the current attempt started (from a start or restart)
    kept = np.zeros(runs, dtype=np.int64)  # checkpoints complete
    nxt = np.zeros(runs, dtype=np.int64)  # index of the next failure
    restarting = np.zeros(runs, dtype=bool)
    done = np.zeros(runs, dtype=bool)
    count = np.zeros(runs, dtype=np.int64)
    rows = np.arange(runs)
    while not done.all():
        if nxt.max() >= fails.shape[1]:  # rare: more failures than drawn; draw the continuation
            more = failure_times(m, runs, chunk, rng) + fails[:, -1:]
            fails = np.concatenate([fails, more], axis=1)
        f = fails[rows, nxt]
        # Restarting: the restart completes if no failure falls inside it, else it begins again at the failure.
        rs = restarting & ~done
        ok = rs & (f >= t + r)
        t[ok] += r
        start[ok] = t[ok]
        restarting[ok] = False
        again = rs & ~ok
        t[again] = f[again]
        nxt[again] += 1
        count[again] += 1
        # Working from `start` with `kept` checkpoints: the end, or the checkpoints kept until the failure.
        wk = ~restarting & ~done  # a run whose restart just ended works on, toward the same failure time
        left = segments - kept
        end = start + (left - 1) * period + last + blocking + background
        finish = wk & (f >= end)
        t[finish] = end[finish]
        done |= finish
        fail = wk & ~finish
        completed = np.floor((f - start - background) / period)
        kept[fail] += np.clip(completed[fail], 0, left[fail] - 1).astype(np.int64)
        t[fail] = f[fail]
        nxt[fail] += 1
        count[fail] += 1
        restarting[fail] = True
    mean_t = t.mean()
    goodput = work / mean_t
    stderr = goodput * t.std(ddof=1) / mean_t / math.sqrt(runs)
    return SimulatedGoodput(float(goodput), float(stderr), runs, float(count.mean()), float(mean_t))


def _simulation_seconds(
    interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float, work_s: float, stall_s: float
) -> tuple[float, float, float, float, float, float]:
    """:func:`simulate_goodput`'s seconds as floats, each refused unless finite and greater than 0 (the checkpoint,
    the restart and the stall at least 0)."""
    return (
        float(_check("interval_s", interval_s)),
        float(_check("checkpoint_s", checkpoint_s, allow_zero=True)),
        float(_check("restart_s", restart_s, allow_zero=True)),
        float(_check("mtbf_s", mtbf_s)),
        float(_check("work_s", work_s)),
        float(_check("stall_s", stall_s, allow_zero=True)),
    )


def _failures_to_draw(
    work: float, tau: float, delta: float, r: float, m: float, async_checkpoint: bool, sigma: float
) -> int:
    """How many failure times to draw for each run at a time: the failures a run of ``work`` seconds expects at the
    closed form's goodput (:func:`expected_goodput`, which refuses a write longer than the interval), with a
    margin; refused above 1e5, too many to simulate."""
    g = expected_goodput(tau, delta, r, m, async_checkpoint, sigma)
    expected_failures = work / max(g, 1e-12) / m
    if expected_failures > 1e5:
        raise ValueError(
            f"about {expected_failures:.3g} failures a run (expected goodput {g:.3g}): too many to simulate; "
            "shorten the interval or the work"
        )
    return int(expected_failures * 1.5 + 10 * math.sqrt(expected_failures) + 20)


# ------------------------------------------------------------------------------------------------ failures


def cluster_mtbf(job_hours: float, interruptions: int) -> float:
    """Mean time between interruptions of a job, in hours: its time over its interruptions."""
    _check("job_hours", job_hours)
    if not (isinstance(interruptions, int | np.integer) and interruptions >= 1):
        raise ValueError(f"interruptions must be a whole number of at least 1, not {interruptions!r}")
    return job_hours / interruptions


def job_mtbf(mtbf_gpu: float, gpus: int) -> float:
    """The MTBF of a job on ``gpus`` GPUs that stops when any one fails, each failing independently at exponential
    times of mean ``mtbf_gpu``: the first of N exponentials is exponential with mean MTBF_gpu / N (any unit)."""
    _check("mtbf_gpu", mtbf_gpu)
    if not (isinstance(gpus, int | np.integer) and gpus >= 1):
        raise ValueError(f"gpus must be a whole number of at least 1, not {gpus!r}")
    return mtbf_gpu / gpus


@dataclass(frozen=True)
class FailureRecord:
    """A published count of a training job's interruptions."""

    name: str
    gpus: int
    days: float
    interruptions: int
    unexpected: int
    faulty_gpus: int
    printed_faulty_gpu_share: float
    source: str

    @property
    def job_hours(self) -> float:
        return 24 * self.days

    def mtbf_job_hours(self, unexpected_only: bool = True) -> float:
        """Hours between interruptions of the job: the unexpected ones (the failures a checkpoint is for; planned
        ones are taken at a checkpoint) or all of them."""
        return cluster_mtbf(self.job_hours, self.unexpected if unexpected_only else self.interruptions)

    def mtbf_gpu_hours(self, unexpected_only: bool = True) -> float:
        """The MTBF per GPU that the job's implies if every interruption is one GPU's (server's) share of the
        failures: N x MTBF_job (the inverse of :func:`job_mtbf`)."""
        return self.gpus * self.mtbf_job_hours(unexpected_only)

    @property
    def faulty_gpu_share(self) -> float:
        """Faulty GPUs over unexpected interruptions, computed (the paper prints another number, see ``LLAMA3``)."""
        return self.faulty_gpus / self.unexpected


LLAMA3 = FailureRecord(
    name="llama3-405b",
    gpus=16_384,
    days=54,
    interruptions=466,
    unexpected=419,
    faulty_gpus=148,
    # Table 5 prints 30.1% for the 148 faulty-GPU interruptions, but 148 / 419 = 35.3%: a slip in the table.
    printed_faulty_gpu_share=0.301,
    source="Grattafiori et al. 2024 (The Llama 3 Herd of Models), §3.3.4 and Table 5: during a 54-day snapshot of "
    "pre-training on 16K H100s, 466 job interruptions, 47 planned and 419 unexpected (about 78% of them confirmed "
    "or suspected hardware), 148 of them faulty GPUs (Table 5 prints 30.1%, but 148/419 = 35.3%)",
)


# ------------------------------------------------------------------------------------------------ checkpoint size


def checkpoint_bytes_per_rank(
    model: Model | str, layout, precision: str = "mixed", deduplicate: bool = False
) -> dict[str, float]:
    """Bytes a checkpoint holds per rank for ``model`` (a :class:`~course_lib.planner.presets.Model` or preset name)
    laid out as ``layout`` (anything with ``tp``, ``pp``, ``dp``, ``zero``, ``cp``, ``ep``: a
    :class:`~course_lib.planner.layouts.Layout`, a planner's candidate or plan), from
    :func:`course_lib.model.formulas.model_state_formula`: the parameters and the optimizer states (for mixed precision
    the fp32 master weights and both moments) that the busiest rank holds, i.e. its stage's share of the layers
    (the layout's ``stage_layers`` where it has them; and, with a known vocabulary, one embedding matrix) over TP,
    the ZeRO stage's shard over the data-parallel ranks, whole experts split by EP. Not gradients (recomputed by the
    next step) nor activations.

    ``deduplicate``: what the rank writes when each replicated tensor is written by only one of its replicas and
    the writes are spread evenly (``torch.distributed.checkpoint`` deduplicates replicas; Megatron's fully
    parallel save spreads them over the data-parallel ranks): :func:`training_state_bytes` over the layout's
    ranks, each part (:func:`deduplicated_checkpoint_bytes`). Without it, the rank's whole holding: what a save
    in which every rank writes all it holds (replicas included) would write."""
    m = make_model(preset=model) if isinstance(model, str) else model
    if deduplicate:  # every rank writes an even share of the state, held once
        ranks = layout.tp * layout.pp * layout.dp * getattr(layout, "cp", 1)
        state = training_state_bytes(m, precision)
        return {part: nbytes / ranks for part, nbytes in state.items()}
    # else the busiest rank's whole holding (its stage's embedding included)
    where = stage_shape(m.vocab, m.hidden, m.layers, m.tied, m.norm) if m.vocab else {}
    states = model_state_formula(
        m.params, precision, layout.zero, layout.dp, layout.tp, layout.pp, m.expert_params, layout.ep, layout.cp,
        stage_layers=getattr(layout, "stage_layers", ()), **where,
    )  # fmt: skip
    return {
        "params": states["params"],
        "optimizer": states["optimizer"],
        "total": states["params"] + states["optimizer"],
    }


def training_state_bytes(model: Model | str, precision: str = "mixed") -> dict[str, float]:
    """The training state a checkpoint holds, each tensor once, whatever the layout: every parameter at the
    model's width and its optimizer states (:func:`course_lib.model.formulas.model_state_formula` on one device).
    Mixed precision: 2 bytes of bf16 weights and 12 of fp32 master weights and AdamW's two moments, 14 bytes a
    parameter; ``fp32``: 4 + 8 = 12. Not gradients (the next step recomputes them) nor activations."""
    m = make_model(preset=model) if isinstance(model, str) else model
    states = model_state_formula(m.params, precision)
    return {"params": states["params"], "optimizer": states["optimizer"],
            "total": states["params"] + states["optimizer"]}  # fmt: skip


def deduplicated_checkpoint_bytes(model: Model | str, gpus: int, precision: str = "mixed") -> float:
    """Bytes each of ``gpus`` ranks writes to a distributed checkpoint that stores every tensor once and spreads
    the writes evenly (PyTorch's DCP deduplicates replicated tensors; Megatron's fully parallel save spreads them
    over the data-parallel ranks): :func:`training_state_bytes` over ``gpus``, in every layout."""
    if not (isinstance(gpus, int | np.integer) and gpus >= 1):
        raise ValueError(f"gpus must be a whole number of at least 1, not {gpus!r}")
    return training_state_bytes(model, precision)["total"] / gpus


def checkpoint_seconds(
    bytes_per_rank: float, write_bandwidth: float, ranks: int = 1, storage_bandwidth: float = math.inf
) -> float:
    """Seconds to write ``bytes_per_rank`` from each of ``ranks`` ranks at once: each rank writes at
    ``write_bandwidth`` bytes/s unless the storage's aggregate ``storage_bandwidth`` shared by all ranks is less,
    min(write_bandwidth, storage_bandwidth / ranks). (Llama 3's Tectonic sustains 2 TB/s, peaks at 7 TB/s; §3.3.1.)"""
    b = _check("bytes_per_rank", bytes_per_rank, allow_zero=True)
    bw = _check("write_bandwidth", write_bandwidth)
    if not (isinstance(ranks, int | np.integer) and ranks >= 1):
        raise ValueError(f"ranks must be a whole number of at least 1, not {ranks!r}")
    if not (storage_bandwidth > 0) or math.isnan(storage_bandwidth):
        raise ValueError(f"storage_bandwidth must be greater than 0 (math.inf: no cap), not {storage_bandwidth!r}")
    return _out(b / np.minimum(bw, storage_bandwidth / ranks))


# ------------------------------------------------------------------------------------------------ worked example


@dataclass
class IntervalChoice:
    """:func:`choose_interval`'s answer: the checkpoint's size and time, the job's MTBF, the intervals, and
    ``table``, (interval_s, expected goodput) rows at multiples of the chosen interval."""

    layout: str
    checkpoint_bytes: float
    checkpoint_s: float
    mtbf_job_s: float
    young_s: float
    daly_s: float
    goodput: float
    table: list[tuple[float, float]]
    async_checkpoint: bool = False


def choose_interval(
    model: Model | str,
    gpus: int,
    mtbf_gpu_s: float,
    write_bandwidth: float,
    restart_s: float,
    layout=None,
    storage_bandwidth: float = math.inf,
    precision: str = "mixed",
    deduplicate: bool = False,
    stall_s: float | None = None,
    factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0),
) -> IntervalChoice:
    """The checkpoint interval for ``model`` on ``gpus`` GPUs: the layout (given, else the published one when its
    axes make ``gpus``, else the planner's choice), the checkpoint per rank (:func:`checkpoint_bytes_per_rank`) and
    its write time (:func:`checkpoint_seconds`), the job's MTBF (:func:`job_mtbf`), Young's and Daly's intervals,
    and the expected goodput at Daly's and at ``factors`` times it. With ``stall_s`` (> 0) the checkpoint is
    asynchronous: Young's and Daly's intervals are the stall's, Daly's at least the write time
    (:func:`expected_goodput`)."""
    m = make_model(preset=model) if isinstance(model, str) else model
    if layout is None:
        p = plan(m, gpus, precision=precision)
        pub = published_candidate(p) if m.published and published_gpus(m.published) == gpus else None
        layout = pub or p
    if isinstance(layout, Layout):
        name = f"TP {layout.tp} x CP {layout.cp} x PP {layout.pp} x DP {layout.dp}, EP {layout.ep}, ZeRO-{layout.zero}"
    else:
        name = describe(layout)
    size = checkpoint_bytes_per_rank(m, layout, precision, deduplicate)["total"]
    delta = checkpoint_seconds(size, write_bandwidth, gpus, storage_bandwidth)
    mtbf = job_mtbf(mtbf_gpu_s, gpus)
    asynchronous = stall_s is not None
    blocking = float(_check("stall_s", stall_s)) if asynchronous else delta  # what training waits for
    best = max(daly_interval(blocking, mtbf), delta) if asynchronous else daly_interval(delta, mtbf)

    def g(tau: float) -> float:
        return expected_goodput(tau, delta, restart_s, mtbf, asynchronous, stall_s or 0.0)

    rows = [(f * best, g(f * best)) for f in factors if not (asynchronous and f * best < delta)]
    return IntervalChoice(name, size, delta, mtbf, young_interval(blocking, mtbf), best, g(best), rows, asynchronous)
