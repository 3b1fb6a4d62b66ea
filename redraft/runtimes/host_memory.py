"""Host memory of a long-running process: keep what it frees for its next request, and back a first request's memory
before the request comes.

Why: the first write to a page the process has never used costs a page fault, and on a virtual machine whose host
backs guest memory lazily (free pages handed back to the host) that fault costs 25-37 us a page instead of ~1 us
(measured on a 2-core AMD EPYC VM: 200 MB in 1.4-1.9 s). glibc's malloc returns large blocks to the kernel as soon as
they are freed (``mmap`` above its threshold, heap trimming above another), so every request's KV copies and
activations land on fresh pages again. A server's first request after start-up, with a prefix entry read from disk,
paid ~0.4 s of its time to first token that way. With :func:`keep_freed_memory` freed blocks stay in the process's
heap, and :func:`prefault` backs a given number of bytes at start-up, where the wait is the operator's, not a user's.

The settings are glibc's ``mallopt`` parameters (``man 3 mallopt``): ``M_ARENA_MAX`` 1 (every thread allocates from
the one heap that :func:`prefault` backs), ``M_MMAP_THRESHOLD`` 32 MiB (its maximum; blocks below it come from the heap,
which also turns off glibc's sliding threshold) and ``M_TRIM_THRESHOLD`` 1 GiB (free memory at the heap's top is
kept up to that). The cost: the process's resident size stays near its peak. Other C libraries: nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1 << 30
CHUNK = 16 << 20  # prefault's blocks: under MMAP_THRESHOLD, so they come from (and go back to) the heap


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory in this process (see the module). Call it early, before the threads
    that allocate start (a thread keeps the arena it first allocated from).

    Returns:
        True when every setting took; False on another C library or when glibc refused one (nothing raised).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        ok = mallopt(param, value) == 1 and ok
    return ok


def first_request_bytes(disk=None) -> int:
    """Bytes a server's first request may allocate at once, for :func:`prefault`: twice the largest prefix KV entry
    on disk for its model (``disk``: its :class:`~redraft.runtimes.prefix_store.PrefixStore`, or None; the entry
    read, and the KV buffer it is copied into) and 64 MiB of activations, at most an eighth of the machine's memory."""
    want = 2 * (disk.largest() if disk is not None else 0) + (64 << 20)
    try:
        return min(want, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8)
    except (ValueError, OSError, AttributeError):
        return want


def prefault(nbytes: int) -> float:
    """Allocate ``nbytes`` from the heap in 16 MiB blocks, write every page, and free them: with
    :func:`keep_freed_memory` in force the pages stay in the heap, backed, for the next allocations.

    Args:
        nbytes: bytes to back (rounded up to 16 MiB; <= 0 does nothing).
    Returns:
        Seconds it took.
    """
    import torch

    t0 = time.perf_counter()
    blocks = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(-(-max(0, int(nbytes)) // CHUNK))]
    del blocks
    return time.perf_counter() - t0
