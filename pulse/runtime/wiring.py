"""Static wiring of a plan: what each chunk reads and writes, what each message carries.

Derived once from (spec, placement) and identical on every rank, so sender and
receiver agree on payloads without talking about them::

    chunk c ──"h", carried shared──▶ chunk c+1        main path (local handoff
          ──relayed skips──────────▶                   or one message per
                                                       traffic.Transfer)
    chunk a ══direct skip══════════▶ chunk b          skip_transport="direct"

Messages follow ``pulse.traffic.transfers()`` exactly: one message per
Transfer per microbatch, payload in a fixed order ("h", then shared names,
then skip keys), and the gradient message back carries the same names.

Layer-made shared inputs live in per-device copies. A copy begins at its
*origin* chunk: the chunk that makes it, or the chunk whose incoming
main-path message carries it; it serves that chunk and every later chunk of
the device until another message brings a fresh copy (relay transport does
that at each revisit, direct transport never)::

    V, P = 2:  chunk 0 (dev 0) makes temb ─msg─▶ chunk 1 (dev 1): copy temb@1
               chunk 2 (dev 1) reads temb@1      chunk 3 (dev 0) reads temb@0

A copy's gradient sums every reading chunk's and what its forwarding
messages bring back; it leaves at the origin (the maker's backward, or the
backward message of the transfer that brought it).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.schedule.ir import Action, Schedule
from pulse.spec import ModelSpec
from pulse.traffic import Transfer, transfers

MAIN = "h"  # the main-path activation's payload name


@dataclass(frozen=True)
class ChunkIO:
    """The named tensors one chunk's forward reads and writes (see protocols.py)."""

    index: int
    start: int  # first layer
    end: int  # one past the last layer
    device: int
    consumes: tuple[str, ...]  # skip keys produced before this chunk, read here
    produces: tuple[str, ...]  # skip keys made here, read by a later chunk
    shared_in: tuple[str, ...]  # layer-made shared inputs made before this chunk, read here
    shared_made: tuple[str, ...]  # shared inputs a layer of this chunk makes
    data_inputs: tuple[str, ...]  # shared inputs every rank loads from the data
    first: bool
    last: bool

    @property
    def grad_names(self) -> frozenset[str]:
        """Inputs whose gradient backward returns (data inputs need none)."""
        names = set(self.consumes) | set(self.shared_in)
        if not self.first:
            names.add(MAIN)
        return frozenset(names)

    @property
    def carry_out(self) -> tuple[str, ...]:
        """Shared names this chunk's device holds after it (what a message may carry on)."""
        return self.shared_in + self.shared_made


@dataclass(frozen=True)
class MessageTag:
    """Names one tensor of one message: direction, Transfer index, microbatch, slot."""

    direction: str  # "F" (activations) or "B" (their gradients)
    transfer: int  # index into traffic.transfers(spec, placement)
    microbatch: int
    slot: int  # position in the payload
    name: str  # payload name ("h", "temb", "a->b")

    def as_int(self) -> int:
        """A 31-bit integer tag, unique per (direction, transfer, microbatch, slot)."""
        if not (self.transfer < 1024 and self.microbatch < 16384 and self.slot < 64):
            raise PlanError(f"message {self} does not fit an integer tag "
                            "(limits: 1024 transfers, 16384 microbatches, 64 tensors per message)")
        return ((self.microbatch * 1024 + self.transfer) * 64 + self.slot) * 2 + (self.direction == "B")

    def __str__(self) -> str:
        what = "activation" if self.direction == "F" else "gradient"
        return f"{what} '{self.name}' of mb{self.microbatch} (transfer #{self.transfer})"


