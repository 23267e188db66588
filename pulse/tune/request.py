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
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    folds: tuple[int, ...] = (1, 2)
    max_pp: int | None = None
    memory: MemoryModel = MemoryModel()
    recompute: bool = True  # may a shape over the budget recompute activations to fit
    encoders: EncoderSet | None = None  # the model's frozen encoders (pulse.zoo.encoders), if any
    encoder_modes: tuple[str, ...] = ("cached",)  # where they may run; each shape is priced per mode
