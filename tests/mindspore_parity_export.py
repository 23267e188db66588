"""Fixtures of the MindSpore-vs-PyTorch parity test, written from the torch side.

Run where torch is installed (not MindSpore)::

    /work/venv/bin/python tests/mindspore_parity_export.py [--out tests/fixtures]

For each tiny zoo model it builds ``pulse_torch.model.build_model(spec,
seed=0)``, rounds every weight to float16 (so the file is small and both sides
use exactly the stored values), runs one batch of 2 samples (training's
synthetic feed, ``tests/check_batches.py``) in float64 and writes
``<out>/mindspore_parity_<model>.npz``::

    weight/<reference key>   the weights (float16), keyed as in the reference checkpoint
    input/<name>             "h" (the noised latent) and the data shared inputs
    target, output, loss     the noise target, the torch output, the MSE (over the target's
                             channels: a learned-variance output's first half, as eps_loss)
    grad/<key>               d loss / d weight, whole, for tensors of <= FULL_MAX entries
    gsample/<key>, gproj/<key>, gmax/<key>, gnorm/<key>
                             for larger ones: SAMPLES evenly spread entries, PROJECTIONS
                             projections on seeded +-1 vectors, max |g| and ||g||

``tests/test_mindspore_layers.py`` loads these with MindSpore only. The
helpers at the top (numpy only) define the gradient digest both sides compute.
"""
from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import Mapping

import numpy as np

MODELS = ("tiny-unet", "tiny-uvit", "tiny-dit")
SEED = 0
BATCH = 2
FULL_MAX = 1024  # gradients up to this many entries are stored whole
SAMPLES = 512  # entries kept of a larger gradient
PROJECTIONS = 2  # random +-1 projections of a larger gradient (they see every entry)
ZERO = 1e-12  # a reference gradient this small (relative to the largest) is zero in exact arithmetic
DEFAULT_OUT = Path(__file__).resolve().parent / "fixtures"


def fixture_path(out: Path, model: str) -> Path:
    return Path(out) / f"mindspore_parity_{model}.npz"


def sample_index(n: int) -> np.ndarray:
    """SAMPLES flat indices spread evenly over n entries (first and last included)."""
    return np.unique(np.linspace(0, n - 1, SAMPLES).round().astype(np.int64))


def projection_vectors(key: str, n: int) -> np.ndarray:
    """(PROJECTIONS, n) +-1 vectors seeded by the parameter's name."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return rng.choice(np.array([-1.0, 1.0]), size=(PROJECTIONS, n))


def digest(key: str, grad: np.ndarray) -> dict[str, np.ndarray]:
    """The npz entries recording one gradient (see the module doc)."""
    g = np.asarray(grad, dtype=np.float64)
    if g.size <= FULL_MAX:
        return {f"grad/{key}": g.astype(np.float32)}
    flat = g.reshape(-1)
    return {f"gsample/{key}": flat[sample_index(flat.size)].astype(np.float32),
            f"gproj/{key}": projection_vectors(key, flat.size) @ flat,
            f"gmax/{key}": np.array(np.abs(flat).max()), f"gnorm/{key}": np.array(np.linalg.norm(flat))}


def _ref_max(fixture: Mapping[str, np.ndarray], key: str) -> float:
    return float(np.abs(fixture[f"grad/{key}"]).max()) if f"grad/{key}" in fixture else float(fixture[f"gmax/{key}"])


def zero_gradients(fixture: Mapping[str, np.ndarray], keys: list[str]) -> list[str]:
    """Parameters whose reference gradient is zero in exact arithmetic (below ZERO x the largest one).

    A bias added to every key before a softmax over keys (Hunyuan's
    cross-attention ``k_norm.bias``, the pooler's ``k_proj.bias``) shifts all
    scores of a query equally: its float64 gradient is ~1e-18 of the largest,
    pure rounding, and a float32 run's rounding ~1e-9; no relative error is
    meaningful there (the test bounds its size instead).
    """
    scale = max(_ref_max(fixture, k) for k in keys)
    return [k for k in keys if _ref_max(fixture, k) < ZERO * scale]


def gradient_errors(fixture: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
                    floor: float = 1e-6) -> dict[str, float]:
    """Per parameter (the zero-gradient ones left out): the largest relative error against the digest.

    Entries (whole or sampled): max |got - ref| / max |ref|; projections:
    |got . r - ref . r| / ||ref||. Denominators are floored at ``floor`` x
    the largest reference gradient entry.
    """
    refmax = {k: _ref_max(fixture, k) for k in grads}
    scale = max(refmax.values()) * floor
    zero = set(zero_gradients(fixture, list(grads)))
    errors = {}
    for key, got in grads.items():
        if key in zero:
            continue
        flat = np.asarray(got, dtype=np.float64).reshape(-1)
        if f"grad/{key}" in fixture:
            errors[key] = float(np.abs(flat - fixture[f"grad/{key}"].reshape(-1)).max()) / max(refmax[key], scale)
            continue
        sampled = np.abs(flat[sample_index(flat.size)] - fixture[f"gsample/{key}"]).max() / max(refmax[key], scale)
        proj = projection_vectors(key, flat.size) @ flat
        projected = np.abs(proj - fixture[f"gproj/{key}"]).max() / max(float(fixture[f"gnorm/{key}"]), scale)
        errors[key] = float(max(sampled, projected))
    return errors


def export(model: str, out: Path) -> Path:
    """Write one model's fixture (torch imported here: the helpers above must import without it)."""
    import torch

    from pulse.zoo import get_spec
    from pulse_torch.layers import reference_key
    from pulse_torch.model import build_model
    from torch_worker_check import make_batches  # beside this file

    spec = get_spec(model)
    net = build_model(spec, seed=SEED)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.half().float())  # the stored float16 values, exactly
    net = net.double()
    batch = make_batches(spec, BATCH, seed=SEED)(0)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.items() if k != "target"}
    output = net.forward_reference(inputs)
    target = batch["target"].double()
    loss = ((output[:, : target.shape[1]] - target) ** 2).mean()
    loss.backward()
    entries: dict[str, np.ndarray] = {"target": batch["target"].numpy(), "output": output.detach().float().numpy(),
                                      "loss": np.array(loss.item())}
    entries.update({f"input/{k}": v.numpy() for k, v in batch.items() if k != "target"})
    for lname, module in net.layers.items():
        layer = spec.layers[spec.index(lname)]
        for pname, p in module.named_parameters():
            key = reference_key(layer, pname)
            entries[f"weight/{key}"] = p.detach().numpy().astype(np.float16)
            entries.update(digest(key, p.grad.numpy()))
    path = fixture_path(out, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **entries)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of the .npz files")
    parser.add_argument("--model", action="append", choices=MODELS, help="default: every tiny model")
    args = parser.parse_args(argv)
    for model in args.model or MODELS:
        path = export(model, args.out)
        print(f"{path}  {path.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
