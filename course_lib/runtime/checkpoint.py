"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP): save a rank's training state, resume it
exactly, on the same layout or another.

**What is saved.** Each trainable parameter and its AdamW state under its name on one device, in its one-device
shape; each rank offers the pieces of them it holds, and DCP reshards at load time, so a checkpoint loads into any
layout (:mod:`course_lib.runtime.checkpoint_state`).

Frozen parameters are not saved (the model's constructor rebuilds them from the seed), nor is any RNG state of the
tiny GPT's training: it has no dropout, and its data is a pure function of the step
(:func:`course_lib.model.gpt.synthetic_tokens` seeds its own generator), so the **data position is the step**, counted
in global batches; a new layout splits the same global batch its own way, which is what makes resharding the data
position trivial here (torchtitan must refuse a data-loader state saved at another DP degree). Each rank's torch RNG
state is saved anyway (``rng.rank<r>``) and restored when the world size is the same, for a student's model with
dropout.

**Atomic.** A checkpoint of the state after n steps is the folder ``step-<n>``: written into ``.step-<n>.partial``
beside it, then ``meta.json`` and ``manifest.json`` (rank 0), then renamed. A crash before the rename leaves the
previous checkpoints as they were and a ``.partial`` folder that nothing reads (the next save of that step clears
it). The Llama 3 report (§3.3.4) counts 419 unexpected interruptions in 54 days: a checkpoint that can be
half-written will be. So a failed run says which checkpoints are complete and which save was in flight
(:func:`survey`, which the harness adds to the run's error), and a resume names the unfinished saves of later steps
it skipped (:func:`skipped_saves`).

**Proven before it is loaded.** A complete checkpoint can still be damaged afterwards (a flipped bit, a truncated
copy, an edited ``meta.json``). The manifest (:mod:`course_lib.runtime.checkpoint_manifest`: each file's size and
SHA-256, each tensor chunk's CRC-32) is checked with ``meta.json``'s fields by :func:`problem`, in the launching
process before any rank starts (:func:`find`, from :func:`plan_for`): a damaged checkpoint named to resume from is
refused in one line naming the file and what is wrong; a resume from a folder of checkpoints (``--auto-resume``)
walks back from the newest to the newest intact one and names each it passed over and why.

**The loop.** :func:`course_lib.parallel.data.train_loop`, the one step body of every scheme, calls :func:`load`
before its first step and saves after each optimizer step that :meth:`CheckpointPlan.due` names (a :class:`Saver`:
with :func:`save` while training waits, or with ``CheckpointPlan.asynchronous`` in the background, as
``dcp.async_save`` does), reading the :class:`CheckpointPlan` that :func:`planned` makes active in the rank's process
(as :mod:`course_lib.runtime.faults` passes a fault), so no scheme carries checkpoint code. The harness builds the plan
with :func:`plan_for`, which refuses a bad resume before any rank starts.

The plan and what is checked on disk (:class:`CheckpointPlan`, :func:`plan_for`, :func:`find`, :func:`problem`,
:func:`survey`, :func:`skipped_saves`) live in :mod:`course_lib.runtime.checkpoint_plan`, which imports no torch, so
the command line refuses a damaged checkpoint before anything starts; this module writes and reads the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ledgers import trace
from course_lib.runtime import checkpoint_manifest, faults, launch
from course_lib.runtime.checkpoint_plan import FORMAT, META, CheckpointPlan, read_meta
from course_lib.runtime.checkpoint_state import Pieces, dcp_planners, training_state

_ACTIVE: CheckpointPlan | None = None  # the plan of this rank's process, set by planned


def active() -> CheckpointPlan | None:
    """This rank's checkpoint plan, if the run has one."""
    return _ACTIVE


def planned(fn: Callable, plan: CheckpointPlan) -> Callable:
    """``fn`` (a rank function) with ``plan`` active in every rank that runs it; pass it to ``launch.run``."""
    return launch.with_setting(fn, __name__, "_ACTIVE", plan)


# ------------------------------------------------------------------------------------------------ the state
# ------------------------------------------------------------------------------------------------ save, load
def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer, staged: bool) -> dict[str, Any]:
    """What this rank saves: its pieces of every parameter and AdamW state, the AdamW step counters and its RNG
    state. ``staged``: copies in host memory (contiguous, on the CPU) that training cannot change while a background
    write reads them; else views of the live tensors."""
    tensors, steps = training_state(model, optimizer, saving=True)
    state: dict[str, Any] = {**tensors, **{key: states[0]["step"] for key, states in steps.items()}}
    state[f"rng.rank{dist.get_rank()}"] = torch.get_rng_state()
    if not staged:
        return state

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)

    for key, value in state.items():
        if isinstance(value, Pieces):
            state[key] = Pieces(value.shape)
            state[key].pieces = {offsets: copy(piece) for offsets, piece in value.pieces.items()}
        else:
            state[key] = copy(value)
    return state


def _folders(plan: CheckpointPlan, step: int) -> tuple[Path, Path]:
    """The checkpoint folder of ``step`` and the ``.partial`` folder it is written into."""
    root = Path(plan.directory)
    return root / f"step-{step}", root / f".step-{step}.partial"


def _prepare(plan: CheckpointPlan, step: int) -> Path:
    """Every rank, before writing ``step``: rank 0 makes the folder and clears what a crashed save of this step left;
    returns the ``.partial`` folder to write into."""
    target, partial = _folders(plan, step)
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    return partial


def _publish(plan: CheckpointPlan, step: int) -> Path:
    """Rank 0, once every rank's shards of ``step`` and DCP's ``.metadata`` are written: add ``meta.json`` and the
    manifest of every file's checksums (:mod:`course_lib.runtime.checkpoint_manifest`), and rename the ``.partial``
    folder into place (module docstring)."""
    target, partial = _folders(plan, step)
    meta = {"format": FORMAT, **plan.meta, "step": step}
    with open(partial / META, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    checkpoint_manifest.write(partial)
    if target.exists():  # the same step saved by an earlier run: set it aside, then drop it
        aside = target.parent / f".step-{step}.old"
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
        partial.rename(target)
        shutil.rmtree(aside)
    else:
        partial.rename(target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is on disk
    finally:
        os.close(fd)
    return target


def save(plan: CheckpointPlan, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Every rank: write the state after ``step`` optimizer steps as ``plan.directory/step-<step>``, atomically,
    while training waits (module docstring). An injected fault of phase ``checkpoint`` fires after the shards are
    written and before the rename (:func:`course_lib.runtime.faults.reach`)."""
    import torch.distributed.checkpoint as dcp

    partial = _prepare(plan, step)
    state = _state_to_save(model, optimizer, staged=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), planner=dcp_planners()[0])
    faults.reach(step - 1, "checkpoint")
    if dist.get_rank() == 0:
        _publish(plan, step)
    dist.barrier()
    return _folders(plan, step)[0]


class Saver:
    """A rank's checkpoints for one run of :func:`course_lib.parallel.data.train_loop`: after each step the plan
    names, :meth:`after_step` saves, in the foreground (:func:`save`) or, with ``plan.asynchronous``, in the
    background with PyTorch's ``dcp.async_save``: training stops only to copy the state to host memory (the
    *stall*); a thread writes the copy while the next steps run, through a gloo group of its own so that its
    collectives never interleave with training's. DCP's write ends on every rank only once every rank's shards and
    the ``.metadata`` are on disk, so rank 0's writer then renames the folder into place at once (an injected fault
    of phase ``checkpoint`` fires in the writer just before). One write is in flight at a time: the next save, and
    the end of the run (:meth:`finish`), first wait for the one under way, and that wait is a stall too.

    ``timings`` records, per save, on this rank's clock (:func:`course_lib.ledgers.trace.now`): ``stall`` (training
    stopped to save), ``write`` (the state going to storage) and ``wait`` (waiting for the background write to end;
    asynchronous only)."""

    def __init__(self, plan: CheckpointPlan, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp  # imported before the first save, so that no stall includes it

        self._dcp = dcp
        self.plan, self.model, self.optimizer = plan, model, optimizer
        self.timings: list[dict] = []
        self._pending: tuple[dict, threading.Event, list] | None = None
        self._group = dist.new_group(backend="gloo") if plan.asynchronous else None

    def after_step(self, step: int) -> None:
        """Step ``step`` (from 0) has taken its optimizer step: save the state if the plan says so."""
        if not self.plan.due(step):
            return
        self.finish()
        began = trace.now()
        if not self.plan.asynchronous:
            save(self.plan, step + 1, self.model, self.optimizer)
            ended = trace.now()
            self.timings.append({"step": step + 1, "stall": [began, ended], "write": [began, ended]})
            return
        partial = _prepare(self.plan, step + 1)
        state = _state_to_save(self.model, self.optimizer, staged=True)
        timing = {"step": step + 1, "stall": [began, None], "write": [trace.now(), None]}
        done, failed = threading.Event(), []

        def written(future) -> None:  # in the writer's thread, as DCP's write ends on every rank
            timing["write"][1] = trace.now()
            try:
                future.result()
                faults.reach(step, "checkpoint")
                if dist.get_rank() == 0:
                    _publish(self.plan, step + 1)
            except BaseException as error:  # re-raised by finish, in the training thread
                failed.append(error)
            finally:
                done.set()

        future = self._dcp.async_save(
            state,
            storage_writer=self._dcp.FileSystemWriter(partial),
            planner=dcp_planners()[0],
            process_group=self._group,
            async_stager=_already_staged(),
        )
        future.add_done_callback(written)
        timing["stall"][1] = trace.now()
        self._pending = (timing, done, failed)

    def finish(self) -> None:
        """Wait for a background save still under way (a no-op otherwise); raise what went wrong in it."""
        if self._pending is None:
            return
        timing, done, failed = self._pending
        self._pending = None
        began = trace.now()
        done.wait()
        timing["wait"] = [began, trace.now()]
        self.timings.append(timing)
        if failed:
            raise failed[0]


def stalls(timing: dict) -> list[list[float]]:
    """The intervals a save of :attr:`Saver.timings` stopped training: its stall, and its wait if it had one."""
    return [timing["stall"], *([timing["wait"]] if "wait" in timing else [])]


def _already_staged():
    """A DCP stager that passes the state through: :func:`_state_to_save` has copied it already (DCP's default
    stager cannot copy :class:`Pieces`)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class AlreadyStaged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return AlreadyStaged()


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank: load the checkpoint folder ``path`` into ``model`` and ``optimizer`` (whatever their layout;
    DCP reads the chunks each rank's pieces overlap) and return its step, the first step left to run."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    step_keys = [key for key in stored if key.startswith("optim.") and key.endswith(".step")]
    step_dtype = stored[step_keys[0]].properties.dtype if step_keys else torch.float32
    tensors, steps = training_state(model, optimizer, step_dtype)
    missing = sorted((set(tensors) | set(steps)) - set(stored))
    if missing:
        raise ValueError(f"{path} holds no {', '.join(missing[:3])}{' ...' * (len(missing) > 3)}: another model's")
    wrong = [
        f"{key} {tuple(stored[key].size)} (here {tuple(t.size())})"
        for key, t in tensors.items()
        if stored[key].size != t.size()
    ]
    if wrong:
        raise ValueError(
            f"{path} holds tensors of other shapes than this model's: {', '.join(wrong[:3])}: another model's"
        )
    counters = {key: torch.zeros((), dtype=stored[key].properties.dtype) for key in steps}
    state: dict[str, Any] = {**tensors, **counters}
    rng = f"rng.rank{dist.get_rank()}"
    same_world = meta["world_size"] == dist.get_world_size()
    if same_world:
        state[rng] = torch.empty_like(torch.get_rng_state())
    dcp.load(state, storage_reader=reader, planner=dcp_planners()[1])
    keys_of: dict[int, list[str]] = {}  # a ZeRO slice's one counter is saved under each parameter it meets
    for key, states in steps.items():
        for s in states:
            keys_of.setdefault(id(s), []).append(key)
    for key, states in steps.items():
        for s in states:
            values = {counters[k].item() for k in keys_of[id(s)]}
            if len(values) > 1:
                raise RuntimeError(f"{path}: AdamW step counters {sorted(values)} differ within one slice at {key}")
            s["step"] = counters[key].clone()
    if same_world:
        torch.set_rng_state(state[rng])
    return int(meta["step"])


def stored_chunks(path: str | os.PathLike) -> list[tuple[str, int, int]]:
    """Every chunk the checkpoint folder ``path`` holds, from DCP's ``.metadata``: (key, the rank that wrote it,
    bytes of data). The files hold a little more: DCP writes each chunk in a container of its own."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    chunks = []
    for index, info in metadata.storage_data.items():
        stored = metadata.state_dict_metadata[index.fqn]
        if not isinstance(stored, TensorStorageMetadata):
            raise ValueError(f"{path}: {index.fqn} is not a tensor; a checkpoint of this course holds only tensors")
        sizes = next(c.sizes for c in stored.chunks if tuple(c.offsets) == tuple(index.offset))
        rank = int(re.fullmatch(r"__(\d+)_\d+\.distcp", info.relative_path).group(1))  # FileSystemWriter's names
        chunks.append((index.fqn, rank, math.prod(sizes) * stored.properties.dtype.itemsize))
    return chunks
