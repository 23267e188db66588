"""A torchrun check of a run's first steps with encoders in the plan: two steps of the tiny SD pipeline's UNet.

::

    torchrun --nproc-per-node 2 tests/first_step_worker.py --pipeline DIR --images DIR --out DIR [--ordered]
        [--room device0]

Each rank builds the plan's program (``encode_program``), joins the job with the torch communicator
(``--ordered``: messages matched by order per pair, NCCL's and HCCL's rule, on gloo), runs the
prefetches of its first step (``pulse.runtime.first_step_encodes``), then steps 0 and 1, and writes
``rank<r>.npz`` (its chunks' gradients of each step, ``step<s>/<name>``) and ``rank<r>.json`` (the
encoders its source loaded, how many prefetch actions it ran).

The pieces a test needs to predict those files live here too (``encode_program``, ``step_batches``):
the in-process tests of ``test_frozen_encoders`` build the same plan and data.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pulse.costs import AnalyticProfiler, with_encoder_costs
from pulse.data.feed import DiffusionFeed
from pulse.data.noise import noise_schedule
from pulse.data.pipeline_folder import read_pipeline
from pulse.data.pipeline_text import pipeline_encoders
from pulse.encoders import EncoderSet
from pulse.hardware import load_cluster
from pulse.partition import plan_symmetric
from pulse.placement import Placement
from pulse.schedule.encode import EncodeContext, add_encodes
from pulse.schedule.generators import make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.train.loop import StepBatches
from pulse.train.sampler import Sampler
from pulse.zoo.diffusers_config import PREFIX
from pulse.zoo.loading import load_model

MICROBATCHES = 4
ROOMS = {"any": None, "device0": {0: 2**40, 1: 0}}  # bytes per device for the encoders' weights


def encode_program(pipeline: Path, mode: str, room: dict[int, int] | None = None,
                   ) -> tuple[ModelSpec, Placement, Schedule, EncoderSet | None]:
    """The tiny SD UNet at pp 2 (V, greedy 1F1B, ``MICROBATCHES``), its encodes placed by ``mode`` in the
    devices' ``room`` (None: anywhere), lowered."""
    spec = load_model(PREFIX + str(pipeline / "unet"))
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    placement = plan_symmetric(spec, costs, 2).placement
    schedule = make_schedule("greedy_v_1f1b", placement, MICROBATCHES, costs)
    encoders = None
    if mode != "cached":
        encoders = EncoderSet(pipeline_encoders(read_pipeline(pipeline)), mode)
        costs = with_encoder_costs(costs, encoders, cluster.hardware)
        schedule = add_encodes(schedule, EncodeContext(spec, placement, costs, cluster, encoders, room))
    return spec, placement, lower(schedule, spec, placement, encoders), encoders


def step_batches(source, device: torch.device | str = "cpu") -> StepBatches:
    """One rank's data over ``source`` (its own: nothing shared with another rank), as ``pulse_torch.job``
    feeds it: v-prediction, caption dropout 0.5, seed 0."""
    feed = DiffusionFeed(source, Sampler(4, 1, MICROBATCHES, 1, 0), noise_schedule("scaled_linear"), 0,
                         "v_prediction", caption_dropout=0.5)
    return StepBatches(lambda s, r, m: feed.batch(s, r, m).map(lambda v: torch.from_numpy(v).to(device)), 0,
                       encoded=lambda s, r, m, f: torch.from_numpy(feed.encoded(s, r, m, f)).to(device),
                       provide=lambda s, r, m, f, v: feed.provide(s, r, m, f, v.detach().cpu().numpy()))


def loaded(source) -> list[str]:
    """The encoders an ``ImageSource`` loaded: "text" (any text encoder), "vae"."""
    encoder = vars(source).get("_encoder")
    if encoder is None:
        return []
    return [name for name, present in (("text", encoder.text_encoders), ("vae", "vae" in vars(encoder))) if present]


def main() -> None:
    import torch.distributed as dist

    from pulse.runtime.executor import StageExecutor
    from pulse.runtime.first_step_encodes import FirstStepEncodes
    from pulse_torch.comm import TorchCommunicator
    from pulse_torch.diffusers_adapter import load_diffusers
    from pulse_torch.diffusion import eps_loss
    from pulse_torch.dist import init_distributed
    from pulse_torch.pipeline.onthefly import ImageSource

    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", type=Path, required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ordered", action="store_true")
    parser.add_argument("--room", choices=tuple(ROOMS), default="any")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(2, 1, timeout_s=120, backend="gloo")
    rank = ctx.layout.rank
    spec, placement, program, encoders = encode_program(args.pipeline, "bubbles", ROOMS[args.room])
    source = ImageSource(str(args.pipeline), args.images, spec)
    comm = TorchCommunicator.from_context(ctx, timeout=120, match_by_tag=False if args.ordered else None)
    backend = load_diffusers(PREFIX + str(args.pipeline / "unet")).backend(lr=1e-3, seed=0)
    batches = step_batches(source)
    ex = StageExecutor(device=rank, spec=spec, placement=placement, schedule=program, backend=backend, comm=comm,
                       batches=batches, loss_fn=eps_loss, timeout=120, encoders=encoders)
    ran = FirstStepEncodes(ex, first_step=0).run()
    comm.wait_sends(120)
    grads = {}
    for step in (0, 1):
        batches.step = step
        ex.run_step()
        comm.wait_sends(120)
        grads.update({f"step{step}/{n}": backend.to_numpy(g) for n, g in ex.gradients().items()})
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / f"rank{rank}.npz", **grads)
    (args.out / f"rank{rank}.json").write_text(json.dumps({"loaded": loaded(source), "prefetches": ran}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
