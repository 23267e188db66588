"""What a training backend does that planning must price or refuse, as data each backend declares.

::

    backends/pulse_torch/traits.py      traits() ─┐  framework-free modules: the core and the
    backends/pulse_mindspore/traits.py  traits() ─┤  command line read them without torch or MindSpore
                                                  ▼
    BackendTraits ─ runs(costs, cluster)   the cost table and cluster as the backend runs them
                  ─ recompute(chunks, n)   the chunks it recomputes, and a note when that is not what was asked
                  ─ check_supported(cfg)   one line naming a setting it cannot honour

``load_traits(name)`` finds ``pulse_<name>.traits`` (the one place the core names a backend
package, by a computed name: the core imports no framework, ``tests/test_core_purity.py``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from pulse.costs import CostTable
from pulse.errors import PulseError
from pulse.hardware import Cluster
from pulse.optimizers import check_backend
from pulse.sim.memory import MemoryModel, run_memory

if TYPE_CHECKING:
    from pulse.train.run_config import RunConfig


@dataclass(frozen=True)
class Unsupported:
    """A ``RunConfig`` setting the backend has no counterpart for: only ``allowed`` is accepted."""

    setting: str  # the RunConfig field (its flag: --setting-name)
    allowed: object  # the only value the backend takes (the setting's default)
    why: str  # said in the refusal


@dataclass(frozen=True)
class BackendTraits:
    """What one backend does, as the simulator prices it and the launcher checks it.

    ``deferred_buckets`` / ``tensor_messages`` / ``buckets_at_chunk_end``: its communicator's ways (``Cluster``'s
    ``COMMUNICATOR_KEYS``); None keeps what the cluster file says (PyTorch's profile writes none).
    ``whole_backward_in_b``: its split backward does all the work in B (``CostTable``'s flag;
    a table measured elsewhere holds PyTorch's halves: B then costs the whole backward, W nothing), and
    hands back each backward's parameter gradients as a set of their own (``MemoryModel.returned_gradients``).
    ``always_recomputes``: its B re-runs every chunk's forward, whatever the plan asks.
    ``memory(config, dp)``: what its ranks hold per parameter, as the simulator prices a run.
    """

    name: str = "torch"  # --backend NAME
    label: str = "PyTorch"  # how messages name it
    deferred_buckets: bool | None = None
    tensor_messages: bool | None = None
    buckets_at_chunk_end: bool | None = None
    whole_backward_in_b: bool = False
    always_recomputes: bool = False
    # autograd keeps the low-precision weight copies a chunk's autocast forward made until its backward
    # (PyTorch); a backend whose backward re-runs the forward keeps none (``pulse.sim.memory.run_memory``)
    compute_copies: bool = True
    # on a CPU host (gloo) a step's receives are posted, their buffers allocated, at its start
    posts_receives_ahead_on_cpu: bool = True
    unsupported: tuple[Unsupported, ...] = ()
    # the words its allocators fail with (pulse.train.out_of_memory): one line and exit 2, not a traceback
    out_of_memory_markers: tuple[str, ...] = ()

    def communicator(self) -> dict[str, bool]:
        """The cluster keys it sets (none: the cluster's own), as ``pulse profile`` writes them."""
        ways = {"deferred_buckets": self.deferred_buckets, "tensor_messages": self.tensor_messages,
                "buckets_at_chunk_end": self.buckets_at_chunk_end}
        return {key: value for key, value in ways.items() if value is not None}

    def runs(self, costs: CostTable, cluster: Cluster) -> tuple[CostTable, Cluster]:
        """The cost table and cluster as this backend runs them; the same objects when nothing changes."""
        if self.whole_backward_in_b and not costs.whole_backward_in_b:
            costs = replace(costs, whole_backward_in_b=True, bwd_input=costs.bwd, bwd_weight=(0.0,) * len(costs.bwd))
        ways = self.communicator()
        return costs, (replace(cluster, **ways) if ways else cluster)

    def recompute(self, chunks: tuple[int, ...], num_chunks: int) -> tuple[tuple[int, ...], str | None]:
        """The chunks it will recompute of the ``chunks`` a plan asks for, and a note when they differ."""
        if not self.always_recomputes or len(chunks) == num_chunks:
            return chunks, None
        return tuple(range(num_chunks)), (f"the {self.label} backend recomputes every chunk's forward in its "
                                          "backward; the plan is priced and written with recompute on all chunks")

    def memory(self, precision: str = "fp32", ema: bool = False, dp: int = 1, lora: bool = False,
               cpu_host: bool = False, optimizer: str = "adamw") -> MemoryModel:
        """What this backend's ranks hold for a run of these settings (``pulse.sim.memory.run_memory``);
        ``cpu_host``: the ranks are CPU processes (their messages go over gloo); ``optimizer``: its state
        per trained parameter (``pulse.optimizers``), refused in one line where this backend has none."""
        check_backend(optimizer, self.name)
        return run_memory(precision, ema, dp, lora, compute_copies=self.compute_copies and not self.always_recomputes,
                          receives_posted_ahead=cpu_host and self.posts_receives_ahead_on_cpu, optimizer=optimizer,
                          returned_gradients=self.whole_backward_in_b)

    def check_supported(self, config: RunConfig) -> None:
        """Refuse, in one line, a setting this backend has no counterpart for (an optimizer it does not build
        included)."""
        check_backend(config.optimizer, self.name)
        for item in self.unsupported:
            value = getattr(config, item.setting)
            if value != item.allowed:
                flag = "--" + item.setting.replace("_", "-")
                shown = "" if isinstance(value, bool) else f" {value}"
                raise PulseError(f"{flag}{shown} is not supported with --backend {self.name} ({item.why}); "
                                 "use --backend torch for it")


class TraitsModule(Protocol):
    """What ``pulse_<name>.traits`` declares (framework-free)."""

    def traits(self) -> BackendTraits: ...

    def check_options(self, config: RunConfig) -> None: ...

    def check_model(self, model: str) -> None: ...


def traits_module(name: str) -> TraitsModule:
    """``pulse_<name>.traits``: the backend's declaration (imported by a computed name, never a framework)."""
    try:
        module: ModuleType = importlib.import_module(f"pulse_{name}.traits")
    except ModuleNotFoundError as exc:
        if exc.name not in (f"pulse_{name}", f"pulse_{name}.traits"):
            raise  # the declaration itself is broken: not a missing backend
        raise PulseError(f"--backend {name}: no package pulse_{name} here; pip install -e '.[{name}]'") from None
    return module  # type: ignore[return-value]  # a module that defines the protocol's functions


def load_traits(name: str) -> BackendTraits:
    """The traits of ``--backend name`` on this host."""
    return traits_module(name).traits()
