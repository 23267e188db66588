"""PULSE's one MindSpore setting for a CPU: every op runs where it is launched (``launch_blocking_on_cpu``)."""
from __future__ import annotations

import mindspore as ms


def launch_blocking_on_cpu() -> None:
    """On a CPU, run every op where it is launched (``mindspore.runtime.launch_blocking``).

    PyNative mode hands each op through a pipeline of threads (front end, backward, backend
    queues, an actor, a kernel thread: five beside Python's, all busy). On a CPU, whose kernels
    run on the host anyway, the hand-offs cost more than the small ops they carry: here a
    tiny-uvit step took 1.0 s asynchronously and 0.085 s blocking, tiny-unet's 8.5 s and 1.6 s
    (the same numbers: the same kernels). And an action's time is then its ops' own, which is
    what ``pulse profile`` reads off the executor. On Ascend the device queues hide the launches:
    left asynchronous there.

    It must come before the process's first op: once ops have run asynchronously, the queue
    threads stay and spin after the switch. ``benchmarks/mindspore_launch_blocking.py`` (300
    value_and_grad steps of a conv and a GroupNorm, medians of 3): 4.2 s wall and 8.4 s CPU
    asynchronous, 0.71 s and 1.4 s blocking from the start, 3.7 s and 7.3 s switched after 20
    asynchronous steps. So ``pulse_mindspore.layers`` calls it on import, before any cell can run,
    and the backend again (a process that set another device since)."""
    if ms.get_context("device_target") == "CPU":
        ms.runtime.launch_blocking()
