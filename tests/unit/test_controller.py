"""The controller's mapping of watchdog reports into the ledger (the table in watchdog.py)."""

from __future__ import annotations

import contextlib
from typing import Any

from fleetwarden.config import Config
from fleetwarden.controller import Controller
from fleetwarden.judge import CanaryRule, Evidence, Health, Verdict
from fleetwarden.ledger import Ledger, Policy, ShardState
from fleetwarden.refit import RefitCoordinator
from fleetwarden.watchdog import CanaryResult, Report

H, S, ST, D = ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE, ShardState.DEAD


def report(verdict: Verdict, health: Health, canary: bool | None = None,
           incarnation: str | None = None) -> Report:
    result = None if canary is None else CanaryResult(canary, 1.5, None if not canary else 200,
                                                      "" if canary else "no answer")
    return Report("http://e", verdict, Evidence(verdict.name.lower()), health, CanaryRule.NEVER,
                  None, None, result, incarnation)


def controller(weights: str = "static") -> tuple[Controller, Ledger, RefitCoordinator]:
    config: Any = Config.model_validate({"fleet": {"weights": weights}})
    ledger = Ledger(["http://a", "http://b"], Policy(weights=config.fleet.weights))
    refit = RefitCoordinator(ledger)
    c = Controller(ledger, None, None, [], config, refit=refit)  # type: ignore[arg-type]
    return c, ledger, refit


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


def test_the_push_names_each_serving_backends_shard_and_weight_version() -> None:
    from fleetwarden.router.pool import BackendFacts

    c, ledger, refit = controller("trainer")
    refit.begin_refit(4)
    refit.complete_refit(4)
    ledger.condemn(0, "gone")
    assert c.serving_push() == (["http://b"], {"http://b": BackendFacts(1, 4)})


class _Watchdog:
    async def round(self, targets: list[Any]) -> dict[str, Report]:
        return {}


class _Router:
    def __init__(self) -> None:
        self.pushed: list[list[str]] = []

    async def set_serving_backends(self, urls: Any, facts: Any = None) -> None:
        self.pushed.append(list(urls))

    async def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
        return {}

    async def rescue(self, url: str) -> int:
        return 0

    async def in_flight(self) -> dict[str, int]:
        return {}

    async def set_retry_after(self, seconds: float | None) -> None:
        pass


class _BrokenSupervisor:
    def __init__(self) -> None:
        self.attempts: dict[int, Any] = {}

    def tick(self) -> None:
        raise RuntimeError("a bug in the supervisor")


async def test_a_step_that_raises_never_aborts_the_tick_before_its_push() -> None:
    config: Any = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"])
    router = _Router()
    c = Controller(ledger, _Watchdog(), _BrokenSupervisor(), [router], config)  # type: ignore[arg-type]
    ledger.condemn(1, "exited")
    report = await c.tick()
    assert router.pushed == [["http://a"]]
    assert report.errors and "a bug in the supervisor" in report.errors[0]


async def test_a_failing_journal_is_in_the_fleet_status(tmp_path: Any) -> None:
    from fleetwarden.journal import Journal

    config: Any = Config.model_validate({})
    ledger = Ledger(["http://a", "http://b"])
    journal = Journal(tmp_path / "j.sqlite")
    journal.attach(ledger)
    router = _Router()
    c = Controller(ledger, _Watchdog(), _BrokenSupervisor(), [router], config,  # type: ignore[arg-type]
                   journal=journal)
    journal._failed(OSError("disk full"))  # what the writer thread does when a commit fails
    ledger.condemn(1, "exited")
    await c.tick()
    assert c.status.state == "degraded" and "journal fails" in c.status.detail
    assert "disk full" in c.status.detail
    assert router.pushed == [["http://a"]]
    with contextlib.suppress(Exception):
        journal.close()


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
    assert sorted(c._fell_asleep) == [0, 1]  # their waiting requests are rescued at the push
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
    assert ledger.state(0) is D and "while SLEEPING" in ledger.shard(0).last_error
