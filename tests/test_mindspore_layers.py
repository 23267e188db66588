"""The MindSpore layer cells: parameter counts and names, seeding, weight exchange, and parity with PyTorch.

Parity runs on fixtures the torch side wrote (``tests/fixtures/
mindspore_parity_<model>.npz``: float16-rounded weights, one batch of two
samples, the float64 torch output and a digest of its parameter gradients;
regenerate with ``/work/venv/bin/python tests/
mindspore_parity_export.py``), so this file needs MindSpore only and is skipped
without it. MindSpore computes in float32 (its CPU Conv2D has no float64).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

try:
    import pulse_mindspore  # noqa: F401
except ImportError:  # the package is not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

from pulse.errors import SpecError  # noqa: E402
from pulse.zoo import ZOO_NAMES, get_spec  # noqa: E402
from pulse_mindspore.layers import build_layer, make_inputs  # noqa: E402
from pulse_mindspore.model import build_model, layer_rng, to_tensor  # noqa: E402
from mindspore_parity_export import DEFAULT_OUT, MODELS, fixture_path, gradient_errors, zero_gradients  # noqa: E402
from pulse_mindspore.weights import export_weights, import_weights, load_state, reference_parameters  # noqa: E402

TINY = ("tiny-unet", "tiny-uvit", "tiny-dit")
# sdxl-unet's time_embed reads SDXL's added inputs: built over diffusers' model only (tests/test_sdxl.py).
NATIVE = tuple(n for n in ZOO_NAMES if n != "sdxl-unet")
FULL = tuple(n for n in NATIVE if n not in TINY)
PARITY = 1e-4  # relative, float32 MindSpore against float64 torch


def _fixture(model: str) -> dict[str, np.ndarray]:
    with np.load(fixture_path(DEFAULT_OUT, model)) as data:
        return {k: data[k] for k in data.files}


def _prefixed(fixture: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in fixture.items() if k.startswith(prefix)}


# -- parameter counts and names --------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_every_tiny_layer_has_its_spec_parameter_count(name):
    spec = get_spec(name)
    assert build_model(spec, seed=0).layer_params() == {layer.name: layer.params for layer in spec.layers}


@pytest.mark.parametrize("name", FULL)
def test_full_models_count_their_spec_parameters_without_memory(name):
    """lazy=True: MindSpore's deferred zero initializer, no values drawn (1.5 B parameters in ~2 s)."""
    spec = get_spec(name)
    model = build_model(spec, lazy=True)
    assert model.layer_params() == {layer.name: layer.params for layer in spec.layers}
    assert sum(model.layer_params().values()) == spec.total_params


@pytest.mark.parametrize("name", ["tiny-uvit", "tiny-dit"])
def test_fused_blocks_have_the_split_blocks_parameters(name):
    split, fused = get_spec(name), get_spec(name, split_blocks=False)
    keys = {k: tuple(p.shape) for k, p in reference_parameters(split, build_model(split, lazy=True).layers).items()}
    fused_keys = {k: tuple(p.shape)
                  for k, p in reference_parameters(fused, build_model(fused, lazy=True).layers).items()}
    assert keys == fused_keys


@pytest.mark.parametrize("name", MODELS)
def test_parameter_names_and_shapes_are_the_torch_ones(name):
    """The torch side's exported keys (reference checkpoint names) are exactly ours, shape for shape."""
    spec = get_spec(name)
    torch_weights = _prefixed(_fixture(name), "weight/")
    mine = reference_parameters(spec, build_model(spec, lazy=True).layers)
    assert {k: tuple(p.shape) for k, p in mine.items()} == {k: v.shape for k, v in torch_weights.items()}


# -- seeding, interface, weight files ----------------------------------------------------------------
def test_a_layer_built_alone_has_the_models_weights():
    spec = get_spec("tiny-dit")
    model = build_model(spec, seed=3)
    layer = spec.layers[spec.index("block5_attn")]
    alone = build_layer(layer, rng=layer_rng(3, layer.name))
    theirs = dict(model.layers["block5_attn"].parameters_and_names())
    assert all(np.array_equal(p.asnumpy(), theirs[n].asnumpy()) for n, p in alone.parameters_and_names())
    other = build_model(spec, seed=4).layers["block5_attn"]
    assert not np.array_equal(other.skip_linear.weight.asnumpy(), alone.skip_linear.weight.asnumpy())


def test_wrong_number_of_skips_is_a_spec_error():
    spec = get_spec("tiny-unet")
    cell = build_layer(spec.layers[spec.index("up0_res0")], rng=np.random.default_rng(0))
    h = to_tensor(np.zeros((1, 64, 8, 8), np.float32))
    with pytest.raises(SpecError, match="expects 1 skip"):
        cell(h, {"temb": to_tensor(np.zeros((1, 128), np.float32))}, [])


