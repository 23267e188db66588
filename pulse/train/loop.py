"""The training loop every backend runs, written once against the runtime's protocols.

::

    train_step:  executor.run_step (F/B/W, sends, receives; data-parallel buckets during backward)
                 ─ wait for this rank's sends ─ clip by the pipeline's global norm ─ optimizer step
                 ─ one sum of (loss, count, bytes) over the world: every rank returns the same record
    run_steps:   train_step for steps start .. steps - 1; a non-finite loss stops every rank;
                 after each step the ``after_step`` hook (rank 0's log.json; told when the records
                 must reach disk: a checkpoint's step, the last step, a failure), every
                 ``checkpoint_every`` steps (and the last one when asked) the ``checkpoint`` hook;
                 a preemption every rank voted for in the step's sum: log, checkpoint of that step
                 (marked preempted), ``Preempted`` (``pulse.train.preemption``)

What needs tensors stays in the backend: ``TrainingBackend`` adds the squared
gradient norm and gradient scaling to ``Backend``; ``StepCommunicator`` adds
waiting for sends and an uncounted sum of bookkeeping numbers to
``Communicator``. PyTorch and MindSpore implement both; nothing here differs
between them.
"""
from __future__ import annotations

import gc
import math
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Protocol, Sequence

import numpy as np

from pulse.errors import PulseError
from pulse.layout import Layout
from pulse.plan import Plan
from pulse.progress import Progress, fmt_bytes
from pulse.runtime.executor import StageExecutor
from pulse.runtime.protocols import Backend, ChunkHandle, Communicator, LossFn, TensorDict
from pulse.train.preemption import Preempted, Preemption
from pulse.train.run_config import RunConfig
from pulse.train.runlog import StepRecord
from pulse.train.resident import ResidentPeak
from pulse.train.schedules import DynamicLossScale, ema_decay, learning_rate
from pulse.spec import ModelSpec


class TrainingBackend(Backend, Protocol):
    """What the loop asks of a backend beyond running chunks."""

    def grad_square_sum(self, chunks: Sequence[ChunkHandle]) -> float:
        """Sum of the squared parameter gradients of ``chunks`` (float64 on the host)."""
        ...

    def scale_gradients(self, chunks: Sequence[ChunkHandle], factor: float) -> None: ...

    def unscale_gradients(self, chunks: Sequence[ChunkHandle], scale: float) -> None:
        """Divide the gradients by the fp16 loss scale (before clipping); ``overflowed`` then answers."""
        ...

    def overflowed(self, chunks: Sequence[ChunkHandle]) -> bool:
        """Whether this step's fp16 gradients overflowed on this rank, as the device knows it.

        Not ``isfinite`` of the gradients: Ascend 910A computes in saturation mode (an overflow
        reads as +-max, NaN as 0), so only its overflow status sees it. CUDA/CPU torch: found-inf
        of the unscale kernel; torch_npu: that and the device's overflow flag; MindSpore:
        ``mindspore.amp.all_finite`` (the float-status registers on 910A).
        """
        ...

    def set_learning_rate(self, chunks: Sequence[ChunkHandle], lr: float) -> None:
        """The rate of this step's optimizer update (optimizers built later start with it too)."""
        ...

    ema: dict  # parameter name -> its EMA (host or device tensor): what ``ema_update`` keeps
    ema_steps: int  # EMA updates so far (the warm-up's count; checkpointed beside ``ema``); the loop counts

    def ema_update(self, chunks: Sequence[ChunkHandle], decay: float) -> None:
        """ema = ema - (1 - decay) * (ema - parameter), per parameter, as diffusers' ``EMAModel.step``
        (a parameter with no average yet: a copy of it)."""
        ...


