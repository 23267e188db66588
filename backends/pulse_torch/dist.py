"""torch.distributed set-up: which backend, which groups (laid out as ``pulse.layout.Layout`` says)."""
from __future__ import annotations

import ctypes
import datetime
import importlib.util
import os
import signal
import sys
from dataclasses import dataclass

from pulse.cores import pin_process
from pulse.host_heap import keep_freed_memory
from pulse.errors import PlanError
from pulse.layout import Layout


def _importable(name: str) -> bool:
    """True when ``import name`` would succeed without importing it (a module
    already in ``sys.modules`` counts, even one without ``__spec__``)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def accelerator_backend() -> tuple[str, str]:
    """(process-group backend, device type): HCCL on Ascend, NCCL on CUDA, gloo on CPU."""
    if _importable("torch_npu"):
        import torch_npu  # noqa: F401  (registers the 'npu' device and the 'hccl' backend)

        import torch

        if torch.npu.is_available():
            return "hccl", "npu"
    import torch

    if torch.cuda.is_available():
        return "nccl", "cuda"
    return "gloo", "cpu"


def cpu_only_build() -> bool:
    """torch is a CPU build (no CUDA, no ROCm) and no NPU plugin is installed: no device runtime at all,
    so a rank is a CPU rank whatever the host (``pulse_torch.forked_ranks`` forks only these)."""
    import torch

    return (getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None
            and not _importable("torch_npu"))


@dataclass
class DistContext:
    layout: Layout
    backend: str
    device: str
    dp_group: object | None  # torch ProcessGroup for this stage's replicas
    pp_group: object | None = None  # this replica's pipeline (None: it is the whole world)
    p2p_groups: tuple[object, object] | None = None  # gloo: point-to-point (to a higher rank, to a lower one)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op).

    A launcher killed by SIGKILL cannot stop its children; this makes them stop
    themselves. If the parent died before the call took effect, leave now.
    """
    parent = os.getppid()
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: nothing more to do than the check below
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def check_world(pp: int, dp: int, world_size: int) -> None:
    if pp * dp != world_size:
        raise PlanError(
            f"the plan needs pp x dp = {pp} x {dp} = {pp * dp} processes but {world_size} were started; "
            f"launch with --nproc-per-node {pp * dp} (or re-plan for {world_size})"
        )


def init_distributed(pp: int, dp: int, timeout_s: float = 300.0, backend: str | None = None) -> DistContext:
    """Join the torchrun job (env:// rendezvous) and build the data-parallel groups."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world(pp, dp, world)
    chosen, device = accelerator_backend() if backend is None else (backend, "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    elif device == "npu":
        torch.npu.set_device(local_rank)
    else:
        pin_to_cores(local_rank)
        keep_freed_memory()  # a CPU rank's heap as a device's caching allocator (pulse.host_heap)
    timeout = datetime.timedelta(seconds=timeout_s)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(chosen, store=restart_store(restart, world, timeout), rank=int(os.environ["RANK"]),
                                world_size=world, timeout=timeout)
    else:
        dist.init_process_group(chosen, timeout=timeout)
    return build_context(pp, dp, chosen, local_device() if backend is None else "cpu")


def restart_store(restart: int, world: int, timeout: datetime.timedelta):
    """The launcher's store under a prefix of this restart's own.

    torch expects a fresh store per restart and adds no prefix of its own; torchrun's static
    rendezvous (``pulse_torch.launch``) keeps one store for the job, so a restarted group read the
    dead group's gloo addresses from it and waited for them forever."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"pulse/restart-{restart}", store)


def pin_to_cores(local_rank: int | None = None, local_ranks: int | None = None) -> None:
    """CPU ranks of one host each on their own cores (``PULSE_PIN_CORES=0`` turns it off;
    ``pulse.cores.pin_process``), torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE by default.

    Why: unpinned, the kernel wakes a rank whose message arrived on the core of the rank that
    sent it, and for a while both compute on one core (pinned, a CPU pipeline's step of small
    actions takes 10-15% less time). The profiler pins the same way, so the cost table is
    measured as training runs."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_ranks is None else local_ranks
    pin_process(local_rank, local_ranks)


def local_device() -> str:
    """This torchrun rank's device: ``npu:<LOCAL_RANK>``, ``cuda:<LOCAL_RANK>`` or ``cpu``."""
    _, device = accelerator_backend()
    return f"{device}:{int(os.environ.get('LOCAL_RANK', '0'))}" if device != "cpu" else "cpu"


def build_context(pp: int, dp: int, backend: str, device: str) -> DistContext:
    """The layout and process groups of a pp x dp job on the running process group.

    Every rank must call it (torch creates groups collectively, in order);
    ``init_distributed`` does, and a test may call it again to run another
    layout on the same processes.
    """
    import torch.distributed as dist

    check_world(pp, dp, dist.get_world_size())
    layout = Layout(pp, dp, dist.get_rank())
    dp_group = pp_group = None
    for stage in range(pp):  # every rank must take part in creating every group
        group = dist.new_group(layout.stage_ranks(stage)) if dp > 1 else None
        if stage == layout.stage:
            dp_group = group
    if pp > 1 and dp > 1:  # pipeline groups: a global gradient norm sums over one replica
        for replica in range(dp):
            group = dist.new_group(layout.replica_ranks(replica))
            if replica == layout.replica:
                pp_group = group
    return DistContext(layout, backend, device, dp_group, pp_group, direction_groups(backend))


def direction_groups(backend: str) -> tuple[object, object] | None:
    """Two more world groups, one for the messages to a higher rank, one for those to a lower one,
    so that each direction between two ranks has its own connection and stream
    (``pulse_torch.comm``). On NCCL and HCCL this is what keeps a pipeline from deadlocking: one
    process group puts both directions between two ranks on one stream (ProcessGroupNCCL's
    ``getKeySendRecv``), where a send larger than NCCL's buffer blocks every later operation
    until its receive runs, and two ranks sending to each other first wait forever
    (``pulse.runtime.rendezvous`` models it; ``tests/test_rendezvous.py`` shows the hang).
    On gloo each direction gets its own TCP connection and progress thread.
    Every rank must call it, in the same order. None for one rank."""
    import torch.distributed as dist

    if dist.get_world_size() < 2:
        return None
    world = list(range(dist.get_world_size()))
    return dist.new_group(world), dist.new_group(world)
