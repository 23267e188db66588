"""Installs ``PULSE_FAULT``'s hooks in every Python process started with this folder on PYTHONPATH.

Python imports ``sitecustomize`` at start-up, before ``-m pulse_torch.train``,
torchrun's agent or an msrun worker runs a line; inert unless ``PULSE_FAULT``
is set. Then an import hook wraps, as each module finishes loading:

::

    pulse.train.loop           TrainingJob(...) notes the job's rank and middle microbatch
                               (num_microbatches // 2) on its StepBatches; fetching that
                               microbatch calls maybe_fail("die", rank, step + 1) and
                               maybe_hold("hold", ...): half-way through the rank's actions
    pulse_torch.checkpoint     save(...): after this rank's file is on disk, before the
    pulse_mindspore.checkpoint manifest (its before_manifest), maybe_fail("crash-during-checkpoint",
                               shard.rank, step); a preemption's checkpoint (its manifest info
                               says "preempted") maybe_hold("hold-in-preempt-checkpoint", shard.rank)

A malformed ``PULSE_FAULT`` is one line on stderr and exit code 2 before
anything runs (a silently inert fault would pass its test).
"""
from __future__ import annotations

import importlib.abc
import inspect
import os
import sys
from types import ModuleType
from typing import Any, Callable

import pulse_faults
from pulse.errors import PulseError


def _patch_loop(module: ModuleType) -> None:
    fetch, init = module.StepBatches.__call__, module.TrainingJob.__init__

    def job_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.batches.fault_point = (self.layout.rank, self.plan.num_microbatches // 2)

    def fetch_or_die(self: Any, microbatch: int) -> Any:
        rank, middle = getattr(self, "fault_point", (None, None))
        if microbatch == middle:
            pulse_faults.maybe_fail("die", rank, self.step + 1)
            pulse_faults.maybe_hold("hold", rank, self.step + 1)
        return fetch(self, microbatch)

    module.TrainingJob.__init__, module.StepBatches.__call__ = job_init, fetch_or_die


def _patch_checkpoint(module: ModuleType) -> None:
    save = module.save
    signature = inspect.signature(save)

    def save_or_die(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        then = bound.arguments["before_manifest"]
        step, rank = bound.arguments["step"], bound.arguments["shard"].rank
        preempted = bool(bound.arguments["manifest_info"].get("preempted"))

        def before_manifest() -> None:
            then()
            pulse_faults.maybe_fail("crash-during-checkpoint", rank, step)
            if preempted:
                pulse_faults.maybe_hold("hold-in-preempt-checkpoint", rank)

        bound.arguments["before_manifest"] = before_manifest
        return save(*bound.args, **bound.kwargs)

    module.save = save_or_die


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "pulse.train.loop": _patch_loop,
    "pulse_torch.checkpoint": _patch_checkpoint,
    "pulse_mindspore.checkpoint": _patch_checkpoint,
}


class _PatchAfterLoading(importlib.abc.MetaPathFinder):
    """Finds a patched module as the other finders would, then patches it once its code has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module: ModuleType, run: Callable[[ModuleType], None] = run) -> None:
                    run(module)
                    PATCHES[name](module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def _install() -> None:
    try:
        faults = pulse_faults.planned()
    except PulseError as exc:
        print(f"pulse fault injection: error: {exc}", file=sys.stderr, flush=True)
        os._exit(2)
    if faults:
        sys.meta_path.insert(0, _PatchAfterLoading())


_install()
