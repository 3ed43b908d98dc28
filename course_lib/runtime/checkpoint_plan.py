"""Which checkpoints a run saves and which one it resumes from: the plan (:class:`CheckpointPlan`, built by
:func:`plan_for`), each checkpoint's ``meta.json``, whether a checkpoint is intact (:func:`problem`, with
:mod:`course_lib.runtime.checkpoint_manifest`), the newest intact one in a folder (:func:`find`) and what a failed run
left behind (:func:`survey`). :mod:`course_lib.runtime.checkpoint` writes and reads the tensors with torch; this
module imports no torch, so the command line refuses a bad resume, a damaged checkpoint or impossible checkpoint
settings in one line before anything starts, and the harness builds the same plan before it launches ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from course_lib.runtime import checkpoint_manifest

FORMAT = "course_lib.runtime.checkpoint/2"  # 2: tensors in their one-device shapes (1: flattened)
META = "meta.json"
TRAIN_FIELDS = ("batch", "lr", "weight_decay", "adam_eps", "seed", "dtype")  # all of TrainConfig that the path needs
_STEP_DIR = re.compile(r"step-(\d+)")
_PARTIAL_DIR = re.compile(r"\.step-(\d+)\.partial")
UNFINISHED = "an unfinished save"  # why a resume passes over a .partial folder
# The fields of meta.json that loading reads, and their types (describe writes them).
_META_TYPES = {
    "format": str,
    "step": int,
    "scheme": str,
    "world_size": int,
    "model_config": dict,
    "model_factory": (str, type(None)),
    "train": dict,
}


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """What a rank does about checkpoints: save into ``directory`` after every ``every``-th step (both or neither),
    resume from the checkpoint folder ``resume`` (a ``step-<n>`` folder), and record ``meta`` (the scheme, world
    size, model and training settings) in each checkpoint."""

    meta: dict
    directory: str | None = None
    every: int | None = None
    resume: str | None = None
    start: int = 0  # the first step to run: the resumed checkpoint's step
    asynchronous: bool = False  # write in the background (:class:`Saver`)
    skipped: tuple[dict, ...] = ()  # what the resume passed over, each {"path", "why"} (:func:`find`)

    def due(self, step: int) -> bool:
        """Save after step ``step`` (from 0)? After every ``every``-th optimizer step: (step + 1) % every == 0."""
        return self.every is not None and (step + 1) % self.every == 0


def _meta(path: Path) -> tuple[dict | None, str | None]:
    """The ``meta.json`` of checkpoint folder ``path``, or what is wrong with it in a few words naming it."""
    try:
        meta = json.loads((path / META).read_bytes())
    except FileNotFoundError:
        return None, f"missing file {META}"
    except ValueError as error:
        return None, f"{META} is not valid JSON ({error}): damaged"
    if not isinstance(meta, dict):
        return None, f"{META} holds a JSON {type(meta).__name__}, not an object"
    for field, kind in _META_TYPES.items():
        if field not in meta:
            return None, f"{META}: missing {field!r}"
        if isinstance(meta[field], bool) or not isinstance(meta[field], kind):
            wanted = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            return None, f"{META}: {field!r} is {type(meta[field]).__name__} {meta[field]!r}, not {wanted}"
        if field == "format" and meta[field] != FORMAT:  # before the other fields, which another format may lack
            return None, f"{META}: format {meta['format']!r}, not this course's {FORMAT}"
    return meta, None


def read_meta(path: str | os.PathLike) -> dict:
    """The ``meta.json`` of checkpoint folder ``path``; a ValueError if it is not one (or is damaged)."""
    meta, why = _meta(Path(path))
    if why:
        raise ValueError(f"{path} is not a checkpoint this course can read: {why}")
    return meta


def problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, in one line naming the file (relative to
    ``path``): a bad ``meta.json``, no manifest, a file missing, truncated or damaged
    (:func:`course_lib.runtime.checkpoint_manifest.problem`), or one that cannot be read; None when it is intact."""
    try:
        return _meta(Path(path))[1] or checkpoint_manifest.problem(path)
    except OSError as error:  # a failing disk, permissions, a file where the folder should be
        where = os.path.relpath(error.filename, path) if error.filename else "a file"
        return f"{where} cannot be read ({error.strerror or error})"


