"""The per-rank job of ``pulse profile`` on PyTorch (torchrun launches it on every rank at once).

::

    join the job as training does (pulse_torch.dist.init_distributed: NCCL on CUDA, HCCL on
    Ascend, gloo with each rank pinned to its cores on a CPU; the rank's device bound)
    ─ TorchCommunicator of that context (training's) ─ pulse.profiling.job.run_profile with
    this backend's rig: TorchBackend or the diffusers adapter over the user's own modules on the
    rank's device, one window of layers real at a time (pulse_torch.profile_layers: a diffusers
    model's skeleton, each window materialized and released), under --precision's autocast,
    eps_loss, the bytes autograd saves per layer (pulse_torch.saved_bytes), a pipeline's frozen
    encoders

On an accelerator every compute call of the backend (and the loss) returns only once the device
has run it (``--device-timing synchronize``, ``pulse_torch.profiler.device_timed``), so the action
spans the figures are read from are the device's time, not the host's enqueue time;
``--device-timing events`` times each action between two device events while the host queues ahead
as in training instead (on an H200 its figures summed further from a real step: RESULTS.md).
Every measurement is
``pulse.profiling``'s, shared with ``pulse_mindspore.profile_job``.
"""
from __future__ import annotations

import argparse
import os
import sys
import torch

from pulse.cores import pins_cores
from pulse.profiling.gather import Ranks
from pulse.profiling.job import ProfileRig, job_parser, run_profile
from pulse.profiling.links import groups
from pulse.profiling.timing import TORCH_DEVICE_TIMING
from pulse_torch.backend import TorchBackend
from pulse_torch.forked_ranks import leaves_on_return
from pulse_torch.comm import TorchCommunicator
from pulse_torch.diffusion import eps_loss
from pulse_torch.dist import DistContext, init_distributed
from pulse_torch.pipeline.encoder_costs import encoder_seconds
from pulse_torch.profile_layers import profile_layers
from pulse_torch.profiler import device_timed_loss
from pulse_torch.saved_bytes import counting_chunks


def build_parser():
    return job_parser("python -m pulse_torch.profile_job", "torchrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = run_profile(args, rig_of(args, join(args)))
    # Leave without tearing the process group down: with ranks pinned to cores, gloo's teardown
    # after a wait at the barrier sometimes aborted a rank
    # ("terminate called without an active exception", signal 6) after the outputs were written.
    # A forked rank leaves that way when this returns.
    if leaves_on_return():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join(args: argparse.Namespace) -> DistContext:
    """This rank in the job as training joins it: the accelerator's process group (NCCL, HCCL; gloo
    on a CPU, pinned to its cores) and its device (LOCAL_RANK's)."""
    return init_distributed(args.pp, args.dp, timeout_s=args.timeout)  # pulse profile --timeout


def rig_of(args: argparse.Namespace, ctx: DistContext) -> ProfileRig:
    """What this rank profiles with: the training job's device, process group and communicator."""
    device = torch.device(ctx.device)
    on_cpu = device.type == "cpu"
    timing = args.device_timing or TORCH_DEVICE_TIMING
    layers = profile_layers(args, ctx.device, timing)
    return ProfileRig(
        Ranks(build_comm(args, ctx), TorchBackend(device=device), ctx.layout.rank, ctx.layout.pp * ctx.layout.dp),
        layers.backend_of, device_timed_loss(eps_loss, device, timing),
        framework=f"torch-{device.type}" + ("" if args.precision == "fp32" else f" {args.precision}"),
        cores=os.cpu_count() if on_cpu else None, pinned=pins_cores() if on_cpu else False,
        encoder_seconds=encoder_seconds, real_layers=layers.real_layers, count_saved=counting_chunks)


def build_comm(args: argparse.Namespace, ctx: DistContext) -> TorchCommunicator:
    """Training's communicator of this context (its device, groups, point-to-point connections),
    and a group for every set of ranks the all-reduce curves are measured on."""
    comm = TorchCommunicator.from_context(ctx, timeout=args.timeout)  # a turn's wait too
    world = ctx.layout.pp * ctx.layout.dp
    for g in groups(args.pp, args.dp):
        if len(g) < world:
            comm.register_group(g)
    return comm


if __name__ == "__main__":
    sys.exit(main())
