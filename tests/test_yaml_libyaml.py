"""LibYAML reads and writes PULSE's YAML as the pure parser does (``pulse.yamlio``).

Every read takes LibYAML's parser when PyYAML has it; a text it refuses is read again by the pure
parser, whose verdict stands. So a text either parser accepts loads to one value, a refusal is the
pure parser's line, and the one difference allowed is LibYAML reading valid YAML the pure parser
refused (a tab or a '? ' inside a flow collection). Dumps read back as the data under both, and
PULSE's own files dump to the same text as under the pure emitter.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pulse.yamlio as yamlio
from pulse.cli.main import main
from pulse.errors import PulseError

REPO = Path(__file__).resolve().parent.parent
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck), max_examples=150)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)
FINITE = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)

pytestmark = pytest.mark.skipif(yamlio.SAFE_LOADER is yaml.SafeLoader,
                                reason="this PyYAML was built without LibYAML: only the pure parser runs")


def outcome(path: Path, loader: type, monkeypatch) -> tuple:
    monkeypatch.setattr(yamlio, "SAFE_LOADER", loader)
    try:
        return "loaded", yamlio.load_mapping(path)
    except PulseError as exc:
        return "refused", str(exc)


def same_under_both(path: Path, monkeypatch) -> tuple:
    """LibYAML's outcome, checked against the pure parser's: one value when the pure parser reads the
    text, the pure parser's line when LibYAML refuses it."""
    fast, pure = outcome(path, yaml.CSafeLoader, monkeypatch), outcome(path, yaml.SafeLoader, monkeypatch)
    text = path.read_text(errors="replace")[:300]
    if pure[0] == "loaded" or fast[0] == "refused":
        assert fast == pure, text
    else:
        assert fast[0] == "loaded" and pure[0] == "refused", text
    return fast


def test_every_shipped_and_written_file_loads_and_dumps_as_under_the_pure_parser(tmp_path, monkeypatch):
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--plan-only", "--out-dir", str(tmp_path / "run")]) == 0
    files = [*REPO.glob("configs/**/*.yaml"), *REPO.glob("benchmarks/results/**/*.yaml"),
             *(tmp_path / "run").glob("*.yaml")]
    assert len(files) > 20 and {"plan.yaml", "run.yaml"} <= {f.name for f in files}
    for f in files:
        verdict, data = same_under_both(f, monkeypatch)
        assert verdict == "loaded" and yamlio.dump_yaml(data) == yaml.safe_dump(
            data, sort_keys=False, default_flow_style=None, width=100), f


HOSTILE = {
    "tab indent": "a:\n\t- 1\n", "control character": "a: b\x07c\n", "unclosed flow": "not: [a plan\n",
    "byte order mark inside": "a: 1\n\ufeffb: 2\n", "lone surrogate escape": 'a: "\\ud800"\n',
    "undefined alias": "a: *nope\n", "two documents": "a: 1\n---\nb: 2\n", "Python tag": "a: !!python/object:os.system x\n",
    "repeated key": "a: 1\nb:\n  c: 1\n  c: 2\n", "flow nested 1,200 deep": "a: " + "[" * 1200 + "]" * 1200 + "\n",
    "block nested 1,500 deep": "".join("  " * i + f"k{i}:\n" for i in range(1500)) + "  " * 1500 + "v: 1\n",
    "5,000 digits": "a: " + "9" * 5000 + "\n", "merge key": "base: &b {x: 1}\nd:\n  <<: *b\n  y: 2\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_texts_get_the_pure_parsers_verdict_and_line(name, tmp_path, monkeypatch):
    path = tmp_path / "f.yaml"
    path.write_text(HOSTILE[name])
    verdict, value = same_under_both(path, monkeypatch)
    if verdict == "refused":
        assert len(value.splitlines()) == 1 and str(path) in value


@FUZZ
@given(data=st.dictionaries(st.text(max_size=8), VALUES, min_size=1, max_size=5),
       cut=st.integers(0, 10**6), junk=st.sampled_from(["", ":", "[", "]", "{", "&a", "*a", "!!", "\t", "- ", "\n  ",
                                                        "'", '"', "\\", "\x00", "%YAML 1.1\n", "---\n", "? "]))
def test_mutated_documents_get_the_same_verdict(data, cut, junk, tmp_path_factory):
    text = yamlio.dump_yaml(data)
    at = cut % (len(text) + 1)
    path = tmp_path_factory.mktemp("m") / "f.yaml"
    path.write_text(text[:at] + junk + text[at:])
    with pytest.MonkeyPatch.context() as monkeypatch:
        same_under_both(path, monkeypatch)


@FUZZ
@given(data=st.dictionaries(st.text(max_size=8), FINITE, max_size=6))
def test_dumps_read_back_as_the_data_under_both_parsers(data):
    text = yamlio.dump_yaml(data)
    assert yaml.load(text, Loader=yaml.CSafeLoader) == data == yaml.load(text, Loader=yaml.SafeLoader)
