"""Every backend's runtime across real processes on CPU: one test, one pytest parameter per backend
(``process_rigs``; a missing framework or msrun skips its cases).

One job per backend runs tiny-unet one step under every configuration on the
same processes, the pulse V placement (greedy_v_1f1b) and the sequential one
(1f1b):
- PyTorch: one torchrun of 4 processes (gloo, float64, M = 2 x PP), first as
  PP=2 x DP=2 then as PP=4 x DP=1; the V placement also with messages matched
  by order (``:ordered``), the sequential one also behind an emulated link
  (``:emulated``: the ranks book each other's inbound links on one board
  across processes).
- MindSpore: one msrun of 2 workers (mccl all-reduce, gloo send/recv:
  ``pulse_mindspore.transport``; float32, PP = 2, M = 2).
Per configuration the test checks every rank's gradients and loss against one
process training the whole model, its payload bytes per peer against
``pulse.traffic`` and the simulator's link bytes exactly, its headers against
the plan, that messages were taken ahead of their turn exactly when the plan
needs it, and that the V placement sent no skip tensor (the sequential one
does: the check can fail).

Measured here (2 shared CPU cores): the torchrun ~15 s, the msrun ~19 s and
MindSpore's one-process reference ~25 s.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from backend_rigs import max_relative_error
from process_rigs import JOB_CASES, MBS, Job, JobRig, job_rig, link_boards
from pulse.costs import AnalyticProfiler
from pulse.hardware import load_cluster, load_hardware
from pulse.placement import Placement
from pulse.runtime.wiring import Wiring
from pulse.schedule.ir import Schedule
from pulse.sim.engine import simulate
from pulse.spec import ModelSpec
from pulse.traffic import transfers

CASES = [pytest.param(backend, pp, dp, config, id=f"{backend}-pp{pp}xdp{dp}-{config}")
         for backend, cases in JOB_CASES.items() for pp, dp, config in cases]


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """One torchrun running every torch case (one start-up for all)."""
    return job_rig("torch").launch(tmp_path_factory.mktemp("torchrun"))


@pytest.fixture(scope="module")
def mindspore_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """One msrun job running every MindSpore case."""
    return job_rig("mindspore").launch(tmp_path_factory.mktemp("msrun_pp2"))


def expected_bytes(spec: ModelSpec, placement: Placement, program: Schedule, microbatches: int,
                   pp: int, dp: int) -> dict[int, dict[int, int]]:
    """Payload bytes rank -> peer: each Transfer per sample, activations one way and gradients back;
    the simulator's per-link bytes for the same plan must say the same."""
    per_link: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):
        per_link[(tr.src_device, tr.dst_device)] += tr.total_bytes * MBS * microbatches
        per_link[(tr.dst_device, tr.src_device)] += tr.total_bytes * MBS * microbatches
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    simulated = simulate(spec, placement, program, costs, load_cluster("v100-pcie-1x8")).link_bytes
    assert {k: v for k, v in simulated.items() if v} == dict(per_link)
    out: dict[int, dict[int, int]] = defaultdict(dict)
    for replica in range(dp):
        for (src, dst), nbytes in per_link.items():
            out[replica * pp + src][replica * pp + dst] = nbytes
    return dict(out)


def out_of_send_order(spec: ModelSpec, placement: Placement, schedule: Schedule) -> bool:
    """True when some rank receives a peer's messages in another order than the peer sends them."""
    wiring = Wiring(spec, placement)
    sent: dict[tuple[int, int], list[int]] = defaultdict(list)
    received: dict[tuple[int, int], list[int]] = defaultdict(list)
    for device, actions in schedule.actions.items():
        for pos, t in wiring.match_transfers(actions).items():
            a, tr = actions[pos], wiring.transfers[t]
            tags = [g.as_int() for g in wiring.tags("F" if a.kind in ("SF", "RF") else "B", t, a.microbatch)]
            peer = tr.dst_device if a.kind in ("SF", "RB") else tr.src_device
            book = sent if a.kind in ("SF", "SB") else received
            book[(device, peer) if book is sent else (peer, device)] += tags
    return sent != received


def replica_gradients(folder: Path, replica: int, pp: int) -> dict[str, np.ndarray]:
    """The gradients one pipeline replica's ranks wrote, by parameter name."""
    grads: dict[str, np.ndarray] = {}
    for device in range(pp):
        with np.load(folder / f"rank{replica * pp + device}.npz") as z:
            grads.update({k: z[k] for k in z.files})
    return grads


