"""The frozen VAE and text encoders under ``--precision``, and which ranks load them.

* held in the training precision (diffusers' ``weight_dtype``): their parameters' dtype is bf16 under
  bf16, and a bf16 encoding equals diffusers' own bf16 encoding bit for bit (not the fp32 cache);
  SDXL's VAE stays fp32 under fp16 (it overflows there), as diffusers' SDXL script keeps it;
* with the encoders in the plan's bubbles, a rank that runs no encode of an encoder never loads it, the
  first step included: its prefetched encodes run before it on the ranks the plan gives them
  (``pulse.runtime.first_step_encodes``), and the gradients stay those of encoding where read;
  (in process, messages by tag and under NCCL's rules; on two gloo processes matched by order);
* the plan prices the encoders' weights in the dtype the ranks hold them in.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import image_folder, pipeline_fixture  # noqa: E402
from sdxl_helpers import sdxl_fixture  # noqa: E402
from first_step_worker import MICROBATCHES, encode_program, loaded, step_batches  # noqa: E402
from pulse.cli.encoders_args import pipeline_encoder_set  # noqa: E402
from pulse.cli.main import main as pulse_main  # noqa: E402
from pulse.costs import AnalyticProfiler, with_encoder_costs  # noqa: E402
from pulse.data.frozen_precision import frozen_bytes, frozen_precision  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.data.pipeline_text import pipeline_encoders  # noqa: E402
from pulse.encoders import Encoder  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.partition import plan_symmetric  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.runtime.executor import StageExecutor  # noqa: E402
from pulse.runtime.first_step_encodes import FirstStepEncodes  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.ir import Schedule  # noqa: E402
from pulse.sim.encodes import place_encodes  # noqa: E402
from pulse.sim.engine import simulate  # noqa: E402
from pulse.testing.fake_comm import FakeNetwork, run_all_ranks  # noqa: E402
from pulse.testing.fake_rendezvous import RendezvousRules  # noqa: E402
from pulse.testing.local import LocalRun  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.diffusers_adapter import load_diffusers  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.pipeline.images import load_image  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
sdxl = pytest.fixture(scope="session")(sdxl_fixture)


def test_encoders_are_held_in_the_training_precision(pipeline: Path, tmp_path: Path) -> None:
    spec = load_model(PREFIX + str(pipeline / "unet"))
    images = image_folder(tmp_path / "img", 2)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        source = ImageSource(str(pipeline), str(images), spec, precision=precision)
        source.latents(np.arange(1)), source.conditions(np.arange(1))
        parts = (source.encoder.vae, source.encoder.text_encoder(0))
        assert all(p.dtype == dtype for part in parts for p in part.parameters()), precision
        assert source.latents(np.arange(1)).dtype == np.float32  # what the backbone reads: float32 either way


def test_sdxl_vae_stays_fp32_under_fp16_only(sdxl: Path, pipeline: Path, tmp_path: Path) -> None:
    folder, sd = read_pipeline(sdxl), read_pipeline(pipeline)
    assert [frozen_precision(folder, p, "fp16") for p in ("text", "vae")] == ["fp16", "fp32"]
    assert [frozen_precision(folder, p, "bf16") for p in ("text", "vae")] == ["bf16", "bf16"]
    assert [frozen_precision(sd, p, "fp16") for p in ("text", "vae")] == ["fp16", "fp16"]
    assert frozen_bytes(folder, "fp16") == {"text": 2, "vae": 4} and frozen_bytes(sd, "fp32") == {"text": 4, "vae": 4}
    spec = load_model(PREFIX + str(sdxl / "unet"))
    source = ImageSource(str(sdxl), str(image_folder(tmp_path / "img", 1)), spec, precision="fp16")
    source.latents(np.arange(1)), source.conditions(np.arange(1))
    assert source.encoder.vae.dtype == torch.float32
    assert {source.encoder.text_encoder(i).dtype for i in (0, 1)} == {torch.float16}


def test_a_bf16_encoding_is_diffusers_own_bf16_encoding(pipeline: Path, tmp_path: Path) -> None:
    """The pipeline loaded by diffusers in bf16 encodes the caption (``encode_prompt``) and the image
    (``vae.encode``) to what a bf16 run's source makes, bit for bit; fp32 differs."""
    spec = load_model(PREFIX + str(pipeline / "unet"))
    images = image_folder(tmp_path / "img", 1)
    source = ImageSource(str(pipeline), str(images), spec, precision="bf16")
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(pipeline, torch_dtype=torch.bfloat16,
                                                             local_files_only=True)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(source.items[0].caption, "cpu", 1, False)
        pixels = torch.from_numpy(load_image(source.items[0].path, source.resolution, False)[None])
        latents = pipe.vae.encode(pixels.to(torch.bfloat16)).latent_dist.mean * pipe.vae.config.scaling_factor
    assert embeds.dtype == torch.bfloat16
    assert np.array_equal(source.conditions(np.arange(1))["context"], embeds.float().numpy())
    assert np.array_equal(source.latents(np.arange(1)), latents.float().numpy())
    fp32 = ImageSource(str(pipeline), str(images), spec)
    assert not np.array_equal(fp32.conditions(np.arange(1))["context"], embeds.float().numpy())


