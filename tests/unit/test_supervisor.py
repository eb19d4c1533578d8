"""The supervisor's policy: budgets, backoff, the fleet-wide cap, exits are conclusive.

A fake launcher whose engines come up (or fail) when the test says so; a fake clock for the
backoff, and the virtual-time loop for the startup timeout (tests/support/clock.py). No real
time passes.
"""

from __future__ import annotations

import asyncio

import pytest

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.launchers import EngineHandle, LaunchError
from fleetwarden.ledger import ABSENT, Ledger, Policy, ShardState
from fleetwarden.supervisor import Supervisor, launch_first
from support.clock import TICK_S, Clock, elapse

D, R, ST, X = ShardState.DEAD, ShardState.RESTARTING, ShardState.STALE, ShardState.RETIRED


class FakeLauncher:
    def __init__(self) -> None:
        self.port = 9000
        self.launched: list[EngineHandle] = []
        self.stopped: list[EngineHandle] = []
        self.ready: dict[str, asyncio.Future[None]] = {}

    async def launch(self, shard: int) -> EngineHandle:
        self.port += 1
        h = EngineHandle(shard, f"http://127.0.0.1:{self.port}", f"launch-{self.port}")
        self.launched.append(h)
        self.ready[h.launch_id] = asyncio.get_running_loop().create_future()
        return h

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        await self.ready[handle.launch_id]

    async def stop(self, handle: EngineHandle) -> None:
        self.stopped.append(handle)

    async def close(self) -> None:
        pass

    def come_up(self, handle: EngineHandle) -> None:
        self.ready[handle.launch_id].set_result(None)

    def fail(self, handle: EngineHandle, why: str = "no /health") -> None:
        self.ready[handle.launch_id].set_exception(LaunchError(why))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def fleet(n: int, **cfg: object) -> tuple[Ledger, FakeLauncher, Supervisor, Clock, list[int]]:
    ledger = Ledger([f"http://127.0.0.1:{8000 + i}" for i in range(n)],
                    Policy(max_restart_attempts=cfg.pop("budget", 5)))  # type: ignore[arg-type]
    launcher = FakeLauncher()
    clock = Clock(0.0)
    condemned: list[int] = []
    sup = Supervisor(ledger, launcher, FleetConfig(), SupervisorConfig(**cfg),  # type: ignore[arg-type]
                     clock=clock)
    # Condemnations travel one way: the ledger's transition stream.
    ledger.subscribe(lambda t: condemned.append(t.shard) if t.to_state is ShardState.DEAD
                     and t.from_state not in ABSENT else None)
    return ledger, launcher, sup, clock, condemned


async def test_a_dead_shard_is_restarted_on_a_new_url_with_no_history() -> None:
    ledger, launcher, sup, _, _ = fleet(4)
    ledger.report_failure(2, "x")
    ledger.condemn(2, "stuck")
    sup.tick()
    assert ledger.state(2) is R  # RESTARTING before the controller's push
    await settle()
    (h,) = launcher.launched
    launcher.come_up(h)
    await settle()
    sup.tick()
    r = ledger.shard(2)
    assert (r.state, r.base_url, r.incarnation, r.restart_attempts) == (ST, h.url, h.launch_id, 1)
    assert r.consecutive_reported_failures == 0
    assert sup.engines[2] is h


async def test_a_replacement_that_answers_is_loaded_at_once_not_at_the_next_tick() -> None:
    """The attempt's end is collected on the next turn of the loop: no tick in between. And
    until then the shard is coming back; a passive one for the startup timeout only."""
    ledger, launcher, sup, clock, _ = fleet(2)
    ledger.condemn(1, "engine process exited with code -9")
    await settle()  # the condemnation began the restart: no tick
    assert ledger.state(1) is R and sup.coming_back(1)
    assert not sup.coming_back(0)  # HEALTHY: nothing to come back
    (h,) = launcher.launched
    launcher.come_up(h)
    await settle()  # no sup.tick(): the attempt's end collected it
    r = ledger.shard(1)
    assert (r.state, r.base_url, r.restart_attempts) == (ST, h.url, 1)
    assert not sup.coming_back(1)  # STALE: the controller's business now (one canary)
    # attached with no restart command: awaited for startup_timeout_s, then not counted
    ledger2 = Ledger(["http://10.0.0.1:8000"])
    sup2 = Supervisor(ledger2, FakeLauncher(), FleetConfig(startup_timeout_s=60.0),
                      SupervisorConfig(), passive=lambda i: True, clock=clock)
    ledger2.condemn(0, "stuck")
    await settle()
    assert sup2.coming_back(0)
    clock.now += 61.0
    assert not sup2.coming_back(0)
    await sup2.close()
    await sup.close()


