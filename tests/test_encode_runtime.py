"""Frozen encoders run inside the pipeline (E, SE, RE actions): the same gradients as encoding where read.

One step of the tiny SD pipeline's UNet, pp 2 V placement, on the in-process network, each device with
its own feed (as separate ranks have): with the VAE and text encoder cached-on-read, run before the
pipeline, and placed in its bubbles (outputs sent to their readers). Gradients and loss must be equal
bit for bit (fp32, same inputs), and the messages must carry exactly the encoders' outputs. The same
for the tiny SDXL pipeline, whose text task makes three inputs (context, text_embeds, time_ids): one
message of three tensors per reader device.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline_helpers import image_folder, pipeline_fixture  # noqa: E402
from sdxl_helpers import SDXL_INPUTS, sdxl_fixture  # noqa: E402
from pulse.costs import AnalyticProfiler, with_encoder_costs  # noqa: E402
from pulse.data.feed import DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.pipeline_folder import read_pipeline  # noqa: E402
from pulse.data.pipeline_text import pipeline_encoders  # noqa: E402
from pulse.encoders import EncoderSet  # noqa: E402
from pulse.errors import PlanError  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.partition import plan_symmetric  # noqa: E402
from pulse.placement import from_cuts  # noqa: E402
from pulse.runtime.executor import StageExecutor  # noqa: E402
from pulse.testing.fake_comm import FakeNetwork  # noqa: E402
from pulse.testing.fake_rendezvous import RendezvousRules  # noqa: E402
from pulse.testing.local import LocalRun  # noqa: E402
from pulse.train.loop import StepBatches  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.sim.encodes import place_encodes  # noqa: E402
from pulse.zoo.diffusers_config import PREFIX  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.diffusers_adapter import load_diffusers  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.pipeline.onthefly import ImageSource  # noqa: E402

torch.set_num_threads(1)
pipeline = pytest.fixture(scope="session")(pipeline_fixture)
sdxl = pytest.fixture(scope="session")(sdxl_fixture)
MICROBATCHES = 4


def device_batches(pipeline: Path, images: Path, spec, device: int, sources: list) -> StepBatches:
    """One rank's data: its own source and feed (nothing shared with the other device)."""
    sources.append(ImageSource(str(pipeline), str(images), spec))
    feed = DiffusionFeed(sources[-1], Sampler(4, 1, MICROBATCHES, 1, 0), noise_schedule("scaled_linear"), 0,
                         "v_prediction", caption_dropout=0.5)
    return StepBatches(lambda s, r, m: feed.batch(s, r, m).map(torch.from_numpy), 0,
                       encoded=lambda s, r, m, f: torch.from_numpy(feed.encoded(s, r, m, f)),
                       provide=lambda s, r, m, f, v: feed.provide(s, r, m, f, v.numpy()))


def one_step(pipeline: Path, images: Path, mode: str, cuts: list[int] | None = None, rendezvous=None):
    model = PREFIX + str(pipeline / "unet")
    spec = load_model(model)
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    placement = plan_symmetric(spec, costs, 2).placement
    if cuts is not None:
        placement = from_cuts(placement.kind, cuts, [0, 1, 1, 0], 2, placement.skip_transport, "test")
    schedule = make_schedule("greedy_v_1f1b", placement, MICROBATCHES, costs)
    encoders = None
    if mode != "cached":
        encoders = EncoderSet(pipeline_encoders(read_pipeline(pipeline)), mode)
        costs = with_encoder_costs(costs, encoders, cluster.hardware)
        schedule = place_encodes(spec, placement, schedule, costs, cluster, encoders, None)
    program = lower(schedule, spec, placement, encoders)
    backend = load_diffusers(model).backend(lr=1e-3, seed=0)
    network, sources = FakeNetwork(2, backend, rendezvous), []
    executors = [StageExecutor(device=d, spec=spec, placement=placement, schedule=program, backend=backend,
                               comm=network.communicator(d), batches=device_batches(pipeline, images, spec, d, sources),
                               loss_fn=eps_loss, encoders=encoders) for d in range(2)]
    run = LocalRun(network, executors, 2, 1)
    run.step()
    return run, program, sources


def test_in_pipeline_encoding_gives_the_gradients_of_encoding_where_read(pipeline: Path, tmp_path: Path) -> None:
    images = image_folder(tmp_path / "img", 4)
    cached, _, sources = one_step(pipeline, images, "cached")
    assert all(hasattr(s, "_encoder") for s in sources)  # both devices read text: both encode
    want = cached.gradients()
    for mode in ("before", "bubbles"):
        run, program, sources = one_step(pipeline, images, mode)
        if mode == "before":  # device 0 encodes everything; device 1 reads only what it received
            assert hasattr(sources[0], "_encoder") and not hasattr(sources[1], "_encoder")
        kinds = [a.kind for row in program.actions.values() for a in row]
        assert kinds.count("E") == 2 * MICROBATCHES and kinds.count("SE") == kinds.count("RE") > 0
        got = run.gradients()
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), mode
        assert run.loss() == cached.loss()


