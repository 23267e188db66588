"""The synthesizer's ILP without a clock, for tests that compare solves: its deadlines never pass
(the clock moves only when something sleeps) and CBC stops only at a proof or at its node limit
(``pulse.synth.ilp.MAX_NODES``), so a solve is a function of its model alone, whatever the host's
load and whatever time limit the code under test asks for (``solve_window``: one thread and a node
limit give the same answer for the same input unless the clock stops the search first)."""
from __future__ import annotations

import importlib

from virtual_clock import VirtualClock

CBC_SECONDS = 3600.0  # a wall-clock limit no solve of a test's model comes near


def untimed_ilp(monkeypatch) -> None:
    """``pulse.synth``'s clock frozen and CBC's wall-clock limit lifted for the rest of the test."""
    ilp, modulo, synthesize = (importlib.import_module(f"pulse.synth.{m}") for m in ("ilp", "modulo", "synthesize"))
    frozen = VirtualClock().as_time_module()
    real_cbc = ilp.cbc

    def cbc(seconds: float, warm_start: bool = False):
        return real_cbc(CBC_SECONDS, warm_start)
    for module in (ilp, synthesize):
        monkeypatch.setattr(module, "time", frozen)
    monkeypatch.setattr(ilp, "cbc", cbc)
    monkeypatch.setattr(modulo, "cbc", cbc)
