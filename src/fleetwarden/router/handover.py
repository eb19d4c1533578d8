"""Listening sockets handed from a router process to its replacement (a reload).

Owns: serving a router's listening sockets to the process that replaces it, and taking them.
Must not: decide when a reload happens (``launchers/routers.py`` does) or serve requests.

Why: routers that share a port with ``SO_REUSEPORT`` each have a listening socket of their own,
and closing one resets every connection that the kernel completed in its queue but the process
had not accepted yet (unless ``net.ipv4.tcp_migrate_req`` is 1; it is 0 by default). A reload
that closes the old routers' sockets after the new ones bound theirs therefore loses a
handshake that lands in the last moment (docs/design.md section 13). So a replacement does not
bind a socket of its own: it takes the old router's (the same socket, passed with
``SCM_RIGHTS``, as HAProxy's ``expose-fd listeners`` and Envoy's hot restart do). Both
processes accept from one queue while the old one hands over; when the old one closes its copy
the socket lives on in the new one, and nothing queued is lost.

The old router serves its sockets on an abstract Unix socket named after its launch id (no
file, nothing to clean up after a SIGKILL). A taker must run as the same user (checked with
``SO_PEERCRED``) and send the router's control token: whoever may drive the router may take its
port, no one else. The check goes both ways: an abstract name has no file permissions, so any
local user may bind it first (before the router, or after it died); the taker checks who
listens (``SO_PEERCRED`` again: the same user, and the expected process when it is known)
before it sends the token, so a squatter never learns the secret.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hmac
import logging
import os
import socket
import struct
import uuid
from collections.abc import Callable, Sequence

__all__ = ["HandoverError", "KeptListeners", "ListenerHandover", "handover_address",
           "peer_credentials", "take_listeners"]

log = logging.getLogger(__name__)

#: The most listening sockets one router hands over (it has one per site; a replacement that
#: took the sockets of several old routers has several).
MAX_SOCKETS = 16
#: Seconds a taker may take to send its token.
_READ_TOKEN_S = 5.0
#: Tries, 0.1 s apart, to take a copy of a router's listeners: it serves them a moment after
#: its control API first answers.
_KEEP_TRIES = 30
_KEEP_POLL_S = 0.1


class HandoverError(RuntimeError):
    """The listening sockets could not be taken (the old router is gone, or refused)."""


def handover_address(launch_id: str) -> str:
    """The abstract Unix socket on which the router launched as ``launch_id`` hands over."""
    return f"\0fleetwarden-router-listeners-{launch_id}"


class ListenerHandover:
    """Hands ``sockets()`` (read at each request: the router's listening sockets then) to a
    process that connects with ``token`` from the same user."""

    def __init__(self, launch_id: str, token: str,
                 sockets: Callable[[], Sequence[socket.socket]]) -> None:
        self.address = handover_address(launch_id)
        self._token = token.encode()
        self._sockets = sockets
        self._server: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        #: Takers served (each got every socket).
        self.handed = 0

    async def start(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(self.address)
            server.listen(8)
            server.setblocking(False)
        except BaseException:
            server.close()
            raise
        self._server = server
        self._task = asyncio.create_task(self._serve(server), name="listener-handover")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(server)
            try:
                await self._hand(loop, conn)
            except Exception as exc:  # one bad taker never stops the next
                log.warning("listener handover refused: %s", exc)
            finally:
                conn.close()

    async def _hand(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        _pid, uid = peer_credentials(conn)
        if uid != os.getuid():
            await loop.sock_sendall(conn, b"refused: another user\n")
            raise HandoverError(f"a process of uid {uid} asked for the listeners")
        line = await asyncio.wait_for(_read_line(loop, conn), _READ_TOKEN_S)
        if not hmac.compare_digest(line, self._token):
            await loop.sock_sendall(conn, b"refused: wrong token\n")
            raise HandoverError("a taker sent the wrong token")
        fds = [s.fileno() for s in self._sockets()][:MAX_SOCKETS]
        if not fds:
            await loop.sock_sendall(conn, b"refused: not listening\n")
            raise HandoverError("asked for the listeners after they were closed")
        # One small message on an empty socket buffer: sendmsg does not block.
        conn.sendmsg([b"ok\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        self.handed += 1
        log.info("listener handover: %d listening socket(s) handed to a replacement", len(fds))


async def _read_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk or len(data) > 4096:
            break
        data += chunk
    return data.rstrip(b"\n")


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel says."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def take_listeners(launch_id: str, token: str, timeout_s: float = 5.0, *,
                   owner_pid: int | None = None) -> list[socket.socket]:
    """The listening sockets of the router launched as ``launch_id`` (blocking: a process
    starting up calls it before it serves). The token goes only to a process of this user
    (and ``owner_pid``, when given). Raises :class:`HandoverError` when that router is not
    there, is not who listens, or refuses."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            conn.connect(handover_address(launch_id))
            pid, uid = peer_credentials(conn)
            if uid != os.getuid():
                raise HandoverError(f"router {launch_id}: its socket is held by uid {uid}, not "
                                    "this user: the token is not sent")
            if owner_pid is not None and pid != owner_pid:
                raise HandoverError(f"router {launch_id}: its socket is held by pid {pid}, not "
                                    f"{owner_pid}: the token is not sent")
            conn.sendall(token.encode() + b"\n")
            msg, fds = _recv_fds_cloexec(conn)
        except OSError as exc:
            raise HandoverError(f"router {launch_id}: {exc}") from exc
    if not fds:
        raise HandoverError(f"router {launch_id}: {msg.decode(errors='replace').strip()}")
    taken = []
    for fd in fds:
        s = socket.socket(fileno=fd)
        s.setblocking(False)
        taken.append(s)
    return taken


def _recv_fds_cloexec(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the fds it carries, each close-on-exec from the moment it exists, as
    every socket Python makes itself: a process started later by this one must not hold a
    listener it never accepts on (the kernel would queue its share of the port's connections
    there), and uvloop's subprocesses inherit every fd without the flag. SCM_RIGHTS gives fds
    without it unless asked (``MSG_CMSG_CLOEXEC``), and ``socket.recv_fds`` drops the flags it
    is given (Python 3.11), so the message is read here. Atomic: the taker runs in a thread
    while the event loop may be starting a process."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = conn.recvmsg(
        1024, socket.CMSG_LEN(MAX_SOCKETS * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


class KeptListeners:
    """A copy of each router slot's listening sockets, held by the process that supervises the
    routers, so that the sockets outlive a router that dies.

    Why: a router that dies (SIGKILL, the OOM killer) closes its listening sockets; the kernel
    resets the connections queued on them and refuses new ones until a replacement binds the
    port (with one worker, every connection for a second or more). With a copy held here the
    socket stays open: connections wait in its queue, and the replacement takes it from here
    (:meth:`launch_id`) as a reload's router takes its predecessor's. Only the requests the dead
    router held are lost.

    A copy that no router accepts from holds connections nobody answers, so it is dropped
    whenever no router of its slot will accept again: a slot whose router cannot be started
    again (the port refuses instead, which a client sees at once), and every slot before the
    routers are stopped.

    ``enabled`` False (several routers share the port): nothing is kept. While one of them is
    replaced the kernel hands new connections to the others at once, where a kept copy would
    hold its share until the replacement accepts.
    """

    def __init__(self, token: str, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._token = token
        self._id = f"kept-{uuid.uuid4().hex[:12]}"
        self._kept: dict[int, list[socket.socket]] = {}
        self._givers: dict[int, ListenerHandover] = {}
        self._closed = False

    def launch_id(self, slot: int) -> str | None:
        """The launch id a replacement for ``slot`` takes its listeners from (as from a
        predecessor); None when none are kept."""
        return f"{self._id}-{slot}" if self._kept.get(slot) else None

    async def keep(self, slot: int, launch_id: str, pid: int) -> bool:
        """Take a copy of the listeners of the router ``launch_id`` (process ``pid``), now in
        ``slot``, in place of the slot's last copy. False, logged, when it cannot be had: the
        slot then keeps none (never a copy of a socket its router no longer listens on)."""
        if not self.enabled:
            return False
        error: Exception | None = None
        for _ in range(_KEEP_TRIES):
            try:
                taken = await asyncio.to_thread(take_listeners, launch_id, self._token,
                                                owner_pid=pid)
                break
            except HandoverError as exc:
                error = exc
                await asyncio.sleep(_KEEP_POLL_S)
        else:
            log.warning("the listeners of router %s could not be kept (%s): if it dies, its "
                        "port refuses connections until its replacement listens", launch_id,
                        error)
            await self.drop(slot)
            return False
        if self._closed:  # the routers are being stopped: a worker started meanwhile is too
            for s in taken:
                s.close()
            return False
        if slot not in self._givers:
            giver = ListenerHandover(f"{self._id}-{slot}", self._token,
                                     lambda: self._kept.get(slot, []))
            try:
                await giver.start()
            except OSError as exc:
                log.warning("the listeners of router slot %d cannot be handed on from here "
                            "(%s): not kept", slot, exc)
                for s in taken:
                    s.close()
                await self.drop(slot)
                return False
            self._givers[slot] = giver
        for s in self._kept.pop(slot, []):
            s.close()
        self._kept[slot] = taken
        return True

    async def drop(self, slot: int) -> None:
        """No copy for ``slot`` any more: its sockets live on only in routers that hold them."""
        giver = self._givers.pop(slot, None)
        if giver is not None:
            await giver.close()
        for s in self._kept.pop(slot, []):
            s.close()

    async def close(self) -> None:
        """Every copy dropped, and none taken from now on."""
        self._closed = True
        for slot in list(self._kept) + list(self._givers):
            await self.drop(slot)
