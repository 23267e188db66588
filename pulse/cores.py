"""Which CPU cores each rank of one host runs on, and so which ranks share a processor.

The runtime pins a CPU host's ranks (``pin_process``: torchrun's ranks in
``pulse_torch.dist.pin_to_cores``, msrun's workers in ``pulse_mindspore.train.join_cluster``) and the
simulator times the same pinning (``pulse.sim.program``), so both read it here::

    4 ranks, cores 0-3   rank 0 {0}  rank 1 {1}  rank 2 {2}  rank 3 {3}     a share each
    2 ranks, cores 0-3   rank 0 {0, 1}           rank 1 {2, 3}
    4 ranks, cores 0-1   rank 0 {0}  rank 1 {1}  rank 2 {0}  rank 3 {1}     round-robin:
                                                                            0 and 2 share core 0

Pinned ranks that share a core split that core between them even while another
core idles; unpinned ranks share all the cores as one pool.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

PIN_SWITCH = "PULSE_PIN_CORES"  # "0" leaves a CPU host's ranks unpinned


def cores_of(local_rank: int, local_ranks: int, allowed: list[int]) -> set[int]:
    """The CPU cores of one of ``local_ranks`` ranks sharing the ``allowed`` cores: an equal
    contiguous share each, or one core shared round-robin when ranks outnumber cores."""
    if local_ranks <= 1 or not allowed:
        return set(allowed)
    if local_ranks >= len(allowed):
        return {allowed[local_rank % len(allowed)]}
    share = len(allowed) // local_ranks
    return set(allowed[local_rank * share:(local_rank + 1) * share])


def core_groups(local_ranks: int, cores: int, pinned: bool = True) -> list[tuple[int, tuple[int, ...]]]:
    """(cores, local ranks) of each group of ranks that share the same cores: pinned, the groups
    ``cores_of`` makes; unpinned, every rank in one group over all the cores."""
    if not pinned:
        return [(cores, tuple(range(local_ranks)))]
    groups: dict[frozenset[int], list[int]] = {}
    for rank in range(local_ranks):
        groups.setdefault(frozenset(cores_of(rank, local_ranks, list(range(cores)))), []).append(rank)
    return [(len(share), tuple(ranks)) for share, ranks in groups.items()]


def pins_cores(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether CPU ranks are pinned here (what the simulator is told: ``Hardware.pinned_cores``)."""
    return environ.get(PIN_SWITCH, "1") != "0" and hasattr(os, "sched_setaffinity")


def pin_process(local_rank: int, local_ranks: int) -> set[int] | None:
    """Pin every thread of this process to the local rank's cores (``cores_of``); None when
    pinning is off. Every thread, not only the caller: a framework may already run threads
    of its own (MindSpore's actor and kernel threads do its work beside Python's), and left
    unpinned they let the kernel put two ranks' compute threads on one core while the other
    idles: a MindSpore profile then read 1.6 or 4.0 ms for the same layer, run to run."""
    if not pins_cores():
        return None
    cores = cores_of(local_rank, local_ranks, sorted(os.sched_getaffinity(0)))
    tasks = Path("/proc/self/task")
    for tid in ([int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]):
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    return cores
