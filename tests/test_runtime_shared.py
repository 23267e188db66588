"""Layer-made shared inputs under direct transport (V, wave): each device receives one
once per microbatch, keeps its copy for all its later chunks, sums the copy's gradient
over them and sends it back on the message that brought it (numpy backend, float64)."""
from __future__ import annotations

import numpy as np
import pytest

from pulse.placement import Placement, from_cuts, wave_devices
from pulse.testing.local import LocalRun, local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.runtime.wiring import MAIN, Wiring
from pulse.schedule.generators import gpipe, greedy_v_1f1b, zero_bubble_v
from pulse.schedule.lower import lower
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.traffic import transfers

M, B = 4, 2
TOY = toy_unet_spec(depth=7)  # temb made by layer 0, read by every dense layer but the head
TEMB = 2 * 8  # bytes per sample


def run(spec: ModelSpec, placement: Placement, generator) -> LocalRun:
    schedule = lower(generator(placement, M), spec, placement)
    r = local_run(spec, placement, schedule, NumpyBackend(), toy_batches(spec, B), mse_loss)
    r.step()
    return r


def single_device(spec: ModelSpec) -> LocalRun:
    return run(spec, from_cuts("sequential", [0, spec.num_layers], [0], 1, "relay", "single"), gpipe)


def assert_same_gradients(got: LocalRun, ref: LocalRun) -> None:
    ref_grads, grads = ref.gradients(), got.gradients()
    assert grads.keys() == ref_grads.keys()
    worst = max(float(np.max(np.abs(grads[k] - ref_grads[k]))) for k in ref_grads)
    assert worst < 1e-10, worst
    assert got.loss() == pytest.approx(ref.loss(), abs=1e-12)


def crossings(placement: Placement) -> int:
    chunks = placement.chunks
    return sum(chunks[c].device != chunks[c + 1].device for c in range(len(chunks) - 1))


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v, gpipe])
@pytest.mark.parametrize("kind, P, folds", [("v", 2, 1), ("v", 4, 1), ("wave", 2, 2), ("wave", 4, 2)])
def test_temb_reaches_each_device_once_and_gradients_match(kind, P, folds, generator) -> None:
    placement = toy_placement(TOY, kind, P, folds=folds)
    got = run(TOY, placement, generator)
    assert_same_gradients(got, single_device(TOY))
    temb = [m for m in got.network.log if m.tag.name == "temb"]
    # temb goes down the first leg only, device d -> d+1; its summed gradient comes back up
    assert {(m.src, m.dst, m.tag.direction) for m in temb} == (
        {(d, d + 1, "F") for d in range(P - 1)} | {(d + 1, d, "B") for d in range(P - 1)})
    assert sum(m.nbytes for m in temb) == 2 * (P - 1) * TEMB * B * M
    # before: every one of the placement's device crossings carried temb both ways
    dropped = 2 * (crossings(placement) - (P - 1)) * TEMB * B * M
    assert dropped == 2 * (P - 1) * (2 * folds - 1) * TEMB * B * M > 0
    # the decoder-side chunks of device 0 read temb without any message bringing it
    wiring = Wiring(TOY, placement)
    assert {wiring.shared_key(c, "temb") for c in placement.chunks_of(0)} == {"temb@0"}
    total = sum(m.nbytes for m in got.network.log)
    assert total == 2 * sum(tr.total_bytes for tr in transfers(TOY, placement)) * B * M


def test_relay_still_carries_temb_across_every_boundary() -> None:
    placement = toy_placement(TOY, "v", 4, transport="relay")
    got = run(TOY, placement, greedy_v_1f1b)
    assert_same_gradients(got, single_device(TOY))
    temb = [m for m in got.network.log if m.tag.name == "temb"]
    assert len(temb) == 2 * crossings(placement) * M


