"""`pulse profile` on real processes: a cost table and a measured cluster every command accepts."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from pulse.cli.main import main  # noqa: E402
from pulse.costs import CostTable  # noqa: E402
from pulse.hardware import load_cluster  # noqa: E402


def test_profile_writes_costs_and_links_that_simulate_accepts(tmp_path: Path, capsys) -> None:
    costs_path, cluster_path = tmp_path / "costs.yaml", tmp_path / "cluster.yaml"
    assert main(["profile", "--model", "tiny-unet", "--pp", "2", "--microbatch-size", "1", "--repeats", "1",
                 "--out-costs", str(costs_path), "--out-cluster", str(cluster_path)]) == 0
    costs = CostTable.load(costs_path)
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
    capsys.readouterr()
    assert main(["simulate", "--model", "tiny-unet", "--pp", "2", "--microbatch-size", "1",
                 "--costs", str(costs_path), "--cluster", str(cluster_path), "--time-limit", "5"]) == 0
    assert "tiny-unet" in capsys.readouterr().out


def test_profile_refuses_a_directory_as_output(tmp_path: Path, capsys) -> None:
    assert main(["profile", "--model", "tiny-unet", "--out-costs", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


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
