"""One torchrun rank's pieces for ``pulse.train.loop``: process group, backend, communicator, data, executor."""
from __future__ import annotations

import os
from typing import Any

import torch

from pulse.errors import PulseError
from pulse.optimizers import check_pipeline
from pulse.plan import Plan
from pulse.runtime.first_step_encodes import FirstStepEncodes
from pulse.runtime.from_plan import executor_for_rank
from pulse.train.loop import ScaledLoss, StepBatches, StepSettings, TrainingJob
from pulse.train.resident import ResidentPeak
from pulse.train.run_config import RunConfig
from pulse.train.schedules import DynamicLossScale
from pulse.spec import ModelSpec
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse_torch.backend import TorchBackend
from pulse_torch.comm import TorchCommunicator
from pulse.data.feed import feed_for
from pulse.data.held_out import split_source, validation_for
from pulse.data.sources import LatentSource
from pulse_torch.diffusion import eps_loss
from pulse_torch.device_support import check_precision, saturation_overflow_flag
from pulse_torch.dist import DistContext, init_distributed
from pulse_torch.emulation.link_board import shared_links_of_job
from pulse_torch.emulation.throttle import ThrottledCommunicator
from pulse_torch.warm_kernels import warm_kernels

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def with_autocast(backend: TorchBackend, dtype: torch.dtype) -> TorchBackend:
    """Mixed precision: chunk forwards under ``torch.autocast`` (zoo layers and a user's diffusers modules alike).

    Parameters and optimizer state stay fp32; the backward follows the
    autocast graph without a context of its own, as autograd requires. The
    backend enters ``forward_context`` around every chunk forward, the one a
    recomputing backward re-runs included, so that one computes what the
    first did.
    """
    backend.forward_context = lambda: torch.autocast(backend.device.type, dtype=dtype)

    def place(t):
        # Activations keep the dtype autocast gave them across a chunk boundary, as they do inside
        # one model: upcasting a bf16 activation at the next chunk would change what it computes.
        t = t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        return t.to(device=backend.device, dtype=t.dtype if t.is_floating_point() and t.dtype in (dtype, torch.float32)
                    else (backend.dtype if t.is_floating_point() else t.dtype))

    backend.place = place  # type: ignore[method-assign]
    return backend


