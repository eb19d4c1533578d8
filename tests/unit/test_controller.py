"""The controller: watchdog reports into the ledger (whose mapping it is), outcome windows, and
a tick that no failing step aborts. Built from its real parts; only the engines are fakes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from fleetwarden.config import Config, FleetConfig
from fleetwarden.controller import Controller, TickReport
from fleetwarden.engines import LLAMACPP, CapUnknown
from fleetwarden.judge import CanaryRule, Evidence, Health, Verdict
from fleetwarden.launchers import EngineHandle, LaunchError
from fleetwarden.ledger import Event, Ledger, Policy, ShardState, never_empty
from fleetwarden.pushes import completion_default_of, output_default_from
from fleetwarden.refit import RefitCoordinator
from fleetwarden.router import InProcessRouter, RemoteRouter, Router
from fleetwarden.router.ops import Holding
from fleetwarden.router.splice import CompletionDefault
from fleetwarden.supervisor import Supervisor
from fleetwarden.watchdog import DEFAULT_CONCURRENCY, CanaryResult, Report, Target, Watchdog
from support.clock import Clock
from support.links import QuietLink
from support.router_rig import rig, until
from support.ticks import read_and_tick

H, S, ST, D = ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE, ShardState.DEAD


def report(verdict: Verdict, health: Health, canary: bool | None = None,
           incarnation: str | None = None) -> Report:
    result = None if canary is None else CanaryResult(canary, 1.5, None if not canary else 200,
                                                      "" if canary else "no answer")
    return Report("http://e", verdict, Evidence(verdict.name.lower()), health, CanaryRule.NEVER,
                  None, None, result, incarnation)


class _NoLauncher:
    async def launch(self, shard: int) -> EngineHandle:
        raise LaunchError("this test launches nothing")

    async def wait_ready(self, handle: EngineHandle, timeout_s: float) -> None:
        pass

    async def stop(self, handle: EngineHandle) -> None:
        pass

    async def close(self) -> None:
        pass


class _Watchdog(Watchdog):
    """A watchdog whose round returns the reports the test gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.next: dict[str, Report] = {}

    async def round(self, targets: Iterable[Target], *,
                    on_report: Callable[[str, Report], None] | None = None,
                    **_: object) -> dict[str, Report]:
        reports, self.next = self.next, {}
        for url, report in reports.items():
            if on_report is not None:
                on_report(url, report)
        return reports


def controller(weights: str = "static") -> tuple[Controller, Ledger, RefitCoordinator]:
    """A controller with no router: the mapping of reports into its ledger, nothing else."""
    config = Config.model_validate({"fleet": {"weights": weights}})
    ledger = Ledger(["http://a", "http://b"], Policy(weights=config.fleet.weights))
    refit = RefitCoordinator(ledger)
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    return Controller(ledger, _Watchdog(), supervisor, [], config, refit=refit), ledger, refit


def test_verdicts_map_to_ledger_operations() -> None:
    c, ledger, _ = controller()
    c.apply_report(0, report(Verdict.IDLE, Health.FAILING, canary=False))
    assert ledger.state(0) is S and ledger.shard(0).consecutive_probe_failures == 1
    c.apply_report(0, report(Verdict.BUSY, Health.PROVEN))
    c.apply_report(0, report(Verdict.BUSY, Health.PROVEN))
    assert ledger.state(0) is H
    c.apply_report(0, report(Verdict.STALLED, Health.UNPROVEN))
    assert ledger.shard(0).consecutive_probe_successes == 2  # unproven: no probe either way
    c.apply_report(1, report(Verdict.STUCK, Health.CONDEMNED))
    assert ledger.state(1) is D and ledger.shard(1).last_error.startswith("STUCK")


def test_a_failed_canary_that_lands_during_a_refit_lease_counts_for_nothing() -> None:
    c, ledger, refit = controller("trainer")
    refit.begin_refit(1)
    c.apply_report(0, report(Verdict.IDLE, Health.FAILING, canary=False))
    c.apply_report(1, report(Verdict.LOST_CORE, Health.CONDEMNED, canary=False))
    assert [ledger.state(0), ledger.state(1)] == [H, H]
    refit.complete_refit(1)
    c.apply_report(0, report(Verdict.IDLE, Health.FAILING, canary=False))
    assert ledger.state(0) is S  # after the lease, a failed canary is a failed probe again


def test_a_silent_restart_goes_stale_in_trainer_mode_and_a_canary_promotes_in_static() -> None:
    c, ledger, _ = controller("trainer")
    ledger.observe_incarnation(0, "1.0")
    c.apply_report(0, report(Verdict.RESTARTED, Health.PROVEN, canary=True, incarnation="2.0"))
    assert ledger.state(0) is ST
    c.apply_report(0, report(Verdict.IDLE, Health.PROVEN, canary=True))
    assert ledger.state(0) is ST  # trainer mode: only a refit brings it back

    s, static, _ = controller("static")
    static.condemn(0, "exited")
    static.mark_restarting(0)
    static.mark_loaded(0, "http://a2", "launch-2")
    s.apply_report(0, report(Verdict.IDLE, Health.PROVEN, canary=True))
    assert static.state(0) is H  # static weights: a good canary is the refit


def test_an_unreachable_stale_shard_is_condemned_after_the_threshold() -> None:
    c, ledger, _ = controller("trainer")
    ledger.mark_weights_partial(0)
    for _ in range(2):
        c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
        assert ledger.state(0) is ST
    c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
    assert ledger.state(0) is D


def test_the_push_says_what_each_engine_kind_gives_a_completion_naming_no_limit() -> None:
    """vLLM and SGLang give 16, llama.cpp and TGI their own default (a chat's), an engine of
    no known kind (``openai``, ``auto`` before it is recognised) is not known: the router then
    ends such a completion, cut, rather than guess its limit."""
    seen = dataclasses.replace(report(Verdict.IDLE, Health.PROVEN), engine=LLAMACPP)
    F, E, U = CompletionDefault.FIXED, CompletionDefault.ENGINE, CompletionDefault.UNKNOWN
    assert [completion_default_of(kind, None) for kind in (
        "vllm", "sglang", "llamacpp", "tgi", "openai", "auto")] == [F, F, E, E, U, U]
    assert completion_default_of("auto", report(Verdict.IDLE, Health.PROVEN)) is U
    assert completion_default_of("auto", seen) is E  # recognised at its read
    assert completion_default_of("vllm", seen) is F  # the configured kind decides


def test_the_push_names_each_serving_backends_shard_and_weight_version() -> None:
    from fleetwarden.router.pool import BackendFacts

    c, ledger, refit = controller("trainer")
    refit.begin_refit(4)
    refit.complete_refit(4)
    ledger.condemn(0, "gone")
    # engine "auto", not recognised yet: what it gives a completion naming no limit is not known
    assert c.serving_push() == (["http://b"], {"http://b": BackendFacts(
        1, 4, completion_default=CompletionDefault.UNKNOWN)})


class _Router(QuietLink):
    def __init__(self) -> None:
        self.pushed: list[list[str]] = []
        self.coming: list[int] = []

    async def set_serving_backends(self, urls: Any, facts: Any = None, *,
                                   coming_back: int = 0) -> None:
        self.pushed.append(list(urls))
        self.coming.append(coming_back)


class _BrokenSupervisor(Supervisor):
    def tick(self) -> None:
        raise RuntimeError("a bug in the supervisor")


def _broken(ledger: Ledger, config: Config) -> Supervisor:
    return _BrokenSupervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)


async def test_a_step_that_raises_never_aborts_the_tick_before_its_push() -> None:
    config = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"])
    router = _Router()
    c = Controller(ledger, _Watchdog(), _broken(ledger, config), [router], config)
    ledger.condemn(1, "exited")
    report = await read_and_tick(c)
    assert router.pushed == [["http://a"]]
    assert report.errors and "a bug in the supervisor" in report.errors[0]


async def test_a_failing_journal_is_in_the_fleet_status(tmp_path: Any) -> None:
    from fleetwarden.journal import Journal

    config = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"])
    journal = Journal(tmp_path / "j.sqlite")
    journal.attach(ledger)
    router = _Router()
    c = Controller(ledger, _Watchdog(), _broken(ledger, config), [router], config,
                   journal=journal)
    journal._failed(OSError("disk full"))  # what the writer thread does when a commit fails
    ledger.condemn(1, "exited")
    await read_and_tick(c)
    assert c.status.state == "degraded" and "journal fails" in c.status.detail
    assert "disk full" in c.status.detail
    assert router.pushed == [["http://a"]]
    with contextlib.suppress(Exception):
        journal.close()