def _entries(directory: str | os.PathLike, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """The entries of ``directory`` whose names ``pattern`` matches, with the step in their name, oldest first."""
    found = []
    for entry in Path(directory).iterdir() if Path(directory).is_dir() else ():
        if m := pattern.fullmatch(entry.name):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def complete(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints in ``directory``, the saves renamed into place as ``step-<n>`` (intact or not:
    :func:`problem`), oldest first."""
    return [entry for _, entry in _entries(directory, _STEP_DIR)]


def unfinished(directory: str | os.PathLike) -> dict[Path, tuple[int, int]]:
    """The saves in ``directory`` that never finished (``.step-<n>.partial`` folders, oldest first), each with its
    inode and modification time: a save of that step makes the folder anew, which is how :func:`survey` tells the
    save a run had in flight from one an earlier run left."""
    found = {}
    for _, entry in _entries(directory, _PARTIAL_DIR):
        with contextlib.suppress(OSError):  # removed since it was listed
            stat = entry.stat()
            found[entry] = (stat.st_ino, stat.st_mtime_ns)
    return found


def survey(directory: str | os.PathLike, before: dict[Path, tuple[int, int]]) -> str:
    """What the checkpoint folder ``directory`` holds after a run failed, in words: its complete checkpoints, the
    save the run had in flight and any unfinished save an earlier run left (``before``: :func:`unfinished` as the
    run began)."""
    said = [f"{entry.name} (complete)" for entry in complete(directory)] or ["no complete checkpoint"]
    for path, mark in unfinished(directory).items():
        step = _PARTIAL_DIR.fullmatch(path.name).group(1)
        if before.get(path) == mark:
            said.append(f"step-{step} is an unfinished save an earlier run left ({path})")
        else:
            said.append(f"step-{step} was being written ({path}) when the run failed")
    return f"checkpoints in {directory}: {'; '.join(said)}"


def skipped_saves(directory: str | os.PathLike, step: int) -> list[dict]:
    """The unfinished saves in ``directory`` of steps after ``step``, newest first, each ``{"path", "why"}``: what a
    resume from the checkpoint of ``step`` leaves behind."""
    return [
        {"path": str(entry), "why": UNFINISHED} for n, entry in reversed(_entries(directory, _PARTIAL_DIR)) if n > step
    ]


def _newest_intact(directory: Path) -> tuple[Path | None, list[dict]]:
    """The newest intact checkpoint in ``directory`` (or None), and the saves passed over on the way back to it,
    newest first, each ``{"path", "why"}``: unfinished, or damaged (:func:`problem`)."""
    saves = _entries(directory, _STEP_DIR) + _entries(directory, _PARTIAL_DIR)
    skipped = []
    for _, entry in sorted(saves, key=lambda save: (save[0], _STEP_DIR.fullmatch(save[1].name) is not None))[::-1]:
        why = UNFINISHED if _PARTIAL_DIR.fullmatch(entry.name) else problem(entry)
        if why is None:
            return entry, skipped
        skipped.append({"path": str(entry), "why": why})
    return None, skipped


def find(path: str | os.PathLike) -> tuple[Path, list[dict]]:
    """The checkpoint ``path`` names and what the resume passes over (each ``{"path", "why"}``): that folder if it
    is a checkpoint, refused if it is damaged (:func:`problem`), and the unfinished saves of later steps beside it;
    else the newest intact checkpoint inside it, and the later saves, unfinished or damaged, walked back over. A
    ValueError in one line when there is none."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"cannot resume from {path}: no such file or folder")
    if _STEP_DIR.fullmatch(path.name) or any(
        (path / name).exists() for name in (META, checkpoint_manifest.MANIFEST, ".metadata")
    ):
        if why := problem(path):
            raise ValueError(f"cannot resume from {path}: {why}")
        return path, skipped_saves(path.parent, read_meta(path)["step"])
    newest, skipped = _newest_intact(path)
    if newest is not None:
        return newest, skipped
    if damaged := [s for s in skipped if s["why"] != UNFINISHED]:
        raise ValueError(
            f"cannot resume from {path}: none of its checkpoints is intact: "
            + "; ".join(f"{s['path']}: {s['why']}" for s in damaged)
            + " (move them aside to start at step 0)"
        )
    left = ", ".join(str(entry) for entry in unfinished(path))
    raise ValueError(
        f"cannot resume from {path}: it is not a checkpoint and holds none (no step-<n> folder; "
        + (f"only unfinished saves: {left})" if left else "a save that crashed leaves only .step-<n>.partial)")
    )


def describe(scheme: str, world_size: int, cfg: Any, train: Any, model: Callable | None) -> dict:
    """What a checkpoint records about the run beside its step: the scheme and world size (for the report; any
    checkpointing scheme and size can load it) and what must match to resume: the model and the training path."""
    return {
        "scheme": scheme,
        "world_size": world_size,
        "model_config": dataclasses.asdict(cfg),
        "model_factory": None if model is None else f"{model.__module__}.{model.__qualname__}",
        "train": {k: getattr(train, k) for k in TRAIN_FIELDS},
        "torch": metadata.version("torch"),  # the installed torch, read without importing it
    }


def plan_for(
    scheme: str,
    takes_checkpoints: bool,
    world_size: int,
    cfg: Any,
    train: Any,
    model: Callable | None,
    directory: str | os.PathLike | None,
    every: int | None,
    resume: str | os.PathLike | None,
    asynchronous: bool = False,
) -> CheckpointPlan | None:
    """The run's plan, or None without checkpoints; a ValueError saying what to change for a scheme that cannot
    checkpoint, a mixed-precision run, ``every`` without a folder (or the reverse), ``asynchronous`` without them,
    or a resume from something that is not a checkpoint, of another model or training settings, or with no step left
    to run."""
    if asynchronous and directory is None:
        raise ValueError("asynchronous checkpoints need checkpoints: checkpoint_dir=D and checkpoint_every=K")
    if directory is None and every is None and resume is None:
        return None
    if not takes_checkpoints:
        raise ValueError(
            f"scheme {scheme!r} cannot save or resume checkpoints: its entry says checkpoint=False (a scheme "
            f"checkpoints when its rank function trains through train_loop and its model describes what it holds)"
        )
    if train.precision is not None:
        raise ValueError(
            "checkpoints hold fp32 AdamW state per parameter, not a mixed-precision run's master weights and loss "
            "scale: drop the checkpoint settings, or precision"
        )
    if (directory is None) != (every is None):
        raise ValueError("checkpoints need both a folder and an interval: checkpoint_dir=D and checkpoint_every=K")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"checkpoint_every must be a whole number of steps of at least 1, not {every!r}")
    meta = describe(scheme, world_size, cfg, train, model)
    if resume is None:
        return CheckpointPlan(meta, str(directory), every, asynchronous=asynchronous)
    path, skipped = find(resume)
    saved = read_meta(path)
    wrong = [
        f"{field}={saved['model_config'].get(field)!r} (this run: {value!r})"
        for field, value in meta["model_config"].items()
        if saved["model_config"].get(field) != value
    ] + [
        f"{field}={saved['train'].get(field)!r} (this run: {value!r})"
        for field, value in meta["train"].items()
        if saved["train"].get(field) != value
    ]
    if saved["model_factory"] != meta["model_factory"]:
        wrong.append(f"model={saved['model_factory']} (this run: {meta['model_factory']})")
    if wrong:
        raise ValueError(
            f"cannot resume from {path}: it was saved by another model or training run: {'; '.join(wrong)}. "
            f"Resume with the settings it was saved with"
        )
    if saved["step"] >= train.steps:
        raise ValueError(
            f"cannot resume from {path}: it holds the state after {saved['step']} steps, and this run has "
            f"{train.steps}, so nothing is left to train; ask for more than {saved['step']} steps"
        )
    return CheckpointPlan(
        meta,
        None if directory is None else str(directory),
        every,
        str(path),
        saved["step"],
        asynchronous,
        tuple(skipped),
    )
