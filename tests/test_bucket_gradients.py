"""Non-square (bucketed) batches through a pipeline: gradients equal single-device training (fp64).

tiny-unet only: its layers are convolutions and attention over whatever grid they get. The DiT and
U-ViT layers hold square tables (U-ViT's pos_embed, Hunyuan-DiT's RoPE grid and unpatchify), so
non-square latents are refused there, as the reference implementations do.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_hardware  # noqa: E402
from pulse.partition import partition  # noqa: E402
from pulse.runtime.wiring import MAIN  # noqa: E402
from pulse.schedule.generators import make_schedule  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.testing.fake_rendezvous import RendezvousRules  # noqa: E402
from pulse.testing.local import local_run  # noqa: E402
from pulse.traffic import transfers  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse.zoo.shapes import latent_shape  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from torch_worker_check import make_batches, reference_gradients  # noqa: E402

M, B = 2, 2
SHAPES = [(16, 32), (24, 8), (8, 20)]  # latent (height, width) of three buckets: 128x256, 192x64, 64x160 px


def bucketed(spec, latent_hw, seed):
    """The training feed's batches with the main path and target drawn at the bucket's latent size."""
    square = make_batches(spec, B, seed=seed)
    rng = np.random.default_rng(seed)

    def batch(mb):
        out = dict(square(mb))
        for name in (MAIN, "target"):
            c = out[name].shape[1]
            out[name] = torch.from_numpy(rng.standard_normal((B, c, *latent_hw)))
        return out

    frozen = [batch(mb) for mb in range(M)]  # one draw per microbatch, read by every rank alike
    return lambda mb: frozen[mb]


def relative_error(got, ref):
    assert got.keys() == ref.keys()
    return max(float(np.abs(got[k] - r).max() / max(np.abs(r).max(), 1e-12)) for k, r in ref.items())


def expected_bytes(spec, placement, latent_hw):
    """Bytes per device pair: the spec's main-path and skip bytes (at its square latent) scaled by the
    bucket's area; shared inputs (the time embedding) do not depend on the image size."""
    _, height, width = latent_shape(spec)
    ratio = latent_hw[0] * latent_hw[1] / (height * width)
    out = {}
    for tr in transfers(spec, placement):
        nbytes = round((tr.main_bytes + tr.skip_bytes) * ratio) + tr.shared_bytes
        for pair in ((tr.src_device, tr.dst_device), (tr.dst_device, tr.src_device)):
            out[pair] = out.get(pair, 0) + nbytes * B * M
    return out


def test_pipelined_gradients_on_non_square_buckets_equal_single_device():
    """Under the rendezvous fake network (NCCL's order matching), one run through three buckets."""
    spec = get_spec("tiny-unet").with_act_bytes(8)
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, B)
    placement = partition("pulse", spec, costs, 2, folds=1)
    program = lower(make_schedule("greedy_v_1f1b", placement, M, costs), spec, placement)
    backend = TorchBackend(dtype=torch.float64)
    for step, hw in enumerate(SHAPES):  # one run, alternating buckets step by step: the messages' shapes change
        batches = bucketed(spec, hw, seed=step)
        run = local_run(spec, placement, program, backend, batches, eps_loss, rendezvous=RendezvousRules())
        run.step()
        got = {k: v.detach().numpy() for k, v in run.gradients().items()}
        ref, _ = reference_gradients(spec, [batches], M, torch.float64)
        assert relative_error(got, ref) < 1e-5
        moved = {(s, d): run.network.bytes_between(s, d) for s in range(2) for d in range(2)}
        assert {k: v for k, v in moved.items() if v} == expected_bytes(spec, placement, hw)
