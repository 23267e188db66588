"""`pulse plan` and `pulse simulate` end to end, in process."""
import json

import pytest

from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.plan import load_plan


def test_plan_prints_devices_and_comparison_and_round_trips(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "sd2-unet", "--pp", "4", "--out", str(out), "--png", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    assert "skips leaving their device: 0" in text
    for name in ("sequential", "diffusionpipe", "pulse"):
        assert name in text
    plan, spec = load_plan(out, load_model)
    assert plan.pp == 4 and plan.placement.kind == "v" and spec.name == "sd2-unet"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    again = tmp_path / "again.yaml"
    plan.save(again, spec)
    assert load_plan(again, load_model)[0] == plan


def test_plan_json_for_scripts(capsys):
    assert main(["plan", "--model", "uvit", "--pp", "2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["comparison"]}
    assert rows["pulse"]["bytes_per_microbatch"] < rows["sequential"]["bytes_per_microbatch"]
    assert data["plan"]["placement"]["kind"] == "v"


@pytest.mark.parametrize("args, message", [
    (["plan", "--model", "no-such-model"], "unknown model"),
    (["plan", "--model", "tiny-unet", "--pp", "64"], "pp"),
    (["plan", "--model", "sd2-unet", "--pp", "0"], "--pp must be >= 1"),
])
def test_plan_bad_input_is_one_line_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_simulate_writes_timeline_trace_and_plan_with_schedule(tmp_path, capsys):
    args = ["simulate", "--model", "uvit", "--pp", "2", "--schedule", "zero_bubble_v",
            "--timeline", str(tmp_path / "t.png"), "--trace", str(tmp_path / "t.json"), "--out", str(tmp_path / "s.yaml")]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "zero_bubble_v" in text and "gpipe" in text
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    plan, _ = load_plan(tmp_path / "s.yaml", load_model)
    assert plan.schedule is not None and plan.schedule.name == "zero_bubble_v"


def test_plan_keeps_crossing_skips_local_where_they_share_a_pair():
    """`pulse plan --strict` refuses crossing skips only when no V keeps them local."""
    import random

    from partition_helpers import random_costs, skip_local_v_splits
    from pulse.cli.common import Setup
    from pulse.cli.plan_cmd import all_placements
    from pulse.errors import PlanError
    from pulse.hardware import Cluster, Hardware
    from pulse.spec import Layer, ModelSpec, SkipEdge
    from pulse.traffic import skips_leaving_device

    layers = [Layer(f"l{i}", "x", 1, 1.0, 4, 0) for i in range(10)]
    skips = [SkipEdge("l0", "l9", 8), SkipEdge("l1", "l6", 5), SkipEdge("l3", "l8", 2)]  # 1-6 x 3-8
    spec = ModelSpec("crossed", layers, skips)
    cluster = Cluster("one-node", Hardware("hw", 1e12, 0.5, 2**34, 1e12, 1e9, 1e-5, 1e8, 1e-5, 8))
    setup = Setup(spec, cluster, random_costs(random.Random(0), spec), {})
    deepest = max(p for p in range(1, 6) if any(True for _ in skip_local_v_splits(spec, p)))
    placements, notes, _ = all_placements(setup, deepest, 1, strict=True)
    assert skips_leaving_device(spec, placements["pulse"]) == []
    assert not any(n.startswith("skips sent between devices") for n in notes)
    with pytest.raises(PlanError, match="drop --strict"):
        all_placements(setup, deepest + 1, 1, strict=True)
    placements, notes, _ = all_placements(setup, deepest + 1, 1, strict=False)
    assert "skips sent between devices: l3->l8" in notes
