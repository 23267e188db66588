"""The suite's order (the slowest files first, so that the xdist workers end together),
MindSpore's cluster retry interval for the msrun jobs the tests start, and byte-code caches for
every process the suite starts.

``--dist loadfile`` hands out whole files in collection order (``--no-loadscope-reorder`` in
setup.cfg: xdist would otherwise put the files with the most tests first, which sends the few-test,
process-launching files, the slowest ones, last). Starting with the longest files and ending with
the many short ones is longest-processing-time-first scheduling: whichever worker frees up takes
the next, and the last files handed out are seconds long, not a minute. Files not listed keep
their collection order after the listed ones; the order inside a file never changes.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import warm_launch

# MindSpore's cluster nodes (msrun's scheduler and workers, and the jobs tests start by hand) wait a
# multi-second retry interval between attempts to register at start and to unregister at exit
# (MS_RETRY_INTERVAL_LOWER / _UPPER); on one host the scheduler answers at once, so each msrun job
# spent ~5-9 s of its wall time asleep. One second: `pulse train --backend mindspore --pp 2 --steps 1`
# 23.8 s -> 18.4 s and 25.8 s -> 16.7 s wall, the same CPU time. Set for the suite's processes only
# (every test's subprocesses inherit it); a value already in the environment wins.
os.environ.setdefault("MS_RETRY_INTERVAL_LOWER", "1")
os.environ.setdefault("MS_RETRY_INTERVAL_UPPER", "1")

# Byte-code caches for the suite's processes. With PYTHONDONTWRITEBYTECODE set (as on the shared
# machine), no process writes __pycache__, so every one recompiled each pulse module it imported
# (~120 files, 0.9 MB of source: importing pulse_torch.train's pulse part takes 0.33-0.36 s CPU
# compiling, 0.20-0.25 s from caches, and the suite starts hundreds of such processes; pytest's
# rewritten test modules too, in each xdist worker); torch, diffusers and MindSpore come compiled
# from their wheels. Writing them for the suite's own processes (this one, the xdist
# workers and every subprocess inherit it) lets each module compile once. The caches land in the
# git-ignored __pycache__ folders and Python recompiles a module whose source changed (its mtime
# and size are in the cache's header).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# seconds per file, roughly: its tests' wall time on their worker (`python benchmarks/suite_time.py`, three workers on
# the shared 2-core machine, launches warm, 2026-12-01, second session); only the order matters, so a stale figure
# costs balance, never correctness
SLOW_FILES = {
    "test_diffusers.py": 112,
    "test_tune_search.py": 100,
    "test_backends.py": 81,
    "test_mindspore_checkpoint.py": 79,
    "test_fault_tolerance.py": 74,
    "test_train_signals.py": 67,
    "test_sdxl_pipeline.py": 59,
    "test_tune.py": 57,
    "test_forked_ranks.py": 50,
    "test_mindspore_msrun.py": 50,
    "test_device_messages.py": 48,
    "test_mindspore_processes.py": 48,
    "test_cli_fuzz.py": 44,
    "test_split_backward.py": 43,
    "test_frozen_encoders.py": 40,
    "test_peer_pipelining.py": 40,
    "test_finetune_e2e.py": 40,
    "test_backend_processes.py": 38,
    "test_mindspore_profile.py": 33,
    "test_partition_priced.py": 33,
    "test_parity_processes.py": 32,
    "test_fuzz_planning.py": 31,
    "test_preemption_processes.py": 30,
    "test_lora.py": 28,
    "test_torch_train.py": 20,
    "test_backends_runtime.py": 18,
    "test_train_resume_identity.py": 17,
    "test_training_features.py": 17,
    "test_grad_buckets_nccl.py": 16,
    "test_sdxl.py": 16,
    "test_stage_loading.py": 16,
    "test_mindspore_backend.py": 16,
    "test_fitted_splits.py": 15,
    "test_malformed_inputs.py": 15,
    "test_image_sets.py": 15,
    "test_optimizers.py": 14,
    "test_partition_dp.py": 13,
    "test_gpu_check.py": 13,
    "test_finetune_onthefly.py": 13,
    "test_finetune_inputs.py": 13,
    "test_rendezvous.py": 13,
    "test_mindspore_layers.py": 13,
    "test_profile_cmd.py": 13,
}


def pytest_collection_modifyitems(session, config, items) -> None:
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(str(item.path), len(first_seen))

    def key(item) -> tuple[int, int]:
        return -SLOW_FILES.get(Path(item.path).name, 0), first_seen[str(item.path)]

    items.sort(key=key)  # stable: a file's own order is kept



def pytest_configure(config) -> None:
    """Every torch launch of a process that runs tests forked from a warm interpreter (``tests/warm_launch.py``):
    set before collection, so that environments test modules copy at import carry it too. The server starts
    in the background; a launch before it listens (or without torch) runs fresh."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test
    folder = tempfile.mkdtemp(prefix="pulse-warm-")
    server, variables = warm_launch.start_server(folder)
    os.environ.update(variables)
    config.warm_launches = (server, folder)  # type: ignore[attr-defined]


def pytest_unconfigure(config) -> None:
    server, folder = getattr(config, "warm_launches", (None, None))
    if server is not None:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)