# ------------------------------------- a restart seen on its own; a STALE engine's streak


def test_a_static_stale_shard_whose_canaries_keep_failing_is_condemned() -> None:
    c, ledger, _ = controller("static")
    ledger.condemn(0, "exited")
    ledger.mark_restarting(0)
    ledger.mark_loaded(0, "http://a2", "launch-2")
    for _ in range(2):
        c.apply_report(0, report(Verdict.IDLE, Health.FAILING, canary=False))
        assert ledger.state(0) is ST
    c.apply_report(0, report(Verdict.IDLE, Health.FAILING, canary=False))
    assert ledger.state(0) is D and "no answer" in ledger.shard(0).last_error


def test_a_good_read_ends_a_stale_shards_failed_run_and_a_new_process_has_none() -> None:
    """The streak that condemns a STALE shard is the ledger's, reset with its reasons: a good
    read ends it; a new process starts without it (the controller kept its own before, and
    it survived the engine's restart)."""
    c, ledger, _ = controller("trainer")
    ledger.mark_weights_partial(0)
    for _ in range(2):
        c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
    c.apply_report(0, report(Verdict.IDLE, Health.PROVEN))
    assert ledger.shard(0).consecutive_probe_failures == 0
    ledger.observe_incarnation(0, "2.0")  # identified: the first incarnation seen
    for _ in range(2):
        c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
    ledger.observe_incarnation(0, "3.0")  # a new process
    c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
    assert ledger.state(0) is ST and ledger.shard(0).consecutive_probe_failures == 1


def test_a_restart_seen_without_a_start_time_is_still_a_new_process() -> None:
    c, ledger, _ = controller("static")
    ledger.observe_incarnation(0, "1.0")
    ledger.report_failure(0, "500")
    ledger.report_failure(0, "500")
    c.apply_report(0, report(Verdict.RESTARTED, Health.UNPROVEN, incarnation=None))
    r = ledger.shard(0)
    assert r.consecutive_reported_failures == 0 and r.state is H
    # no start time to name the new process: the ledger names the restart it saw, so nothing
    # credited to the old process (a refit's version) is credited to this one
    assert r.incarnation == "restart-seen-1"


async def test_the_old_process_failures_never_count_against_the_new_one() -> None:
    """Spec section 5: the windows drained in the tick in which a restart is seen hold the
    old process's failures (they are why it restarted), from every router; the new process
    starts with no streak."""
    c, ledger, _ = controller("static")
    ledger.observe_incarnation(0, "1.0")
    c.apply_report(0, report(Verdict.RESTARTED, Health.PROVEN, incarnation="2.0"))
    c.apply_outcomes({"http://a": (0, 4, 4)})  # one router's window
    c.apply_outcomes({"http://a": (0, 2, 2), "http://b": (3, 0, 0)})  # another router's
    assert ledger.shard(0).consecutive_reported_failures == 0 and ledger.state(0) is H
    await read_and_tick(c)
    c.apply_outcomes({"http://a": (0, 1, 1)})  # the next tick's window is the new process's
    assert ledger.shard(0).consecutive_reported_failures == 1


def test_a_sleeping_engine_leaves_the_serving_set_and_comes_back_when_it_reports_awake() -> None:
    from dataclasses import replace

    from fleetwarden.engine_metrics import Sample

    c, ledger, _ = controller()
    ledger.report_failure(1, "timeout")  # SUSPECT
    awake = Sample(running=0, waiting=0, steps=1, generation_tokens=1, start_time=1.0,
                   sleep_level=0)
    asleep = replace(awake, sleep_level=1)

    def read(sample: Sample, verdict: Verdict, health: Health) -> Report:
        return replace(report(verdict, health), sample=sample)

    for i in (0, 1):
        c.apply_report(i, read(asleep, Verdict.SLEEPING, Health.UNPROVEN))
    assert ledger.sleeping() == [0, 1] and ledger.serving_urls() == []
    assert c.serving_push() == ([], {})
    assert sorted(c.pushes._fell_asleep) == [0, 1]  # their waiting requests are rescued at the push
    assert c._status().state == "asleep"
    for _ in range(5):  # unreachable twice: proves nothing yet; a failed canary proves nothing
        c.apply_report(0, read(asleep, Verdict.SLEEPING, Health.UNPROVEN))
    c.apply_report(1, report(Verdict.IDLE, Health.FAILING, canary=False))  # no sample: no word
    assert ledger.sleeping() == [0, 1]
    c.apply_report(0, read(awake, Verdict.IDLE, Health.UNPROVEN))
    c.apply_report(1, read(awake, Verdict.IDLE, Health.UNPROVEN))
    assert [ledger.state(0), ledger.state(1)] == [H, S]  # as they slept
    # Held asleep by the trainer: a read that says awake does not wake it
    ledger.report_asleep(0, "put to sleep by the trainer", held=True)
    c.apply_report(0, read(awake, Verdict.IDLE, Health.PROVEN))
    assert ledger.state(0) is ShardState.SLEEPING
    # A sleeping engine that stops answering is condemned after the threshold, as a STALE one
    for _ in range(3):
        c.apply_report(0, report(Verdict.UNREACHABLE, Health.FAILING))
    assert ledger.state(0) is D and ledger.shard(0).last_error.startswith("UNREACHABLE")


# ---------------------------------------------------------------------- evidence
# A real router on real sockets in front of scripted engines; the controller's reads of the
# engines are scripted (what each read concludes), so that each test shows one mechanism.


class ScriptedReads:
    """The watchdog's side: what a read of each engine concludes, set by the test."""

    def __init__(self, default: Report) -> None:
        self.default = default
        #: What the controller reads of a watchdog beside its calls, as :class:`Watchdog`
        #: has them: how many reads go at once, and when each engine's last read finished.
        self.concurrency = DEFAULT_CONCURRENCY
        self.finished_at: dict[str, float] = {}
        self.by_url: dict[str, Report] = {}
        self.probed: list[Target] = []
        #: (url, held_flat_s) of each hedged lost core's watching canary; each returns
        #: ``watch_result`` once ``watch_released`` is set.
        self.watches: list[tuple[str, float]] = []
        self.watch_result: Report | None = None
        self.watch_released = asyncio.Event()

    def models(self, url: str) -> None:
        return None  # no model list read: the push names none

    def output_cap(self, url: str, incarnation: str | None) -> CapUnknown:
        return CapUnknown("not read", settled=False)  # no /server_info read

    def output_default(self, url: str, incarnation: str | None) -> None:
        return None  # nor the default it shows

    async def probe(self, target: Target) -> Report:
        self.probed.append(target)
        r = self.by_url.get(target.url, self.default)
        return dataclasses.replace(r, url=target.url)

    async def round(self, targets: list[Target], *, spread_s: float = 0.0,
                    fresh: Callable[[Target], Awaitable[Target | None]] | None = None,
                    on_report: Callable[[str, Report], None] | None = None,
                    ) -> dict[str, Report]:
        out: dict[str, Report] = {}
        for t in targets:  # one at a time, all at once: the spread is the watchdog's
            now = t if fresh is None else await fresh(t)
            if now is not None:
                out[now.url] = await self.probe(now)
                if on_report is not None:
                    on_report(now.url, out[now.url])
        return out

    async def watch_hedged(self, report: Report) -> Report | None:
        self.watches.append((report.url, report.held_flat_s))
        await self.watch_released.wait()
        return self.watch_result


class IdleSupervisor:
    def __init__(self) -> None:
        self.attempts: dict[int, Any] = {}
        self.engines: dict[int, Any] = {}

    def tick(self) -> None:
        pass

    def coming_back(self, i: int) -> bool:
        return False


def evidence_controller(r: Any, reads: ScriptedReads,
                        ledger_clock: Callable[[], float] = time.monotonic,
                        **health: Any) -> tuple[Controller, Ledger]:
    config = Config.model_validate({"health": {"confirm_interval_s": 0.01,
                                               "ejection_base_s": 0.3, **health}})
    h = config.health
    ledger = Ledger([e.url for e in r.engines],
                    Policy(ejection_base_s=h.ejection_base_s, ejection_max_s=h.ejection_max_s),
                    clock=ledger_clock)
    c = Controller(ledger, reads, IdleSupervisor(), [r.router.control()], config)  # type: ignore[arg-type]
    return c, ledger


