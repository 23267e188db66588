"""`pulse train --plan FILE` trains exactly that plan; `--schedule auto` is what `pulse simulate` picks."""
from __future__ import annotations

from pathlib import Path

from untimed_ilp import untimed_ilp

from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.plan import load_plan


def test_train_plan_launches_the_given_plan_unchanged(tmp_path: Path, capsys) -> None:
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--num-microbatches", "6", "--schedule", "zero_bubble_v",
                 "--plan-only", "--out-dir", str(tmp_path / "a")]) == 0
    given, _ = load_plan(tmp_path / "a" / "plan.yaml", load_model)
    # other model flags are ignored: the plan says what to train
    assert main(["train", "--plan", str(tmp_path / "a" / "plan.yaml"), "--model", "tiny-dit", "--pp", "4",
                 "--plan-only", "--out-dir", str(tmp_path / "b")]) == 0
    launched, _ = load_plan(tmp_path / "b" / "plan.yaml", load_model)
    assert launched == given and launched.schedule == given.schedule
    assert "--plan" in capsys.readouterr().out


def test_train_plan_without_a_schedule_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--model", "tiny-unet", "--pp", "2", "--hardware", "cpu-local",
                 "--out", str(tmp_path / "p.yaml")]) == 0
    capsys.readouterr()
    code = main(["train", "--plan", str(tmp_path / "p.yaml"), "--plan-only", "--out-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "has no schedule" in err and len(err.strip().splitlines()) == 1


def test_auto_schedule_is_the_one_simulate_reports(tmp_path: Path, capsys, monkeypatch) -> None:
    untimed_ilp(monkeypatch)  # two ILP solves compared: each ends at a proof or its node limit, not the clock
    common = ["--model", "tiny-unet", "--pp", "2", "--microbatch-size", "2", "--precision", "fp32",
              "--hardware", "cpu-local", "--time-limit", "20"]
    assert main(["simulate", *common, "--out", str(tmp_path / "sim.yaml")]) == 0
    assert main(["train", *common, "--plan-only", "--out-dir", str(tmp_path / "t")]) == 0
    simulated, _ = load_plan(tmp_path / "sim.yaml", load_model)
    trained, _ = load_plan(tmp_path / "t" / "plan.yaml", load_model)
    assert trained.placement == simulated.placement
    assert trained.schedule == simulated.schedule
