"""Keep freed host memory in the process for reuse (glibc malloc), so CPU prefill's temporaries cost no page faults.

A CPU prefill chunk allocates and frees tensors of tens of MB at every operation (a norm's float32 copy of an
8192-token chunk is 64 MB). glibc serves an allocation above its mmap threshold (at most 32 MB) with a fresh
``mmap`` and returns it to the kernel when it is freed, and trims the top of its heap above ``M_TRIM_THRESHOLD``;
each new allocation then faults in zeroed pages again. On the 2-core development VM an 8192-token prefill of four
Qwen3-30B-A3B layers took 2.2 million minor faults (8.4 GB of pages zeroed) and spent 9 of its 16 s in the kernel.

:func:`keep_freed_memory` sets ``M_MMAP_MAX`` to 0 (large blocks come from the heap too), ``M_TRIM_THRESHOLD`` to
its largest value, 2 GiB (freed memory up to that is kept), and ``M_ARENA_MAX`` to 1: a thread's own arena lives in
heaps of 64 MiB and serves a larger block with ``mmap`` whatever ``M_MMAP_MAX`` says, so threads that first allocate
after the call share the main heap. The next chunk then reuses the pages of the last. The process keeps its peak
heap size instead of shrinking after a long prompt. The runner calls it on a CPU device once the weights are loaded
(the expert pool and the weights keep their own mappings); the server calls it before it starts its engine thread,
which builds the runner. The settings are process-wide and stay (``--no-keep-freed-host-memory`` skips them).
glibc's malloc parameters are documented in ``mallopt(3)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt(3) parameter numbers (glibc malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
_TRIM_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set


def keep_freed_memory() -> str | None:
    """Make glibc malloc keep freed memory (see the module docstring).

    Returns:
        A one-line description for the start-up summary, or ``None`` where it does not apply (not glibc, or
        ``mallopt`` refused a parameter; nothing is changed then beyond what was accepted, and a warning says so).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as e:
        log.warning("host malloc: libc not loadable (%s); freed memory goes back to the kernel", e)
        return None
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, _TRIM_MAX)
            and libc.mallopt(M_ARENA_MAX, 1)):
        log.warning("host malloc: mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD / M_ARENA_MAX; freed memory may go "
                    "back to the kernel")
        return None
    return ("glibc malloc keeps freed memory (no mmap per block, trim above 2 GiB, one arena): prefill temporaries "
            "reuse pages")