class StepCommunicator(Communicator, Protocol):
    """What the loop asks of a communicator beyond messages and all-reduce."""

    def wait_sends(self, timeout: float | None = None) -> None:
        """Block until every send so far has left (a step's end)."""
        ...

    def sum_values(self, values: Sequence[float], timeout: float | None = None) -> list[float]:
        """Bookkeeping numbers (loss, byte counts) summed over the world; not counted as traffic."""
        ...


class NonFiniteLoss(PulseError):
    """The loss became NaN or infinite: every rank stops (they all see the same summed loss)."""


class StepBatches:
    """The executor's ``Batches``: microbatches of one replica at the current step.

    ``batch(step, replica, microbatch)`` is the backend's data feed; ``step``
    is set by the loop before each step's actions.
    """

    def __init__(self, batch: Callable[[int, int, int], TensorDict], replica: int,
                 encoded: Callable[[int, int, int, str], Any] | None = None,
                 provide: Callable[[int, int, int, str, Any], None] | None = None,
                 shapes: Callable[[int], Hashable] | None = None) -> None:
        self.batch, self.replica = batch, replica
        self._encoded, self._provide = encoded, provide  # the feed's, for encode actions (pulse.encoders)
        self._shapes = shapes  # the feed's shapes_key: a step's aspect-ratio bucket
        self.step = 0

    def shapes_key(self) -> Hashable:
        """What the current step's shapes depend on besides the plan (its bucket; None: nothing)."""
        return None if self._shapes is None else self._shapes(self.step)

    def __call__(self, microbatch: int) -> TensorDict:
        return self.batch(self.step, self.replica, microbatch)

    @property
    def can_encode(self) -> bool:
        return self._encoded is not None and self._provide is not None

    def encode(self, microbatch: int, feeds: str, ahead: int = 0) -> Any:
        """An E action: the frozen encoder's output for ``feeds`` of this microbatch (of the step
        ``ahead`` steps on: a prefetch), as a tensor."""
        return self._encoded(self.step + ahead, self.replica, microbatch, feeds)

    def provide(self, microbatch: int, feeds: str, value: Any, ahead: int = 0) -> None:
        """An encode's output (made here or received) that this microbatch's batch is to read."""
        self._provide(self.step + ahead, self.replica, microbatch, feeds, value)


@dataclass(frozen=True)
class StepSettings:
    """How each optimizer step is taken (from the run configuration)."""

    clip: float = 0.0  # global gradient-norm limit; 0: no clipping
    lr: float = 1e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    ema: float | None = None  # EMA decay of the weights (the most it warms up to); None: no EMA
    ema_power: float | None = None  # None: diffusers' default warm-up; else its power schedule
    ema_inv_gamma: float = 1.0

    def lr_at(self, step: int) -> float:
        return learning_rate(self.lr, step, self.total_steps, self.lr_schedule, self.warmup_steps)

    def ema_at(self, update: int) -> float:
        """The decay of EMA update ``update`` (1-based), warmed up as diffusers' ``EMAModel``."""
        return ema_decay(self.ema, update, self.ema_power, self.ema_inv_gamma)

    @classmethod
    def of(cls, config: RunConfig) -> "StepSettings":
        return cls(config.clip, config.lr, config.lr_schedule, config.warmup_steps, config.steps, config.ema,
                   ema_power=config.ema_power, ema_inv_gamma=config.ema_inv_gamma)


class ScaledLoss:
    """The loss function with its output gradient times the fp16 loss scale (the loss value stays as is)."""

    def __init__(self, loss_fn: LossFn, backend: Backend, scaler: DynamicLossScale) -> None:
        self.loss_fn, self.backend, self.scaler = loss_fn, backend, scaler

    def __call__(self, outputs: TensorDict, batch: TensorDict) -> tuple[float, dict]:
        loss, grads = self.loss_fn(outputs, batch)
        return loss, {k: self.backend.scale(g, self.scaler.scale) for k, g in grads.items()}


