"""Which CPU cores each rank of one host runs on, and so which ranks share a processor.

The runtime pins a CPU host's ranks (``pulse_torch.dist.pin_to_cores``) and the
simulator times the same pinning (``pulse.sim.program``), so both read it here::

    4 ranks, cores 0-3   rank 0 {0}  rank 1 {1}  rank 2 {2}  rank 3 {3}     a share each
    2 ranks, cores 0-3   rank 0 {0, 1}           rank 1 {2, 3}
    4 ranks, cores 0-1   rank 0 {0}  rank 1 {1}  rank 2 {0}  rank 3 {1}     round-robin:
                                                                            0 and 2 share core 0

Pinned ranks that share a core split that core between them even while another
core idles; unpinned ranks share all the cores as one pool.
"""
from __future__ import annotations


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
