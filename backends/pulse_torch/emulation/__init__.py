"""Emulated device links on one CPU host: what `pulse train --emulate-bandwidth` and the benchmarks
that compare schedules on slow links run on.

::

    throttle     ThrottledCommunicator: a communicator behind a link of a given bandwidth and latency
    link_board   the inbound-link bookings every rank of the host shares (a shared-memory board)

Their timing rule is the simulator's (``pulse.link_slots``: one outbound and one inbound link per
rank), so emulated runs and predictions price messages alike. Not emulation, and so not here:
``pulse.cores`` pins ranks to cores for real, and ``pulse.profiling.cold_start`` measures.
"""