def optimizer_settings(config: RunConfig) -> dict[str, Any]:
    """The optimizer of the run and its arguments (``--optimizer``, ``--lr``, ``--weight-decay``,
    ``--adam-beta1/2``, ``--adam-epsilon``: ``pulse_torch.optimizers``)."""
    return {"optimizer": config.optimizer, "lr": config.lr, "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_epsilon, "weight_decay": config.weight_decay}


FROZEN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_backend(config: RunConfig, device: str, plan: Plan, stage: int = 0) -> TorchBackend:
    """The backend of pipeline device ``stage``: a diffusers model holds only that stage's layers (the
    rest of the model stays on the meta device); zoo chunks are built per layer by the backend anyway."""
    check_pipeline(config.optimizer, plan.pp)  # said again on every rank: a plan run directly with torchrun
    if plan.model.startswith(DIFFUSERS_PREFIX):  # the user's own model: chunks wrap its modules
        from pulse.ownership import stage_layers
        from pulse_torch.diffusers_adapter.stage_loading import materialize, skeleton_adapter

        lora = config.lora_rank is not None
        adapter = skeleton_adapter(plan.model, **plan.model_options)
        # diffusers' scripts hold a LoRA run's frozen base in the training precision (weight_dtype)
        materialize(adapter, stage_layers(adapter.spec, plan.placement, stage), device=device, seed=config.seed,
                    frozen_dtype=FROZEN_DTYPES.get(config.precision) if lora else None)
        adapter.model.train()
        if lora:  # --lora-rank: the base frozen, only its adapters train
            from pulse_torch.diffusers_adapter.lora import add_lora, lora_of

            add_lora(adapter, lora_of(config), config.seed)
        backend = adapter.backend(seed=config.seed, **optimizer_settings(config))
    else:
        if config.lora_rank is not None:
            raise PulseError(f"--lora-rank trains adapters on a diffusers backbone, not zoo model '{plan.model}': "
                             "train with --pipeline DIR")
        backend = TorchBackend(device=device, seed=config.seed, **optimizer_settings(config))
    backend.recompute = frozenset(plan.recompute)  # what the simulator priced: the plan's chunks
    autocast = AUTOCAST[config.precision]
    return backend if autocast is None else with_autocast(backend, autocast)


def prepare_device(config: RunConfig, device: str) -> None:
    """What a rank settles about its device before building anything: bf16 where it exists (the
    launcher refused it first when it could see the device), deterministic kernels when asked.

    ``--deterministic`` only: deterministic algorithms slow a GPU's convolutions and scatter-adds
    and cost ~4 s of start-up, and CPU kernels here are deterministic without them.
    """
    check_precision(config.precision, device)
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (CUDA >= 10.2)
        torch.use_deterministic_algorithms(True, warn_only=True)


def build_job(config: RunConfig, plan: Plan, spec: ModelSpec, source: LatentSource,
              first_step: int = 0) -> tuple[TrainingJob, DistContext]:
    """Join the process group and build this rank's share of the plan; with encodes in the plan's bubbles,
    run the ones it prefetches for ``first_step`` (``pulse.runtime.first_step_encodes``)."""
    # torch.optim.Optimizer.__init__ imports torch._dynamo on first use (2-4 s of CPU): pay it here,
    # not inside step 0's timing.
    import torch._dynamo  # noqa: F401

    ctx = init_distributed(plan.pp, plan.dp, timeout_s=config.timeout)
    torch.manual_seed(config.seed)  # nothing should draw from it; if something does, it is repeatable
    prepare_device(config, ctx.device)
    if plan.model.startswith(DIFFUSERS_PREFIX):  # libraries are not the stage: imported before the baseline
        from pulse_torch.diffusers_adapter.stage_loading import import_libraries

        import_libraries(plan.model)
    resident = None
    if torch.device(ctx.device).type == "cpu":  # the kernels' first use is the library's memory, not the stage's
        warm_kernels(AUTOCAST[config.precision])
        resident = ResidentPeak.start()
    backend = make_backend(config, ctx.device, plan, ctx.layout.stage)
    if config.precision == "fp16":  # Ascend 910A: isfinite cannot see an fp16 overflow, its flag can
        backend.device_overflow = saturation_overflow_flag(ctx.device)
    comm: Any = TorchCommunicator.from_context(ctx, timeout=config.timeout)
    if config.emulate_bandwidth:
        comm = ThrottledCommunicator(comm, config.emulate_bandwidth, backend.nbytes, links=shared_links_of_job())
    layout = ctx.layout
    source, held = split_source(source, config.validation_split, config.seed)  # --validation-split
    feed = feed_for(plan, source, config)
    device = torch.device(ctx.device)

    def batch(step: int, replica: int, microbatch: int):
        return feed.batch(step, replica, microbatch).map(lambda v: torch.from_numpy(v).to(device))

    def encoded(step: int, replica: int, microbatch: int, feeds: str) -> torch.Tensor:
        return torch.from_numpy(feed.encoded(step, replica, microbatch, feeds)).to(device)

    def provide(step: int, replica: int, microbatch: int, feeds: str, value: torch.Tensor) -> None:
        feed.provide(step, replica, microbatch, feeds, value.detach().cpu().numpy())

    batches = StepBatches(batch, layout.replica, encoded, provide, feed.shapes_key)
    scaler = DynamicLossScale() if config.precision == "fp16" else None
    loss = eps_loss if scaler is None else ScaledLoss(eps_loss, backend, scaler)
    executor = executor_for_rank(plan, spec, layout.rank, backend, comm, batches, loss, config.timeout,
                                 overlap_dp=True, bucket_cap=config.bucket_bytes)
    prefetch = FirstStepEncodes(executor, first_step)
    if prefetch.needed:  # else the first step's readers would encode (and load encoders) themselves
        prefetch.run()
        comm.wait_sends(config.timeout)
    job = TrainingJob(plan, spec, layout, backend, comm, executor, batches, StepSettings.of(config), config.timeout,
                      scaler, resident)
    job.validation = validation_for(job, held, config)
    return job, ctx
