"""A CPU rank's heap keeps the memory it frees, as a device's caching allocator does.

glibc hands a large block (above 32 MiB at most, often far less) its own ``mmap`` and
gives it back to the kernel when freed; the next block of that size is faulted in again
page by page. A CPU training step allocates and frees its activations, gradients and each
convolution's reordered weights every action, so every action paid for its pages twice:
at SD v2 size, 144k faults in an up block's forward, 300k in its weight gradient, and the
step (pp 2, 256 px) ran 10.1 s where it runs 7.9 s with the heap kept::

    default heap    malloc(118 MB) -> mmap, 29k faults  ... free -> munmap    (every action)
    kept heap       malloc(118 MB) -> heap, faulted once ... free -> stays in the heap, reused

``keep_freed_memory()`` turns mmap off (``M_MMAP_MAX`` 0: every block from the heap) and trimming
off up to 2 GiB of free heap top (``M_TRIM_THRESHOLD``, an int). The rank's resident peak is
unchanged (its tensors' peak plus what glibc's heap always kept), and memory it freed is
not handed back to the host until the process ends. Left alone where the user set glibc's
heap themselves (``MALLOC_*_`` or ``GLIBC_TUNABLES``; ``benchmarks/memory_scale.py`` sets a
64 KiB mmap threshold for exact accounting), with ``PULSE_HOST_HEAP=default``, or off glibc.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping

SWITCH = "PULSE_HOST_HEAP"  # "default": glibc's heap as it is
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # malloc.h
_INT_MAX = 2**31 - 1


def user_chose_heap(environ: Mapping[str, str]) -> bool:
    """The user (or a benchmark) set glibc's heap themselves, or asked for it as it is."""
    return (environ.get(SWITCH, "") == "default" or any(k.startswith("MALLOC_") for k in environ)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""))


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Keep freed memory in this process's heap (see the module); True when it was set."""
    if user_chose_heap(os.environ if environ is None else environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
