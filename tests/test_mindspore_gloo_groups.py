"""The gloo groups a MindSpore CPU pipeline's sums meet at, on real processes (``GlooTransport.add_group`` /
``meet``): a group's barrier waits for its own late member, not for ranks outside it, and a member that never
comes ends the wait at the job's timeout in one ``CommTimeout`` line. Three gloo ranks forked from this
worker (torch only; MindSpore is imported by the transport module, so skipped without it)."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import re
import time

import pytest

pytest.importorskip("mindspore")
pytest.importorskip("torch")

from pulse.cli.msrun_launch import free_port  # noqa: E402
from pulse.runtime.errors import CommTimeout  # noqa: E402
from pulse_mindspore.transport import GlooTransport  # noqa: E402

GROUP = (0, 2)  # rank 1 is in the world, not in the group


def _member(rank: int, port: int, timeout: float, arrive_after: float | None, out, late_came) -> None:
    """One rank: joins the world, adds GROUP (every rank must), then, a member that comes, meets there; the
    last to come sets ``late_came`` on its way in, and each says whether it was set when it left."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    carrier = GlooTransport(dist, torch, timeout)
    carrier.add_group(GROUP)
    what = "stayed away"
    if arrive_after is not None:
        time.sleep(arrive_after)
        if arrive_after > 0:
            late_came.set()
        try:
            carrier.meet(GROUP)
            what = "met"
        except CommTimeout as exc:
            what = str(exc)
    out.put((rank, late_came.is_set(), what))
    out.close()
    out.join_thread()  # the queue's feeder thread has written it before the process ends
    time.sleep(2 if arrive_after is None else 0)  # one that stays away is still there while the others wait
    os._exit(0)


def run_world(timeouts: tuple[float, float, float], arrivals: tuple[float | None, ...]) -> dict:
    fork = multiprocessing.get_context("fork")  # this worker's torch import is reused
    out, late_came = fork.Queue(), fork.Event()
    port = free_port()
    ranks = [fork.Process(target=_member, args=(r, port, timeouts[r], arrivals[r], out, late_came))
             for r in range(3)]
    for proc in ranks:
        proc.start()
    got = {}
    for _ in ranks:
        rank, saw_late_one, what = out.get(timeout=60)
        got[rank] = (saw_late_one, what)
    for proc in ranks:
        proc.join(30)
    return got


def test_a_groups_barrier_waits_for_its_late_member_and_not_for_the_others() -> None:
    """Rank 2 comes to the group's sum 1 s after rank 0; rank 1 (not a member) never does. Rank 0 leaves
    the barrier only once rank 2 has come (a world barrier would wait for rank 1 until the timeout)."""
    met = run_world((30.0, 30.0, 30.0), (0.0, None, 1.0))
    assert [met[r][1] for r in range(3)] == ["met", "stayed away", "met"]
    assert met[0][0]  # rank 0 left after rank 2 had come: no clock read, the order is the barrier's


def test_a_member_that_never_comes_ends_the_wait_at_the_jobs_timeout_in_one_line() -> None:
    late = run_world((0.5, 30.0, 30.0), (0.0, None, None))
    assert re.fullmatch(r"rank 0: the gloo barrier before an all-reduce failed \(.+\)", late[0][1]), late[0][1]
