"""A port reserved for router processes (``launchers.local.reserve_port``): no other bind gets
it, and a listener that shares it with ``SO_REUSEPORT`` takes every connection; and who
listens on a port (``launchers.procs.listening_processes``), this process included."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from fleetwarden.launchers.local import reserve_port
from fleetwarden.launchers.procs import listening_processes


def _bind(port: int, *, reuse_addr: bool = False) -> None:
    with socket.socket() as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("reuse_addr", [False, True])
def test_a_reserved_port_is_refused_to_any_bind_that_does_not_share_it(reuse_addr: bool) -> None:
    with reserve_port("127.0.0.1") as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError) as refused:
            _bind(port, reuse_addr=reuse_addr)
        assert refused.value.errno == errno.EADDRINUSE
    _bind(port, reuse_addr=reuse_addr)  # the rule can fail: let go, the port is anyone's


def test_a_listener_sharing_a_reserved_port_takes_every_connection_and_the_reservation_none(
        ) -> None:
    with reserve_port("127.0.0.1") as held:
        port = held.getsockname()[1]
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            listener.settimeout(5)
            clients = [socket.create_connection(("127.0.0.1", port), timeout=5)
                       for _ in range(20)]
            accepted = [listener.accept()[0] for _ in clients]
            for s in clients + accepted:
                s.close()
        # No listener left: the reservation completes no handshake (a client learns at once).
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_this_process_is_found_holding_its_listener_behind_a_closed_lower_fd() -> None:
    """Listing this process's own fds opens one in the lowest free number and closes it before
    it is read: taken as the process gone, that hid the listener (before: [])."""
    gap = socket.socket()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        gap.close()  # the lowest free fd is now below the listener's
        port = listener.getsockname()[1]
        assert os.getpid() in {p.pid for p in listening_processes(port)}
