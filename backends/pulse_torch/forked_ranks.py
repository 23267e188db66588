"""CPU ranks forked from the launcher, which has imported torch and the rank's module once for all of them.

::

    torchrun (a subprocess per rank)        python -m pulse_torch.train    each rank: import torch, torch._dynamo
                                                                           and PULSE (~3 s of CPU), then train
    this (a CPU build of torch)             launcher: import them once ─ fork ─▶ each rank: run the module as
                                                                           __main__ (what python -m does), train

Every rank of a CPU job imported the same libraries, in a process of its own, before its first
step: torch (1.1-1.5 s of CPU on this project's 2-core host), ``torch._dynamo`` (another 1.2 s:
``torch.optim`` imports it on an optimizer's first use) and PULSE's modules. ``pulse_torch.launch``
runs torchrun's agent in its own process, which imports torch anyway; here it imports the rest
too and hands torchrun a function entry point with the ``fork`` start method (torchrun's own
``--start-method``, used for function entry points), so each rank starts with them imported.
What a rank then runs is the module's code as ``__main__``, with its arguments in ``sys.argv``,
as ``python -u -m MODULE ARGS`` would: the same entry, exit codes and output.

Only on a CPU build of torch (no CUDA, ROCm or torch_npu), where there is no device runtime a
fork could inherit half-started; GPU and NPU ranks stay subprocesses as torchrun starts them.
``PULSE_FORK_RANKS=0`` turns it off. What a forked child must not inherit is undone before the
module runs: the launcher's signal handlers (torchrun's agent raises on SIGTERM), its sockets (the
rendezvous store's), and the thread count torch took from the launcher's environment at import.
"""
from __future__ import annotations

import gc
import importlib
import os
import runpy
import signal
import stat
import sys
from typing import Sequence

from pulse.errors import PulseError
from pulse_torch.dist import cpu_only_build

_forked = False  # set in a forked rank (run_module)
SWITCH = "PULSE_FORK_RANKS"  # "0": every rank a subprocess, as torchrun starts it
# the signals torchrun's agent handles (raising SignalException), which a rank must meet as a fresh process would
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def forks_ranks(args, environ=os.environ) -> bool:
    """Whether torchrun's parsed ``args`` can start their ranks by fork: a module entry (``-m``), run by
    Python, on a CPU build of torch, not turned off."""
    return (environ.get(SWITCH, "1") != "0" and bool(args.module) and not args.no_python
            and not args.run_path and cpu_only_build())


def preload(module: str, argv: Sequence[str]) -> None:
    """Import what every rank imports before its first step, once, here: the rank's module (and with it
    torch and PULSE), ``torch._dynamo`` (which ``torch.optim`` imports on an optimizer's first use), and
    what the module's own ``preload(argv)`` names for this run (``pulse_torch.train``: a diffusers model's
    libraries)."""
    import torch._dynamo  # noqa: F401

    entry = importlib.import_module(module)
    if callable(getattr(entry, "preload", None)):
        try:
            entry.preload(list(argv))
        except (PulseError, OSError, ImportError):  # bad input or a missing library: the ranks say so, one line
            pass


def leaves_on_return() -> bool:
    """Whether this process is a forked rank. Its entry's return ends it without tearing anything down
    (multiprocessing leaves by ``os._exit``), and an ``os._exit(0)`` of its own would leave torchrun's
    agent waiting for a return value that never comes: such a rank returns its code instead."""
    return _forked


def run_module(module: str, *argv: str) -> None:
    """A forked rank: undo what it must not inherit, then run ``module`` as ``python -u -m module argv``."""
    global _forked
    _forked = True
    close_inherited_sockets()
    for name in AGENT_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):  # -u: each line leaves as it is written
        try:
            stream.reconfigure(write_through=True)
        except (AttributeError, ValueError):
            pass
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read at torch's import, here in the launcher, before torchrun set it
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # as under python -m, the module runs as __main__ only (its imports stay)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def close_inherited_sockets() -> None:
    """Close every socket the launcher held (its store's listening socket and connections): a rank
    opens its own. torchrun's pipes to the rank (its return value, its finish) are pipes, not sockets."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the directory's own descriptor, gone by now
            pass


def launch_forked(args) -> None:
    """torchrun's ``run`` on parsed ``args`` with each rank forked from this process (``run_module``)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    config, _cmd, cmd_args = config_from_args(args)
    config.start_method = "fork"
    # config_from_args gives [-u, -m, MODULE, *rank args] for a module entry
    rank_args = cmd_args[cmd_args.index(args.training_script) + 1:]
    preload(args.training_script, rank_args)
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered here is written again by each child
    # what is imported by now lives as long as the ranks: out of the collector's sight, so that a rank's
    # collections do not write to (and copy) every page of it (the gc module's advice for fork without exec)
    gc.freeze()
    elastic_launch(config=config, entrypoint=run_module)(args.training_script, *rank_args)
