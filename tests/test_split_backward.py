"""Zero-bubble schedules (backward split into input and weight halves) on real processes.

Regression for the repro plan that killed rank 1 with SIGSEGV: torch 2.13's CPU
convolution crashes computing its weight gradient after a retained input-gradient
pass when its input is a channels-last view (what the U-Net's transformer block
returned). Everything runs in subprocesses, so a crash fails the test, not pytest.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse.cli.launchers import launcher_prefix  # noqa: E402
from pulse.plan import Plan, load_plan  # noqa: E402
from pulse.cli.common import load_model  # noqa: E402
from pulse.schedule.generators import greedy_v_1f1b  # noqa: E402

REPRO = Path(__file__).parent / "fixtures" / "zbv-segfault-plan.yaml"


def train(plan_path: Path, out: Path, steps: int) -> list[float]:
    done = subprocess.run([*launcher_prefix(2), "-m", "pulse_torch.train",
                           "--plan", str(plan_path), "--steps", str(steps), "--out-dir", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [s["loss"] for s in json.loads((out / "log.json").read_text())["steps"]]


def test_repro_plan_trains_like_the_unsplit_schedule(tmp_path: Path) -> None:
    zbv = train(REPRO, tmp_path / "zbv", 3)
    plan, spec = load_plan(REPRO, load_model)
    unsplit = Plan(**{**plan.__dict__, "schedule": greedy_v_1f1b(plan.placement, plan.num_microbatches)})
    unsplit.save(tmp_path / "greedy.yaml", spec)
    greedy = train(tmp_path / "greedy.yaml", tmp_path / "greedy", 3)
    assert zbv[0] == greedy[0]  # same weights, same batch: the same forward
    # later steps follow gradients summed in another order: equal up to float reordering
    assert zbv == pytest.approx(greedy, rel=1e-5)


SPLIT_ON_CHANNELS_LAST = """
import torch
from pulse.cli.common import load_model
from pulse.runtime.wiring import Wiring
from pulse.placement import from_cuts
from pulse_torch.backend import TorchBackend
spec = load_model("tiny-unet")
last = spec.num_layers - 1  # conv_out: GroupNorm, SiLU, Conv2d
placement = from_cuts("sequential", [0, last, last + 1], [0, 1], 2, "relay", "t")
io = Wiring(spec, placement).ios[1]
backend = TorchBackend(dtype=torch.float64)
chunk = backend.build_chunk(spec, io)
h = torch.randn(2, 8, 8, spec.layers[last].attrs["in_channels"], dtype=torch.float64).permute(0, 3, 1, 2)
assert h.is_contiguous(memory_format=torch.channels_last) and not h.is_contiguous()
inputs = {"h": h, **{n: torch.zeros(2, 4) for n in io.shared_in}}
out, ctx = backend.forward(chunk, inputs, io.grad_names)
g = {"h": torch.randn_like(out["h"])}
grads_in, work = backend.backward_input(ctx, g)
backend.backward_weight(work)
split = {n: t.clone() for n, t in backend.gradients(chunk).items()}
backend.zero_grad(chunk)
out, ctx = backend.forward(chunk, inputs, io.grad_names)
backend.backward(ctx, g)
whole = backend.gradients(chunk)
assert all(torch.allclose(split[n], whole[n], rtol=1e-12, atol=1e-12) for n in whole)
print("ok")
"""


def test_split_backward_on_a_channels_last_input_equals_the_whole_backward() -> None:
    done = subprocess.run([sys.executable, "-c", SPLIT_ON_CHANNELS_LAST], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


SPLIT_PER_LAYER = """
import sys
import torch
from torch.utils.flop_counter import FlopCounterMode
from pulse.cli.common import load_model
from pulse.runtime.wiring import Wiring
from pulse.placement import from_cuts
from pulse_torch.backend import TorchBackend
from torch_worker_check import make_batches
spec = load_model(sys.argv[1])
n = spec.num_layers
# the middle chunk: many layers, skips made and read inside it, input gradients asked for
placement = from_cuts("sequential", [0, 2, n - 2, n], [0, 1, 2], 3, "relay", "t")
ios = Wiring(spec, placement).ios
backend = TorchBackend(dtype=torch.float64)
first, chunk = backend.build_chunk(spec, ios[0]), backend.build_chunk(spec, ios[1])
batch = make_batches(spec, 2)(0)
made, _ = backend.forward(first, {k: batch[k] for k in (*ios[0].data_inputs, "h") if k in batch}, frozenset())
feed = {**{k: v for k, v in batch.items() if k in ios[1].data_inputs}, **made}
feed = {k: feed[k] for k in ("h", *ios[1].consumes, *ios[1].shared_in, *ios[1].data_inputs)}
def run(split):
    backend.zero_grad(chunk)
    out, ctx = backend.forward(chunk, feed, ios[1].grad_names)
    g = {k: torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(1))
         for k, v in out.items() if v.is_floating_point()}
    with FlopCounterMode(display=False) as flops:
        if split:
            got, work = backend.backward_input(ctx, g)
            backend.backward_weight(work)
        else:
            got = backend.backward(ctx, g)
    return got, {k: v.clone() for k, v in backend.gradients(chunk).items()}, flops.get_total_flops()
