"""The stage executor and what it needs on one rank: protocols, wiring, the skip cache, message order.

::

    StageExecutor(device, spec, placement, schedule, Backend, Communicator, batches, loss_fn)
        walks its action list (F B W SF RF SB RB SE RE), skips in a local SkipCache

Backends (pulse_torch, pulse_mindspore) implement ``Backend``; communicators
(torch.distributed, MindSpore HCCL, ``pulse.testing.FakeCommunicator``) implement
``Communicator`` (``CommunicatorDefaults``: its neutral half, to inherit). ``executor_for_rank``
builds one rank's executor from a Plan.

The neighbouring rooms: ``pulse.train`` runs steps of this executor as a training run
(loop, checkpoints, logs); ``pulse.layers`` holds the layer definitions every backend
shares; ``pulse.testing`` runs whole plans in one process on a fake network.
"""
from pulse.runtime.errors import CommTimeout, DeadlockError, ScheduleOrderError
from pulse.runtime.executor import StageExecutor, StepStats
from pulse.runtime.from_plan import executor_for_rank
from pulse.runtime.protocols import Backend, Batches, Communicator, CommunicatorDefaults, LossFn
from pulse.runtime.skip_cache import SkipCache
from pulse.runtime.wiring import MAIN, ChunkIO, MessageTag, Wiring, chunk_ios

__all__ = [
    "Backend", "Batches", "ChunkIO", "CommTimeout", "Communicator", "CommunicatorDefaults", "DeadlockError",
    "LossFn", "MAIN",
    "MessageTag", "ScheduleOrderError", "SkipCache", "StageExecutor", "StepStats", "Wiring", "chunk_ios",
    "executor_for_rank",
]