def chunk_ios(spec: ModelSpec, placement: Placement) -> list[ChunkIO]:
    producer_at = {s.name: spec.index(s.producer) for s in spec.shared_inputs if s.producer is not None}
    data = tuple(s.name for s in spec.shared_inputs if s.producer is None)
    spans = spec.skip_spans()
    out = []
    last = len(placement.chunks) - 1
    for i, c in enumerate(placement.chunks):
        out.append(ChunkIO(
            index=i, start=c.start, end=c.end, device=c.device,
            consumes=tuple(e.key for s, t, e in spans if s < c.start <= t < c.end),
            produces=tuple(e.key for s, t, e in spans if c.start <= s < c.end <= t),
            shared_in=tuple(n for n, p in producer_at.items() if p < c.start),
            shared_made=tuple(n for n, p in producer_at.items() if c.start <= p < c.end),
            data_inputs=data, first=i == 0, last=i == last,
        ))
    return out


def shared_origins(ios: list[ChunkIO], msgs: list[Transfer], main: dict[int, int]) -> dict[tuple[int, str], int]:
    """(chunk, layer-made shared name it reads or makes) -> origin chunk of its device's copy."""
    held: dict[int, dict[str, int]] = defaultdict(dict)  # device -> name -> origin of the live copy
    origin = {}
    for io in ios:
        mine = held[io.device]
        arriving = msgs[main[io.index - 1]].shared if io.index - 1 in main else ()
        for n in (*arriving, *io.shared_made):
            mine[n] = io.index
        for n in (*io.shared_in, *io.shared_made):
            if n not in mine:
                raise PlanError(f"chunk {io.index} (device {io.device}) reads shared input '{n}', which "
                                "traffic.transfers() never brings to its device")
            origin[(io.index, n)] = mine[n]
    return origin


