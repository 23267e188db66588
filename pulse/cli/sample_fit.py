"""Does ``--sample-every`` fit? `pulse train`'s check before launch.

Rank 0 samples on its own training device, mid-run (``pulse_torch.pipeline.samples``), while what
it trains stays there::

    need   = rank 0's simulated peak (its pipeline device, stage 0 of replica 0)
           + every part of the pipeline as sampling loads it: fp32, counted from the parts'
             safetensors headers (no weight read; a part kept only as a pickle: its file's bytes)
    device : need <= the hardware's memory_bytes
    CPU    : the host's ranks share its memory (``pulse.cli.host_memory``): the node-0 ranks' peaks and
             data + the pipeline <= what the job may use of the host (``pulse.host_limits``)

Not counted: the sampler's activations (a UNet's forward at inference, a few microbatches' worth).
"""
from __future__ import annotations

from pathlib import Path

from pulse.cli.host_memory import GiB, host_need
from pulse.data.backbone_weights import part_weights
from pulse.data.pipeline_folder import read_pipeline
from pulse.hardware import Hardware
from pulse.plan import Plan

SAMPLE_BYTES_PER_PARAM = 4  # the sampling pipeline is loaded in fp32 (pulse_torch.pipeline.samples.SAMPLE_DTYPE)
ADVICE = ("drop --sample-every, or sample after training (`pulse export`, then diffusers' "
          "DiffusionPipeline.from_pretrained), or --force to launch anyway")


def sample_weight_bytes(pipeline: str | Path) -> int:
    """Bytes of every part ``model_index.json`` lists (backbone, VAE, text encoders, any other model) as
    sampling holds them: each tensor's elements at ``SAMPLE_BYTES_PER_PARAM``."""
    folder = read_pipeline(pipeline)
    total = 0
    for name in sorted(folder.index):
        part = folder.root / name
        if name.startswith("_") or not part.is_dir():
            continue
        entries = part_weights(part)
        if entries is not None:
            total += sum(_elements(e.shape) for e in entries.values()) * SAMPLE_BYTES_PER_PARAM
        else:  # a pickle's bytes are its tensors' as stored: the best a header-less file tells
            total += sum(p.stat().st_size for p in part.glob("*.bin"))
    return total


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def sample_refusal(plan: Plan, hardware: Hardware, pipeline_bytes: int, sample_every: int, data_bytes: int = 0,
                   nnodes: int = 1, limit: int | None = None) -> str | None:
    """The one line that refuses ``--sample-every`` where rank 0's device (a CPU cluster: its host) cannot hold
    the sampling pipeline beside its training; None when it fits or the plan was not simulated per device.
    ``limit``: what the job may use of the host (its memory cgroup's, ``pulse.host_limits``)."""
    peaks = plan.predicted.get("peak_memory_bytes_per_device")
    if not pipeline_bytes or not peaks:
        return None
    head = f"--sample-every {sample_every}: sampling loads the pipeline ({_size(pipeline_bytes)} in fp32)"
    if hardware.shared_cores is None:  # a device of its own
        need = int(peaks[0]) + pipeline_bytes
        if need <= hardware.memory_bytes:
            return None
        return (f"{head} on rank 0's device beside its training ({_size(int(peaks[0]))} predicted): "
                f"{_size(need)}, but a {hardware.name} device has {_size(hardware.memory_bytes)}; {ADVICE}")
    host = host_need(plan, data_bytes, nnodes, node=0)
    if host is None:
        return None
    usable = hardware.memory_bytes if limit is None else min(limit, hardware.memory_bytes)
    need = host.total + pipeline_bytes
    if need <= usable:
        return None
    where = (f"the {hardware.name} host has {_size(hardware.memory_bytes)}" if usable == hardware.memory_bytes
             else f"this process's memory cgroup allows {_size(usable)} of the {hardware.name} host")
    return (f"{head} in rank 0's process, beside the {host.ranks} ranks of its host ({_size(host.total)} "
            f"predicted with their data): {_size(need)}, but {where}; {ADVICE}")


def _size(n: int) -> str:
    """GiB as the other memory checks say it; MiB below a tenth of one (a tiny pipeline's would read 0.01)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"
