"""Who is asking: a request's client address, whether it is on this host, and, for a loopback
TCP connection, the local user that holds the client's end of it.

Shared-memory registration opens ``/dev/shm`` objects with the daemon's permissions, so a
keyless daemon lets a local process register only objects of that process's own user, as if it
had opened them itself (routers/shm.py). The kernel lists every TCP socket of the network
namespace with its owner in ``/proc/net/tcp`` and ``/proc/net/tcp6``; the client's end of a
loopback connection is the socket whose local address is the client's address and port and
whose remote port is the daemon's.

Behind ``--workers`` a request reaches the primary over a private Unix socket from the worker
that holds the connection; the worker names the client's address in :data:`CLIENT_HEADER`
beside the link's token, and only a header that comes with the token is believed.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from dataclasses import dataclass
from typing import Any

from mmad.errors import Forbidden

CLIENT_HEADER = "mmad-client"  # "<client host> <client port> <daemon port>", set by a serving worker
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True)
class Peer:
    host: str
    port: int
    server_port: int

    @property
    def loopback(self) -> bool:
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def header(self) -> str:
        return f"{self.host} {self.port} {self.server_port}"


def peer_of(scope: dict[str, Any], trusted_header: bool) -> Peer | None:
    """The client of an ASGI request: its TCP address, or (``trusted_header``: the request came
    from a serving worker with the link's token) the address the worker named; None when
    unknown (a Unix-socket client without the header)."""
    if trusted_header:
        for name, value in scope.get("headers", ()):
            if name.decode("latin-1").lower() == CLIENT_HEADER:
                host, port, server_port = value.decode("latin-1").split()
                return Peer(host, int(port), int(server_port))
        return None
    client, server = scope.get("client"), scope.get("server")
    if not client or not server or server[1] is None:
        return None
    return Peer(client[0], int(client[1]), int(server[1]))


def _address_bytes(host: str) -> tuple[int, bytes]:
    address = ipaddress.ip_address(host)
    return (socket.AF_INET if address.version == 4 else socket.AF_INET6), address.packed


def _decode(field: str) -> tuple[bytes, int]:
    """A ``/proc/net/tcp*`` address ``HEX:PORT``: the address in the kernel's word order."""
    hex_address, hex_port = field.split(":")
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":  # each 32-bit word is printed as a number in host order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return raw, int(hex_port, 16)


def loopback_peer_uid(peer: Peer, tables: tuple[str, ...] = _TCP_TABLES) -> int | None:
    """The user id owning the client's socket of a loopback connection, or None when the kernel's
    tables do not list it (not a loopback TCP client, or it closed meanwhile)."""
    if not peer.loopback:
        return None
    family, wanted = _address_bytes(peer.host)
    candidates = {wanted}
    if family == socket.AF_INET:  # a dual-stack socket lists an IPv4 client as ::ffff:a.b.c.d
        candidates.add(b"\x00" * 10 + b"\xff\xff" + wanted)
    for table in tables:
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)  # the column titles
                for line in f:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    local, local_port = _decode(fields[1])
                    _, remote_port = _decode(fields[2])
                    if local_port == peer.port and remote_port == peer.server_port and local in candidates:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def shared_memory_owner(mode: str, keyed: bool, peer: Peer | None) -> int | None:
    """The ``--shared-memory`` rule, the same for every front end: refuse (403) a client that
    ``mode`` does not let change the regions; return the user id whose ``/dev/shm`` objects a
    keyless daemon's client may register (None: any object, the caller holds the API key).
    ``keyed``: the daemon has an API key (which the front end has already checked)."""
    if mode == "off":
        raise Forbidden("shared memory is off on this daemon (--shared-memory off)")
    if mode == "loopback" and (peer is None or not peer.loopback):
        raise Forbidden("this daemon changes shared-memory regions for clients on its own host only "
                        "(--shared-memory loopback); start it with --shared-memory on and an API key to "
                        "allow other hosts")
    if keyed:
        return None
    uid = loopback_peer_uid(peer) if peer is not None else None
    if uid is None:  # a keyless daemon trusts a client only as far as its own user's files
        raise Forbidden("this keyless daemon cannot tell which local user is asking (the connection is not "
                        "listed as a loopback TCP socket); set an API key to register from here")
    return uid