async def test_an_attached_engine_is_awaited_until_its_startup_timeout_not_a_tick_longer(
) -> None:
    ledger = Ledger(["http://10.0.0.1:8000"])
    clock = Clock(0.0)
    sup = Supervisor(ledger, FakeLauncher(), FleetConfig(startup_timeout_s=60.0),
                     SupervisorConfig(), passive=lambda i: True, clock=clock)
    ledger.condemn(0, "stuck")
    await settle()
    clock.now = 60.0 - TICK_S
    assert sup.coming_back(0)
    clock.now = 60.0
    assert not sup.coming_back(0)
    await sup.close()


async def test_backoff_doubles_up_to_the_maximum() -> None:
    ledger, launcher, sup, clock, _ = fleet(4, backoff_initial_s=2, backoff_max_s=10, budget=20)
    ledger.condemn(0, "exited")
    waits = []
    sup.tick()
    for _ in range(5):
        await settle()
        launcher.fail(launcher.launched[-1])
        await settle()
        sup.tick()
        assert ledger.state(0) is D
        start = clock.now
        while ledger.state(0) is D:
            clock.now += 0.25
            sup.tick()
        waits.append(clock.now - start)
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]


async def test_a_failed_restart_is_retried_at_its_backoff_not_a_tick_before() -> None:
    """Each boundary of the backoff (2 s, doubled to 4 s, capped at 5 s) from both sides."""
    ledger, launcher, sup, clock, _ = fleet(2, backoff_initial_s=2, backoff_max_s=5, budget=20)
    ledger.condemn(0, "exited")
    sup.tick()
    for backoff in (2.0, 4.0, 5.0, 5.0):
        await settle()
        launcher.fail(launcher.launched[-1])
        await settle()
        sup.tick()
        assert ledger.state(0) is D
        due = clock.now + backoff
        clock.now = due - TICK_S
        sup.tick()
        assert ledger.state(0) is D, f"retried before its {backoff:g} s backoff"
        clock.now = due
        sup.tick()
        assert ledger.state(0) is R, f"not retried at its {backoff:g} s backoff"


async def test_the_restart_budget_retires_a_shard_that_keeps_dying() -> None:
    ledger, launcher, sup, _clock, _ = fleet(2, budget=2)
    for _ in range(2):
        ledger.condemn(0, "exited")
        sup.tick()
        await settle()
        launcher.come_up(launcher.launched[-1])
        await settle()
        sup.tick()
        assert ledger.state(0) is ST
        ledger.report_refit(0, 0)
    ledger.condemn(0, "exited")
    sup.tick()
    assert ledger.state(0) is X
    assert len(launcher.launched) == 2  # the third restart was never started
    assert 0 not in sup.engines


async def test_restarts_are_capped_fleet_wide() -> None:
    ledger, launcher, sup, _, _ = fleet(8)  # cap: a quarter of 8 = 2
    for i in range(6):
        ledger.condemn(i, "exited")
    sup.tick()
    await settle()
    assert [ledger.state(i) for i in range(6)].count(R) == 2
    assert len(launcher.launched) == 2
    launcher.come_up(launcher.launched[0])
    await settle()
    sup.tick()  # one finished: one more may start
    await settle()
    assert [ledger.state(i) for i in range(6)].count(R) == 2
    assert len(launcher.launched) == 3