def test_weights_round_trip_through_npz(tmp_path):
    spec = get_spec("tiny-uvit")
    src, dst = build_model(spec, seed=0), build_model(spec, seed=1)
    export_weights(spec, src.layers, tmp_path / "w.npz")
    loaded = import_weights(spec, dst.layers, tmp_path / "w.npz")
    assert len(loaded) == len(list(src.get_parameters()))
    x, shared = make_inputs(spec, 1, np.random.default_rng(0))
    a = src.forward_reference({"h": x, **shared}).asnumpy()
    assert np.array_equal(a, dst.forward_reference({"h": x, **shared}).asnumpy())
    # a chunk loads its share of a whole-model file; strict loading names what is missing
    part = {n: dst.layers[n] for n in ("final",)}
    assert import_weights(spec, part, tmp_path / "w.npz") == ["norm.weight", "norm.bias", "decoder_pred.weight",
                                                               "decoder_pred.bias", "final_layer.weight",
                                                               "final_layer.bias"]
    with pytest.raises(SpecError, match="lack"):
        load_state(spec, dst.layers, {"pos_embed": np.zeros((1, 18, 64), np.float32)})


def test_split_and_fused_blocks_compute_the_same(tmp_path):
    split, fused = get_spec("tiny-dit"), get_spec("tiny-dit", split_blocks=False)
    a, b = build_model(split, seed=0), build_model(fused, seed=5)
    export_weights(split, a.layers, tmp_path / "w.npz")
    import_weights(fused, b.layers, tmp_path / "w.npz")
    x, shared = make_inputs(split, 1, np.random.default_rng(1))
    ya, yb = a.forward_reference({"h": x, **shared}).asnumpy(), b.forward_reference({"h": x, **shared}).asnumpy()
    assert np.allclose(ya, yb, rtol=0, atol=1e-6 * np.abs(ya).max())


@pytest.mark.parametrize("options", [{"split_resnets": True}, {"split_transformers": True},
                                     {"split_resnets": ("down1_res0", "up1_res1"), "split_transformers": ("mid_attn",)}])
def test_split_and_whole_unet_blocks_compute_the_same(tmp_path, options):
    """``split_resnets``: each ResnetBlock2D as two cells; ``split_transformers``: each transformer block's
    halves as two; or only the blocks named (a fitted plan's); the same checkpoint names and the same output."""
    split, whole = get_spec("tiny-unet", **options), get_spec("tiny-unet")
    a, b = build_model(split, seed=0), build_model(whole, seed=5)
    assert a.layer_params() == {layer.name: layer.params for layer in split.layers}
    export_weights(split, a.layers, tmp_path / "w.npz")
    assert len(import_weights(whole, b.layers, tmp_path / "w.npz")) == len(list(b.get_parameters()))
    x, shared = make_inputs(split, 1, np.random.default_rng(1))
    ya, yb = a.forward_reference({"h": x, **shared}).asnumpy(), b.forward_reference({"h": x, **shared}).asnumpy()
    assert np.allclose(ya, yb, rtol=0, atol=1e-6 * np.abs(ya).max())


# -- parity with PyTorch -----------------------------------------------------------------------------------
def _run_fixture(name: str) -> tuple[dict, np.ndarray, float, dict[str, np.ndarray]]:
    """Load the torch weights, run the fixture's batch: (fixture, output, loss, gradients by reference key)."""
    fixture, spec = _fixture(name), get_spec(name)
    model = build_model(spec, seed=1)  # other weights first: the file must overwrite every one
    load_state(spec, model.layers, _prefixed(fixture, "weight/"))
    inputs = {k: to_tensor(v) for k, v in _prefixed(fixture, "input/").items()}
    shared = {k: v for k, v in inputs.items() if k != "h"}
    params = reference_parameters(spec, model.layers)
    out, vjp_fn = ms.vjp(lambda h: model(h, shared), inputs["h"], weights=list(params.values()))
    target = to_tensor(fixture["target"])
    channels = target.shape[1]  # a learned-variance output (DiT): the MSE reads its first half, as eps_loss does
    diff = out[:, :channels] - target
    loss = float((diff * diff).mean().asnumpy())
    grad = diff * (2.0 / diff.size)
    if out.shape[1] > channels:
        grad = ms.ops.cat([grad, ms.ops.zeros_like(out[:, channels:])], axis=1)
    _, grads = vjp_fn(grad)
    return fixture, out.asnumpy(), loss, {k: g.asnumpy() for k, g in zip(params, grads)}


@pytest.mark.parametrize("name", MODELS)
def test_output_and_gradients_match_pytorch(name):
    fixture, out, loss, grads = _run_fixture(name)
    ref = fixture["output"]
    assert np.abs(out - ref).max() / np.abs(ref).max() < PARITY
    assert loss == pytest.approx(float(fixture["loss"]), rel=PARITY)
    errors = gradient_errors(fixture, grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] < PARITY, f"{name}: gradient of {worst} differs by {errors[worst]:.2e} (relative)"
    # gradients that are zero in exact arithmetic hold float32 rounding only
    scale = max(np.abs(g).max() for g in grads.values())
    for key in zero_gradients(fixture, list(grads)):
        assert np.abs(grads[key]).max() < 1e-7 * scale, key