def test_sdxl_text_task_sends_its_three_inputs_and_gives_the_gradients_of_encoding_where_read(
        sdxl: Path, tmp_path: Path) -> None:
    """SDXL's two text encoders run as one task (context, text_embeds, time_ids); 20 px images, so the
    time ids hold a crop. Before, in bubbles, and in bubbles under rendezvous (a communicator matching
    each tensor by the sender's order): bit-equal to encoding where read."""
    images = image_folder(tmp_path / "img", 4, size=20)
    cached, _, _ = one_step(sdxl, images, "cached")
    want = cached.gradients()
    text = pipeline_encoders(read_pipeline(sdxl))[0]
    assert text.feeds == SDXL_INPUTS and {"transformer2d", "transformer2d_part", "time_embed"} == set(text.readers)
    for mode, rules in (("before", None), ("bubbles", None), ("bubbles", RendezvousRules())):
        run, program, sources = one_step(sdxl, images, mode, rendezvous=rules)
        if mode == "before":
            assert not hasattr(sources[1], "_encoder")  # device 1 reads only what it received
        kinds = [a.kind for row in program.actions.values() for a in row]
        assert kinds.count("E") == 2 * MICROBATCHES and kinds.count("SE") == kinds.count("RE") > 0
        got = run.gradients()
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), mode
        assert run.loss() == cached.loss()


def test_encode_messages_train_under_rendezvous(pipeline: Path, tmp_path: Path) -> None:
    """SE/RE move as NCCL moves messages (in the sender's order, each waiting for its receive)."""
    images = image_folder(tmp_path / "img", 4)
    want = one_step(pipeline, images, "bubbles")[0]
    got, program, _ = one_step(pipeline, images, "bubbles", rendezvous=RendezvousRules())
    assert any(a.kind == "SE" for row in program.actions.values() for a in row)
    assert all(torch.equal(got.gradients()[n], g) for n, g in want.gradients().items())
    assert got.loss() == want.loss()


def test_prefetched_encodes_feed_the_next_step_without_encoding_again(pipeline: Path, tmp_path: Path) -> None:
    """Bubbles place microbatch 0's encodes in the step before (E of M + m): in the second step every
    microbatch is encoded exactly once (by its E, this step's or the previous one's prefetch) and the
    gradients are those of the cached latents."""
    images = image_folder(tmp_path / "img", 4)
    run, program, sources = one_step(pipeline, images, "bubbles")  # step 0: nothing was prefetched for it
    encodes = [a for a in program.all_actions() if a.kind == "E"]
    assert any(a.microbatch >= MICROBATCHES for a in encodes)
    calls = []
    for source in sources:
        for name in ("latents", "conditions"):
            method = getattr(source, name)
            setattr(source, name, lambda index, method=method: calls.append(1) or method(index))
    cached, _, _ = one_step(pipeline, images, "cached")
    for r in (run, cached):
        for ex in r.executors:
            ex.batches.step = 1
        r.step()
    assert len(calls) == len(encodes)  # this step's encodes and the next step's prefetches, nothing else
    want, got = cached.gradients(), run.gradients()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert run.loss() == cached.loss()


def test_a_chunk_without_a_reader_layer_does_not_encode_what_its_device_receives(pipeline: Path,
                                                                                tmp_path: Path) -> None:
    """Device 1's first chunk is one ResNet block (no cross-attention): it runs before the text arrives
    and must not read the text from its batch, or it would run the text encoder itself."""
    images = image_folder(tmp_path / "img", 4)
    spec = load_model(PREFIX + str(pipeline / "unet"))
    resnet = next(i for i, layer in enumerate(spec.layers) if i > 1 and layer.kind.startswith("res"))
    cuts = [0, resnet, resnet + 1, spec.num_layers - resnet, spec.num_layers]
    run, program, sources = one_step(pipeline, images, "before", cuts)
    first = program.actions[1]
    assert [a.kind for a in first].index("F") < [a.kind for a in first].index("RE")  # it does run first
    assert not hasattr(sources[1], "_encoder")
    cached, _, _ = one_step(pipeline, images, "cached", cuts)
    want, got = cached.gradients(), run.gradients()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_rank_that_cannot_encode_refuses_the_plan(pipeline: Path) -> None:
    model = PREFIX + str(pipeline / "unet")
    spec = load_model(model)
    cluster = load_cluster("cpu-local")
    costs = AnalyticProfiler(cluster.hardware).profile(spec, 1)
    placement = plan_symmetric(spec, costs, 2).placement
    encoders = EncoderSet(pipeline_encoders(read_pipeline(pipeline)), "before")
    costs = with_encoder_costs(costs, encoders, cluster.hardware)
    schedule = place_encodes(spec, placement, make_schedule("gpipe", placement, 2, costs), costs, cluster, encoders,
                             None)
    backend = load_diffusers(model).backend(lr=1e-3, seed=0)
    with pytest.raises(PlanError, match="cannot encode"):
        StageExecutor(device=0, spec=spec, placement=placement, schedule=lower(schedule, spec, placement, encoders),
                      backend=backend, comm=FakeNetwork(2, backend).communicator(0),
                      batches=lambda mb: {}, loss_fn=eps_loss, encoders=encoders)