@dataclass
class TrainingJob:
    """One rank's share of a plan, ready to train."""

    plan: Plan
    spec: ModelSpec
    layout: Layout
    backend: TrainingBackend
    comm: StepCommunicator
    executor: StageExecutor
    batches: StepBatches
    settings: StepSettings
    timeout: float | None
    loss_scale: DynamicLossScale | None = None  # fp16 only; the executor's loss is a ScaledLoss over it
    # a CPU rank's measured memory (no allocator counts it): its bytes in use, sampled after every action,
    # and its resident peak, above the baselines taken before the rank built its stage (``pulse.train.resident``)
    resident: ResidentPeak | None = None
    # the stop signals this rank heard, voted in every step's sum (None: no preemption handling)
    preemption: Preemption | None = None
    # --validation-split: the held-out samples' loss through this rank's forward-only program
    # (pulse.train.validation.Validation; every rank calls it at the same steps); None: no split
    validation: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        if self.resident is not None:
            self.executor.after_action = self.resident.sample


def global_grad_norm(backend: TrainingBackend, chunks: Sequence[ChunkHandle], comm: Communicator | None,
                     group: Sequence[int]) -> float:
    """The L2 norm of the pipeline's gradients (inf or NaN when any is not finite).

    ``group``: this rank's pipeline replica (data-parallel replicas hold equal gradients once
    their buckets are summed, so one pipeline's norm is everybody's). Every rank of the group
    must call this.
    """
    return grad_norm_and_overflow(backend, chunks, comm, group)[0]


def grad_norm_and_overflow(backend: TrainingBackend, chunks: Sequence[ChunkHandle], comm: Communicator | None,
                           group: Sequence[int], overflowed: bool = False, replicas: int = 1) -> tuple[float, bool]:
    """``global_grad_norm`` and whether any rank of ``group`` overflowed, in the one all-reduce.

    The all-reduce carries [squared norm, 0/1 overflow flag]: one rank's overflow skips the step
    on every rank of the group with no second round trip. ``replicas``: how many copies of the
    pipeline ``group`` holds (their gradients are equal once the buckets are summed, so the
    squares are counted once).
    """
    square = backend.grad_square_sum(chunks)
    flags = 1.0 if overflowed else 0.0
    if comm is not None and len(group) > 1:  # float32 on the wire: not every HCCL reduces float64
        summed = comm.all_reduce(backend.from_numpy(np.array([square, flags], np.float32)), group)
        square, flags = (float(v) for v in np.asarray(backend.to_numpy(summed)).reshape(-1)[:2])
        square /= replicas
    norm = math.sqrt(square) if math.isfinite(square) else square
    return norm, flags > 0.0 or not math.isfinite(norm)  # a non-finite norm is an overflow whoever saw it


def clip_gradients(backend: TrainingBackend, chunks: Sequence[ChunkHandle], comm: Communicator | None,
                   group: Sequence[int], max_norm: float) -> float:
    """Scale the gradients so that the pipeline's global L2 norm is at most ``max_norm``; the norm before."""
    norm = global_grad_norm(backend, chunks, comm, group)
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        backend.scale_gradients(chunks, factor)
    return norm


