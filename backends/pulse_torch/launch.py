"""torchrun with its store on one address: ``python -m pulse_torch.launch --bind ADDR -- TORCHRUN_ARGS``.

::

    pulse train ──▶ python -m pulse_torch.launch --bind 127.0.0.1 --port 0 -- --nnodes 1 --nproc-per-node 4 -m ...
                      1. a socket bound to ADDR:PORT (port 0: the kernel picks a free one, no race)
                      2. a multi-tenant TCPStore server on that socket (master_listen_fd)
                      3. torchrun in this process, static rendezvous on ADDR:<port>: its store is
                         created multi-tenant on the same port, so torch reuses the server of step 2
                         and workers join it (MASTER_ADDR/MASTER_PORT)
                      4. on a CPU build of torch, each rank forked from here with torch and its module
                         imported once (``pulse_torch.forked_ranks``); else a subprocess per rank
                      5. torchrun's log folder (its ranks' error files) a temporary one, removed when the
                         job ends, unless ``--log-dir`` names one: torchrun left an empty
                         ``torchelastic_*`` folder in TMPDIR for every job

Why: torch's TCPStore server listens on every interface (``*:PORT``) whatever host
it is given, unauthenticated; anyone who reaches the port reads and writes its keys.
A server on an already-bound socket listens where that socket is bound.

Nodes other than 0 (``--node-rank`` > 0) create no server: they connect to node 0's.
The ranks' gloo data plane is pinned the same way: ``GLOO_SOCKET_IFNAME`` names the
interface of ADDR's side (``lo`` for loopback; the one that holds ADDR or carries its
route on other nodes), unless exported already; gloo would otherwise listen on whatever
the host name resolves to (``pulse.net_interface``).
This process also dies with its parent (``PR_SET_PDEATHSIG``): ``pulse train`` killed
by SIGKILL must not leave torchrun and its ranks running.

Stop signals (``--preempt-signals TERM,USR1``, the run's ``--preempt-signals``): torchrun's agent
handles them as it handles SIGTERM (its ``--signals-to-handle``: without SIGUSR1 there, Slurm's
warning would kill the agent, and the ranks with it), passes each on to the ranks and gives them
``--stop-timeout`` seconds (the run's grace and a margin) before SIGKILL; the ranks checkpoint
the step in progress (``pulse.train.preemption``). One stop often reaches the agent twice (Slurm
signals every process of a step, and ``pulse train`` passes it on): a repeat within
``DUPLICATE_S`` is ignored, where torchrun would take it for a second stop and leave at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta

from pulse.errors import PulseError
from pulse.net_interface import interface_toward
from pulse_torch.dist import die_with_parent

PROG = "python -m pulse_torch.launch"


def bound_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address:port`` (IPv4 or IPv6 by the address's form)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"{PROG}: error: cannot listen on {address}:{port} ({exc.strerror}); name an "
                         "address of this machine with --master-addr, or another --master-port") from None
    sock.listen(128)
    sock.set_inheritable(False)  # the ranks must not hold the store's socket open
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False,
                                     description="torchrun whose rendezvous store listens on one address only.")
    parser.add_argument("--bind", default="127.0.0.1", help="the store's address (node 0's, on every node)")
    parser.add_argument("--port", type=int, default=0, help="the store's port (0: any free one; one node only)")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--preempt-signals", default="", metavar="SIGNALS",
                        help="signals torchrun passes on to the ranks (they checkpoint, then leave), e.g. TERM,USR1")
    parser.add_argument("--stop-timeout", type=int, default=None, metavar="SECONDS",
                        help="how long torchrun waits for the ranks after passing a signal on (default: torchrun's)")
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="-- then torchrun's arguments")
    args = parser.parse_args(argv)
    rest = args.torchrun_args[1:] if args.torchrun_args[:1] == ["--"] else args.torchrun_args
    die_with_parent()
    try:
        pin_gloo_interface(args.bind)
    except PulseError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main, parse_args as torchrun_args

    from pulse_torch.forked_ranks import forks_ranks, launch_forked

    quiet_agent_logs()
    try:
        rest = stop_arguments(rest, args.preempt_signals, args.stop_timeout)
    except PulseError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    port, keep = args.port, []
    if args.node_rank == 0:
        sock = bound_socket(args.bind, args.port)
        port = sock.getsockname()[1]
        # keep both alive until torchrun returns: the server serves on this socket
        keep = [sock, dist.TCPStore(args.bind, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                                    master_listen_fd=sock.fileno(), timeout=timedelta(seconds=300))]
    torchrun = ["--rdzv-backend", "static", "--master-addr", args.bind, "--master-port", str(port),
                "--node-rank", str(args.node_rank), *rest]
    own_logs = None
    if torchrun_args(torchrun).log_dir is None:  # torchrun would leave an empty torchelastic_* folder in TMPDIR
        own_logs = tempfile.mkdtemp(prefix="torchelastic_")  # its ranks' error files, read before it returns
        torchrun = ["--log-dir", own_logs, *torchrun]
    parsed = torchrun_args(torchrun)
    try:
        if forks_ranks(parsed):  # a CPU build: ranks forked from here, torch and PULSE imported once
            launch_forked(parsed)
        else:
            torchrun_main(torchrun)
    except ChildFailedError as exc:  # one line, not torchrun's traceback; the ranks said why already
        return failure_code(exc.failures)
    except SignalException as exc:  # stopped from outside: torchrun has stopped its ranks already
        return 128 + int(exc.sigval)
    finally:
        del keep
        if own_logs is not None:
            shutil.rmtree(own_logs, ignore_errors=True)
    return 0


AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default --signals-to-handle


def stop_arguments(torchrun_args: list[str], preempt_signals: str, stop_timeout: int | None) -> list[str]:
    """torchrun's arguments with the stop signals handled by its agent, once per stop (repeats within
    ``DUPLICATE_S`` ignored), and ``stop_timeout`` seconds for the ranks to leave after one."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.run import get_args_parser

    from pulse.train.preemption import signal_names

    names = [f"SIG{n}" for n in signal_names(preempt_signals)]
    if not names:
        return torchrun_args
    known = get_args_parser().format_help()
    extra = []
    if "--signals-to-handle" in known:
        extra += ["--signals-to-handle", ",".join(dict.fromkeys([*AGENT_SIGNALS, *names]))]
    else:  # torch before --signals-to-handle: its agent read the environment
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(dict.fromkeys([*AGENT_SIGNALS, *names]))
    if stop_timeout is not None:
        os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(stop_timeout)  # read when --shutdown-timeout is not given
    api._terminate_process_handler = once_per_stop(api._terminate_process_handler)
    return extra + torchrun_args


