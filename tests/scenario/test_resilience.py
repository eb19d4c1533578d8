"""fleetwarden survives its own restart: budgets kept, engines adopted, nothing
orphaned, a reused PID never adopted. `fleetwarden up` runs as a real subprocess and is killed
with SIGKILL, as an OOM killer or an operator would."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord
from fleetwarden.launchers.local import LocalLauncher, kill_launched, live_launch_ids
from fleetwarden.launchers.procs import listening_processes, process_start_ticks
from fleetwarden.testing.up import UpProcess
from support.fleet import SIM
from support.wait import wait_until

pytestmark = pytest.mark.scenario

FAST = ["--engine-cmd", SIM]

#: Polls the admin API of a fleetwarden process: a read may fail while it starts, or race a
#: restart, and counts as "not yet".
wait_for = functools.partial(wait_until, timeout=60.0, every_s=0.2, ignoring=(Exception,))


def Up(work: Path, *args: str) -> UpProcess:
    return UpProcess(work, "--engines", "2", *args)


def kill_leftovers(work: Path) -> None:
    with Journal(work / "fleetwarden.sqlite") as journal:
        kill_launched(journal.launch_ids() | journal.router_launch_ids())


def live_routers(work: Path) -> set[str]:
    """The router processes this journal recorded that still run."""
    with Journal(work / "fleetwarden.sqlite") as journal:
        return live_launch_ids(journal.router_launch_ids())


def live_engines(work: Path) -> set[str]:
    """Launch ids, of those this journal ever recorded, that a live process still carries."""
    with Journal(work / "fleetwarden.sqlite") as journal:
        return live_launch_ids(journal.launch_ids())


def test_fleetwarden_restart_keeps_budgets_and_adopts_engines(tmp_path: Path) -> None:
    up = Up(tmp_path, *FAST)
    try:
        asked = time.time()
        landed = up.client.chaos(0, "crash")["at"]  # when it landed: figures count from there
        assert asked <= landed <= time.time()
        wait_for(lambda: up.client.shards()[0]["restart_attempts"] == 1
                 and up.client.shards()[0]["state"] == "HEALTHY", what="shard 0 restarted")
        before = {s["index"]: (s["pid"], s["base_url"]) for s in up.client.shards()}
        # The engine started after the routers holds none of their listening sockets: one it
        # held (inherited from fleetwarden's copy) would outlive the routers and queue their
        # port's connections where nobody accepts them.
        port = int(up.router.rsplit(":", 1)[1])
        holders = {p.pid for p in listening_processes(port)}
        assert holders and not holders & {pid for pid, _ in before.values()}, holders
        up.kill9()

        again = Up(tmp_path, *FAST)
        shards = again.client.shards()
        assert {s["index"]: (s["pid"], s["base_url"]) for s in shards} == before  # adopted
        assert [s["restart_attempts"] for s in shards] == [1, 0]  # the budget it had
        assert [s["state"] for s in shards] == ["HEALTHY", "HEALTHY"]
        import asyncio

        from fleetwarden.testing.load import Load

        async def serve() -> list[object]:
            async with Load(again.router, concurrency=2, total=10) as load:
                await load.wait()
            return list(load.failures)

        assert asyncio.run(serve()) == []
        # an adopted engine that dies is still seen at once
        again.client.chaos(1, "crash")
        wait_for(lambda: again.client.shards()[1]["restart_attempts"] == 1
                 and again.client.shards()[1]["state"] == "HEALTHY", what="adopted one replaced")
        out = again.stop()
        assert "nothing left running" in out
    finally:
        up.kill9()
        left = live_engines(tmp_path) | live_routers(tmp_path)
        kill_leftovers(tmp_path)  # whatever happened above, nothing this test started lives on
    assert left == set()


def test_kill_9_of_fleetwarden_orphans_nothing(tmp_path: Path) -> None:
    # Engines take 2 s to start, so a restart is in progress when fleetwarden is killed.
    slow = ["--engine-cmd", f"sh -c 'sleep 2 && exec {SIM}'"]
    up = Up(tmp_path, *slow)
    try:
        first = live_engines(tmp_path)  # the two engines of the first start
        up.client.chaos(0, "crash")
        # RESTARTING comes a moment before the replacement is launched (the routers are
        # told to move the old engine's requests first): wait for the replacement's process,
        # then kill fleetwarden mid-start. Counted apart from the first engines: the crashed
        # one lives on for the simulator's crash_exit_s (0.4 s), and counted with them it
        # stood in for a replacement not launched yet.
        wait_for(lambda: up.client.shards()[0]["state"] == "RESTARTING"
                 and len(live_engines(tmp_path) - first) == 1,
                 what="restarting, replacement launched")
        up.kill9()
        now = live_engines(tmp_path)
        assert len(now - first) == 1  # the one starting
        assert len(now & first) >= 1  # shard 1's engine (and the crashed one, until it exits)

        again = Up(tmp_path, *slow)
        wait_for(lambda: [s["state"] for s in again.client.shards()] == ["HEALTHY"] * 2,
                 what="the fleet whole again")
        shards = again.client.shards()
        assert shards[0]["restart_attempts"] == 1  # the interrupted restart was not re-charged
        assert len(live_engines(tmp_path)) == 2  # the half-started one was stopped, not kept
        assert "nothing left running" in again.stop()
    finally:
        up.kill9()
        left = live_engines(tmp_path) | live_routers(tmp_path)
        kill_leftovers(tmp_path)  # whatever happened above, nothing this test started lives on
    assert left == set()


async def test_a_reused_pid_is_never_adopted(tmp_path: Path) -> None:
    launcher = LocalLauncher(FleetConfig(log_dir=tmp_path), SupervisorConfig(stop_grace_s=1),
                             lambda h: None)
    # A live process that is not the engine: same PID as the record, but another program.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)
    try:
        ticks = process_start_ticks(stranger.pid)
        assert ticks is not None
        record = EngineRecord(shard=0, launch_id="s0-gone", url="http://127.0.0.1:9",
                              pid=stranger.pid, pgid=stranger.pid, proc_start_ticks=ticks,
                              log_path=None, launched_at=0.0)
        assert not launcher.adoptable(record)  # no FLEETWARDEN_LAUNCH_ID=s0-gone in its env
        older = EngineRecord(**{**record.to_dict(), "proc_start_ticks": ticks - 100})
        assert not launcher.adoptable(older)  # and a start time that does not match
        assert await launcher.stop_leftover(record) == 0
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()


class _Died(Exception):
    """fleetwarden killed between an engine's spawn and the journal's record of its PID."""


async def test_an_engine_whose_pid_never_reached_the_journal_is_stopped_by_the_next_run(
        tmp_path: Path) -> None:
    """fleetwarden killed between an engine's spawn and the commit that records its PID (an
    fsync, seconds on a busy disk) left the engine running, named by no journal row: the next
    run neither adopted nor stopped it (the fleet model found one, an orphan holding an
    engine's memory). The launch's intent is journaled before the spawn; the next run finds
    its process by launch id and stops it, and only it."""
    from fleetwarden.fleet import _JournalEngines
    from fleetwarden.restore import adopt_or_stop

    class DiesAfterTheSpawn(_JournalEngines):
        def launched(self, handle: EngineHandle) -> None:
            raise _Died

    fleet = FleetConfig(engine_cmd="{python} -c 'import time; time.sleep(60)' {port}",
                        log_dir=tmp_path, engines_outlive_fleetwarden=True)
    path = tmp_path / "fleetwarden.sqlite"
    env = {**os.environ, "FLEETWARDEN_LAUNCH_ID": "s0-another-launch"}
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env=env, start_new_session=True)
    first = LocalLauncher(fleet, SupervisorConfig(stop_grace_s=5), lambda h: None)
    try:
        with Journal(path) as journal:
            first.events = DiesAfterTheSpawn(journal)
            with pytest.raises(_Died):
                await first.launch(0)
            [engine] = first.handles
            assert [e["pid"] for e in journal.running_engines()] == [None]  # its intent only
        assert live_launch_ids({engine.launch_id}) == {engine.launch_id}  # it runs on

        with Journal(path) as journal:  # the next run; killed before its first snapshot too
            again = LocalLauncher(fleet, SupervisorConfig(stop_grace_s=5), lambda h: None)
            assert await adopt_or_stop(journal, again, None) == {}
            assert journal.running_engines() == []  # the journal says it stopped
        assert live_launch_ids({engine.launch_id}) == set()
        assert bystander.poll() is None  # another launch id: never signalled
    finally:
        kill_launched({h.launch_id for h in first.handles})
        bystander.kill()
        bystander.wait()


async def test_an_engine_with_the_same_launch_id_is_adopted_and_stopped_through_its_group(
        tmp_path: Path) -> None:
    env = {**os.environ, "FLEETWARDEN_LAUNCH_ID": "s0-real"}
    engine = subprocess.Popen([sys.executable, "-m", "fleetwarden", "sim", "--port", "0"],
                              env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        url = engine.stdout.readline().split()[1]
        record = EngineRecord(shard=0, launch_id="s0-real", url=url, pid=engine.pid,
                              pgid=engine.pid, proc_start_ticks=process_start_ticks(engine.pid),
                              log_path=None, launched_at=0.0)
        exits: list[object] = []
        launcher = LocalLauncher(FleetConfig(log_dir=tmp_path), SupervisorConfig(),
                                 exits.append)
        assert launcher.adoptable(record)
        handle = await launcher.adopt(record)
        await launcher.stop(handle)
        assert engine.wait(timeout=10) is not None and exits == []  # a stop is not an exit
    finally:
        if engine.poll() is None:
            engine.kill()


async def test_fleetwardens_own_deaths_spend_no_restart_budget(tmp_path: Path) -> None:
    """Each unclean stop of fleetwarden spent a restart on every engine it
    could not adopt; six of them retired a fleet. Its own death is not the engines' failure."""
    from support.fleet import running_fleet, until

    for _ in range(3):
        async with running_fleet(tmp_path) as fleet:
            await until(lambda: [fleet.ledger.state(i).value for i in range(2)]
                        == ["HEALTHY"] * 2, 60, "the fleet serving")
            attempts = [r.restart_attempts for r in fleet.ledger.snapshot()]
            assert attempts == [0, 0]
            path = fleet.config.journal.path
        with Journal(path) as journal:  # as if it had died: the next start is not a clean one
            journal.set_meta("clean_shutdown", "0")
    with Journal(path) as journal:
        causes = [e.cause for e in journal.transitions(shard=0)]
    assert any("no restart spent" in c for c in causes)  # journaled, with its cause


async def test_attached_engines_that_lived_on_keep_their_weights_across_a_trainer_restart(
        tmp_path: Path) -> None:
    """In trainer mode every attached engine came back from fleetwarden's restart as a new run,
    STALE until the trainer's next refit (409 for every client), although the same processes
    held the same weights. One whose start time is the journal's keeps its state (its version;
    asleep, its sleep and the trainer's hold); one with no start time (SGLang) cannot be told
    from a replacement and waits for the refit as before."""
    from support.fleet import running_fleet, stamp, until
    from support.sim import SimProcess

    sims = [SimProcess("--steps-per-s", "40"), SimProcess("--steps-per-s", "40"),
            SimProcess("--steps-per-s", "40", "--engine", "sglang")]
    urls = [s.url for s in sims]
    fleet_cfg = {"fleet": {"engines": 0, "backends": urls, "weights": "trainer"}}
    try:
        async with running_fleet(tmp_path, **fleet_cfg) as fleet:
            await until(lambda: all(fleet.ledger.shard(i).incarnation for i in (0, 1)),
                        60, "the vLLM engines identified")
            await fleet.begin_refit(1)
            await stamp(fleet, 1)
            await fleet.complete_refit(1)
            assert [fleet.ledger.state(i).value for i in range(3)] == ["HEALTHY"] * 3
            await fleet.sleep(1, [1])
            assert fleet.ledger.shard(1).sleep_held
            path = fleet.config.journal.path
        with Journal(path) as journal:  # as if it had died: the next start is not a clean one
            journal.set_meta("clean_shutdown", "0")
        async with running_fleet(tmp_path, **fleet_cfg) as fleet:
            r0, r1, r2 = fleet.ledger.snapshot()
            assert (r0.state.value, r0.weight_version) == ("HEALTHY", 1)
            assert (r1.state.value, r1.sleep_held, r1.weight_version) == ("SLEEPING", True, 1)
            assert r2.state.value == "STALE"  # no start time: a new run, for the next refit
            assert fleet.router.serving_backends() == [urls[0]]
            await fleet.wake([1])
            assert (fleet.ledger.state(1).value, fleet.ledger.shard(1).weight_version) == (
                "HEALTHY", 1)
    finally:
        for s in sims:
            s.kill()
