"""The per-rank job of ``pulse profile`` on PyTorch (torchrun launches it on every rank at once).

::

    pin to cores (as training) ─ gloo process group ─ TorchCommunicator (a connection per
    direction, as training) ─ pulse.profiling.job.run_profile with this backend's rig:
    TorchBackend or the diffusers adapter over the user's own modules, eps_loss, the
    bytes autograd keeps per layer, a pipeline's frozen encoders

Every measurement is ``pulse.profiling``'s, shared with ``pulse_mindspore.profile_job``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from pulse.cli.common import parse_options
from pulse.cores import pins_cores
from pulse.profiling.gather import Ranks
from pulse.profiling.job import ProfileRig, job_parser, run_profile, spec_activation_bytes
from pulse.profiling.links import groups
from pulse.spec import ModelSpec
from pulse_torch.backend import TorchBackend
from pulse_torch.comm import TorchCommunicator
from pulse_torch.diffusion import eps_loss
from pulse_torch.dist import direction_groups, pin_to_cores
from pulse_torch.pipeline.encoder_costs import encoder_seconds
from pulse_torch.profiler import TorchProfiler


def build_parser():
    return job_parser("python -m pulse_torch.profile_job", "torchrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    pin_to_cores()  # as training: pulse_torch.dist.init_distributed
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    code = run_profile(args, ProfileRig(
        Ranks(build_comm(args, world), TorchBackend(), dist.get_rank(), world), backend_factory(args), eps_loss,
        framework="torch-cpu" if torch.cuda.device_count() == 0 else "torch-cuda",
        cores=os.cpu_count() if torch.cuda.device_count() == 0 else None, pinned=pins_cores(),
        act_mem=activation_bytes(args), encoder_seconds=encoder_seconds))
    # Leave without tearing the process group down: with ranks pinned to cores, gloo's teardown
    # after a wait at the barrier sometimes aborted a rank
    # ("terminate called without an active exception", signal 6) after the outputs were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def backend_factory(args: argparse.Namespace):
    """A fresh backend per measurement: TorchBackend, or the diffusers adapter's over the user's modules."""
    if args.model.startswith("diffusers:"):
        from pulse_torch.diffusers_adapter import load_diffusers

        return lambda: load_diffusers(args.model, device="cpu", **parse_options(args.model_option)).backend(
            lr=1e-12, seed=0)
    return lambda: TorchBackend(seed=0, lr=1e-12)


def activation_bytes(args: argparse.Namespace):
    """What each layer keeps for its backward: what autograd really keeps (parameters excluded) for
    zoo layers; the spec's figures for a diffusers model's own modules."""
    def act_mem(spec: ModelSpec, microbatch_size: int) -> tuple[int, ...]:
        if args.model.startswith("diffusers:"):
            return spec_activation_bytes(spec, microbatch_size)
        return TorchProfiler(warmup=0, repeats=1).profile(spec, microbatch_size).act_mem
    return act_mem


def build_comm(args: argparse.Namespace, world: int) -> TorchCommunicator:
    comm = TorchCommunicator(timeout=120.0, p2p_groups=direction_groups("gloo"))
    for g in groups(args.pp, args.dp):
        if len(g) < world:
            comm.register_group(g)
    return comm


if __name__ == "__main__":
    sys.exit(main())
