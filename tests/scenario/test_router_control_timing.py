"""The router's control API in real time: its long polls held open and answered, a router
draining or stopping while polls and connections are open, and ``fleetwarden route`` as a
process. Each waits for what it tests (a poll's ``wait_s``, a silence's age, the handover's
settle timer), so they are scenario tests, not unit tests (docs/development.md, "Test
tiers"); the control API's shape and refusals are in tests/unit/test_router_control.py."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.router import RemoteRouter, Router
from fleetwarden.router.app import HANDOVER_SETTLE_S
from support.router_rig import rig
from support.scripted_engine import ScriptedEngine

TOKEN = "s3cret-token"


async def test_fleetwarden_route_serves_a_static_list_and_its_control_api(
        tmp_path: Path) -> None:
    engines = [await ScriptedEngine().start() for _ in range(2)]
    token_file = tmp_path / "token"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "route", "--port", "0",
        "--backend", engines[0].url, "--backend", engines[1].url,
        "--control-port", "0", "--token-file", str(token_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(60):
            listening = (await proc.stdout.readline()).decode()
            control_line = (await proc.stdout.readline()).decode()
        assert listening.startswith("fleetwarden route: listening on http://127.0.0.1:")
        url = listening.split(" on ", 1)[1].split(",")[0]
        control = control_line.rsplit(" ", 1)[1].strip()
        async with aiohttp.ClientSession() as http:
            # A prompt of its own each: the default cache-aware routing spreads them by load
            # (one prompt repeated is an RL group, kept on one engine).
            for i in range(4):
                async with http.post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": f"hi {i}"}) as response:
                    assert response.status == 200
            await engines[1].crash()  # static list, no health management: retries cover it
            for i in range(4, 8):
                async with http.post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": f"hi {i}"}) as response:
                    assert response.status == 200
        assert engines[0].answered == 6
        async with RemoteRouter(control, token_file.read_text().strip()) as remote:
            status = await remote.status()
            assert status["serving"] == [e.url for e in engines]  # no reflex: nothing dropped
            assert not status["reflex_armed"]
        proc.terminate()
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        assert b"reflex drop disarmed" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for e in engines:
            await e.stop()


def test_fleetwarden_route_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    import subprocess

    def route(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fleetwarden", "route", *args],
                              capture_output=True, text=True, timeout=60)

    out = route("--backend", "localhost:8000")
    assert out.returncode == 2 and "is not an http:// or https:// URL" in out.stderr
    out = route("--backend", "http://127.0.0.1:9", "--control-port", "0")
    assert out.returncode == 2 and "--token-file" in out.stderr
    out = route("--backend", "http://127.0.0.1:9", "--max-retries", "-1", "--port", "0")
    assert out.returncode == 2 and "max_retries" in out.stderr


async def test_evidence_is_answered_at_the_first_failure_and_none_falls_between_two_polls(
) -> None:
    async with rig(2, health_managed=True, control_token=TOKEN) as r:
        good, bad = r.engines
        assert r.router.control_url is not None
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            assert await remote.evidence(0.2, 1.0) == (0, {})  # nothing: empty at wait_s
            bad.answer_status(503)
            poll = asyncio.create_task(remote.evidence(30, 1.0))
            await asyncio.sleep(0.2)
            assert not poll.done()  # held open while nothing happens
            for _ in range(20):  # requests until one lands on bad and fails there
                assert (await r.post())[0] == 200
                if poll.done():
                    break
            failed, silent = await asyncio.wait_for(poll, 5)
            assert failed >= 1 and silent == {}
            # a failure between two polls: the next one is answered at once
            r.router.set_serving_backends([bad.url, good.url])
            for _ in range(20):
                if r.router.stats.backend_failures[(bad.url, "server_error")] > failed:
                    break
                assert (await r.post())[0] == 200
            assert r.router.stats.backend_failures[(bad.url, "server_error")] > failed
            assert (await asyncio.wait_for(remote.evidence(30, 1.0), 5))[0] >= 1


async def test_evidence_names_a_backend_holding_a_request_silent() -> None:
    async with rig(2, health_managed=True, control_token=TOKEN) as r:
        _good, wedged = r.engines
        r.router.set_serving_backends([wedged.url])
        wedged.wedge()
        assert r.router.control_url is not None
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            poll = asyncio.create_task(remote.evidence(30, 0.3))
            held = asyncio.create_task(r.post())
            failed, silent = await asyncio.wait_for(poll, 5)
            assert failed == 0 and list(silent) == [wedged.url] and silent[wedged.url] >= 0.3
            wedged.unwedge()
            assert (await held)[0] == 200


async def test_a_router_stopping_answers_a_held_evidence_poll_instead_of_waiting_for_it() -> None:
    router = Router([])
    await router.start(control_port=0, control_token=TOKEN)
    assert router.control_url is not None
    async with RemoteRouter(router.control_url, TOKEN) as remote:
        poll = asyncio.create_task(remote.evidence(60, 1.0))
        await asyncio.sleep(0.3)
        assert not poll.done()
        await asyncio.wait_for(router.stop(), 30)  # not held for its 5 s grace, nor cut
        assert poll.done() and await poll == (0, {})


async def test_a_draining_router_says_connection_close_on_the_answer_before_it_closes() -> None:
    """A drain closes each connection after its next answer, and that answer must say so: a
    keep-alive client that is not told reuses the connection at once, and its request meets the
    close ("Server disconnected without sending a response": 1 request in ~240 of a reload
    under make test's load, while aiohttp chose the header before the drain's hook ran)."""
    async with rig(1) as r:
        status, headers, _ = await r.post()
        assert status == 200 and headers.get("Connection") != "close"  # kept alive
        drain = asyncio.create_task(r.router.drain(30))
        await asyncio.sleep(HANDOVER_SETTLE_S + 0.2)  # its timer runs first: draining now
        assert not drain.done()  # the connection is still open
        status, headers, _ = await r.post()  # on that connection
        assert status == 200 and headers.get("Connection") == "close"
        await asyncio.wait_for(drain, 10)  # and then closed: nothing left to drain


async def test_connections_queued_when_the_listener_closes_are_served_not_reset() -> None:
    """A reload under load: connections whose handshake the kernel completed, still waiting in
    the listener's queue when it closes, are accepted and answered (a SO_REUSEPORT listener
    that closes resets them: 2 of ~100 requests in a reload under make test's load)."""
    async with rig(1) as r:
        host, port = "127.0.0.1", r.router.port
        clients = []
        for _ in range(8):  # connected by the kernel; this loop has not run to accept them
            c = socket.create_connection((host, port), timeout=10)
            clients.append(c)
        assert await r.router.stop_accepting()  # its first step empties the queue
        answers = []
        for c in clients:
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for c in clients:
            c.setblocking(False)
            data = b""
            for _ in range(200):  # 10 s at most
                try:
                    chunk = c.recv(65536)
                except BlockingIOError:
                    await asyncio.sleep(0.05)
                    continue
                except ConnectionResetError:
                    data = b"RESET"
                    break
                if not chunk:
                    break
                data += chunk
            c.close()
            answers.append(data.split(b"\r\n", 1)[0])
        assert answers == [b"HTTP/1.1 200 OK"] * 8
        with pytest.raises(OSError):  # and nothing new is accepted
            socket.create_connection((host, port), timeout=2).close()


