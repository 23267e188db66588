"""Measured links and collectives: what ``pulse profile`` writes into a cluster YAML.

A link between two ranks, as the runtime uses it (``pulse.sim.program`` prices it)::

    sender  [send_overhead]                                issuing one wire message
    link          [ bytes / bandwidth ]                    the sender's outbound and
                                                           the receiver's inbound link
    arrival                           + latency
    receiver                                 [message_overhead]   its header, then its payload

and an all-reduce curve per group size: seconds against bytes, interpolated.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from pulse.errors import PulseError
from pulse.yamlio import check_keys, require_list, require_number


@dataclass(frozen=True)
class LinkCost:
    """One ordered pair of ranks. Bandwidth in bytes/s, times in seconds."""

    bandwidth: float
    latency: float
    message_overhead: float = 0.0  # the receiver's time per wire message
    send_overhead: float = 0.0  # the sender's time per wire message

    def with_bandwidth(self, bandwidth: float) -> "LinkCost":
        return LinkCost(bandwidth, self.latency, self.message_overhead, self.send_overhead)


@dataclass(frozen=True)
class AllReduceCurve:
    """All-reduce seconds measured at several sizes for one group size."""

    ranks: int
    nbytes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.nbytes) != len(self.seconds) or not self.nbytes:
            raise PulseError(f"all-reduce curve for {self.ranks} ranks: needs as many sizes as times, at least one")
        if list(self.nbytes) != sorted(set(self.nbytes)):
            raise PulseError(f"all-reduce curve for {self.ranks} ranks: sizes must increase")

    def time(self, nbytes: float) -> float:
        """Piecewise-linear in between, the smallest size's time below it, the last slope beyond."""
        xs, ys = self.nbytes, self.seconds
        if nbytes <= xs[0] or len(xs) == 1:
            return ys[0] if nbytes <= xs[0] else ys[0] * nbytes / xs[0]
        i = min(bisect.bisect_left(xs, nbytes), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0), 0.0)


def links_from_list(items: list, where: str) -> dict[tuple[int, int], LinkCost]:
    out: dict[tuple[int, int], LinkCost] = {}
    for i, item in enumerate(items):
        at = f"{where}: links[{i}]"
        if not isinstance(item, dict):
            raise PulseError(f"{at}: expected a mapping, got {type(item).__name__}")
        check_keys(item, {"src", "dst", "bandwidth", "latency"}, {"message_overhead", "send_overhead"}, at)
        src, dst = (require_number(item, k, at, integer=True) for k in ("src", "dst"))
        if src == dst or (src, dst) in out:
            raise PulseError(f"{at}: link {src}->{dst} is {'a self-link' if src == dst else 'listed twice'}")
        extra = {k: require_number(item, k, at) for k in ("message_overhead", "send_overhead") if k in item}
        out[(src, dst)] = LinkCost(require_number(item, "bandwidth", at, positive=True),
                                   require_number(item, "latency", at), **extra)
    return out


def curves_from_list(items: list, where: str) -> tuple[AllReduceCurve, ...]:
    out = []
    for i, item in enumerate(items):
        at = f"{where}: allreduce[{i}]"
        if not isinstance(item, dict):
            raise PulseError(f"{at}: expected a mapping, got {type(item).__name__}")
        check_keys(item, {"ranks", "bytes", "seconds"}, set(), at)
        ranks = require_number(item, "ranks", at, positive=True, integer=True)
        sizes = [require_number({f"bytes[{j}]": v}, f"bytes[{j}]", at, positive=True, integer=True)
                 for j, v in enumerate(require_list(item, "bytes", at, non_empty=True))]
        times = [require_number({f"seconds[{j}]": v}, f"seconds[{j}]", at)
                 for j, v in enumerate(require_list(item, "seconds", at, non_empty=True))]
        try:
            out.append(AllReduceCurve(ranks, tuple(sizes), tuple(times)))
        except PulseError as exc:
            raise PulseError(f"{at}: {exc}") from None
    if len({c.ranks for c in out}) != len(out):
        raise PulseError(f"{where}: 'allreduce' lists a group size twice")
    return tuple(out)


def links_to_list(links: dict[tuple[int, int], LinkCost]) -> list[dict]:
    return [{"src": a, "dst": b, "bandwidth": c.bandwidth, "latency": c.latency,
             "message_overhead": c.message_overhead, "send_overhead": c.send_overhead}
            for (a, b), c in sorted(links.items())]


def curves_to_list(curves: tuple[AllReduceCurve, ...]) -> list[dict]:
    return [{"ranks": c.ranks, "bytes": list(c.nbytes), "seconds": list(c.seconds)} for c in curves]
