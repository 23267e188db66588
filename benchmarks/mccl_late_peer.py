"""How long MindSpore's CPU all-reduce (mccl) waits for a late peer: why the MindSpore workers meet at a gloo
barrier before each sum over the world (``pulse_mindspore.transport.GlooTransport.meet``).

    python benchmarks/mccl_late_peer.py [--late 70] [--receive-timeout 150]

Two msrun workers on this machine's CPUs call one all-reduce; worker 1 calls it ``--late`` seconds after worker
0. Run twice: as msrun leaves it, and with ``MS_RECEIVE_MSG_TIMEOUT`` set to ``--receive-timeout``. Prints, per
run and worker, whether its all-reduce returned and after how many seconds of its own wait; writes
benchmarks/results/mccl_late_peer.json. Round 4, session 13, MindSpore 2.10: both workers fail after 30.0 s
in both runs ("AllReduce failed"; worker 0's log: "Ring ReduceScatter wait receiving [1,3] failed").
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pulse.cli.msrun_launch import find_msrun, msrun_env, msrun_prefix  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

WORKER = """
import sys, time
import numpy as np
import mindspore as ms
from mindspore import Tensor
from mindspore.communication import get_rank, init
from mindspore.ops import communication

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")
init()
rank = get_rank()
if rank == 1:
    time.sleep(float(sys.argv[1]))
start = time.time()
try:
    x = Tensor(np.ones(4, np.float32))
    communication.all_reduce(x)
    print(f"RESULT {rank} ok {time.time() - start:.1f} {float(x.asnumpy()[0])}", flush=True)
except Exception as exc:  # noqa: BLE001 - the library's failure is the measurement
    print(f"RESULT {rank} failed {time.time() - start:.1f} {str(exc).splitlines()[0]!r}", flush=True)
"""


def one_run(late: float, receive_timeout: float | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        env = {**msrun_env(), "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
        if receive_timeout is not None:
            env["MS_RECEIVE_MSG_TIMEOUT"] = str(int(receive_timeout))
        command = [*msrun_prefix(find_msrun(), 2, Path(tmp) / "logs"), "python", str(script), str(late)]
        subprocess.run(command, env=env, capture_output=True, text=True, timeout=late + 240)
        rows = []
        for log in sorted((Path(tmp) / "logs").glob("worker_*.log")):
            for m in re.finditer(r"^RESULT (\d) (\w+) ([\d.]+) (.*)$", log.read_text(errors="replace"), re.M):
                rows.append({"worker": int(m[1]), "outcome": m[2], "waited_s": float(m[3]), "detail": m[4]})
        return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--late", type=float, default=70.0, help="seconds worker 1 comes after worker 0")
    parser.add_argument("--receive-timeout", type=float, default=150.0, help="MS_RECEIVE_MSG_TIMEOUT of run 2")
    args = parser.parse_args()
    runs = []
    for receive_timeout in (None, args.receive_timeout):
        started = time.time()
        rows = one_run(args.late, receive_timeout)
        runs.append({"late_s": args.late, "MS_RECEIVE_MSG_TIMEOUT": receive_timeout, "workers": rows,
                     "wall_s": round(time.time() - started, 1)})
        setting = "unset" if receive_timeout is None else f"{receive_timeout:g}"
        for r in rows:
            print(f"late {args.late:g} s, MS_RECEIVE_MSG_TIMEOUT {setting}: worker {r['worker']} {r['outcome']} "
                  f"after {r['waited_s']:.1f} s ({r['detail']})", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mccl_late_peer.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {RESULTS / 'mccl_late_peer.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