def once_per_stop(handler, clock=time.monotonic):
    """torchrun's signal handler (it raises, and the agent stops the ranks) for the first stop and for
    a second one later; a repeat within ``DUPLICATE_S`` of the first is the same stop delivered twice."""
    from pulse.train.preemption import DUPLICATE_S

    first: list[float] = []

    def handle(signum, frame):
        now = clock()
        if first and now - first[0] < DUPLICATE_S:
            return
        first[:] = first or [now]
        handler(signum, frame)
    return handle


def pin_gloo_interface(master_addr: str, environ=os.environ) -> None:
    """The ranks' gloo connections on ``master_addr``'s interface (they inherit this environment);
    an interface the user exported is kept."""
    if not environ.get("GLOO_SOCKET_IFNAME"):
        environ["GLOO_SOCKET_IFNAME"] = interface_toward(master_addr)


def quiet_agent_logs() -> None:
    """torchrun's agent logs every rank it stops, and a failure twice; this launcher says it in one line.
    ``LOGLEVEL=INFO`` (torch's own switch) keeps them."""
    if os.environ.get("LOGLEVEL"):
        return
    agent = [name for name in logging.root.manager.loggerDict if name.startswith("torch.distributed.elastic")]
    for name in [*agent, "torch.multiprocessing.spawn"]:  # spawn: it stops forked ranks (pulse_torch.forked_ranks)
        logging.getLogger(name).setLevel(logging.CRITICAL)


def failure_code(failures: dict) -> int:
    """Say which ranks failed; exit with their code when they agree on a positive one (2: bad input),
    else 1. SIGTERM (-15) is torchrun stopping the others after the first failed."""
    codes = {rank: f.exitcode for rank, f in failures.items() if f.exitcode not in (0, -15)} or \
        {rank: f.exitcode for rank, f in failures.items()}
    agreed = set(codes.values())
    if agreed == {2}:  # bad input: every rank said it in one line (rank 0 once for all)
        return 2
    how = ", ".join(f"rank {r}: {'exit code ' + str(c) if c >= 0 else 'signal ' + str(-c)}"
                    for r, c in sorted(codes.items()))
    print(f"{PROG}: the job failed ({how})", file=sys.stderr, flush=True)
    return agreed.pop() if len(agreed) == 1 and min(agreed) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
