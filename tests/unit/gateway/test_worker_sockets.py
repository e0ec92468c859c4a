"""``serve --workers N`` gives each worker a listening socket of its own on the one port
(`gateway.serving.workers.bind`), so the kernel spreads connections over them.

Real sockets on 127.0.0.1. Before, the workers shared one socket and the first to wake took
every connection waiting: the overhead bench's 32 connections split 1:31, 3:29, 0:32.
"""

from __future__ import annotations

import select
import socket
from collections import Counter

import pytest

from gateway.serving.workers import REUSE_PORT, bind

pytestmark = pytest.mark.skipif(not REUSE_PORT, reason="SO_REUSEPORT spreads connections on Linux only")


def test_connections_spread_over_the_workers_sockets() -> None:
    socks = bind("127.0.0.1", 0, 2)
    clients = []
    try:
        assert len({s.fileno() for s in socks}) == 2
        port = socks[0].getsockname()[1]
        assert socks[1].getsockname()[1] == port
        accepted: Counter[int] = Counter()
        for _ in range(64):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            readable, _, _ = select.select(socks, [], [], 5)  # the connection waits on one socket's queue
            for i, sock in enumerate(socks):
                if sock in readable:
                    conn, _ = sock.accept()
                    conn.close()
                    accepted[i] += 1
        assert sum(accepted.values()) == 64
        assert min(accepted[0], accepted[1]) >= 12  # each worker gets its share (a 1:63 split: ~1e-7 by chance)
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()


@pytest.mark.parametrize("holder_reuses_port", [False, True], ids=["plain-server", "another-reuseport-group"])
def test_a_port_in_use_fails_the_bind_even_if_its_holder_allows_port_reuse(holder_reuses_port: bool) -> None:
    """SO_REUSEPORT alone would let a second ``serve --workers`` on the same port join the first
    one's group and take half its connections; the plain bind first makes it fail, as before."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if holder_reuses_port:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(OSError):
            bind("127.0.0.1", holder.getsockname()[1], 2)
    finally:
        holder.close()


def test_one_worker_gets_one_plain_socket() -> None:
    (sock,) = bind("127.0.0.1", 0, 1)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        assert sock.get_inheritable()
    finally:
        sock.close()