BUSY_REPORT = report(Verdict.BUSY, Health.PROVEN)
STALLED_REPORT = report(Verdict.STALLED, Health.UNPROVEN)


async def failing_request(r: Any, bad: Any, attempts: int = 200) -> None:
    """Requests through the router until one fails on ``bad`` (and is re-sent elsewhere); at
    most ``attempts``."""
    before = r.router.stats.retries["paid"] + r.router.stats.retries["replaced"]
    for _ in range(attempts):
        status, _, _ = await r.post()
        assert status == 200
        if r.router.stats.retries["paid"] + r.router.stats.retries["replaced"] != before:
            return
    raise AssertionError(f"no request failed on {bad.url} in {attempts}")


async def test_a_failed_request_ejects_its_engine_before_any_tick() -> None:
    async with rig(2, health_managed=True) as r:
        _good, bad = r.engines
        reads = ScriptedReads(STALLED_REPORT)  # nothing proves it either way
        c, ledger = evidence_controller(r, reads)
        bad.answer_status(503)
        await failing_request(r, bad)
        await until(lambda: ledger.ejected() == [1], what="ejected by the event")
        assert c.tick_number == 0
        assert c.focus_started == {"ejected": 1}
        await until(lambda: any(t.url == bad.url for t in reads.probed), what="a focused read")
        # out of routing for failed requests: read at its health path too (a dead core)
        assert all(t.check_health for t in reads.probed if t.url == bad.url)
        await c.close()


async def test_an_ejected_engine_stays_out_of_every_push_while_its_evidence_stands() -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        reads = ScriptedReads(BUSY_REPORT)
        reads.by_url[bad.url] = STALLED_REPORT  # its reads prove nothing
        c, ledger = evidence_controller(r, reads)
        bad.answer_status(503)
        await failing_request(r, bad)
        await until(lambda: ledger.ejected() == [1], what="ejected")
        for _ in range(3):
            await read_and_tick(c)  # the heartbeat pushes every tick: it leaves the engine out
            assert r.router.serving_backends() == [good.url]
            assert ledger.state(1) is S
        await c.close()


async def test_an_answered_canary_puts_an_ejected_engine_on_trial_and_a_request_ends_it() -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        reads = ScriptedReads(BUSY_REPORT)
        # The ledger on a wall-clock time, as a fleet's is (its journal's), the controller on
        # the monotonic one: an ejection's time is read on the ledger's. The test moves it.
        wall = Clock(1.7e9)
        c, ledger = evidence_controller(r, reads, ledger_clock=wall)
        bad.answer_status(503)
        await failing_request(r, bad)
        await until(lambda: ledger.ejected() == [1], what="ejected")
        # Its focused reads show progress, well past the ejection's 0.3 s: no proof that its
        # generations complete (the trickle's engine steps too), so it stays out.
        def bad_reads() -> int:
            return sum(t.url == bad.url for t in reads.probed)
        await until(lambda: bad_reads() > 5, what="focused reads within its ejection")
        wall.advance(0.8)
        past = bad_reads()
        await until(lambda: bad_reads() > past + 5 or ledger.ejected() != [1],
                    what="focused reads past its ejection")
        seen = len(reads.probed)
        assert ledger.ejected() == [1] and not ledger.shard(1).on_trial
        assert r.router.serving_backends() == [good.url]
        # It goes idle: the next focused read asks for a canary, which answers: on trial.
        reads.by_url[bad.url] = report(Verdict.IDLE, Health.PROVEN, canary=True)
        await until(lambda: r.router.pool.trial == {bad.url}, what="on trial")
        assert set(r.router.serving_backends()) == {good.url, bad.url}
        assert any(t.url == bad.url and t.confirm for t in reads.probed[seen:])
        assert ledger.shard(1).on_trial
        bad.answer(None)  # it serves again
        answered = bad.answered
        while bad.answered == answered:  # its one trial request, among the others
            assert (await r.post())[0] == 200
        await read_and_tick(c)  # the window with its completed trial request
        assert not ledger.shard(1).on_trial and r.router.pool.trial == frozenset()
        await c.close()


async def test_a_window_drained_after_a_failed_probe_lifts_no_suspicion_it_may_predate(
) -> None:
    async with rig(2, health_managed=True) as r:
        _good, bad = r.engines
        reads = ScriptedReads(BUSY_REPORT)
        c, ledger = evidence_controller(r, reads)
        r.router.set_serving_backends([bad.url])
        assert (await r.post())[0] == 200  # completed there before its probe fails
        reads.by_url[bad.url] = report(Verdict.IDLE, Health.FAILING, canary=False)
        await read_and_tick(c)  # the round's failed canary, then the window with that completion
        assert ledger.state(1) is S
        # A completion in a window of its own, after the failure: that one lifts it.
        reads.by_url[bad.url] = STALLED_REPORT  # its reads prove nothing either way
        # The controller's own pushes put the good engine back beside it, and where a request
        # then goes is the policy's choice: sent until one is answered there (bounded).
        answered = bad.answered
        for _ in range(20):
            r.router.set_serving_backends([bad.url])
            assert (await r.post())[0] == 200
            if bad.answered > answered:
                break
        assert bad.answered > answered, "no request answered on the suspect engine"
        await read_and_tick(c)
        assert ledger.state(1) is H
        await c.close()


async def test_requests_held_on_an_engine_that_takes_no_step_are_hedged_and_it_stays_in(
) -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()
        reads = ScriptedReads(BUSY_REPORT)
        # Its reads: a request held 0.1 s while it took no step, under hedge_after_s.
        reads.by_url[bad.url] = dataclasses.replace(STALLED_REPORT, held_flat_s=0.1)
        c, ledger = evidence_controller(r, reads, hedge_after_s=0.2)
        r.router.set_serving_backends([bad.url])
        tasks = [asyncio.create_task(r.post()) for _ in range(3)]
        await until(lambda: bad.held == 3, what="3 held on the engine")
        r.router.set_serving_backends([good.url, bad.url])
        c.confirm(1, "silent requests")
        await until(lambda: sum(t.url == bad.url for t in reads.probed) >= 3, what="reads")
        # Nor within a pause it was seen to come back from (its cadence): 0.5 s held with no
        # step, but it once paused 0.8 s and went on.
        reads.by_url[bad.url] = dataclasses.replace(STALLED_REPORT, held_flat_s=0.5,
                                                    longest_pause_s=0.8)
        seen = len(reads.probed)
        await until(lambda: len(reads.probed) >= seen + 3, what="more reads")
        assert r.router.stats.hedges == 0
        reads.by_url[bad.url] = dataclasses.replace(STALLED_REPORT, held_flat_s=0.5)
        assert [(await t)[0] for t in tasks] == [200] * 3  # the other engine's answers
        assert good.answered == 3 and r.router.stats.hedges_won == 3
        await until(lambda: bad.cancelled == 3, what="the held ones cancelled")
        # Each lost the race: out of the router's list until the next push (no new request
        # waits there meanwhile), but not ejected: a long step looks the same until it ends,
        # and only the stall limit condemns.
        assert r.router.serving_backends() == [good.url]
        assert ledger.ejected() == [] and ledger.state(1) is H
        await c.close()


async def held_and_accused(r: Any, c: Controller, shard: int, n: int
                           ) -> list[asyncio.Task[tuple[int, object, bytes]]]:
    """``n`` requests sent while engine ``shard`` alone serves, held there (it is wedged);
    then every engine serves again, and the controller accuses it of silent requests."""
    engine = r.engines[shard]
    r.router.set_serving_backends([engine.url])
    tasks = [asyncio.create_task(r.post()) for _ in range(n)]
    await until(lambda: engine.held == n, what=f"{n} held on the engine")
    r.router.set_serving_backends([e.url for e in r.engines])
    c.confirm(shard, "silent requests")
    return tasks


