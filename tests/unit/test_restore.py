"""How a restored ledger meets this run's engines (restore.begin_run): no shard left without a
way out, no restart spent on fleetwarden's own death, every change a journaled transition."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, EngineRecord, LaunchError
from fleetwarden.launchers.local import LocalLauncher
from fleetwarden.ledger import Event, Ledger, Policy, ShardState, Transition, unnamed_incarnation
from fleetwarden.restore import adopt_or_stop, begin_run, read_attached, same_process
from fleetwarden.watchdog import Target, Watchdog
from support.wait import free_port

H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)


def restored(n: int = 3, weights: str = "static") -> tuple[Ledger, list[Transition]]:
    ledger = Ledger([f"http://127.0.0.1:{8000 + i}" for i in range(n)],
                    Policy(weights=weights))  # type: ignore[arg-type]
    seen: list[Transition] = []
    ledger.subscribe(seen.append)
    return ledger, seen


def engine(i: int, port: int) -> EngineHandle:
    return EngineHandle(i, f"http://127.0.0.1:{port}", f"launch-{port}")


def test_a_first_launch_that_fails_leaves_no_shard_restarting() -> None:
    """Item 1: a restore that marked a shard RESTARTING and then failed to launch its engine
    left it there for good (the supervisor only acts on DEAD shards)."""
    ledger, _ = restored()
    ledger.condemn(0, "exited")
    ledger.mark_restarting(0)  # the last run died in the middle of this restart
    begin_run(ledger, {0: LaunchError("no /health"), 1: LaunchError("no /health"),
                       2: engine(2, 9002)}, attached={})
    assert [ledger.state(0), ledger.state(1), ledger.state(2)] == [D, D, H]
    assert "first start failed" in ledger.shard(1).last_error


def test_fleetwardens_own_restarts_spend_no_budget() -> None:
    """Item 11: each unclean restart of fleetwarden spent a restart on every engine it could
    not adopt; six of them retired a fleet."""
    ledger, seen = restored(2)
    ledger.report_failure(1, "500")
    for run in range(8):
        begin_run(ledger, {i: engine(i, 9000 + 10 * run + i) for i in range(2)}, attached={})
    assert [r.restart_attempts for r in ledger.snapshot()] == [0, 0]
    assert [ledger.state(0), ledger.state(1)] == [H, H]
    assert ledger.shard(1).consecutive_reported_failures == 0  # the last run's process's
    assert ledger.shard(0).base_url == "http://127.0.0.1:9070"
    assert {t.event for t in seen if t.shard == 0} == {Event.NEW_RUN}  # each one journaled


def test_an_interrupted_restart_completes_and_a_dead_shard_is_left_to_the_supervisor() -> None:
    ledger, _ = restored()
    ledger.condemn(0, "exited")
    ledger.mark_restarting(0)
    ledger.condemn(1, "exited")
    begin_run(ledger, {0: engine(0, 9100), 2: engine(2, 9102)}, attached={})
    r0 = ledger.shard(0)
    assert (r0.state, r0.restart_attempts, r0.base_url) == (ST, 1, "http://127.0.0.1:9100")
    assert ledger.state(1) is D and ledger.shard(1).restart_attempts == 0


def test_trainer_mode_new_engines_wait_for_a_refit_and_attached_ones_too() -> None:
    ledger, _ = restored(3, weights="trainer")
    ledger.record_probe(2, False, "refused")
    begin_run(ledger, {0: engine(0, 9200), 1: engine(1, 9201)},
              attached={2: "http://127.0.0.1:8002"})
    assert [ledger.state(i) for i in range(3)] == [ST, ST, ST]
    assert ledger.shard(2).base_url == "http://127.0.0.1:8002"  # attached: same URL
    assert ledger.shard(2).consecutive_probe_failures == 0
    assert [r.restart_attempts for r in ledger.snapshot()] == [0, 0, 0]


def test_a_new_engine_on_a_url_another_shard_records_fails_cleanly() -> None:
    ledger, _ = restored(2)
    begin_run(ledger, {0: engine(0, 8001)}, attached={})  # shard 1 records port 8001
    assert ledger.state(0) is D and "belongs to another shard" in ledger.shard(0).last_error


def test_a_shard_ejected_in_the_last_run_is_routed_as_soon_as_it_is_healthy_again() -> None:
    """An engine ejected for failed requests, then fleetwarden restarted (killed or stopped):
    its shard came back HEALTHY with the last run's ejected_until, which no good probe clears
    once HEALTHY, so no push ever named it again."""
    for attached in (False, True):
        ledger, _ = restored(2)
        ledger.report_failure(1, "500")  # ejected: SUSPECT, out of routing
        assert ledger.shard(1).ejected_until is not None
        if attached:
            begin_run(ledger, {}, attached={1: "http://127.0.0.1:8001"})
        else:
            begin_run(ledger, {1: engine(1, 9301)}, attached={})
        r = ledger.shard(1)
        assert r.state is H
        assert (r.ejected_until, r.on_trial, r.ejections) == (None, False, 0)
        assert r.base_url in ledger.serving_urls()


def test_an_edited_backends_list_is_the_one_routed_after_a_restart() -> None:
    """Restarted with one --backend replaced, the fleet kept the journal's URL and routed to the
    old engine, never to the new one."""
    ledger, _ = restored(3)
    begin_run(ledger, {}, attached={1: "http://127.0.0.1:8001", 2: "http://127.0.0.1:9999"})
    assert ledger.serving_urls() == ["http://127.0.0.1:8000", "http://127.0.0.1:8001",
                                     "http://127.0.0.1:9999"]
    assert ledger.shard_for_url("http://127.0.0.1:8002") is None


def test_a_backend_moved_down_the_list_takes_the_url_its_neighbour_left() -> None:
    ledger, _ = restored(3)  # 8000, 8001, 8002: 8001 removed, 8002 moved up, 8003 added
    begin_run(ledger, {}, attached={1: "http://127.0.0.1:8002", 2: "http://127.0.0.1:8003"})
    assert [r.base_url for r in ledger.snapshot()] == [
        "http://127.0.0.1:8000", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]
    assert [ledger.state(i) for i in range(3)] == [H, H, H]


def test_two_backends_that_swapped_places_are_condemned_not_routed_to_the_wrong_shard() -> None:
    ledger, _ = restored(2)
    begin_run(ledger, {}, attached={0: "http://127.0.0.1:8001", 1: "http://127.0.0.1:8000"})
    assert [ledger.state(i) for i in range(2)] == [D, D]
    assert "belongs to another shard" in ledger.shard(0).last_error


def test_a_condemned_backend_replaced_in_the_config_is_loaded_on_its_new_url() -> None:
    """A DEAD attached shard kept its journal URL: the passive wait for its engine to come
    back watched the old URL (or the new engine, which never restarts), so the replacement
    the operator configured was never routed."""
    ledger, _ = restored(2)
    ledger.condemn(1, "stuck")
    begin_run(ledger, {}, attached={1: "http://127.0.0.1:9999"})
    r = ledger.shard(1)
    assert (r.state, r.base_url, r.restart_attempts) == (ST, "http://127.0.0.1:9999", 1)
    # ... while one whose URL is unchanged is left to the supervisor, as before.
    ledger.condemn(0, "stuck")
    begin_run(ledger, {}, attached={0: "http://127.0.0.1:8000"})
    assert ledger.state(0) is D


# ---------------------------------------------------------------- an attached engine that lived on

VLLM_START = "1764600000.5"  # what a vLLM engine reports: process_start_time_seconds


def trainer_fleet_at_version(n: int = 3, version: int = 7) -> Ledger:
    """A trainer-mode fleet whose attached engines were identified (the watchdog's first read)
    and refit to ``version``: what the journal holds when fleetwarden is SIGKILLed."""
    ledger, _ = restored(n, weights="trainer")
    for i in range(n):
        ledger.observe_incarnation(i, f"{VLLM_START}{i}")
        ledger.report_refit(i, version)
    return ledger


def test_the_same_process_is_one_both_sides_name_alike() -> None:
    assert same_process("1764600000.5", "1764600000.5")
    assert not same_process("1764600000.5", "1764600001.5")  # restarted meanwhile
    assert not same_process(None, None)  # SGLang, TGI, openai: no start time to compare
    assert not same_process("1764600000.5", None)  # gave none now, or the read failed
    assert not same_process(None, "1764600000.5")  # never identified in the last run
    # a name the ledger gave a restart it saw on an engine with no start time is no process's
    assert not same_process(unnamed_incarnation(None), unnamed_incarnation(None))


def test_a_trainer_restart_keeps_an_attached_engine_that_lived_on_at_its_version() -> None:
    """fleetwarden SIGKILLed and started again in trainer mode: every attached engine became a
    new run, STALE until the trainer's next refit (409 for every client), although the same
    processes held the same weights. Only the one that is provably the same keeps its state."""
    ledger = trainer_fleet_at_version()
    attached = {i: ledger.shard(i).base_url for i in range(3)}
    running = {0: f"{VLLM_START}0",  # the same process
               1: f"{VLLM_START}1-other",  # restarted while fleetwarden was down
               2: None}  # did not answer, or gives no start time
    begin_run(ledger, {}, attached, running)
    assert [ledger.state(i) for i in range(3)] == [H, ST, ST]
    assert ledger.shard(0).weight_version == 7
    assert ledger.shard(0).incarnation == f"{VLLM_START}0"
    assert ledger.serving_urls() == [attached[0]]
    # a new run's process is the one read now: the next restart can tell it again
    assert [ledger.shard(i).incarnation for i in (1, 2)] == [f"{VLLM_START}1-other", None]


def test_an_unidentified_or_moved_attached_shard_is_a_new_run_whatever_it_reports() -> None:
    ledger, _ = restored(2, weights="trainer")
    ledger.report_refit(0, 3)  # never identified: the journal knows no process of it
    ledger.observe_incarnation(1, VLLM_START)
    ledger.report_refit(1, 3)
    attached = {0: ledger.shard(0).base_url, 1: "http://127.0.0.1:9999"}  # 1 replaced
    begin_run(ledger, {}, attached, {0: VLLM_START, 1: VLLM_START})
    assert [ledger.state(0), ledger.state(1)] == [ST, ST]
    assert ledger.shard(1).base_url == "http://127.0.0.1:9999"


def test_a_sleeping_attached_engine_that_lived_on_stays_asleep_and_held() -> None:
    """The journal says asleep, held by the trainer; the same process is still asleep. A new
    run woke it (STALE, awake, no hold): the trainer's wake then found nothing to wake and the
    shard had left its version behind."""
    for weights in ("trainer", "static"):
        ledger, _ = restored(2, weights=weights)
        for i in range(2):
            ledger.observe_incarnation(i, f"{VLLM_START}{i}")
            ledger.report_refit(i, 4)
            ledger.report_asleep(i, "the trainer's sleep", held=True)
        attached = {i: ledger.shard(i).base_url for i in range(2)}
        begin_run(ledger, {}, attached, {0: f"{VLLM_START}0", 1: "another"})
        r0, r1 = ledger.shard(0), ledger.shard(1)
        assert (r0.state, r0.sleep_held, r0.state_before_sleep, r0.weight_version) == (
            ShardState.SLEEPING, True, H, 4), weights
        assert (r1.state, r1.sleep_held) == (ST, False), weights  # a new process starts awake
        assert ledger.report_awake(0, "the trainer's wake", by_trainer=True)
        assert ledger.state(0) is H


def test_a_static_restart_keeps_an_ejected_engine_that_lived_on_ejected() -> None:
    """The same process keeps its verdicts too, as an adopted launched engine does: its
    ejection and its streak are about this very process."""
    ledger, _ = restored(2)
    ledger.observe_incarnation(1, VLLM_START)
    ledger.report_failure(1, "500")
    before = ledger.shard(1)
    begin_run(ledger, {}, {1: before.base_url}, {1: VLLM_START})
    assert ledger.shard(1) == before


async def test_read_attached_names_each_engine_as_the_watchdog_does_and_never_raises() -> None:
    metrics = (Path(__file__).parents[1] / "fixtures/vllm/metrics-idle.txt").read_text()

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def exported(_: web.Request) -> web.Response:
        return web.Response(text=metrics)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", exported)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
        async with Watchdog() as watchdog:
            got = await read_attached(watchdog, {3: Target(f"http://127.0.0.1:{port}"),
                                                 4: Target(dead)})
            assert await read_attached(watchdog, {}) == {}
    finally:
        await runner.cleanup()
    start = next(line.split()[-1] for line in metrics.splitlines()
                 if line.startswith("process_start_time_seconds"))
    assert got == {3: repr(float(start)), 4: None}


async def test_a_launch_journaled_only_by_its_intent_is_marked_stopped_when_nothing_runs(
        tmp_path: Path) -> None:
    """A launch whose PID never reached the journal: when no process carries its launch id,
    the next run signals nothing and closes its record, adopting nothing, whether a ledger was
    restored or not (a run killed before its first snapshot). Its process found running is
    tests/scenario/test_resilience.py's."""
    for ledger in (restored(1)[0], None):
        handle = EngineHandle(0, "http://127.0.0.1:8000", f"s0-never-spawned-{id(ledger)}")
        with Journal(tmp_path / "fleet.sqlite") as journal:
            journal.engine_launched(handle.launch_id, 0, EngineRecord.intent(handle))
            launcher = LocalLauncher(FleetConfig(log_dir=tmp_path), SupervisorConfig(),
                                     lambda h: None)
            assert await adopt_or_stop(journal, launcher, ledger) == {}
            assert journal.running_engines() == []
            assert handle.launch_id in journal.launch_ids()
