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
