"""The torch runtime across real processes (torchrun, gloo, CPU) and the process-group backend choice.

One torchrun launch of ``pulse_torch/worker_check.py`` with 4 processes runs
tiny-unet one step (float64, M = 2 x PP) under the pulse V placement
(greedy_v_1f1b) and the sequential one (1f1b), first as PP=2 x DP=2 then as
PP=4 x DP=1 on the same processes, the sequential one also behind an emulated
link (``--emulate-bandwidth``: the ranks book each other's inbound links on
one board across processes). Per configuration the test checks every rank's
gradients against one process training the whole model, its payload bytes per
peer against ``pulse.traffic`` and the simulator's link bytes exactly, and that
the V placement sent no skip tensor.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pulse_torch  # noqa: E402
from pulse.costs import AnalyticProfiler  # noqa: E402
from pulse.hardware import load_cluster, load_hardware  # noqa: E402
from pulse.runtime.message_order import CLASS_SPAN, sent_messages  # noqa: E402
from pulse.runtime.wiring import Wiring  # noqa: E402
from pulse.schedule.lower import lower  # noqa: E402
from pulse.sim.engine import simulate  # noqa: E402
from pulse.spec import ModelSpec  # noqa: E402
from pulse.traffic import transfers  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.comm import HEADER_BYTES  # noqa: E402
from pulse_torch.dist import accelerator_backend  # noqa: E402
from pulse_torch.worker_check import (EMULATED_BANDWIDTH, make_batches, max_relative_error,  # noqa: E402
                                      plan_case, reference_gradients)

WORKER = Path(pulse_torch.__file__).resolve().parent / "worker_check.py"
MODEL, MBS, TOL = "tiny-unet", 1, 1e-5
LAYOUTS = [(2, 2), (4, 1)]  # (pp, dp)
# ":ordered": messages matched by order per pair, not by tag (NCCL's and HCCL's rule), on gloo;
# ":emulated": behind --emulate-bandwidth's link, every rank booking the others' inbound links on one board
CONFIGS = ["pulse:greedy_v_1f1b", "sequential:1f1b", "pulse:greedy_v_1f1b:ordered", "sequential:1f1b:emulated"]
LAUNCH_TIMEOUT = 180  # seconds: a hung rank fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], out: Path) -> None:
    """Launch ``worker_check.py`` under torchrun; fail with the ranks' errors when one fails.

    The port is free when chosen but may be taken before torchrun binds it:
    that one failure is retried once with a new port.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(WORKER), "--out", str(out), *args]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT} s: {' '.join(cmd)}\n{exc.stderr}")
        if done.returncode == 0:
            return
        if attempt == 0 and "address already in use" in done.stderr.lower():
            continue
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
        pytest.fail(f"torchrun failed ({done.returncode}): {' '.join(cmd)}\n" + "\n".join(errors[-20:])
                    + f"\n--- stderr tail ---\n{done.stderr[-3000:]}")


BOARDS_BEFORE: set[Path] = set()


def link_boards() -> set[Path]:
    """The emulated links' boards on this host (``pulse_torch.link_board``)."""
    return {p for base in (Path("/dev/shm"), Path(tempfile.gettempdir())) for p in base.glob("pulse-links-*")}


def spec64() -> ModelSpec:
    return get_spec(MODEL).with_act_bytes(8)  # float64 on the wire


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun of 4 processes running every layout and configuration (one start-up for all)."""
    out = tmp_path_factory.mktemp("torchrun")
    BOARDS_BEFORE.update(link_boards())
    args = ["--model", MODEL, "--microbatch-size", str(MBS), "--dtype", "float64", "--timeout", "60"]
    args += [a for pp, dp in LAYOUTS for a in ("--layout", f"{pp}x{dp}")]
    args += [a for c in CONFIGS for a in ("--config", c)]
    torchrun(4, args, out)
    return out


def expected_bytes(spec: ModelSpec, config: str, pp: int, dp: int) -> dict[int, dict[int, int]]:
    """Payload bytes rank -> peer: each Transfer per sample, activations one way and gradients back;
    the simulator's per-link bytes for the same plan must say the same."""
    partitioner, schedule_name = config.split(":")[:2]
    placement, schedule = plan_case(spec, partitioner, schedule_name, pp, 2 * pp, MBS)
    per_link: dict[tuple[int, int], int] = defaultdict(int)
    for tr in transfers(spec, placement):
        per_link[(tr.src_device, tr.dst_device)] += tr.total_bytes * MBS * 2 * pp
        per_link[(tr.dst_device, tr.src_device)] += tr.total_bytes * MBS * 2 * pp
    costs = AnalyticProfiler(load_hardware("cpu-local")).profile(spec, MBS)
    simulated = simulate(spec, placement, schedule, costs, load_cluster("v100-pcie-1x8")).link_bytes
    assert {k: v for k, v in simulated.items() if v} == dict(per_link)
    out: dict[int, dict[int, int]] = defaultdict(dict)
    for replica in range(dp):
        for (src, dst), nbytes in per_link.items():
            out[replica * pp + src][replica * pp + dst] = nbytes
    return dict(out)