@pytest.mark.parametrize("backend,pp,dp,config", CASES)
def test_step_matches_reference_and_traffic(request: pytest.FixtureRequest, backend: str, pp: int, dp: int,
                                            config: str) -> None:
    rig = job_rig(backend)
    job: Job = request.getfixturevalue(f"{backend}_job")
    folder = rig.folder(job.out, pp, dp, config)
    records = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(pp * dp)}
    spec = rig.spec
    ref, ref_losses = rig.reference(pp, dp)
    for replica in range(dp):  # after the data-parallel all-reduce every replica holds the mean
        err = max_relative_error(replica_gradients(folder, replica, pp), ref)
        assert err < rig.grad_tol, f"{config} pp{pp}xdp{dp} replica {replica}: gradients differ by {err:.2e}"
        losses = [records[replica * pp + d]["loss"] for d in range(pp)
                  if records[replica * pp + d]["loss"] is not None]
        assert losses == [pytest.approx(ref_losses[replica], rel=rig.loss_rel)]  # one rank holds the last chunk
    placement, program = rig.plan(config, pp)
    want = expected_bytes(spec, placement, program, rig.microbatches(pp), pp, dp)
    wiring = Wiring(spec, placement)
    sends = {d: sum(a.kind in ("SF", "SB") for a in program.actions[d]) for d in range(pp)}
    for rank, rec in records.items():
        messages = rig.messages(rec)
        assert {int(peer): n for peer, n in rec["bytes_sent"].items()} == want.get(rank, {}), \
            f"rank {rank}: bytes per peer"
        assert sum(n for _, _, n in messages) == sum(want.get(rank, {}).values())
        assert sum(rec["header_bytes"].values()) == rig.headers(wiring, program, rank % pp, config) * rig.header_bytes
        assert len(messages) >= sends[rank % pp] and rec["early_left"] == 0
        if rig.carrier:
            assert rec["carrier"] == rig.carrier
    if rig.ordered(config):  # messages taken ahead of their turn exactly when the plan needs it
        early = max(rec["peak_early"] for rec in records.values()) > 0
        assert early == out_of_send_order(spec, placement, program)
    if config.endswith(":emulated"):  # the same gradients and bytes, every message booked on the link
        check_link_bookings(rig, {r: rec["link_bookings"] for r, rec in records.items()},
                            {r: rec["bytes_sent"] for r, rec in records.items()}, {r: sends[r % pp] for r in records})
        assert link_boards() <= job.boards_before, "the job left its link board behind"
    skip_keys = {e.key for e in spec.skips}
    names = {name for rec in records.values() for _, name, _ in rig.messages(rec)}
    if config.startswith("pulse"):
        assert names and not names & skip_keys, f"skip tensors crossed devices: {names & skip_keys}"
    else:  # the sequential baseline relays skips: the log does see them
        assert names & skip_keys


def check_link_bookings(rig: JobRig, bookings: dict[int, list], bytes_sent: dict[int, dict],
                        sends: dict[int, int]) -> None:
    """The emulated link's slots, read from the stamps (not the host's clock): one booking per send,
    each as long as its bytes take at the rig's emulated bandwidth; a rank's outbound link carries
    one message at a time, in send order; every inbound stretch starts at or after its send, and no
    receiver's inbound link carries two messages at once, whoever sent them (one board for the job)."""
    assert rig.emulated_bandwidth, f"{rig.name} has no emulated link"
    inbound: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for rank, booked in bookings.items():
        assert len(booked) == sends[rank], f"rank {rank}: a booking per send"
        for peer, nbytes in bytes_sent[rank].items():
            held = [hold for p, _, hold, _ in booked if p == int(peer)]
            assert abs(sum(held) - nbytes / rig.emulated_bandwidth * 1e6) <= len(held)  # µs, rounded per message
        for (_, start, hold, _), (_, later, _, _) in zip(booked, booked[1:]):
            assert later >= start + hold, f"rank {rank}: two messages on its outbound link at once"
        for peer, start, hold, landed in booked:
            assert landed - hold >= start
            inbound[peer].append((landed - hold, landed))
    for receiver, stretches in inbound.items():
        stretches.sort()
        assert all(a[1] <= b[0] for a, b in zip(stretches, stretches[1:])), f"rank {receiver}'s inbound link"