class SilentReads(ScriptedReads):
    """A silent engine's reads: its first concludes at once, each later one waits (as a
    silence read waits out ``silence_read_s``) until the test sets ``released``."""

    def __init__(self, default: Report, silent_url: str) -> None:
        super().__init__(default)
        self.silent_url = silent_url
        self.released = asyncio.Event()

    def waiting(self) -> int:
        return max(0, sum(t.url == self.silent_url for t in self.probed) - 1)

    async def probe(self, target: Target) -> Report:
        if target.url == self.silent_url and any(t.url == target.url for t in self.probed):
            self.probed.append(target)
            await self.released.wait()
            return dataclasses.replace(self.by_url[target.url], url=target.url)
        return await super().probe(target)


async def test_a_silent_engines_request_is_hedged_as_it_reaches_hedge_after_s_not_a_read_later(
) -> None:
    """A request sent just before its engine went silent is held there under hedge_after_s at
    the read that finds the silence: it is hedged when it reaches hedge_after_s, while the
    next read still waits out its silence, not when that read ends (a wedge's next read
    answers at once and hedges it then)."""
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()  # answers no request, as a SIGSTOPped engine
        reads = SilentReads(BUSY_REPORT, bad.url)
        reads.by_url[bad.url] = dataclasses.replace(report(Verdict.SILENT, Health.UNPROVEN),
                                                    held_flat_s=0.5)
        c, _ = evidence_controller(r, reads, hedge_after_s=0.2)
        tasks = await held_and_accused(r, c, 1, 1)  # held milliseconds at the first read
        await until(lambda: r.router.stats.hedges_won == 1, what="hedged, and answered")
        assert [(await t)[0] for t in tasks] == [200] and good.answered == 1
        assert reads.waiting() == 1 and not reads.released.is_set()  # the next read waits on
        reads.released.set()
        await c.close()


async def test_a_long_step_that_outlasts_hedge_after_s_costs_its_engine_nothing() -> None:
    """A healthy engine's first long prefill step (no pause learned yet, so hedged at
    hedge_after_s): its held requests are answered by their hedges, and when the step ends
    it is routed again at the next push, never ejected, never suspected."""
    async with rig(2, health_managed=True) as r:
        good, slow = r.engines
        slow.wedge()  # the long step: nothing advances
        reads = ScriptedReads(BUSY_REPORT)
        reads.by_url[slow.url] = dataclasses.replace(STALLED_REPORT, held_flat_s=0.5)
        c, ledger = evidence_controller(r, reads, hedge_after_s=0.2)
        moves: list[Any] = []
        ledger.subscribe(moves.append)
        tasks = await held_and_accused(r, c, 1, 2)
        assert [(await t)[0] for t in tasks] == [200] * 2
        assert r.router.stats.hedges_won == 2
        slow.unwedge()  # the step ends
        reads.by_url[slow.url] = BUSY_REPORT
        await read_and_tick(c)
        # routed again once a read shows the step ended (held back until then)
        await until(lambda: set(r.router.serving_backends()) == {good.url, slow.url},
                    what="routed again")
        assert ledger.state(1) is H and ledger.ejected() == []
        assert not [t for t in moves if t.shard == 1 and t.event in (Event.EJECTED,
                                                                     Event.FAILURE)]
        await c.close()


async def test_an_engine_whose_held_requests_were_hedged_is_in_no_push_until_it_steps(
) -> None:
    """A hedge that wins drops its engine from that router's list only until the next push,
    and the tick's heartbeat put a wedge back in routing: a request sent there then waited for
    the stall limit's condemnation and a generation elsewhere (+7.3 s after the wedge, at 3
    and at 256 engines). The controller leaves it out of every push while its reads show no
    step, with nothing told to the ledger; the first read that shows one routes it again."""
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()
        reads = ScriptedReads(BUSY_REPORT)
        reads.by_url[bad.url] = dataclasses.replace(STALLED_REPORT, held_flat_s=0.5)
        c, ledger = evidence_controller(r, reads, hedge_after_s=0.2)
        tasks = await held_and_accused(r, c, 1, 2)
        assert [(await t)[0] for t in tasks] == [200] * 2
        await until(lambda: bad.held == 0, what="the held ones cancelled")
        await read_and_tick(c)  # the heartbeat's push
        assert r.router.serving_backends() == [good.url]
        before = good.answered
        for _ in range(4):
            assert (await r.post())[0] == 200
        assert good.answered == before + 4 and bad.held == 0  # none waits on the wedge
        assert ledger.state(1) is H and ledger.ejected() == []  # and it is no failure
        bad.unwedge()  # its step ends: the next read shows it
        reads.by_url[bad.url] = BUSY_REPORT
        await until(lambda: set(r.router.serving_backends()) == {good.url, bad.url},
                    what="routed again at the read that shows a step")
        await read_and_tick(c)
        assert set(r.router.serving_backends()) == {good.url, bad.url}
        await c.close()


@pytest.mark.parametrize("canary_answers", [False, True])
async def test_a_lost_cores_held_requests_are_hedged_and_a_canary_sent_with_them_keeps_watch(
        canary_answers: bool) -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()
        reads = ScriptedReads(BUSY_REPORT)
        # No work in its gauges, a request held 0.5 s with no step: a lost core.
        reads.by_url[bad.url] = dataclasses.replace(
            report(Verdict.LOST_CORE, Health.UNPROVEN), held_flat_s=0.5)
        c, ledger = evidence_controller(r, reads, hedge_after_s=0.2)
        seen_transitions: list[Any] = []
        ledger.subscribe(seen_transitions.append)
        tasks = await held_and_accused(r, c, 1, 3)
        # Its requests are answered by the other engine (hedged away, they will never reach
        # the stall limit there); one canary, sent with the first hedges, keeps the watch.
        assert [(await t)[0] for t in tasks] == [200] * 3
        assert good.answered == 3 and r.router.stats.hedges_won == 3
        await until(lambda: bad.cancelled == 3, what="the held ones cancelled")
        # No work in its gauges is no proof that no step runs (real vLLM writes its gauges at
        # a step's end: a long first step reads idle): the lost races cost it nothing, and the
        # canary decides.
        assert reads.watches == [(bad.url, 0.5)]
        assert ledger.ejected() == [] and ledger.state(1) is H
        assert not [t for t in seen_transitions if t.shard == 1 and t.event in (
            Event.EJECTED, Event.FAILURE)]
        # The focused reads go on while the canary waits, and send no second one.
        seen = len(reads.probed)
        await until(lambda: len(reads.probed) >= seen + 3, what="reads while it waits")
        assert len(reads.watches) == 1
        # Held out of every push while the canary watches (a tick's push included), with no
        # verdict: the ledger still calls it HEALTHY.
        await read_and_tick(c)
        assert r.router.serving_backends() == [good.url]
        assert ledger.state(1) is H and ledger.serving_urls() == [good.url, bad.url]
        if not canary_answers:  # the watch concludes (an answer concludes nothing)
            lost = reads.by_url[bad.url]
            reads.watch_result = dataclasses.replace(
                lost, url=bad.url, health=Health.CONDEMNED,
                canary=CanaryResult(False, 4.5, None, "no answer"),
                evidence=dataclasses.replace(lost.evidence, summary="the canary sent with the "
                                             "hedges got no answer"))
        reads.watch_released.set()
        if canary_answers:  # not a wedge: routed again at once, never ejected
            await until(lambda: bad.url in r.router.serving_backends(), what="pushed again")
            assert ledger.state(1) is H and ledger.ejected() == []
        else:
            await until(lambda: ledger.state(1) is D, what="condemned by the canary")
            assert "got no answer" in seen_transitions[-1].cause
        await c.close()


async def test_a_hold_lasts_at_most_the_stall_floor_while_the_watch_goes_on() -> None:
    """Held out as long as the stall limit, a healthy engine in a long step its cadence allows
    would be kept from serving as long as a wedge: a hold ends at the floor, with a push, even
    while the canary still watches; and it is not taken again for the same accusation."""
    async with rig(2, health_managed=True) as r:
        _, bad = r.engines
        bad.wedge()
        reads = ScriptedReads(BUSY_REPORT)
        reads.by_url[bad.url] = dataclasses.replace(
            report(Verdict.LOST_CORE, Health.UNPROVEN), held_flat_s=0.5)
        c, ledger = evidence_controller(r, reads, hedge_after_s=0.2, stall_s=0.3)
        tasks = await held_and_accused(r, c, 1, 3)
        assert [(await t)[0] for t in tasks] == [200] * 3
        await until(lambda: reads.watches != [], what="the watch began")
        # The floor passed: routed again, the watch still waiting, nothing concluded.
        await until(lambda: bad.url in r.router.serving_backends(), what="pushed again")
        assert len(reads.watches) == 1 and ledger.state(1) is H
        seen = len(reads.probed)
        await until(lambda: len(reads.probed) >= seen + 5, what="reads after the hold")
        await read_and_tick(c)
        assert bad.url in r.router.serving_backends()  # not held again: its reads go on
        reads.watch_released.set()
        await c.close()