def optimizer_update(backend: TrainingBackend, chunks: Sequence[ChunkHandle], step: int, settings: StepSettings,
                     scaler: DynamicLossScale | None = None, comm: Communicator | None = None,
                     group: Sequence[int] = (), marks: list[tuple[str, float]] | None = None,
                     replicas: int = 1) -> tuple[float | None, bool]:
    """Unscale (fp16), clip, set the step's learning rate, step the optimizers, update the EMA.

    ``group``: the ranks the global norm (and, fp16, the overflow answer) spans; ``replicas``: the
    pipeline copies it holds (``norm_group``). ``marks``: when given, the moments the norm
    all-reduce returned and clipping ended go there (the trace's phases). Returns (the gradient
    norm before clipping, or None when nothing needed it; whether the step was skipped: fp16
    gradients that overflowed on any rank of ``group`` leave the weights as they were and lower
    the loss scale).
    """
    overflowed = False
    if scaler is not None:
        backend.unscale_gradients(chunks, scaler.scale)
        overflowed = backend.overflowed(chunks)  # the device's answer: isfinite misses a saturated +-max
    norm = None
    if settings.clip or scaler is not None:
        norm, overflowed = grad_norm_and_overflow(backend, chunks, comm, group, overflowed, replicas)
        if marks is not None:
            marks.append(("gradient norm all-reduce", time.perf_counter()))
    if scaler is not None:
        scaler.update(not overflowed)
        if overflowed:
            return norm, True
    if settings.clip and norm is not None and norm + 1e-6 > settings.clip:
        backend.scale_gradients(chunks, settings.clip / (norm + 1e-6))
    if marks is not None:
        marks.append(("clip", time.perf_counter()))
    if settings.ema is not None and not backend.ema:  # the average starts from the weights before step 1
        backend.ema_update(chunks, 0.0)
    backend.set_learning_rate(chunks, settings.lr_at(step))
    for chunk in chunks:
        backend.optimizer_step(chunk)
    if settings.ema is not None:  # counted in updates, as EMAModel: a skipped fp16 step is none
        backend.ema_steps += 1
        backend.ema_update(chunks, settings.ema_at(backend.ema_steps))
    return norm, False


def norm_group(layout: Layout, fp16: bool) -> tuple[list[int], int]:
    """The ranks whose all-reduce gives the global norm, and the pipeline replicas among them.

    This rank's pipeline, unless fp16: then the whole world, so that every data-parallel replica
    skips the same steps. A saturating device's overflow flag is its own, and the buckets' sum of
    its +-max gradients is finite: the other replicas would step while it skips.
    """
    if fp16 and layout.dp > 1:
        return list(range(layout.pp * layout.dp)), layout.dp
    return layout.pp_ranks(), 1


def _sent(comm: StepCommunicator) -> tuple[int, int]:
    return sum(comm.bytes_sent.values()), comm.allreduce_bytes


def train_step(job: TrainingJob, step: int, phases: list[dict] | None = None) -> StepRecord:
    """One optimizer step; every rank returns the same record.

    ``phases``: when given, the step's measured timeline goes there (``--trace``): every action
    of the executor, then the loop's phases, in seconds from the step's start.
    """
    ex, comm = job.executor, job.comm
    p2p0, ar0 = _sent(comm)
    start = time.perf_counter()
    ex.timeline = [] if phases is not None else None
    marks = [("actions", start)]
    job.batches.step = step
    comm.set_shapes(job.batches.shapes_key())  # every rank knows the step's bucket: receives sized without a message
    stats = ex.run_step()
    marks.append(("data-parallel buckets", time.perf_counter()))
    comm.wait_sends(job.timeout)
    marks.append(("wait sends", time.perf_counter()))
    chunks = [ex.chunks[c] for c in sorted(ex.chunks)]
    scale = job.loss_scale.scale if job.loss_scale is not None else None
    group, replicas = norm_group(job.layout, fp16=job.loss_scale is not None)
    norm, skipped = optimizer_update(job.backend, chunks, step, job.settings, job.loss_scale, comm,
                                     group, marks if phases is not None else None, replicas)
    marks.append(("optimizer", time.perf_counter()))
    p2p1, ar1 = _sent(comm)
    losses = list(stats.losses.values())
    votes = job.preemption.votes() if job.preemption is not None else []  # rides along: no extra collective
    loss_sum, count, p2p, ar, *rest = comm.sum_values([sum(losses), len(losses), p2p1 - p2p0, ar1 - ar0,
                                                       *votes, *peak_memory_slots(job)], job.timeout)
    if job.preemption is not None:
        job.preemption.agree(rest[:len(votes)])
    world = job.plan.world_size
    peaks, resident = rest[len(votes):len(votes) + world], rest[len(votes) + world:]
    seconds = time.perf_counter() - start
    if phases is not None:
        phases.extend(step_timeline(ex, start, marks, start + seconds))
        ex.timeline = None
    return StepRecord(step, loss_sum / max(count, 1.0), seconds, job.plan.global_batch / seconds,
                      int(p2p), int(ar), norm, job.settings.lr_at(step), skipped, scale,
                      tuple(int(v) for v in peaks) or None, resident_memory_bytes=tuple(int(v) for v in resident) or None)


