"""A reload hands the old router's listening sockets to its replacement (router/handover.py):
one socket, one queue, so a connection queued when the old router lets go is never reset."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import uuid

import aiohttp
import pytest

from fleetwarden.router import Router
from fleetwarden.router.handover import (
    HandoverError,
    ListenerHandover,
    handover_address,
    take_listeners,
)
from support.scripted_engine import ScriptedEngine

TOKEN = "s3cret-token"


def _listener() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    s.setblocking(False)
    return s


async def test_a_connection_queued_when_the_old_copy_closes_is_accepted_by_the_taker() -> None:
    old = _listener()
    port = old.getsockname()[1]
    launch_id = f"t-{uuid.uuid4().hex}"
    handover = ListenerHandover(launch_id, TOKEN, lambda: [old])
    await handover.start()
    try:
        taken = await asyncio.to_thread(take_listeners, launch_id, TOKEN)
        assert [s.getsockname()[1] for s in taken] == [port] and handover.handed == 1
        # The kernel completes these handshakes; no process has accepted them.
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        old.close()  # the old router lets go: its SO_REUSEPORT socket alone would reset them
        accepted = []
        for _ in range(4):
            conn, _ = taken[0].accept()
            accepted.append(conn)
        for i, (c, a) in enumerate(zip(clients, accepted, strict=True)):
            c.sendall(b"ping %d" % i)
            a.settimeout(5)
            assert a.recv(16) == b"ping %d" % i
            c.close()
            a.close()
        for s in taken:
            s.close()
    finally:
        await handover.close()
        old.close()


async def test_the_wrong_token_or_no_router_there_gets_nothing() -> None:
    old = _listener()
    launch_id = f"t-{uuid.uuid4().hex}"
    handover = ListenerHandover(launch_id, TOKEN, lambda: [old])
    await handover.start()
    try:
        with pytest.raises(HandoverError, match="wrong token"):
            await asyncio.to_thread(take_listeners, launch_id, "not-the-token")
        assert handover.handed == 0
        with pytest.raises(HandoverError):
            await asyncio.to_thread(take_listeners, f"nobody-{uuid.uuid4().hex}", TOKEN)
        # the handover goes on serving after a refusal
        taken = await asyncio.to_thread(take_listeners, launch_id, TOKEN)
        assert len(taken) == 1 and handover.handed == 1
        taken[0].close()
    finally:
        await handover.close()
        old.close()


async def test_a_replacement_router_serves_on_the_old_routers_socket() -> None:
    engine = await ScriptedEngine().start()
    old = Router([engine.url])
    new = Router([engine.url])
    await old.start(reuse_port=True)
    launch_id = f"t-{uuid.uuid4().hex}"
    handover = ListenerHandover(launch_id, TOKEN, old.listening_sockets)
    await handover.start()
    try:
        taken = await asyncio.to_thread(take_listeners, launch_id, TOKEN)
        await new.start(sockets=taken)
        assert new.url == old.url
        assert await old.stop_accepting() and old.listening_sockets() == []
        # Once the old one let go, the port is the new one's: every request answered there.
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(old.url + "/v1/completions",
                                     json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                     headers={"Connection": "close"}) as response:
                    assert response.status == 200
        assert new.stats.requests == 5 and old.stats.requests == 0
        with pytest.raises(HandoverError, match="not listening"):  # nothing left to hand
            await asyncio.to_thread(take_listeners, launch_id, TOKEN)
    finally:
        await handover.close()
        await new.stop()
        await old.stop()
        await engine.stop()


class _Squatter:
    """Whoever bound the abstract name first: it accepts one taker and keeps what it sent."""

    def __init__(self, launch_id: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(handover_address(launch_id))
        self.sock.listen(1)
        self.sock.settimeout(5)
        self.heard = b""

    def listen_once(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(1)
            try:
                while chunk := conn.recv(4096):
                    self.heard += chunk
            except TimeoutError:
                pass


@pytest.mark.parametrize("who", ["another user", "another process"])
async def test_the_token_is_never_sent_to_a_squatter_on_the_handover_socket(
        who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launch_id = f"t-{uuid.uuid4().hex}"
    squatter = _Squatter(launch_id)
    listening = asyncio.create_task(asyncio.to_thread(squatter.listen_once))
    try:
        if who == "another user":
            # The squatter runs as this test; the taker is made another user than it.
            own = os.getuid()
            monkeypatch.setattr("fleetwarden.router.handover.os.getuid", lambda: own + 1)
            expected_pid = None
        else:
            expected_pid = os.getpid() + 1_000_000  # the router's pid: not the squatter's
        with pytest.raises(HandoverError, match="the token is not sent"):
            await asyncio.to_thread(take_listeners, launch_id, TOKEN, owner_pid=expected_pid)
        await listening
        assert TOKEN.encode() not in squatter.heard and squatter.heard == b""
    finally:
        squatter.sock.close()


async def test_the_sockets_taken_are_not_inherited_by_a_process_started_afterwards() -> None:
    """The supervisor keeps a copy of its router's sockets, then starts processes (a router's
    replacement, engines) on uvloop, whose subprocesses inherit every fd not marked
    close-on-exec. Before: SCM_RIGHTS fds were not, and a replacement router that could not
    take the copy (its giver killed meanwhile) held it beside a socket of its own, never
    accepting there: half of the port's new connections waited forever."""
    old = _listener()
    launch_id = f"t-{uuid.uuid4().hex}"
    handover = ListenerHandover(launch_id, TOKEN, lambda: [old])
    await handover.start()
    try:
        taken = await asyncio.to_thread(take_listeners, launch_id, TOKEN)
        assert not any(os.get_inheritable(s.fileno()) for s in taken)
        inode = os.fstat(taken[0].fileno()).st_ino
        # close_fds=False: a spawner that closes nothing, as uvloop's
        child = subprocess.Popen(["sleep", "30"], close_fds=False)
        try:
            held = {os.stat(f"/proc/{child.pid}/fd/{fd}").st_ino
                    for fd in os.listdir(f"/proc/{child.pid}/fd")}
        finally:
            child.kill()
            child.wait()
        assert inode not in held
        for s in taken:
            s.close()
    finally:
        await handover.close()
        old.close()
