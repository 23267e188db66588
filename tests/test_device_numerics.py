"""Numerics that depend on the device, checked without one (issue 30, items 4, 5, 7).

- fp16 overflow is the backend's answer, agreed by every rank in the norm's one all-reduce: a stub
  Ascend 910A in saturation mode (overflow reads as +-65504, never inf) must back the scale off.
- bf16 is refused where the device has none (V100, Ascend 910A): before launch and on the rank.
- deterministic kernels only with ``--deterministic``.
The device queries are monkeypatched; nothing here needs a GPU or an NPU.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pulse_torch.job as job_module  # noqa: E402
from pulse import device_check, launch_env  # noqa: E402
from pulse.cli import launchers  # noqa: E402
from pulse.cli.main import main as pulse_main  # noqa: E402
from pulse.args.run_args import rank_entry_parser, run_config_of  # noqa: E402
from pulse.errors import PulseError  # noqa: E402
from pulse.layout import Layout  # noqa: E402
from pulse.train.loop import StepSettings, norm_group, optimizer_update  # noqa: E402
from pulse.train.run_config import RunConfig  # noqa: E402
from pulse.train.schedules import DynamicLossScale  # noqa: E402
from pulse_torch import device_support  # noqa: E402
from pulse_torch.backend import TorchBackend  # noqa: E402
from pulse_torch.dist import DistContext  # noqa: E402

FP16_MAX = 65504.0


# -- item 4: fp16 overflow, as a saturating device reports it ------------------------------------

class SaturatingBackend:
    """An Ascend 910A as the loop sees it (saturation mode): an fp16 overflow left +-65504 in the
    gradients, never inf or NaN, and set the device's overflow flag, which ``overflowed`` reads
    and clears. Numpy gradients of one chunk; records what the loop did."""

    def __init__(self, grads: dict[str, np.ndarray], flag: bool) -> None:
        self.grads = {n: g.astype(np.float64) for n, g in grads.items()}
        self.flag = flag
        self.ema: dict = {}
        self.steps = 0

    def grad_square_sum(self, chunks) -> float:
        return float(sum(np.sum(g * g) for g in self.grads.values()))

    def scale_gradients(self, chunks, factor: float) -> None:
        self.grads = {n: g * factor for n, g in self.grads.items()}

    def unscale_gradients(self, chunks, scale: float) -> None:
        self.scale_gradients(chunks, 1.0 / scale)

    def overflowed(self, chunks) -> bool:
        flagged, self.flag = self.flag, False
        return flagged

    def set_learning_rate(self, chunks, lr: float) -> None:
        pass

    def optimizer_step(self, chunk) -> None:
        self.steps += 1

    def ema_update(self, chunks, decay: float) -> None:
        pass

    def from_numpy(self, a):
        return np.array(a)

    def to_numpy(self, t):
        return np.asarray(t)


def saturated_grads(scale: float) -> dict[str, np.ndarray]:
    """What a 910A leaves after an overflowing fp16 backward at loss scale ``scale``: finite."""
    return {"w": np.array([FP16_MAX, -FP16_MAX, 3.0 * scale]), "b": np.array([FP16_MAX])}


def test_a_saturated_overflow_backs_the_scale_off_and_skips_the_step() -> None:
    scaler = DynamicLossScale(scale=2.0 ** 16)
    backend = SaturatingBackend(saturated_grads(scaler.scale), flag=True)
    norm, skipped = optimizer_update(backend, ["chunk"], 0, StepSettings(clip=1.0), scaler)
    assert math.isfinite(norm)  # what the loop used to ask: it sees nothing wrong
    assert skipped and backend.steps == 0
    assert (scaler.scale, scaler.skipped, scaler.good_steps) == (2.0 ** 15, 1, 0)
    backend.grads = {"w": np.array([1.0, 2.0, 3.0]) * scaler.scale}  # the next step is clean: it updates
    norm, skipped = optimizer_update(backend, ["chunk"], 1, StepSettings(clip=1.0), scaler)
    assert not skipped and backend.steps == 1 and norm == pytest.approx(math.sqrt(14.0))
    assert (scaler.scale, scaler.skipped, scaler.good_steps) == (2.0 ** 15, 1, 1)


class ThreadNetwork:
    """All-reduce over every thread (the world), counted per rank: one per step is the budget."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: dict[int, np.ndarray] = {}
        self.calls: Counter[int] = Counter()