def out_of_send_order(spec: ModelSpec, placement, schedule) -> bool:
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


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("pp,dp", LAYOUTS, ids=[f"pp{p}xdp{d}" for p, d in LAYOUTS])
def test_torchrun_step_matches_reference_and_traffic(launch: Path, pp: int, dp: int, config: str) -> None:
    folder = launch / f"pp{pp}xdp{dp}" / config.replace(":", "-")
    records = {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(pp * dp)}
    spec = spec64()
    ref, ref_losses = reference_gradients(spec, [make_batches(spec, MBS, r) for r in range(dp)],
                                          2 * pp, torch.float64)
    for replica in range(dp):  # after the data-parallel all-reduce every replica holds the mean
        grads = {}
        for device in range(pp):
            with np.load(folder / f"rank{replica * pp + device}.npz") as z:
                grads.update({k: z[k] for k in z.files})
        err = max_relative_error(grads, ref)
        assert err < TOL, f"{config} pp{pp}xdp{dp} replica {replica}: gradients differ by {err:.2e}"
        losses = [records[replica * pp + d]["loss"] for d in range(pp) if records[replica * pp + d]["loss"]]
        assert losses == [pytest.approx(ref_losses[replica], rel=1e-12)]
    want = expected_bytes(spec, config, pp, dp)
    placement, schedule = plan_case(spec, *config.split(":")[:2], pp, 2 * pp, MBS)
    program = lower(schedule, spec, placement)
    sends = {d: sum(a.kind in ("SF", "SB") for a in program.actions[d]) for d in range(pp)}
    if config.endswith(":ordered"):  # a header for each message class's first message only
        wiring = Wiring(spec, placement)
        sends = {d: len({(m.dst_device, m.key % CLASS_SPAN) for m in sent_messages(wiring, program, d)})
                 for d in range(pp)}
    for rank, rec in records.items():
        got = {int(peer): n for peer, n in rec["bytes_sent"].items()}
        assert got == want.get(rank, {}), f"rank {rank}: bytes per peer"
        # one header per transfer (its tensors share one payload), counted apart from the bytes
        assert sum(rec["header_bytes"].values()) == sends[rank % pp] * HEADER_BYTES
        assert len(rec["messages"]) >= sends[rank % pp]
        assert rec["early_left"] == 0
    if config.endswith(":emulated"):  # the same gradients and bytes, every message booked on the link
        check_link_bookings({r: rec["link_bookings"] for r, rec in records.items()},
                            {r: rec["bytes_sent"] for r, rec in records.items()}, {r: sends[r % pp] for r in records})
        assert link_boards() <= BOARDS_BEFORE, "the job left its link board behind"
    if config.endswith(":ordered"):  # messages taken ahead of their turn exactly when the plan needs it
        placement, schedule = plan_case(spec, *config.split(":")[:2], pp, 2 * pp, MBS)
        early = max(rec["peak_early"] for rec in records.values()) > 0
        assert early == out_of_send_order(spec, placement, schedule)
    skip_keys = {e.key for e in spec.skips}
    names = {m[2] for rec in records.values() for m in rec["messages"]}
    if config.startswith("pulse"):
        assert names and not names & skip_keys, f"skip tensors crossed devices: {names & skip_keys}"
    else:  # the sequential baseline relays skips: the log does see them
        assert names & skip_keys


