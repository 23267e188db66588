"""The framework-free layer and chunk layout both backends share (pulse/layers/chunk_layout.py,
layer_contract.py, split_blocks.py, layer_recipes.py; data draws in pulse/zoo/shapes.py).

Run with plain Python objects as layers and numbers as tensors, so what the
backends inherit is checked without a framework; the last tests compare the
two backends' tables where they are installed.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from pulse.errors import SpecError
from pulse.placement import Chunk, Placement
from pulse.layers.chunk_layout import (MAIN, SkipWiring, chunk_output_names, layer_seed, param_name,
                                        reference_key, run_chunk, run_model)
from pulse.layers.layer_contract import VARIANT_CHECKS, LayerContract, build_checked, need
from pulse.layers.split_blocks import MlpHalf, split_block_classes
from pulse.runtime.wiring import chunk_ios
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.zoo import get_spec
from pulse.zoo.shapes import INTEGERS, NORMAL, PREFIX_MASK, ROWS, ZEROS, data_draws

BACKENDS = Path(__file__).resolve().parents[1] / "backends"


class Recorder:
    """A layer over numbers: h + offset, remembering the skips and shared names it was given."""

    def __init__(self, offset: int, makes: dict[str, int] | None = None) -> None:
        self.offset, self.makes, self.calls = offset, makes or {}, []

    def __call__(self, h, shared, skips):
        self.calls.append((h, sorted(shared), list(skips)))
        return h + self.offset + sum(skips), dict(self.makes)


def _spec() -> ModelSpec:
    """a ─ b ─ c ─ d; skips a→d and b→c; a makes "temb"; "timesteps" is data."""
    layers = [Layer(n, "toy", 0, 0.0, 4, 4) for n in "abcd"]
    return ModelSpec("toy", layers, skips=(SkipEdge("a", "d", 4), SkipEdge("b", "c", 4)),
                     shared_inputs=(SharedInput("timesteps", 8), SharedInput("temb", 8, producer="a")))


def _layers() -> dict[str, Recorder]:
    return {"a": Recorder(1, {"temb": 7}), "b": Recorder(10), "c": Recorder(100), "d": Recorder(1000)}


def test_model_walk_hands_each_layer_its_skips_and_the_made_shared_inputs():
    spec, layers = _spec(), _layers()
    out = run_model(layers, SkipWiring.of(spec, layers), 0, {"timesteps": 3})
    # a: 1; b: 11; c: 11 + 100 + skip b (11) = 122; d: 122 + 1000 + skip a (1) = 1123
    assert out == 1123
    assert layers["a"].calls == [(0, ["timesteps"], [])]
    assert layers["c"].calls == [(11, ["temb", "timesteps"], [11])]
    assert layers["d"].calls == [(122, ["temb", "timesteps"], [1])]


def test_skip_tensors_are_dropped_once_read():
    spec, layers = _spec(), _layers()
    skips: dict[str, int] = {}
    from pulse.layers.chunk_layout import walk_layers

    walk_layers({n: layers[n] for n in "abc"}, SkipWiring.of(spec, "abc"), 0, {}, skips)
    assert skips == {"a->d": 1}  # b→c was read by c; a→d still waits for d


def test_chunks_return_what_later_chunks_read_and_equal_the_whole_model():
    spec = _spec()
    ios = chunk_ios(spec, Placement("sequential", 2, (Chunk(0, 2, 0), Chunk(2, 4, 1))))
    first_layers, second_layers = _layers(), _layers()
    first = run_chunk({n: first_layers[n] for n in "ab"}, SkipWiring.of(spec, "ab"), ios[0],
                      {MAIN: 0, "timesteps": 3})
    assert tuple(first) == chunk_output_names(ios[0]) == (MAIN, "a->d", "b->c", "temb")
    assert first == {MAIN: 11, "a->d": 1, "b->c": 11, "temb": 7}
    second = run_chunk({n: second_layers[n] for n in "cd"}, SkipWiring.of(spec, "cd"), ios[1],
                       {**first, "timesteps": 3})
    assert second == {MAIN: run_model(_layers(), SkipWiring.of(spec, "abcd"), 0, {"timesteps": 3})}
    assert second_layers["c"].calls[0][1] == ["temb", "timesteps"]


def test_names_and_seeds_are_the_same_for_every_backend():
    assert param_name("down0_res1", "norm1.weight") == "down0_res1.norm1.weight"
    one = Layer("x", "resnet", 0, 0.0, 0, 0, {"ref_module": "down_blocks.0.resnets.1"})
    two = Layer("y", "conv_out", 0, 0.0, 0, 0, {"ref_module": "conv_norm_out,conv_out"})
    assert reference_key(one, "conv1.weight") == "down_blocks.0.resnets.1.conv1.weight"
    assert reference_key(two, "conv_out.bias") == "conv_out.bias"
    assert layer_seed(0, "a") == layer_seed(0, "a") != layer_seed(0, "b") != layer_seed(1, "a")
    assert 0 <= layer_seed(7, "a") < 2 ** 63


class ToyLayer(LayerContract):
    def __init__(self) -> None:
        self.built: list[str] = []


class AttnHalf:
    """Adds 1 per skip and 10."""

    def build(self, layer, attrs, tag):
        layer.built.append(f"attn:{tag}")
        layer.num_skips = 1 if attrs["skip"] else 0

    def run(self, layer, h, shared, skips):
        return h + 10 + sum(skips)


class ToyMlpHalf(MlpHalf):
    def build(self, layer, attrs, tag):
        layer.built.append(f"mlp:{tag}")
        layer.norm2 = lambda x: 2 * x
        layer.mlp = lambda x: x + 1


def test_split_blocks_make_three_kinds_from_two_halves():
    finished = []
    kinds = split_block_classes("toy_block", "Toy", ToyLayer, AttnHalf(), ToyMlpHalf(), "forward",
                                finish=lambda layer: finished.append(list(layer.built)))
    assert sorted(kinds) == ["toy_block", "toy_block_attn", "toy_block_mlp"]
    assert [kinds[k].__name__ for k in ("toy_block_attn", "toy_block_mlp", "toy_block")] == [
        "ToyBlockAttn", "ToyBlockMlp", "ToyBlock"]
    whole = kinds["toy_block"]({"skip": True}, "t")
    assert finished == [["attn:t", "mlp:t"]]  # once, after both halves
    assert whole.kind == "toy_block" and whole.num_skips == 1
    # attention: 1 + 10 + 5 = 16; MLP: 16 + (2 * 16 + 1) = 49
    assert whole.forward(1, {}, [5]) == (49, {})
    mlp = kinds["toy_block_mlp"]({"skip": True}, "t")
    assert mlp.num_skips == 0 and mlp.forward(1, {}, []) == (4, {})
    with pytest.raises(SpecError, match="expects 1 skip"):
        whole.forward(1, {}, [])


def test_build_checked_names_the_problem():
    table = {"toy": lambda attrs, extra: (attrs["size"], extra)}
    assert build_checked(table, Layer("l", "toy", 0, 0.0, 0, 0, {"size": 3}), "x", backend="b", unit="u") == (3, "x")
    with pytest.raises(SpecError, match="the b backend has no u for kind 'mystery'"):
        build_checked(table, Layer("l", "mystery", 0, 0.0, 0, 0), "x", backend="b", unit="u")
    with pytest.raises(SpecError, match="lacks attribute 'size'"):
        build_checked(table, Layer("l", "toy", 0, 0.0, 0, 0), "x", backend="b", unit="u")
    with pytest.raises(SpecError, match="reads shared input 'c'.*have: temb"):
        need({"temb": 1}, "c", "hdit_final")


@pytest.mark.parametrize("kind, attrs, message", [
    ("transformer2d", {"linear_projection": True, "qkv_bias": True, "activation": "geglu"}, "bias-free"),
    ("uvit_embed", {"time_embed": "mlp"}, "mlp_time_embed"),
    ("hdit_block_attn", {"qk_norm": False, "norm": "layer", "rope": "2d"}, "qk-norm"),
    ("hdit_block", {"qk_norm": True, "norm": "layer", "rope": "2d", "activation": "relu"}, "relu"),
    ("uvit_block_mlp", {"activation": "swiglu"}, "swiglu"),
])
def test_variants_no_backend_implements_are_refused_before_building(kind, attrs, message):
    built = []
    table = {kind: lambda a: built.append(a)}
    assert kind in VARIANT_CHECKS
    with pytest.raises(NotImplementedError, match=message):
        build_checked(table, Layer("l", kind, 0, 0.0, 0, 0, attrs), backend="b", unit="u")
    assert built == []


def test_data_draws_follow_the_spec():
    draws = {d.name: d for d in data_draws(get_spec("tiny-dit"), 3)}
    assert {n: d.law for n, d in draws.items()} == {
        "timesteps": INTEGERS, "text_clip": NORMAL, "text_t5": NORMAL, "text_clip_mask": PREFIX_MASK,
        "text_t5_mask": PREFIX_MASK, "image_meta_size": ROWS, "style": ZEROS}
    assert draws["timesteps"].shape == (3,) and draws["timesteps"].high == 1000
    assert draws["text_t5_mask"].shape[0] == 3 and draws["image_meta_size"].shape == (3, 6)
    assert [d.name for d in data_draws(get_spec("tiny-unet"), 2)] == ["timesteps", "context"]
    spec = _spec()
    with pytest.raises(SpecError, match="no maker for data input 'weather'"):
        data_draws(ModelSpec("odd", spec.layers, shared_inputs=(SharedInput("weather", 4),)), 1)


def _package_imports(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports anywhere (functions included)."""
    prefix = f"pulse_torch.{package.name}."
    graph = {}
    for path in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
                names.add(node.module[len(prefix):])
        graph[path.stem] = names
    return graph


def test_the_diffusers_adapter_imports_in_one_direction():
    graph = _package_imports(BACKENDS / "pulse_torch" / "diffusers_adapter")
    assert "backend" in graph["adapter"] and "adapter" not in graph["backend"]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for dep in graph.get(module, ()):
                visit(dep, path + (module,))
            done.add(module)

    for module in graph:
        visit(module, ())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("mindspore") is None,
                    reason="compares the torch and MindSpore backends")
def test_both_backends_build_every_kind_the_zoo_makes():
    from pulse_mindspore.layers import LAYER_TYPES as CELLS
    from pulse_torch.layers import LAYER_TYPES as MODULES

    split_options = {"tiny-unet": ("split_resnets", "split_transformers"), "tiny-uvit": ("split_blocks",),
                     "tiny-dit": ("split_blocks",)}
    zoo_kinds = {layer.kind for name, options in split_options.items() for option in options
                 for split in (True, False) for layer in get_spec(name, **{option: split}).layers}
    assert set(MODULES) == set(CELLS) == zoo_kinds
    for kind in MODULES:
        assert MODULES[kind].kind == CELLS[kind].kind == kind
        assert MODULES[kind].__name__ == CELLS[kind].__name__
