"""AttachLauncher's restart command on real processes: it ends, whatever the command does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fleetwarden.config import FleetConfig, HealthConfig
from fleetwarden.launchers import LaunchError
from fleetwarden.launchers.attach import AttachLauncher
from fleetwarden.launchers.local import free_port
from fleetwarden.sim import FaultMode, Sim, SimConfig
from support.pids import alive

pytestmark = pytest.mark.scenario


async def test_a_restart_command_that_hangs_is_ended_with_its_group(tmp_path: Path) -> None:
    """A hung `kubectl` must not leave the shard RESTARTING for good: past
    `startup_timeout_s` the command's whole process group is ended and the attempt fails."""
    pidfile = tmp_path / "pids"
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: read fails fast
    command = f"sh -c 'sleep 1000 & echo $$ $! > {pidfile}; wait'"
    fleet = FleetConfig(engines=0, backends=[url], restart_command=command,
                        startup_timeout_s=1.0)
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"restart command .*1 s"):
        await asyncio.wait_for(launcher.launch(0), 10)
    assert time.monotonic() - started < 5
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    for _ in range(50):
        if not any(alive(p) for p in pids):
            break
        await asyncio.sleep(0.1)
    assert not any(alive(p) for p in pids), "the command's process group outlived it"
    assert os.getpgid(0) != pids[0]


async def test_a_cancelled_restart_command_is_ended_with_its_group(tmp_path: Path) -> None:
    """Retiring a shard or stopping fleetwarden cancels the attempt: the command goes too."""
    pidfile = tmp_path / "pids"
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    command = f"sh -c 'sleep 1000 & echo $$ $! > {pidfile}; wait'"
    fleet = FleetConfig(engines=0, backends=[url], restart_command=command)
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    task = asyncio.create_task(launcher.launch(0))
    for _ in range(100):
        if pidfile.exists() and len(pidfile.read_text().split()) == 2:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pids = [int(p) for p in pidfile.read_text().split()]
    for _ in range(50):
        if not any(alive(p) for p in pids):
            break
        await asyncio.sleep(0.1)
    assert not any(alive(p) for p in pids)


async def test_a_failed_restart_command_leaves_nothing_remembered(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    fleet = FleetConfig(engines=0, backends=[url], restart_command="false")
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    for _ in range(3):
        with pytest.raises(LaunchError, match="exited with code 1"):
            await launcher.launch(0)
    assert launcher._before == {}


async def test_a_restart_command_cancelled_while_it_is_set_up_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while its process is being set up (asyncio connects its pipes after the
    fork), the command already runs: it is ended too, with its group. Seen once under load:
    a cancel inside process creation left a restart command's child running for good. The
    set-up is made slow here so that the cancel lands inside it every time."""
    mark = f"FLEETWARDEN_TEST_MARK={uuid.uuid4().hex}"
    monkeypatch.setenv(*mark.split("=", 1))
    real = asyncio.create_subprocess_exec

    async def slow_setup(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await real(*args, **kwargs)
        await asyncio.sleep(0.5)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_setup)
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    fleet = FleetConfig(engines=0, backends=[url],
                        restart_command="sh -c 'sleep 1000 & wait'")
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    task = asyncio.create_task(launcher.launch(0))
    try:
        for _ in range(100):
            if len(_marked(mark)) == 2:  # sh and its sleep: running, the set-up not done
                break
            await asyncio.sleep(0.02)
        assert len(_marked(mark)) == 2 and not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(50):
            if not _marked(mark):
                break
            await asyncio.sleep(0.1)
        assert _marked(mark) == []
    finally:
        for pid in _marked(mark):
            os.kill(pid, 9)


def _marked(mark: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                env = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if mark.encode() in env and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


class _NoStartTimeEngine:
    """An engine that answers /health and has no start time to tell its processes apart (no
    /metrics, as SGLang's or TGI's without one), on a port it can leave and come back to."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.runner: web.AppRunner | None = None

    async def up(self) -> None:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def down(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.mark.parametrize("down_at_launch", [False, True])
async def test_a_passive_wait_for_an_engine_with_no_start_time_ends_when_it_is_back(
        down_at_launch: bool) -> None:
    """With no restart command fleetwarden waits for the system that runs the engine to
    replace it. Without a start time the wait only ended for a restart command: a passive one
    never did, and the shard stayed DEAD while its new engine answered."""
    port = free_port("127.0.0.1")
    engine = _NoStartTimeEngine(port)
    fleet = FleetConfig(engines=0, backends=[f"http://127.0.0.1:{port}"])
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    try:
        if not down_at_launch:
            await engine.up()  # condemned (a stall, say) while it still answered
        handle = await launcher.launch(0)
        waiting = asyncio.create_task(launcher.wait_ready(handle, 20.0))
        await asyncio.sleep(0.6)  # a poll or more: it still answers, or not yet
        assert not waiting.done()  # nothing says a new process answers yet
        if not down_at_launch:
            await engine.down()  # the system that runs it replaces it
            await asyncio.sleep(0.6)
        await engine.up()
        await asyncio.wait_for(waiting, 10)
    finally:
        await engine.down()
        await launcher.close()


async def test_an_engine_back_under_a_new_incarnation_leaves_nothing_remembered() -> None:
    """Ready, the handle takes the new incarnation as its launch id (what the watchdog
    reports): what was kept under the old one must go then, or each restart of a long-lived
    fleet leaves one entry for good."""
    sim = Sim(SimConfig())
    await sim.start()
    launcher = AttachLauncher(FleetConfig(engines=0, backends=[sim.url]),
                              HealthConfig(probe_timeout_s=2.0))
    try:
        for _ in range(3):
            handle = await launcher.launch(0)
            await sim.set_fault(FaultMode.RESTART)  # the system that runs it replaces it
            await launcher.wait_ready(handle, 20.0)
            assert not handle.launch_id.startswith("attach-")  # the new incarnation
            await launcher.stop(handle)
        assert launcher._before == {} and launcher._seen_down == set()
    finally:
        await launcher.close()
        await sim.stop()


async def test_with_a_command_and_no_start_time_the_old_process_answering_is_not_back() -> None:
    """A restart command may return before the old process goes (``kubectl delete pod``):
    with no start time to tell them apart, the first /health 200 after it may be the old
    one's. Back is /health again after it was seen not answering since the restart began
    (the command's run watched too: a ``systemctl restart`` is down while it runs)."""
    port = free_port("127.0.0.1")
    engine = _NoStartTimeEngine(port)
    fleet = FleetConfig(engines=0, backends=[f"http://127.0.0.1:{port}"],
                        restart_command="true")
    launcher = AttachLauncher(fleet, HealthConfig(probe_timeout_s=0.5))
    try:
        await engine.up()
        handle = await launcher.launch(0)  # the old process answers on
        waiting = asyncio.create_task(launcher.wait_ready(handle, 20.0))
        await asyncio.sleep(0.6)  # a poll or more
        assert not waiting.done(), "the old process's answer was taken for the new one's"
        await engine.down()
        await asyncio.sleep(0.6)
        await engine.up()
        await asyncio.wait_for(waiting, 10)
        # A command that replaces it while it runs: the watch during the run sees it down.
        launcher.command = "sleep 1"
        launching = asyncio.create_task(launcher.launch(0))
        await asyncio.sleep(0.3)
        await engine.down()
        await asyncio.sleep(0.3)
        await engine.up()
        handle = await asyncio.wait_for(launching, 10)
        await asyncio.wait_for(launcher.wait_ready(handle, 20.0), 10)
    finally:
        await engine.down()
        await launcher.close()