async def test_an_in_process_link_answers_evidence_at_the_first_failure() -> None:
    # Two engines failing with different 5xx: each is its engine's (a lone engine's 5xx
    # proves nothing against it, and the same 5xx from both would be a poison request).
    async with rig(2, health_managed=True) as r:
        bad, other = r.engines
        link = r.router.control()
        assert await link.evidence(0.1, 1.0) == (0, {})  # nothing: empty at wait_s
        bad.answer_status(503)
        other.answer_status(500)
        poll = asyncio.create_task(link.evidence(30, 1.0))
        await asyncio.sleep(0.1)
        assert not poll.done()  # held open while nothing happens
        await r.post()
        failed, silent = await asyncio.wait_for(poll, 5)
        assert failed >= 1 and silent == {}


async def test_a_remote_link_tells_its_listeners_of_the_failures_an_evidence_answer_counts(
) -> None:
    async with rig(2, health_managed=True, control_token=TOKEN) as r:  # as above
        bad, other = r.engines
        bad.answer_status(503)
        other.answer_status(500)
        assert r.router.control_url is not None
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            heard: list[tuple[str, str]] = []
            unlisten = remote.listen(lambda url, cause: heard.append((url, cause)))
            assert await remote.evidence(0.1, 1.0) == (0, {}) and heard == []
            await r.post()
            failed, _ = await asyncio.wait_for(remote.evidence(30, 1.0), 5)
            assert failed >= 1 and heard == [("", "remote")] * failed
            unlisten()
            r.router.set_serving_backends([bad.url, other.url])  # back after the reflex
            await r.post()
            assert (await asyncio.wait_for(remote.evidence(30, 1.0), 5))[0] >= 1
            assert len(heard) == failed
