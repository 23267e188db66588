"""One rank of the cross-backend parity run over real processes (launched by ``benchmarks/parity.py --processes``).

::

    torchrun --nproc-per-node 2 benchmarks/parity_ranks.py --backend torch     --weights W.npz --data D.npz ...
    msrun --worker_num 2 ... python benchmarks/parity_ranks.py --backend mindspore --weights W.npz --data D.npz ...

Both launches run the same plan (``case``: the pulse V placement at P = 2,
greedy_v_1f1b, M = 2 microbatches of 1 sample, float32), start from the same
weights (W.npz, by reference checkpoint name, loaded into each rank's own
chunks) and read the same batches (D.npz, ``<step>/<microbatch>/<input>``,
drawn once by the launcher). Per step: the executor's step (torch: gloo
send/recv; MindSpore: gloo send/recv, mccl all-reduce), AdamW on every chunk
(no clipping), and one all-reduce of (loss sum, count) so every rank holds the
step's mean loss. Rank 0
writes ``--out`` (JSON: the per-step losses, seconds, carrier).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

P, M, MBS, LR, SEED = 2, 2, 1, 1e-3, 0


def case(model: str) -> tuple[Any, Any, Any]:
    """(spec, placement, program): the plan both backends run."""
    from pulse.costs import AnalyticProfiler
    from pulse.hardware import load_hardware
    from pulse.partition import partition
    from pulse.schedule.generators import make_schedule
    from pulse.schedule.lower import lower
    from pulse.zoo import get_spec

    spec = get_spec(model).with_act_bytes(4)  # float32 on the wire
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    placement = partition("pulse", spec, costs, P)
    return spec, placement, lower(make_schedule("greedy_v_1f1b", placement, M), spec, placement)


class FileBatches:
    """The executor's ``Batches``: microbatch ``mb`` of the current step, read from the shared file."""

    def __init__(self, data: Any, convert: Callable[[np.ndarray], Any]) -> None:
        self.data, self.convert, self.step = data, convert, 1

    def __call__(self, mb: int) -> dict[str, Any]:
        prefix = f"{self.step}/{mb}/"
        return {k[len(prefix):]: self.convert(self.data[k]) for k in self.data.files if k.startswith(prefix)}


def torch_rank(args: argparse.Namespace) -> tuple[Any, Any, Any, Callable, Callable]:
    """(communicator, backend, batches, loss_fn, load weights into a chunk) of a torchrun rank."""
    import torch

    from pulse_torch.backend import TorchBackend
    from pulse_torch.comm import TorchCommunicator
    from pulse_torch.diffusion import eps_loss
    from pulse_torch.dist import init_distributed
    from pulse_torch.layers import reference_key

    torch.set_num_threads(1)
    comm = TorchCommunicator.from_context(init_distributed(P, 1, args.timeout, backend="gloo"), timeout=args.timeout)
    weights = np.load(args.weights)

    def load(spec: Any, chunk: Any) -> None:
        for lname, module in chunk.layers.items():
            layer = spec.layers[spec.index(lname)]
            for pname, p in module.named_parameters():
                with torch.no_grad():
                    p.copy_(torch.from_numpy(weights[reference_key(layer, pname)]))

    convert = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return (comm, TorchBackend(dtype=torch.float32, seed=SEED, lr=LR), FileBatches(np.load(args.data), convert),
            eps_loss, load)


def mindspore_rank(args: argparse.Namespace) -> tuple[Any, Any, Any, Callable, Callable]:
    """The same for an msrun worker (after ``init()``)."""
    import mindspore as ms
    from mindspore.communication import init

    from pulse_mindspore.backend import MindSporeBackend
    from pulse_mindspore.comm import MindSporeCommunicator
    from pulse_mindspore.diffusion import eps_loss
    from pulse_mindspore.model import to_tensor
    from pulse_mindspore.weights import import_weights

    init()
    comm = MindSporeCommunicator(timeout=args.timeout, p2p=True)
    load = lambda spec, chunk: import_weights(spec, chunk.layers, Path(args.weights), strict=True)  # noqa: E731
    return (comm, MindSporeBackend(dtype=ms.float32, seed=SEED, lr=LR), FileBatches(np.load(args.data), to_tensor),
            eps_loss, load)


def train(args: argparse.Namespace) -> dict | None:
    from pulse.runtime.executor import StageExecutor

    spec, placement, program = case(args.model)
    comm, backend, batches, loss_fn, load = (torch_rank if args.backend == "torch" else mindspore_rank)(args)
    ex = StageExecutor(device=comm.rank, spec=spec, placement=placement, schedule=program, backend=backend,
                       comm=comm, batches=batches, loss_fn=loss_fn, pipeline_ranks=list(range(P)), dp_group=[],
                       timeout=args.timeout)
    for chunk in ex.chunks.values():
        load(spec, chunk)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batches.step = step
        stats = ex.run_step()
        comm.wait_sends(args.timeout)
        for chunk in ex.chunks.values():  # AdamW, no clipping: what parity.py's in-process run does
            backend.optimizer_step(chunk)
        mine = list(stats.losses.values())
        shared = backend.from_numpy(np.array([sum(mine), len(mine)], np.float64))  # float32 on both sides
        total, count = backend.to_numpy(comm.all_reduce(shared, list(range(P)), args.timeout)).tolist()
        losses.append(total / count)
        if comm.rank == 0:
            print(f"  {args.backend:9s} step {step:3d}/{args.steps}  loss {losses[-1]:.6f}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)
    seconds = time.perf_counter() - start
    if hasattr(comm, "transport"):  # MindSpore: its send/recv carrier
        carrier = comm.transport.name
    else:
        import torch.distributed as dist
        carrier = dist.get_backend()
    comm.barrier(args.timeout)
    if comm.rank != 0:
        return None
    return {"backend": args.backend, "losses": losses, "seconds": seconds, "carrier": carrier}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mindspore"), required=True)
    parser.add_argument("--model", default="tiny-unet")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.backend == "mindspore" and os.environ.get("MS_ROLE") == "MS_SCHED":
        from mindspore.communication import init
        init()  # the scheduler serves the cluster until the workers leave
        return 0
    report = train(args)
    if report is not None:
        args.out.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
