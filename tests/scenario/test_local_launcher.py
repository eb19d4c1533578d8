"""LocalLauncher on real processes: process groups, free ports, logs, stop that leaves nothing."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.launchers import EngineHandle, LaunchError
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.launchers.procs import group_members
from support.wait import until

ENGINE = Path(__file__).parents[1] / "support" / "engines" / "tiny_engine.py"

pytestmark = pytest.mark.scenario


def launcher(tmp_path: Path, flags: str = "", grace_s: float = 10.0,
             exits: list[EngineHandle] | None = None) -> LocalLauncher:
    fleet = FleetConfig(engine_cmd=f"{{python}} {ENGINE} --host {{host}} --port {{port}} {flags}",
                        log_dir=tmp_path / "logs")
    sink = exits if exits is not None else []
    return LocalLauncher(fleet, SupervisorConfig(stop_grace_s=grace_s), sink.append)


async def test_an_engine_runs_in_its_own_group_and_stop_leaves_nothing(tmp_path: Path) -> None:
    exits: list[EngineHandle] = []
    lau = launcher(tmp_path, "--spawn-child", exits=exits)
    h = await lau.launch(0)
    try:
        await lau.wait_ready(h, 30)
        assert h.pgid == h.pid and os.getpgid(h.pid) == h.pid != os.getpgid(0)
        await until(lambda: len(group_members(h.pgid or 0)) == 2)  # leader + "EngineCore"
    finally:
        await lau.stop(h)
    assert group_members(h.pgid or 0) == []
    assert exits == []  # a stop on purpose is not a failure


async def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    lau = launcher(tmp_path, "--spawn-child --ignore-term", grace_s=0.5)
    h = await lau.launch(0)
    await lau.wait_ready(h, 30)
    await until(lambda: len(group_members(h.pgid or 0)) == 2)
    await lau.stop(h)
    assert group_members(h.pgid or 0) == []


async def test_an_exit_is_reported_at_once_with_its_code(tmp_path: Path) -> None:
    exits: list[EngineHandle] = []
    lau = launcher(tmp_path, "--exit-after 0.5 --exit-code 7", exits=exits)
    h = await lau.launch(0)
    await until(lambda: bool(exits))
    assert exits == [h] and h.returncode == 7
    await lau.close()


async def test_an_engine_that_never_answers_fails_its_start(tmp_path: Path) -> None:
    lau = launcher(tmp_path, "--never-ready --api-key sk-never-shown")
    h = await lau.launch(0)
    try:
        # Its process listens first (a loaded machine may take seconds to start Python): what
        # is tested is an engine that answers, but never 200, within the startup timeout.
        await _wait_for_status(h.url + "/health")
        with pytest.raises(LaunchError, match="/health answered 503"):
            await lau.wait_ready(h, 1.5)
        # A start given up leaves in its log what its processes were doing then: where a
        # start hangs before the engine prints anything, nothing else says.
        assert h.log_path is not None
        log = h.log_path.read_text()
        assert "# fleetwarden: not ready; its processes now:" in log, log
        assert f"#   pid {h.pid} state " in log and "tiny_engine.py" in log, log
        assert re.search(r"\) nice -?\d+ policy \d+ cpus [0-9]", log), log  # what it was given
        assert "--api-key ***" in log and "sk-never-shown" not in log, log  # keys hidden
    finally:
        await lau.close()
    assert group_members(h.pgid or 0) == []


async def _wait_for_status(url: str, timeout_s: float = 30.0) -> None:
    import aiohttp

    from fleetwarden.probe import health_status

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while not isinstance(await health_status(session, url), int):
            assert asyncio.get_running_loop().time() < deadline, f"{url} never answered"
            await asyncio.sleep(0.1)


async def test_an_engine_that_dies_while_starting_fails_fast(tmp_path: Path) -> None:
    lau = launcher(tmp_path, "--never-ready --exit-after 0.3")
    h = await lau.launch(0)
    with pytest.raises(LaunchError, match="exited with code 3"):
        await lau.wait_ready(h, 60)
    await lau.close()


async def test_each_incarnation_gets_a_free_port_and_a_log_of_its_own(tmp_path: Path) -> None:
    lau = launcher(tmp_path)
    a, b = await lau.launch(0), await lau.launch(0)
    try:
        await asyncio.gather(lau.wait_ready(a, 30), lau.wait_ready(b, 30))
        assert a.url != b.url and a.launch_id != b.launch_id
        assert a.log_path != b.log_path
        assert a.log_path is not None and "ready" in a.log_path.read_text()
        env = Path(f"/proc/{a.pid}/environ").read_bytes().split(b"\0")
        assert f"FLEETWARDEN_LAUNCH_ID={a.launch_id}".encode() in env
    finally:
        await lau.close()
    assert group_members(a.pgid or 0) == group_members(b.pgid or 0) == []


async def test_a_missing_program_is_a_launch_error(tmp_path: Path) -> None:
    fleet = FleetConfig(engine_cmd="/nonexistent/engine --port {port}", log_dir=tmp_path)
    lau = LocalLauncher(fleet, SupervisorConfig(), lambda h: None)
    with pytest.raises(LaunchError, match="cannot start"):
        await lau.launch(0)


async def test_a_spawn_that_fails_leaves_no_running_record(tmp_path: Path) -> None:
    """A launch is journaled before its spawn; one that never started a process is closed
    at once, so the next run does not look for it."""
    from fleetwarden.fleet import _JournalEngines
    from fleetwarden.journal import Journal

    fleet = FleetConfig(engine_cmd="/nonexistent/engine --port {port}", log_dir=tmp_path)
    lau = LocalLauncher(fleet, SupervisorConfig(), lambda h: None)
    with Journal(tmp_path / "fleetwarden.sqlite") as journal:
        lau.events = _JournalEngines(journal)
        with pytest.raises(LaunchError, match="cannot start"):
            await lau.launch(0)
        assert len(journal.launch_ids()) == 1 and journal.running_engines() == []


async def test_a_port_that_a_shard_records_is_not_handed_out_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may hand back the port of a DEAD or RETIRED shard's
    engine; the launcher asks again rather than collide with what the ledger records."""
    from fleetwarden.launchers import local

    real = local.free_port
    first = real("127.0.0.1")
    ports = iter([first, first])
    monkeypatch.setattr(local, "free_port", lambda host: next(ports, None) or real(host))
    lau = launcher(tmp_path)
    lau.taken_urls = lambda: {f"http://127.0.0.1:{first}"}
    h = await lau.launch(0)
    try:
        assert h.url != f"http://127.0.0.1:{first}"
    finally:
        await lau.stop(h)
