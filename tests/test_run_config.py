"""The run configuration: one typed record `pulse train` writes and every rank reads (no settings in argv)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from pulse.args.parser import OneLineParser
from pulse.args.run_args import add_run_arguments, run_config_of
from pulse.errors import PulseError
from pulse.train.run_config import RunConfig


def rank_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rank")
    parser.add_argument("--config")
    add_run_arguments(parser)
    return parser


def test_round_trip(tmp_path: Path) -> None:
    config = RunConfig(steps=7, seed=3, lr=2e-4, clip=0.0, precision="bf16", data="x.npz", resume="",
                       save_final=True, emulate_bandwidth=5e6, checkpoints_total_limit=2)
    config.save(tmp_path / "run.yaml")
    assert RunConfig.load(tmp_path / "run.yaml") == config


@pytest.mark.parametrize("key, value, says", [
    ("steps", 0, "'steps' must be a finite number in [1"),
    ("steps", 2.5, "'steps' must be int"),
    ("lr", 0.0, "'lr' must be > 0"),
    ("lr", float("nan"), "'lr' must be a finite number"),
    ("precision", "fp8", "'precision' must be one of fp32, bf16, fp16"),
    ("save_final", "yes", "'save_final' must be bool"),
    ("seed", True, "'seed' must be int"),
    ("timeout", 1e9, "'timeout' must be a finite number"),
    ("bogus", 1, "unknown setting(s) bogus"),
])
def test_bad_values_are_one_line(tmp_path: Path, key: str, value: object, says: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"pulse_run": 1, **{key: value}}))
    with pytest.raises(PulseError) as err:
        RunConfig.load(path)
    assert says in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_file_that_is_not_a_run_configuration(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text("pulse_plan: 1\nmodel: tiny-unet\n")
    with pytest.raises(PulseError, match="not a PULSE run configuration"):
        RunConfig.load(path)


def test_flags_override_the_file_and_the_rest_stays(tmp_path: Path) -> None:
    RunConfig(steps=9, seed=4, lr=1e-2, resume_any=True).save(tmp_path / "run.yaml")
    args = rank_parser().parse_args(["--config", str(tmp_path / "run.yaml"), "--steps", "3", "--resume"])
    config = run_config_of(args, args.config)
    assert (config.steps, config.seed, config.lr, config.resume, config.resume_any) == (3, 4, 1e-2, "", True)
    defaults = run_config_of(rank_parser().parse_args([]))
    assert defaults == RunConfig()


def test_pulse_train_writes_the_configuration_and_passes_no_settings_as_flags(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "pulse.cli.main", "train", "--model", "tiny-unet", "--pp", "2",
                          "--schedule", "1f1b", "--partitioner", "sequential", "--steps", "5", "--seed", "7",
                          "--lr", "3e-4", "--clip", "0", "--checkpoint-every", "2", "--save-final",
                          "--out-dir", str(run), "--plan-only"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    config = RunConfig.load(run / "run.yaml")
    assert asdict(config) == {**asdict(RunConfig()), "steps": 5, "seed": 7, "lr": 3e-4, "clip": 0.0,
                              "checkpoint_every": 2, "save_final": True, "out_dir": str(run)}
    launch = next(line for line in out.stdout.splitlines() if line.startswith("launch: "))
    tail = launch.split("-m pulse_torch.train ", 1)[1].split()
    assert tail == ["--plan", str(run / "plan.yaml"), "--config", str(run / "run.yaml")]
