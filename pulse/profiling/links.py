"""The link and all-reduce figures of ``pulse profile``, through the job's real ``Communicator``.

::

    probe_pair(a, b): ping-pong (latency), back-to-back small messages (per-message costs, the
                      send call's share apart), large messages (bandwidth); every rank calls it
    allreduce_curve:  seconds per size over one group (the pipeline, data-parallel, world groups)
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np

from pulse.layout import Layout
from pulse.links import AllReduceCurve, LinkCost
from pulse.profiling.gather import Ranks

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23)  # all-reduce curve points, bytes
# Each all-reduce figure samples at least this long. A small one's tail is rare and long (a stall
# of 1.5-8.5 ms in a few of 20 samples of ~0.35 ms): 20 samples put the 1 KB figure of one host
# anywhere in 0.28-1.21 ms from one profile to the next, and a step pays two such all-reduces.
CURVE_SECONDS = 0.25


def expected(samples: list[float]) -> float:
    """A link or all-reduce figure: the mean of its samples, not the median. Why: a message's
    delay on a shared host is heavy-tailed (measured here: a small all-reduce right after compute
    takes ~0.35 ms three times in four and 1.5-8.5 ms otherwise), every step pays its share of
    that tail, and the simulator adds delays along the critical path, where the expectation of
    a sum is the sum of the expectations. Link figures have 4x the samples of a layer's."""
    return statistics.fmean(samples)


def probe_pair(ranks: Ranks, a: int, b: int, repeats: int) -> LinkCost:
    """Rank ``a`` to rank ``b`` through the real communicator (every rank calls it)."""
    comm, me = ranks.comm, ranks.rank
    small = ranks.tensors.from_numpy(np.zeros(16, dtype=np.float32))  # 64 B
    large = ranks.tensors.from_numpy(np.zeros(1 << 20, dtype=np.float32))  # 4 MiB
    large_bytes = 4 << 20
    one_way, send_calls, streams, bulk = [], [], [], []
    for rep in range(repeats + 1):
        ranks.barrier()
        if me == b:  # b's first receive is posted before a starts the clock: no barrier skew in it
            comm.recv(a, 0)
        elif me == a:
            comm.send(small, b, 0)
            comm.wait_sends()
        start = time.perf_counter()
        for i in range(4):  # round trips back to back
            if me == a:
                comm.send(small, b, 1)
                comm.recv(b, 2)
            elif me == b:
                comm.recv(a, 1)
                comm.send(small, a, 2)
        comm.wait_sends()
        if rep and me == a:
            one_way.append((time.perf_counter() - start) / 8)
        for tensor, sink in ((small, streams), (large, bulk)):
            ranks.barrier()
            start, calls = time.perf_counter(), 0.0
            for i in range(8):
                if me == a:
                    t0 = time.perf_counter()
                    comm.send(tensor, b, 10 + i)
                    calls += time.perf_counter() - t0
                elif me == b:
                    comm.recv(a, 10 + i)
            comm.wait_sends()
            if rep:
                sink.append((time.perf_counter() - start) / 8)
                if tensor is small and me == a:
                    send_calls.append(calls / 8)
    # the pair's figures, from whichever side saw them
    latency_total, send_call, per_message, per_large = ranks.max(
        [expected(x) if x else 0.0 for x in (one_way, send_calls, streams, bulk)])
    receive = max(per_message - send_call, 0.0)
    bandwidth = large_bytes / max(per_large - per_message, 1e-9)
    return LinkCost(bandwidth=bandwidth, latency=max(latency_total - send_call - receive, 0.0),
                    message_overhead=receive, send_overhead=send_call)


def allreduce_curve(ranks: Ranks, group: list[int], repeats: int) -> AllReduceCurve:
    """Seconds of one all-reduce over ``group`` per size of ``SIZES`` (the slowest member's mean),
    each size sampled ``repeats`` times and then on until its samples span ``CURVE_SECONDS``."""
    seconds = []
    for nbytes in SIZES:
        buf = ranks.tensors.from_numpy(np.zeros(nbytes // 4, dtype=np.float32))
        times = timed_allreduces(ranks, buf, group, repeats + 1)[1:]  # the first one warms up
        more = math.ceil(CURVE_SECONDS / max(statistics.fmean(times), 1e-6)) - len(times) \
            if ranks.rank in group else 0
        more = int(ranks.max([more])[0])  # every rank runs the same number of rounds
        if more > 0:
            times += timed_allreduces(ranks, buf, group, more)
        seconds.append(ranks.max([expected(times)])[0])
    return AllReduceCurve(len(group), SIZES, tuple(seconds))


def timed_allreduces(ranks: Ranks, buf: Any, group: list[int], rounds: int) -> list[float]:
    """Seconds of ``rounds`` all-reduces over ``group``, each started from a barrier (every rank calls it)."""
    times = []
    for _ in range(rounds):
        ranks.barrier()
        start = time.perf_counter()
        if ranks.rank in group:
            ranks.comm.all_reduce(buf, group)
        times.append(time.perf_counter() - start)
    return times


def groups(pp: int, dp: int) -> list[list[int]]:
    """One group per size the step uses, smallest first: a data-parallel group (the gradients' all-reduce),
    a pipeline (the norm and report syncs), the world. The curves are looked up by size
    (``Cluster.allreduce_seconds``), so where two of them are the same size (pp = dp) one is measured:
    the data-parallel group, whose all-reduce carries the gradients."""
    layout = Layout(pp, dp)
    by_size: dict[int, list[int]] = {}
    for group in (layout.stage_ranks(0), layout.replica_ranks(0), list(range(pp * dp))):
        if len(group) > 1:
            by_size.setdefault(len(group), group)
    return [by_size[size] for size in sorted(by_size)]
