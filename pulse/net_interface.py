"""Which of this machine's network interfaces carries the traffic to an address (Linux, standard library).

::

    interface_toward("127.0.0.1")   -> "lo"
    interface_toward("10.0.0.5")    -> "eth0"   (node 0 owns 10.0.0.5 on eth0, or the route there leaves by eth0)

Why: gloo's data plane listens on whatever the host name resolves to
(torch's default gloo device), whatever address the rendezvous uses; with the
host name mapped to a routable address, a loopback run listened on the
network. ``GLOO_SOCKET_IFNAME`` (torch's documented switch) pins it to one
interface: the launchers give the ranks the interface of ``--master-addr``'s
side. The local address is the one the kernel would send from (a UDP socket
``connect`` sends nothing); its interface is the one that holds that address.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

from pulse.errors import PulseError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address
IF_INET6 = "/proc/net/if_inet6"  # Linux: every IPv6 address, one a line, with its interface


def interface_toward(address: str) -> str:
    """The name of the interface this machine reaches ``address`` through (one line if none is found)."""
    local = local_address_toward(address)
    for name, addresses in interface_addresses().items():
        if local in addresses:
            return name
    raise PulseError(f"cannot tell which network interface holds {local} (the way to {address}); "
                     "name it with GLOO_SOCKET_IFNAME=<interface>")


def local_address_toward(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address this machine sends from to reach ``address`` (a host name or an IP)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: picks the route and the source address, sends nothing
            return ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    except (OSError, IndexError) as exc:
        raise PulseError(f"no route from this machine to {address} ({exc}); name an address of node 0 "
                         "with --master-addr") from None


def interface_addresses() -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every interface's addresses: IPv4 from the kernel (one per interface), IPv6 from /proc."""
    found: dict[str, set] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found.setdefault(name, set()).add(ipaddress.IPv4Address(reply[20:24]))
    try:
        with open(IF_INET6) as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    found.setdefault(fields[5], set()).add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    except OSError:  # no IPv6 on this machine
        pass
    return found
