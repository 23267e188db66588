"""torch.distributed.pipelining's own schedules training the peer benchmark's UNet, one process per rank.

``run_tp(TPRun)`` launches P gloo processes on loopback (this file, ``--rank r``) (each pinned to its
share of the cores as PULSE's ranks are, ``pulse.cores.pin_process``, one
torch thread each) and runs every schedule of ``TPRun.schedules`` in them,
one after another, each on fresh weights (seed 0) and the same batches::

    rank r:  build the UNet (seed 0), keep its stage(s) of the hand cut (``peer_models``: the real-size
             UNet is built on the meta device and only the rank's stages materialized)
             PipelineStage(stage, index, stages, cpu) for each
             schedule = Schedule1F1B / ScheduleInterleaved1F1B / ... (loss: MSE to the noise)
             per step: zero_grad; schedule.step(sample | nothing, target=noise (last stage),
                                                timesteps=..., ctx=...);
                       clip by the pipeline's norm (torchtitan's recipe; PULSE's --clip 1.0);
                       fused AdamW step (as PULSE's);
                       all_reduce([loss, bytes])  (every rank ends the step together, as PULSE's
                                                   log.json row: its step ends in one all-reduce)

Stage placement, as each schedule expects: one stage per rank (GPipe,
1F1B); two per rank, ``r`` and ``r + P`` (interleaved 1F1B, interleaved zero
bubble); ``r`` and ``2P - 1 - r`` (ZBV: a V). Messages go through
``peer_link`` (PULSE's emulated link, bytes counted from the wire).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from peer_stages import WORKAROUNDS
from peer_trace import ActionTracer, traced

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
           "interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
ZERO_BUBBLE = ("interleaved_zb", "zbv")
LR = 1e-4
CLIP = 1.0  # pulse train's default --clip


@dataclass(frozen=True)
class TPRun:
    """One launch: ``pp`` ranks, ``schedules`` run in order; ``cuts``: stage cut points over the UNet's
    units, by stage count (P for one stage per rank, 2P for two); ``bandwidth`` bytes/s (None: free);
    ``workarounds``: ``peer_stages.WORKAROUNDS`` to apply (each schedule takes those it needs,
    ``workarounds_for``; leave one out to see what fails without it)."""

    pp: int
    microbatches: int
    microbatch_size: int
    steps: int
    warmup: int
    cuts: dict[int, list[int]]
    schedules: tuple[str, ...] = ("1f1b",)
    bandwidth: float | None = None
    workarounds: tuple[str, ...] = WORKAROUNDS
    timeout_s: float = 600.0
    out: str = ""
    model: str = "small"  # peer_models.MODELS
    resolution: int = 0  # pixels; 0: the model's default
    trace: str = ""  # a Chrome trace of the last step's actions on every rank (peer_trace), or none


@dataclass
class ScheduleResult:
    """One schedule's run: per step wall seconds (rank 0, after the closing all-reduce), pipeline
    payload bytes (all ranks), mean loss; step 0's per-microbatch losses (the split check)."""

    schedule: str
    workarounds: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    first_losses: list[float] = field(default_factory=list)
    link_wait_seconds: float = 0.0
    peak_rss_bytes: list[int] = field(default_factory=list)  # per rank: its process's peak so far
    error: str | None = None

    def summary(self, warmup: int) -> dict:
        timed = self.seconds[warmup:] or self.seconds
        return {**asdict(self), "median_s": statistics.median(timed) if timed else None,
                "bytes_per_step": self.bytes[-1] if self.bytes else None}


def workarounds_for(schedule: str, given: tuple[str, ...]) -> tuple[str, ...]:
    """``given``, less ``fresh_outputs`` where the schedule runs without it (its clones cost copies):
    only the zero-bubble schedules detach stage outputs in place before their weight-backward."""
    return tuple(w for w in given if w != "fresh_outputs" or schedule in ZERO_BUBBLE)


def stage_indices(schedule: str, rank: int, pp: int) -> list[int]:
    if schedule in ("gpipe", "1f1b"):
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp]


def _schedule(name: str, stages: list, microbatches: int):
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, CLASSES[name])
    loss = torch.nn.functional.mse_loss
    if name in ("gpipe", "1f1b"):
        return cls(stages[0], microbatches, loss_fn=loss)
    return cls(stages, microbatches, loss_fn=loss)