def in_process_run(pipeline: Path, images: Path, mode: str, first_step: int | None = 0,
                   rendezvous: RendezvousRules | None = None, precision: str = "fp32",
                   room: dict[int, int] | None = None) -> tuple[LocalRun, Schedule, list[ImageSource]]:
    """The plan of ``first_step_worker.encode_program`` on the in-process network, each device with a
    source of its own (as separate ranks have); each rank's prefetches for ``first_step`` run (None:
    none, as before ``pulse.runtime.first_step_encodes``). Step it with ``step``."""
    spec, placement, program, encoders = encode_program(pipeline, mode, room)
    backend = load_diffusers(PREFIX + str(pipeline / "unet")).backend(lr=1e-3, seed=0)
    network, sources, executors = FakeNetwork(2, backend, rendezvous), [], []
    for d in range(2):
        sources.append(ImageSource(str(pipeline), str(images), spec, precision=precision))
        executors.append(StageExecutor(device=d, spec=spec, placement=placement, schedule=program, backend=backend,
                                       comm=network.communicator(d), batches=step_batches(sources[-1]),
                                       loss_fn=eps_loss, encoders=encoders))
    if first_step is not None:
        prefetches = [FirstStepEncodes(ex, first_step) for ex in executors]
        run_all_ranks(prefetches)
        for p in prefetches:
            p.finish()
    return LocalRun(network, executors, 2, 1), program, sources


def step(run: LocalRun, number: int) -> LocalRun:
    for ex in run.executors:
        ex.batches.step = number
    run.step()
    return run


def in_process_step(pipeline: Path, images: Path, mode: str, **options):
    """Step 0 of ``in_process_run``."""
    run, program, sources = in_process_run(pipeline, images, mode, **options)
    return step(run, 0), program, sources


def encoders_run_on(program, names: tuple[str, ...]) -> dict[int, set[str]]:
    """Device -> the encoders (by name) the program runs an E of there."""
    out: dict[int, set[str]] = {0: set(), 1: set()}
    for a in program.all_actions():
        if a.kind == "E":
            out[a.device].add(names[a.encoder])
    return out


@pytest.mark.parametrize("room", [None, {0: 2**40, 1: 0}], ids=["both-devices", "device-0-only"])
@pytest.mark.parametrize("rendezvous", [None, RendezvousRules()], ids=["tags", "rendezvous"])
def test_a_rank_that_runs_no_encoder_never_loads_it(pipeline: Path, tmp_path: Path, rendezvous, room) -> None:
    """Bubbles at pp 2 prefetch encodes into the step before (E of M + m): in the first step each is
    run beforehand on its own rank and sent, so every rank loads exactly the encoders it runs an E of;
    without that, a reader of a prefetched microbatch loads an encoder the plan never gave it (device 1,
    which reads the text, when the encoders fit device 0 only). Gradients and loss equal encoding where
    read, bit for bit (under NCCL's rules too)."""
    images = image_folder(tmp_path / "img", 4)
    names = tuple(e.name for e in pipeline_encoders(read_pipeline(pipeline)))
    cached, _, _ = in_process_step(pipeline, images, "cached")
    run, program, sources = in_process_step(pipeline, images, "bubbles", rendezvous=rendezvous, room=room)
    assert any(a.microbatch >= MICROBATCHES for a in program.all_actions() if a.kind == "E")  # prefetches
    runs_on = encoders_run_on(program, names)
    assert [set(loaded(s)) for s in sources] == [runs_on[0], runs_on[1]]
    want, got = cached.gradients(), run.gradients()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert run.loss() == cached.loss()
    if room is not None:  # what the first step's prefetches spare device 1
        assert runs_on[1] == set()
        _, _, before = in_process_step(pipeline, images, "bubbles", first_step=None, room=room)
        assert loaded(before[1]) == ["text"]


def test_a_resumed_run_prefetches_for_the_step_it_starts_at(pipeline: Path, tmp_path: Path) -> None:
    """--resume at step 1: the prefetches run for step 1 (as step 0 would have run them), and step 1's
    gradients are those of encoding where read."""
    images = image_folder(tmp_path / "img", 4)
    run, _, sources = in_process_run(pipeline, images, "bubbles", first_step=1, room={0: 2**40, 1: 0})
    assert loaded(sources[1]) == []
    cached, _, _ = in_process_run(pipeline, images, "cached")
    want, got = step(cached, 1).gradients(), step(run, 1).gradients()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert loaded(sources[1]) == []


def test_a_bf16_rank_holds_only_the_encoders_it_runs_in_bf16(pipeline: Path, tmp_path: Path) -> None:
    images = image_folder(tmp_path / "img", 4)
    names = tuple(e.name for e in pipeline_encoders(read_pipeline(pipeline)))
    _, program, sources = in_process_step(pipeline, images, "bubbles", precision="bf16")
    runs_on = encoders_run_on(program, names)
    for d, source in enumerate(sources):
        assert set(loaded(source)) == runs_on[d]
        held = [source.encoder.vae] * ("vae" in runs_on[d]) + list(source.encoder.text_encoders.values())
        assert held and all(p.dtype == torch.bfloat16 for part in held for p in part.parameters())


