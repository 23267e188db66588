"""`pulse profile` a window of layers at a time, and the activation bytes it counts.

* a diffusers model is built once as a skeleton (every parameter on the meta device); whenever a chunk
  is built, only one window's layers of it hold bytes, no other model is constructed, and every
  layer is back on the meta device afterwards;
* a zoo model's chunks are built a window at a time too, and freed before the next window's;
* the table has every layer of the spec, every column one entry per layer, every per-action kind;
* the measured ``act_mem`` is what autograd keeps: by hand for a linear and a convolution (the
  parameters and autocast's weight copies not counted, a storage once), exactly the saved input of
  tiny-unet's plain ``conv_in`` in fp32 and bf16, and within 3% of the spec's formula on every
  tiny-unet layer in fp32;
* the cold-start probe's windows pair their exchanges and read every kind; cost tables say whether
  ``act_mem`` was measured, and files without the flag still load.
"""
from __future__ import annotations

import argparse
import functools
import json
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pulse.costs import CostTable  # noqa: E402
from pulse.profiling.cold_start import cold_start_over  # noqa: E402
from pulse.profiling.job import cold_start_runs  # noqa: E402
from pulse.profiling.layers import layer_costs, saved_per_layer, windowed  # noqa: E402
from pulse.zoo.loading import load_model  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.diffusion import eps_loss  # noqa: E402
from pulse_torch.profile_layers import profile_layers  # noqa: E402
from pulse_torch.saved_bytes import counting, counting_chunks  # noqa: E402

torch.set_num_threads(1)
KINDS = {"F", "B", "Bi", "W", "O", "D"}


def job_args(model: str, precision: str = "fp32", options: tuple[str, ...] = ()) -> argparse.Namespace:
    return argparse.Namespace(model=model, model_option=list(options), repeats=1, warmup=0, microbatch_size=1,
                              pp=1, images=None, precision=precision)


def windowed_model(args: argparse.Namespace, spec):
    layers = profile_layers(args, "cpu")
    return windowed(spec, layers.backend_of, layers.real_layers, args.microbatch_size), layers


def check_table(columns: dict, spec) -> None:
    """The table as the whole-model profile wrote it: one entry per spec layer in every column."""
    n = spec.num_layers
    for key in ("fwd", "bwd", "bwd_input", "bwd_weight", "optimizer", "act_mem"):
        assert len(columns[key]) == n, key
    assert set(columns["per_action"]) == KINDS
    table = CostTable(spec.name, 1, tuple(l.name for l in spec.layers), columns["fwd"], columns["bwd"],
                      columns["act_mem"], "test", tuple(columns["bwd_input"]), tuple(columns["bwd_weight"]),
                      tuple(columns["optimizer"]), per_action=tuple(columns["per_action"].items()))
    table.check_matches(spec)
    assert all(f > 0 and b > 0 for f, b in zip(table.fwd, table.bwd)) and all(m > 0 for m in table.act_mem)


def test_zoo_chunks_are_built_and_freed_one_window_at_a_time(monkeypatch) -> None:
    spec = load_model("tiny-unet")
    model, _ = windowed_model(job_args("tiny-unet"), spec)
    windows = model.windows
    live: list = []  # weak references to every chunk built
    plain = TorchBackend.build_chunk

    def build_chunk(self, spec_, io):
        alive = [c() for c in live if c() is not None]  # freed when their run closed, not by a collection
        window = next(w for w in windows if w.start <= io.start and io.end <= w.end)
        assert all(window.start <= c.io.start and c.io.end <= window.end for c in alive), \
            "a chunk of another window is still alive"
        assert sum(c.io.end - c.io.start for c in alive) < window.size + 1  # one copy of the window at most
        chunk = plain(self, spec_, io)
        live.append(weakref.ref(chunk))
        return chunk
    monkeypatch.setattr(TorchBackend, "build_chunk", build_chunk)
    columns = layer_costs(job_args("tiny-unet"), model, eps_loss, count_saved=counting_chunks)
    check_table(columns, spec)
    assert len(live) > spec.num_layers  # the walk's, the one-layer runs' and the fit's chunks


