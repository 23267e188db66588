"""benchmarks/validate.py's measuring order: mirrored runs, then more runs for every pair the
measurement orders against the prediction (real runs replaced by a scripted clock)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "validate.py"


@pytest.fixture
def validate(monkeypatch):
    spec = importlib.util.spec_from_file_location("validate_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "placement_text", lambda plan: "0-1@0")
    return module


def group(validate, monkeypatch, predicted: dict[str, float], measured: dict[str, list[float]]):
    calls: list[str] = []
    taken = {k: iter(v) for k, v in measured.items()}
    monkeypatch.setattr(validate, "predict", lambda spec, plan, costs, cluster: (predicted[plan.name], 0))

    def measure(plan, spec, workdir, tag, steps, bandwidth):
        calls.append(tag)
        return next(taken[plan.name])

    monkeypatch.setattr(validate, "measure", measure)
    plans = [(name, SimpleNamespace(name=name, pp=2)) for name in predicted]
    return validate.measure_group("m", None, plans, None, None, None, 4, Path("unused")), calls


def test_runs_mirrored_and_adds_two_runs_each_to_a_pair_measured_against_its_prediction(validate, monkeypatch) -> None:
    rows, calls = group(validate, monkeypatch, {"seq+1f1b": 1.00, "V+greedy": 0.95, "V+zbv": 1.30},
                        {"seq+1f1b": [1.00, 1.00, 1.00, 1.00], "V+greedy": [1.02, 1.04, 0.96, 0.94], "V+zbv": [1.2, 1.2]})
    assert calls == ["m-pp2-seq+1f1b-run0", "m-pp2-V+greedy-run0", "m-pp2-V+zbv-run0",
                     "m-pp2-V+zbv-run1", "m-pp2-V+greedy-run1", "m-pp2-seq+1f1b-run1",
                     "m-pp2-seq+1f1b-run2", "m-pp2-V+greedy-run2", "m-pp2-V+greedy-run3", "m-pp2-seq+1f1b-run3"]
    by = {r.config: r for r in rows}
    assert (by["seq+1f1b"].repeats, by["V+greedy"].repeats, by["V+zbv"].repeats) == (4, 4, 2)
    assert by["V+greedy"].measured_s == pytest.approx(0.99)
    assert by["V+greedy"].spread == pytest.approx(0.10 / 0.99)  # slowest minus fastest over the mean
    ranks = validate.rankings(rows)  # four runs each order the pair as predicted: 0.99 < 1.00
    assert ranks[0]["same"] is True and ranks[0]["inversions"] == []


def test_a_pair_still_inverted_after_four_runs_each_is_reported_with_its_noise(validate, monkeypatch) -> None:
    rows, _ = group(validate, monkeypatch, {"seq+1f1b": 1.00, "V+greedy": 0.95},
                    {"seq+1f1b": [1.00, 1.00, 1.00, 1.00], "V+greedy": [1.10, 1.10, 1.12, 1.08]})
    assert [r.repeats for r in rows] == [4, 4]
    (inverted,) = validate.rankings(rows)[0]["inversions"]
    assert inverted["pair"] == ["seq+1f1b", "V+greedy"] and inverted["beyond_noise"] is True  # 10% apart, 4% spread


def test_agreeing_groups_and_the_balanced_v_run_twice_only(validate, monkeypatch) -> None:
    rows, calls = group(validate, monkeypatch, {"seq+1f1b": 1.0, "V+greedy": 0.9, validate.BALANCED: 0.8},
                        {"seq+1f1b": [1.0, 1.0], "V+greedy": [0.9, 0.9], validate.BALANCED: [1.5, 1.5]})
    assert len(calls) == 6 and all(r.repeats == 2 for r in rows)
