"""What one simulated iteration produced: times, memory, traffic (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pulse.schedule.deps import ComputeKey


@dataclass(frozen=True)
class ComputeSpan:
    device: int
    kind: str  # F, B or W; E for an encode (``chunk`` is then the encoder's index)
    chunk: int
    microbatch: int
    start: float
    end: float

    @property
    def key(self) -> ComputeKey:
        return (self.kind, self.chunk, self.microbatch)


@dataclass(frozen=True)
class MessageEvent:
    """One message on a link: a forward activation or a backward gradient."""

    src_device: int
    dst_device: int
    src_chunk: int  # the chunk that sends it (for a gradient: the traffic's dst chunk)
    dst_chunk: int
    microbatch: int
    direction: str  # "F" (activations), "B" (gradients) or "E" (an encoder's output; src_chunk: the encoder)
    nbytes: int
    skips: tuple[str, ...]  # skip keys riding this message
    ready: float  # the producing compute ended
    start: float  # the link became free for it
    end: float  # arrival at the receiver


@dataclass(frozen=True)
class MarkEvent:
    """A FREE or AR of the lowered program: the moment its rank reached it."""

    device: int
    kind: str  # "FREE" (saved state released) or "AR" (gradient bucket launched)
    chunk: int
    microbatch: int
    time: float


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at the moment of its peak."""

    static: int  # parameters + optimizer state, and gradients where they are held all step
    activations: int  # kept for backward
    skip_cache: int  # skips cached locally until their consumer's backward
    buffers: int  # received messages (and encoder outputs) not yet consumed
    encoder_weights: int = 0  # frozen encoders' weights (Encoder.bytes_per_param each), resident where they run
    # gradients made by the step's backwards so far, where they are not held all step (MemoryModel.lazy_gradients)
    gradients: int = 0

    @property
    def total(self) -> int:
        return self.static + self.activations + self.skip_cache + self.buffers + self.encoder_weights + self.gradients


@dataclass(frozen=True)
class SimResult:
    schedule_name: str
    num_devices: int
    makespan: float
    busy: tuple[float, ...]  # per device, seconds of compute
    idle: tuple[float, ...]
    bubble_ratio: float  # 1 - total busy / (devices * makespan)
    peak_memory: tuple[int, ...]  # bytes per device
    memory: tuple[MemoryBreakdown, ...]  # per device, at its peak
    peak_inflight: tuple[int, ...]  # microbatches started and not finished, per device
    peak_skip_cache: tuple[int, ...]
    skip_cache_curve: tuple[tuple[tuple[float, int], ...], ...]  # per device (time, bytes) steps
    link_bytes: dict[tuple[int, int], int] = field(hash=False)  # (src, dst) -> bytes, fwd + bwd
    compute: tuple[ComputeSpan, ...] = ()
    messages: tuple[MessageEvent, ...] = ()
    memory_budget: int | None = None
    rank_end: tuple[float, ...] = ()  # per device: its action list done (compute and message calls)
    sends_done: tuple[float, ...] = ()  # per device: its last sent message arrived (``wait_sends``)
    comm_busy: tuple[float, ...] = ()  # per device: seconds spent issuing and unpacking messages
    marks: tuple[MarkEvent, ...] = ()  # every FREE and AR, in time order
    encoder_names: tuple[str, ...] = ()  # the plan's encoders, by the index E spans carry

    @property
    def fits_memory(self) -> bool:
        return self.memory_budget is None or max(self.peak_memory) <= self.memory_budget

    @property
    def total_link_bytes(self) -> int:
        return sum(self.link_bytes.values())

    def span(self, kind: str, chunk: int, microbatch: int) -> ComputeSpan:
        for s in self.compute:
            if s.key == (kind, chunk, microbatch):
                return s
        raise KeyError((kind, chunk, microbatch))

    def summary(self) -> str:
        mem = max(self.peak_memory) / 2**30
        return (f"{self.schedule_name}: makespan {self.makespan * 1e3:.3f} ms, bubble "
                f"{self.bubble_ratio:.1%}, peak memory {mem:.2f} GiB, "
                f"traffic {self.total_link_bytes / 2**20:.1f} MiB")
