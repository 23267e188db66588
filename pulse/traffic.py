"""What crosses device boundaries for one sample under a placement.

One source of truth for the partitioners' reports, the schedule's send/recv
pass, the simulator and the runtime's communicator: each ``Transfer`` is one
message per microbatch in the forward pass; backward sends the gradient of the
same tensors the other way, the same number of bytes.

Shared inputs a layer makes (``SharedInput.producer``: temb, a text context)
ride the main-path message. Under ``skip_transport == "relay"`` (sequential
baselines) they cross every device boundary after their producer, as
conventional pipelines do. Under ``"direct"`` (V, wave) a device keeps the copy
it first received (or made) for all its later chunks, so the message into chunk
c+1 carries a shared input only if that device has not held it earlier in the
chain: the V's decoder side, which revisits every device, resends nothing::

    V, P = 3, temb made in chunk 0:   dev 0 ─h,temb▶ dev 1 ─h,temb▶ dev 2 ┐
                                      dev 0 ◀──h─── dev 1 ◀──h───  dev 2 ┘

The gradient of a device's copy (summed over all its chunks and what later
devices send back) returns on the backward of the message that brought it.

A frozen encoder run inside the pipeline (``pulse.encoders``) sends its output,
forward only, to each device that reads it and did not run it: one
``EncodeTransfer`` per reader chunk (the first reader chunk of each device).
"""
from __future__ import annotations

from dataclasses import dataclass

from pulse.encoders import EncoderSet, reader_chunks
from pulse.placement import Placement
from pulse.spec import ModelSpec

# A transfer's tensors cross together, one header and one payload per wire message
# (backends/pulse_torch/wire.py); a transfer with more tensors than this takes several.
MAX_TENSORS_PER_MESSAGE = 32


def wire_messages(tensors: int) -> int:
    """Wire messages that carry ``tensors`` tensors (each a header with its payload inline once both
    sides know the tag's size, which is every step after the first: ``pulse_torch.comm``)."""
    return -(-tensors // MAX_TENSORS_PER_MESSAGE)


@dataclass(frozen=True)
class Transfer:
    src_chunk: int
    dst_chunk: int
    src_device: int
    dst_device: int
    main_bytes: int  # the main-path activation (0 for a direct skip message)
    skip_bytes: int
    shared_bytes: int
    skips: tuple[str, ...]  # skip keys carried ("src->dst")
    shared: tuple[str, ...]  # produced shared inputs carried (direct: only to a device not holding them)

    @property
    def total_bytes(self) -> int:
        return self.main_bytes + self.skip_bytes + self.shared_bytes


@dataclass(frozen=True)
class TrafficReport:
    """Bytes per sample, forward (backward moves the same amount back)."""

    main_bytes: int
    skip_bytes: int
    shared_bytes: int
    messages: int

    @property
    def forward_bytes(self) -> int:
        return self.main_bytes + self.skip_bytes + self.shared_bytes

    @property
    def total_bytes(self) -> int:
        """Forward activations plus backward gradients."""
        return 2 * self.forward_bytes


def transfers(spec: ModelSpec, placement: Placement) -> list[Transfer]:
    """Forward messages per sample, in chunk order.

    Produced shared inputs go to a device once under direct transport (see the
    module docstring): re-sending a tensor the device already holds would only
    add traffic, since its copy serves every later chunk there.
    """
    chunks = placement.chunks
    spans = spec.skip_spans()
    producers = {s.name: spec.index(s.producer) for s in spec.shared_inputs if s.producer is not None}
    shared_bytes = {s.name: s.bytes for s in spec.shared_inputs}
    resend = placement.skip_transport == "relay"
    held: dict[int, set[str]] = {}  # device -> produced shared inputs it holds so far
    out: list[Transfer] = []
    for c in range(len(chunks) - 1):
        here, nxt = chunks[c], chunks[c + 1]
        boundary = here.end  # first layer of the next chunk
        held.setdefault(here.device, set()).update(n for n, p in producers.items() if p < boundary)
        if here.device == nxt.device:
            continue
        shared = tuple(name for name, p in producers.items()
                       if p < boundary and (resend or name not in held.get(nxt.device, ())))
        relayed: tuple[str, ...] = ()
        if placement.skip_transport == "relay":
            relayed = tuple(e.key for s, t, e in spans if s < boundary <= t)
        out.append(Transfer(
            src_chunk=c, dst_chunk=c + 1, src_device=here.device, dst_device=nxt.device,
            main_bytes=spec.layers[boundary - 1].out_bytes,
            skip_bytes=sum(e.bytes for s, t, e in spans if e.key in relayed),
            shared_bytes=sum(shared_bytes[n] for n in shared),
            skips=relayed, shared=shared,
        ))
    if placement.skip_transport == "direct":
        for s, t, e in spans:
            a, b = placement.chunk_of_layer(s), placement.chunk_of_layer(t)
            if chunks[a].device != chunks[b].device:
                out.append(Transfer(a, b, chunks[a].device, chunks[b].device,
                                    0, e.bytes, 0, (e.key,), ()))
        out.sort(key=lambda tr: (tr.src_chunk, tr.dst_chunk))
    return out


def summarize(spec: ModelSpec, placement: Placement) -> TrafficReport:
    msgs = transfers(spec, placement)
    return TrafficReport(
        main_bytes=sum(m.main_bytes for m in msgs),
        skip_bytes=sum(m.skip_bytes for m in msgs),
        shared_bytes=sum(m.shared_bytes for m in msgs),
        messages=len(msgs),
    )


def skips_leaving_device(spec: ModelSpec, placement: Placement) -> list[str]:
    """Skip keys whose tensor crosses a device boundary (empty for a proper V/wave)."""
    return sorted({k for m in transfers(spec, placement) for k in m.skips})


@dataclass(frozen=True)
class EncodeTransfer:
    """Encoder ``encoder``'s output for one sample, to ``dst_chunk`` when the encode ran elsewhere
    (no gradient comes back: the encoders are frozen)."""

    encoder: int  # index in the EncoderSet
    dst_chunk: int
    dst_device: int
    nbytes: int  # per sample


def encode_transfers(spec: ModelSpec, placement: Placement, encoders: EncoderSet) -> list[EncodeTransfer]:
    """Every delivery an encode may need, per encoder in order, then chain order; the one that
    runs on device d skips the transfers whose ``dst_device`` is d."""
    return [EncodeTransfer(e, c, placement.chunks[c].device, enc.out_bytes_at(spec.act_bytes))
            for e, enc in enumerate(encoders.encoders) for c in reader_chunks(spec, placement, enc)]


def encode_bytes(spec: ModelSpec, placement: Placement, encoders: EncoderSet,
                 encode_devices: dict[tuple[int, int], int]) -> int:
    """Bytes per sample the encodes put on links, given each (encoder, microbatch)'s device."""
    deliveries = encode_transfers(spec, placement, encoders)
    return sum(tr.nbytes for (e, _), d in encode_devices.items() for tr in deliveries
               if tr.encoder == e and tr.dst_device != d)
