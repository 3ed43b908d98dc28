"""A checkpoint that proves itself: the manifest of every file a checkpoint folder holds, written with it and checked
before it is loaded (issue 37: one flipped byte in an optimizer-state chunk resumed with exit 0, 7.3e-3 off).

**What it holds.** ``manifest.json``, written by rank 0 into the ``.partial`` folder once DCP's shards, its
``.metadata`` and ``meta.json`` are on disk, and before the folder is renamed into place (so a complete checkpoint
always has one; :func:`course_lib.runtime.checkpoint.save`, and the background writer of
:class:`course_lib.runtime.checkpoint.Saver`): per file its size in bytes and its SHA-256, and per tensor chunk of a
``.distcp`` file (the byte range DCP's ``.metadata`` records for each piece: key, offsets in the one-device tensor,
where it starts, how long) a CRC-32. The file's SHA-256 is the proof; the chunks' CRC-32s only say *which* tensor a
damaged file has wrong, and are read only when the file's SHA-256 already differs. CRC-32 (``zlib.crc32``, 4 GB/s
here against SHA-256's 1.8 GB/s with the CPU's SHA instructions) suffices for that: it catches every error burst of up
to 32 bits and other accidental damage but for one case in 2^32; nothing relies on it against a forger. The manifest
ends with the SHA-256 of the rest of itself, so a damaged manifest is named as such rather than blamed on a shard.

**Checked** by :func:`problem`, in the launching process before any rank starts
(:func:`course_lib.runtime.checkpoint.find`): every listed file is there, of its size (a stat, nothing read), then
each file's SHA-256 (every byte read once). A checkpoint without a manifest, written before there were any or with
its manifest lost, is refused: nothing could tell it from a damaged one.

**Cost**, measured on this 2-core machine (shared, load about 8) with zero3 on 2 ranks in float32: the course's tiny
GPT (``GPTConfig()``, a 1.5 MB checkpoint) takes 12 ms to write its manifest (a third of it the fsync) and 2-6 ms to
check it before a resume (a resume's whole run: 1.6 s); a save's write went from a median of 131 ms without to 151 ms
with (32 saves each; the quartiles overlap). Lesson 08's d_model 256 x 4 layers (38.7 MB): 60-90 ms to write, 55 ms
to check, about the 49 ms of reading its files once.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "course_lib.runtime.checkpoint.manifest/1"


def _dumps(value: dict) -> str:
    """The one way a manifest is written, so that a reader can hold its bytes to it: one line (``indent`` would
    take Python's own encoder instead of the C one, 7 ms for the tiny GPT's manifest instead of 0.3)."""
    return json.dumps(value, sort_keys=True)


def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _crc32s(file: Path, chunks: list[dict]) -> list[int]:
    """The CRC-32 of each chunk's bytes of ``file`` (``at``, ``bytes``)."""
    with open(file, "rb") as f:
        found = []
        for chunk in chunks:
            f.seek(chunk["at"])
            found.append(zlib.crc32(f.read(chunk["bytes"])))
        return found


def _chunks(folder: Path) -> dict[str, list[dict]]:
    """Each file's tensor chunks, as DCP's ``.metadata`` in ``folder`` places them: ``{file: [{key, offsets, at,
    bytes}]}``, in the order they lie in the file."""
    from torch.distributed.checkpoint import FileSystemReader

    found: dict[str, list[dict]] = {}
    for index, info in FileSystemReader(str(folder)).read_metadata().storage_data.items():
        found.setdefault(info.relative_path, []).append(
            {"key": index.fqn, "offsets": list(index.offset), "at": info.offset, "bytes": info.length}
        )
    return {name: sorted(chunks, key=lambda c: c["at"]) for name, chunks in found.items()}


def write(folder: Path) -> None:
    """Rank 0, in the ``.partial`` folder of a save whose files are all written: add ``manifest.json`` (module
    docstring) and fsync it."""
    chunks = _chunks(folder)
    files = {}
    for file in sorted(p for p in folder.iterdir() if p.name != MANIFEST):
        listed = chunks.get(file.name, [])
        crcs = _crc32s(file, listed)
        files[file.name] = {
            "bytes": file.stat().st_size,
            "sha256": _sha256(file),
            **({"chunks": [{**c, "crc32": crc} for c, crc in zip(listed, crcs, strict=True)]} if listed else {}),
        }
    body = {"format": FORMAT, "files": files}
    text = _dumps({**body, "sha256": hashlib.sha256(_dumps(body).encode()).hexdigest()})
    with open(folder / MANIFEST, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read(folder: Path) -> tuple[dict | None, str | None]:
    """The manifest of ``folder``, or why it cannot be trusted."""
    try:
        raw = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, (
            f"no {MANIFEST}, so nothing proves it intact (checkpoints written before issue 37 have none): train "
            f"again, or resume from a checkpoint that has one"
        )
    try:
        manifest = json.loads(raw)
    except ValueError as error:
        return None, f"{MANIFEST} is not valid JSON ({error}): damaged"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"{MANIFEST} is not a manifest of format {FORMAT}"
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if raw != _dumps(manifest).encode() or manifest.get("sha256") != hashlib.sha256(_dumps(body).encode()).hexdigest():
        return None, f"{MANIFEST}: its own checksum differs (flipped or overwritten bytes)"
    return manifest, None


def _at(chunk: dict) -> str:
    return f"{chunk['key']} at {tuple(chunk['offsets'])}"


def problem(folder: str | os.PathLike) -> str | None:
    """Why the checkpoint folder ``folder`` is not as its manifest says, in one line naming the file (relative to
    ``folder``); None when every file is there, of its size and checksum."""
    folder = Path(folder)
    manifest, why = _read(folder)
    if why:
        return why
    files = manifest["files"]
    for name, entry in files.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"missing file {name} (the manifest lists it)"
        if size != entry["bytes"]:
            return f"{name} is {size:,} bytes, the manifest says {entry['bytes']:,} (truncated or overwritten)"
    for name, entry in files.items():
        if _sha256(folder / name) == entry["sha256"]:
            continue
        chunks = entry.get("chunks", [])
        bad = [c for c, crc in zip(chunks, _crc32s(folder / name, chunks), strict=True) if crc != c["crc32"]]
        where = f" in {_at(bad[0])}" + (f" and {len(bad) - 1} more chunk(s)" if len(bad) > 1 else "") if bad else ""
        return f"{name}: checksum differs from the manifest (flipped or overwritten bytes){where}"
    return None
