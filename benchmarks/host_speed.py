"""A host-speed probe for benchmarks on a shared host: how fast this host computes right now.

This 2-core VM's speed swings by 15-20% within a minute (two profiles of tiny-uvit 90 s apart
read its layers 4.95 and 4.29 ms; the same plan's runs 13-28% apart in one group). A profile
prices the host as it was while the profile ran; a run takes what the host gives it then.
``benchmarks/validate.py`` probes the host right before and after every profile and every run,
and prices each row a second time at the speed its runs saw (``pulse.profiling.mean.at_speed``
by the ratio of probes), beside the plain prediction. It reads the host only in part: over 22
groups of the run at b8bcde5, the probes' ratio across a group's two profiles correlated 0.51
with the profiles' own (the median gap between two profiles 7.8%, 3.8% once corrected).

The probe is independent of what it corrects: a fixed workload (tiny-uvit's forwards and
backwards, one layer per chunk, one microbatch, in this process) timed for PROBE_SECONDS,
its median step. It never reads a run's own figures.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

PROBE_SECONDS = 0.3  # per probe: ~30 steps of ~10 ms, so one stall does not set the median
PROBE_MODEL = "tiny-uvit"


@dataclass
class HostSpeed:
    """Probes on demand; the workload is built on the first one (torch is imported then)."""

    seconds: float = PROBE_SECONDS
    _run: Any = field(default=None, repr=False)

    def _workload(self) -> Any:
        if self._run is None:
            import torch

            from pulse.cli.common import ACT_BYTES
            from pulse.profiling.layers import one_chunk_per_layer
            from pulse.zoo.loading import load_model
            from pulse_torch.backend import TorchBackend
            from pulse_torch.diffusion import eps_loss

            torch.set_num_threads(1)  # as every rank runs
            spec = load_model(PROBE_MODEL).with_act_bytes(ACT_BYTES["fp32"])
            self._run = one_chunk_per_layer(spec, TorchBackend(seed=0, lr=1e-12), eps_loss, 2, split=False, seed=0)
            self._run.step()  # the first step builds what later ones reuse
        return self._run

    def probe(self) -> float:
        """Seconds of one step of the workload now (median over PROBE_SECONDS, at least 3 steps)."""
        run, times = self._workload(), []
        start = time.perf_counter()
        while len(times) < 3 or time.perf_counter() - start < self.seconds:
            begin = time.perf_counter()
            run.step()
            times.append(time.perf_counter() - begin)
        return statistics.median(times)


def slowdown(run_probes: list[float], profile_probes: list[float]) -> float:
    """How many times slower the host was around the runs than around the profiles."""
    return statistics.fmean(run_probes) / statistics.fmean(profile_probes)
