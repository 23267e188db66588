"""Data-parallel gradient all-reduce pricing, shared with the simulator (``pulse.sim.collectives``)."""
from __future__ import annotations

from pulse.sim.collectives import allreduce_seconds, replica_devices, ring_allreduce_time

__all__ = ["allreduce_seconds", "replica_devices", "ring_allreduce_time"]
