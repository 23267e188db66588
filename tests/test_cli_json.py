"""`pulse simulate` and `pulse tune` speak JSON like `pulse plan`: same key names for the
same quantities, the same figures as the text tables, progress on stderr."""
from __future__ import annotations

import json
import re

from pulse.cli.common import load_model
from pulse.cli.main import main
from pulse.plan import load_plan

FIGURES = {"step_seconds", "pipeline_seconds", "bubble_ratio", "peak_memory_bytes", "memory_budget_bytes",
           "fits_memory", "pipeline_bytes_per_step", "allreduce_bytes_per_step"}
SIMULATE = ["simulate", "--model", "uvit", "--pp", "2", "--schedule", "zero_bubble_v"]
TUNE = ["tune", "--model", "uvit", "--cluster", "ascend-910a-1x8", "--global-batch", "16",
        "--microbatch-sizes", "1", "--folds", "1", "--top", "30"]


def run(capsys, args: list[str]) -> tuple[str, str]:
    assert main(args) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def schedule_rows(text: str) -> dict[str, list[str]]:
    """The rows of `pulse simulate`'s table ("* name  12.34 ..."), by schedule name, in order."""
    return {m.group(1): line[2:].split() for line in text.splitlines()
            if (m := re.match(r"^[* ] (\S+)\s+\d+\.\d+\s", line))}


def test_simulate_json_matches_the_text_table_and_marks_what_is_over_budget(capsys, tmp_path):
    data = json.loads(run(capsys, [*SIMULATE, "--format", "json"])[0])
    peaks = sorted(r["peak_memory_bytes"] for r in data["schedules"])
    assert peaks[0] < peaks[-1]
    budget = ["--memory-budget", f"{(peaks[0] + peaks[-1]) / 2 / 2**30:.6f}", "--force"]
    out, err = run(capsys, [*SIMULATE, *budget, "--format", "json", "--out", str(tmp_path / "p.yaml")])
    data = json.loads(out)  # nothing but the JSON on stdout
    assert "plan written to" in err
    text = schedule_rows(run(capsys, [*SIMULATE, *budget])[0])
    assert [r["schedule"] for r in data["schedules"]] == list(text)  # fastest first, as printed
    assert {r["fits_memory"] for r in data["schedules"]} == {True, False}
    for row in data["schedules"]:
        assert FIGURES <= row.keys()
        name, makespan, step, bubble, peak = text[row["schedule"]][:5]
        assert f"{row['pipeline_seconds'] * 1e3:.2f}" == makespan
        assert f"{row['step_seconds'] * 1e3:.2f}" == step and row["step_seconds"] > row["pipeline_seconds"]
        assert f"{row['bubble_ratio']:.1%}" == bubble and f"{row['peak_memory_bytes'] / 2**30:.2f}" == peak
        assert row["fits_memory"] == (row["peak_memory_bytes"] <= row["memory_budget_bytes"])
        assert text[row["schedule"]][-1] == ("fits" if row["fits_memory"] else "budget")  # "OVER budget"
    chosen = next(r for r in data["schedules"] if r["schedule"] == data["chosen"])
    plan, _ = load_plan(tmp_path / "p.yaml", load_model)
    assert FIGURES <= plan.predicted.keys() and plan.predicted["step_seconds"] == chosen["step_seconds"]


def test_simulate_json_sends_the_ilp_progress_to_stderr(capsys):
    out, err = run(capsys, ["simulate", "--model", "tiny-unet", "--pp", "2", "--time-limit", "0.5",
                            "--format", "json"])
    data = json.loads(out)
    assert "ilp:" in err and "ilp:" not in out
    assert data["chosen"] in {r["schedule"] for r in data["schedules"]} and data["note"] in err + out


def test_tune_json_matches_the_text_table_and_shares_the_key_names(capsys, tmp_path):
    out, err = run(capsys, [*TUNE, "--format", "json", "--out", str(tmp_path / "j.yaml")])
    data = json.loads(out)
    assert "tuning uvit" in err and "plan written to" in err
    text, _ = run(capsys, [*TUNE, "--out", str(tmp_path / "t.yaml")])
    ranked = [line.split() for line in text.split("best of each strategy")[0].splitlines()
              if re.match(r"\s+\d+ ", line)]
    # both show the best --top (30 here) of the configurations that fit, in the same order
    assert len(ranked) == len(data["ranked"]) == min(30, data["counts"]["fit"]) > 1
    for cells, row in zip(ranked, data["ranked"]):
        assert FIGURES | {"samples_per_second"} <= row.keys()
        iter_ms, samples, peak, gb, bubble = cells[-5:]
        assert cells[1] == row["strategy"] and int(cells[2]) == row["pp"] and int(cells[3]) == row["dp"]
        assert f"{row['step_seconds'] * 1e3:.1f}" == iter_ms and f"{row['samples_per_second']:.1f}" == samples
        assert f"{row['peak_memory_bytes'] / 2**30:.2f}" == peak and f"{row['bubble_ratio']:.1%}" == bubble
        assert f"{(row['pipeline_bytes_per_step'] + row['allreduce_bytes_per_step']) / 1e9:.2f}" == gb
        assert row["fits_memory"] and row["memory_budget_bytes"] == data["memory_budget_bytes"]
    assert data["winner"] == data["ranked"][0]
    assert f"winner: {data['winner']['label']}:" in text
    plan, _ = load_plan(tmp_path / "j.yaml", load_model)
    assert FIGURES <= plan.predicted.keys() and plan.predicted["step_seconds"] == data["winner"]["step_seconds"]
