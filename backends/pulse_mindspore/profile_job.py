"""The per-worker job of ``pulse profile --backend mindspore`` (msrun launches it on every worker at once).

::

    msrun --worker_num PP*DP ... python -m pulse_mindspore.profile_job --model M --pp P ...
      scheduler:    init() serves the cluster until the workers leave
      every worker: init() ─ MindSporeCommunicator (HCCL on Ascend; on CPU mccl all-reduce and,
                    for pairs, gloo send/recv as training) ─ pulse.profiling.job.run_profile
                    with this backend's rig: MindSporeBackend (PyNative, float32, the zoo's or
                    a diffusers UNet's cells, built with each window's chunks), eps_loss, the spec's
                    activation bytes at float32

Every measurement is ``pulse.profiling``'s, the same as ``pulse_torch.profile_job``'s; on
Ascend each action is timed between two device events (``DeviceEvents``). A
MindSpore backward re-runs the chunk's forward under ``mindspore.vjp``
(``pulse_mindspore.backend``), so the measured backward halves hold a forward:
the table stores them without it (``pulse.profiling.layers.without_forward``) and
the simulator adds it back, as for any recomputing chunk (MindSpore plans
recompute every chunk). Its split backward computes both halves in B, for the
first chunk too, and W only adds the weight gradients up: the table says
``whole_backward_in_b`` and the simulator prices B and W so.

Its communicator sends every tensor of a transfer as a message of its own and,
on CPU, sums data-parallel buckets after a worker's actions (on Ascend it
launches each at its AR), so the cluster says ``tensor_messages`` and, on CPU,
``deferred_buckets`` (``pulse_mindspore.traits``) and the
simulator prices both.

On a CPU host the workers pin themselves to cores as training's do
(``pulse_mindspore.train.join_cluster``), so the cluster says ``pinned_cores``
as ``pulse_torch.profile_job``'s does.
"""
from __future__ import annotations

import os
import sys

import mindspore as ms

from pulse import launch_env
from pulse.cores import pins_cores
from pulse.errors import PulseError
from pulse.profiling.gather import Ranks
from pulse.profiling.job import ProfileRig, job_parser, run_profile
from pulse.profiling.links import groups
from pulse_mindspore.backend import MindSporeBackend
from pulse_mindspore.comm import MindSporeCommunicator
from pulse_mindspore.diffusion import eps_loss
from pulse_mindspore.msrun_env import SCHEDULER, MsrunEnv, check_world, mark_finished
from pulse_mindspore.traits import traits
from pulse_mindspore.train import join_cluster

PROG = "pulse_mindspore.profile_job"
TIMEOUT = 300.0  # seconds one message may take: a worker may wait while its peer still measures


class DeviceEvents:
    """The ``DeviceClock`` of an Ascend device: ``mindspore.runtime.Event`` with timing, recorded on the
    current stream. PyNative queues an op and returns on Ascend, so the host's clock around an action
    would time its launch; a CPU runs each op where it is launched (``launch_blocking_on_cpu``)."""

    def mark(self) -> ms.runtime.Event:
        event = ms.runtime.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: ms.runtime.Event, end: ms.runtime.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def profiled_backend(device: str) -> MindSporeBackend:
    """A fresh backend to time layers with on ``device`` (``device_target``): on its events off a CPU."""
    backend = MindSporeBackend(seed=0, lr=1e-12)
    if device != "CPU":
        backend.device_clock = DeviceEvents()
    return backend


def build_parser():
    return job_parser(f"python -m {PROG}", "msrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = MsrunEnv.read()
    try:
        check_world(args.pp, args.dp, env)
    except PulseError as exc:
        if env.speaks:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if env.role == SCHEDULER:
        join_cluster(TIMEOUT, worker=False)  # serves the cluster inside init() until the workers leave
        return 0
    join_cluster(args.timeout)  # pulse profile --timeout: a worker may wait while others still measure
    # link probes send between every pair of workers (on a CPU over gloo, as a pipeline's messages)
    comm = MindSporeCommunicator(timeout=args.timeout, p2p=args.pp * args.dp > 1)
    for group in groups(args.pp, args.dp):  # members create their groups, in the same order everywhere
        comm.register_group(group)
    device = ms.get_context("device_target")
    code = run_profile(args, ProfileRig(
        Ranks(comm, MindSporeBackend(), comm.rank, comm.world_size, barrier_by_messages=device == "CPU"),
        lambda: profiled_backend(device), eps_loss, framework=f"mindspore-{device.lower()}",
        cores=os.cpu_count() if device == "CPU" else None, pinned=pins_cores(),
        backward_reruns_forward=True, whole_backward_in_b=True, alternate_fit=True,
        communicator=traits(ascend=device == "Ascend").communicator()))
    if code == 0:  # costs.yaml and cluster.yaml written: a crash in MindSpore's teardown loses nothing
        mark_finished(launch_env.msrun_log_dir(args.out_costs))
    return code


if __name__ == "__main__":
    sys.exit(main())
