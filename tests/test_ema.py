"""The EMA of the weights: diffusers' ``EMAModel`` warm-up, and a resume that keeps every average.

::

    ema_decay(decay, u)          == EMAModel.get_decay(u)            (default and power warm-up)
    5 pipelined steps + EMA      == EMAModel.step after each step     (tiny diffusers UNet, same weights)
    4 steps                      == 2 steps ─ checkpoint ─ fresh model ─ load ─ 2 steps
                                    (EMA, its update count and weights bit for bit; tiny-unet and a
                                    tiny diffusers UNet, whose parameters carry the model's own names)

In process (fake network, two pipeline ranks sharing one backend), on fixed microbatches.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from diffusers.training_utils import EMAModel  # noqa: E402
from pipeline_helpers import TableComm, pipeline_fixture  # noqa: E402

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.plan import Plan  # noqa: E402
from pulse.train import checkpoints# noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.train.loop import StepSettings, optimizer_update  # noqa: E402
from pulse.train.schedules import ema_decay  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch import checkpoint  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusers_adapter import load_diffusers  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from torch_worker_check import make_batches  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)


@pytest.mark.parametrize("decay, power, inv_gamma", [(0.9999, None, 1.0), (0.9, None, 1.0), (0.999, 2 / 3, 1.0),
                                                     (0.9999, 0.75, 3.0)])
def test_the_decay_is_emamodels_update_by_update(decay: float, power: float | None, inv_gamma: float) -> None:
    theirs = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=decay, use_ema_warmup=power is not None,
                      power=power if power is not None else 2 / 3, inv_gamma=inv_gamma)
    ours = [ema_decay(decay, u, power, inv_gamma) for u in range(1, 2001)]
    assert ours == [theirs.get_decay(u) for u in range(1, 2001)]  # exact floats
    assert ours[0] == 0.0 and ours[-1] == min(decay, ours[-1]) and ours == sorted(ours)  # 0, warming up to decay


class Pipelined:
    """A model over two in-process pipeline ranks that one backend serves, stepped as the loop steps."""

    def __init__(self, model: str, make_backend, spec, settings: StepSettings) -> None:
        self.model, self.spec, self.settings = model, spec, settings
        self.backend = make_backend()
        costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, 1)
        self.placement = partition("sequential", spec, costs, 2)
        program = lower(make_schedule("1f1b", self.placement, 2), spec, self.placement)
        self.run = local_run(spec, self.placement, program, self.backend, make_batches(spec, 1), eps_loss)
        self.chunks = [ex.chunks[c] for ex in self.run.executors for c in sorted(ex.chunks)]

    def train(self, start: int, stop: int) -> None:
        for step in range(start, stop):
            self.run.step()
            optimizer_update(self.backend, self.chunks, step, self.settings)

    def shards(self) -> list[checkpoint.Shard]:
        return [checkpoint.Shard(self.backend, [ex.chunks[c] for c in sorted(ex.chunks)], r, 2, 0)
                for r, ex in enumerate(self.run.executors)]

    def save(self, root: Path, step: int) -> Path:
        plan = Plan(self.model, "cpu-local", 2, 1, 1, 2, "sequential", self.placement)
        info = checkpoints.manifest_info(plan, self.spec, 0, checkpoints.data_position(step, 2, 8))
        comm = TableComm()
        for shard in reversed(self.shards()):  # rank 0 last: it writes the manifest
            where = checkpoint.save(root, step, shard, comm, info, checkpoints.layers_by_rank(plan, self.spec))
        return where

    def load(self, where: Path, step: int) -> None:
        found = checkpoints.Found(step, where, checkpoints.check_step(where, step))
        for shard in self.shards():
            checkpoint.load(found, shard)


def diffusers_unet(pipeline: Path, settings: StepSettings) -> tuple[Pipelined, object]:
    model = f"diffusers:{pipeline / 'unet'}"
    adapter = load_diffusers(model)
    return Pipelined(model, lambda: adapter.backend(lr=1e-3), adapter.spec, settings), adapter


def zoo_unet(settings: StepSettings) -> Pipelined:
    return Pipelined("tiny-unet", lambda: TorchBackend(lr=1e-3), get_spec("tiny-unet"), settings)


@pytest.mark.parametrize("power", [None, 0.75])
def test_the_pipelined_ema_equals_emamodel_on_the_same_weights(pipeline: Path, power: float | None) -> None:
    settings = StepSettings(lr=1e-3, ema=0.99, ema_power=power)
    job, adapter = diffusers_unet(pipeline, settings)
    params = dict(adapter.model.named_parameters())
    reference = EMAModel(params.values(), decay=0.99, use_ema_warmup=power is not None, power=power or 2 / 3)
    for step in range(5):
        job.train(step, step + 1)
        reference.step(params.values())
    assert job.backend.ema_steps == reference.optimization_step == 5
    theirs = dict(zip(params, reference.shadow_params))
    assert job.backend.ema.keys() == theirs.keys() and len(theirs) > 100
    assert [n for n in theirs if not torch.equal(job.backend.ema[n], theirs[n])] == []  # bit for bit
    assert sum(not torch.equal(theirs[n], params[n]) for n in theirs) > len(theirs) // 2  # an average, not the weights


def resumed_equals_uninterrupted(make, tmp_path: Path) -> int:
    """4 steps against 2 + checkpoint + a fresh model loading it + 2; returns how many EMA tensors agreed."""
    whole = make()
    whole.train(0, 4)
    first = make()
    first.train(0, 2)
    where = first.save(tmp_path / "ckpt", 2)
    second = make()  # a fresh model and backend: nothing carried over but the checkpoint
    second.load(where, 2)
    assert second.backend.ema_steps == 2
    second.train(2, 4)
    assert second.backend.ema_steps == whole.backend.ema_steps == 4
    ends = [job.save(tmp_path / name, 4) for job, name in ((whole, "whole"), (second, "resumed"))]
    want, got = (checkpoint.merge_weights(e, 4, ema=True) for e in ends)
    assert want.keys() == got.keys() and [n for n in want if not torch.equal(want[n], got[n])] == []
    weights = [checkpoint.merge_weights(e, 4) for e in ends]
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    return len(want)


def test_a_resumed_diffusers_unet_keeps_every_ema_tensor(pipeline: Path, tmp_path: Path) -> None:
    settings = StepSettings(lr=1e-3, ema=0.999)
    agreed = resumed_equals_uninterrupted(lambda: diffusers_unet(pipeline, settings)[0], tmp_path)
    names = dict(load_diffusers(f"diffusers:{pipeline / 'unet'}").model.named_parameters())
    assert agreed == len(names)  # every one of the model's own names, not only conv_in / conv_out


def test_a_resumed_zoo_model_keeps_its_ema_and_warm_up(tmp_path: Path) -> None:
    make = lambda: zoo_unet(StepSettings(lr=1e-3, ema=0.999))  # noqa: E731
    agreed = resumed_equals_uninterrupted(make, tmp_path)
    job = make()
    assert agreed == sum(len(job.backend.parameters(c)) for c in job.chunks)