def test_a_diffusers_profile_materializes_one_window_at_a_time(tmp_path: Path, monkeypatch) -> None:
    diffusers = pytest.importorskip("diffusers")
    from pulse_torch.diffusers_adapter.backend import DiffusersBackend
    from pulse_torch.diffusers_adapter.stage_loading import materialized_parameters
    from test_diffusers import UNET_TINY

    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**UNET_TINY).save_pretrained(tmp_path / "unet")  # weights read by key
    name = f"diffusers:{(tmp_path / 'unet').resolve()}"
    args = job_args(name, options=("context_len=8",))
    spec = load_model(name, {"context_len": 8})
    model, layers = windowed_model(args, spec)
    made: list[str] = []
    plain_init = diffusers.UNet2DConditionModel.__init__

    @functools.wraps(plain_init)  # diffusers reads the constructor's signature for the config
    def counted_init(self, *a, **k):
        made.append("model")
        plain_init(self, *a, **k)
    monkeypatch.setattr(diffusers.UNet2DConditionModel, "__init__", counted_init)
    biggest = max(sum(l.params for l in spec.layers[w.start:w.end]) for w in model.windows)
    seen: list[int] = []
    plain_build = DiffusersBackend.build_chunk

    def build_chunk(self, spec_, io):
        real = sum(p.numel() for p in materialized_parameters(self.adapter.model).values())
        window = next(w for w in model.windows if w.start <= io.start and io.end <= w.end)
        assert real == sum(l.params for l in spec.layers[window.start:window.end]) <= biggest
        seen.append(real)
        return plain_build(self, spec_, io)
    monkeypatch.setattr(DiffusersBackend, "build_chunk", build_chunk)
    columns = layer_costs(args, model, eps_loss, count_saved=counting_chunks)
    check_table(columns, spec)
    assert made == ["model"]  # the skeleton, and never a whole model besides
    assert seen and max(seen) == biggest < spec.total_params
    assert materialized_parameters(layers.real_layers.__self__.adapter.model) == {}  # every layer released


def by_hand(module, x: torch.Tensor, autocast: bool) -> int:
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.enable_grad()
    with context, counting(module.parameters()) as count:
        module(x)
    return count.bytes


def test_saved_bytes_by_hand() -> None:
    """A linear or a convolution keeps its input for the weight gradient, and its weight (not counted);
    under autocast the bf16 input copy (counted) and the bf16 weight copy (the memory model's)."""
    x = torch.randn(3, 8, requires_grad=True)
    assert by_hand(torch.nn.Linear(8, 4), x, False) == 3 * 8 * 4
    assert by_hand(torch.nn.Linear(8, 4), x, True) == 3 * 8 * 2
    image = torch.randn(2, 4, 5, 5, requires_grad=True)
    assert by_hand(torch.nn.Conv2d(4, 6, 3, padding=1), image, False) == image.numel() * 4
    assert by_hand(torch.nn.Conv2d(4, 6, 3, padding=1), image, True) == image.numel() * 2

    class TwoViews(torch.nn.Module):  # one storage saved twice (mul keeps both operands): counted once
        def forward(self, t):
            return t.view(-1) * t.view(-1)
    assert by_hand(TwoViews(), x, False) == 3 * 8 * 4


@pytest.mark.parametrize("precision,element", [("fp32", 4), ("bf16", 2)])
def test_measured_act_mem_is_what_autograd_keeps(precision: str, element: int) -> None:
    spec = load_model("tiny-unet")
    args = job_args("tiny-unet", precision)
    args.microbatch_size = 2
    model, _ = windowed_model(args, spec)
    window = next(w for w in model.windows if w.start <= spec.index("conv_in") < w.end)
    saved = model.each_window(lambda w: saved_per_layer(model.run(w, eps_loss, split=False), counting_chunks),
                              [window])[0]
    conv_in = spec.layers[spec.index("conv_in")]
    # conv_in is one convolution: it keeps its input, 4 x 16 x 16 latents per sample (in bf16, autocast's copy)
    assert saved[spec.index("conv_in") - window.start] == 2 * conv_in.attrs["in_channels"] * 16 * 16 * element
    if precision == "fp32":  # the zoo's formula, at fp32's 4 bytes: every layer within 3%
        columns = layer_costs(args, model, eps_loss, count_saved=counting_chunks)
        formula = [l.saved_bytes * 2 for l in spec.with_act_bytes(4).layers]
        assert all(abs(m - f) <= 0.03 * f for m, f in zip(columns["act_mem"], formula)), \
            list(zip(columns["act_mem"], formula))


def test_the_cold_start_windows_read_every_kind() -> None:
    spec = load_model("tiny-unet")
    model, _ = windowed_model(job_args("tiny-unet"), spec)
    exchanges = []
    cold = cold_start_over(cold_start_runs(model, eps_loss, 1), lambda: exchanges.append(1), steps=1, warmup=0)
    assert set(cold) == {"F", "B", "Bi", "W"} and all(t >= 0 for t in cold.values())
    assert exchanges  # before every compute action, stand-ins' too: both partners' windows alike


def test_a_cost_table_says_whether_act_mem_was_measured(tmp_path: Path) -> None:
    table = CostTable("m", 1, ("a", "b"), (1.0, 1.0), (2.0, 2.0), (10, 20), "test", act_mem_measured=True)
    table.save(tmp_path / "costs.json")
    assert json.loads((tmp_path / "costs.json").read_text())["act_mem_measured"] is True
    assert CostTable.load(tmp_path / "costs.json") == table
    old = {k: v for k, v in table.to_dict().items() if k != "act_mem_measured"}  # a table written before the flag
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert CostTable.load(tmp_path / "old.json").act_mem_measured is False
    (tmp_path / "bad.json").write_text(json.dumps({**old, "act_mem_measured": "yes"}))
    with pytest.raises(Exception, match="act_mem_measured"):
        CostTable.load(tmp_path / "bad.json")
