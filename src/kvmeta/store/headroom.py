"""Whether the memory of a new in-process pool can be had, asked before it is allocated.

A pool's arrays grow with the pages it hands out (``core.pool``): creating one commits it to
its first capacity step only (``first_capacity``, at most 1025 pages), so the check is of that
and rarely matters; it stays as a backstop. Python raises MemoryError only where the kernel
refuses the allocation outright; where it overcommits, the server is killed later, when the
pages are touched. So the size is compared with what the system says is available first, and
a MemoryError that happens anyway becomes the same refusal: a 413 that changed nothing, never
a 500. (A pool whose arrays cannot grow later answers its reserves as a full pool does.)
"""

from __future__ import annotations

import os
import resource

from kvmeta.core.pool import first_capacity
from kvmeta.errors import PayloadTooLarge

__all__ = ["BUILD_BYTES_PER_PAGE", "check_pool_memory", "memory_headroom", "pool_too_big"]

# Memory a pool takes per page while its arrays grow (26 bytes once grown, ``service.limits``):
# a state byte, a key slot, a read-lease double and two int32 links, and the zeroed bytes an
# array is extended from.
BUILD_BYTES_PER_PAGE = 30
# Smaller pools are not checked: the common case reads no file.
_CHECK_FROM = 64 << 20


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """A cgroup v2 limit (a container's memory.max) minus what the cgroup uses."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def _address_space_available() -> int | None:
    """RLIMIT_AS (ulimit -v) minus the address space this process has mapped."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(0, soft - mapped)


def memory_headroom() -> int | None:
    """Bytes this process may still allocate as far as the system says (the least of the
    machine's available memory, its cgroup's and its address-space limit); None: unknown."""
    known = [
        n
        for n in (_meminfo_available(), _cgroup_available(), _address_space_available())
        if n is not None
    ]
    return min(known) if known else None


def _size(nbytes: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"~{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} bytes"


def pool_too_big(num_pages: int, available: int | None) -> PayloadTooLarge:
    """The 413 of a pool whose memory cannot be had (``available``: None when the allocation
    itself failed)."""
    need = _size(first_capacity(num_pages) * BUILD_BYTES_PER_PAGE)
    have = (
        f"this server has {_size(available)} available"
        if available is not None
        else "the allocation failed (out of memory)"
    )
    return PayloadTooLarge(
        f"`num_pages` {num_pages}: a new pool needs {need} of memory to create and {have}; "
        "nothing was created. Free memory on the machine (this server is out of it), or "
        "check the page size computation and create a smaller pool",
        "num_pages",
    )


def check_pool_memory(num_pages: int) -> None:
    """Raises ``pool_too_big`` when a new pool of ``num_pages`` would not fit in memory."""
    need = first_capacity(num_pages) * BUILD_BYTES_PER_PAGE
    if need < _CHECK_FROM:
        return
    available = memory_headroom()
    if available is not None and need > available:
        raise pool_too_big(num_pages, available)