def mid_embed_spec() -> ModelSpec:
    """A toy U with a second embedding, "cond", made mid-encoder (layer 3) and read by every
    later dense layer: under a V its maker's device is not device 0, so device 0 first
    receives cond on its decoder side."""
    a = 8
    def dense(name: str, dim: int, reads) -> Layer:
        return Layer(name, "dense", dim * dim, 2.0 * dim * dim, dim * a, dim * a, {"op": "dense", "reads": reads})
    both = ["temb", "cond"]
    layers = [Layer("temb", "embed", 2, 4.0, 3 * a, 0, {"op": "embed", "source": "t", "produces": "temb"}),
              dense("stem", 4, ["temb"]), dense("enc0", 5, ["temb"]),
              Layer("cemb", "embed", 3, 6.0, 5 * a, 0, {"op": "embed", "source": "t", "produces": "cond"}),
              dense("enc1", 6, both), dense("enc2", 7, both), dense("mid", 7, both), dense("dec2", 7, both),
              dense("dec1", 6, both), dense("dec0", 5, both), dense("head", 3, [])]
    skips = [SkipEdge("stem", "head", 4 * a), SkipEdge("enc0", "dec0", 5 * a),
             SkipEdge("enc1", "dec1", 6 * a), SkipEdge("enc2", "dec2", 7 * a)]
    shared = [SharedInput("t", 1 * a), SharedInput("temb", 2 * a, "temb"), SharedInput("cond", 3 * a, "cemb")]
    return ModelSpec("toy-mid-embed", tuple(layers), tuple(skips), tuple(shared), act_bytes=a,
                     meta={"depth": 3})


MID = mid_embed_spec()


def mid_placement(P: int) -> Placement:
    cuts = {2: [0, 3, 6, 9, 11],  # [temb stem enc0] [cemb enc1 enc2] | [mid dec2 dec1] [dec0 head]
            3: [0, 3, 5, 6, 8, 9, 11]}[P]  # [temb stem enc0] [cemb enc1] [enc2] | [mid dec2] [dec1] [dec0 head]
    return from_cuts("v", cuts, wave_devices(P, 1), P, "direct", "test")


def test_a_shared_input_first_reaching_a_device_on_the_decoder_side() -> None:
    """P=3: temb goes 0 -> 1 -> 2 on the encoder side; cond, made on device 1, goes to
    device 2 (encoder side) and to device 0 on the decoder side (4 -> 5), and its gradient
    returns on that decoder-side message."""
    placement = mid_placement(3)
    assert [(t.src_chunk, t.dst_chunk, t.shared) for t in transfers(MID, placement)] == [
        (0, 1, ("temb",)), (1, 2, ("temb", "cond")), (3, 4, ()), (4, 5, ("cond",))]
    wiring = Wiring(MID, placement)
    assert wiring.shared_key(5, "cond") == "cond@5" and wiring.shared_key(5, "temb") == "temb@0"
    assert wiring.shared_key(4, "cond") == "cond@1" and wiring.shared_key(3, "temb") == "temb@2"


@pytest.mark.parametrize("generator", [greedy_v_1f1b, zero_bubble_v, gpipe])
@pytest.mark.parametrize("P", [2, 3])
def test_decoder_side_arrival_gradients_match(P: int, generator) -> None:
    placement = mid_placement(P)
    got = run(MID, placement, generator)
    assert_same_gradients(got, single_device(MID))
    sent = {(m.src, m.dst, m.tag.direction, m.tag.name) for m in got.network.log if m.tag.name != MAIN}
    cond_to_0 = {(1, 0, "F", "cond"), (0, 1, "B", "cond")}
    assert cond_to_0 <= sent and not any(n == "temb" and d == 0 for _, d, f, n in sent if f == "F")
    total = sum(m.nbytes for m in got.network.log)
    assert total == 2 * sum(tr.total_bytes for tr in transfers(MID, placement)) * B * M
    for ex in got.executors:
        assert ex.shared.live_bytes == 0 and ex.stats.peak_shared_bytes > 0
