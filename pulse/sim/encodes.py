"""Encodes placed with the memory the pipeline leaves: the bubbles pass, given each device's room.

``pulse.schedule.encode`` places E actions on timing alone; whether a device can
hold an encoder's weights depends on the pipeline's own peak, which only a
simulation knows. So for ``bubbles`` the schedule is simulated cached first and
each device offers ``budget - its peak`` to the encoders' weights. The ILP may then
re-sequence everything around the encodes (``pulse.synth.encodes.place_encodes_with_ilp``).
"""
from __future__ import annotations

from pulse.costs import CostTable
from pulse.encoders import EncoderSet
from pulse.hardware import Cluster
from pulse.placement import Placement
from pulse.schedule.encode import EncodeContext, add_encodes
from pulse.schedule.ir import Schedule
from pulse.sim.engine import simulate
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec


def place_encodes(spec: ModelSpec, placement: Placement, schedule: Schedule, costs: CostTable, cluster: Cluster,
                  encoders: EncoderSet, budget: int | None, memory: MemoryModel = MemoryModel()) -> Schedule:
    """``schedule`` with its encodes placed by ``encoders.mode`` (replacing any it had)."""
    room = None
    if encoders.mode == "bubbles" and budget is not None:
        cached = simulate(spec, placement, schedule.without_encodes(), costs, cluster, memory=memory)
        room = {d: budget - peak for d, peak in enumerate(cached.peak_memory)}
    return add_encodes(schedule, EncodeContext(spec, placement, costs, cluster, encoders, room))
