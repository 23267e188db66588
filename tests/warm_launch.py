"""The suite's torch launchers started from a warm interpreter: torch, ``torch._dynamo`` and PULSE imported once.

::

    pulse train ─ Popen ─▶ python -S warm_launch.py PY -m pulse_torch.launch ARGS      (PULSE_LAUNCH_WRAPPER)
                             │ its fds 0-2, argv, env, cwd ──(unix socket)──▶ server: torch & PULSE imported
                             │                                                 └ fork: reporter ─ fork: launcher
                             │ signals ──────────────────────────────────────────────────────────▶ (its group)
                             └ exits as the launcher exited (code or signal) ◀── reporter waits, reports

Every ``pulse_torch.launch`` process imports torch, ``torch._dynamo`` and PULSE before it forks its
ranks: 5-7 s of CPU on this host, paid again by every torch launch the suite makes. Here the
launcher is forked from a server that imported them once (one per pytest worker, ``serve``), and runs
what ``python -m pulse_torch.launch ARGS`` runs, in the caller's cwd, environment and file
descriptors, as ``pulse_torch.forked_ranks`` forks ranks from the launcher. Through
``PULSE_LAUNCH_WRAPPER`` (``pulse.cli.launchers.launcher_prefix``), the one command every torch
launch goes through, so the launches test what users run, not a copy.

What a fresh interpreter would do differently is sent to one: anything but ``-m pulse_torch.launch``
under the server's own Python, a variable read only as the interpreter or a library starts
(``start_up_env``: hash seed, ``LD_PRELOAD``, ``MALLOC_*``, thread counts, ``TORCH_*``) that differs from
the server's, or a PYTHONPATH entry whose start-up hooks would run first (``sitecustomize``:
``tests/fault_injection``). Those, and any launch without a server, ``exec`` the command unchanged.
The client is this file run with ``-S`` (no site packages): stdlib only above ``serve``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

SOCKET_VAR = "PULSE_WARM_LAUNCH_SOCKET"  # the server's socket; unset: every launch runs fresh
PYTHON_VAR = "PULSE_WARM_LAUNCH_PYTHON"  # the interpreter the server runs (only its launches are taken)
MODULE = "pulse_torch.launch"
# read once, as the interpreter or a library starts: a launch must find the server's values
FIXED_AT_START = ("PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONIOENCODING", "PYTHONFAULTHANDLER", "PYTHONMALLOC",
                  "PYTHONOPTIMIZE", "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONDEVMODE", "PYTHONHOME",
                  "PYTHONTRACEMALLOC", "PYTHONSAFEPATH", "PYTHONINTMAXSTRDIGITS", "LD_PRELOAD", "GLIBC_TUNABLES")
FIXED_PREFIXES = ("MALLOC_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def start_up_env(env: dict[str, str]) -> dict[str, str]:
    """The variables an interpreter or its libraries read when they start, which a fork cannot take
    afterwards. Not among them: PYTHONPATH, PYTHONUNBUFFERED and PYTHONDONTWRITEBYTECODE (the launcher
    takes them as it starts, below), and LD_LIBRARY_PATH (torch finds its libraries by their rpath;
    the suite's workers gain MindSpore's folder there by importing it, which no user's launch has)."""
    return {k: v for k, v in env.items() if k in FIXED_AT_START or k.startswith(FIXED_PREFIXES)}


def runs_hooks(path_entry: str) -> bool:
    """Whether a PYTHONPATH entry holds something the interpreter runs at start-up."""
    try:
        names = os.listdir(path_entry)
    except OSError:
        return False
    return any(n in ("sitecustomize.py", "usercustomize.py") or n.endswith(".pth") for n in names)


def warm_request(argv: list[str], env: dict[str, str]) -> dict | None:
    """What to send the server, or None where only a fresh interpreter runs ``argv`` as it would."""
    served = env.get(SOCKET_VAR)
    if not served or len(argv) < 3 or argv[0] != env.get(PYTHON_VAR) or argv[1:3] != ["-m", MODULE]:
        return None
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if any(runs_hooks(p) for p in path):
        return None
    return {"args": argv[3:], "env": env, "cwd": os.getcwd(), "path": path, "client": os.getpid(),
            "session": os.getsid(0) == os.getpid()}


def client(argv: list[str]) -> None:
    """Run ``argv`` (a launcher command): through the server where it can, else by ``exec``."""
    env = dict(os.environ)
    request = warm_request(argv, env)
    conn = None
    if request is not None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(env[SOCKET_VAR])
        except OSError:
            conn = None
    if conn is None:
        os.execv(argv[0], argv)
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile("r")
    first = replies.readline().strip()
    if not first.isdigit():  # the server cannot start it as a fresh interpreter would (or is gone)
        conn.close()
        os.execv(argv[0], argv)
    launcher = int(first)
    leads = request["session"]

    def forward(signum: int, _frame) -> None:
        try:  # a group leader stands for its group (pulse train signals the launcher's group)
            os.killpg(launcher, signum) if leads else os.kill(launcher, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    how, value = replies.readline().split()
    if how == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


def start_server(folder: str):
    """A server on ``folder``/warm.sock, started as the suite's launches run (one thread each, no
    PYTHONPATH), and the variables that route launches to it. It listens once its imports are done
    (seconds); a launch before that, or without torch here, runs fresh."""
    import subprocess

    address = os.path.join(folder, "warm.sock")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    server = subprocess.Popen([sys.executable, __file__, "--serve", address], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    variables = {"PULSE_LAUNCH_WRAPPER": f"{sys.executable} -S {__file__}", SOCKET_VAR: address,
                 PYTHON_VAR: sys.executable}
    return server, variables


def listening(address: str, timeout_s: float = 180.0) -> bool:
    """Whether the server at ``address`` listens, waiting up to ``timeout_s`` for its imports."""
    import time

    end = time.monotonic() + timeout_s
    while not os.path.exists(address):
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


# ---- the server (run with the suite's own interpreter; imports torch) ----

def serve(address: str) -> None:
    """Import what every launcher imports, then fork a launcher per connection until killed."""
    import gc

    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import pulse_torch.forked_ranks  # noqa: F401
    import pulse_torch.train  # noqa: F401

    sys.stdout.flush()
    gc.freeze()  # the imports' objects stay untouched in every fork (no copy-on-write by the collector)
    base = sys.path[1:]  # without this file's folder
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".new")
    listener.listen(64)
    os.rename(address + ".new", address)  # the name appears once it listens
    listener.settimeout(1.0)
    while True:
        _reap()
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            listener.close()
            _report(conn, base)
        conn.close()


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def _report(conn: socket.socket, base: list[str]) -> None:
    """In a forked reporter: start the launcher, tell the client its pid, then how it ended. A client
    that dies first (killed with its group) takes the launcher with it, as SIGKILL would have."""
    try:
        message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                return
            message += more
        request = json.loads(message)
        if start_up_env(request["env"]) != start_up_env(dict(os.environ)):
            conn.sendall(b"fresh\n")
            return
        launcher = os.fork()
        if launcher == 0:
            conn.close()
            _run_launcher(request, fds, base)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{launcher}\n".encode())
        ended = os.pidfd_open(launcher)
        try:
            watched = [os.pidfd_open(request["client"])]
        except ProcessLookupError:  # the client is gone already
            watched = []
        ready = select.select([*watched, ended], [], [])[0] if watched else []
        if ended not in ready:
            os.kill(launcher, signal.SIGKILL)
        status = os.waitpid(launcher, 0)[1]
        how = ("signal", os.WTERMSIG(status)) if os.WIFSIGNALED(status) else ("exit", os.waitstatus_to_exitcode(status))
        try:
            conn.sendall(f"{how[0]} {how[1]}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(0)


def _run_launcher(request: dict, fds: list[int], base: list[str]) -> None:
    """``python -m pulse_torch.launch ARGS`` in this forked process, with the client's fds, cwd and env."""
    import atexit
    import io
    import runpy
    import tempfile
    import threading
    import traceback
    import types

    code: int | str = 0
    try:
        if request["session"]:
            os.setsid()
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))  # python -u

        def writer(fd: int, like, line_buffering: bool) -> io.TextIOWrapper:
            raw = io.FileIO(fd, "w", closefd=False)
            return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=like.encoding,
                                    errors=like.errors, line_buffering=line_buffering, write_through=unbuffered)

        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                     encoding=sys.__stdin__.encoding, errors=sys.__stdin__.errors)
        sys.stdout = sys.__stdout__ = writer(1, sys.__stdout__, os.isatty(1))
        sys.stderr = sys.__stderr__ = writer(2, sys.__stderr__, True)
        sys.dont_write_bytecode = bool(request["env"].get("PYTHONDONTWRITEBYTECODE"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # read from the client's TMPDIR again, as a fresh interpreter would
        sys.path[:] = [request["cwd"], *request["path"], *base]
        sys.argv = ["-m", *request["args"]]
        sys.modules["__main__"] = types.ModuleType("__main__")
        runpy._run_module_as_main(MODULE)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = "SIGINT"
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == "SIGINT":  # as Python leaves on an uncaught KeyboardInterrupt: killed by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(int(code))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
