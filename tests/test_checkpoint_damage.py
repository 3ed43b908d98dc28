"""Damaged checkpoints (issue 37 item 2): one zero3 save on 2 ranks, copied per case and damaged as disks, editors and
crashes damage files (a flipped byte in each kind of piece, truncated, emptied or missing files, bad DCP metadata, bad
``meta.json`` fields, no manifest); each is refused in one line naming the file and what is wrong, before any rank
starts, and a resume from the folder falls back to the newest intact checkpoint, bit for bit, saying what it skipped.
Before the manifest, a flipped byte in an optimizer-state chunk or in ``meta.json``'s step resumed with exit 0."""

import io
import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from course_lib.cli import main
from course_lib.harness import run_scheme
from course_lib.model.config import GPTConfig, TrainConfig
from course_lib.runtime import checkpoint_plan
from course_lib.runtime.checkpoint_manifest import MANIFEST

CFG = GPTConfig(layers=1)  # the command line's tiny GPT with --layers 1
TRAIN = TrainConfig(steps=4, dtype="float64")
MORE = TrainConfig(steps=6, dtype="float64")  # steps left after step-4: a refusal is the damage's, not the count's
COMMON = ["run", "zero3", "--world-size", "2", "--steps", "4", "--dtype", "float64", "--layers", "1"]
FLIPPED = "checksum differs from the manifest (flipped or overwritten bytes)"


def params(run) -> dict[str, torch.Tensor]:
    whole = {}
    for value in run.result:
        whole |= value["params"] or {}
    return whole


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """zero3 on 2 ranks, 4 steps in float64, a checkpoint every 2 (step-2, step-4): the run and its folder."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    return run_scheme("zero3", 2, CFG, TRAIN, checkpoint_dir=folder, checkpoint_every=2), folder


def flip(file, at: int, bit: int = 0x10) -> None:
    """Flip one bit of the byte at ``at`` of ``file``."""
    data = bytearray(file.read_bytes())
    data[at] ^= bit
    file.write_bytes(bytes(data))


def chunk_data(folder, file: str, wanted) -> tuple[str, tuple, int]:
    """The first tensor chunk of ``file`` whose key ``wanted`` accepts, from DCP's own ``.metadata`` (not the
    manifest): its key, offsets and where its tensor's numbers start in the file (DCP writes each chunk as a
    torch.save container; the numbers are found in it by value)."""
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    index, info = next((i, s) for i, s in storage.items() if s.relative_path == file and wanted(i.fqn))
    with open(folder / file, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    numbers = torch.load(io.BytesIO(blob)).numpy().tobytes()
    assert blob.count(numbers) == 1
    return index.fqn, tuple(index.offset), info.offset + blob.find(numbers)


def flip_number(file: str, wanted):
    """Damage: flip a bit in the first number of the first chunk of ``file`` whose key ``wanted`` accepts."""

    def damage(folder) -> str:
        key, offsets, at = chunk_data(folder, file, wanted)
        flip(folder / file, at + 6)  # float64, little-endian: a high bit of the mantissa
        return f"{file}: {FLIPPED} in {key} at {offsets}"

    return damage


def flip_meta_step(folder) -> str:
    """A bit flipped in meta.json's step: 4 (0x34) becomes 5 (0x35), still valid JSON of the right types (the old
    code resumed at step 5 with exit 0)."""
    text = (folder / checkpoint_plan.META).read_text()
    assert text.count('"step": 4') == 1
    flip(folder / checkpoint_plan.META, text.index('"step": 4') + len('"step": '), bit=0x01)
    return f"{checkpoint_plan.META}: {FLIPPED}"


def edit_meta(change):
    def damage(folder) -> str:
        meta = json.loads((folder / checkpoint_plan.META).read_text())
        expected = change(meta)
        (folder / checkpoint_plan.META).write_text(json.dumps(meta))
        return expected

    return damage


def drop_model_config(meta: dict) -> str:
    del meta["model_config"]
    return f"{checkpoint_plan.META}: missing 'model_config'"


def step_as_text(meta: dict) -> str:
    meta["step"] = "4"
    return f"{checkpoint_plan.META}: 'step' is str '4', not int"


def other_format(meta: dict) -> str:
    meta["format"] = "course_lib.runtime.checkpoint/1"  # which had no model_factory: the format is named first
    del meta["model_factory"]
    return (
        f"{checkpoint_plan.META}: format 'course_lib.runtime.checkpoint/1', not this course's {checkpoint_plan.FORMAT}"
    )


def meta_a_list(folder) -> str:
    (folder / checkpoint_plan.META).write_text("[]")
    return f"{checkpoint_plan.META} holds a JSON list, not an object"


def cut(file: str, keep):
    """Damage: ``file`` cut to ``keep(size)`` bytes."""

    def damage(folder) -> str:
        size = (folder / file).stat().st_size
        (folder / file).write_bytes((folder / file).read_bytes()[: keep(size)])
        return f"{file} is {keep(size):,} bytes, the manifest says {size:,} (truncated or overwritten)"

    return damage


def remove(file: str, expected: str):
    def damage(folder) -> str:
        (folder / file).unlink()
        return expected

    return damage


def flip_middle(file: str, expected: str):
    def damage(folder) -> str:
        flip(folder / file, (folder / file).stat().st_size // 2)
        return expected

    return damage


def overwrite_metadata(folder) -> str:
    """Bad metadata: DCP's .metadata overwritten by zeros of its own length (the old code: UnpicklingError)."""
    size = (folder / ".metadata").stat().st_size
    (folder / ".metadata").write_bytes(bytes(size))
    return f".metadata: {FLIPPED}"


