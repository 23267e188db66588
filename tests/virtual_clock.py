"""A clock for tests that moves only when the code under test sleeps: they assert stamps, order and
counts, never the host's time (a loaded host stretches every sleep)."""
from __future__ import annotations

from types import SimpleNamespace


class VirtualClock:
    def __init__(self, start_us: int = 1_000_000) -> None:
        self.us = start_us
        self.sleeps: list[float] = []  # every sleep asked for, in order

    def now_us(self) -> int:
        return self.us

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.us += round(seconds * 1e6)

    def perf_counter(self) -> float:
        return self.us / 1e6

    def thread_time(self) -> float:
        return self.us / 1e6

    def as_time_module(self) -> SimpleNamespace:
        """What a module that did ``import time`` sees instead (sleep and the clocks)."""
        return SimpleNamespace(sleep=self.sleep, perf_counter=self.perf_counter, thread_time=self.thread_time,
                               monotonic=self.perf_counter)

    def drive_throttle(self, monkeypatch) -> "VirtualClock":
        """``pulse_torch.emulation.throttle`` stamps and sleeps on this clock for the rest of the test."""
        from pulse_torch.emulation import throttle

        monkeypatch.setattr(throttle, "now_us", self.now_us)
        monkeypatch.setattr(throttle, "time", self.as_time_module())
        return self

    def drive_ilp(self, monkeypatch) -> list[float]:
        """``pulse.synth``'s deadlines on this clock, every CBC solve taking the whole time it is
        granted (the worst case); returns the list the grants are noted in, in order."""
        import importlib

        ilp, modulo, synthesize = (importlib.import_module(f"pulse.synth.{m}") for m in ("ilp", "modulo", "synthesize"))
        granted: list[float] = []
        real_cbc = ilp.cbc

        def cbc(seconds: float, warm_start: bool = False):
            granted.append(max(0.1, seconds))
            self.us += round(max(0.1, seconds) * 1e6)
            return real_cbc(seconds, warm_start)

        for module in (ilp, synthesize):
            monkeypatch.setattr(module, "time", self.as_time_module())
        monkeypatch.setattr(ilp, "cbc", cbc)
        monkeypatch.setattr(modulo, "cbc", cbc)
        return granted