async def test_a_condemnation_reaches_the_routers_through_the_ledger_alone() -> None:
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()
        reads = ScriptedReads(BUSY_REPORT)
        c, ledger = evidence_controller(r, reads)
        tasks = [asyncio.create_task(r.post()) for _ in range(4)]
        await until(lambda: good.answered + bad.held == 4, what="all 4 placed")
        parked = bad.held
        ledger.condemn(1, "engine process exited with code -9")  # as the supervisor does
        assert [(await t)[0] for t in tasks] == [200] * 4  # rescued
        assert r.router.serving_backends() == [good.url]
        assert r.router.stats.rescues == parked and c.tick_number == 0
        await c.close()


class _SlowLink(InProcessRouter):
    """A router link whose rescue takes a while, as a call to a router process does: it
    answers when the test sets ``answer``."""

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def rescue(self, url: str, *, streams: bool = True) -> int:
        self.asked.set()
        await self.answer.wait()
        return await super().rescue(url, streams=streams)


class _RecordingLauncher(_NoLauncher):
    """Records, as each engine is stopped, how many requests the router had rescued."""

    def __init__(self, rescues: Any) -> None:
        self.rescues = rescues
        self.stopped: list[tuple[str, int]] = []

    async def stop(self, handle: EngineHandle) -> None:
        self.stopped.append((handle.url, self.rescues()))


async def test_a_condemned_engine_is_stopped_only_after_its_requests_were_moved() -> None:
    # Stopped first, a wedged vLLM is let go into its shutdown and answers what it held 200
    # with finish_reason "abort": truncated answers, passed on as successes (CI's real tier).
    async with rig(2, health_managed=True) as r:
        good, bad = r.engines
        bad.wedge()
        config = Config.model_validate({})
        ledger = Ledger([e.url for e in r.engines])
        launcher = _RecordingLauncher(lambda: r.router.stats.rescues)
        supervisor = Supervisor(ledger, launcher, config.fleet, config.supervisor)
        supervisor.adopt(1, EngineHandle(1, bad.url, "launch-1"))
        link = _SlowLink(r.router)
        c = Controller(ledger, ScriptedReads(BUSY_REPORT), supervisor, [link], config)  # type: ignore[list-item]
        tasks = [asyncio.create_task(r.post()) for _ in range(4)]
        await until(lambda: good.answered + bad.held == 4, what="all 4 placed")
        parked = bad.held
        ledger.condemn(1, "LOST_CORE: idle and flat, with requests in flight")
        await link.asked.wait()
        for _ in range(20):  # turns of the loop in which a stop that did not wait would come
            await asyncio.sleep(0)
        assert launcher.stopped == []
        link.answer.set()
        await until(lambda: launcher.stopped != [], what="the old engine stopped")
        assert launcher.stopped == [(bad.url, parked)]  # moved before the stop, not by it
        assert [(await t)[0] for t in tasks] == [200] * 4
        await supervisor.close()
        await c.close()


def evidence_polls_taken_in(router: Router) -> list[int]:
    """Each evidence poll as the router's control API takes it in (its count fixed): the
    list grows by one per poll."""
    wait, opened = router.feed.wait, []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        opened.append(len(opened))
        return await wait(*args, **kwargs)

    router.feed.wait = counted  # type: ignore[method-assign]
    return opened


@contextlib.asynccontextmanager
async def across_processes(r: Any) -> Any:
    """A controller driving the rig's router over its control API, as `fleetwarden up` drives
    its router processes, running its loop with a tick a minute apart."""
    assert r.router.control_url is not None
    config = Config.model_validate({"health": {"probe_interval_s": 60, "silent_after_s": 0.3,
                                               "confirm_interval_s": 0.01}})
    ledger = Ledger([e.url for e in r.engines])
    opened = evidence_polls_taken_in(r.router)
    async with RemoteRouter(r.router.control_url, "t0ken") as remote:
        c = Controller(ledger, ScriptedReads(BUSY_REPORT), IdleSupervisor(), [remote],  # type: ignore[arg-type]
                       config)
        stop = asyncio.Event()
        loop = asyncio.create_task(c.run(stop))
        try:
            await until(lambda: c.tick_number == 1, what="the first tick")
            # A failure before the first poll reaches the router is counted before it (the
            # poll counts from the router's count as it arrives): start once it is open.
            await until(lambda: opened != [], what="the long poll open")
            yield c, ledger
        finally:
            stop.set()
            await loop
            await c.close()


class HangingReads(ScriptedReads):
    """Reads that hang until ``release`` is set: an engine that takes its time to answer."""

    def __init__(self, default: Report) -> None:
        super().__init__(default)
        self.release = asyncio.Event()
        self.hanging = 0

    async def round(self, targets: list[Target], *, spread_s: float = 0.0,
                    fresh: Callable[[Target], Awaitable[Target | None]] | None = None,
                    on_report: Callable[[str, Report], None] | None = None,
                    ) -> dict[str, Report]:
        self.hanging += 1
        await self.release.wait()
        return await super().round(targets, spread_s=spread_s, fresh=fresh,
                                   on_report=on_report)


async def test_the_running_tick_waits_for_no_engine_read() -> None:
    """In the running fleet each engine is read on its own schedule beside the tick: reads
    that hang hold no tick (its supervisor, drain and push go on), and what they decide when
    they come goes into the next tick's report."""
    async with rig(2, health_managed=True) as r:
        reads = HangingReads(BUSY_REPORT)
        c, _ledger = evidence_controller(r, reads, probe_interval_s=0.05)
        ticks: list[TickReport] = []
        c.on_tick = ticks.append
        stop = asyncio.Event()
        loop = asyncio.create_task(c.run(stop))
        try:
            await until(lambda: c.tick_number >= 3 and reads.hanging >= 1,
                        what="ticks while the reads hang")
            assert not any(t.verdicts for t in ticks)
            reads.release.set()
            await until(lambda: any(t.verdicts == {0: "BUSY", 1: "BUSY"} for t in ticks),
                        what="the reads in a later tick's report")
        finally:
            stop.set()
            reads.release.set()
            await loop
            await c.close()


async def test_a_router_in_another_process_reports_a_failure_before_the_next_tick() -> None:
    async with rig(2, health_managed=True, control_token="t0ken") as r, \
            across_processes(r) as (c, ledger):
        _good, bad = r.engines
        ejected: list[int] = []  # the tick number at each ejection
        ledger.subscribe(lambda t: ejected.append(c.tick_number)
                         if t.event is Event.EJECTED else None)
        bad.answer_status(503)
        await failing_request(r, bad)
        await until(lambda: ejected == [1], what="ejected by the evidence, before tick 2")
        assert c.focus_started.get("ejected") == 1


async def test_a_router_in_another_process_reports_a_silent_request_before_the_next_tick(
) -> None:
    async with rig(2, health_managed=True, control_token="t0ken") as r, \
            across_processes(r) as (c, _):
        _good, bad = r.engines
        bad.wedge()
        # One lands on each: two prompts (one prompt twice at once is an RL group's pair,
        # which cache-aware routing keeps on one engine).
        held = [asyncio.create_task(r.post(payload={"model": "tiny", "prompt": p,
                                                    "max_tokens": 8}))
                for p in ("hello", "world")]
        await until(lambda: c.focus_started.get("silent requests", 0) >= 1,
                    what="accused for a request silent 0.3 s")
        assert c.tick_number == 1
        bad.unwedge()
        assert [(await t)[0] for t in held] == [200, 200]


class _HoldingRouter(_Router):
    """A router holding requests that got nothing: ``holding`` gives their ages."""

    def __init__(self, held: dict[str, float]) -> None:
        super().__init__()
        self.held = held

    async def holding(self, silent_after_s: float = 0.0) -> Holding:
        return Holding({}, {url: age for url, age in self.held.items() if age >= silent_after_s})


