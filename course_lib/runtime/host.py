"""What this machine has for ranks: the memory this process may still take, as the kernel estimates it and as its
memory cgroups allow, its cores and its GPUs; and what they decide: how many local ranks it holds, which backend and
device the ranks take. It imports no torch (but to count GPUs where a driver is installed), so the launcher, the
harness and the command line can all ask before anything starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from course_lib.runtime.forkserver import under_torchrun

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


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def max_local_ranks() -> int:
    """How many local ranks this machine holds: four per core (at least 8, the course's 3D grid) and no more than
    the memory available to this process fits at :data:`RANK_MEMORY_BYTES` each
    (:func:`available_memory`: page cache counts as available, a cgroup's limit as a limit)."""
    by_cores = max(8, 4 * cores())
    available = available_memory()
    return by_cores if available is None else max(1, min(by_cores, available // RANK_MEMORY_BYTES))


def check_world_size(world_size: int, max_ranks: int | None = None) -> None:
    """Refuse more local CPU ranks than this machine holds (:func:`max_local_ranks`), or than ``max_ranks`` where the
    user set that limit: a typo must not fork a thousand processes. Under torchrun, torchrun decides how many
    processes there are."""
    if under_torchrun():
        return
    if max_ranks is not None:
        if world_size > max_ranks:
            raise ValueError(
                f"world size {world_size} is more ranks than your limit allows (max_ranks={max_ranks}, "
                f"--max-ranks {max_ranks} on the command line): use fewer ranks, or raise the limit."
            )
        return
    limit = max_local_ranks()
    if world_size > limit:
        available = available_memory()
        memory = "" if available is None else f"{available / 2**30:.1f} GiB available, "
        raise ValueError(
            f"world size {world_size} is more ranks than this machine holds ({limit}: four per core on {cores()} "
            f"core{'s' * (cores() != 1)}, at least 8, within the memory available to this process ({memory}"
            f"~{RANK_MEMORY_BYTES // 2**20} MB a rank)). Use fewer ranks, or raise the limit if you know better "
            "(max_ranks= in launch.run and run_scheme, --max-ranks on the command line)."
        )


# Where a CUDA (or ROCm) GPU's driver shows itself on Linux (WSL2: /dev/dxg); none of them: no GPU torch could use.
_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def cuda_devices() -> int:
    """The CUDA devices torch can use: 0, without importing torch, where no GPU driver is installed (a laptop, CI:
    neither Linux's device nodes above nor Windows), so that a CPU machine refuses ``nccl`` or ``cuda`` at once;
    else torch's count."""
    if sys.platform != "win32" and not any(os.path.exists(path) for path in _GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def compute_device(backend: str, device: str | None = None) -> str:
    """Where ranks compute: ``cpu``, or ``cuda`` (local rank r on GPU r modulo the GPUs). By default CUDA under
    NCCL and the CPU under gloo. gloo ranks may compute on CUDA too, several to a GPU: their collectives then go
    through host memory (:mod:`course_lib.ledgers.comm`). NCCL ranks compute on their GPUs only."""
    if device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not cuda_devices():
        raise ValueError("device 'cuda' needs a CUDA GPU, and this machine has none: use device 'cpu'")
    if device == "cpu" and backend == "nccl":
        raise ValueError("NCCL ranks compute on their GPUs: use backend 'gloo' for ranks on the CPU")
    return device


def resolve_backend(backend: str, world_size: int) -> str:
    """``auto`` becomes nccl when CUDA has one device per rank, else gloo; an impossible choice is an error."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    gpus = cuda_devices()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend 'nccl' needs one CUDA device per rank: world_size={world_size} but this machine has {gpus}. "
            "Use backend='gloo' (CPU ranks) or a smaller world_size."
        )
    return backend


def local_device(name: str | None) -> str:
    """The device ``name`` says (``cpu``, ``cuda`` or ``cuda:N``; None: the first CUDA GPU if there is one, else the
    CPU), as ``cpu`` or ``cuda:N``; a one-line ValueError for another name or a GPU this machine has not."""
    if name is None:
        return "cuda:0" if cuda_devices() else "cpu"
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not index.isdigit()):
        raise ValueError(f"unknown device {name!r}; use cpu or cuda (cuda:N for GPU N)")
    if kind == "cpu":
        return "cpu"
    count, index = cuda_devices(), int(index or 0)
    if index >= count:
        raise ValueError(f"no CUDA device {index}: this machine has {count}; measure the CPU with --device cpu")
    return f"cuda:{index}"
