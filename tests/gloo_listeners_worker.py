"""One rank of ``test_gloo_interface``: join gloo, exchange, then write where its listening sockets are.

Run by torchrun (through ``pulse_torch.launch``): ``gloo_listeners_worker.py OUT_DIR``. Writes
``OUT_DIR/rank-<r>.json``: the local address of every listening TCP socket this process holds
(read from the kernel's socket table, matched by inode to this process's file descriptors) and
what the host name resolves to here.
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes


def listening_addresses(inodes: set[str]) -> list[str]:
    """The local address (no port) of every listening socket (state 0A) among ``inodes``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
                found.append(str(ipaddress.ip_address(words)))
    return found


def main() -> None:
    dist.init_process_group("gloo")
    total = torch.ones(4)
    dist.all_reduce(total)  # the data plane is up: every pair connected
    dist.barrier()
    report = {"listening": listening_addresses(own_socket_inodes()),
              "host_name_resolves_to": socket.gethostbyname(socket.gethostname()), "sum": total.tolist()}
    with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.json"), "w") as out:
        json.dump(report, out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no teardown: nothing to learn from it


if __name__ == "__main__":
    main()
