"""The stage executor: one rank walks its action list, one handler per action kind.

::

    actions:  0F0  0SF0:1  0F1  0SF1:1  3RF0:2  3F0  3B0  3FREE0 ...  0RB7:1  0B7  0AR7  0FREE7
                │     │                                  │                    │     │     │
    handlers: _forward _send_forward ...               _free   _recv_backward ┘ _backward │ _free
                                                                          _reduce_gradients
    state:    main-path inputs/outputs per (chunk, mb), forward contexts,
              output gradients, the SkipCache keyed by (mb, skip), and the
              device's copies of layer-made shared inputs keyed by
              (mb, "name@origin chunk"), read by every later local chunk,
              their gradients summed until the origin sends them back
              (see ``pulse.runtime.wiring``)

The list is the lowered program (``pulse.schedule.lower``): a FREE releases what
a (chunk, microbatch) saved, an AR launches what is left of a chunk's data-parallel
gradient buckets (the chunk's last backward before it launches each as it becomes final,
``pulse.runtime.grad_sync``); at the end of a step nothing may be left (a leak means the schedule and
the plan disagree). Without overlapped buckets (the in-process runner), the
group all-reduces and averages the gradients after the list, one at a time.
The same code runs every backend and communicator; with the fake
communicator ``run_all_ranks`` interleaves all ranks in one process.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.runtime.errors import CommTimeout, ScheduleOrderError
from pulse.encoders import EncoderSet
from pulse.runtime.encode_actions import EncodeRunner
from pulse.grad_buckets import BUCKET_CAP_BYTES
from pulse.runtime.grad_sync import BucketedGradientSync
from pulse.runtime.message_order import inbound_order
from pulse.runtime.spans import ActionSpan
from pulse.runtime.protocols import Backend, Batches, Communicator, LossFn, Tensor
from pulse.runtime.skip_cache import SkipCache
from pulse.runtime.wiring import MAIN, MessageTag, Wiring
from pulse.schedule.ir import Action, Schedule
from pulse.schedule.passes import final_gradient_positions
from pulse.spec import ModelSpec

# Receives posted ahead of the one being run (``Communicator.post_recv``). Gloo moves a message
# only once its receive is posted, and the simulator prices every message as moving when it is
# sent: post far enough ahead that a step's messages never wait for their receive. 8 left a 2-fold
# wave's messages waiting (tiny-uvit, P = 2: 38-39 ms/step at 8, 33.6 ms at 64, 46 ms at 1). A
# posted buffer is allocated but not written until its message lands.
RECV_LOOKAHEAD = 64

Slot = tuple[int, int]  # (chunk, microbatch)


@dataclass
class StepStats:
    """What one rank measured in one step, in the simulator's terms."""

    rank: int
    device: int
    actions_run: int = 0
    peak_skip_bytes: int = 0  # local skip values: compare with SimResult.peak_skip_cache
    peak_skip_cache_total: int = 0  # all the cache held at once: transit values, pending gradients
    peak_shared_bytes: int = 0  # shared-input copies and their pending gradients held at once
    peak_live_contexts: int = 0  # (chunk, microbatch) forward contexts alive at once
    peak_inflight: int = 0  # microbatches holding a context: compare with SimResult.peak_inflight
    # per microbatch, last chunk's rank only: what the loss function returned, a float or a tensor
    # left on the device (reading it there would wait for the device at every microbatch)
    losses: dict[int, Any] = field(default_factory=dict)

    @property
    def loss(self) -> float | None:
        return sum(float(v) for v in self.losses.values()) / len(self.losses) if self.losses else None