class ThreadComm:
    def __init__(self, net: ThreadNetwork, rank: int) -> None:
        self.net, self.rank = net, rank

    def all_reduce(self, tensor, group, timeout=None):
        self.net.calls[self.rank] += 1
        self.net.slots[self.rank] = np.array(tensor)
        self.net.barrier.wait(timeout=60)
        total = sum(self.net.slots[r] for r in group)
        self.net.barrier.wait(timeout=60)
        return total


def test_one_ranks_overflow_skips_the_step_on_every_rank_of_every_replica() -> None:
    """pp 2 x dp 2: only replica 1's stage 0 saw the overflow (its flag; the buckets' sum of its
    +-max gradients is finite on the others). All four skip, in the one all-reduce of the norm,
    and the norm counts each pipeline's gradients once."""
    pp, dp, scale = 2, 2, 1024.0
    net = ThreadNetwork(pp * dp)
    grads = {0: {"w": np.array([3.0, 4.0]) * scale}, 1: {"w": np.array([12.0]) * scale}}  # per stage, as summed
    results: dict[int, tuple] = {}

    def rank(r: int) -> None:
        layout = Layout(pp, dp, r)
        backend = SaturatingBackend(grads[layout.stage], flag=(r == 2))
        scaler = DynamicLossScale(scale=scale)
        group, replicas = norm_group(layout, fp16=True)
        norm, skipped = optimizer_update(backend, ["chunk"], 0, StepSettings(clip=0.0), scaler,
                                         ThreadComm(net, r), group, replicas=replicas)
        results[r] = (norm, skipped, scaler.scale, backend.steps)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(pp * dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(res == (pytest.approx(13.0), True, 512.0, 0) for res in results.values())  # sqrt(9+16+144)
    assert net.calls == {0: 1, 1: 1, 2: 1, 3: 1}  # no second round trip for the flag


def test_the_norm_group_spans_the_world_only_for_fp16() -> None:
    layout = Layout(pp=2, dp=2, rank=3)
    assert norm_group(layout, fp16=True) == ([0, 1, 2, 3], 2)
    assert norm_group(layout, fp16=False) == ([2, 3], 1)
    assert norm_group(Layout(pp=4, dp=1, rank=1), fp16=True) == ([0, 1, 2, 3], 1)


def torch_backend_with_saturated_grads(flag: bool) -> tuple[TorchBackend, list]:
    backend = TorchBackend(dtype=torch.float32)
    chunk = torch.nn.Linear(2, 2)  # a chunk as the loop sees it: parameters with gradients
    for p in chunk.parameters():
        p.grad = torch.full_like(p, FP16_MAX)
    chunk.optimizer = None
    chunk.layers = {"lin": chunk}
    backend.device_overflow = lambda: flag  # the torch_npu overflow flag (saturation_overflow_flag)
    return backend, [chunk]


def test_torch_backend_asks_the_device_flag_where_the_gradients_look_finite() -> None:
    scaler = DynamicLossScale(scale=1024.0)
    backend, chunks = torch_backend_with_saturated_grads(flag=True)
    before = [p.detach().clone() for p in chunks[0].parameters()]
    norm, skipped = optimizer_update(backend, chunks, 0, StepSettings(lr=1e-2), scaler)
    assert math.isfinite(norm) and skipped and scaler.scale == 512.0
    assert all(torch.equal(a, p) for a, p in zip(before, chunks[0].parameters()))
    backend, chunks = torch_backend_with_saturated_grads(flag=False)
    norm, skipped = optimizer_update(backend, chunks, 0, StepSettings(lr=1e-2), DynamicLossScale(scale=1024.0))
    assert not skipped and norm == pytest.approx(FP16_MAX / 1024.0 * math.sqrt(6.0))


def test_torch_unscale_divides_on_the_device_and_finds_inf_and_nan() -> None:
    backend = TorchBackend(dtype=torch.float32)
    chunk = torch.nn.Linear(2, 1)
    chunk.weight.grad = torch.tensor([[2048.0, -1024.0]])
    chunk.bias.grad = torch.tensor([512.0])
    backend.unscale_gradients([chunk], 1024.0)
    assert chunk.weight.grad.tolist() == [[2.0, -1.0]] and chunk.bias.grad.tolist() == [0.5]
    assert not backend.overflowed([chunk])
    chunk.bias.grad = torch.tensor([float("nan")])
    backend.unscale_gradients([chunk], 2.0)
    assert backend.overflowed([chunk])
    assert backend.overflowed([chunk])  # asked again without an unscale: it checks the gradients itself


def test_mindspore_overflow_is_all_finite_not_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    ms = pytest.importorskip("mindspore")
    from pulse_mindspore.backend import MindSporeBackend

    backend = MindSporeBackend()
    chunk = SimpleNamespace(params={"w": None}, grads={"w": ms.Tensor(np.array([FP16_MAX], np.float32))})
    assert not backend.overflowed([chunk])  # CPU: AllFinite of the values, which are finite
    asked = []
    # Ascend 910A: all_finite reads the float-status registers, which saw the saturated overflow
    monkeypatch.setattr(ms.amp, "all_finite", lambda grads: asked.append(len(grads)) or ms.Tensor(False))
    assert backend.overflowed([chunk]) and asked == [1]


# -- item 5: bf16 where the device has none --------------------------------------------------------

def fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str, native_bf16: bool) -> None:
    # torch >= 2.3 counts emulation by default: a V100 says True unless asked including_emulation=False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16 or
                        including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)


