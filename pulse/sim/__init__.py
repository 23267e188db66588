"""The simulator: one discrete-event engine that times, sizes and checks any schedule."""
from pulse.sim.engine import simulate
from pulse.sim.result import ComputeSpan, MemoryBreakdown, MessageEvent, SimResult

__all__ = ["simulate", "SimResult", "ComputeSpan", "MessageEvent", "MemoryBreakdown"]
