"""The one lowering step: a compute schedule becomes the program every rank runs.

Zero Bubble's ``graph.py`` order, then explicit memory and gradient sync::

    F/B/W per device ──pre-validate──▶ + SF/RF/SB/RB ──validate with──▶ + AR, FREE ──check──▶ program
    (any generator,    (devices,         (add_send_recv:  communication   (add_memory_and_sync:
     the ILP, a file)   coverage, B       traffic.          (pairs, places,  one AR per chunk,
                        after F)          transfers())      no cyclic wait)  Alpa-style frees)

Encodes (E, ``pulse.encoders``) ride along: the send/recv step adds an SE after
each and an RE before each reader chunk's forward on another device; a
schedule with encodes needs the plan's ``EncoderSet``.

A compute order that can never run (a cyclic wait) is caught by the third step:
with its messages in place it is the deadlock the runtime would hit, and the
grid marks the actions each rank is stuck at.

The simulator (``pulse.sim.engine``), the runtime's launchers and the tests all call
``lower``; nothing else adds messages, frees or all-reduces. Lowering a lowered
schedule gives the same program (every pass replaces what it adds).
"""
from __future__ import annotations

from pulse.encoders import EncoderSet
from pulse.placement import Placement
from pulse.schedule.ir import Schedule
from pulse.schedule.passes import add_memory_and_sync, add_send_recv
from pulse.schedule.validate import check_coverage, check_marks, check_shape, validate_communication
from pulse.spec import ModelSpec


def lower(schedule: Schedule, spec: ModelSpec, placement: Placement,
          encoders: EncoderSet | None = None) -> Schedule:
    """The runnable program of ``schedule`` on ``placement``; PlanError (with the grid) if it cannot run."""
    num_mb = schedule.num_microbatches
    compute = schedule.compute_only()
    # a device without actions still gets a (empty) row: every rank runs a list
    compute = Schedule(compute.name, num_mb,
                       {d: compute.actions.get(d, ()) for d in sorted({*compute.actions,
                                                                      *range(placement.num_devices)})})
    check_shape(compute, placement, num_mb)
    check_coverage(compute, placement, num_mb)
    program = add_send_recv(compute, spec, placement, encoders)
    validate_communication(program, placement)
    program = add_memory_and_sync(program)
    check_marks(program, placement)
    return program
