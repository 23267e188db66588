"""A CPU rank's heap keeps what it frees (pulse.host_heap): a freed large block is reused
without faulting its pages in again, and a heap the user set is left alone."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pulse.host_heap import keep_freed_memory, user_chose_heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")

# faults when a 64 MiB block (plain malloc: no transparent huge pages asked for, as torch asks none) is allocated, filled, freed and allocated and filled again
_REFAULTS = """
import ctypes, resource, sys
from pulse.host_heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc, size = ctypes.CDLL(None), 64 << 20
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); ctypes.memset(block, 1, size)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _refaults(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _REFAULTS, mode], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_kept_heap_reuses_a_freed_block_without_faulting_it_in_again() -> None:
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    kept, faults = _refaults("keep")
    assert kept
    assert faults < 0.05 * pages
    default, faults_default = _refaults("default")
    assert not default
    assert faults_default > 0.9 * pages  # glibc unmapped the block: the control that makes the check mean something


def test_a_heap_the_user_set_is_left_alone() -> None:
    kept, faults = _refaults("keep", MALLOC_MMAP_THRESHOLD_="65536")
    assert not kept and faults > 0.9 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert not keep_freed_memory({"PULSE_HOST_HEAP": "default"})
    assert not keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert user_chose_heap({"MALLOC_ARENA_MAX": "2"})
    assert not user_chose_heap({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512", "PULSE_HOST_HEAP": ""})
