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
