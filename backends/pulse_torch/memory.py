"""Device memory as PyTorch's caching allocator counts it: what a rank's tensors held at most.

::

    peak_bytes(device)     torch.cuda / torch.npu max_memory_allocated; None on a CPU (nothing counts it)
    InProcessShares        every device's chunks in one process on one accelerator (local_run):
                           each executor's calls charged to its pipeline device, so each device
                           gets its own peak to hold against the simulator's prediction for it

A multi-process run needs no sharing out: each rank is alone on its device, and
``TorchBackend.peak_memory_bytes`` is its figure (``pulse.train.loop`` gathers them into log.json).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


def device_module(device: torch.device) -> Any:
    """``torch.cuda`` or ``torch.npu`` (torch_npu registers it) for an accelerator device."""
    return torch.cuda if device.type == "cuda" else getattr(torch, device.type)


def peak_bytes(device: str | torch.device) -> int | None:
    """The most bytes tensors held on ``device`` at once since the process started (or the last reset);
    None on a CPU, where no allocator counts them."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    return int(device_module(device).max_memory_allocated(device))


@dataclass(frozen=True)
class AllocatorQueries:
    """What ``InProcessShares`` reads of an allocator: the bytes held now, the most since the last reset,
    and the reset. Injected so the sharing out is testable without a device."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    reset_peak: Callable[[], None]

    @classmethod
    def of(cls, device: str | torch.device) -> "AllocatorQueries | None":
        device = torch.device(device)
        if device.type == "cpu":
            return None
        mod = device_module(device)
        return cls(lambda: int(mod.memory_allocated(device)), lambda: int(mod.max_memory_allocated(device)),
                   lambda: mod.reset_peak_memory_stats(device))


@dataclass
class InProcessShares:
    """Each pipeline device's share of one allocator that every device's executor uses (one process).

    Every call an executor makes that allocates or frees (``begin_step``: gradients dropped;
    ``run_next``: one action; ``optimizer_step``: its state) is charged to that executor's device:
    the bytes held after minus before; the device's peak is its share before the call plus the
    most the call held above where it started. A message is the receiver's from the moment it is
    sent (the in-process wire copy is made in the sender's action but freed by the receiver), so a
    send moves its bytes from the sender's share to the receiver's. The parameters, built before the
    wrap, start each device's share.
    """

    queries: AllocatorQueries
    live: dict[int, int] = field(default_factory=dict)  # device -> bytes charged to it now
    peak: dict[int, int] = field(default_factory=dict)  # device -> the most charged to it at once

    def watch(self, executors: Sequence[Any], nbytes: Callable[[Any], int]) -> "InProcessShares":
        device_of_rank = {ex.rank: ex.device for ex in executors}
        for ex in executors:
            params = sum(nbytes(t) for h in ex.chunks.values() for t in ex.backend.parameters(h).values())
            self.live[ex.device] = self.live.get(ex.device, 0) + params
            self.peak[ex.device] = self.live[ex.device]
            for name in ("begin_step", "run_next", "optimizer_step"):
                setattr(ex, name, self._charged(getattr(ex, name), ex.device))
            # every message the executor sends goes through send_group (one send per tensor in the fake)
            ex.comm.send_group = self._moving(ex.comm.send_group, ex.device, device_of_rank, nbytes)
        return self

    def _charged(self, call: Callable[..., Any], device: int) -> Callable[..., Any]:
        def charged(*args: Any, **kwargs: Any) -> Any:
            before = self.queries.allocated()
            self.queries.reset_peak()
            share = self.live[device]
            try:
                return call(*args, **kwargs)
            finally:
                self.peak[device] = max(self.peak[device], share + self.queries.peak() - before)
                self.live[device] += self.queries.allocated() - before
        return charged

    def _moving(self, send_group: Callable[..., Any], device: int, device_of_rank: dict[int, int],
                nbytes: Callable[[Any], int]) -> Callable[..., Any]:
        def moving(sent: Any, peer_rank: int, *args: Any, **kwargs: Any) -> Any:
            out = send_group(sent, peer_rank, *args, **kwargs)
            moved = sum(nbytes(t) for t in sent)
            peer = device_of_rank[peer_rank]
            self.live[device] -= moved
            self.live[peer] += moved
            self.peak[peer] = max(self.peak[peer], self.live[peer])
            return out
        return moving