def fake_npu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch, "npu", SimpleNamespace(get_device_name=lambda index=0: name), raising=False)


def test_bf16_refused_on_a_v100_and_accepted_on_an_a100(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, "Tesla V100-SXM2-32GB", native_bf16=False)
    refusal = device_support.bf16_refusal("cuda:0")
    assert refusal is not None and "Tesla V100-SXM2-32GB" in refusal and "bf16" in refusal and "\n" not in refusal
    fake_cuda(monkeypatch, "NVIDIA A100-SXM4-80GB", native_bf16=True)
    assert device_support.bf16_refusal("cuda:0") is None
    assert device_support.bf16_refusal("cpu") is None


@pytest.mark.parametrize("soc, refused", [("Ascend910A", True), ("Ascend910ProB", True), ("Ascend910B", True),
                                          ("Ascend910B3", False), ("Ascend910_9391", False)])
def test_bf16_refused_on_first_generation_ascend(monkeypatch: pytest.MonkeyPatch, soc: str, refused: bool) -> None:
    fake_npu(monkeypatch, soc)
    refusal = device_support.bf16_refusal("npu:0")
    assert (refusal is not None) == refused
    assert refusal is None or soc in refusal


def test_pulse_train_refuses_bf16_in_one_line_before_launch(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                            capsys: pytest.CaptureFixture) -> None:
    fake_cuda(monkeypatch, "Tesla V100-SXM2-32GB", native_bf16=False)
    asked = []
    # the probe (a child process on a real node) answered from this process's patched torch
    monkeypatch.setattr(device_check, "probe",
                        lambda module: asked.append(module) or device_support.describe("cuda:0"))
    monkeypatch.setattr("pulse.cli.train_cmd.launch", lambda *a, **k: pytest.fail("launched"))
    code = pulse_main(["train", "--model", "tiny-unet", "--pp", "2", "--schedule", "1f1b", "--partitioner",
                       "sequential", "--precision", "bf16", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and asked == ["pulse_torch.device_support"]
    assert err.count("\n") == 0 and "Tesla V100-SXM2-32GB cannot train in bf16" in err
    assert not (tmp_path / "run" / "plan.yaml").exists()  # refused before anything was written


def test_the_probe_is_asked_only_for_bf16_and_answers_for_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = device_check.probe("pulse_torch.device_support")  # a real child process: this CPU machine
    assert answer == {"device": "cpu", "name": "cpu", "bf16_refusal": None}
    monkeypatch.setattr(device_check, "probe", lambda module: pytest.fail("probed"))
    launchers.TorchrunLauncher().check(RunConfig(precision="fp16"), launchers.Where())


def test_msrun_refuses_bf16_on_a_910a(monkeypatch: pytest.MonkeyPatch) -> None:
    from pulse_mindspore.traits import check_options

    monkeypatch.setattr(launch_env, "ascend_available", lambda: True)
    monkeypatch.setattr(device_check, "probe", lambda module: {"bf16_refusal": f"refused by {module}"})
    with pytest.raises(PulseError, match="refused by pulse_mindspore.device_support"):
        check_options(RunConfig(precision="bf16"))


def test_mindspore_worker_refuses_bf16_on_a_910a(monkeypatch: pytest.MonkeyPatch) -> None:
    ms = pytest.importorskip("mindspore")
    import pulse_mindspore.device_support as ms_support

    monkeypatch.setattr(ms_support, "soc_version", lambda: "ascend910")
    assert "Ascend 910A" in ms_support.bf16_refusal("Ascend")
    assert ms_support.bf16_refusal("CPU") is None
    monkeypatch.setattr(ms_support, "soc_version", lambda: "ascend910b")
    assert ms_support.bf16_refusal("Ascend") is None
    from pulse_mindspore import backend as ms_backend

    monkeypatch.setattr(ms_backend, "bf16_refusal", lambda target: f"no bf16 on this {target}")
    with pytest.raises(PulseError, match="no bf16 on this CPU"):
        ms_backend.MindSporeBackend(compute_dtype=ms.bfloat16)


# -- items 5 and 7 on the rank: what build_job settles before building anything -------------------

class Built(Exception):
    """build_job got past the device set-up (to make_backend)."""


def rank_set_up(monkeypatch: pytest.MonkeyPatch, config: RunConfig, device: str = "cuda:0") -> list:
    """Run the rank's build_job on a monkeypatched ``device`` up to make_backend; the calls to
    torch.use_deterministic_algorithms it made."""
    calls: list = []
    ctx = DistContext(Layout(1, 1, 0), "nccl", device, None)
    monkeypatch.setattr(job_module, "init_distributed", lambda pp, dp, timeout_s: ctx)
    monkeypatch.setattr(job_module.torch, "use_deterministic_algorithms", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(job_module, "make_backend", lambda *a, **k: (_ for _ in ()).throw(Built()))
    with pytest.raises(Built):
        job_module.build_job(config, SimpleNamespace(pp=1, dp=1, model="tiny-unet"), None, None)
    return calls


def test_deterministic_kernels_only_with_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rank_set_up(monkeypatch, RunConfig()) == []  # a GPU run no longer pays for them unasked
    parser = rank_entry_parser("pulse_torch.train", "torchrun")
    config = run_config_of(parser.parse_args(["--plan", "p.yaml", "--deterministic"]))
    assert config.deterministic and not run_config_of(parser.parse_args(["--plan", "p.yaml"])).deterministic
    assert rank_set_up(monkeypatch, config) == [((True,), {"warn_only": True})]


def test_a_rank_refuses_bf16_on_a_device_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, "Tesla V100-PCIE-16GB", native_bf16=False)
    with pytest.raises(PulseError, match="V100-PCIE-16GB cannot train in bf16"):
        rank_set_up(monkeypatch, RunConfig(precision="bf16"))
    assert rank_set_up(monkeypatch, RunConfig(precision="fp16")) == []
