"""Whole plans in one process, for tests and for checking a backend: not used by a training run.

::

    FakeNetwork(n_ranks)            in-memory mailboxes (or NCCL's rendezvous rules)
    local_run(plan, backend, ...)   every rank's executor on one FakeNetwork
    numpy_backend, toy              a float64 reference backend and a toy UNet it builds

Nothing under ``pulse/`` outside this package imports it, and nothing in ``backends/``.
"""
from pulse.testing.fake_comm import FakeCommunicator, FakeNetwork, LoggedMessage, WouldBlock, run_all_ranks
from pulse.testing.local import LocalRun, local_run

__all__ = ["FakeCommunicator", "FakeNetwork", "LocalRun", "LoggedMessage", "WouldBlock", "local_run", "run_all_ranks"]
