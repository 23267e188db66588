"""CPU ranks forked from the launcher (``pulse_torch.forked_ranks``) see what a rank torchrun starts as a
subprocess sees, and train the same numbers.

::

    python -m pulse_torch.launch -- --nproc-per-node 2 -m rank_probe ...   PULSE_FORK_RANKS=1 (a CPU build: forked)
                                                                           PULSE_FORK_RANKS=0 (a subprocess a rank)
    each rank writes what it sees: its arguments, __name__, torch's thread count, its signal handlers,
    the sockets it holds; rank 1 exits with a code of the test's choosing
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse_torch import forked_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def env(fork: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, forked_ranks.SWITCH: fork}


def probe(tmp_path: Path, fork: str, exit_rank1: int) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / f"fork{fork}-exit{exit_rank1}"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "pulse_torch.launch", "--", "--nproc-per-node", "2", "-m",
                           "rank_probe", "--out", str(out), "--exit-rank1", str(exit_rank1)],
                          env=env(fork), capture_output=True, text=True, timeout=120)
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()]
    return done, seen


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_rank_sees_what_python_dash_m_gives_it_and_its_exit_code_reaches_the_launcher(tmp_path: Path,
                                                                                       fork: str) -> None:
    done, seen = probe(tmp_path, fork, exit_rank1=3)
    assert len(seen) == 2, done.stderr
    for rank in seen:
        assert rank["preloaded"] == (fork == "1")  # forked: torch._dynamo was imported before the module ran
        assert rank["argv"] == ["--out", str(tmp_path / f"fork{fork}-exit3"), "--exit-rank1", "3"]
        assert rank["name"] == "__main__" and not rank["in_modules"]  # run as __main__ only, as python -m does
        assert rank["threads"] == 1 == int(rank["omp"])
        assert rank["sigterm_default"] and rank["sigint_default"]  # not torchrun's agent's handlers
        assert rank["sockets"] == []  # not the launcher's store
    assert done.returncode == 3
    assert done.stderr.strip().splitlines()[-1] == "python -m pulse_torch.launch: the job failed (rank 1: exit code 3)"
    for noise in ("Traceback", "RuntimeWarning", "Terminating process"):  # torch's spawn logger quiet, as the agent's
        assert noise not in done.stderr, done.stderr


def test_only_module_entries_on_a_cpu_build_fork(monkeypatch) -> None:
    import torch

    args = Namespace(module=True, no_python=False, run_path=False)
    assert forked_ranks.forks_ranks(args, {})  # this suite's torch is a CPU build
    assert not forked_ranks.forks_ranks(args, {forked_ranks.SWITCH: "0"})
    assert not forked_ranks.forks_ranks(Namespace(module=False, no_python=False, run_path=False), {})
    assert not forked_ranks.forks_ranks(Namespace(module=True, no_python=False, run_path=True), {})
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build: its ranks stay subprocesses
    assert not forked_ranks.forks_ranks(args, {})


def test_forked_and_subprocess_ranks_train_the_same_numbers(tmp_path: Path) -> None:
    """tiny-unet pp 2: every step's loss and gradient norm identical whichever way the ranks started."""
    runs = {}
    for fork in ("1", "0"):
        out = tmp_path / f"run{fork}"
        done = subprocess.run([str(Path(sys.executable).parent / "pulse"), "train", "--model", "tiny-unet", "--pp", "2",
                               "--steps", "3", "--out-dir", str(out)], env=env(fork), capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr
        steps = json.loads((out / "log.json").read_text())["steps"]
        runs[fork] = [(s["loss"], s.get("grad_norm")) for s in steps]
    assert len(runs["1"]) == 3 and runs["1"] == runs["0"]


PRELOAD_PROBE = """import json, sys
from pulse_torch.forked_ranks import preload
for plan in sys.argv[1:]:  # one process, the diffusers plan last: what each preload adds is seen alone
    preload("pulse_torch.train", ["--plan", plan, "--steps", "2"])
    print(json.dumps({name: name in sys.modules for name in ("pulse_torch.train", "torch._dynamo", "diffusers.models",
                                                           "peft")}))
"""


def test_the_launcher_imports_a_diffusers_models_libraries_once_for_its_ranks(tmp_path: Path) -> None:
    """``pulse_torch.train.preload``: a diffusers plan's libraries imported in the launcher; a zoo plan's not;
    a plan that is not there left for the ranks to refuse."""
    pytest.importorskip("diffusers")
    from pulse.cli.main import main

    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({
        "_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64], "layers_per_block": 1,
        "sample_size": 16, "in_channels": 4, "out_channels": 4, "cross_attention_dim": 32,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "attention_head_dim": 8, "norm_num_groups": 8}))
    plans = {}
    for name, model in (("diffusers", ["--diffusers-config", str(unet / "config.json")]), ("zoo", ["--model", "tiny-unet"])):
        assert main(["train", *model, "--pp", "2", "--plan-only", "--out-dir", str(tmp_path / name)]) == 0
        plans[name] = str(tmp_path / name / "plan.yaml")
    order = {"missing": str(tmp_path / "nowhere.yaml"), "zoo": plans["zoo"], "diffusers": plans["diffusers"]}
    done = subprocess.run([sys.executable, "-c", PRELOAD_PROBE, *order.values()], env=env("1"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    seen = dict(zip(order, map(json.loads, done.stdout.strip().splitlines()[-3:])))
    for name in seen:
        assert seen[name]["pulse_torch.train"] and seen[name]["torch._dynamo"]
    assert seen["diffusers"]["diffusers.models"] and seen["diffusers"]["peft"]
    assert not seen["zoo"]["diffusers.models"] and not seen["missing"]["diffusers.models"]