class StageExecutor:
    """Runs one device's share of a schedule (one rank of one pipeline replica).

    ``pipeline_ranks[d]`` is the global rank holding device ``d`` of this
    replica (default: rank = device); ``dp_group`` lists the global ranks
    holding this device in every replica (empty or one rank: no data parallel).
    The loss hook runs on the rank of the last chunk; its gradient is scaled
    by ``loss_scale`` (default 1/M: the loss is the mean over microbatches).
    """

    def __init__(self, *, device: int, spec: ModelSpec, placement: Placement, schedule: Schedule,
                 backend: Backend, comm: Communicator, batches: Batches, loss_fn: LossFn | None = None,
                 pipeline_ranks: Sequence[int] | None = None, dp_group: Sequence[int] = (),
                 timeout: float | None = None, loss_scale: float | None = None,
                 wiring: Wiring | None = None, chunks: dict[int, Any] | None = None,
                 overlap_dp: bool = False, encoders: EncoderSet | None = None,
                 bucket_cap: int = BUCKET_CAP_BYTES) -> None:
        self.device = device
        self.wiring = wiring if wiring is not None else Wiring(spec, placement)
        self.schedule = schedule
        self.backend = backend
        self.comm = comm
        self.batches = batches
        self.loss_fn = loss_fn
        self.ranks = list(pipeline_ranks) if pipeline_ranks is not None else list(range(placement.num_devices))
        self.rank = self.ranks[device]
        self.dp_group = list(dp_group)
        self.timeout = timeout
        self.loss_scale = 1.0 / schedule.num_microbatches if loss_scale is None else loss_scale
        self.actions: tuple[Action, ...] = schedule.actions.get(device, ())
        self.timeline: list[ActionSpan] | None = None  # set to [] to record every action's span
        # called after every action: a CPU rank samples its bytes in use there (pulse.train.resident)
        self.after_action: Callable[[], None] | None = None
        self.encodes = self._encode_runner(encoders, spec, placement, schedule, batches)
        self._check_setup(placement)
        self._transfer_at = self.wiring.match_transfers(self.actions)
        self._split = {(a.chunk, a.microbatch) for a in self.actions if a.kind == "W"}
        self._receives = [p for p, a in enumerate(self.actions) if a.kind in ("RF", "RB")]
        # what a communicator that matches messages by order (NCCL, HCCL) posts its receives by
        feeds = [e.feeds for e in encoders.encoders] if encoders is not None else []  # an encode message's tensors
        comm.expect_inbound({self.ranks[d]: m for d, m in inbound_order(self.wiring, schedule, device, feeds).items()})
        self.chunks = chunks if chunks is not None else {
            c: backend.build_chunk(spec, self.wiring.ios[c]) for c in placement.chunks_of(device)}
        # Real launchers overlap the data-parallel all-reduce with backward (buckets of whole
        # layers launched as they become final, needs comm.all_reduce_async); otherwise _sync_next reduces after the
        # actions, one parameter at a time, which the cooperative in-process runner can interleave.
        self.grad_sync = BucketedGradientSync(backend, comm, self.dp_group, self.chunks, timeout,
                                              bucket_cap) if overlap_dp and len(self.dp_group) > 1 else None
        # each chunk's last backward (the compute its AR follows): its buckets may launch inside it
        self._arm_at = {pos: chunk for chunk, pos in final_gradient_positions(self.actions).items()}
        self._handlers: dict[str, Callable[[Action, int], None]] = {
            "F": self._forward, "B": self._backward, "W": self._weight,
            "SF": self._send_forward, "RF": self._recv_forward,
            "SB": self._send_backward, "RB": self._recv_backward,
            "FREE": self._free, "AR": self._reduce_gradients,
            "E": lambda a, pos: self.encodes.encode(a),
            "SE": lambda a, pos: self.encodes.send(a, self._send_all, lambda c: self.ranks[placement.chunks[c].device]),
            "RE": lambda a, pos: self.encodes.receive(a, lambda tags, d: self._recv_all(tags, self.ranks[d])),
        }
        self.begin_step(zero_grad=False)

    def _encode_runner(self, encoders: EncoderSet | None, spec: ModelSpec, placement: Placement,
                       schedule: Schedule, batches: Batches) -> EncodeRunner | None:
        """The E/SE/RE handlers of a plan whose frozen encoders run in the pipeline (else None)."""
        if not schedule.has_encodes:
            return None
        if encoders is None or not encoders.active:
            raise PlanError(f"schedule '{schedule.name}' has encode actions but no encoders were given to run them")
        return EncodeRunner(encoders, spec, placement, schedule, self.device, batches, len(self.wiring.transfers))

    def _check_setup(self, placement: Placement) -> None:
        if self.comm.rank != self.rank:
            raise PlanError(f"device {self.device} is global rank {self.rank} but its communicator "
                            f"is rank {self.comm.rank}")
        self.wiring.check_actions(self.device, self.schedule)
        last = self.wiring.num_chunks - 1
        if placement.chunks[last].device == self.device and self.loss_fn is None:
            raise PlanError(f"device {self.device} runs the last chunk ({last}) and needs a loss_fn")
        if self.dp_group and self.rank not in self.dp_group:
            raise PlanError(f"rank {self.rank} is not in its own data-parallel group {self.dp_group}")

    # -- the step ------------------------------------------------------------
    def begin_step(self, zero_grad: bool = True) -> None:
        """Forget the last step's state; optionally zero parameter gradients."""
        self.position = 0
        self.done = False
        self._posted = 0  # receives of this step (self._receives) already posted
        self.stats = StepStats(self.rank, self.device)
        self.cache = SkipCache(self.backend.nbytes, self.backend.add, self.wiring.local_skips(self.device))
        self.shared = SkipCache(self.backend.nbytes, self.backend.add, label="shared input")
        self._fwd_in: dict[Slot, dict[str, Tensor]] = {}  # main path arriving at a chunk
        self._fwd_out: dict[Slot, dict[str, Tensor]] = {}  # main path waiting for its SF
        self._ctx: dict[Slot, Any] = {}  # forward contexts until B
        self._wctx: dict[Slot, Any] = {}  # split backward: weight half until W
        self._bwd_in: dict[Slot, dict[str, Tensor]] = {}  # output gradients arriving at a chunk
        self._bwd_out: dict[Slot, dict[str, Tensor]] = {}  # input gradients waiting for their SB
        self._batch_cache: dict[int, Mapping[str, Tensor]] = {}
        self._batch_left: dict[int, int] = {}
        self._sync_items: list[tuple[int, str]] | None = None
        self._reduced: dict[int, dict[str, Tensor]] = {}
        if zero_grad:
            for handle in self.chunks.values():
                self.backend.zero_grad(handle)

    def run_step(self, zero_grad: bool = True) -> StepStats:
        """One whole step with a blocking communicator (the real-cluster path)."""
        self.begin_step(zero_grad)
        while not self.done:
            self.run_next()
        return self.stats

    def run_next(self) -> None:
        """Run the next action (or the next gradient all-reduce after the actions).

        May raise the communicator's would-block signal before changing any
        state, so the cooperative runner can retry it later.
        """
        if self.done:
            raise PlanError(f"rank {self.rank}: the step is already complete")
        try:
            if self.position < len(self.actions):
                action = self.actions[self.position]
                clock = getattr(self.backend, "device_clock", None) if self.timeline is not None else None
                mark = clock.mark() if clock is not None else None
                start, cpu = time.perf_counter(), time.thread_time()
                self._post_receives_ahead()
                if self.grad_sync is not None and self.position in self._arm_at:
                    self.grad_sync.arm(self._arm_at[self.position])
                self._handlers[action.kind](action, self.position)
                if self.timeline is not None:  # the processor time read inside the wall span, so never above it
                    cpu = time.thread_time() - cpu
                    self.timeline.append(ActionSpan(str(action), action.kind, action.chunk, action.microbatch,
                                                    start, time.perf_counter(), cpu, action.encoder,
                                                    None if clock is None else (mark, clock.mark())))
                self.position += 1
                self._track()
                if self.after_action is not None:
                    self.after_action()
            elif self._sync_next():
                self._finish()
        except CommTimeout as exc:  # say where in the schedule this rank was stuck
            raise CommTimeout(f"rank {self.rank} (device {self.device}), {self.next_label()} "
                              f"of schedule '{self.schedule.name}': {exc}") from None

    def _post_receives_ahead(self) -> None:
        """Post the next RECV_LOOKAHEAD receives of the list before they are reached, so that a
        message sent early is written at once instead of waiting for its receive (gloo moves a
        message only once its receive is posted: ``pulse_torch.comm``)."""
        first = bisect_left(self._receives, self.position)  # the next receive to run (earlier ones ran)
        ahead = self.comm.recv_lookahead or RECV_LOOKAHEAD  # a communicator may want fewer
        last = min(first + ahead, len(self._receives))
        self._posted = max(self._posted, first)
        while self._posted < last:
            pos = self._receives[self._posted]
            a, t = self.actions[pos], self._transfer_at[pos]
            tr = self.wiring.transfers[t]
            direction, peer = ("F", tr.src_device) if a.kind == "RF" else ("B", tr.dst_device)
            self.comm.post_recv(self.ranks[peer], self.wiring.tags(direction, t, a.microbatch))
            self._posted += 1

    def next_label(self) -> str:
        if self.position < len(self.actions):
            return f"action #{self.position} {self.actions[self.position]}"
        items = self._sync_items or []
        done = sum(len(v) for v in self._reduced.values())
        name = items[done][1] if done < len(items) else "?"
        return f"gradient all-reduce {done + 1}/{len(items)} ('{name}') over ranks {self.dp_group}"

    def optimizer_step(self) -> None:
        for handle in self.chunks.values():
            self.backend.optimizer_step(handle)

    def gradients(self) -> dict[str, Tensor]:
        """Parameter gradients of every local chunk, by parameter name."""
        return {n: g for h in self.chunks.values() for n, g in self.backend.gradients(h).items()}

    def _track(self) -> None:
        s = self.stats
        s.actions_run += 1
        live = list(self._ctx) + list(self._wctx)
        s.peak_live_contexts = max(s.peak_live_contexts, len(live))
        s.peak_inflight = max(s.peak_inflight, len({mb for _, mb in live}))

    def _finish(self) -> None:
        stores = {"main-path inputs": self._fwd_in, "unsent activations": self._fwd_out,
                  "forward contexts": self._ctx, "weight-gradient contexts": self._wctx,
                  "output gradients": self._bwd_in, "unsent gradients": self._bwd_out}
        left = [f"{what} {sorted(store)}" for what, store in stores.items() if store]
        left += self.cache.leftovers() + self.shared.leftovers()
        if left:
            raise PlanError(f"rank {self.rank} (device {self.device}) finished schedule "
                            f"'{self.schedule.name}' still holding: {'; '.join(left)}")
        self.stats.peak_skip_bytes = self.cache.peak_local_bytes
        self.stats.peak_skip_cache_total = self.cache.peak_bytes
        self.stats.peak_shared_bytes = self.shared.peak_bytes
        self.done = True

    # -- data parallel ---------------------------------------------------------
    def _sync_next(self) -> bool:
        """All-reduce one parameter gradient; True once all are averaged and written back."""
        if self.grad_sync is not None:
            return self.grad_sync.finish_next()
        if len(self.dp_group) <= 1:
            return True
        if self._sync_items is None:
            self._sync_items = [(c, n) for c in sorted(self.chunks)
                                for n in sorted(self.backend.gradients(self.chunks[c]))]
            self._reduced = {c: {} for c in self.chunks}
        done = sum(len(v) for v in self._reduced.values())
        if done < len(self._sync_items):
            c, name = self._sync_items[done]
            total = self.comm.all_reduce(self.backend.gradients(self.chunks[c])[name], self.dp_group,
                                         self.timeout)
            self._reduced[c][name] = self.backend.scale(total, 1.0 / len(self.dp_group))
            done += 1
        if done < len(self._sync_items):
            return False
        for c, grads in self._reduced.items():
            self.backend.set_gradients(self.chunks[c], grads)
        return True

    # -- compute handlers ------------------------------------------------------
    def _require(self, ok: bool, action: Action, what: str) -> None:
        if not ok:
            raise ScheduleOrderError(
                f"rank {self.rank} (device {self.device}), action #{self.position} {action} of schedule "
                f"'{self.schedule.name}': needs {what}, which no earlier action on this rank provided "
                "(actions out of order, or a send/receive missing)")

    def _batch(self, mb: int) -> Mapping[str, Tensor]:
        if mb not in self._batch_cache:
            self._batch_cache[mb] = self.batches(mb)  # a Mapping; a lazy one makes only what is read
            self._batch_left[mb] = len(self.wiring.placement.chunks_of(self.device))
        return self._batch_cache[mb]

    def _batch_used(self, mb: int) -> None:
        self._batch_left[mb] -= 1
        if self._batch_left[mb] == 0:
            del self._batch_cache[mb], self._batch_left[mb]

    def _forward(self, a: Action, pos: int) -> None:
        io, slot, mb = self.wiring.ios[a.chunk], (a.chunk, a.microbatch), a.microbatch
        self._require(io.first or slot in self._fwd_in, a, f"the main-path input of chunk {a.chunk} mb{mb}")
        for k in io.consumes:
            self._require(self.cache.has_value(mb, k), a, f"skip '{k}' of mb{mb}")
        held = {n: self.wiring.shared_key(a.chunk, n) for n in io.shared_in}
        for n, key in held.items():
            self._require(self.shared.has_value(mb, key), a, f"shared input '{n}' of mb{mb} (copy {key})")
        batch = self._batch(mb)
        unread = self.encodes.unread[a.chunk] if self.encodes is not None else frozenset()
        inputs = {MAIN: batch[MAIN] if io.first else self._fwd_in.pop(slot)[MAIN],
                  **{n: self.shared.value(mb, key) for n, key in held.items()},
                  **{k: self.cache.value(mb, k) for k in io.consumes},
                  **{n: batch[n] for n in io.data_inputs if n not in unread}}
        outputs, self._ctx[slot] = self.backend.forward(self.chunks[a.chunk], inputs, io.grad_names)
        want = {MAIN, *io.produces, *io.shared_made}
        if not want <= outputs.keys():
            raise PlanError(f"backend forward of chunk {a.chunk} returned {sorted(outputs)}; "
                            f"expected {sorted(want)}")
        for k in io.produces:
            self.cache.put_value(mb, k, outputs[k])
        for n in io.shared_made:  # this device's copy, for its later chunks and outgoing messages
            self.shared.put_value(mb, self.wiring.shared_key(a.chunk, n), outputs[n])
        nxt = {MAIN: outputs[MAIN]}
        if io.last:
            self._loss(slot, nxt[MAIN], batch)
        elif self.wiring.next_is_local(a.chunk):
            self._fwd_in[(a.chunk + 1, mb)] = nxt
        else:
            self._fwd_out[slot] = nxt
        self._batch_used(mb)

    def _loss(self, slot: Slot, output: Tensor, batch: dict[str, Tensor]) -> None:
        assert self.loss_fn is not None
        loss, grads = self.loss_fn({MAIN: output}, batch)
        self.stats.losses[slot[1]] = loss
        self._bwd_in[slot] = {MAIN: self.backend.scale(grads[MAIN], self.loss_scale)}

    def _backward(self, a: Action, pos: int) -> None:
        io, slot, mb = self.wiring.ios[a.chunk], (a.chunk, a.microbatch), a.microbatch
        self._require(slot in self._ctx, a, f"the forward context of chunk {a.chunk} mb{mb} (its F)")
        self._require(slot in self._bwd_in, a, f"the output gradient of chunk {a.chunk} mb{mb}")
        for k in io.produces:
            self._require(self.cache.has_grad(mb, k), a, f"the gradient of skip '{k}' of mb{mb}")
        ctx, downstream = self._ctx.pop(slot), self._bwd_in.pop(slot)
        out_grads = {MAIN: downstream[MAIN]}
        out_grads.update({k: self.cache.take_grad(mb, k) for k in io.produces})
        out_grads.update(self._made_shared_grads(a.chunk, mb))
        if slot in self._split:
            in_grads, self._wctx[slot] = self.backend.backward_input(ctx, out_grads)
        else:
            in_grads = self.backend.backward(ctx, out_grads)
        if not io.grad_names <= in_grads.keys():
            raise PlanError(f"backend backward of chunk {a.chunk} returned gradients for {sorted(in_grads)}; "
                            f"expected {sorted(io.grad_names)}")
        for k in io.consumes:  # the skip values themselves stay until this slot's FREE
            self.cache.add_grad(mb, k, in_grads[k])
        up = self._read_shared_grads(a.chunk, mb, in_grads)
        if io.first:
            return
        up[MAIN] = in_grads[MAIN]
        if self.wiring.next_is_local(a.chunk - 1):
            self._bwd_in[(a.chunk - 1, mb)] = up
        else:
            self._bwd_out[slot] = up

    def _made_shared_grads(self, chunk: int, mb: int) -> dict[str, Tensor]:
        """Output gradients of the shared inputs ``chunk`` makes: its device's copies, complete
        now (every later local reader ran its backward, every outgoing message's gradient
        came back); none if nothing read them. The copies are released."""
        grads = {}
        for n in self.wiring.ios[chunk].shared_made:
            key = self.wiring.shared_key(chunk, n)
            if self.shared.has_grad(mb, key):
                grads[n] = self.shared.take_grad(mb, key)
            self.shared.drop_value(mb, key)
        return grads

    def _read_shared_grads(self, chunk: int, mb: int, in_grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Add this chunk's shared-input gradients to its device's copies; return (and release)
        the copies that began here by message: their gradient goes back on that message."""
        back = {}
        for n in self.wiring.ios[chunk].shared_in:
            key = self.wiring.shared_key(chunk, n)
            self.shared.add_grad(mb, key, in_grads[n])
            if self.wiring.shared_origin[(chunk, n)] == chunk:
                back[n] = self.shared.take_grad(mb, key)
                self.shared.drop_value(mb, key)
        return back

    def _weight(self, a: Action, pos: int) -> None:
        slot = (a.chunk, a.microbatch)
        self._require(slot in self._wctx, a, f"the input-gradient half (B) of chunk {a.chunk} mb{a.microbatch}")
        self.backend.backward_weight(self._wctx.pop(slot))

    # -- memory and data-parallel actions ------------------------------------------
    def _free(self, a: Action, pos: int) -> None:
        """Release the skips this (chunk, microbatch) read; its contexts must be gone by now
        (a split backward still reads its skips in W, so the lowering puts FREE after W)."""
        slot = (a.chunk, a.microbatch)
        self._require(slot not in self._ctx and slot not in self._wctx, a,
                      f"the backward of chunk {a.chunk} mb{a.microbatch} to have run (FREE ends its saved state)")
        for k in self.wiring.ios[a.chunk].consumes:
            self._require(self.cache.has_value(a.microbatch, k), a, f"skip '{k}' of mb{a.microbatch} to free")
            self.cache.drop_value(a.microbatch, k)

    def _reduce_gradients(self, a: Action, pos: int) -> None:
        """Launch this chunk's gradient bucket; without overlap, ``_sync_next`` reduces after the list."""
        if self.grad_sync is not None:
            self.grad_sync.launch(a.chunk)

    # -- message handlers --------------------------------------------------------
    def _send_all(self, tags: list[MessageTag], tensors: list[Tensor], peer: int) -> None:
        """One transfer: one wire message where the communicator can, not one per tensor (pulse.traffic)."""
        self.comm.send_group(tensors, peer, tags, self.timeout)

    def _recv_all(self, tags: list[MessageTag], peer: int) -> list[Tensor]:
        """One transfer's tensors, in ``tags`` order (all or, with the fake's would-block, none)."""
        return list(self.comm.recv_group(peer, tags, self.timeout))

    def _send_forward(self, a: Action, pos: int) -> None:
        t, slot, mb = self._transfer_at[pos], (a.chunk, a.microbatch), a.microbatch
        tr, main = self.wiring.transfers[t], self.wiring.is_main(t)
        self._require(not main or slot in self._fwd_out, a, f"the output of chunk {a.chunk} mb{mb} (its F)")
        for k in tr.skips:
            self._require(self.cache.has_value(mb, k), a, f"skip '{k}' of mb{mb}")
        head = self._fwd_out.pop(slot) if main else {}
        head.update({n: self.shared.value(mb, self.wiring.shared_key(a.chunk, n)) for n in tr.shared})
        tags = self.wiring.tags("F", t, mb)
        tensors = [head[g.name] if g.name in head else self.cache.value(mb, g.name) for g in tags]
        self._send_all(tags, tensors, self.ranks[tr.dst_device])
        for k in tr.skips:  # the skip now lives on the receiver
            self.cache.drop_value(mb, k)

    def _recv_forward(self, a: Action, pos: int) -> None:
        t, slot, mb = self._transfer_at[pos], (a.chunk, a.microbatch), a.microbatch
        tr, main = self.wiring.transfers[t], self.wiring.is_main(t)
        tags = self.wiring.tags("F", t, mb)
        got = dict(zip((g.name for g in tags), self._recv_all(tags, self.ranks[tr.src_device])))
        if main:
            self._fwd_in[slot] = {MAIN: got[MAIN]}
        for n in tr.shared:  # a new copy on this device, for this and later local chunks
            self.shared.put_value(mb, self.wiring.shared_key(a.chunk, n), got[n])
        for k in tr.skips:
            self.cache.put_value(mb, k, got[k])

    def _send_backward(self, a: Action, pos: int) -> None:
        t, slot, mb = self._transfer_at[pos], (a.chunk, a.microbatch), a.microbatch
        tr, main = self.wiring.transfers[t], self.wiring.is_main(t)
        self._require(not main or slot in self._bwd_out, a, f"the input gradient of chunk {a.chunk} mb{mb} (its B)")
        for k in tr.skips:
            self._require(self.cache.has_grad(mb, k), a, f"the gradient of skip '{k}' of mb{mb}")
        head = self._bwd_out.pop(slot) if main else {}
        tags = self.wiring.tags("B", t, mb)
        tensors = [head[g.name] if g.name in head else self.cache.take_grad(mb, g.name) for g in tags]
        self._send_all(tags, tensors, self.ranks[tr.src_device])

    def _recv_backward(self, a: Action, pos: int) -> None:
        t, slot, mb = self._transfer_at[pos], (a.chunk, a.microbatch), a.microbatch
        tr, main = self.wiring.transfers[t], self.wiring.is_main(t)
        tags = self.wiring.tags("B", t, mb)
        got = dict(zip((g.name for g in tags), self._recv_all(tags, self.ranks[tr.dst_device])))
        if main:
            self._bwd_in[slot] = {MAIN: got[MAIN]}
        for n in tr.shared:  # later devices' share of the gradient of the copy that was sent
            self.shared.add_grad(mb, self.wiring.shared_key(a.chunk, n), got[n])
        for k in tr.skips:
            self.cache.add_grad(mb, k, got[k])
