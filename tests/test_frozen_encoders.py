"""The frozen VAE and text encoders under ``--precision``, and which ranks load them.

* held in the training precision (diffusers' ``weight_dtype``): their parameters' dtype is bf16 under
  bf16, and a bf16 encoding equals diffusers' own bf16 encoding bit for bit (not the fp32 cache);
  SDXL's VAE stays fp32 under fp16 (it overflows there), as diffusers' SDXL script keeps it;
* with the encoders in the plan's bubbles, a rank that runs no encode of an encoder never loads it, the
  first step included: its prefetched encodes run before it on the ranks the plan gives them
  (``pulse.runtime.first_step_encodes``), and the gradients stay those of encoding where read;
* the plan prices the encoders' weights in the dtype the ranks hold them in.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import image_folder, pipeline_fixture  # noqa: E402
from sdxl_helpers import sdxl_fixture  # noqa: E402
from pulse.cli.encoders_args import pipeline_encoder_set  # noqa: E402
from pulse.cli.main import main as pulse_main  # noqa: E402
from pulse.costs import AnalyticProfiler, with_encoder_costs  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.frozen_precision import frozen_bytes, frozen_precision  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.data.pipeline_text import pipeline_encoders  # noqa: E402
from pulse.encoders import Encoder, EncoderSet  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.partition import plan_symmetric  # noqa: E402
from pulse.plan import load_plan  # noqa: E402
from pulse.runtime.executor import StageExecutor  # noqa: E402
from pulse.runtime.first_step_encodes import FirstStepEncodes  # noqa: E402
from pulse.schedule.encode import EncodeContext, add_encodes  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.sim.encodes import place_encodes  # noqa: E402
from pulse.sim.engine import simulate  # noqa: E402
from pulse.testing.fake_comm import FakeNetwork, run_all_ranks  # noqa: E402
from pulse.testing.fake_rendezvous import RendezvousRules  # noqa: E402
from pulse.testing.local import LocalRun  # noqa: E402
from pulse.train.loop import StepBatches  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.diffusers_adapter import load_diffusers  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.pipeline.images import load_image  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
sdxl = pytest.fixture(scope="session")(sdxl_fixture)
MICROBATCHES = 4


def loaded(source: ImageSource) -> set[str]:
    """The encoders a source loaded: "text" (any text encoder), "vae"."""
    encoder = vars(source).get("_encoder")
    if encoder is None:
        return set()
    return {name for name, present in (("text", encoder.text_encoders), ("vae", "vae" in vars(encoder))) if present}


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


def in_process_step(pipeline: Path, images: Path, mode: str, first_step_encodes: bool = True,
                    rendezvous: RendezvousRules | None = None, precision: str = "fp32",
                    room: dict[int, int] | None = None):
    """One step of the tiny SD UNet at pp 2 (V, greedy 1F1B) on the in-process network, each device with a
    source of its own (as separate ranks have); with ``first_step_encodes``, each rank's prefetches first.
    ``room``: bytes per device for the encoders' weights (where the bubbles pass may put them)."""
    model = PREFIX + str(pipeline / "unet")
    spec = load_model(model)
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    placement = plan_symmetric(spec, costs, 2).placement
    schedule = make_schedule("greedy_v_1f1b", placement, MICROBATCHES, costs)
    encoders = None
    if mode != "cached":
        encoders = EncoderSet(pipeline_encoders(read_pipeline(pipeline)), mode)
        costs = with_encoder_costs(costs, encoders, cluster.hardware)
        schedule = add_encodes(schedule, EncodeContext(spec, placement, costs, cluster, encoders, room))
    program = lower(schedule, spec, placement, encoders)
    backend = load_diffusers(model).backend(lr=1e-3, seed=0)
    network, sources, executors = FakeNetwork(2, backend, rendezvous), [], []
    for d in range(2):
        sources.append(ImageSource(str(pipeline), str(images), spec, precision=precision))
        feed = DiffusionFeed(sources[-1], Sampler(4, 1, MICROBATCHES, 1, 0), noise_schedule("scaled_linear"), 0,
                             "v_prediction", caption_dropout=0.5)
        batches = StepBatches(lambda s, r, m, feed=feed: feed.batch(s, r, m).map(torch.from_numpy), 0,
                              encoded=lambda s, r, m, f, feed=feed: torch.from_numpy(feed.encoded(s, r, m, f)),
                              provide=lambda s, r, m, f, v, feed=feed: feed.provide(s, r, m, f, v.numpy()))
        executors.append(StageExecutor(device=d, spec=spec, placement=placement, schedule=program, backend=backend,
                                       comm=network.communicator(d), batches=batches, loss_fn=eps_loss,
                                       encoders=encoders))
    if first_step_encodes:
        prefetches = [FirstStepEncodes(ex, first_step=0) for ex in executors]
        run_all_ranks(prefetches)
        for p in prefetches:
            p.finish()
    for ex in executors:
        ex.batches.step = 0
    run = LocalRun(network, executors, 2, 1)
    run.step()
    return run, program, sources


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
    assert [loaded(s) for s in sources] == [runs_on[0], runs_on[1]]
    want, got = cached.gradients(), run.gradients()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert run.loss() == cached.loss()
    if room is not None:  # what the first step's prefetches spare device 1
        assert runs_on[1] == set()
        _, _, before = in_process_step(pipeline, images, "bubbles", first_step_encodes=False, room=room)
        assert loaded(before[1]) == {"text"}


def test_a_bf16_rank_holds_only_the_encoders_it_runs_in_bf16(pipeline: Path, tmp_path: Path) -> None:
    images = image_folder(tmp_path / "img", 4)
    names = tuple(e.name for e in pipeline_encoders(read_pipeline(pipeline)))
    _, program, sources = in_process_step(pipeline, images, "bubbles", precision="bf16")
    runs_on = encoders_run_on(program, names)
    for d, source in enumerate(sources):
        assert loaded(source) == runs_on[d]
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
