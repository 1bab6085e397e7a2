"""What a run's processes listen on, asked from inside them, and a machine whose hostname
resolves to one of its other addresses, for what binds to the hostname's address.

``LISTENING`` is code a cell starts with: ``_listening()`` is every TCP socket of the
calling process in the LISTEN state, as ``(address, port)``, read from its descriptors
(``/proc/self/fd``) and ``/proc/net/tcp``/``tcp6`` (which every user of a machine can
read). ``not_loopback(found)`` keeps those another machine, or a container's neighbour,
could reach.

On this machine the hostname resolves to 127.0.0.1, so what binds to the hostname's address
(gloo's default device) is on loopback by luck. :func:`run_with_hostname_elsewhere` runs
Python code where it resolves to a non-loopback address of this machine, as on a TPU VM or
in a container: /etc/hosts replaced in a mount namespace of its own (root only).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

# Code that defines ``_tcp_listening(keep)``: every TCP socket of the machine in the LISTEN
# state whose /proc/net/tcp{,6} fields ``keep`` takes, as (address, port).
TCP_LISTENING = '''
import socket as _socket

def _tcp_listening(keep):
    found = []
    for name, family in (("/proc/net/tcp", _socket.AF_INET),
                         ("/proc/net/tcp6", _socket.AF_INET6)):
        with open(name) as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or not keep(fields):  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                packed = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                                  for i in range(0, len(address), 8))
                found.append((_socket.inet_ntop(family, packed), int(port, 16)))
    return found
'''

LISTENING = TCP_LISTENING + '''
import os as _os

def _listening():
    inodes = set()
    for fd in _os.listdir("/proc/self/fd"):
        try:
            link = _os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return _tcp_listening(lambda fields: fields[9] in inodes)
'''


def not_loopback(found: Sequence[Tuple[str, int]]) -> List[Tuple[str, int]]:
    """The sockets of ``found`` on an address other than loopback (``0.0.0.0`` and ``::``,
    every interface, included)."""
    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback
    return [(a, p) for a, p in found if not loopback(a)]


def other_address() -> Optional[Tuple[str, str]]:
    """``(interface, IPv4 address)`` of this machine that is not loopback, or None."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                asked = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:  # (none)
                continue
        address = socket.inet_ntoa(asked[20:24])
        if not ipaddress.ip_address(address).is_loopback:
            return name, address
    return None


def run_with_hostname_elsewhere(code: str, timeout: float = 240,
                                env: Optional[Dict[str, str]] = None
                                ) -> subprocess.CompletedProcess:
    """``code`` run by this Python where this machine's hostname resolves to the address
    of :func:`other_address` (skips unless root, with ``unshare`` and such an address). The
    child checks that it does before running ``code``."""
    other = other_address()
    if os.geteuid() != 0 or shutil.which("unshare") is None or other is None:
        pytest.skip("needs root, unshare(1) and a non-loopback address (a mount namespace "
                    "whose /etc/hosts resolves the hostname to it)")
    address = other[1]
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        check = ("import socket\n"
                 f"assert socket.gethostbyname(socket.gethostname()) == {address!r}\n")
        return subprocess.run(
            ["unshare", "--mount", "sh", "-c",
             'mount --bind "$0" /etc/hosts && exec "$1" -c "$2"', str(hosts),
             sys.executable, check + code],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **(env or {})})