def check_link_bookings(bookings: dict[int, list], bytes_sent: dict[int, dict], sends: dict[int, int]) -> None:
    """The emulated link's slots, read from the stamps (not the host's clock): one booking per send,
    each as long as its bytes take at EMULATED_BANDWIDTH; a rank's outbound link carries one message
    at a time, in send order; every inbound stretch starts at or after its send, and no receiver's
    inbound link carries two messages at once, whoever sent them (one board for the whole job)."""
    inbound: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for rank, booked in bookings.items():
        assert len(booked) == sends[rank], f"rank {rank}: a booking per send"
        for peer, nbytes in bytes_sent[rank].items():
            held = [hold for p, _, hold, _ in booked if p == int(peer)]
            assert abs(sum(held) - nbytes / EMULATED_BANDWIDTH * 1e6) <= len(held)  # µs, rounded per message
        for (_, start, hold, _), (_, later, _, _) in zip(booked, booked[1:]):
            assert later >= start + hold, f"rank {rank}: two messages on its outbound link at once"
        for peer, start, hold, landed in booked:
            assert landed - hold >= start
            inbound[peer].append((landed - hold, landed))
    for receiver, stretches in inbound.items():
        stretches.sort()
        assert all(a[1] <= b[0] for a, b in zip(stretches, stretches[1:])), f"rank {receiver}'s inbound link"


def test_recv_from_a_silent_peer_times_out_naming_it(tmp_path: Path) -> None:
    torchrun(2, ["--mode", "silent-peer", "--recv-timeout", "1", "--timeout", "30"], tmp_path)
    record = json.loads((tmp_path / "silent.json").read_text())
    assert record["type"] == "CommTimeout"
    assert "from rank 1" in record["error"] and "timed out after 1 s" in record["error"]  # the wait it was given


def test_a_tags_later_messages_ride_inline_into_receives_posted_early(tmp_path: Path) -> None:
    """The first message of a tag is a header and a payload; once both sides know its size, one
    message into a receive posted before the send; a payload that grew goes as two again. Each
    direction between the two ranks goes through its own process group."""
    torchrun(2, ["--mode", "inline", "--timeout", "30"], tmp_path)
    record = json.loads((tmp_path / "inline.json").read_text())
    assert record["received"] == [[float(x + i) for x in range(n)] for i, n in enumerate((5, 5, 9))]
    assert record["wire"] == [2, 1, 2]
    assert record["left_posted"] == 0
    assert record["own_groups"]  # gloo: each direction between two ranks has its own process group


def test_hccl_is_chosen_when_torch_npu_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # a stand-in, no __spec__
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert accelerator_backend() == ("hccl", "npu")


def test_gloo_on_a_machine_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    if torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("this machine has an accelerator")
    assert accelerator_backend() == ("gloo", "cpu")
    # torch_npu present but no NPU visible: still gloo
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert accelerator_backend() == ("gloo", "cpu")


def test_header_round_trip_and_rejects_garbage() -> None:
    from pulse.errors import PlanError
    from pulse_torch.wire import HEADER_LEN, decode_header, encode_header, pack, payload_bytes, unpack

    t = torch.arange(30, dtype=torch.float64).reshape(2, 3, 5)
    odd = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)  # 6 bytes: the next tensor starts padded
    flag = torch.tensor([True, False])
    tag, layout, stamp = decode_header(encode_header([odd, t, flag], 12345, stamp=77))
    assert (tag, stamp) == (12345, 77)
    assert layout == [((3,), torch.bfloat16), ((2, 3, 5), torch.float64), ((2,), torch.bool)]
    payload = pack([odd, t, flag], torch.device("cpu"))
    assert payload.numel() == payload_bytes(layout) == 8 + 240 + 8
    for got, want in zip(unpack(payload, layout), [odd, t, flag]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    bad = encode_header([t], 1)
    bad[4] = 99  # dtype code 99
    with pytest.raises(PlanError, match="malformed"):
        decode_header(bad)
    with pytest.raises(PlanError, match="malformed"):
        decode_header(torch.zeros(HEADER_LEN, dtype=torch.int64))  # a message of no tensors
