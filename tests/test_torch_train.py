"""PyTorch training entry points: diffusion math, data, profiler, and `pulse train` end to end.

The end-to-end runs launch real torchrun jobs (gloo, CPU, OMP_NUM_THREADS=1):
`pulse train --model tiny-unet --pp 2 --dp 2 --steps 20` once (shared by the
loss, files and determinism tests), a 3-step rerun, and a 2-step run from a
.npz file. A hung rank fails its test after LAUNCH_TIMEOUT, not the suite.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pulse.cli.launchers import LauncherOutput  # noqa: E402
from pulse.partition import partition, plan_symmetric  # noqa: E402
from pulse.runtime.wiring import MessageTag  # noqa: E402
from pulse.zoo import get_spec  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse.train.sampler import Sampler  # noqa: E402
from pulse.data.feed import TARGET, DiffusionFeed  # noqa: E402
from pulse.data.noise import noise_schedule  # noqa: E402
from pulse.data.scheduler_config import noise_settings  # noqa: E402
from pulse.data.sources import FileLatents, SyntheticLatents  # noqa: E402
from pulse_torch.diffusion import MAIN, eps_loss  # noqa: E402
from pulse_torch.profiler import TorchProfiler  # noqa: E402
from pulse_torch.emulation.throttle import ThrottledCommunicator  # noqa: E402
from virtual_clock import VirtualClock  # noqa: E402

LAUNCH_TIMEOUT = 240
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
SPEC = get_spec("tiny-unet")


def pulse_train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pulse.cli.main", "train", "--model", "tiny-unet", "--out-dir", str(out),
           "--timeout", "60", *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def losses(out: Path) -> list[float]:
    return [s["loss"] for s in json.loads((out / "log.json").read_text())["steps"]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """In-process timings and tests run on one thread, as each rank does (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, float]:
    """The README's job: pp 2 x dp 2 on 4 CPU processes, 20 steps."""
    out = tmp_path_factory.mktemp("main")
    start = time.monotonic()
    done = pulse_train(out, "--pp", "2", "--dp", "2", "--steps", "20")
    return out, done, time.monotonic() - start