class _TargetsWatchdog(_Watchdog):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[Target] = []

    async def round(self, targets: Iterable[Target], **kwargs: Any) -> dict[str, Report]:
        self.targets += list(targets)
        return await super().round(targets, **kwargs)


async def test_every_read_is_told_how_long_the_routers_have_held_a_request_there() -> None:
    # The oldest request any router holds on an engine, silent: what judge.held_its_requests
    # weighs against the engine's flat counters.
    config = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"], Policy())
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    watchdog = _TargetsWatchdog()
    routers = [_HoldingRouter({"http://a": 2.5}), _HoldingRouter({"http://a": 4.0}), _Router()]
    c = Controller(ledger, watchdog, supervisor, routers, config)
    try:
        await read_and_tick(c)
    finally:
        await c.close()
        await supervisor.close()
    held = {t.url: t.held_s for t in watchdog.targets}
    assert held == {"http://a": 4.0, "http://b": 0.0}


async def test_a_lease_keeps_a_participants_status_while_it_is_under_focused_reads() -> None:
    """The tick leaves a shard under focused reads to them: the lease's status of that
    participant must come from those reads, not stay at the last tick's."""
    config = Config.model_validate({"fleet": {"weights": "trainer"},
                                    "health": {"confirm_interval_s": 0.01}})
    ledger = Ledger(["http://a", "http://b"], Policy(weights="trainer"))
    refit = RefitCoordinator(ledger)
    reads = ScriptedReads(BUSY_REPORT)
    c = Controller(ledger, reads, IdleSupervisor(), [], config,  # type: ignore[arg-type]
                   refit=refit)
    lease = refit.begin_refit(1)
    await read_and_tick(c)
    assert lease.status[1].api_answers is True
    reads.by_url["http://b"] = report(Verdict.UNREACHABLE, Health.FAILING)
    c.confirm(1, "silent requests")
    await until(lambda: lease.status[1].culprit, what="the focused reads on the lease")
    assert lease.status[1].api_answers is False or not lease.status[1].process_alive
    assert "UNREACHABLE" in lease.status[1].evidence or ledger.state(1) is D
    assert [s.shard for s in lease.culprits()] == [1]
    await c.close()


@pytest.mark.parametrize("panic_threshold_percent", [50.0, 0.0])
async def test_with_every_engine_ejected_the_router_serves_through_the_panic_threshold(
        panic_threshold_percent: float) -> None:
    """Both engines ejected for one failed request each (two different 5xx: no poison), and
    both answer again. Below the panic threshold the ledger pushes them both back (Envoy's
    rule), so clients are answered; with panic off they get 409s until proof comes."""
    # comeback_wait_s: how long a request waits for a backend before its 409; the default
    # (5 s) made this test wait 20 s for its four 409s
    async with rig(2, health_managed=True, max_retries=1, comeback_wait_s=0.05) as r:
        a, b = r.engines
        reads = ScriptedReads(STALLED_REPORT)  # nothing proves them either way
        config = Config.model_validate({"health": {
            "confirm_interval_s": 0.01, "panic_threshold_percent": panic_threshold_percent}})
        ledger = Ledger([e.url for e in r.engines],
                        Policy(panic_threshold_percent=panic_threshold_percent))
        c = Controller(ledger, reads, IdleSupervisor(), [r.router.control()],  # type: ignore[arg-type]
                       config)
        a.answer_status(503)
        b.answer_status(502)
        assert (await r.post())[0] in (502, 503)
        await until(lambda: ledger.ejected() == [0, 1], what="both ejected")
        a.answer(None)
        b.answer(None)
        await read_and_tick(c)
        statuses = [(await r.post())[0] for _ in range(4)]
        if panic_threshold_percent:
            assert ledger.panicking() and set(r.router.serving_backends()) == {a.url, b.url}
            assert statuses == [200] * 4
        else:
            assert r.router.serving_backends() == [] and statuses == [409] * 4
        await c.close()


# ------------------------------------- the controller's measure of its own work (workmeter.py)


def _idle(url: str) -> Report:
    return Report(url, Verdict.IDLE, Evidence("idle"), Health.PROVEN, CanaryRule.NEVER,
                  None, None, None, None)


class _Reads(Watchdog):
    async def probe(self, target: Target) -> Report:
        await asyncio.sleep(0)
        return _idle(target.url)


async def test_the_controller_measures_its_tick_round_decisions_and_push() -> None:
    config = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b", "http://c"])
    router = _Router()
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, _Reads(), supervisor, [router], config)
    await read_and_tick(c)
    await read_and_tick(c)
    m = c.meter
    assert m.tick.count == 2 and m.read_round.count == 2 and m.reads == 6
    assert m.evidence_to_decision.count == 6  # one decision per read
    assert m.push.count >= 2 and m.push_size.largest == 3
    await c.close()


