"""Gloo's data plane stays on the rendezvous side (``GLOO_SOCKET_IFNAME`` from ``pulse_torch.launch``).

Left alone, gloo listens on whatever the host name resolves to. The real-process test maps the host
name to this machine's routable address (an /etc/hosts bind-mounted in a private mount namespace:
nothing outside the test sees it), launches two gloo ranks on loopback the way ``pulse train`` does,
and reads each rank's listening sockets from the kernel's socket table: all on 127.0.0.1.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pulse.errors import PulseError
from pulse.net_interface import interface_addresses, interface_toward

WORKER = Path(__file__).resolve().parent / "gloo_listeners_worker.py"
LAUNCH_TIMEOUT = 180  # seconds: a hung rank fails the test instead of the suite


def routable_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None: it has none)."""
    for addresses in interface_addresses().values():
        for address in sorted(addresses, key=str):
            if address.version == 4 and not address.is_loopback and not address.is_link_local:
                return str(address)
    return None


def in_private_hosts(hosts: Path) -> list[str]:
    """The command prefix that runs a command with ``hosts`` as /etc/hosts, seen by it alone."""
    return ["unshare", "-rm", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]


def test_the_interface_is_the_one_that_holds_the_address() -> None:
    loopback = next(name for name, addrs in interface_addresses().items()
                    if ipaddress.ip_address("127.0.0.1") in addrs)
    assert interface_toward("127.0.0.1") == loopback and interface_toward("localhost") == loopback
    address = routable_address()
    if address is not None:
        assert ipaddress.ip_address(address) in interface_addresses()[interface_toward(address)]


def test_an_address_with_no_route_is_one_line() -> None:
    with pytest.raises(PulseError, match="no route from this machine to no-such-host.invalid"):
        interface_toward("no-such-host.invalid")


def test_an_exported_interface_is_kept() -> None:
    pytest.importorskip("torch")
    from pulse_torch.launch import pin_gloo_interface

    mine, unset = {"GLOO_SOCKET_IFNAME": "eth7"}, {}
    pin_gloo_interface("127.0.0.1", mine)
    pin_gloo_interface("127.0.0.1", unset)
    assert mine == {"GLOO_SOCKET_IFNAME": "eth7"} and unset == {"GLOO_SOCKET_IFNAME": interface_toward("127.0.0.1")}


def test_gloo_listens_on_loopback_when_the_host_name_points_elsewhere(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    address = routable_address()
    if address is None or shutil.which("unshare") is None:
        pytest.skip("needs a routable address and unshare")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
    probe = subprocess.run(in_private_hosts(hosts) + ["getent", "hosts", socket.gethostname()],
                           capture_output=True, text=True)
    if probe.returncode != 0 or address not in probe.stdout:
        pytest.skip(f"cannot map the host name in a private mount namespace ({probe.stderr.strip()})")
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["OMP_NUM_THREADS"] = "1"
    command = in_private_hosts(hosts) + [sys.executable, "-m", "pulse_torch.launch", "--bind", "127.0.0.1", "--",
                                         "--nnodes", "1", "--nproc-per-node", "2", str(WORKER), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["host_name_resolves_to"] == address  # the mapping held inside the job
        assert report["sum"] == [2.0] * 4
        assert report["listening"] and set(report["listening"]) == {"127.0.0.1"}, report
