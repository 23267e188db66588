"""A torchrun check of the torch runtime: one training step per configuration, results to files.

::

    torchrun --nproc-per-node 4 tests/torch_worker_check.py --layout 2x2 --layout 4x1 --out DIR \\
        --config pulse:greedy_v_1f1b --config sequential:1f1b
    torchrun --nproc-per-node 2 tests/torch_worker_check.py --mode silent-peer --out DIR

``train`` mode runs every configuration under every PPxDP layout on the same
processes (one start-up for all), M = 2 x PP microbatches unless
``--microbatches`` says otherwise. Each rank writes
``DIR/pp<P>xdp<D>/<partitioner>-<schedule>[-ordered]/rank<r>.npz`` (the gradients of
its chunks, by parameter name) and ``rank<r>.json`` (payload and header bytes
per peer, the payload names it sent, its loss).
``silent-peer`` mode: rank 0 receives from rank 1, which never sends; rank 0
writes ``DIR/silent.json`` with the error it got.

The pieces a test needs to predict those files live here too, so the
processes and the test build the same plan and data: ``plan_case``,
``make_batches``, ``reference_gradients``, ``max_relative_error``. Many
single-process tests import them too (this folder is on their sys.path).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from check_batches import check_batches  # beside this file
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_hardware
from pulse.partition import partition
from pulse.placement import Placement
from pulse.runtime.errors import CommTimeout
from pulse.runtime.executor import StageExecutor
from pulse.runtime.protocols import Batches
from pulse.runtime.wiring import MAIN, MessageTag
from pulse.schedule.generators import make_schedule
from pulse.schedule.ir import Schedule
from pulse.schedule.lower import lower
from pulse.spec import ModelSpec
from pulse.zoo import get_spec
from pulse_torch.diffusion import eps_loss
from pulse_torch.model import build_model

DTYPES = {"float32": torch.float32, "float64": torch.float64}
EMULATED_BANDWIDTH = 2e7  # bytes/s: a tiny-unet float64 message holds the link about a millisecond


def plan_case(spec: ModelSpec, partitioner: str, schedule: str, pp: int, microbatches: int,
              microbatch_size: int = 1, folds: int = 1) -> tuple[Placement, Schedule]:
    """Placement from the analytic CPU cost table, and the schedule with its messages."""
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, microbatch_size)
    placement = partition(partitioner, spec, costs, pp, folds=folds)
    compute = make_schedule(schedule, placement, microbatches, costs)
    return placement, lower(compute, spec, placement)


def make_batches(spec: ModelSpec, microbatch_size: int, replica: int = 0, seed: int = 0) -> Batches:
    """Microbatch -> the batch training's synthetic feed makes for it (``check_batches``), as torch tensors."""
    return check_batches(spec, microbatch_size, replica, seed, torch.from_numpy)


def reference_gradients(spec: ModelSpec, batches: list[Batches], microbatches: int,
                        dtype: torch.dtype, seed: int = 0) -> tuple[dict[str, np.ndarray], list[float]]:
    """Single-process training step over every replica's microbatches: gradients and per-replica losses.

    The whole model from ``build_model`` (not the backend under test); the
    loss gradient is scaled as the pipeline scales it (1/M, then the
    data-parallel mean).
    """
    model = build_model(spec, seed=seed, dtype=dtype)
    place = lambda t: t.to(dtype) if t.is_floating_point() else t
    losses = []
    for provider in batches:
        total = 0.0
        for mb in range(microbatches):
            batch = provider(mb)
            out = model.forward_reference({k: place(v) for k, v in batch.items() if k != "target"})
            loss, grad = eps_loss({MAIN: out}, batch)
            out.backward(grad[MAIN] / (microbatches * len(batches)))
            total += float(loss)
        losses.append(total / microbatches)
    prefix = "layers."
    grads = {n[len(prefix):]: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
             if p.grad is not None}
    return grads, losses


def max_relative_error(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], floor: float = 1e-6) -> float:
    """max |got - ref| / max |ref| over tensors, the denominator floored at ``floor`` x the largest
    reference entry: some gradients are zero in exact arithmetic (a key bias before a softmax)
    and hold only rounding noise, which no two summation orders share."""
    if got.keys() != ref.keys():
        raise AssertionError(f"parameter names differ: {sorted(set(got) ^ set(ref))[:6]}")
    scale = max(float(np.max(np.abs(r))) for r in ref.values())
    return max(float(np.max(np.abs(got[k] - r))) / max(float(np.max(np.abs(r))), floor * scale)
               for k, r in ref.items())


