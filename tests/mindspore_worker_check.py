"""A real-process check of the MindSpore runtime: one pipeline step per configuration, results to files.

::

    msrun --worker_num 2 --local_worker_num 2 --master_port P --log_dir LOGS --join True \\
        python tests/mindspore_worker_check.py --out DIR --config pulse:greedy_v_1f1b --config sequential:1f1b
    (scheduler + 2 workers started by hand, as msrun does)
        python tests/mindspore_worker_check.py --mode die --out DIR

``train`` mode: pp 2, float32, M microbatches of one sample (default 2), one
step per configuration on the same processes (one start-up for all): mccl
for the all-reduces, gloo (``pulse_mindspore.transport``) for send/recv on
CPU. Each worker writes ``DIR/<partitioner>-<schedule>/rank<r>.npz`` (the
gradients of its chunks, by parameter name) and ``rank<r>.json`` (payload
and header bytes per peer, the names of the tensors it sent, its loss).

``die`` mode: rank ``--die-rank`` leaves the process hard (``os._exit``,
as a killed process would) at its ``--die-at-send``-th send of the step,
after printing ``pulse fault injection: rank R exits hard ... t=<time>``.
Every other worker prints one ``worker_check: rank r: error: ...`` line
with the time and exits with code 2.

The pieces a test needs to predict those files live here too, so the
processes and the test build the same plan and data: ``plan_case``,
``make_batches``, ``reference_gradients`` (single-process tests import them
too). Framework-free but for MindSpore itself (torch only through the
communicator's gloo carrier).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from check_batches import check_batches  # beside this file
from pulse.costs import AnalyticProfiler
from pulse.errors import PulseError
from pulse.hardware import load_hardware
from pulse.partition import partition
from pulse.placement import Placement
from pulse.runtime.protocols import CommunicatorDefaults, CommunicatorWrapper
from pulse.schedule.generators import make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.zoo import get_spec

PP = 2


def spec_of(model: str) -> ModelSpec:
    return get_spec(model).with_act_bytes(4)  # float32 on the wire


def plan_case(spec: ModelSpec, partitioner: str, schedule: str, microbatches: int,
              microbatch_size: int = 1) -> tuple[Placement, Schedule]:
    """Placement at pp 2 from the analytic CPU cost table, and the schedule with its messages."""
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, microbatch_size)
    placement = partition(partitioner, spec, costs, PP)
    return placement, lower(make_schedule(schedule, placement, microbatches), spec, placement)


def make_batches(spec: ModelSpec, microbatch_size: int, replica: int = 0, seed: int = 0) -> Any:
    """Microbatch -> the batch training's synthetic feed makes for it (``check_batches``), as MindSpore tensors."""
    from pulse_mindspore.model import to_tensor

    return check_batches(spec, microbatch_size, replica, seed, to_tensor)


def reference_gradients(spec: ModelSpec, microbatches: int, microbatch_size: int = 1,
                        seed: int = 0) -> tuple[dict[str, np.ndarray], float]:
    """The whole model in one process (``build_model`` and ``mindspore.vjp``, not the backend under
    test): gradients over the microbatches, loss gradient scaled by 1/M as the pipeline scales it,
    and the mean loss."""
    import mindspore as ms

    from pulse_mindspore.diffusion import eps_loss
    from pulse_mindspore.model import MAIN, build_model

    net = build_model(spec, seed=seed)
    params = net.params_by_name()
    batches = make_batches(spec, microbatch_size, seed=seed)
    total: dict[str, np.ndarray] = {}
    losses = []
    for mb in range(microbatches):
        batch = batches(mb)
        shared = {k: v for k, v in batch.items() if k not in (MAIN, "target")}
        out, vjp_fn = ms.vjp(lambda h: net(h, shared), batch[MAIN], weights=list(params.values()))
        loss, grad = eps_loss({MAIN: out}, batch)
        losses.append(loss)
        _, grads = vjp_fn(grad[MAIN] * (1.0 / microbatches))
        for name, g in zip(params, grads):
            total[name] = total.get(name, 0.0) + g.asnumpy()
    return total, sum(losses) / microbatches


