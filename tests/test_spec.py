import pytest

from pulse.errors import PulseError, SpecError
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.spec_io import load_spec, save_spec, spec_from_dict, spec_to_dict


def layer(name, params=10, flops=100.0, out=8, saved=16, **attrs):
    return Layer(name, "block", params, flops, out, saved, attrs)


def small_spec(skips=(("a", "e", 4), ("b", "d", 2))):
    return ModelSpec("m", [layer(n) for n in "abcde"], [SkipEdge(*s) for s in skips],
                     [SharedInput("temb", 3, "a"), SharedInput("context", 5)])


def test_totals_and_lookup():
    spec = small_spec()
    assert spec.total_params == 50 and spec.total_flops == 500.0
    assert spec.index("c") == 2
    assert [(s, t) for s, t, _ in spec.skip_spans()] == [(0, 4), (1, 3)]
    assert spec.crossing_pairs() == []


def test_crossing_edges_are_allowed_and_reported():
    spec = small_spec(skips=(("a", "c", 1), ("b", "d", 1)))
    assert [(a.key, b.key) for a, b in spec.crossing_pairs()] == [("a->c", "b->d")]


@pytest.mark.parametrize("skips, message", [
    ((("a", "zz", 1),), "unknown layer 'zz'"),
    ((("d", "b", 1),), "points backwards"),
    ((("a", "a", 1),), "points backwards"),
    ((("a", "b", -1),), "negative bytes"),
    ((("a", "b", 1), ("a", "b", 1)), "listed twice"),
])
def test_bad_edges_are_rejected(skips, message):
    with pytest.raises(SpecError, match=message):
        small_spec(skips)


def test_duplicate_names_and_negative_sizes_are_rejected():
    with pytest.raises(SpecError, match="duplicate layer name 'a'"):
        ModelSpec("m", [layer("a"), layer("a")])
    with pytest.raises(SpecError, match="negative flops"):
        ModelSpec("m", [layer("a", flops=-1.0)])
    with pytest.raises(SpecError, match="unknown producer"):
        ModelSpec("m", [layer("a")], shared_inputs=[SharedInput("t", 1, "nope")])


def test_rescaling_activation_precision():
    spec = small_spec()
    fp32 = spec.with_act_bytes(4)
    assert fp32.layers[0].out_bytes == 16 and fp32.skips[1].bytes == 4
    assert fp32.shared_inputs[0].bytes == 6 and fp32.act_bytes == 4
    assert fp32.layers[0].params == spec.layers[0].params
    assert fp32.with_act_bytes(2) == spec


def test_yaml_round_trip(tmp_path):
    spec = small_spec()
    path = tmp_path / "m.yaml"
    save_spec(spec, path)
    loaded = load_spec(path)
    assert loaded == spec
    assert loaded.layers[0].attrs == {} and loaded.shared_inputs[1].producer is None


def test_yaml_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: m\nlayers: [ {name: a\n")
    with pytest.raises(PulseError, match=r"bad.yaml: malformed YAML at line"):
        load_spec(bad)
    data = spec_to_dict(small_spec())
    data["layers"][1]["colour"] = "red"
    with pytest.raises(PulseError, match=r"layers\[1\]: unknown key 'colour'"):
        spec_from_dict(data)
    data = spec_to_dict(small_spec())
    del data["layers"][0]["params"]
    with pytest.raises(PulseError, match=r"layers\[0\]: missing key 'params'"):
        spec_from_dict(data)
    data = spec_to_dict(small_spec())
    data["skips"][0]["dst"] = "nowhere"
    with pytest.raises(SpecError, match="unknown layer 'nowhere'"):
        spec_from_dict(data)
