"""`pulse train --backend mindspore`: the msrun command line, its environment, and what to show of its output.

::

    msrun --worker_num N --local_worker_num N --master_port <free> --log_dir RUN/msrun_logs --join True \\
          python -m pulse_mindspore.train --plan RUN/plan.yaml --config RUN/run.yaml
      msrun starts a scheduler and N workers (each runs the entry; their output goes to
      RUN/msrun_logs/worker_<r>.log, which msrun tails to this terminal)

msrun starts the task with the ``python`` found on PATH, so the launch puts
this interpreter's directory first. A pipeline plan (pp > 1) needs Ascend
(HCCL send/recv) or, on CPU, torch: its gloo carries the point-to-point
messages (``pulse_mindspore.transport``), meeting at a TCPStore on the free
port exported as ``PULSE_GLOO_PORT``. Framework-free, like all of ``pulse``:
whether MindSpore is installed is asked of importlib, not by importing it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from pulse.cli import device_check
from pulse.data.backbone_weights import backbone_weights
from pulse.errors import PulseError
from pulse.plan import Plan
from pulse.train.run_config import RunConfig
from pulse.zoo.diffusers_config import PREFIX as DIFFUSERS_PREFIX
from pulse.zoo.diffusers_config import UNET as DIFFUSERS_UNET
from pulse.zoo.diffusers_config import read_config

SDXL_ZOO = "sdxl-unet"  # zoo entries MindSpore refuses (their time_embed reads SDXL's added inputs)

ENTRY = "pulse_mindspore.train"
# Settings whose MindSpore counterpart does not exist (yet): (setting, the only value allowed, why).
UNSUPPORTED = (
    ("images", None, "on-the-fly encoding is PyTorch only: cache first with `pulse cache-latents`, then --data CACHE"),
    ("sample_every", 0, "sample images are drawn by the PyTorch pipeline from a checkpoint"),
    ("emulate_bandwidth", None, "link emulation wraps the PyTorch communicator"),
    ("lora_rank", None, "LoRA adapters are peft modules of the PyTorch backend"),
    ("deterministic", False, "it sets PyTorch's deterministic kernels; MindSpore's own switch is not wired yet"),
)

def communicator_traits(ascend: bool) -> dict[str, bool]:
    """What MindSpore's communicator (pulse_mindspore.comm) does that the simulator prices (Cluster's
    COMMUNICATOR_KEYS): every tensor of a transfer a wire message of its own (header, then payload);
    data-parallel buckets launched at their AR on Ascend (HCCL, asynchronous), summed after the
    actions on CPU (mccl's all-reduce blocks where ops launch blocking: no overlap to gain)."""
    return {"deferred_buckets": not ascend, "tensor_messages": True}

GLOO_PORT_ENV = "PULSE_GLOO_PORT"  # read by pulse_mindspore.transport.gloo_rendezvous
NODES_ENV = "PULSE_MSRUN_NODES"  # the nodes the job spans: a CPU worker's share of its node's cores


def gloo_available() -> bool:
    """torch is importable: the MindSpore workers can carry send/recv over its gloo on CPU."""
    return importlib.util.find_spec("torch") is not None


def ascend_available() -> bool:
    """Ascend NPUs are visible: the driver's device nodes (/dev/davinci0, ...) exist."""
    return any(Path("/dev").glob("davinci[0-9]*"))


def free_port() -> int:
    """A TCP port nobody listens on now (msrun's scheduler takes it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_options(config: RunConfig) -> None:
    if config.precision == "bf16" and not ascend_available():
        raise PulseError("--precision bf16 with --backend mindspore needs Ascend NPUs (MindSpore's CPU kernels have "
                         "no bfloat16 convolution or matmul): use --precision fp16 or fp32 here, or --backend torch")
    if config.precision == "bf16":  # Ascend, but a first-generation 910 (910A) has no bf16 either
        device_check.check_precision(config.precision, "pulse_mindspore.device_support")
    for name, allowed, why in UNSUPPORTED:
        value = getattr(config, name)
        if value != allowed:
            flag = "--" + name.replace("_", "-")
            shown = "" if isinstance(value, bool) else f" {value}"
            raise PulseError(f"{flag}{shown} is not supported with --backend mindspore ({why}); "
                             "use --backend torch for it")

def check_model(model: str) -> None:
    """A diffusers plan MindSpore can train: a UNet whose weights are safetensors (or none: config only).

    The workers check the rest before joining (every layer kind has a cell; the file's names and shapes
    equal the cells', ``pulse_mindspore.diffusers_weights``); this says the common refusals before msrun starts.
    """
    if model.startswith(SDXL_ZOO):
        raise PulseError(f"--backend mindspore does not train SDXL ('{model}': its added text/time embedding "
                         "has no MindSpore cell): use --backend torch")
    if not model.startswith(DIFFUSERS_PREFIX):
        return
    folder = Path(model[len(DIFFUSERS_PREFIX):])
    config = read_config(folder)
    cls = config.get("_class_name")
    if cls != DIFFUSERS_UNET:
        raise PulseError(f"--backend mindspore trains diffusers {DIFFUSERS_UNET} backbones only, not {cls} "
                         "(its diffusers module names differ from the MindSpore cells'): use --backend torch")
    if config.get("addition_embed_type") == "text_time":
        raise PulseError(f"--backend mindspore does not train SDXL UNets ({folder}: addition_embed_type "
                         "'text_time' has no MindSpore cell): use --backend torch")
    entries = backbone_weights(folder)
    stored = sorted({e.dtype for e in (entries or {}).values()} - {"F16", "F32", "F64"})
    if stored:
        raise PulseError(f"{folder}: weights stored as {stored[0]}, which numpy (the MindSpore loader) cannot "
                         "read: save the UNet in float32 or float16, or use --backend torch")


def find_msrun() -> Path:
    if importlib.util.find_spec("mindspore") is None or importlib.util.find_spec("pulse_mindspore") is None:
        raise PulseError("--backend mindspore needs MindSpore and pulse_mindspore: pip install -e '.[mindspore]'")
    msrun = Path(sys.executable).parent / "msrun"
    if not msrun.exists():
        raise PulseError(f"--backend mindspore launches with msrun, which is not next to {sys.executable}; "
                         "install MindSpore (it brings msrun) into this environment")
    return msrun


def msrun_command(plan: Plan, plan_path: Path, config_path: Path, where: Any = None) -> list[str]:
    """One worker per rank of this node. One node: every worker here, a free scheduler port. Several
    (``where``: nnodes, node_rank, master_addr, master_port; the same command on each node): msrun's
    multi-node form, ``--node_rank`` numbering the workers node by node as ``pulse.layout`` expects,
    the scheduler on the node whose address is ``--master_addr``."""
    msrun = find_msrun()
    if plan.pp > 1:
        check_p2p(f"--pp {plan.pp}", "use --pp 1 (data parallel) here")
    return msrun_prefix(msrun, plan.world_size, Path(config_path).parent / "msrun_logs", where) + \
        ["python", "-m", ENTRY, "--plan", str(plan_path), "--config", str(config_path)]


def check_p2p(what: str, instead: str) -> None:
    """Point-to-point messages between MindSpore workers: Ascend (HCCL), or torch's gloo on a CPU."""
    if not ascend_available() and not gloo_available():
        raise PulseError(f"{what} with --backend mindspore needs Ascend NPUs (none found: no "
                         "/dev/davinci*) or torch (its gloo carries send/recv on CPU, where MindSpore's mccl "
                         f"has none): pip install torch, {instead}, or --backend torch")


def msrun_prefix(msrun: Path, n: int, log_dir: Path, where: Any = None) -> list[str]:
    """msrun for ``n`` workers, up to ``python``: all here with a free scheduler port, or this node's share."""
    nodes = getattr(where, "nnodes", 1)
    if nodes == 1:
        place = ["--worker_num", str(n), "--local_worker_num", str(n), "--master_port", str(free_port())]
    else:
        place = ["--worker_num", str(n), "--local_worker_num", str(n // nodes), "--master_addr", where.master_addr,
                 "--master_port", str(where.master_port), "--node_rank", str(where.node_rank)]
    return [str(msrun), *place, "--log_dir", str(log_dir), "--join", "True"]


def msrun_env(environ: dict[str, str] | None = None, nodes: int = 1) -> dict[str, str]:
    """The launch environment: this interpreter first on PATH (msrun runs ``python``), quiet C++ logs,
    and on one node a free port for the gloo group of a CPU pipeline (unused otherwise; several nodes
    agree on the scheduler's port + 1 instead, ``pulse_mindspore.transport.gloo_rendezvous``)."""
    env = dict(os.environ if environ is None else environ)
    if nodes == 1:
        env.setdefault(GLOO_PORT_ENV, str(free_port()))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env[NODES_ENV] = str(nodes)  # read by pulse_mindspore.msrun_env.local_worker
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers share the host's cores
    # MindSpore's C++ warnings (cluster building retries, ...) would flood the tailed worker logs.
    env.setdefault("GLOG_v", "3")
    return env


class MsrunOutput:
    """Filters msrun's stderr: its report of a failed worker and its own traceback are summarised.

    When a worker fails, msrun logs "Worker process <pid> exit with exception.
    Error code: N", kills the others, and raises RuntimeError (exit 1). A
    worker that failed on bad input printed its one line already (msrun tails
    every worker log to stdout): this drops msrun's lines, keeping the code.
    """

    _WORKER = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
    _NOISE = re.compile(r"^\[(INFO|WARNING)\] |Scheduler process \d+ exit with exception|"
                        r"There's worker exits with exception")
    _LOGS = re.compile(r"Please check logs in directory: (.*?)\.?$")

    def __init__(self) -> None:
        self.exit_codes: dict[int, int] = {}  # worker pid -> exit code
        self.log_dir: str | None = None
        self._held: list[str] = []  # msrun's traceback, until its last line says whose it is

    def feed(self, line: str) -> list[str]:
        """The lines to show now."""
        if match := self._WORKER.search(line):
            self.exit_codes[int(match.group(1))] = int(match.group(2))
            return []
        if self._held or line.startswith("Traceback (most recent call last):"):
            self._held.append(line)
            if line[:1] in (" ", "\t") or line.startswith("Traceback"):
                return []
            held, self._held = self._held, []
            if (match := self._LOGS.search(line.strip())) and self.failed():
                self.log_dir = match.group(1)  # a worker failed: its own output said why
                return []
            return held
        return [] if self._NOISE.search(line) else [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, []
        return held

    def failed(self) -> dict[int, int]:
        """Workers that failed by themselves (msrun SIGKILLs the rest: -9)."""
        return {p: c for p, c in self.exit_codes.items() if c not in (0, -9)}

    def exit_code(self, launcher_code: int) -> int:
        """The failed workers' code when they agree on a positive one (2: bad input), else msrun's."""
        codes = set(self.failed().values())
        return codes.pop() if len(codes) == 1 and min(codes) > 0 and launcher_code != 0 else launcher_code

    def failure_note(self) -> str:
        codes = ", ".join(f"worker pid {p}: {'exit code ' + str(c) if c >= 0 else 'signal ' + str(-c)}"
                          for p, c in sorted(self.failed().items())) or "msrun failed"
        return codes + (f"; worker logs in {self.log_dir}" if self.log_dir else "")