class _CondemnsFirst(Watchdog):
    """One reader: engine a's read condemns it; engine b's read looks at the ledger first."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(concurrency=1)
        self.ledger = ledger
        self.a_out_when_b_read: bool | None = None

    async def probe(self, target: Target) -> Report:
        await asyncio.sleep(0)
        if target.url == "http://a":
            return Report(target.url, Verdict.STUCK, Evidence("stuck"), Health.CONDEMNED,
                          CanaryRule.NEVER, None, None, None, None)
        self.a_out_when_b_read = self.ledger.state(0) in (D, ShardState.RESTARTING)
        return _idle(target.url)


async def test_a_read_is_decided_on_as_it_finishes_not_at_the_rounds_end() -> None:
    config = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"])
    watchdog = _CondemnsFirst(ledger)
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, watchdog, supervisor, [_Router()], config)
    report = await read_and_tick(c)
    assert watchdog.a_out_when_b_read is True  # condemned before the round went on to b
    assert ledger.state(0) in (D, ShardState.RESTARTING)
    assert report.verdicts == {0: "STUCK", 1: "IDLE"}
    assert c.meter.evidence_to_decision.count == 2
    await c.close()


def test_the_push_carries_each_backends_incarnation_so_a_router_sees_a_restart() -> None:
    from fleetwarden.router.pool import BackendFacts

    c, ledger, _ = controller("static")
    ledger.observe_incarnation(1, "1.5")
    before = c.serving_push()[1]["http://b"]
    assert before == BackendFacts(1, ledger.shard(1).weight_version, incarnation="1.5",
                                  completion_default=CompletionDefault.UNKNOWN)
    ledger.observe_incarnation(1, "2.5")  # a silent restart
    assert c.serving_push()[1]["http://b"].incarnation == "2.5"


class _FirstCanaryTimesOut(Watchdog):
    """Engine a's first visit: idle, and its canary got no answer (a loaded machine's first
    generation); every later visit of a: idle, its canary answered. b: idle."""

    def __init__(self) -> None:
        super().__init__()
        self.visits: list[Target] = []

    async def probe(self, target: Target) -> Report:
        await asyncio.sleep(0)
        if target.url != "http://a":
            return _idle(target.url)
        self.visits.append(target)
        first = len(self.visits) == 1
        return Report(target.url, Verdict.IDLE, Evidence("idle"),
                      Health.FAILING if first else Health.PROVEN, CanaryRule.NEVER, None, None,
                      CanaryResult(not first, 5.0 if first else 0.1,
                                   None if first else 200, "timed out" if first else ""),
                      None)


async def test_a_read_that_leaves_an_engine_in_doubt_is_followed_by_reads_that_settle_it() -> None:
    """A round's read that makes an engine SUSPECT is followed by focused reads, each with a
    canary while it is idle, until healthy_threshold good ones lift it: the round itself
    comes back to it once per round, a minute or more at a thousand engines."""
    config = Config.model_validate({"health": {"confirm_interval_s": 0.01}})
    ledger = Ledger(["http://a", "http://b"])
    watchdog = _FirstCanaryTimesOut()
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, watchdog, supervisor, [_Router()], config)
    await read_and_tick(c)  # its round: a's canary timed out
    assert ledger.state(0) is S
    focus = c.focus.running.get(0)
    assert focus is not None, "no read follows until the next round"
    await asyncio.wait_for(focus, 30.0)  # a bound, not a timing claim
    assert ledger.state(0) is H
    # two good reads after the failed one (healthy_threshold), each asking for a canary
    assert len(watchdog.visits) == 1 + ledger.policy.healthy_threshold
    assert all(t.confirm for t in watchdog.visits[1:])
    await c.close()


def test_a_lost_core_is_held_out_of_pushes_unless_it_is_all_there_is() -> None:
    assert never_empty(["a", "b", "c"], {"b"}) == ["a", "c"]
    assert never_empty(["a", "b"], {"a", "b"}) == ["a", "b"]  # none left: all still serve
    assert never_empty(["a"], {"a"}) == ["a"]
    assert never_empty([], {"a"}) == []
    assert never_empty(["a", "b"], {"z"}) == ["a", "b"]  # a URL no longer serving


# ---------------------------------------------------------------------- the status headline

def test_every_state_is_counted_once_as_serving_coming_back_or_out() -> None:
    from fleetwarden.ledger import COMING_BACK, OUT, ROUTABLE, tally

    assert set(ShardState) == ROUTABLE | COMING_BACK | OUT
    assert not (ROUTABLE & COMING_BACK or ROUTABLE & OUT or COMING_BACK & OUT)
    assert tally(ShardState) == {"serving": 2, "coming_back": 4, "out": 1}


@pytest.mark.parametrize("states, state, detail", [
    ("HH", "serving", "all 2 shards serve"),
    ("HS", "serving", "all 2 shards serve"),  # SUSPECT still serves
    ("HR", "degraded", "1 of 2 shards serve; 1 coming back"),
    ("HDT", "degraded", "1 of 3 shards serve; 2 coming back"),
    ("HX", "degraded", "1 of 2 shards serve; 1 out"),
    ("RZ", "asleep", "no shard serves; 2 coming back (1 asleep: none serves until one wakes)"),
    ("RD", "down", "no shard serves; 2 coming back"),
    ("XX", "exhausted", "0 of 2 shards can still serve; min_serving_shards is 1"),
])
def test_the_headline_counts_the_shards_it_is_given(states: str, state: str,
                                                    detail: str) -> None:
    from fleetwarden.controller import fleet_status
    from fleetwarden.ledger import ShardRecord

    names = {"H": ShardState.HEALTHY, "S": ShardState.SUSPECT, "T": ShardState.STALE,
             "D": ShardState.DEAD, "R": ShardState.RESTARTING, "X": ShardState.RETIRED,
             "Z": ShardState.SLEEPING}
    shards = [ShardRecord(i, f"http://127.0.0.1:{9000 + i}", names[c])
              for i, c in enumerate(states)]
    status = fleet_status(shards, min_serving_shards=1)
    assert (status.state, status.detail) == (state, detail)
    assert sum(status.tally.values()) == len(shards) == sum(status.counts.values())
    if state == "serving":  # a journal that fails degrades a fleet that serves
        journal = fleet_status(shards, 1, "; the journal fails (disk full)")
        assert journal.state == "degraded" and journal.detail.endswith("(disk full)")


async def test_focused_reads_of_a_sleeping_engine_send_it_no_canary() -> None:
    """An engine the ledger holds asleep is never canaried nor judged stuck, by the round
    (``_target``) or by the focused reads an accusation starts: a canary to an engine in
    vLLM's sleep mode waits until it wakes, and a stall while asleep is no fault."""
    config = Config.model_validate({"fleet": {"weights": "trainer"},
                                    "health": {"confirm_interval_s": 0.01}})
    ledger = Ledger(["http://a", "http://b"], Policy(weights="trainer"))
    reads = ScriptedReads(BUSY_REPORT)
    c = Controller(ledger, reads, IdleSupervisor(), [], config)  # type: ignore[arg-type]
    ledger.report_asleep(1, "the trainer put it to sleep", held=True)
    reads.by_url["http://b"] = report(Verdict.SLEEPING, Health.UNPROVEN)
    c.confirm(1, "silent requests")
    focus = c.focus.running.get(1)
    assert focus is not None
    await until(lambda: any(t.url == "http://b" for t in reads.probed), what="a focused read")
    await c.close()
    read = next(t for t in reads.probed if t.url == "http://b")
    assert not read.confirm and read.stalls_excused


# ---------------------------------------------------------------------- a comeback


async def test_a_new_process_is_proven_by_one_canary_at_once_and_routed() -> None:
    """A replacement that answers is read (and canaried, being idle) the moment the ledger
    loads it, not at the round's next read of it: with static weights, HEALTHY and pushed
    within the same turn of focused reads. Meanwhile it counts as coming back in the push."""
    async with rig(2, health_managed=True) as r:
        good, back = r.engines
        reads = ScriptedReads(report(Verdict.RESTARTED, Health.PROVEN, canary=True))
        c, ledger = evidence_controller(r, reads)
        ledger.condemn(1, "engine process exited with code -9")
        ledger.mark_restarting(1)
        assert c.pushes.coming_back() == 0  # an idle double of a supervisor: nothing it restarts
        ledger.mark_loaded(1, back.url, "2.0")
        assert ledger.state(1) is ST and c.pushes.coming_back() == 1  # one canary away
        await until(lambda: ledger.state(1) is H, what="proven by its canary")
        assert c.focus_started.get("comeback") == 1
        assert reads.probed[0].url == back.url and reads.probed[0].confirm
        await until(lambda: set(r.router.serving_backends()) == {good.url, back.url},
                    what="pushed back into routing")
        assert c.pushes.coming_back() == 0
        await c.close()


async def test_a_trainer_fleets_new_process_stays_stale_until_its_refit() -> None:
    """``--weights trainer``: its canary proves the process, never its weights; it is not
    counted as coming back either (a refit nobody can time)."""
    async with rig(2, health_managed=True) as r:
        reads = ScriptedReads(report(Verdict.RESTARTED, Health.PROVEN, canary=True))
        config = Config.model_validate({"health": {"confirm_interval_s": 0.01}})
        ledger = Ledger([e.url for e in r.engines], Policy(weights="trainer"))
        c = Controller(ledger, reads, IdleSupervisor(), [r.router.control()], config)  # type: ignore[arg-type]
        ledger.condemn(1, "engine process exited with code -9")
        ledger.mark_restarting(1)
        ledger.mark_loaded(1, r.engines[1].url, "2.0")
        await until(lambda: len(reads.probed) >= 2, what="its focused reads")
        assert ledger.state(1) is ST and c.pushes.coming_back() == 0
        await c.close()


def test_a_serving_engine_held_or_ejected_out_of_the_push_counts_as_coming_back() -> None:
    """A held or ejected engine is on its way back (a proof, its time, or the never-empty rule
    and the panic threshold once the others fail): a router whose last engine fails meanwhile
    waits for the push that brings it, instead of a 409 at once."""
    from fleetwarden.ledger import HoldCause

    urls = ["http://a", "http://b", "http://c"]
    ledger = Ledger(urls, Policy())
    c = Controller(ledger, ScriptedReads(BUSY_REPORT), IdleSupervisor(), [], Config())  # type: ignore[arg-type]
    assert c.pushes.coming_back() == 0 and c.pushes.serving() == urls
    ledger.admission.hold("http://a", HoldCause.STALLED, 30.0)
    assert c.pushes.serving() == ["http://b", "http://c"]
    assert c.pushes.coming_back() == 1  # held: no verdict, a push away
    ledger.report_outcomes(1, 0, 3, 3)
    assert ledger.ejected() == [1] and c.pushes.serving() == ["http://c"]
    assert c.pushes.coming_back() == 2  # ejected too: back on proof after its time


def test_the_push_carries_the_server_cap_an_engine_command_sets() -> None:
    """vLLM's ``--override-generation-config '{"max_new_tokens": N}'`` caps every request and no
    endpoint tells it: the push says it, from the command, before any finish could reveal it
    (a continuation asks no more than the cap less what was produced)."""
    from fleetwarden.router.pool import BackendFacts

    command = ("vllm serve m --port {port} --override-generation-config "
               "'{{\"max_new_tokens\": 64}}'")
    config = Config.model_validate({"fleet": {"engine_cmd": command, "groups": [
        {"engines": 1, "engine_cmd": "vllm serve m --port {port}"}]}})
    ledger = Ledger(["http://a", "http://b", "http://c"], Policy())
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, _Watchdog(), supervisor, [], config,
                   refit=RefitCoordinator(ledger))
    facts = c.serving_push()[1]
    assert [facts[u].output_cap for u in ("http://a", "http://b", "http://c")] == [64, 64, None]
    # the override's max_new_tokens is also the default of a chat that names none
    assert facts["http://a"] == BackendFacts(0, ledger.shard(0).weight_version, output_cap=64,
                                             output_default=64,
                                             completion_default=CompletionDefault.UNKNOWN)


