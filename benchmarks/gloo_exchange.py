"""Two ranks computing and exchanging messages both ways, through one gloo connection or one per direction.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gloo_exchange.py [--rounds 40] [--bytes 10000]

What a pipeline's ranks do between their chunks, reduced to its pattern: each of
two torchrun ranks (gloo, pinned to its core as training pins it) computes a block
(~0.4 ms of matmuls), sends one message to the other, then receives the other's,
16 times per round, every receive posted before the round (as the executor posts
them). Three patterns:

    both ways, shared     rank 0 -> 1 and 1 -> 0 at the same time, both through the
                          default process group (one TCP connection per pair)
    both ways, own        the same through ``pulse_torch.dist.direction_groups``
                          (one group, so one connection, per direction: what
                          ``TorchCommunicator`` now does on gloo)
    ping-pong             one message at a time, alternating: a V's chunks at P = 2

Per pattern: milliseconds per iteration (compute + one send + one receive per rank)
and what the messages cost on top of the compute (ping-pong: on top of both ranks'
blocks, which an iteration holds one after the other). Writes
benchmarks/results/gloo_exchange.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PATTERNS = ("both ways, shared", "both ways, own", "ping-pong")
ITERATIONS = 16


def worker(args: argparse.Namespace) -> None:
    """One rank: every pattern, ``args.rounds`` rounds each; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist

    from pulse_torch.comm import TorchCommunicator
    from pulse_torch.dist import direction_groups, pin_to_cores

    pin_to_cores()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    shared = TorchCommunicator(timeout=60.0)
    own = TorchCommunicator(timeout=60.0, p2p_groups=direction_groups("gloo"))
    layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    message = torch.zeros(args.bytes // 4)

    def compute() -> None:
        for _ in range(6):
            layer(x)

    def one_round(comm: TorchCommunicator, pattern: str, with_messages: bool) -> float:
        for i in range(ITERATIONS):
            comm.post_recv(peer, [100 + i])
        dist.barrier()
        start = time.perf_counter()
        for i in range(ITERATIONS):
            if pattern == "ping-pong" and with_messages and (rank == 1 or i > 0):
                comm.recv(peer, 100 + i - (rank == 0))
            compute()
            if with_messages:
                comm.send(message, peer, 100 + i)
                if pattern != "ping-pong":
                    comm.recv(peer, 100 + i)
        if pattern == "ping-pong" and with_messages and rank == 0:
            comm.recv(peer, 100 + ITERATIONS - 1)
        comm.wait_sends()
        seconds = (time.perf_counter() - start) / ITERATIONS
        if not with_messages:  # the receives posted for the round still wait: fill and take them
            for i in range(ITERATIONS):
                comm.send(message, peer, 100 + i)
            for i in range(ITERATIONS):
                comm.recv(peer, 100 + i)
            comm.wait_sends()
        return seconds

    out = {}
    for pattern in PATTERNS:
        comm = own if pattern != "both ways, shared" else shared
        quiet, busy = [], []
        for _ in range(args.rounds):
            quiet.append(one_round(comm, pattern, False))
            busy.append(one_round(comm, pattern, True))
        out[pattern] = {"compute_ms": statistics.median(quiet[3:]) * 1e3,
                        "iteration_ms": statistics.median(busy[3:]) * 1e3}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no teardown: see pulse_torch.profile_job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--bytes", type=int, default=10000, help="bytes per message")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "exchange.json"
        command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
                   __file__, "--worker", "--rounds", str(args.rounds), "--bytes", str(args.bytes),
                   "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    print(f"{'pattern':<20} {'compute ms':>10} {'iteration ms':>12} {'messages ms':>11}")
    for pattern, r in rows.items():
        computes = 2 if pattern == "ping-pong" else 1  # a ping-pong iteration holds the peer's block too
        r["messages_ms"] = r["iteration_ms"] - computes * r["compute_ms"]
        print(f"{pattern:<20} {r['compute_ms']:10.3f} {r['iteration_ms']:12.3f} {r['messages_ms']:11.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join(sys.argv), "bytes": args.bytes, "rounds": args.rounds,
           "iterations_per_round": ITERATIONS, "rows": rows}
    (RESULTS / "gloo_exchange.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
