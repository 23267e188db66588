"""Memory as the synthesizer sees it: a budget becomes a cap on in-flight microbatches per device.

The static bytes per parameter come from the ``MemoryModel`` the caller passes (the
same one the simulator is given), never from another function's defaults.
"""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.sim.memory import MemoryModel, held_bytes, local_skips, model_static_bytes, recompute_of
from pulse.spec import ModelSpec
from pulse.traffic import transfers


def microbatch_bytes(spec: ModelSpec, placement: Placement, costs: CostTable,
                     recompute: frozenset[int] = frozenset()) -> list[int]:
    """Bytes one in-flight microbatch holds per device: saved activations of its
    chunks (only their inputs for chunks in ``recompute``), skips cached between
    them, and the messages it receives."""
    mbs = costs.microbatch_size
    out = [0] * placement.num_devices
    for c, chunk in enumerate(placement.chunks):
        out[chunk.device] += held_bytes(spec, placement, costs, c, c in recompute)
    for a, _, nbytes in local_skips(spec, placement):
        out[placement.chunks[a].device] += nbytes * mbs
    for tr in transfers(spec, placement):  # activations in, and their gradients back
        out[tr.dst_device] += tr.total_bytes * mbs
        out[tr.src_device] += tr.total_bytes * mbs
    return out


def recompute_peak(placement: Placement, costs: CostTable, recompute: frozenset[int]) -> list[int]:
    """Per device, the largest graph one recomputing backward rebuilds: a transient on top of
    the in-flight microbatches (one backward runs at a time on a device)."""
    out = [0] * placement.num_devices
    for c in recompute:
        ch = placement.chunks[c]
        out[ch.device] = max(out[ch.device], sum(costs.act_mem[ch.start:ch.end]))
    return out


def inflight_caps(spec: ModelSpec, placement: Placement, costs: CostTable, memory_budget: int | None,
                  memory: MemoryModel) -> dict[int, int] | None:
    """Microbatches each device may hold: (budget - static) // bytes per microbatch
    (static includes a recomputing backward's rebuilt graph, which one microbatch holds at a time)."""
    if memory_budget is None:
        return None
    recompute = recompute_of(memory, placement)
    static = [s + r for s, r in zip(model_static_bytes(spec, placement, memory),
                                    recompute_peak(placement, costs, recompute))]
    per_mb = microbatch_bytes(spec, placement, costs, recompute)
    caps = {d: (memory_budget - static[d]) // max(per_mb[d], 1) for d in range(placement.num_devices)}
    short = [d for d, c in caps.items() if c < 1]
    if short:
        need = max(static[d] + per_mb[d] for d in range(placement.num_devices))
        d = short[0]
        raise PlanError(f"memory budget {memory_budget / 2**30:.2f} GiB holds no microbatch on device {d} "
                        f"({static[d] / 2**30:.2f} GiB static + {per_mb[d] / 2**30:.2f} GiB per microbatch): "
                        f"the minimum budget is {need / 2**30:.2f} GiB")
    return {d: int(c) for d, c in caps.items()}
