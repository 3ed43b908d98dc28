"""What this machine has for ranks: the memory this process may still take, as the kernel estimates it and as its
memory cgroups allow. It imports no torch, so the launcher, the harness and the command line can all ask before
anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path

MEMINFO = "/proc/meminfo"  # the kernel's account of the machine's memory (Linux)
RANK_MEMORY_BYTES = 400 * 2**20  # what one local CPU rank costs: its own pages beyond the forkserver's, generously

# What a memory cgroup's files are called: its limit, its use, and the file cache in its memory.stat (counted as
# free, as MemAvailable counts the machine's: the kernel reclaims it before it fails an allocation). v1's "total_"
# fields count the cgroup's descendants too, as v2's do. (The kernel's cgroup-v1.rst and cgroup-v2.rst.)
_CGROUP_FILES = {
    "cgroup2": ("memory.max", "memory.current", ("active_file", "inactive_file")),
    "cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
}


def parse_meminfo(text: str) -> dict[str, int]:
    """The fields of ``/proc/meminfo`` as numbers, in bytes where it counts ``kB`` (KiB)."""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


def memory_cgroups(mountinfo: str, membership: str) -> list[tuple[str, Path, Path]]:
    """The memory cgroups this process is in, from the text of ``/proc/self/mountinfo`` and ``/proc/self/cgroup``:
    (kind, its folder, the folder its hierarchy is mounted at), kind ``cgroup2`` (v2) or ``cgroup`` (v1's memory
    controller)."""
    joined = {}  # kind: the cgroup's path in its hierarchy
    for line in membership.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            joined["cgroup2"] = path
        elif "memory" in controllers.split(","):
            joined["cgroup"] = path
    found = []
    for line in mountinfo.splitlines():
        mount_fields, _, fs_fields = line.partition(" - ")
        mount, fs = mount_fields.split(), fs_fields.split()
        if len(mount) < 5 or len(fs) < 3 or fs[0] not in joined:
            continue
        if fs[0] == "cgroup" and "memory" not in fs[2].split(","):
            continue
        inside = os.path.relpath(joined[fs[0]], mount[3])  # mount[3]: the part of the hierarchy mounted there
        if not inside.startswith(".."):
            found.append((fs[0], Path(os.path.normpath(Path(mount[4], inside))), Path(mount[4])))
    return found


def cgroup_room(kind: str, folder: Path, top: Path) -> int | None:
    """What the memory cgroups from ``folder`` up to ``top`` leave: the least of each one's limit less its use, its
    file cache counted as free; None where none has a limit or none can be read."""
    limit_file, usage_file, cache_fields = _CGROUP_FILES[kind]
    rooms = []
    for level in (folder, *folder.parents):
        if not level.is_relative_to(top):
            break
        try:
            limit = (level / limit_file).read_text().strip()
            usage = int((level / usage_file).read_text())
            stat = dict(line.split() for line in (level / "memory.stat").read_text().splitlines())
            cache = sum(int(stat.get(name, 0)) for name in cache_fields)
        except (OSError, ValueError):  # not a level of this hierarchy that holds the files (or not readable)
            continue
        if limit != "max":
            rooms.append(int(limit) - usage + cache)
    return min(rooms, default=None)


def available_memory() -> int | None:
    """Bytes this process may still take: the machine's ``MemAvailable`` (free pages and the page cache and slab
    the kernel can reclaim; free pages alone shrink as the page cache fills), or less where a memory cgroup (v2 or
    v1) limits it. Where ``/proc/meminfo`` is not there or has no ``MemAvailable``, the free pages; None if not even
    they can be read."""
    try:
        machine = parse_meminfo(Path(MEMINFO).read_text())["MemAvailable"]
    except (OSError, KeyError):
        try:
            machine = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # no such sysconf name on this system
            return None
    try:
        cgroups = memory_cgroups(Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError:  # not Linux
        cgroups = []
    rooms = [room for kind, folder, top in cgroups if (room := cgroup_room(kind, folder, top)) is not None]
    return min([machine, *rooms])
