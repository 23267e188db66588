"""``pulse train --config FILE``: the run.yaml `pulse train` wrote trains the same run again; a hand-written
YAML of flags is read as those flags typed out, the command line on top; a wrong key or value is one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pulse.cli.main import main


def plan_only(*flags: str) -> int:
    return main(["train", "--plan-only", *flags])


def settings(folder: Path) -> dict:
    data = yaml.safe_load((folder / "run.yaml").read_text())
    data.pop("out_dir")
    return data


def test_the_written_run_file_plans_the_same_run_again(tmp_path: Path) -> None:
    first, again = tmp_path / "first", tmp_path / "again"
    assert plan_only("--model", "tiny-unet", "--pp", "2", "--dp", "2", "--schedule", "zero_bubble_v", "--steps", "7",
                     "--lr", "3e-4", "--seed", "5", "--ema", "0.99", "--out-dir", str(first)) == 0
    assert plan_only("--config", str(first / "run.yaml"), "--out-dir", str(again)) == 0
    assert settings(again) == settings(first)
    assert (again / "plan.yaml").read_text() == (first / "plan.yaml").read_text()


def test_a_hand_written_file_is_its_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("model: tiny-unet\npp: 2\n--schedule: greedy_v_1f1b\nlr: 1e-4\nsteps: 4\n"
                      "sample-prompt: [a cat, a dog]\nema: 0.9\n")  # YAML reads 1e-4 as text
    assert plan_only("--config", str(config), "--steps", "6", "--out-dir", str(tmp_path / "run")) == 0
    written = settings(tmp_path / "run")
    assert (written["lr"], written["steps"], written["ema"]) == (1e-4, 6, 0.9)
    assert written["sample_prompt"] == ["a cat", "a dog"]
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert plan["schedule"]["name"] == "greedy_v_1f1b" and plan["pp"] == 2


@pytest.mark.parametrize("text, said", [
    ("model: tiny-unet\nlearning_rate: 1e-4\n", "unknown setting 'learning_rate'"),
    ("model: tiny-unet\nlr: fast\n", "lr:"),
    ("model: tiny-unet\nschedule: fastest\n", "schedule: 'fastest' is not one of"),
    ("model: tiny-unet\nplan-only: yes please\n", "expected true or false"),
    ("model: [tiny-unet\n", "job.yaml"),
])
def test_a_wrong_run_file_is_one_line_and_exit_2(tmp_path: Path, capsys, text: str, said: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(text)
    assert plan_only("--config", str(config), "--out-dir", str(tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "run" / "run.yaml").exists()


def test_training_again_from_the_run_file_reproduces_its_losses(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*flags: str) -> list[float]:
        done = subprocess.run([sys.executable, "-m", "pulse.cli.main", "train", *flags], capture_output=True,
                              text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        out = Path(flags[flags.index("--out-dir") + 1])
        return [s["loss"] for s in json.loads((out / "log.json").read_text())["steps"]]

    first = train("--model", "tiny-unet", "--pp", "2", "--steps", "3", "--seed", "4", "--lr", "2e-3",
                  "--out-dir", str(tmp_path / "first"))
    again = train("--config", str(tmp_path / "first" / "run.yaml"), "--out-dir", str(tmp_path / "again"))
    assert again == first


def test_a_pretrained_pipeline_defaults_to_diffusers_learning_rate(tmp_path: Path, capsys) -> None:
    pytest.importorskip("diffusers")
    from pipeline_helpers import tiny_pipeline

    tiny_pipeline(tmp_path / "pipe")
    for flags, lr in ((["--pipeline", str(tmp_path / "pipe")], 1e-4),
                      (["--pipeline", str(tmp_path / "pipe"), "--lora-rank", "4"], 1e-4),
                      (["--pipeline", str(tmp_path / "pipe"), "--lr", "5e-6"], 5e-6),
                      (["--model", "tiny-unet"], 1e-3)):
        out = tmp_path / f"run-{len(flags)}-{lr}"
        assert plan_only(*flags, "--out-dir", str(out)) == 0
        assert yaml.safe_load((out / "run.yaml").read_text())["lr"] == lr
        said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("learning rate")]
        assert len(said) == 1 and said[0].startswith(f"learning rate {lr:g} (")
        assert ("diffusers" in said[0]) == ("--pipeline" in flags and "--lr" not in flags)
