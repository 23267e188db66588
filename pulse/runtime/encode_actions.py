"""One rank's encode actions: the frozen encoders run inside the pipeline (``pulse.encoders``).

::

    E  (encoder e, microbatch m)           batches.encode(m, name) per model input it makes (its
                                           feeds): the VAE's latents or a text encoder's output for
                                           microbatch m, made here; kept for this device's readers
                                           (batches.provide) and its SEs
    SE (encoder e, peer = reader chunk)    that output, one wire message (a tensor per input), to the
                                           reader's device
    RE (chunk = reader chunk, encoder e)   received from the device that ran E; provided to the batch

An E of microbatch M + m (M per step) prefetches the next step's microbatch m: made in this
step's idle time and provided to the next step's batch. A run's first step has no step before
it: ``pulse.runtime.first_step_encodes`` runs the prefetches alone before it, on the same ranks,
so only the ranks the plan gives an encoder ever load it. (A step with nothing provided for a
microbatch would encode it where its chunks read, as without encode actions.)

The batch then reads the provided output instead of encoding (``pulse.data.feed``):
the same array either way, so gradients equal those of encoding where it is read.
A message's tag is a transfer number past the model's own (``Wiring.transfers``).
"""
from __future__ import annotations

from typing import Any, Callable

from pulse.encoders import LATENT, EncoderSet, reader_chunks, reader_layers
from pulse.errors import PlanError
from pulse.placement import Placement
from pulse.runtime.message_order import encoder_tags
from pulse.runtime.wiring import MessageTag
from pulse.schedule.ir import Action, Schedule
from pulse.spec import ModelSpec


class EncodeRunner:
    def __init__(self, encoders: EncoderSet, spec: ModelSpec, placement: Placement, schedule: Schedule,
                 device: int, batches: Any, num_transfers: int) -> None:
        if not getattr(batches, "can_encode", False):
            raise PlanError(f"schedule '{schedule.name}' runs frozen encoders in the pipeline (E actions) but this "
                            "rank's data cannot encode (it needs --pipeline with --images); plan with --encoders "
                            "cached")
        self.encoders, self.batches, self.base_tag = encoders.encoders, batches, num_transfers
        self.num_microbatches = schedule.num_microbatches
        self.ran_on = {(a.encoder, a.microbatch): a.device for a in schedule.all_actions() if a.is_encode}
        self.reads_here = {e: any(placement.chunks[c].device == device for c in reader_chunks(spec, placement, enc))
                           for e, enc in enumerate(self.encoders)}
        # a chunk without a reader layer must not read an encoder's input from the batch: on a chunk
        # that runs before the RE it would encode it again (the plan prices one encode)
        chunks_reading = {feeds: {placement.chunk_of_layer(i) for i in reader_layers(spec, enc)}
                          for enc in self.encoders for feeds in enc.feeds if feeds != LATENT}
        self.unread: dict[int, frozenset[str]] = {
            c: frozenset(n for n, readers in chunks_reading.items() if c not in readers)
            for c in placement.chunks_of(device)}
        self.sends = {}  # (encoder, microbatch) -> SEs of this device
        for a in schedule.actions.get(device, ()):
            if a.kind == "SE":
                self.sends[(a.encoder, a.microbatch)] = self.sends.get((a.encoder, a.microbatch), 0) + 1
        self.outputs: dict[tuple[int, int], Any] = {}  # kept until their last SE

    def tags(self, encoder: int, microbatch: int) -> list[MessageTag]:
        return encoder_tags(self.base_tag, encoder, microbatch, self.encoders[encoder].feeds)

    def _target(self, microbatch: int) -> tuple[int, int]:
        """(microbatch, steps ahead): M + m is the next step's m (a prefetch)."""
        ahead = int(microbatch >= self.num_microbatches)
        return microbatch - ahead * self.num_microbatches, ahead

    def encode(self, a: Action) -> None:
        key, feeds = (a.encoder, a.microbatch), self.encoders[a.encoder].feeds
        mb, ahead = self._target(a.microbatch)
        values = [self.batches.encode(mb, name, ahead) for name in feeds]
        if self.reads_here[a.encoder]:
            for name, value in zip(feeds, values):
                self.batches.provide(mb, name, value, ahead)
        if self.sends.get(key):
            self.outputs[key] = (values, self.sends[key])

    def send(self, a: Action, send: Callable[[list[MessageTag], list[Any], int], None], device_of_chunk) -> None:
        key = (a.encoder, a.microbatch)
        if key not in self.outputs:
            raise PlanError(f"action {a}: sends the output of encoder {a.encoder} for mb{a.microbatch} before its E")
        values, left = self.outputs[key]
        send(self.tags(*key), values, device_of_chunk(a.peer))
        if left == 1:
            del self.outputs[key]
        else:
            self.outputs[key] = (values, left - 1)

    def receive(self, a: Action, recv: Callable[[list[MessageTag], int], list[Any]]) -> None:
        encoder, mb = a.encoder, a.microbatch
        values = recv(self.tags(encoder, mb), self.ran_on[(encoder, mb)])
        target, ahead = self._target(mb)
        for name, value in zip(self.encoders[encoder].feeds, values):
            self.batches.provide(target, name, value, ahead)
