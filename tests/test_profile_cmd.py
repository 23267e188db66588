"""`pulse profile` on real processes: a cost table and a measured cluster every command accepts."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse.cli.main import main  # noqa: E402
from pulse.costs import CostTable  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402
from pulse.cli.common import load_model  # noqa: E402
from pulse.plan import load_plan  # noqa: E402


def test_profile_writes_costs_and_links_that_simulate_accepts(tmp_path: Path, capfd) -> None:
    """Profiled for a plan, its chunks timed whole too (--time-chunks): the table's spans are exactly
    the plan's chunks, each with every kind; the first chunk's B has no input gradient to walk."""
    costs_path, cluster_path = tmp_path / "costs.yaml", tmp_path / "cluster.yaml"
    assert main(["train", "--model", "tiny-unet", "--pp", "2", "--microbatch-size", "1", "--plan-only",
                 "--out-dir", str(tmp_path / "run")]) == 0
    plan = load_plan(tmp_path / "run" / "plan.yaml", load_model)[0]
    assert main(["profile", "--plan", str(tmp_path / "run" / "plan.yaml"), "--time-chunks", "--repeats", "1",
                 "--out-costs", str(costs_path), "--out-cluster", str(cluster_path)]) == 0
    assert "the plan's chunk of layers 0.." in capfd.readouterr().out  # the ranks' lines, through the launcher
    costs = CostTable.load(costs_path)
    chunks = sorted((c.start, c.end) for c in plan.placement.chunks)
    assert sorted({(a, b) for a, b, _, _ in costs.spans}) == chunks and len(costs.spans) == 5 * len(chunks)
    assert all(t > 0 for _, _, _, t in costs.spans)
    first = {k: t for a, b, k, t in costs.spans if (a, b) == chunks[0]}
    assert first["Bi"] < 0.2 * first["W"]  # B of the first chunk: its input needs no gradient
    assert costs.span(*chunks[1]) == tuple(t for a, b, k, t in costs.spans if (a, b) == chunks[1] and k in "FB")
    assert costs.microbatch_size == 1 and costs.source.startswith("measured:torch-cpu")
    n = len(costs.layer_names)
    assert len(costs.bwd_input) == len(costs.optimizer) == n
    assert all(f > 0 and b > 0 for f, b in zip(costs.fwd, costs.bwd))
    assert all(0 < i <= b for i, b in zip(costs.bwd_input, costs.bwd))  # the input half of the backward
    assert all(o > 0 for o in costs.optimizer)
    # ranks 0 and 1 timed every layer right after a message and back to back
    assert {k for k, _ in costs.cold_start} == {"F", "B", "Bi", "W"}
    assert all(t >= 0 for _, t in costs.cold_start)
    cluster = load_cluster(str(cluster_path))
    assert set(cluster.links) == {(0, 1), (1, 0)}
    for link in cluster.links.values():
        assert link.bandwidth > 0 and link.message_overhead >= 0 and link.send_overhead > 0
    assert cluster.allreduce_seconds(1 << 20, 2) > 0 and cluster.shared_cores is not None
    capfd.readouterr()
    assert main(["simulate", "--model", "tiny-unet", "--pp", "2", "--microbatch-size", "1",
                 "--costs", str(costs_path), "--cluster", str(cluster_path), "--time-limit", "5"]) == 0
    assert "tiny-unet" in capfd.readouterr().out


def test_profile_refuses_a_directory_as_output(tmp_path: Path, capsys) -> None:
    assert main(["profile", "--model", "tiny-unet", "--out-costs", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_time_chunks_without_a_plan_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["profile", "--model", "tiny-unet", "--time-chunks", "--out-costs", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--time-chunks times a plan's chunks" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c.yaml").exists()


def test_the_jobs_plan_cuts_are_checked_in_one_line() -> None:
    import argparse

    from pulse.profiling.job import cut_list
    assert cut_list("0,5,9,17") == [0, 5, 9, 17]
    for bad in ("", "5,9", "0,9,5", "0,0,3", "0,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cut_list(bad)


def test_per_action_fit_uses_chunks_of_the_size_plans_cut() -> None:
    """Layer 0 alone, then chunks of PER_ACTION_SPAN layers (the rest in the last); one long chunk
    only when the model is too small for two."""
    from pulse.profiling.layers import PER_ACTION_SPAN, fit_cuts, in_flight
    assert PER_ACTION_SPAN == 3
    assert fit_cuts(16) == [0, 1, 4, 7, 10, 13, 16]
    assert fit_cuts(8) == [0, 1, 4, 8]  # the remainder joins the last chunk
    assert fit_cuts(4) == [0, 1, 4] and fit_cuts(3) == [0, 1, 3]
    for n in (5, 6, 7, 9, 40):
        cuts = fit_cuts(n)
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        assert cuts[0] == 0 and cuts[-1] == n and sizes[0] == 1
        assert all(PER_ACTION_SPAN <= s < 2 * PER_ACTION_SPAN for s in sizes[1:])
    assert in_flight(1) == 2 and in_flight(2) == in_flight(4) == 4