class Wiring:
    """Chunk IOs, transfers and payloads of one (spec, placement)."""

    def __init__(self, spec: ModelSpec, placement: Placement) -> None:
        placement.validate(spec.num_layers)
        self.spec = spec
        self.placement = placement
        self.ios = chunk_ios(spec, placement)
        self.transfers: list[Transfer] = transfers(spec, placement)
        self._main: dict[int, int] = {}  # chunk -> index of its main-path message to chunk+1
        self._by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, tr in enumerate(self.transfers):
            self._by_pair[(tr.src_chunk, tr.dst_chunk)].append(i)
            # transfers() lists a boundary's main-path message before any direct
            # skip message between the same two chunks.
            if tr.dst_chunk == tr.src_chunk + 1 and tr.src_chunk not in self._main:
                self._main[tr.src_chunk] = i
        self.shared_origin = shared_origins(self.ios, self.transfers, self._main)
        self.skip_consumer = {e.key: placement.chunk_of_layer(spec.index(e.dst)) for e in spec.skips}
        self.skip_producer = {e.key: placement.chunk_of_layer(spec.index(e.src)) for e in spec.skips}

    @property
    def num_chunks(self) -> int:
        return len(self.ios)

    def device_of(self, chunk: int) -> int:
        return self.placement.chunks[chunk].device

    def next_is_local(self, chunk: int) -> bool:
        """True when chunk+1 exists and shares chunk's device (main path handed over in memory)."""
        return chunk + 1 < self.num_chunks and self.device_of(chunk + 1) == self.device_of(chunk)

    def local_skips(self, device: int) -> list[str]:
        """Skips kept on ``device`` from producer chunk to a different consumer chunk
        (what the simulator counts as skip cache)."""
        carried = {k for tr in self.transfers for k in tr.skips}
        return [k for k, a in self.skip_producer.items()
                if k not in carried and a != self.skip_consumer[k]
                and self.device_of(a) == device == self.device_of(self.skip_consumer[k])]

    def shared_key(self, chunk: int, name: str) -> str:
        """Cache key of the copy of shared input ``name`` that ``chunk`` reads (or makes)."""
        return f"{name}@{self.shared_origin[(chunk, name)]}"

    def is_main(self, transfer: int) -> bool:
        tr = self.transfers[transfer]
        return self._main.get(tr.src_chunk) == transfer

    def payload(self, transfer: int) -> tuple[str, ...]:
        """The names a message carries, in wire order."""
        tr = self.transfers[transfer]
        head = (MAIN, *tr.shared) if self.is_main(transfer) else ()
        return (*head, *tr.skips)

    def tags(self, direction: str, transfer: int, microbatch: int) -> list[MessageTag]:
        return [MessageTag(direction, transfer, microbatch, slot, name)
                for slot, name in enumerate(self.payload(transfer))]

    def match_transfers(self, actions: tuple[Action, ...]) -> dict[int, int]:
        """Position of each send/recv in ``actions`` -> the Transfer it moves.

        Two messages may join the same pair of chunks (a main-path message and
        a direct skip, or two direct skips): the k-th such action of a
        microbatch moves the k-th of those transfers, in transfers() order.
        """
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for pos, a in enumerate(actions):
            if not a.is_comm or a.is_encode_comm:  # an encoder's output is no Transfer
                continue
            pair = (a.chunk, a.peer) if a.kind in ("SF", "RB") else (a.peer, a.chunk)
            key = (a.kind, pair, a.microbatch)
            candidates = self._by_pair.get(pair, [])
            if seen[key] >= len(candidates):
                raise PlanError(f"device {a.device}: action {a} moves nothing: traffic.transfers() has "
                                f"{len(candidates)} message(s) from chunk {pair[0]} to chunk {pair[1]}")
            out[pos] = candidates[seen[key]]
            seen[key] += 1
        return out

    def check_actions(self, device: int, schedule: Schedule) -> None:
        """Every chunk of ``device``: one F, one B and one FREE per microbatch, at most one W,
        one AR; and one send/recv per microbatch for every message touching the device."""
        actions = schedule.actions.get(device, ())
        counts: dict[tuple, int] = defaultdict(int)
        for a in actions:
            counts[(a.kind, a.chunk, a.peer, a.microbatch)] += 1
        problems = []
        for mb in range(schedule.num_microbatches):
            for c in self.placement.chunks_of(device):
                for kind in ("F", "B"):
                    if counts[(kind, c, None, mb)] != 1:
                        problems.append(f"{c}{kind}{mb} appears {counts[(kind, c, None, mb)]} times")
                if counts[("W", c, None, mb)] > 1:
                    problems.append(f"{c}W{mb} appears {counts[('W', c, None, mb)]} times")
                if counts[("FREE", c, None, mb)] != 1:
                    problems.append(f"{c}FREE{mb} appears {counts[('FREE', c, None, mb)]} times")
            for tr in self.transfers:
                need = []
                if tr.src_device == device:
                    need += [("SF", tr.src_chunk, tr.dst_chunk), ("RB", tr.src_chunk, tr.dst_chunk)]
                if tr.dst_device == device:
                    need += [("RF", tr.dst_chunk, tr.src_chunk), ("SB", tr.dst_chunk, tr.src_chunk)]
                for kind, chunk, peer in need:
                    want = len(self._by_pair[(tr.src_chunk, tr.dst_chunk)])
                    if counts[(kind, chunk, peer, mb)] != want:
                        problems.append(f"{chunk}{kind}{mb}:{peer} appears {counts[(kind, chunk, peer, mb)]} "
                                        f"times, traffic.transfers() needs {want}")
        for c in self.placement.chunks_of(device):
            reduces = sum(n for (kind, chunk, _, _), n in counts.items() if kind == "AR" and chunk == c)
            if reduces != 1:
                problems.append(f"chunk {c} has {reduces} all-reduce (AR) actions, expected 1")
        if problems:
            shown = "; ".join(sorted(set(problems))[:6])
            lowered = any(a.kind in ("SF", "RF") for a in actions) and any(a.is_mark for a in actions)
            raise PlanError(f"schedule '{schedule.name}', device {device}: {shown}"
                            + ("" if lowered else " (the list is not a lowered program: "
                               "run pulse.schedule.lower.lower on the schedule first)"))