# -- diffusion math ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "scaled_linear"])
def test_noising_and_targets_match_diffusers(kind: str) -> None:
    """x_t and v against diffusers' own DDPMScheduler (add_noise, get_velocity), and the closed form."""
    if kind == "linear":
        betas = np.linspace(1e-4, 0.02, 1000)
    else:
        betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
    abar = np.cumprod(1.0 - betas)
    rng = np.random.default_rng(0)
    x0, eps = rng.normal(size=(2, 5, 4, 3, 3)).astype(np.float32)
    t = np.array([0, 17, 500, 998, 999])
    want = (np.sqrt(abar[t])[:, None, None, None] * x0 + np.sqrt(1 - abar[t])[:, None, None, None] * eps)
    schedule = noise_schedule(kind)
    np.testing.assert_allclose(schedule.add_noise(x0, eps, t), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(schedule.target(x0, eps, t, "epsilon"), eps)
    diffusers = pytest.importorskip("diffusers")
    start, end = (1e-4, 0.02) if kind == "linear" else (0.00085, 0.012)
    theirs = diffusers.DDPMScheduler(beta_schedule=kind, beta_start=start, beta_end=end)
    x, e, tt = torch.from_numpy(x0), torch.from_numpy(eps), torch.from_numpy(t)
    np.testing.assert_allclose(schedule.add_noise(x0, eps, t), theirs.add_noise(x, e, tt).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(schedule.target(x0, eps, t, "v_prediction"), theirs.get_velocity(x, e, tt).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_a_pipeline_scheduler_sets_the_noise_and_the_run_overrides_it(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "DDPMScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
         "num_train_timesteps": 1000, "prediction_type": "v_prediction"}))
    model = f"diffusers:{tmp_path / 'unet'}"
    assert noise_settings(model, None, None).prediction_type == "v_prediction"
    assert noise_settings(model, None, None).beta_schedule == "scaled_linear"
    assert noise_settings(model, None, "epsilon").prediction_type == "epsilon"
    assert noise_settings("tiny-unet", None, None) == noise_settings("tiny-unet", "linear", "epsilon")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_gradient_equals_autograd(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    out = torch.randn(3, 4, 8, 8, generator=g).to(dtype).requires_grad_()
    target = torch.randn(3, 4, 8, 8, generator=g)
    ref = torch.nn.functional.mse_loss(out.float(), target)
    ref.backward()
    loss, grad = eps_loss({MAIN: out}, {TARGET: target})
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    assert grad[MAIN].dtype == dtype
    torch.testing.assert_close(grad[MAIN].float(), out.grad.float(), rtol=1e-6, atol=1e-9)


def test_learned_variance_outputs_train_their_epsilon_half() -> None:
    out = torch.randn(2, 8, 4, 4, requires_grad=True)  # DiT: epsilon channels, then variance channels
    target = torch.randn(2, 4, 4, 4)
    torch.nn.functional.mse_loss(out[:, :4], target).backward()
    _, grad = eps_loss({MAIN: out}, {TARGET: target})
    torch.testing.assert_close(grad[MAIN], out.grad)
    assert not grad[MAIN][:, 4:].any()


# -- data --------------------------------------------------------------------------------
def test_every_rank_draws_the_same_microbatch_and_the_data_is_learnable() -> None:
    def feed() -> DiffusionFeed:  # built from scratch, as each rank does
        source = SyntheticLatents(SPEC, num_samples=64)
        return DiffusionFeed(source, Sampler(64, 2, 4, 2, seed=3), noise_schedule(), seed=3)

    a, b = feed().batch(5, 1, 2), feed().batch(5, 1, 2)
    assert a.keys() == {MAIN, TARGET, "timesteps", "context"}
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a[TARGET], feed().batch(5, 1, 3)[TARGET])
    x0 = torch.from_numpy(SyntheticLatents(SPEC, num_samples=64).latents(np.arange(64)))
    neighbours = torch.corrcoef(torch.stack([x0[..., :-1].flatten(), x0[..., 1:].flatten()]))[0, 1]
    assert neighbours > 0.8  # smooth fields: structure to learn, unlike white noise
    seen = torch.as_tensor(np.concatenate([Sampler(10, 2, 1, 1, seed=0).indices(s, 0, 0) for s in range(5)]))
    assert sorted(seen.tolist()) == list(range(10))  # one epoch: every sample once


def test_npz_latents_with_and_without_conditions(tmp_path: Path) -> None:
    x = np.random.default_rng(0).normal(size=(6, 4, 16, 16)).astype(np.float32)
    context = np.random.default_rng(1).normal(size=(6, 8, 32)).astype(np.float32)
    np.savez(tmp_path / "with.npz", latents=x, context=context)
    np.savez(tmp_path / "bare.npz", x)
    with_ctx = FileLatents(tmp_path / "with.npz", SPEC)
    index = np.array([4, 1])
    np.testing.assert_array_equal(with_ctx.conditions(index)["context"], context[[4, 1]])
    bare = FileLatents(tmp_path / "bare.npz", SPEC, seed=7)
    np.testing.assert_array_equal(bare.latents(index), x[[4, 1]])
    np.testing.assert_array_equal(bare.conditions(index)["context"], FileLatents(tmp_path / "bare.npz", SPEC, 7)
                                  .conditions(index)["context"])
    np.save(tmp_path / "wrong.npy", x[:, :, :8])
    with pytest.raises(Exception, match=r"\(N, 4, 16, 16\)"):
        FileLatents(tmp_path / "wrong.npy", SPEC)


# -- profiler, throttle, launcher output ----------------------------------------------------------
def test_profiler_measures_every_layer_and_the_partitioners_accept_it() -> None:
    costs = TorchProfiler(warmup=1, repeats=2).profile(SPEC, 1)
    assert costs.layer_names == tuple(layer.name for layer in SPEC.layers)
    assert costs.source == "measured:torch-cpu"
    assert all(t > 0 for t in costs.fwd + costs.bwd) and all(m > 0 for m in costs.act_mem)
    costs.check_matches(SPEC)
    assert plan_symmetric(SPEC, costs, 2).placement.kind == "v"
    assert partition("sequential", SPEC, costs, 4).num_devices == 4


class _Loopback:
    """An inner communicator that hands each sent group (and its stamp) to the next receive."""

    rank = 0

    def __init__(self) -> None:
        self.queue: list[tuple[list[torch.Tensor], int]] = []
        self.bytes_sent: dict[int, int] = {}
        self.last_stamp = 0

    def send_group(self, tensors, peer_rank, tags, timeout=None, stamp=0):
        self.queue.append((list(tensors), stamp))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes_sent[peer_rank] = self.bytes_sent.get(peer_rank, 0) + nbytes

    def recv_group(self, peer_rank, tags, timeout=None):
        tensors, self.last_stamp = self.queue.pop(0)
        return tensors


def test_emulated_link_is_asynchronous_and_serializes_messages(monkeypatch) -> None:
    clock = VirtualClock().drive_throttle(monkeypatch)
    backend, inner = TorchBackend(), _Loopback()
    comm = ThrottledCommunicator(inner, bandwidth=1e5, nbytes=backend.nbytes)
    tag = MessageTag("F", 0, 0, 0, MAIN)
    sent = clock.us
    comm.send(torch.zeros(1000), 1, tag)  # 4000 B at 100 kB/s: on the link for 40 ms
    comm.send(torch.zeros(1000), 1, tag)  # queued behind it: lands at 80 ms
    assert clock.sleeps == [], "a send must not block the sender"
    assert [stamp - sent for _, stamp in inner.queue] == [40_000, 80_000]  # µs: one after the other
    comm.recv(1, tag)
    assert clock.us - sent == 40_000  # the receiver waits until the first lands
    comm.recv(1, tag)
    assert clock.us - sent == 80_000 and len(clock.sleeps) == 2
    assert comm.bytes_sent[1] == 8000 and comm.rank == 0


class _ByTag(_Loopback):
    """Receives by tag, in whatever order the receiver asks (the runtime posts receives ahead)."""

    def recv_group(self, peer_rank, tags, timeout=None):
        i = next(i for i, (t, _) in enumerate(self.queue) if t[0].numel() == tags[0])
        tensors, self.last_stamp = self.queue.pop(i)
        return tensors


def test_emulated_link_delivers_a_message_received_out_of_order_at_its_own_slot(monkeypatch) -> None:
    """A (40 ms on the link) then B (40.04 ms) from one sender; the receiver asks for B first. B lands
    at 80.04 ms; A had the inbound link from 0 to 40 ms, so it is there already (not at 120 ms behind B)."""
    clock = VirtualClock().drive_throttle(monkeypatch)
    backend, inner = TorchBackend(), _ByTag()
    comm = ThrottledCommunicator(inner, bandwidth=1e5, nbytes=backend.nbytes)
    sent = clock.us
    comm.send(torch.zeros(1000), 1, 1000)
    comm.send(torch.zeros(1001), 1, 1001)
    comm.recv(1, 1001)
    assert clock.us - sent == 80_040
    comm.recv(1, 1000)
    assert clock.us - sent == 80_040 and len(clock.sleeps) == 1  # A landed long ago: no wait
    now = clock.us  # the send's slot starts at the send's own stamp, not after it
    comm.send(torch.zeros(1000), 1, 1000)  # the link is free again: 40 ms from now
    comm.recv(1, 1000)
    assert clock.us - now == 40_000


def test_launcher_output_keeps_the_rank_line_and_drops_torchruns_echo() -> None:
    text = """pulse_torch.train: error: the plan needs pp x dp = 2 x 2 = 4 processes but 3 were started
W1122 02:44:20.444000 23747 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 7 closing signal SIGTERM
E1122 02:35:22.095000 17294 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "/work/venv/bin/torchrun", line 8, in <module>
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 17359)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 17358)
============================================================
"""
    out = LauncherOutput()
    shown = [s for line in text.splitlines(keepends=True) for s in out.feed(line)] + out.flush()
    assert shown == [text.splitlines(keepends=True)[0]]
    assert out.exit_codes == {1: -15, 0: 2} and out.exit_code(1) == 2


# -- the torchrun entry ----------------------------------------------------------------------------
def test_world_size_mismatch_is_one_line_and_exit_2(main_run) -> None:
    out, _, _ = main_run
    env = {**ENV, "WORLD_SIZE": "3", "RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "pulse_torch.train", "--plan", str(out / "plan.yaml")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "2 x 2 = 4 processes but 3 were started" in lines[0] and "--nproc-per-node 4" in lines[0]


def test_pulse_train_pp2_dp2_learns_and_writes_its_log(main_run) -> None:
    out, done, seconds = main_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "plan.yaml").is_file() and (out / "loss.png").stat().st_size > 1000
    log = json.loads((out / "log.json").read_text())
    steps = log["steps"]
    assert len(steps) == 20 and log["run"]["world_size"] == 4
    values = [s["loss"] for s in steps]
    assert np.mean(values[-5:]) < np.mean(values[:5]), values
    assert all(s["pipeline_bytes"] > 0 and s["allreduce_bytes"] > 0 and s["seconds"] > 0 for s in steps)
    assert done.stdout.count("train [") >= 20 and "loss" in done.stdout  # rank 0's line per step
    print(f"pulse train pp2 x dp2, 20 steps: {seconds:.1f} s wall, loss {values[0]:.3f} -> {values[-1]:.3f}")


def test_same_seed_gives_bit_identical_losses_recomputing_or_not(main_run, tmp_path: Path) -> None:
    """The rerun recomputes every chunk (the main run's plan, ``recompute`` added): the ranks
    read it from the plan, and fp32 recomputation gives the same numbers bit for bit."""
    out, done, _ = main_run
    assert done.returncode == 0
    plan = (out / "plan.yaml").read_text()
    assert "recompute" not in plan
    (tmp_path / "plan.yaml").write_text(plan + "recompute: [0, 1, 2, 3]\n")
    again = pulse_train(tmp_path / "run", "--plan", str(tmp_path / "plan.yaml"), "--steps", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "recomputing chunks 0, 1, 2, 3" in again.stdout
    assert losses(tmp_path / "run") == losses(out)[:3]  # exact float equality


def test_trains_two_steps_from_an_npz_file(tmp_path: Path) -> None:
    x = SyntheticLatents(SPEC, num_samples=16, seed=5).latents(np.arange(16))
    labels = np.arange(16)  # not a tiny-unet input: ignored
    np.savez(tmp_path / "latents.npz", latents=x, labels=labels)
    done = pulse_train(tmp_path / "run", "--pp", "2", "--steps", "2", "--data", str(tmp_path / "latents.npz"))
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert len(log["steps"]) == 2 and "latents.npz" in log["run"]["data"]
    assert all(np.isfinite(s["loss"]) for s in log["steps"])