class Recording(CommunicatorWrapper):
    """A communicator that logs every send (peer, tensor name, bytes) and may die at the k-th one.
    A transfer's tensors go through ``send`` one by one (``CommunicatorDefaults.send_group``)."""

    send_group = CommunicatorDefaults.send_group
    recv_group = CommunicatorDefaults.recv_group

    def __init__(self, inner: Any, die_at_send: int = 0) -> None:
        super().__init__(inner)
        self.die_at_send = die_at_send
        self.log: list[list[Any]] = []

    def send(self, tensor: Any, peer_rank: int, tag: Any, timeout: float | None = None) -> None:
        if self.die_at_send and len(self.log) + 1 == self.die_at_send:
            print(f"pulse fault injection: rank {self.inner.rank} exits hard (send {self.die_at_send}, "
                  f"t={time.time():.3f})", file=sys.stderr, flush=True)
            os._exit(1)  # no finally, no atexit: as a killed process
        self.log.append([peer_rank, getattr(tag, "name", str(tag)), int(tensor.nbytes)])
        self.inner.send(tensor, peer_rank, tag, timeout)


def run_config(args: argparse.Namespace, comm: Any, config: str, spec: ModelSpec, die_at_send: int = 0) -> Path:
    """One step of ``config`` on this worker; returns the folder it wrote to."""
    from pulse.runtime.executor import StageExecutor
    from pulse_mindspore.backend import MindSporeBackend
    from pulse_mindspore.diffusion import eps_loss

    partitioner, schedule_name = config.split(":")
    placement, schedule = plan_case(spec, partitioner, schedule_name, args.microbatches)
    counted = Recording(comm, die_at_send)
    before = dict(comm.bytes_sent), dict(comm.header_bytes)
    ex = StageExecutor(device=comm.rank, spec=spec, placement=placement, schedule=schedule,
                       backend=MindSporeBackend(seed=args.seed), comm=counted,
                       batches=make_batches(spec, 1, seed=args.seed), loss_fn=eps_loss,
                       pipeline_ranks=list(range(PP)), dp_group=[], timeout=args.timeout)
    stats = ex.run_step()
    comm.wait_sends(args.timeout)
    delta = [{str(p): n - b.get(p, 0) for p, n in now.items() if n - b.get(p, 0)}
             for now, b in zip((comm.bytes_sent, comm.header_bytes), before)]
    record = {"rank": comm.rank, "bytes_sent": delta[0], "header_bytes": delta[1], "messages": counted.log,
              "loss": stats.loss, "peak_early": comm.peak_early, "early_left": len(comm.early),
              "carrier": comm.transport.name}
    folder = Path(args.out) / config.replace(":", "-")
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"rank{comm.rank}.npz", **{n: g.asnumpy() for n, g in ex.gradients().items()})
    (folder / f"rank{comm.rank}.json").write_text(json.dumps(record))
    comm.barrier(args.timeout)  # nobody starts the next configuration while a peer still sends
    return folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["train", "die"], default="train")
    parser.add_argument("--model", default="tiny-unet")
    parser.add_argument("--config", action="append", default=[], help="partitioner:schedule (repeatable)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-at-send", type=int, default=1)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mindspore.communication import init

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        init()  # the scheduler serves the cluster until the workers leave
        return 0
    init()
    from pulse_mindspore.comm import MindSporeCommunicator

    comm = MindSporeCommunicator(timeout=args.timeout, p2p=True)
    spec = spec_of(args.model)
    if args.mode == "train":
        for config in args.config or ["pulse:greedy_v_1f1b"]:
            run_config(args, comm, config, spec)
        return 0
    die_at = args.die_at_send if comm.rank == args.die_rank else 0
    try:
        run_config(args, comm, "pulse:greedy_v_1f1b", spec, die_at)
    except PulseError as exc:  # what a survivor saw, and when
        print(f"worker_check: rank {comm.rank}: error: {exc} (t={time.time():.3f})", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
