"""Malformed input files: every loader answers with one PulseError line naming the file.

For each entrance (model spec, hardware, cluster, plan, cost table, schedule as
YAML, JSON and CSV): hand-written broken files, hypothesis-generated garbage
text and bytes, and random mutations of a valid document (a value replaced by
any YAML value, a key dropped, a key added). Each either loads or raises a
PulseError whose message is one line and names the file; no other exception
type ever escapes. Through the CLI the same files exit with code 2, one line
on stderr, no traceback, and leave no --out file behind.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.costs import AnalyticProfiler, CostTable
from pulse.errors import PulseError
from pulse.hardware import CONFIG_DIR, load_cluster, load_hardware
from pulse.partition import partition
from pulse.plan import Plan, load_plan
from pulse.schedule.generators import make_schedule
from pulse.schedule.ir import Schedule
from pulse.spec import Layer, ModelSpec, SharedInput, SkipEdge
from pulse.spec_io import load_spec, spec_to_dict

REPO = Path(__file__).resolve().parent.parent
FUZZ_CASES: Counter = Counter()  # files tried per loader by the hypothesis tests
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)

# -- valid documents, one per entrance -----------------------------------------------------------------
SPEC = ModelSpec("m6", [Layer(f"l{i}", "res", 10, 1e6, 64, 32, {"channels": 4}) for i in range(6)],
                 [SkipEdge("l0", "l5", 16), SkipEdge("l1", "l4", 8)],
                 [SharedInput("t", 4), SharedInput("temb", 8, "l0")])
TINY = load_model("tiny-unet")
COSTS = AnalyticProfiler(load_hardware("cpu-local")).profile(TINY, 1)
PLACEMENT = partition("pulse", TINY, COSTS, 2)
SCHEDULE = make_schedule("greedy_v_1f1b", PLACEMENT, 4, COSTS)
PLAN = Plan("tiny-unet", "cpu-local", 2, 1, 1, 4, "pulse", PLACEMENT, SCHEDULE)

VALID = {
    "spec": spec_to_dict(SPEC),
    "hardware": yaml.safe_load((CONFIG_DIR / "hardware" / "cpu-local.yaml").read_text()),
    "cluster": {"name": "two-cpus", "hardware": "cpu-local", "nodes": 2},
    "plan": PLAN.to_dict(TINY),
    "costs": AnalyticProfiler(load_hardware("cpu-local")).profile(SPEC, 2).to_dict(),
    "schedule": SCHEDULE.to_dict(),
}

LOADERS = {
    "spec": load_spec,
    "hardware": lambda p: load_hardware(str(p)),
    "cluster": lambda p: load_cluster(str(p)),
    "plan": lambda p: load_plan(p, load_model),
    "costs": CostTable.load,
    "schedule": Schedule.load,
}
ENTRANCES = [(kind, suffix) for kind in LOADERS for suffix in (".yaml", ".json")] + [("schedule", ".csv")]


def dump(data, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(data)
    return yaml.safe_dump(data, sort_keys=False)


def expect_clean_error(kind: str, path: Path, fragment: str | None = None) -> str:
    """Load ``path``; it must fail with one PulseError line naming the file (and containing ``fragment``)."""
    with pytest.raises(PulseError) as info:
        LOADERS[kind](path)
    message = str(info.value)
    assert path.name in message, message
    assert "\n" not in message, message
    if fragment is not None:
        assert fragment in message, message
    return message


def loads_or_clean_error(kind: str, path: Path) -> bool:
    """Load ``path``: True if it loads; a PulseError must be one line naming the file; nothing else escapes."""
    try:
        LOADERS[kind](path)
    except PulseError as exc:
        assert path.name in str(exc) and "\n" not in str(exc), str(exc)
        return False
    return True


@pytest.mark.parametrize("kind,suffix", ENTRANCES)
def test_valid_documents_load(tmp_path, kind, suffix):
    path = tmp_path / f"ok{suffix}"
    path.write_text(SCHEDULE.to_csv() if suffix == ".csv" else dump(VALID[kind], suffix))
    assert loads_or_clean_error(kind, path)


# -- hand-written cases ---------------------------------------------------------------------------------
def edit(kind: str, change) -> dict:
    data = copy.deepcopy(VALID[kind])
    change(data)
    return data


def chunk(i: int, **fields):
    return lambda d: d["placement"]["chunks"][i].update(fields)


CASES = [
    # every entrance: not a mapping, empty, broken syntax, a Python tag, missing file, not UTF-8
    *[(kind, ".yaml", text, fragment) for kind in LOADERS for text, fragment in [
        ("- a\n- b\n", "expected a mapping at the top level, got list"),
        ("", "expected a mapping at the top level, got NoneType"),
        ("name: [unclosed\n", "malformed YAML at line"),
        ("!!python/object/apply:os.system ['true']\n", "Python tags are refused"),
        ("a: 1\na: 2\n", "key 'a' is written twice"),
    ]],
    ("spec", ".json", '{"name": "m", "name": "n", "layers": []}', "key 'name' is written twice"),
    ("costs", ".json", "[1, 2, 3]", "expected a mapping at the top level, got list"),
    ("plan", ".json", '{"pulse_plan": 1,', "malformed JSON at line 1"),
    # model specs
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][0].update(params="ten")), "'params' must be a number"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][0].update(flops=float("nan"))), "'flops' must be a finite"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][2].update(saved_bytes=-1)), "must not be negative"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][1].update(name=7)), "layers[1]: 'name' must be"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][1].update(name="a\nb")), "printable text on one line"),
    ("spec", ".yaml", edit("spec", lambda d: d.update(layers={"l0": 1})), "'layers' must be a non-empty list"),
    ("spec", ".yaml", edit("spec", lambda d: d.update(skips="l0->l5")), "'skips' must be a list"),
    ("spec", ".yaml", edit("spec", lambda d: d.update(shared_inputs=3)), "'shared_inputs' must be a list"),
    ("spec", ".yaml", edit("spec", lambda d: d.update(meta=[1])), "'meta' must be a mapping"),
    ("spec", ".yaml", edit("spec", lambda d: d.update(act_bytes=True)), "'act_bytes' must be a positive"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][0]["attrs"].update(channels=[4])), "attrs['channels']"),
    ("spec", ".yaml", edit("spec", lambda d: d["skips"][0].update(dst="nowhere")), "unknown layer 'nowhere'"),
    ("spec", ".yaml", edit("spec", lambda d: d["skips"].append({"src": "l5", "dst": "l0", "bytes": 1})), "backwards"),
    ("spec", ".yaml", edit("spec", lambda d: d["shared_inputs"].append({"name": "t", "bytes": 1})), "duplicate"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"].append(d["layers"][0])), "duplicate layer name 'l0'"),
    ("spec", ".yaml", edit("spec", lambda d: d["layers"][0].update(colour="red")), "unknown key 'colour'"),
    # hardware and clusters
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(efficiency=1.5)), "'efficiency' is a fraction"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(peak_flops="fast")), "'peak_flops' must be a number"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(peak_flops=float("inf"))), "finite"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(devices_per_node=0)), "must be positive"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(memory_bytes=1.5)), "whole number"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.pop("hbm_bandwidth")), "missing key 'hbm_bandwidth'"),
    ("hardware", ".yaml", edit("hardware", lambda d: d.update(sources=[1])), "'sources' must be a mapping"),
    ("cluster", ".yaml", edit("cluster", lambda d: d.update(nodes=0)), "'nodes' must be positive"),
    ("cluster", ".yaml", edit("cluster", lambda d: d.update(nodes="two")), "'nodes' must be a number"),
    ("cluster", ".yaml", edit("cluster", lambda d: d.update(hardware=["cpu-local"])), "'hardware' must be"),
    ("cluster", ".yaml", edit("cluster", lambda d: d.update(hardware="no-such-chip")), "'hardware': unknown hardware"),
    ("cluster", ".yaml", edit("cluster", lambda d: d.update(hardware="missing.yaml")), "missing.yaml: no such"),
    # cost tables
    ("costs", ".yaml", edit("costs", lambda d: d["fwd"].pop()), "'fwd' has 5 entries for 6 layer_names"),
    ("costs", ".yaml", edit("costs", lambda d: d.pop("act_mem")), "missing key 'act_mem'"),
    ("costs", ".yaml", edit("costs", lambda d: d.update(turbo=1)), "unknown key 'turbo'"),
    ("costs", ".yaml", edit("costs", lambda d: d["bwd"].__setitem__(2, "slow")), "'bwd[2]' must be a number"),
    ("costs", ".yaml", edit("costs", lambda d: d["fwd"].__setitem__(0, -1.0)), "'fwd[0]' must not be negative"),
    ("costs", ".yaml", edit("costs", lambda d: d["act_mem"].__setitem__(0, 0.5)), "'act_mem[0]' must be a whole"),
    ("costs", ".yaml", edit("costs", lambda d: d.update(microbatch_size=0)), "'microbatch_size' must be positive"),
    ("costs", ".yaml", edit("costs", lambda d: d.update(layer_names=["a"] * 6)), "lists layer 'a' twice"),
    ("costs", ".yaml", edit("costs", lambda d: d.update(fwd=3.0)), "'fwd' must be a list"),
    # plans: schema, placement, names against the model, schedule against the placement
    ("plan", ".yaml", edit("plan", chunk(0, device=0.5)), "chunks[0]: 'device' must be a whole number"),
    ("plan", ".yaml", edit("plan", chunk(0, device=5)), "'device' is 5, but pp = 2"),
    ("plan", ".yaml", edit("plan", chunk(1, start=3)), "(overlap)"),
    ("plan", ".yaml", edit("plan", chunk(2, end=11)), "(gap)"),
    ("plan", ".yaml", edit("plan", chunk(0, first="conv_in_renamed")), "re-plan for this model"),
    ("plan", ".yaml", edit("plan", chunk(3, end=40)), "'last' expects layer 'conv_out' at index 39"),
    ("plan", ".yaml", edit("plan", lambda d: (chunk(3, end=40)(d), d["placement"]["chunks"][3].pop("last"))),
     "covers 40 layers but the model has 17"),
    ("plan", ".yaml", edit("plan", lambda d: d["placement"].update(chunks=None)), "'chunks' must be a non-empty list"),
    ("plan", ".yaml", edit("plan", lambda d: d["placement"].update(kind="sequential")), "one chunk per device"),
    ("plan", ".yaml", edit("plan", lambda d: d["placement"].update(kind="spiral")), "unknown kind 'spiral'"),
    ("plan", ".yaml", edit("plan", lambda d: d["placement"].update(skip_transport="teleport")), "relay or direct"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(pp=3)), "leaves device 2 without work"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(pp=10**12)), "pp is 1000000000000 but there are only 4"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(dp="two")), "'dp' must be a number"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(model="no-such-model")), "'model': unknown model"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(model_options={"heads": 0})), "option 'heads' must be a list"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(model_options=[1])), "'model_options' must be a mapping"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(predicted=5)), "'predicted' must be a mapping"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(pulse_plan=2)), "plan version 2 is not supported"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"]["actions"].update({0: "0F0 0B0"})), "schedule lacks"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"]["actions"].update(
        {0: d["schedule"]["actions"][1]})), "lives on device 1"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"]["actions"].update({7: "0F0"})), "actions for device 7"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"].update(num_microbatches=5)), "plan's num_microbatches is 4"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"]["actions"].update({0: "0F0 0Z0"})), "parse action '0Z0'"),
    ("plan", ".yaml", edit("plan", lambda d: d["schedule"]["actions"].update(
        {0: " ".join(reversed(d["schedule"]["actions"][0].split()))})), "comes before"),
    ("plan", ".yaml", edit("plan", lambda d: d.update(schedule="gpipe")), "schedule: expected a mapping"),
    # schedules
    ("schedule", ".yaml", edit("schedule", lambda d: d.update(num_microbatches=0)), "must be positive"),
    ("schedule", ".yaml", edit("schedule", lambda d: d.update(num_microbatches=2)), "names microbatch 2"),
    ("schedule", ".yaml", edit("schedule", lambda d: d.update(actions=[])), "'actions' must be a non-empty mapping"),
    ("schedule", ".yaml", edit("schedule", lambda d: d["actions"].update({-1: "0F0"})), "device must be a whole"),
    ("schedule", ".yaml", edit("schedule", lambda d: d["actions"].update({0: 5})), "actions[0]: expected action texts"),
    ("schedule", ".yaml", edit("schedule", lambda d: d.pop("num_microbatches")), "missing key 'num_microbatches'"),
    ("schedule", ".json", '{"num_microbatches": 1, "actions": {"0.5": "0F0"}}', "device must be a whole number"),
    ("schedule", ".csv", "0,0F0,0B0\nzero,1F0\n", "line 2: device must be a whole number"),
    ("schedule", ".csv", "0,0F0,garbage\n", "line 1: cannot parse action 'garbage'"),
    ("schedule", ".csv", "0,0F0\n0,0B0\n", "line 2: device 0 already has a row"),
    ("schedule", ".csv", "", "no rows"),
    ("schedule", ".csv", "0\n1\n", "no compute actions"),
    ("schedule", ".csv", "0,0SF0\n", "send/recv need a peer chunk"),
]


@pytest.mark.parametrize("kind,suffix,content,fragment", CASES,
                         ids=[f"{i}-{c[0]}{c[1]}" for i, c in enumerate(CASES)])
def test_hand_written_malformed_files(tmp_path, kind, suffix, content, fragment):
    path = tmp_path / f"bad-{kind}{suffix}"
    path.write_text(content if isinstance(content, str) else dump(content, suffix))
    expect_clean_error(kind, path, fragment)


@pytest.mark.parametrize("kind", LOADERS)
def test_missing_and_binary_files(tmp_path, kind):
    expect_clean_error(kind, tmp_path / "absent.yaml", "no such file")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81name: x\n")
    expect_clean_error(kind, binary, "not UTF-8")
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    expect_clean_error(kind, folder, "cannot read")


def test_python_tags_are_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    for kind in LOADERS:
        message = expect_clean_error(kind, path, "could not determine a constructor")
        assert "python/object/apply" in message
    path.write_text("name: !!python/object:pulse.spec.Layer {name: a}\nlayers: []\n")
    expect_clean_error("spec", path, "Python tags are refused")
    assert not marker.exists()


def test_loaders_read_yaml_only_with_safe_load():
    sources = [p for folder in ("pulse", "backends", "scripts", "benchmarks") for p in (REPO / folder).rglob("*.py")]
    offenders = [str(p.relative_to(REPO)) for p in sources
                 if any(call in p.read_text() for call in ("yaml.load(", "yaml.unsafe_load", "yaml.full_load",
                                                           "yaml.Loader", "UnsafeLoader", "FullLoader"))]
    assert offenders == []


# -- hypothesis: garbage and mutations -------------------------------------------------------------------
YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


def paths_of(data, prefix=()) -> list[tuple]:
    """Every key path into nested dicts and lists."""
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for key, value in data.items():
            out += paths_of(value, prefix + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += paths_of(value, prefix + (i,))
    return out


@st.composite
def mutated(draw, kind: str):
    """The valid document of ``kind`` with one to three random edits."""
    data = copy.deepcopy(VALID[kind])
    for _ in range(draw(st.integers(1, 3))):
        paths = paths_of(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        action = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if action == "replace":
            parent[last] = draw(YAML_VALUES)
        elif action == "drop":
            del parent[last]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(YAML_VALUES)
        else:
            parent.insert(last, draw(YAML_VALUES))
    return data


GARBAGE_TEXT = st.text(max_size=300) | st.lists(
    st.sampled_from(["name:", "layers:", "- ", "{", "}", "[", "]", ": ", "\n", "  ", "0F0", ",", "1", "-1",
                     "!!python/object:os.system", "&a", "*a", "'", '"', "null", ".nan", "1e999", "actions:",
                     "0B0", "3SF0:1", "x", "\t", "#", "---", "..."]),
    max_size=60).map("".join)


@fuzz(40)
@given(data=st.data())
@pytest.mark.parametrize("kind,suffix", ENTRANCES)
def test_garbage_files_give_clean_errors(tmp_path, kind, suffix, data):
    path = tmp_path / f"garbage-{kind}{suffix}"
    if data.draw(st.booleans()):
        path.write_text(data.draw(GARBAGE_TEXT), encoding="utf-8", errors="surrogatepass")
    else:
        path.write_bytes(data.draw(st.binary(max_size=200)))
    FUZZ_CASES[f"garbage {kind}{suffix}"] += 1
    event("loaded" if loads_or_clean_error(kind, path) else "PulseError")


@fuzz(60)
@given(data=st.data())
@pytest.mark.parametrize("kind,suffix", [e for e in ENTRANCES if e[1] != ".csv"])
def test_mutated_documents_give_clean_errors(tmp_path, kind, suffix, data):
    path = tmp_path / f"mutated-{kind}{suffix}"
    path.write_text(dump(data.draw(mutated(kind)), suffix))
    FUZZ_CASES[f"mutated {kind}{suffix}"] += 1
    event("loaded" if loads_or_clean_error(kind, path) else "PulseError")


CSV_CELLS = st.sampled_from(["0F0", "0B0", "1F0", "1B0", "0W0", "0SF0:1", "1RF0:0", "", " ", "F", "-1", "0F-1",
                             "0F0:", "x", "0", "1", "0.5", '"', "0F0 0B0", "99999999999999999999F0"])


@fuzz(60)
@given(st.lists(st.lists(CSV_CELLS, max_size=6), max_size=5))
def test_mutated_csv_schedules_give_clean_errors(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("csv") / "mutated.csv"
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    FUZZ_CASES["mutated schedule.csv"] += 1
    event("loaded" if loads_or_clean_error("schedule", path) else "PulseError")


# -- through the CLI -------------------------------------------------------------------------------------
def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulse.cli.main", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def assert_one_line_exit_2(code: int, err: str, name: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and "Traceback" not in err, err


BAD_MODEL = "name: m\nlayers:\n- {name: a, kind: x, params: many, flops: 1, out_bytes: 1, saved_bytes: 1}\n"


@pytest.mark.parametrize("argv,bad_name,content", [
    (["plan", "--model", "{bad}"], "bad-model.yaml", BAD_MODEL),
    (["plan", "--model", "{bad}"], "bad-model.yaml", "- not\n- a mapping\n"),
    (["simulate", "--plan", "{bad}", "--schedule", "gpipe", "--hardware", "cpu-local"], "bad-plan.yaml",
     dump(edit("plan", chunk(0, device=0.5)), ".yaml")),
    (["simulate", "--plan", "{bad}", "--schedule", "gpipe", "--hardware", "cpu-local"], "bad-plan.yaml",
     dump(edit("plan", lambda d: d["schedule"]["actions"].update({0: "0F0 0B0"})), ".yaml")),
    (["simulate", "--plan", "{bad}", "--schedule", "gpipe"], "bad-plan.yaml",  # no --hardware to price it on
     dump(edit("plan", lambda d: d.update(cluster="no-such-cluster")), ".yaml")),
], ids=["plan-model-type", "plan-model-list", "simulate-plan-float-device", "simulate-plan-schedule",
        "simulate-plan-cluster"])
def test_cli_subprocess_reports_one_line_and_writes_nothing(tmp_path, argv, bad_name, content):
    bad = tmp_path / bad_name
    bad.write_text(content)
    out = tmp_path / "out.yaml"
    result = run_cli(*[a.replace("{bad}", str(bad)) for a in argv], "--out", str(out), cwd=tmp_path)
    assert_one_line_exit_2(result.returncode, result.stderr, bad_name)
    assert not out.exists() and result.stdout == ""


def test_simulate_prices_a_plan_on_the_hardware_given_instead_of_its_own_cluster(tmp_path):
    """A plan naming a cluster this machine does not know (``measured``, from validate) is priced
    on ``--hardware`` (e.g. the cluster YAML ``pulse profile`` wrote), and the plan written says so."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(dump(edit("plan", lambda d: d.update(cluster="no-such-cluster")), ".yaml"))
    out = tmp_path / "out.yaml"
    result = run_cli("simulate", "--plan", str(plan), "--schedule", "gpipe", "--hardware", "cpu-local",
                     "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(out.read_text())["cluster"] == "cpu-local"


REQUIRED = {"spec": "layers", "costs": "fwd", "hardware": "peak_flops", "cluster": "nodes", "plan": "placement",
            "schedule": "actions"}


@pytest.mark.parametrize("flag,kind,suffix", [("--model", "spec", ".yaml"), ("--costs", "costs", ".yaml"),
                                              ("--hardware", "hardware", ".yaml"), ("--hardware", "cluster", ".yaml"),
                                              ("--plan", "plan", ".yaml"), ("--plan", "plan", ".json"),
                                              ("--schedule", "schedule", ".csv"),
                                              ("--schedule", "schedule", ".yaml")])
@pytest.mark.parametrize("mutation", range(3))
def test_cli_in_process_bad_files(tmp_path, capsys, flag, kind, suffix, mutation):
    """Through ``main()``: each entrance with broken files exits 2 with one stderr line and no output file."""
    bad = tmp_path / f"bad-{kind}{suffix}"
    if suffix == ".csv":
        bad.write_text(["0,0F0,zzz\n", "x,0F0\n", ""][mutation])
    else:
        bad.write_text([
            "- 1\n",
            dump(edit(kind, lambda d: d.update(turbo=True)), suffix),
            dump(edit(kind, lambda d: d.pop(REQUIRED[kind])), suffix),
        ][mutation])
    out = tmp_path / "out.yaml"
    command = "simulate" if flag in ("--plan", "--schedule") else "plan"
    argv = [command, flag, str(bad), "--out", str(out), "--pp", "2"]
    if flag != "--hardware":
        argv += ["--hardware", "cpu-local"]
    if flag == "--costs":
        argv += ["--model", "tiny-unet"]
    if flag == "--schedule":
        argv += ["--model", "tiny-unet"]
    code = main(argv)
    captured = capsys.readouterr()
    assert_one_line_exit_2(code, captured.err, bad.name)
    assert not out.exists()


@pytest.mark.parametrize("kind, suffix", ENTRANCES)
def test_a_number_of_thousands_of_digits_is_one_line(tmp_path, kind, suffix):
    """Python refuses int() of over 4300 digits with a ValueError: the loader says it, no traceback."""
    path = tmp_path / f"huge{suffix}"
    digits = "9" * 5000
    path.write_text(f"a,{digits}\n" if suffix == ".csv" else
                    (f'{{"name": {digits}}}' if suffix == ".json" else f"name: {digits}\n"))
    message = expect_clean_error(kind, path)
    assert suffix == ".csv" or "5000 digits" in message, message


@pytest.mark.parametrize("kind", LOADERS)
def test_a_named_pipe_is_refused_before_it_is_opened(tmp_path, kind):
    """Opening a FIFO blocks until a writer comes: the loaders refuse anything but a regular file first."""
    import os

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    expect_clean_error(kind, fifo, "not a regular file")


def test_an_all_zero_cost_table_is_refused(tmp_path):
    data = copy.deepcopy(VALID["costs"])
    data["fwd"] = [0.0] * len(data["fwd"])
    data["bwd"] = [0.0] * len(data["bwd"])
    path = tmp_path / "costs.yaml"
    path.write_text(dump(data, ".yaml"))
    expect_clean_error("costs", path, "every layer's 'fwd' and 'bwd' is 0 s")
