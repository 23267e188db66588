"""What the tuner is asked: the model, the cluster, the batch, the budget and the search space."""
from __future__ import annotations

from dataclasses import dataclass

from pulse.encoders import EncoderSet
from pulse.hardware import Cluster
from pulse.sim.memory import MemoryModel
from pulse.spec import ModelSpec


@dataclass(frozen=True)
class TuneRequest:
    spec: ModelSpec
    cluster: Cluster
    global_batch: int
    memory_budget: int  # bytes per device
    microbatch_sizes: tuple[int, ...] = ()  # () : ``default_microbatch_sizes``
    folds: tuple[int, ...] = (1, 2)
    max_pp: int | None = None
    memory: MemoryModel = MemoryModel()
    recompute: bool = True  # may a shape over the budget recompute activations to fit
    encoders: EncoderSet | None = None  # the model's frozen encoders (pulse.zoo.encoders), if any
    encoder_modes: tuple[str, ...] = ("cached",)  # where they may run; each shape is priced per mode

    @property
    def sizes(self) -> tuple[int, ...]:
        """The microbatch sizes searched: those asked for, else ``default_microbatch_sizes``."""
        return self.microbatch_sizes or default_microbatch_sizes(self.global_batch, self.cluster.num_devices)


def default_microbatch_sizes(global_batch: int, num_devices: int) -> tuple[int, ...]:
    """Powers of two from 1 to a device's share of the batch, at least to 8: data parallelism over
    every device can then run its share as one microbatch, whose whole backward hides the
    gradient all-reduce (with 8 at most, SD v2 on 2x8 910A at batch 256 accumulated two
    microbatches of 8 and left 38 ms of a 473 ms step's all-reduce exposed)."""
    top = max(8, global_batch // max(num_devices, 1))
    return tuple(2 ** k for k in range(top.bit_length()) if 2 ** k <= top)
