"""glibc allocator settings for a training process: freed tensor memory stays in the process.

Every step allocates and frees tensors of the same large sizes again: the logits (8 rows x 64
positions x 49k ids of SmolLM2 in fp32 = 100 MB), their log-softmax and its gradient, autocast's
bf16 copy of each weight, the weight gradients. By default glibc serves each block above its mmap
threshold (128 KiB, rising to at most 32 MiB) with a fresh `mmap` and unmaps it on free, and trims
the heap's free top, so the next step's tensor of the same size page-faults every page in again.
Where bf16 matmuls are fast (AMX) that is a large share of the update: the profiler showed a 56 MB
weight cast at 90 ms instead of 10 ms into memory already mapped.

`keep_freed_memory()` turns both off (`mallopt(M_MMAP_MAX, 0)`, `mallopt(M_TRIM_THRESHOLD, 2 GiB)`,
what the environment variables MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_ do for a whole process), so
freed blocks are reused. Measured (docs/performance.md, "Allocator"): the full-FT bf16 update at the
vs_trl shape from ~6.3 s to ~4.2 s on an Intel Xeon with AMX. Cost: the process keeps its peak
memory mapped after the peak instead of returning some of it to the system. Setting:
`train.keep_freed_memory` (default on).
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

# glibc's malloc.h parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# mallopt takes an int: the largest trim threshold it can hold.
_NEVER_TRIM_BYTES = 2**31 - 1


@cache
def keep_freed_memory() -> bool:
    """Keep freed memory in this process (no mmap per large block, no heap trimming). Idempotent.

    Returns True when glibc took both settings; False on a platform without glibc's mallopt (macOS,
    Windows, musl's no-op), where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the libc this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # Trimming off first: with mmap off and trimming on, a freed large block at the heap's top
    # would be handed back to the system at once.
    return mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM_BYTES) == 1 and mallopt(M_MMAP_MAX, 0) == 1