whole_in, whole_w, whole_flops = run(False)
split_in, split_w, split_flops = run(True)
assert whole_in.keys() == split_in.keys() and len(whole_in) > 0, whole_in.keys()
assert all(torch.allclose(whole_in[k], split_in[k], rtol=1e-12, atol=1e-12) for k in whole_in), "input grads"
assert all(torch.allclose(whole_w[k], split_w[k], rtol=1e-12, atol=1e-12) for k in whole_w), "weight grads"
assert all(float(v.abs().sum()) > 0 for v in split_w.values())
print(whole_flops, split_flops)
"""


@pytest.mark.parametrize("model", ["tiny-unet", "tiny-uvit", "tiny-dit"])
def test_split_backward_walks_each_layer_once(model: str) -> None:
    """B then W equal the whole backward in every gradient and cost its FLOPs, not more: W runs
    each layer from the gradient B kept at its output instead of walking the chunk again."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, "-c", SPLIT_PER_LAYER, model], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    whole, split = map(int, done.stdout.split())
    assert whole > 0 and split == whole


def test_weight_half_hands_out_no_gradient_twice() -> None:
    """W gives each parameter the gradient autograd made for it (no copy), except where that tensor is
    one B kept or another parameter already holds: an add's backward passes its gradient through, so
    ``p`` and ``q`` below would share one tensor and clipping would scale it twice."""
    import torch
    from pulse_torch.weight_grads import input_half, weight_half

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w, p, q = (torch.nn.Parameter(torch.randn(*shape)) for shape in ((8, 8), (4, 8), (4, 8)))
    out = x @ w + p + q
    g = torch.randn(4, 8)
    expected = [t.clone() for t in torch.autograd.grad(out, [w, p, q], g, retain_graph=True)]
    _, half = input_half([out], [g.clone()], [x], [w, p, q])
    assert half is not None
    weight_half(half)
    assert all(torch.equal(t.grad, e) for t, e in zip((w, p, q), expected))
    assert len({t.grad.untyped_storage().data_ptr() for t in (w, p, q)}) == 3
    p.grad.mul_(0.5)
    assert torch.equal(q.grad, expected[2]) and torch.equal(w.grad, expected[0])


def test_weight_half_copies_a_gradient_that_is_also_an_inputs() -> None:
    """``x + b``'s backward passes its gradient through to both: the tensor B returned as ``x``'s gradient
    (sent upstream, or handed to a chunk on the same rank) must not become ``b.grad``, which the next
    microbatch's W adds into in place."""
    import torch
    from pulse_torch.weight_grads import input_half, weight_half

    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    b = torch.nn.Parameter(torch.randn(4, 8))
    g = torch.randn(4, 8)
    (dx,), half = input_half([x + b], [g.clone()], [x], [b])
    assert half is not None
    weight_half(half)
    sent = dx.clone()
    b.grad.add_(1.0)  # the next microbatch's accumulation
    assert torch.equal(dx, sent) and torch.equal(b.grad, g + 1.0)