def test_the_encoders_weights_are_priced_in_the_dtype_they_are_held_in(pipeline: Path, tmp_path: Path) -> None:
    spec = load_model(PREFIX + str(pipeline / "unet"))
    images = str(image_folder(tmp_path / "img", 1))
    held = {p: pipeline_encoder_set(str(pipeline), images, "before", spec, p) for p in ("fp32", "bf16", "fp16")}
    for precision, want in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        assert all(e.weight_bytes == e.params * want for e in held[precision].encoders), precision
    assert Encoder.from_dict(held["fp32"].encoders[0].to_dict(), "e") == held["fp32"].encoders[0]
    # the simulator's encoder bytes per device, where the encodes run (before: device 0)
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    placement = plan_symmetric(spec, costs, 2).placement
    weights = {}
    for precision, encoders in held.items():
        priced = with_encoder_costs(costs, encoders, cluster.hardware)
        schedule = place_encodes(spec, placement, make_schedule("gpipe", placement, 2, priced), priced, cluster,
                                 encoders, None)
        weights[precision] = [m.encoder_weights for m in simulate(spec, placement, schedule, priced, cluster,
                                                                  encoders=encoders).memory]
    total = sum(e.params for e in held["fp32"].encoders)
    assert weights["fp32"] == [4 * total, 0] and weights["bf16"] == weights["fp16"] == [2 * total, 0]
    # pulse train's plan: the encoders' bytes per weight, and the peak moves by the difference
    plans = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        assert pulse_main(["train", "--pipeline", str(pipeline), "--images", images, "--encoders", "before",
                           "--schedule", "gpipe", "--precision", precision, "--plan-only", "--out-dir", str(out)]) == 0
        plans[precision] = load_plan(out / "plan.yaml", load_model)[0]
    assert [e.bytes_per_param for e in plans["fp32"].encoders.encoders] == [4, 4]
    assert [e.bytes_per_param for e in plans["bf16"].encoders.encoders] == [2, 2]
    # a written plan trained under another precision is priced as that run holds its encoders
    assert pulse_main(["train", "--plan", str(tmp_path / "fp32" / "plan.yaml"), "--pipeline", str(pipeline),
                       "--images", images, "--precision", "bf16", "--plan-only", "--out-dir",
                       str(tmp_path / "again")]) == 0
    again = load_plan(tmp_path / "again" / "plan.yaml", load_model)[0]
    assert [e.bytes_per_param for e in again.encoders.encoders] == [2, 2]
    assert again.schedule.to_dict() == plans["fp32"].schedule.to_dict()  # the plan itself unchanged


def test_two_processes_load_only_the_encoders_they_run(pipeline: Path, tmp_path: Path) -> None:
    """The same on two gloo processes with the torch communicator matching messages by order (NCCL's
    rule): each rank is told the prefetches' message order, then the program's again (its headers
    counted afresh on both ends). The encoders fit device 0 only: rank 1 loads none, and steps 0 and
    1 give the gradients of encoding where read, bit for bit."""
    from process_rigs import free_port

    images = image_folder(tmp_path / "img", 4)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={free_port()}", str(Path(__file__).parent / "first_step_worker.py"), "--pipeline",
         str(pipeline), "--images", str(images), "--out", str(out), "--room", "device0", "--ordered"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["loaded"] for r in records] == [["text", "vae"], []]
    assert records[0]["prefetches"] > 0 and records[1]["prefetches"] > 0  # E + SE there, RE here
    cached, _, _ = in_process_run(pipeline, images, "cached")
    got = {k: v for r in (0, 1) for k, v in np.load(out / f"rank{r}.npz").items()}
    for number in (0, 1):
        want = step(cached, number).gradients()
        mine = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(f"step{number}/")}
        assert set(mine) == set(want) and all(np.array_equal(mine[n], want[n].numpy()) for n in want), number


def test_a_missing_kernel_in_the_encoders_dtype_is_one_line(pipeline: Path, tmp_path: Path, monkeypatch) -> None:
    """A CPU build without a bf16 kernel for one of the VAE's ops: one line naming the part and what to do."""
    spec = load_model(PREFIX + str(pipeline / "unet"))
    source = ImageSource(str(pipeline), str(image_folder(tmp_path / "img", 1)), spec, precision="bf16")

    def no_kernel(*args, **kwargs):
        raise RuntimeError('"slow_conv2d_cpu" not implemented for \'BFloat16\'')

    monkeypatch.setattr(source.encoder.vae, "encode", no_kernel)
    with pytest.raises(PulseError) as said:
        source.latents(np.arange(1))
    assert "\n" not in str(said.value) and "no torch.bfloat16 kernel on cpu" in str(said.value)
    assert "--precision fp32" in str(said.value) and "pulse cache-latents" in str(said.value)
