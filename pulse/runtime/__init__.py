"""The backend-neutral runtime: protocols, the stage executor, the skip cache, a fake network.

::

    StageExecutor(device, spec, placement, schedule, Backend, Communicator, batches, loss_fn)
        walks its action list (F B W SF RF SB RB), skips in a local SkipCache

Backends (pulse_torch, pulse_mindspore) implement ``Backend``; communicators
(torch.distributed, MindSpore HCCL, ``FakeCommunicator``) implement
``Communicator``. ``executor_for_rank`` builds one rank's executor from a
Plan; ``local_run`` builds every rank of a plan in one process.
"""
from pulse.runtime.errors import CommTimeout, DeadlockError, ScheduleOrderError
from pulse.runtime.executor import StageExecutor, StepStats
from pulse.runtime.fake_comm import FakeCommunicator, FakeNetwork, LoggedMessage, WouldBlock, run_all_ranks
from pulse.runtime.from_plan import executor_for_rank
from pulse.runtime.local import LocalRun, local_run
from pulse.runtime.protocols import Backend, Batches, Communicator, LossFn
from pulse.runtime.skip_cache import SkipCache
from pulse.runtime.wiring import MAIN, ChunkIO, MessageTag, Wiring, chunk_ios

__all__ = [
    "Backend", "Batches", "ChunkIO", "CommTimeout", "Communicator", "DeadlockError", "FakeCommunicator",
    "FakeNetwork", "LocalRun", "LoggedMessage", "LossFn", "MAIN", "MessageTag", "ScheduleOrderError",
    "SkipCache", "StageExecutor", "StepStats", "WouldBlock", "Wiring", "chunk_ios", "executor_for_rank",
    "local_run", "run_all_ranks",
]