def test_the_push_carries_the_default_limit_of_a_launched_engines_model_folder(
        tmp_path: Path) -> None:
    """A launched engine's model folder is on this host: its ``generation_config.json``
    ``max_new_tokens`` is the default limit of a chat that names none (vLLM's
    ``--generation-config auto``), pushed apart from the cap on every request; ignored under
    ``--generation-config vllm``; an attached engine's comes only from its ``/server_info``
    (docs/design.md 4.1)."""
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 48}')
    config = Config.model_validate({"fleet": {
        "engines": 1, "engine_cmd": f"vllm serve {tmp_path} --port {{port}}",
        "backends": ["http://x"],
        "groups": [{"engines": 1, "engine_cmd": f"vllm serve {tmp_path} --port {{port}} "
                                                "--generation-config vllm"}]}})
    ledger = Ledger(["http://a", "http://b", "http://x"], Policy())
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, _Watchdog(), supervisor, [], config, refit=RefitCoordinator(ledger))
    facts = c.serving_push()[1]
    assert [(f.output_cap, f.output_default) for f in facts.values()] == [
        (None, 48), (None, None), (None, None)]
    assert facts["http://a"].to_dict()["output_default"] == 48


def test_the_push_carries_the_cap_an_engine_says_else_the_declared_else_the_commands(
        caplog: pytest.LogCaptureFixture) -> None:
    """An attached engine's command is not fleetwarden's: its cap comes from its own
    ``GET /server_info`` (vLLM's dev mode), else from its ``[[fleet.backends]]`` table; where
    neither says, it is unknown: said once per process in the log and on its status row, and
    pushed as unknown, with why (docs/design.md 4.1)."""
    command = ("vllm serve m --port {port} --override-generation-config "
               "'{{\"max_new_tokens\": 64}}'")
    backends = ["http://said", "http://declared", "http://silent", "http://none"]
    config = Config.model_validate({"fleet": {"engines": 2, "engine_cmd": command, "backends": [
        backends[0], {"url": backends[1], "output_cap": 32}, backends[2],
        {"url": backends[3], "output_cap": "none"}]}})
    urls = ["http://l0", "http://l1", *backends]
    ledger = Ledger(urls, Policy())
    watchdog = _Watchdog()
    said: dict[str, int | CapUnknown | None] = {
        "http://l0": 100, "http://said": 120, "http://declared": 16,
        "http://silent": CapUnknown("no GET /server_info"),
        "http://none": CapUnknown("no GET /server_info")}
    watchdog.output_cap = (  # type: ignore[method-assign]
        lambda url, incarnation: said.get(url, CapUnknown("not read", settled=False)))
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, watchdog, supervisor, [], config, refit=RefitCoordinator(ledger))
    assert [c.pushes.output_cap(ledger.shard(i)) for i in range(len(urls))] == [
        (100, "engine"), (64, "command"), (120, "engine"), (16, "engine"),
        (None, "unknown: no GET /server_info"), (None, "declared")]
    said["http://declared"] = CapUnknown("no GET /server_info")
    assert c.pushes.output_cap(ledger.shard(3)) == (32, "declared")
    pushed = c.serving_push()[1].values()
    assert [f.output_cap for f in pushed] == [100, 64, 120, 32, None, None]
    # the router refuses continuations on the unknown one, and is told why
    assert [f.output_cap_unknown for f in pushed] == [
        None, None, None, None, "no GET /server_info", None]
    told = [r for r in caplog.records if "server cap" in r.getMessage()]
    assert len(told) == 1 and "http://silent" in told[0].getMessage()
    # a new process: not told until it was asked (nothing is known to be missing), then once
    restarted = dataclasses.replace(ledger.shard(4), incarnation="new")
    said.pop("http://silent")
    assert c.pushes.output_cap(restarted)[1] == "unknown: not read"
    assert len([r for r in caplog.records if "server cap" in r.getMessage()]) == 1
    said["http://silent"] = CapUnknown("no GET /server_info")
    c.pushes.output_cap(restarted)
    c.pushes.output_cap(restarted)
    assert len([r for r in caplog.records if "server cap" in r.getMessage()]) == 2


def test_a_models_default_is_the_engines_word_else_declared_else_the_command_else_unknown(
        tmp_path: Path) -> None:
    """A chat naming no limit gets its model's generation config default: what the engine's
    ``/server_info`` shows, else the config's ``output_default``, else a launched command's
    model folder; where none says, pushed as unknown, with why (docs/design.md 4.1)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"max_new_tokens": 48}')
    fleet = FleetConfig.model_validate({
        "engines": 2, "engine_cmd": f"vllm serve {folder} --port {{port}}",
        "groups": [{"engines": 1, "engine_cmd": "vllm serve hub/x --port {port}"}],
        "backends": ["http://a:1", {"url": "http://b:1", "output_default": "none"}]})
    unknown = CapUnknown("no GET /server_info")
    assert [output_default_from(said, fleet, shard) for said, shard in (
        (30, 0), (unknown, 1), (unknown, 2), (unknown, 3), (unknown, 4), (None, 3))] == [
        (30, None), (48, None),
        (None, "the model's generation_config.json is not readable in 'hub/x' on this host"),
        (None, "no GET /server_info"), (None, None), (None, None)]


class _SaysItsCap(Watchdog):
    """A watchdog whose engines' ``/server_info`` says what ``says`` holds for the process
    now there (cap, default): its memory is the real one, only the GET is not made."""

    def __init__(self) -> None:
        super().__init__()
        self.says: tuple[int | None, int | None] = (None, None)

    async def _server_cap(self, url: str) -> tuple[int | None, int | None]:
        return self.says

    async def read_process(self, url: str, incarnation: str) -> None:
        """A read of ``url``'s process ``incarnation`` that answered, then its
        ``/server_info``, as a round makes them."""
        self._remember(Target(url, engine="vllm"))
        await self.learn_output_cap(Report(url, Verdict.IDLE, Evidence("idle"), Health.UNPROVEN,
                                           CanaryRule.NEVER, None, None, None, incarnation))


async def test_a_restarted_engine_is_not_held_to_the_cap_its_old_process_said() -> None:
    """An engine restarted on the same URL (an attached one, or one started again with other
    flags) is named as a new process by the ledger at the read that sees it, and that read is
    decided on (and may be pushed) before the watchdog asks the new process's
    ``/server_info``. Until then the push says what the config says (declared), else that the
    cap is unknown: never the old process's word, which may be bigger than the new one's cap
    (a continuation sent there would ask past it) (docs/design.md 4.1, "Server caps")."""
    config = Config.model_validate({"fleet": {"engines": 0, "backends": [
        "http://a", {"url": "http://b", "output_cap": 32, "output_default": 24}]}})
    ledger = Ledger(["http://a", "http://b"], Policy())
    watchdog = _SaysItsCap()
    supervisor = Supervisor(ledger, _NoLauncher(), config.fleet, config.supervisor)
    c = Controller(ledger, watchdog, supervisor, [], config, refit=RefitCoordinator(ledger))

    def pushed() -> list[tuple[int | None, str | None, int | None, str | None]]:
        facts = c.serving_push()[1]
        return [(f.output_cap, f.output_cap_unknown, f.output_default,
                 f.output_default_unknown) for f in (facts["http://a"], facts["http://b"])]

    watchdog.says = (64, 48)
    for i, url in enumerate(("http://a", "http://b")):
        ledger.observe_incarnation(i, "1.0")
        await watchdog.read_process(url, "1.0")
    assert pushed() == [(64, None, 48, None), (64, None, 48, None)]  # the engine's word
    for i in range(2):
        ledger.observe_incarnation(i, "2.0")  # its new process read and decided on
    new = "not read from the new process yet"
    assert pushed() == [(None, new, None, new), (32, None, 24, None)]
    watchdog.says = (16, None)  # the new process was started with a smaller cap
    for url in ("http://a", "http://b"):
        await watchdog.read_process(url, "2.0")
    assert pushed() == [(16, None, None, None), (16, None, None, None)]
