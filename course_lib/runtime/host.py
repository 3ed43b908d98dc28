"""What this machine has for ranks: the memory available to new processes, as the kernel estimates it.

It imports no torch, so the launcher, the harness and the command line can all ask before anything starts.
"""

from __future__ import annotations

import os


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The memory new processes can take without the machine swapping: Linux's ``MemAvailable`` (free memory plus
    the page cache and reclaimable slabs it can drop), else the free pages (``SC_AVPHYS_PAGES``, an underestimate
    where the kernel keeps a cache); None where neither is known."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such sysconf name on this system
        return None