def peak_memory_slots(job: TrainingJob) -> list[float]:
    """This rank's peak memory in its own slot of a world-long list, zeros elsewhere: summed with the
    step's other numbers, every rank learns every rank's peak at no extra collective. The device's
    allocator peak on an accelerator; on a CPU the most its allocations held above its pre-build baseline,
    followed by a second world-long list with its resident peak above its baseline (``pulse.train.resident``;
    where malloc cannot be asked, the resident peak alone). Empty where nothing is known (every rank of a
    job alike, so the lists agree)."""
    query = getattr(job.backend, "peak_memory_bytes", None)
    peak, resident = (query() if query is not None else None), None
    if peak is None and job.resident is not None:
        peak, resident = job.resident.held_above_baseline(), job.resident.peak_above_baseline()
        if peak is None:
            peak, resident = resident, None
    if peak is None:
        return []
    world = job.plan.world_size
    slots = [0.0] * (world if resident is None else 2 * world)
    slots[job.layout.rank] = float(peak)
    if resident is not None:
        slots[world + job.layout.rank] = float(resident)
    return slots


def step_timeline(ex: StageExecutor, start: float, marks: list[tuple[str, float]], end: float) -> list[dict]:
    """The executor's actions, then the loop's phases (each ends at the next mark), from ``start``."""
    spans = [{"label": a.label, "kind": a.kind, "start": a.start - start, "end": a.end - start, "cpu": a.cpu}
             for a in ex.timeline or []]
    last = max((a.end for a in ex.timeline or []), default=start)
    ends = [last] + [t for _, t in marks[1:]] + [end]
    names = [name for name, _ in marks[1:]] + ["report all-reduce"]
    origin = {"label": "origin", "kind": "origin", "start": 0.0, "end": 0.0, "clock": start,
              "host": socket.gethostname()}  # ranks of one host share the monotonic clock: merge_trace aligns them
    return spans + [{"label": n, "kind": "step", "start": a - start, "end": b - start}
                    for n, a, b in zip(names, ends, ends[1:])] + [origin]


@dataclass
class LoopHooks:
    """What a launcher adds around the steps (all optional)."""

    # the records so far, and whether they must reach disk now: a checkpoint's step, the last step,
    # a failure (rank 0: log.json)
    after_step: Callable[[list[StepRecord], bool], None] | None = None
    # steps done (and preempted="SIGTERM" for a preemption's checkpoint); every rank calls it
    checkpoint: Callable[..., None] | None = None
    checkpoint_every: int = 0
    checkpoint_last: bool = False
    sample: Callable[[int], None] | None = None  # steps done, after that step's checkpoint (rank 0: images)
    sample_every: int = 0  # a sample step is a checkpoint step too: the images come from its weights
    trace: list[dict] | None = None  # the last step's measured timeline goes here
    validate: Callable[[], float] | None = None  # every rank: the held-out loss (pulse.train.validation)
    validate_every: int = 0  # steps between validation losses (and after the last step)
    freeze_gc: bool = False  # launchers: see freeze_setup_objects (off for in-process callers such as tests)


def freeze_setup_objects() -> None:
    """Move every object alive before the first step out of the collector's reach.

    A full (generation 2) collection walks every tracked object; in a rank holding torch,
    diffusers and a model that took 150-200 ms, at a step of the collector's choosing (the
    diffusers UNet's V stalled at step 6 of every run: 590 -> 720 ms), on one rank while its
    peers wait. What exists before step 1 (modules, the model, the data) lives for the whole
    run, so freezing it leaves later collections only the steps' own objects.
    """
    gc.collect()
    gc.freeze()


