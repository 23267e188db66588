"""Broken plans fail fast with errors that name the rank, the action and what it waits for."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pulse.errors import PlanError
from pulse.runtime import DeadlockError, ScheduleOrderError
from pulse.testing.local import local_run
from pulse.testing.numpy_backend import NumpyBackend
from pulse.testing.toy import mse_loss, toy_batches, toy_placement, toy_unet_spec
from pulse.schedule.generators import gpipe, greedy_v_1f1b
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.lower import lower

SPEC = toy_unet_spec(depth=3)
PULSE = Path(__file__).resolve().parents[1] / "pulse"


def parse(rows: dict[int, str], num_microbatches: int = 1) -> Schedule:
    return Schedule("hand", num_microbatches,
                    {d: tuple(Action.parse(t, d) for t in row.split()) for d, row in rows.items()})


def run(schedule: Schedule, placement=None):
    placement = placement or toy_placement(SPEC, "sequential", 2)
    return local_run(SPEC, placement, schedule, NumpyBackend(), toy_batches(SPEC, 1), mse_loss)


def test_valid_hand_schedule_runs() -> None:
    run(parse({0: "0F0 0SF0:1 0RB0:1 0B0 0AR0 0FREE0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"})).step()


def test_free_before_the_backward_is_a_schedule_order_error() -> None:
    with pytest.raises(ScheduleOrderError, match=r"action #2 0FREE0 .* backward of chunk 0 mb0"):
        run(parse({0: "0F0 0SF0:1 0FREE0 0RB0:1 0B0 0AR0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"})).step()


def test_a_list_without_frees_and_all_reduces_is_refused() -> None:
    with pytest.raises(PlanError, match=r"0FREE0 appears 0 times; chunk 0 has 0 all-reduce .* pulse.schedule.lower"):
        run(parse({0: "0F0 0SF0:1 0RB0:1 0B0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"}))


def test_cyclic_wait_raises_deadlock_naming_every_blocked_rank() -> None:
    broken = parse({0: "0RB0:1 0F0 0SF0:1 0B0 0AR0 0FREE0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"})
    with pytest.raises(DeadlockError) as err:
        run(broken).step()
    text = str(err.value)
    assert "rank 0 (device 0): action #0 0RB0:1 waits for gradient 'h' of mb0 (transfer #0) from rank 1" in text
    assert "rank 1 (device 1): action #0 1RF0:0 waits for activation 'h' of mb0 (transfer #0) from rank 0" in text
    assert "<-- ERROR HERE" in text  # the Step x Device grid


def test_deadlock_after_progress_reports_positions() -> None:
    """Both devices get going, then each waits for the other's second microbatch."""
    rows = {0: "0F0 0SF0:1 0RB1:1 0B1 0FREE1 0F1 0SF1:1 0RB0:1 0B0 0AR0 0FREE0",
            1: "1RF0:0 1F0 1RF1:0 1F1 1B1 1FREE1 1SB1:0 1B0 1AR0 1FREE0 1SB0:0"}
    with pytest.raises(DeadlockError, match=r"rank 0 \(device 0\): action #2 0RB1:1 .*\n.*"
                                            r"rank 1 \(device 1\): action #2 1RF1:0"):
        run(parse(rows, 2)).step()


def test_backward_before_forward_is_a_schedule_order_error() -> None:
    with pytest.raises(ScheduleOrderError, match=r"rank 1 \(device 1\), action #0 1B0 .* forward context"):
        run(parse({0: "0F0 0SF0:1 0RB0:1 0B0 0AR0 0FREE0", 1: "1B0 1AR0 1FREE0 1RF0:0 1F0 1SB0:0"})).step()


def test_compute_only_schedule_is_refused_with_a_hint() -> None:
    placement = toy_placement(SPEC, "v", 2)
    with pytest.raises(PlanError, match=r"not a lowered program: run pulse\.schedule\.lower\.lower"):
        run(greedy_v_1f1b(placement, 2), placement)


def test_missing_microbatch_is_refused() -> None:
    placement = toy_placement(SPEC, "sequential", 2)
    full = lower(gpipe(placement, 2), SPEC, placement)
    short = Schedule("short", 2, {d: tuple(a for a in row if a.microbatch == 0)
                                  for d, row in full.actions.items()})
    with pytest.raises(PlanError, match="0F1 appears 0 times"):
        run(short)


def test_duplicated_send_is_refused() -> None:
    with pytest.raises(PlanError, match=r"0SF0:1 appears 2 times, traffic.transfers\(\) needs 1"):
        run(parse({0: "0F0 0SF0:1 0SF0:1 0RB0:1 0B0 0AR0 0FREE0", 1: "1RF0:0 1F0 1B0 1AR0 1FREE0 1SB0:0"}))


def test_send_for_a_pair_without_traffic_is_refused() -> None:
    """Chunks 1 and 2 of a V share device 1: nothing travels between them."""
    placement = toy_placement(SPEC, "v", 2)
    full = lower(gpipe(placement, 1), SPEC, placement)
    row = full.actions[1] + (Action(1, 1, 0, "SF", 2),)
    with pytest.raises(PlanError, match=r"action 1SF0:2 moves nothing"):
        run(Schedule("extra", 1, {0: full.actions[0], 1: row}), placement)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_no_framework() -> None:
    banned = {"torch", "torch_npu", "mindspore"}
    offenders = {str(p.relative_to(PULSE.parent)): sorted(_imports(p) & banned)
                 for p in PULSE.rglob("*.py") if _imports(p) & banned}
    assert not offenders, f"framework imports in the backend-neutral core: {offenders}"


def test_importing_the_runtime_loads_no_framework() -> None:
    code = ("import sys, pulse.runtime, pulse.testing.local, pulse.testing.toy, pulse.testing.numpy_backend; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mindspore', 'torch_npu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
