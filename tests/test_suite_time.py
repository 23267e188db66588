"""``benchmarks/suite_time.py``: the per-test clocks it records in a real pytest run, and its sums."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
from suite_time import ROWS_ENV, per_file, per_worker, read_rows, report, slow_files  # noqa: E402

BUSY = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end:\n    pass\n"
TESTS = f'''
import subprocess, sys, time

def test_burns_its_own_cpu():
    exec({BUSY!r})

def test_starts_a_busy_child():
    subprocess.run([sys.executable, "-c", {BUSY!r}], check=True)

def test_sleeps():
    time.sleep(0.4)
'''


def test_each_test_gets_its_own_cpu_its_childrens_and_its_wall(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    rows = tmp_path / "rows"
    rows.mkdir()
    env = {**os.environ, ROWS_ENV: str(rows),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_time", "-p", "no:cacheprovider", "-q",
                           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_probe.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got = {r["test"].split("::")[1]: r for r in read_rows(rows)}
    assert set(got) == {"test_burns_its_own_cpu", "test_starts_a_busy_child", "test_sleeps"}
    own, child, asleep = got["test_burns_its_own_cpu"], got["test_starts_a_busy_child"], got["test_sleeps"]
    assert own["self"] >= 0.35 and own["children"] < 0.05
    assert child["children"] >= 0.35 and child["self"] < 0.3  # the child's interpreter start counts to it too
    assert asleep["wall"] >= 0.4 and asleep["self"] + asleep["children"] < 0.1
    assert all(r["warm"] == 0.0 for r in got.values())  # no warm-launch server in this session
    assert per_worker(list(got.values())) == [pytest.approx(sum(r["wall"] for r in got.values()))]  # one worker


def test_files_are_summed_and_ordered_by_cpu_and_slow_files_by_wall() -> None:
    rows = [{"test": "tests/test_a.py::x", "self": 1.0, "children": 0.0, "warm": 0.0, "wall": 20.0, "worker": "w1"},
            {"test": "tests/test_a.py::y", "self": 0.5, "children": 1.0, "warm": 0.0, "wall": 1.0, "worker": "w1"},
            {"test": "tests/test_b.py::z", "self": 0.1, "children": 0.0, "warm": 9.0, "wall": 5.0, "worker": "w2"}]
    files = per_file(rows)
    assert list(files) == ["tests/test_b.py", "tests/test_a.py"]  # 9.1 s of CPU before 2.5 s
    assert files["tests/test_a.py"] == pytest.approx({"tests": 2, "wall": 21.0, "self": 1.5, "children": 1.0,
                                                      "warm": 0.0, "cpu": 2.5})
    assert slow_files(files) == {"test_a.py": 21}  # test_b.py's 5 s of wall is under the 12 s line
    assert per_worker(rows) == [21.0, 5.0]
    result = report(rows, top=1)
    assert result["attributed_cpu_s"] == pytest.approx(11.6)
    assert [r["test"] for r in result["costliest_tests"]] == ["tests/test_b.py::z", "tests/test_a.py::y",
                                                              "tests/test_a.py::x"]