async def test_an_engine_exit_is_conclusive_at_once() -> None:
    ledger, launcher, sup, _, condemned = fleet(2)
    up = await asyncio.wait_for(_launch_all(sup, launcher, [0, 1]), 5)
    assert set(up) == {0, 1}
    h = sup.engines[1]
    h.returncode = -9
    sup.engine_exited(h)
    assert ledger.state(1) is D and condemned == [1]
    assert "exited with code -9" in ledger.shard(1).last_error


async def test_an_old_incarnation_exiting_condemns_nothing() -> None:
    ledger, _launcher, sup, _, condemned = fleet(2)
    old = EngineHandle(0, "http://127.0.0.1:1", "old", returncode=1)
    sup.engine_exited(old)
    assert ledger.state(0) is ShardState.HEALTHY and condemned == []


async def test_a_retired_shard_has_its_engine_stopped() -> None:
    ledger, launcher, sup, _, _ = fleet(2)
    await _launch_all(sup, launcher, [0, 1])
    ledger.retire(1, "operator")
    sup.tick()
    await settle()
    assert launcher.stopped == [launcher.launched[1]]
    await sup.close()


async def test_close_cancels_restarts_in_progress() -> None:
    ledger, _launcher, sup, _, _ = fleet(2)
    ledger.condemn(0, "x")
    sup.tick()
    await settle()
    await sup.close()
    assert sup.attempts == {}


async def test_no_task_of_the_supervisor_outlives_its_close() -> None:
    """Every task it starts is owned: a restart in progress, a cancelled
    one still stopping what it launched, a background stop. Close ends or awaits them all."""
    ledger, launcher, sup, _, _ = fleet(3)
    sup.adopt(2, EngineHandle(2, "http://127.0.0.1:8002", "first-2"))
    ledger.condemn(0, "x")
    ledger.condemn(1, "y")
    sup.tick()  # two attempts (the cap at 3 shards is 1: one waits)
    await settle()
    ledger.retire(2, "operator")
    sup.tick()  # shard 2's engine is stopped in the background
    started = [t for t in asyncio.all_tasks() if t.get_name().startswith(("restart:", "stop:"))]
    assert started and len(sup.tasks) == len(started)
    await sup.close()
    assert len(sup.tasks) == 0 and all(t.done() for t in started)
    assert any(h.launch_id == "first-2" for h in launcher.stopped)


async def _launch_all(sup: Supervisor, launcher: FakeLauncher, shards: list[int]) -> dict[int, str]:
    task = asyncio.create_task(launch_first(launcher, shards, 30))
    await settle()
    for h in launcher.launched:
        launcher.come_up(h)
    up = {}
    for i, h in (await task).items():
        assert isinstance(h, EngineHandle)
        sup.adopt(i, h)
        up[i] = h.url
    return up


async def test_a_first_launch_that_fails_is_returned_not_raised() -> None:
    launcher = FakeLauncher()
    task = asyncio.create_task(launch_first(launcher, [0, 1], 30))
    await settle()
    launcher.come_up(launcher.launched[0])
    launcher.fail(launcher.launched[1], "exited with code 1")
    results = await task
    assert isinstance(results[0], EngineHandle)
    assert isinstance(results[1], LaunchError) and launcher.stopped == [launcher.launched[1]]


