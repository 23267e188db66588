"""benchmarks/validate.py's measuring order: mirrored runs, then more runs for every pair the
measurement orders against the prediction until the runs settle it (real runs replaced by a
scripted clock); and benchmarks/measured_order.py's interval against figures by hand."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "validate.py"
Run = float | list[float]  # a scripted run: its one step's seconds, or every step's


@pytest.fixture
def validate(monkeypatch):
    spec = importlib.util.spec_from_file_location("validate_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "placement_text", lambda plan: "0-1@0")
    return module


def group(validate, monkeypatch, tmp_path, predicted: dict[str, float], measured: dict[str, list[Run]],
          later: dict[str, dict[str, float]] | None = None):
    """One group measured on scripted runs. A profile's "cost table" is a prediction per plan: the
    first profile predicts ``predicted``; a later one (by its ``when``), ``later``'s or the same;
    the mean of two profiles, the mean of theirs."""
    calls: list[str] = []
    taken = {k: iter(v) for k, v in measured.items()}
    monkeypatch.setattr(validate, "predict", lambda spec, plan, costs, cluster: (costs[plan.name], 0))
    monkeypatch.setattr(validate, "profiles_mean", lambda profiles: (
        {k: sum(p.costs[k] for p in profiles) / len(profiles) for k in profiles[0].costs}, None))

    def measure(plan, spec, workdir, tag, steps, bandwidth):
        calls.append(tag)
        steps = next(taken[plan.name])
        return steps if isinstance(steps, list) else [steps]

    def take_profile(when):
        calls.append(f"profile{when}")
        return validate.Profile((later or {}).get(when, predicted), None, ())  # no probes: no host speed

    monkeypatch.setattr(validate, "measure", measure)
    monkeypatch.setattr(validate, "HOST", SimpleNamespace(probe=lambda: 1.0))
    plans = [(name, SimpleNamespace(name=name, pp=2)) for name in predicted]
    return validate.measure_group("m", None, plans, None, 4, tmp_path, take_profile), calls


def test_runs_mirrored_and_adds_two_runs_each_to_a_pair_measured_against_its_prediction(
        validate, monkeypatch, tmp_path) -> None:
    rows, calls = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.00, "V+greedy": 0.95, "V+zbv": 1.30},
                        {"seq+1f1b": [1.00, 1.00, 1.00, 1.00], "V+greedy": [1.02, 1.04, 0.96, 0.94], "V+zbv": [1.2, 1.2]})
    assert calls == ["profile", "m-pp2-seq+1f1b-run0", "m-pp2-V+greedy-run0", "m-pp2-V+zbv-run0", "profile-mid",
                     "m-pp2-V+zbv-run1", "m-pp2-V+greedy-run1", "m-pp2-seq+1f1b-run1", "profile-after",
                     "m-pp2-seq+1f1b-run2", "m-pp2-V+greedy-run2", "m-pp2-V+greedy-run3", "m-pp2-seq+1f1b-run3",
                     "profile-recheck1"]
    by = {r.config: r for r in rows}
    assert (by["seq+1f1b"].repeats, by["V+greedy"].repeats, by["V+zbv"].repeats) == (4, 4, 2)
    assert by["V+greedy"].measured_s == pytest.approx(0.99)
    assert by["V+greedy"].spread == pytest.approx(0.10 / 0.99)  # slowest minus fastest over the mean
    ranks = validate.rankings(rows)  # four runs each order the pair as predicted: 0.99 < 1.00
    assert ranks[0]["same"] is True and ranks[0]["inversions"] == []


def test_each_run_is_predicted_on_the_two_profiles_right_around_it(validate, monkeypatch, tmp_path) -> None:
    # the first profile orders the pair against the runs; the profiles around each run, as they measured
    rows, calls = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.00, "V+greedy": 0.95},
                        {"seq+1f1b": [1.00, 1.00], "V+greedy": [1.05, 1.05]},
                        later={"-mid": {"seq+1f1b": 0.96, "V+greedy": 1.05},
                               "-after": {"seq+1f1b": 1.00, "V+greedy": 1.07}})
    assert calls[-1] == "profile-after" and len(calls) == 7  # no pair to run again
    # seq: (1.00 + 0.96) / 2 and (0.96 + 1.00) / 2; V: (0.95 + 1.05) / 2 and (1.05 + 1.07) / 2
    assert [r.predicted_s for r in rows] == [pytest.approx(0.98), pytest.approx(1.03)]
    assert rows[1].error == pytest.approx(1.03 / 1.05 - 1)
    assert validate.rankings(rows)[0]["same"] is True
    saved = validate.run_windows.load(tmp_path, 2)  # what --repredict reads
    assert saved["V+greedy"] == [validate.Window("", "-mid", 1.0), validate.Window("-mid", "-after", 1.0)]
    assert validate.run_windows.load(tmp_path, 4) is None


def test_a_timeline_refuses_a_profile_taken_twice_and_a_run_before_any_profile() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import run_windows
    finally:
        sys.path.remove(str(BENCH.parent))
    timeline = run_windows.Timeline(lambda when: run_windows.Profile(when, None, ()))
    timeline.ran(0)
    with pytest.raises(ValueError, match="before a group's first profile"):
        timeline.profile("")
    timeline = run_windows.Timeline(lambda when: run_windows.Profile(when, None, ()))
    timeline.profile("")
    with pytest.raises(ValueError, match="taken already"):
        timeline.profile("")


def test_a_pair_still_inverted_after_four_runs_each_is_reported_with_its_noise(validate, monkeypatch, tmp_path) -> None:
    rows, _ = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.00, "V+greedy": 0.95},
                    {"seq+1f1b": [1.00, 1.00, 1.00, 1.00], "V+greedy": [1.10, 1.10, 1.12, 1.08]})
    assert [r.repeats for r in rows] == [4, 4]
    (inverted,) = validate.rankings(rows)[0]["inversions"]
    # 10% apart, ± 1.6%: the runs order the pair against the prediction
    assert inverted["pair"] == ["V+greedy", "seq+1f1b"] and inverted["verdict"] == "inverted"
    assert inverted["measured_gap"] == pytest.approx(1.0 / 1.1 - 1)
    assert validate.rankings(rows)[0]["same"] is False


def test_a_pair_the_runs_cannot_order_is_measured_three_more_rounds_then_called_a_tie(
        validate, monkeypatch, tmp_path) -> None:
    # 1% apart against the prediction, every run's two steps 6% apart: 16 steps each leave ± 2.1%
    rows, calls = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.00, "V+zbv": 1.03},
                        {"seq+1f1b": [[1.04, 0.98]] * 8, "V+zbv": [[1.03, 0.97]] * 8})
    assert len(calls) == 16 + 6 and [r.repeats for r in rows] == [8, 8]  # 16 runs, six profiles
    (group_rank,) = validate.rankings(rows)
    (tie,) = group_rank["inversions"]
    assert tie["verdict"] == "tie" and tie["interval"] == pytest.approx(1.959964 * (2 * 0.03 ** 2 * 16 / 15 / 16) ** 0.5 / 1.01)
    assert group_rank["same"] is True and group_rank["same_order_of_means"] is False
    assert group_rank["pairs_ordered"] == 0 and group_rank["pairs"] == 1


def test_a_pair_tied_within_one_percent_stops_after_one_round(validate, monkeypatch, tmp_path) -> None:
    rows, calls = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.00, "V+zbv": 1.03},
                        {"seq+1f1b": [[1.003, 0.999]] * 4, "V+zbv": [[1.002, 0.998]] * 4})
    assert len(calls) == 8 + 4 and validate.rankings(rows)[0]["inversions"][0]["verdict"] == "tie"


def test_the_interval_by_hand_and_rows_without_samples_ordered_by_their_means() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import measured_order
    finally:
        sys.path.remove(str(BENCH.parent))
    gap = measured_order.measured_gap([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])  # variances 1 and 4, three samples each
    assert gap.difference == 2.0 and gap.half_width == pytest.approx(1.959964 * (5 / 3) ** 0.5)
    assert not gap.resolved and gap.mean == 3.0
    assert measured_order.measured_gap([1.0], [2.0, 3.0]) is None
    assert measured_order.verdict([], [], faster_mean=1.1, slower_mean=1.0) == "inverted"
    assert measured_order.verdict([], [], faster_mean=1.0, slower_mean=1.1) == "as predicted"


def test_agreeing_groups_and_the_balanced_v_run_twice_only(validate, monkeypatch, tmp_path) -> None:
    rows, calls = group(validate, monkeypatch, tmp_path, {"seq+1f1b": 1.0, "V+greedy": 0.9, validate.BALANCED: 0.8},
                        {"seq+1f1b": [1.0, 1.0], "V+greedy": [0.9, 0.9], validate.BALANCED: [1.5, 1.5]})
    assert len(calls) == 6 + 3 and all(r.repeats == 2 for r in rows)


def test_each_row_is_predicted_again_at_the_host_speed_its_runs_saw(validate, monkeypatch, tmp_path) -> None:
    # probes: 1.0 s around the profiles; around A's two runs 1.2 and 1.4, around B's 1.1 and 1.1
    probes = iter([1.2, 1.2, 1.1, 1.1, 1.1, 1.1, 1.4, 1.4])
    monkeypatch.setattr(validate, "HOST", SimpleNamespace(probe=lambda: next(probes)))
    monkeypatch.setattr(validate, "predict", lambda spec, plan, costs, cluster: (costs[plan.name], 0))
    monkeypatch.setattr(validate, "profiles_mean", lambda profiles: (profiles[0].costs, None))
    monkeypatch.setattr(validate, "at_speed", lambda costs, factor: {k: v * factor for k, v in costs.items()})
    monkeypatch.setattr(validate, "measure", lambda plan, spec, workdir, tag, steps, bandwidth: [1.3])
    costs = {"A": 1.0, "B": 0.9}
    plans = [(name, SimpleNamespace(name=name, pp=2)) for name in costs]
    rows = validate.measure_group("m", None, plans, None, 4, tmp_path,
                                  lambda when: validate.Profile(costs, None, (1.0, 1.0)))
    by = {r.config: r for r in rows}
    assert by["A"].host_slowdown == pytest.approx(1.3) and by["B"].host_slowdown == pytest.approx(1.1)
    assert by["A"].predicted_s == 1.0 and by["A"].predicted_at_host_speed_s == pytest.approx(1.3)
    assert by["A"].error_at_host_speed == pytest.approx(0.0) and by["A"].error == pytest.approx(1 / 1.3 - 1)
    assert by["B"].error_at_host_speed == pytest.approx(0.99 / 1.3 - 1)
    assert "at host speed (x1.10) -23.8%" in validate.format_row(by["B"])


def test_the_host_probe_is_the_median_step_over_its_budget(validate, monkeypatch) -> None:
    import host_speed  # beside validate.py, on the path it set

    clock = [0.0]
    durations = iter([0.10, 0.50, 0.10, 0.12, 0.11])  # one stall among them

    def step() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(host_speed.time, "perf_counter", lambda: clock[0])
    probe = host_speed.HostSpeed(seconds=0.9, _run=SimpleNamespace(step=step))
    assert probe.probe() == pytest.approx(0.11)  # five steps span 0.93 s >= 0.9; median of them
    assert host_speed.slowdown([1.2, 1.4], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.3)


def test_repredict_puts_each_run_between_its_own_profiles_or_the_groups_ends(validate, monkeypatch, tmp_path) -> None:
    where = validate.group_dir(tmp_path / "m", None)
    where.mkdir(parents=True)
    validate.run_windows.save(where, 2, ["V"], {0: [validate.Window("", "-mid"), validate.Window("-mid", "-after")]})
    validate.profile_files(where, 2, validate.AFTER)[0].write_text("")  # the group was profiled after its runs
    seconds = {"": 1.0, "-mid": 0.8, "-after": 1.2}  # each profile's prediction of the plan
    monkeypatch.setattr(validate, "loaded_profile", lambda pp, w, when, bw: validate.Profile(seconds[when], None, ()))
    monkeypatch.setattr(validate, "profiles_mean", lambda profiles: (sum(p.costs for p in profiles) / 2, None))
    monkeypatch.setattr(validate, "predict", lambda spec, plan, costs, cluster: (costs, 0))
    monkeypatch.setattr(validate, "load_model", lambda name: SimpleNamespace(with_act_bytes=lambda b: None))
    monkeypatch.setattr(validate, "load_plan", lambda path: (SimpleNamespace(pp=2), None))
    row = validate.measured_row("m", "free", "V", SimpleNamespace(pp=2), (2.0, 0), [[1.0], [1.0]])
    (windowed,) = validate.repredict([row], tmp_path)
    assert windowed.predicted_s == pytest.approx((0.9 + 1.0) / 2)  # (1.0 + 0.8) / 2, then (0.8 + 1.2) / 2
    (ends,) = validate.repredict([row], tmp_path, ends_only=True)
    assert ends.predicted_s == pytest.approx(1.1) and ends.error == pytest.approx(0.1)