def flip_manifest(folder) -> str:
    """A bit flipped in one of the manifest's own checksums: the manifest, not the shard, is named."""
    text = (folder / MANIFEST).read_text()
    at = text.index('"sha256": "') + len('"sha256": "')
    # Another hex digit, so the manifest stays valid JSON (flipping bit 0x10 of a "2" would make it a '"').
    flip(folder / MANIFEST, at, bit=ord(text[at]) ^ ord("0" if text[at] != "0" else "1"))
    return f"{MANIFEST}: its own checksum differs (flipped or overwritten bytes)"


def meta_cut_in_half(folder) -> str:
    half = (folder / checkpoint_plan.META).read_bytes()[: (folder / checkpoint_plan.META).stat().st_size // 2]
    (folder / checkpoint_plan.META).write_bytes(half)
    with pytest.raises(ValueError) as words:
        json.loads(half)
    return f"{checkpoint_plan.META} is not valid JSON ({words.value}): damaged"


DAMAGE = {
    "model-shard-flipped": flip_number("__0_0.distcp", lambda key: key.startswith("model.")),
    "optimizer-shard-flipped": flip_number("__1_0.distcp", lambda key: key.endswith(".exp_avg_sq")),
    "metadata-flipped": flip_middle(".metadata", f".metadata: {FLIPPED}"),
    "meta-json-flipped": flip_meta_step,
    "manifest-flipped": flip_manifest,
    "shard-truncated": cut("__1_0.distcp", lambda size: size // 2),
    "shard-emptied": cut("__0_0.distcp", lambda size: 0),
    "metadata-truncated": cut(".metadata", lambda size: 100),
    "shard-missing": remove("__1_0.distcp", "missing file __1_0.distcp (the manifest lists it)"),
    "metadata-missing": remove(".metadata", "missing file .metadata (the manifest lists it)"),
    "metadata-overwritten": overwrite_metadata,
    "meta-json-missing": remove(checkpoint_plan.META, f"missing file {checkpoint_plan.META}"),
    "meta-json-not-json": meta_cut_in_half,
    "meta-json-key-missing": edit_meta(drop_model_config),
    "meta-json-wrong-type": edit_meta(step_as_text),
    "meta-json-other-format": edit_meta(other_format),
    "meta-json-a-list": meta_a_list,
    "no-manifest": remove(
        MANIFEST,
        f"no {MANIFEST}, so nothing proves it intact (checkpoints written before issue 37 have none): train again, "
        f"or resume from a checkpoint that has one",
    ),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_refused_in_one_line_before_any_rank(case, saved, tmp_path, nothing_may_start):
    copy = tmp_path / "step-4"
    shutil.copytree(saved[1] / "step-4", copy)
    assert checkpoint_plan.problem(copy) is None  # the copy is intact: what follows is the damage's doing
    reason = DAMAGE[case](copy)
    with pytest.raises(ValueError) as refused:
        run_scheme("zero3", 2, CFG, MORE, resume=copy)
    said = str(refused.value)
    assert said == f"cannot resume from {copy}: {reason}" and "\n" not in said


def test_the_command_line_refuses_a_damaged_checkpoint_in_one_line(saved, tmp_path, nothing_may_start):
    """The issue's case, as a user types it: a flipped bit in an optimizer-state chunk resumed with exit 0."""
    copy = tmp_path / "step-4"
    shutil.copytree(saved[1] / "step-4", copy)
    reason = DAMAGE["optimizer-shard-flipped"](copy)
    with pytest.raises(SystemExit) as refused:
        main([*COMMON, "--steps", "6", "--resume", str(copy)])
    assert refused.value.code == f"run zero3: cannot resume from {copy}: {reason}"


def test_a_resume_from_the_folder_falls_back_to_the_newest_intact_checkpoint(saved, tmp_path):
    """step-4 damaged: the resume from the folder takes step-2, names step-4 and why in the report, and trains the
    two steps left bit for bit as the uninterrupted run."""
    run, folder = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    reason = DAMAGE["optimizer-shard-flipped"](copy / "step-4")
    resumed = run_scheme("zero3", 2, CFG, TRAIN, resume=copy)
    assert resumed.report["resumed_from"] == {
        "path": str(copy / "step-2"),
        "scheme": "zero3",
        "world_size": 2,
        "skipped": [{"path": str(copy / "step-4"), "why": reason}],
    }
    assert resumed.report["losses"] == run.report["losses"][2:]  # float equality: bit for bit
    full, again = params(run), params(resumed)
    assert full.keys() == again.keys() and all(torch.equal(full[k], again[k]) for k in full)


def test_auto_resume_says_which_checkpoint_it_skipped_and_why(saved, tmp_path, capsys):
    """--auto-resume walks back past an unreadable step-6, an unfinished save of step 6 and a truncated step-4, says
    so, and its own save of step 4 replaces the damaged one."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[1], copy)
    reason = DAMAGE["shard-truncated"](copy / "step-4")
    (copy / ".step-6.partial").mkdir()
    (copy / "step-6").write_text("")  # a file where a checkpoint folder should be
    report = tmp_path / "resumed.json"
    saving = ["--checkpoint-dir", str(copy), "--checkpoint-every", "2", "--auto-resume", "--json", str(report)]
    assert main([*COMMON, *saving]) == 0
    said = capsys.readouterr().out
    assert json.loads(report.read_text())["losses"] == saved[0].report["losses"][2:]
    assert (
        f"  resumed from {copy / 'step-2'} (step 2, saved by zero3 on 2); skipped {copy / 'step-6'}: meta.json cannot "
        f"be read (Not a directory); skipped {copy / '.step-6.partial'}: an unfinished save; "
        f"skipped {copy / 'step-4'}: {reason}\n" in said
    ), said
    assert checkpoint_plan.problem(copy / "step-4") is None


def test_auto_resume_refuses_when_no_checkpoint_is_intact(saved, tmp_path, nothing_may_start):
    """Every checkpoint damaged: refused, naming each and why, rather than starting over on a disk that damages
    files (moving them aside starts at step 0)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[1], copy)
    two, four = DAMAGE["model-shard-flipped"](copy / "step-2"), DAMAGE["no-manifest"](copy / "step-4")
    with pytest.raises(SystemExit) as refused:
        main([*COMMON, "--checkpoint-dir", str(copy), "--checkpoint-every", "2", "--auto-resume"])
    assert refused.value.code == (
        f"run zero3: cannot resume from {copy}: none of its checkpoints is intact: {copy / 'step-4'}: {four}; "
        f"{copy / 'step-2'}: {two} (move them aside to start at step 0)"
    )


def test_the_manifest_lists_every_file_and_every_chunk(saved):
    """Each file of the checkpoint but the manifest, of its size; each chunk DCP's .metadata records, once."""
    folder = saved[1] / "step-4"
    manifest = json.loads((folder / MANIFEST).read_text())
    files = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST}
    assert {name: entry["bytes"] for name, entry in manifest["files"].items()} == files
    listed = sorted(
        (name, c["key"], tuple(c["offsets"]), c["at"], c["bytes"])
        for name, entry in manifest["files"].items()
        for c in entry.get("chunks", [])
    )
    storage = FileSystemReader(str(folder)).read_metadata().storage_data
    assert listed == sorted((s.relative_path, i.fqn, tuple(i.offset), s.offset, s.length) for i, s in storage.items())