async def test_a_passive_shard_spends_no_budget_until_its_engine_returns() -> None:
    ledger = Ledger(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    launcher = FakeLauncher()
    sup = Supervisor(ledger, launcher, FleetConfig(), SupervisorConfig(),
                     passive=lambda i: i == 1)
    ledger.condemn(1, "stuck")
    for _ in range(3):
        sup.tick()
        await settle()
    assert ledger.state(1) is D and ledger.shard(1).restart_attempts == 0
    assert len(launcher.launched) == 1  # one wait for its return, not one per tick
    launcher.come_up(launcher.launched[0])
    await settle()
    sup.tick()
    r = ledger.shard(1)
    assert (r.state, r.restart_attempts) == (ST, 1)


# ---------------------------------------------------------------- no state without a way out
# (each of these once left a shard where nothing would ever move it again)


async def test_a_passive_wait_never_holds_a_restart_slot() -> None:
    """Two launched engines and one attached with no restart command: the cap is 1. The
    attached engine's wait for its return must not keep a crashed launched shard DEAD."""
    ledger = Ledger(["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://10.0.0.2:8000"])
    launcher = FakeLauncher()
    sup = Supervisor(ledger, launcher, FleetConfig(), SupervisorConfig(),
                     passive=lambda i: i == 2)
    assert sup.cap == 1
    ledger.condemn(2, "wedged")
    sup.tick()
    await settle()
    ledger.condemn(0, "exited with code -9")
    sup.tick()
    assert ledger.state(0) is R
    await sup.close()


async def test_retiring_a_shard_cancels_its_attempt() -> None:
    ledger = Ledger(["http://127.0.0.1:8000", "http://10.0.0.2:8000"])
    launcher = FakeLauncher()
    sup = Supervisor(ledger, launcher, FleetConfig(), SupervisorConfig(),
                     passive=lambda i: i == 1)
    ledger.condemn(1, "wedged")
    ledger.condemn(0, "exited")
    sup.tick()
    await settle()
    waits = [a.task for a in sup.attempts.values()]
    assert len(waits) == 2
    ledger.retire(1, "operator")
    ledger.retire(0, "operator")
    sup.tick()
    await settle()
    assert sup.attempts == {} and all(t.cancelled() for t in waits)
    await sup.close()


class HangingLauncher(FakeLauncher):
    """A launch that never returns (a restart command that hangs, a scheduler that never
    places the engine)."""

    async def launch(self, shard: int) -> EngineHandle:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.virtual_time
async def test_a_launch_that_hangs_fails_at_the_startup_timeout_not_a_tick_before() -> None:
    ledger = Ledger(["http://127.0.0.1:8000", "http://127.0.0.1:8001"])
    sup = Supervisor(ledger, HangingLauncher(), FleetConfig(startup_timeout_s=20.0),
                     SupervisorConfig(), clock=asyncio.get_running_loop().time)
    ledger.condemn(0, "exited")
    sup.tick()
    assert ledger.state(0) is R
    await elapse(20.0 - TICK_S)
    sup.tick()
    assert ledger.state(0) is R and sup.restarts_failed == 0  # a tick before: still waited for
    await elapse(2 * TICK_S)
    sup.tick()
    r = ledger.shard(0)
    assert r.state is D and sup.attempts == {}
    assert "20 s" in r.last_error and sup.restarts_failed == 1


async def test_a_port_that_a_dead_shard_still_records_fails_the_attempt_not_the_tick() -> None:
    ledger, launcher, sup, _, _ = fleet(2)
    ledger.condemn(1, "exited")
    ledger.mark_restarting(1)
    ledger.mark_restart_failed(1, "no /health")  # DEAD, still recording port 8001
    ledger.condemn(0, "exited")
    launcher.port = 8000  # the next launch is given port 8001
    sup.tick()
    await settle()
    (h, *_) = launcher.launched
    assert h.url == "http://127.0.0.1:8001"
    launcher.come_up(h)
    await settle()
    sup.tick()  # must not raise
    r = ledger.shard(0)
    assert r.state is D and "shard 1" in r.last_error
    await settle()
    assert launcher.stopped == [h]  # the engine that could not be recorded is not left running
    await sup.close()


async def test_a_restarting_shard_that_no_attempt_brings_up_is_restarted() -> None:
    """A restore whose first launch failed leaves a shard RESTARTING with nothing of the
    supervisor's bringing it up; it must not wait there for ever."""
    ledger, launcher, sup, _, _ = fleet(2)
    ledger.condemn(0, "fleetwarden restarted")
    ledger.mark_restarting(0)
    sup.tick()
    assert ledger.state(0) is R and 0 in sup.attempts
    await settle()
    launcher.come_up(launcher.launched[0])
    await settle()
    sup.tick()
    assert ledger.state(0) is ST