def run_steps(job: TrainingJob, steps: int, start: int = 0, hooks: LoopHooks | None = None) -> list[StepRecord]:
    """Steps ``start .. steps - 1`` with a progress line per step on rank 0."""
    hooks = hooks or LoopHooks()
    records: list[StepRecord] = []
    lead = job.layout.rank == 0
    if hooks.freeze_gc:
        freeze_setup_objects()
    with Progress(steps - start, "train", stream=sys.stdout, log_every=0.0, enabled=lead) as bar:
        try:
            for step in range(start, steps):
                records.append(with_validation(run_one_step(job, step, steps, hooks), steps, hooks))
                bar.update(1, note=progress_note(records[-1]))
                stop = job.preemption.agreed if job.preemption is not None and step + 1 < steps else None
                if stop is not None:
                    preempt(step + 1, stop, hooks, records)
                after_step(step + 1, steps, hooks, records)
        except Preempted:
            raise  # its records are on disk already
        except BaseException:
            if records and hooks.after_step is not None:
                hooks.after_step(records, True)  # what was trained before the failure stays on disk
            raise
    return records


def run_one_step(job: TrainingJob, step: int, steps: int, hooks: LoopHooks) -> StepRecord:
    r = train_step(job, step, hooks.trace if step == steps - 1 else None)
    if not math.isfinite(r.loss):
        raise NonFiniteLoss(f"step {step + 1}: the loss is {r.loss} (non-finite); training stopped. "
                            "Lower --lr, check the data for NaN/inf values, or try --precision fp32")
    return r


def with_validation(r: StepRecord, steps: int, hooks: LoopHooks) -> StepRecord:
    """``r`` with the held-out loss when a validation is due after its step (every rank runs it)."""
    done = r.step + 1
    if hooks.validate is None or not (done % hooks.validate_every == 0 or done == steps):
        return r
    return replace(r, val_loss=hooks.validate())


def progress_note(r: StepRecord) -> str:
    skipped = " | skipped: fp16 gradients overflowed" if r.skipped else ""
    val = f" | val/loss {r.val_loss:.4f}" if r.val_loss is not None else ""
    return (f"loss {r.loss:.4f}{val} | {r.samples_per_s:7.2f} samples/s | "
            f"p2p {fmt_bytes(r.pipeline_bytes)} | all-reduce {fmt_bytes(r.allreduce_bytes)}{skipped}")


def preempt(done: int, signum: int, hooks: LoopHooks, records: list[StepRecord]) -> None:
    """Every rank agreed to stop after ``done`` steps: the log, that step's checkpoint (in place of any
    due now; no samples: the grace period is short), then ``Preempted``."""
    if hooks.after_step is not None:
        hooks.after_step(records, True)
    if hooks.checkpoint is not None:
        hooks.checkpoint(done, preempted=signal.Signals(signum).name)
    raise Preempted(signum, done, hooks.checkpoint is not None)


def after_step(done: int, steps: int, hooks: LoopHooks, records: list[StepRecord]) -> None:
    """The log, then the checkpoint and the samples that are due after ``done`` steps."""
    sample_due = bool(hooks.sample_every) and done % hooks.sample_every == 0
    due = bool(hooks.checkpoint_every and done % hooks.checkpoint_every == 0) or \
        (hooks.checkpoint_last and done == steps) or sample_due
    if hooks.after_step is not None:
        hooks.after_step(records, due or done == steps)  # a checkpoint's steps are in the log it resumes with
    if due and hooks.checkpoint is not None:
        hooks.checkpoint(done)
    if sample_due and hooks.sample is not None:
        hooks.sample(done)
