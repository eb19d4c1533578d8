"""The fleet's measure of its own work (``workmeter.py``), its Prometheus families
(``admin/work.py``), a round's bounded readers (``Watchdog.round``) and what the controller
hands the meter at each step."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetwarden.admin.work import WorkCollector
from fleetwarden.judge import CanaryRule, Evidence, Health, Verdict
from fleetwarden.watchdog import Report, Target, Watchdog
from fleetwarden.workmeter import RECENT, Series, WorkMeter


def test_a_series_keeps_recent_values_for_quantiles_and_every_value_in_buckets() -> None:
    s = Series()
    assert s.quantile(0.5) is None and s.summary()["p50"] is None
    for v in (0.001, 0.002, 0.003, 0.004, 2.0):
        s.observe(v)
    assert s.quantile(0.5) == 0.003 and s.quantile(0.99) == 2.0
    assert s.summary() == {"count": 5, "p50": 0.003, "p99": 2.0, "max": 2.0, "mean": 0.402}
    buckets = dict(s.cumulative())
    assert buckets["0.001"] == 1 and buckets["0.0025"] == 2 and buckets["0.005"] == 4
    assert buckets["1.0"] == 4 and buckets["2.5"] == 5 and buckets["+Inf"] == 5
    for _ in range(RECENT):
        s.observe(0.5)
    assert s.quantile(0.99) == 0.5  # the old outlier has left the recent values...
    assert s.largest == 2.0 and dict(s.cumulative())["+Inf"] == RECENT + 5  # ...not the totals


@pytest.mark.parametrize("bad", [-0.001, float("nan")])
def test_a_series_refuses_what_is_not_a_measure(bad: float) -> None:
    s = Series()
    with pytest.raises(ValueError, match="a measure is a number >= 0"):
        s.observe(bad)
    assert s.count == 0 and not s.recent  # nothing half-kept


def test_reads_per_second_is_over_the_time_the_rounds_spanned() -> None:
    m = WorkMeter()
    m.round_done(100.0, 0.5, 10)
    assert m.reads_per_s() is None  # one round spans no time
    m.round_done(105.0, 0.5, 10)
    m.round_done(110.0, 0.5, 30)
    assert m.reads_per_s() == pytest.approx(40 / 10)
    assert m.reads == 50
    summary = m.summary()
    assert summary["reads_per_s"] == 4.0 and summary["reads_per_round"]["max"] == 30


def test_the_collector_exports_every_measure() -> None:
    m = WorkMeter()
    registry = CollectorRegistry()
    registry.register(WorkCollector(lambda: m))
    m.tick_done(0.02)
    m.round_done(1.0, 0.01, 3)
    m.round_done(2.0, 0.01, 3)
    m.decided(0.004)
    m.pushed(0.001, 3)
    text = generate_latest(registry).decode()
    for line in ("fleetwarden_tick_seconds_count 1.0", "fleetwarden_read_round_seconds_count 2.0",
                 "fleetwarden_evidence_to_decision_seconds_count 1.0",
                 "fleetwarden_push_seconds_count 1.0", "fleetwarden_push_backends_sum 3.0",
                 "fleetwarden_engine_reads_total 6.0",
                 "fleetwarden_engine_reads_per_second 3.0"):
        assert line in text, line
    empty = CollectorRegistry()
    empty.register(WorkCollector(lambda: None))
    assert generate_latest(empty) == b""  # not started: nothing, not zeros


def _report(url: str) -> Report:
    return Report(url, Verdict.IDLE, Evidence("idle"), Health.PROVEN, CanaryRule.NEVER,
                  None, None, None, None)


class _CountingWatchdog(Watchdog):
    """A watchdog whose reads take a turn of the loop each and count how many run at once."""

    def __init__(self, concurrency: int) -> None:
        super().__init__(concurrency=concurrency)
        self.now = 0
        self.most = 0

    async def probe(self, target: Target) -> Report:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0)
        self.now -= 1
        return _report(target.url)


async def test_a_round_reads_every_engine_never_more_than_its_readers_at_once() -> None:
    w = _CountingWatchdog(concurrency=4)
    targets = [Target(url=f"http://e{i}") for i in range(37)]
    reports = await w.round(targets)
    assert list(reports) == [t.url for t in targets]  # every one, in the order asked
    assert w.most == 4
    assert set(w.finished_at) == set(reports)
    small = _CountingWatchdog(concurrency=64)
    await small.round(targets[:3])
    assert small.most == 3  # a small fleet: all at once, as before
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        Watchdog(concurrency=0)