# -- the torchrun entry ---------------------------------------------------------------
def _write(out: Path, rank: int, grads: dict[str, np.ndarray], record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank}.npz", **grads)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _run_config(args: argparse.Namespace, config: str, ctx, spec: ModelSpec, out: Path) -> None:
    from pulse_torch.backend import TorchBackend
    from pulse_torch.comm import TorchCommunicator

    partitioner, schedule_name, *mode = config.split(":")  # "ordered": NCCL's matching on gloo; "emulated": a slow link
    layout = ctx.layout
    microbatches = args.microbatches or 2 * layout.pp
    placement, schedule = plan_case(spec, partitioner, schedule_name, layout.pp, microbatches,
                                    args.microbatch_size)
    comm = TorchCommunicator.from_context(ctx, timeout=args.timeout,  # fresh counters per config
                                          match_by_tag=False if mode == ["ordered"] else None)
    backend = TorchBackend(dtype=DTYPES[args.dtype], seed=args.seed)
    if mode == ["emulated"]:  # every rank books the others' inbound links on one board, as training does
        from pulse_torch.emulation.link_board import shared_links_of_job
        from pulse_torch.emulation.throttle import ThrottledCommunicator

        comm = ThrottledCommunicator(comm, EMULATED_BANDWIDTH, backend.nbytes, links=shared_links_of_job(),
                                     bookings=[])
    ex = StageExecutor(
        device=layout.stage, spec=spec, placement=placement, schedule=schedule, backend=backend, comm=comm,
        batches=make_batches(spec, args.microbatch_size, layout.replica, args.seed), loss_fn=eps_loss,
        pipeline_ranks=layout.pp_ranks(), dp_group=layout.dp_ranks() if layout.dp > 1 else [],
        timeout=args.timeout)
    stats = ex.run_step()
    comm.wait_sends(args.timeout)
    grads = {n: backend.to_numpy(g) for n, g in ex.gradients().items()}
    record = {"rank": layout.rank, "stage": layout.stage, "replica": layout.replica,
              "bytes_sent": {str(k): v for k, v in comm.bytes_sent.items()},
              "header_bytes": {str(k): v for k, v in comm.header_bytes.items()},
              "allreduce_bytes": comm.allreduce_bytes,
              "messages": [[m.peer, m.direction, m.name, m.nbytes] for m in comm.log],
              "loss": stats.loss, "peak_early": comm.peak_early, "early_left": len(comm.early),
              "link_bookings": getattr(comm, "bookings", None) or []}  # emulated: every send's slots
    _write(out / config.replace(":", "-"), layout.rank, grads, record)
    comm.barrier(args.timeout)  # no rank starts the next config while a peer still sends


def _silent_peer(args: argparse.Namespace, ctx) -> None:
    """Rank 0 waits ``--recv-timeout`` s for a message rank 1 never sends.

    Gloo closes the connection to a peer after a timed-out receive, so no
    collective can follow: rank 1 just waits for rank 0's result file.
    """
    from pulse_torch.comm import TorchCommunicator

    comm = TorchCommunicator.from_context(ctx)
    result = Path(args.out) / "silent.json"
    if comm.rank != 0:
        deadline = time.monotonic() + args.timeout
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    started = time.monotonic()
    try:
        comm.recv(1, MessageTag("F", 0, 0, 0, MAIN), timeout=args.recv_timeout)
        record: dict = {"error": None}
    except CommTimeout as exc:
        record = {"error": str(exc), "type": type(exc).__name__}
    record["elapsed"] = time.monotonic() - started
    result.parent.mkdir(parents=True, exist_ok=True)
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(result)  # atomic: rank 1 never reads half a file


def _inline_messages(args: argparse.Namespace, ctx) -> None:
    """Rank 0 sends one tag's message three times (the last one grown), rank 1 takes the second and
    third through receives posted before the sends; rank 1 writes what arrived and what rank 0 put
    on the wire."""
    from pulse_torch.comm import TorchCommunicator

    comm = TorchCommunicator.from_context(ctx, timeout=args.timeout)
    tag = MessageTag("F", 0, 0, 0, MAIN)
    sizes = (5, 5, 9)
    record: dict = {"received": [], "wire": []}
    for i, n in enumerate(sizes):
        if comm.rank == 1 and i:
            comm.post_recv(0, [tag])  # before rank 0 sends: the barrier below orders them
        comm.barrier()
        if comm.rank == 0:
            before = comm.wire_messages.get(1, 0)
            comm.send(torch.arange(n, dtype=torch.float32) + i, 1, tag)
            comm.wait_sends()
            record["wire"].append(comm.wire_messages[1] - before)
        else:
            record["received"].append(comm.recv(0, tag).tolist())
        comm.barrier()
    if comm.rank == 0:
        comm.send(torch.tensor(record["wire"], dtype=torch.float32), 1, MessageTag("F", 1, 0, 0, MAIN))
        comm.wait_sends()
    else:
        record["wire"] = [int(x) for x in comm.recv(0, MessageTag("F", 1, 0, 0, MAIN)).tolist()]
        record["left_posted"] = len(comm.posted)
        to_lower, to_higher = comm.direction_group(1, 0), comm.direction_group(0, 1)  # each direction: own connection
        record["own_groups"] = to_lower is not None and to_higher is not None and to_lower is not to_higher
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "inline.json").write_text(json.dumps(record))
    comm.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["train", "silent-peer", "inline"], default="train")
    parser.add_argument("--model", default="tiny-unet")
    parser.add_argument("--layout", action="append", default=[], help="PPxDP, e.g. 2x2 (repeatable)")
    parser.add_argument("--config", action="append", default=[],
                        help="partitioner:schedule[:ordered|:emulated] (repeatable; ordered: match messages "
                             "by order, not tag, as NCCL/HCCL do; emulated: behind --emulate-bandwidth's link)")
    parser.add_argument("--microbatches", type=int, default=0, help="M (default: 2 x PP)")
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--recv-timeout", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import torch.distributed as dist

    from pulse_torch.dist import build_context, init_distributed

    if args.mode in ("silent-peer", "inline"):
        ctx = init_distributed(int(os.environ["WORLD_SIZE"]), 1, timeout_s=args.timeout, backend="gloo")
        (_silent_peer if args.mode == "silent-peer" else _inline_messages)(args, ctx)
    else:
        layouts = [tuple(int(x) for x in text.lower().split("x")) for text in args.layout or ["2x1"]]
        ctx = init_distributed(*layouts[0], timeout_s=args.timeout, backend="gloo")
        spec = get_spec(args.model).with_act_bytes(torch.tensor([], dtype=DTYPES[args.dtype]).element_size())
        for i, (pp, dp) in enumerate(layouts):
            if i:
                ctx = build_context(pp, dp, ctx.backend, ctx.device)
            for config in args.config:
                _run_config(args, config, ctx, spec, Path(args.out) / f"pp{pp}xdp{dp}")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