def run_schedule(cfg: TPRun, name: str, rank: int, link) -> ScheduleResult:
    """Train ``cfg.steps`` steps of schedule ``name`` on this rank; every rank returns the same figures."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from peer_models import peer_model

    pp, result = cfg.pp, ScheduleResult(name, list(workarounds_for(name, cfg.workarounds)))
    count = pp if name in ("gpipe", "1f1b") else 2 * pp
    model = peer_model(cfg.model, cfg.resolution or None)
    indices = stage_indices(name, rank, pp)
    modules = model.rank_stages(cfg.cuts[count], indices, workarounds_for(name, cfg.workarounds))
    stages = [PipelineStage(m, i, count, torch.device("cpu")) for m, i in zip(modules, indices)]
    schedule = _schedule(name, stages, cfg.microbatches)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=True)  # as PULSE's (pulse_torch.optimizers)
    first, last = 0 in indices, count - 1 in indices
    tracer = ActionTracer(stages) if cfg.trace else None
    for step in range(cfg.steps):
        if tracer:
            tracer.restart()
        batch = model.batch(cfg.microbatches * cfg.microbatch_size, seed=step)
        optimizer.zero_grad(set_to_none=True)
        sent, waited = link.bytes, link.waited_seconds
        losses: list = []
        start = time.perf_counter()
        args = (batch.sample,) if first else ()
        schedule.step(*args, target=batch.target if last else None, losses=losses if last else None,
                      return_outputs=False, timesteps=batch.timesteps, ctx=batch.ctx)
        with traced(tracer, "clip"):
            clip_pipeline(params)
        with traced(tracer, "optimizer"):
            optimizer.step()
        mine = [float(x.detach()) for x in losses]
        totals = torch.tensor([sum(mine), len(mine), link.bytes - sent], dtype=torch.float64)
        dist.all_reduce(totals)
        seconds = time.perf_counter() - start
        result.seconds.append(seconds)
        result.losses.append(float(totals[0] / max(totals[1], 1)))
        result.bytes.append(int(totals[2]))
        result.link_wait_seconds += link.waited_seconds - waited
        if step == 0:  # the split check: the last stage's per-microbatch losses, on every rank
            holder = [mine if last else None]
            dist.broadcast_object_list(holder, src=_rank_of_last(name, pp))
            result.first_losses = holder[0]
    result.peak_rss_bytes = _peak_rss_per_rank(rank, pp)
    if tracer:
        Path(f"{cfg.trace}.{name}.rank{rank}").write_text(json.dumps(tracer.events))
    return result


def clip_pipeline(params: list, limit: float = CLIP) -> None:
    """Clip by the whole pipeline's gradient norm, as torchtitan does under pipeline parallelism
    (each rank's total norm, squared, summed over the ranks, then ``clip_grads_with_norm_``): the
    recipe PULSE's runs train with (``--clip``, default 1.0)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    square = torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2
    dist.all_reduce(square)
    torch.nn.utils.clip_grads_with_norm_(params, limit, square.sqrt().float())


def _peak_rss_per_rank(rank: int, pp: int) -> list[int]:
    """Each rank's peak resident bytes so far (its process's high-water mark: this schedule's, or an
    earlier one's in the same process if that was higher)."""
    import resource

    import torch.distributed as dist

    peaks = torch.zeros(pp, dtype=torch.float64)
    peaks[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    dist.all_reduce(peaks)
    return [int(x) for x in peaks]


def error_line(exc: BaseException) -> str:
    """The first non-empty line of an error and of what caused it (pipelining wraps its backward's)."""
    lines = []
    while exc is not None and len(lines) < 2:
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        lines.append(f"{type(exc).__name__}: {text}"[:240])
        exc = exc.__cause__
    return " <- ".join(lines)


def _rank_of_last(name: str, pp: int) -> int:
    """The rank holding the last stage: the last rank, or rank 0 in a V (ZBV)."""
    return 0 if name == "zbv" else pp - 1


def _worker(rank: int, cfg: TPRun, port: int) -> None:
    import torch.distributed as dist

    from peer_link import Link, install
    from pulse.cores import pin_process
    from pulse.host_heap import keep_freed_memory

    pin_process(rank, cfg.pp)
    keep_freed_memory()  # the host heap PULSE's CPU ranks keep (pulse.host_heap): the same allocator on both sides
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cfg.pp,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    link = Link(cfg.bandwidth)
    install(link)
    results = []
    try:
        for name in cfg.schedules:
            try:
                results.append(run_schedule(cfg, name, rank, link).summary(cfg.warmup))
            except Exception as exc:  # recorded: a schedule that fails out of the box is a finding
                results.append(ScheduleResult(name, error=error_line(exc)).summary(cfg.warmup))
                _rank_file(cfg, rank).write_text(json.dumps(results))
                raise
        _rank_file(cfg, rank).write_text(json.dumps(results))
    finally:
        link.close()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(cfg: TPRun) -> list[dict]:
    """Launch ``cfg.pp`` rank processes (this file, ``--rank``) and wait for them: each schedule's
    summary, or its error (a rank that fails stops the launch; the others are ended)."""
    out = Path(cfg.out)
    for r in range(cfg.pp):
        _rank_file(cfg, r).unlink(missing_ok=True)
    config = out.with_suffix(".config.json")
    config.write_text(json.dumps(asdict(cfg)))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, __file__, "--config", str(config), "--rank", str(r),
                               "--port", str(port)], env=env) for r in range(cfg.pp)]
    try:
        codes = _wait_all(ranks, cfg.timeout_s + 120)
    finally:
        for proc in ranks:  # only the ranks this launch started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    files = [_rank_file(cfg, r) for r in range(cfg.pp)]
    if not any(f.exists() for f in files):
        raise RuntimeError(f"TP ranks exited with {codes} and wrote no result")
    return merged([json.loads(f.read_text()) for f in files if f.exists()])


def _rank_file(cfg: TPRun, rank: int) -> Path:
    return Path(f"{cfg.out}.rank{rank}")


def merged(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's records (every rank's figures agree: all-reduced), each with the error that
    stopped its schedule: the one a rank raised itself, not a peer's dropped connection."""
    rows = per_rank[0]
    for i, row in enumerate(rows):
        errors = [ranks[i]["error"] for ranks in per_rank if i < len(ranks) and ranks[i]["error"]]
        own = [e for e in errors if "pair.cc" not in e and "Connection" not in e]
        row["error"] = (own or errors or [None])[0]
    return rows


def _wait_all(ranks: list, limit_s: float) -> list[int | None]:
    """Exit codes; once one rank fails the rest get a few seconds (a peer waits on it forever)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in ranks]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.2)
    return [p.poll() for p in ranks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one TP rank (launched by run_tp)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw["cuts"] = {int(k): v for k, v in raw["cuts"].items()}
    raw["schedules"], raw["workarounds"] = tuple(raw["schedules"]), tuple(raw["workarounds"])
    _worker(args.rank, TPRun(**raw), args.port)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
