"""The judge's watch of one engine, read as a specification: what it was told it observed, and
what it answers, a finished report or the next thing to fetch (docs/design.md section 5). Pure:
no sockets, no sleeps; the time of each observation is whatever the test says."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from fleetwarden.engine_metrics import Sample
from fleetwarden.judge import (
    DEFAULT_POLICY,
    EXIT_UNREACHABLE,
    Canaried,
    CanaryResult,
    Down,
    EngineWatch,
    Fetch,
    Health,
    Hedge,
    Hedged,
    NoMetrics,
    ProxyAnswered,
    Read,
    ReadEngine,
    Reading,
    Report,
    SendCanary,
    Silent,
    Target,
    Verdict,
    Visit,
    exit_code,
)
from support.clock import TICK_S

URL = "http://engine:8000"
IDLE = Sample(running=0, waiting=0, steps=1000, generation_tokens=4000, prompt_tokens=40,
              finished_requests=10, start_time=1.7e9)
BUSY = replace(IDLE, running=4)
ANSWERED = CanaryResult(True, 0.2, 200)
TIMEOUT = DEFAULT_POLICY.canary_timeout_s
SILENT = CanaryResult(False, TIMEOUT, None, f"no answer within {TIMEOUT:g} s")


def moved(s: Sample, **fields: float) -> Sample:
    return replace(s, **{k: getattr(s, k) + v for k, v in fields.items()})


def feed(watch: EngineWatch, step: Report | Fetch | None, answers: list[Reading | CanaryResult],
         at: float) -> tuple[list[Fetch], Report | None]:
    """Answer each fetch the watch asks for with the next of ``answers`` (a reading for a read,
    a result for a canary), all at time ``at``; what it asked, and how it ended."""
    asked: list[Fetch] = []
    answers = list(answers)
    while isinstance(step, ReadEngine | SendCanary):
        asked.append(step)
        answer = answers.pop(0)
        if isinstance(step, ReadEngine):
            assert not isinstance(answer, CanaryResult), (step, answer)
            step = watch.next(Read(step.visit, answer, at))
        else:
            assert isinstance(answer, CanaryResult), (step, answer)
            step = watch.next(Canaried(step.visit, answer, at))
    assert not answers, f"fetches left unasked: {answers}"
    return asked, step


def visit(watch: EngineWatch, target: Target, at: float,
          answers: list[Reading | CanaryResult]) -> tuple[list[Fetch], Report]:
    asked, report = feed(watch, watch.next(Visit(target, at)), answers, at)
    assert report is not None
    return asked, report


@dataclass(frozen=True)
class Case:
    """A baseline kept at t=0 (or none), then one visit at ``at``: the fetches it asks for,
    answered in order, and what it finds."""

    name: str
    baseline: Sample | None
    target: Target
    at: float
    answers: list[Reading | CanaryResult]
    asks: list[str]  # "read", "proxy read", "canary <timeout>"
    verdict: Verdict
    health: Health
    says: str = ""  # in the evidence's summary


CASES = [
    Case("an idle engine's first read sends a canary, and reads again after it",
         None, Target(URL), 1.0, [IDLE, ANSWERED, moved(IDLE, steps=1)],
         ["read", f"canary {TIMEOUT:g}", "read"], Verdict.IDLE, Health.PROVEN),
    Case("a busy engine that advanced is proven by progress alone, never canaried",
         BUSY, Target(URL, in_flight=4), 1.0, [moved(BUSY, steps=5, generation_tokens=20)],
         ["read"], Verdict.BUSY, Health.PROVEN),
    Case("work held the stall floor with nothing advancing is condemned without a canary",
         BUSY, Target(URL, in_flight=4, held_s=6.0), 6.0, [BUSY],
         ["read"], Verdict.STALLED, Health.CONDEMNED, "held a request 6.0 s"),
    Case("a request held short of the floor is only a stall",
         BUSY, Target(URL, in_flight=4, held_s=4.0), 4.0, [BUSY],
         ["read"], Verdict.STALLED, Health.UNPROVEN),
    Case("a lost core whose held request concludes before a canary could: no canary",
         IDLE, Target(URL, in_flight=1, held_s=1.0), 1.0, [IDLE],
         ["read"], Verdict.LOST_CORE, Health.UNPROVEN, "concludes in 4.0 s"),
    Case("a lost core holding nothing for long: its canary's failure is conclusive",
         IDLE, Target(URL, in_flight=1), 1.0, [IDLE, SILENT],
         ["read", f"canary {TIMEOUT:g}"], Verdict.LOST_CORE, Health.CONDEMNED),
    Case("an idle engine that held its canary the floor, advancing nothing, is condemned",
         IDLE, Target(URL), 40.0, [IDLE, SILENT, IDLE],
         ["read", f"canary {TIMEOUT:g}", "read"], Verdict.IDLE, Health.CONDEMNED,
         "held its canary"),
    Case("an idle engine that did something meanwhile is one failed probe",
         IDLE, Target(URL), 40.0, [IDLE, SILENT, moved(IDLE, steps=1)],
         ["read", f"canary {TIMEOUT:g}", "read"], Verdict.IDLE, Health.FAILING),
    Case("a canary that was answered with an error is one failed probe, read no more",
         IDLE, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.1, 500, "answered 500")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.FAILING),
    Case("a new process that is idle is canaried at once, asking its model again",
         IDLE, Target(URL), 1.0, [replace(IDLE, start_time=1.8e9), ANSWERED,
                                  replace(IDLE, start_time=1.8e9, steps=1001)],
         ["read", f"canary {TIMEOUT:g} new model", "read"], Verdict.RESTARTED, Health.PROVEN),
    Case("an unreachable engine is one failed probe",
         IDLE, Target(URL), 1.0, [Down("refused")],
         ["read"], Verdict.UNREACHABLE, Health.FAILING),
    # "You asked wrong" (judge.ASKED_WRONG) is a fault of fleetwarden's config, never the
    # engine's: it proves nothing, either way.
    Case("an idle engine whose canary is refused a key proves nothing, and is not failing",
         IDLE, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.01, 401, "answered 401")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.UNPROVEN, "proves nothing"),
    Case("a canary that cannot list the models for want of a key proves nothing",
         IDLE, Target(URL), 40.0,
         [IDLE, CanaryResult(False, 0.01, 401, "no model to ask for: GET /v1/models "
                             "answered 401", request="GET /v1/models")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.UNPROVEN),
    Case("a canary answered 404 for its model name or path proves nothing",
         IDLE, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.01, 404, "answered 404")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.UNPROVEN),
    Case("a canary answered 400 proves nothing",
         IDLE, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.01, 400, "answered 400")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.UNPROVEN),
    Case("a lost core's refused canary is not conclusive: its held requests still are",
         IDLE, Target(URL, in_flight=1), 1.0, [IDLE, CanaryResult(False, 0.01, 403, "403")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.LOST_CORE, Health.UNPROVEN),
    Case("a lost core's held request condemns at the limit, whatever the canary says",
         IDLE, Target(URL, in_flight=1, held_s=6.0), 6.0, [IDLE],
         ["read"], Verdict.LOST_CORE, Health.CONDEMNED, "held a request 6.0 s"),
    Case("a health path that refuses us answered: reachable, judged without metrics",
         IDLE, Target(URL), 40.0,
         [Down("/metrics: answered 401; /health: answered 401",
               (("/metrics", 401), ("/health", 401)), 401),
          CanaryResult(False, 0.01, 401, "answered 401")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.NO_METRICS, Health.UNPROVEN),
    Case("a health path that answers 503 is down, refusals elsewhere or not",
         IDLE, Target(URL), 1.0,
         [Down("/metrics: answered 401; /health: answered 503",
               (("/metrics", 401), ("/health", 503)), 503)],
         ["read"], Verdict.UNREACHABLE, Health.FAILING),
    Case("a proxy that refuses our model list is reachable, proves nothing, gets no canary",
         None, Target(URL, proxy=True), 1.0,
         [Down("GET /v1/models: answered 401", (("/v1/models", 401),), 401)],
         ["proxy read"], Verdict.NO_METRICS, Health.UNPROVEN, "proxy refused us"),
    Case("a canary answered 429 (the engine's own word on its load) is one failed probe",
         IDLE, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.01, 429, "answered 429")],
         ["read", f"canary {TIMEOUT:g}"], Verdict.IDLE, Health.FAILING),
    Case("an excused stall (a refit lease) is never condemned, whatever it holds",
         BUSY, Target(URL, in_flight=4, held_s=60.0, stalls_excused=True), 60.0, [BUSY],
         ["read"], Verdict.STALLED, Health.UNPROVEN, "excused"),
]


def said(step: Fetch) -> str:
    if isinstance(step, ReadEngine):
        return "proxy read" if step.proxy else "read"
    return f"canary {step.timeout_s:g}" + (" new model" if step.new_model else "")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_observation_answers_a_report_or_the_next_fetch(case: Case) -> None:
    watch = EngineWatch()
    if case.baseline is not None:
        watch.keep_baseline(case.baseline, 0.0)
    asked, report = visit(watch, case.target, case.at, case.answers)
    assert [said(s) for s in asked] == case.asks
    assert (report.verdict, report.health) == (case.verdict, case.health), report.evidence
    assert case.says in report.evidence.summary
    assert report.limit_s >= DEFAULT_POLICY.stall_s or not isinstance(report.sample, Sample)


def test_a_start_time_that_comes_back_is_a_proxy_read_as_one_from_then_on() -> None:
    watch = EngineWatch()
    a, b = BUSY, replace(BUSY, start_time=1.8e9)  # with work in it: never canaried
    visit(watch, Target(URL, in_flight=1), 0.0, [a])
    visit(watch, Target(URL, in_flight=1), 1.0, [b])
    asked, report = visit(watch, Target(URL, in_flight=1), 2.0, [a, ProxyAnswered(("m",))])
    assert [said(s) for s in asked] == ["read", "proxy read"]
    assert isinstance(asked[1], ReadEngine) and "load balancer" in asked[1].why
    assert (report.verdict, report.health) == (Verdict.REACHABLE, Health.PROVEN)
    asked, _ = visit(watch, Target(URL), 3.0, [ProxyAnswered(("m",))])
    assert [said(s) for s in asked] == ["proxy read"]


def lost_core(watch: EngineWatch) -> Report:
    """A lost core holding a request 1.1 s flat: the read a hedge is decided on."""
    watch.keep_baseline(IDLE, 0.0)
    _, report = visit(watch, Target(URL, in_flight=1, held_s=1.1), 1.1, [IDLE])
    assert report.verdict is Verdict.LOST_CORE and report.held_flat_s == pytest.approx(1.1)
    return report


@pytest.mark.parametrize(("answers", "condemned"), [
    ([CanaryResult(False, 3.9, None, "no answer within 3.9 s"), IDLE], True),
    ([CanaryResult(False, 3.9, None, "no answer within 3.9 s"), moved(IDLE, steps=1)], False),
    ([CanaryResult(True, 0.2, 200)], False),
    ([CanaryResult(False, 3.9, None, "no answer within 3.9 s"), Down("refused")], False),
])
def test_a_hedged_lost_cores_canary_waits_what_the_limit_left_and_concludes(
        answers: list[Reading | CanaryResult], condemned: bool) -> None:
    watch = EngineWatch()
    report = lost_core(watch)
    first = watch.next(Hedged(report, 1.2))
    assert isinstance(first, SendCanary)
    assert first.timeout_s == pytest.approx(DEFAULT_POLICY.stall_s - 1.1)
    _, ended = feed(watch, first, answers, 5.1)
    if condemned:
        assert ended is not None and ended.health is Health.CONDEMNED
        assert "our canary sent with them kept the watch" in ended.evidence.summary
        assert ended.canary == answers[0]
    else:
        assert ended is None  # nothing concluded: nothing goes to the ledger


def test_a_restart_during_a_hedged_watch_is_told_by_the_next_read() -> None:
    """The hedged canary's read was kept as the sample even from a new process (restarted
    while the canary waited, which dropped with the old one): every later read compared the
    new process with itself, no read said RESTARTED, and a refit credited the new process
    with the weights the old one had received."""
    watch = EngineWatch()
    report = lost_core(watch)
    first = watch.next(Hedged(report, 1.2))
    assert isinstance(first, SendCanary)
    assert IDLE.start_time is not None
    new = Sample(running=0, waiting=0, steps=0, generation_tokens=0,
                 start_time=IDLE.start_time + 60)
    dropped = CanaryResult(False, 0.3, None, "Server disconnected")
    for canary in (dropped, CanaryResult(False, 3.9, None, "no answer within 3.9 s")):
        _, ended = feed(watch, watch.next(Hedged(report, 1.2)) if canary is not dropped
                        else first, [canary, new], 5.1)
        assert ended is None
        assert watch.sample == IDLE  # the old process's: the new one is still to be told
    _, told = visit(watch, Target(URL), 6.0, [new, ANSWERED, new])  # a restart: a canary
    assert told.restarted and told.incarnation == new.incarnation


def test_a_hedged_watch_with_no_sample_to_compare_asks_for_nothing() -> None:
    watch = EngineWatch()
    _, report = visit(watch, Target(URL, in_flight=1), 0.0, [Down("refused")])
    assert watch.next(Hedged(report, 1.0)) is None


def test_a_visit_that_waited_on_its_canary_keeps_no_older_sample_over_a_newer() -> None:
    watch = EngineWatch()
    watch.keep_baseline(IDLE, 0.0)
    slow = watch.next(Visit(Target(URL), 40.0))
    assert isinstance(slow, ReadEngine)
    canary = watch.next(Read(slow.visit, IDLE, 40.0))
    assert isinstance(canary, SendCanary)
    visit(watch, Target(URL), 41.0, [moved(IDLE, steps=3)])  # read meanwhile
    assert watch.sample_at == 41.0
    feed(watch, canary, [CanaryResult(False, 0.1, 500, "answered 500")], 45.0)
    assert watch.sample_at == 41.0 and watch.sample == moved(IDLE, steps=3)


def test_each_fetch_is_answered_once_and_an_unknown_one_is_refused() -> None:
    watch = EngineWatch()
    step = watch.next(Visit(Target(URL), 0.0))
    assert isinstance(step, ReadEngine)
    watch.next(Read(step.visit, Down("refused"), 0.0))
    with pytest.raises(ValueError, match="no visit"):
        watch.next(Read(step.visit, Down("refused"), 0.1))


def test_a_configuration_fault_is_shown_until_the_same_request_is_answered() -> None:
    """Each refused request names its fault and fix in the report, read after read (not only
    at the read that sent the canary), until the same request is asked again and answered."""
    watch = EngineWatch()
    watch.keep_baseline(IDLE, 0.0)
    refused = CanaryResult(False, 0.01, 401, "no model to ask for: GET /v1/models answered 401",
                           request="GET /v1/models")
    _, report = visit(watch, Target(URL), 40.0, [IDLE, refused])
    assert report.health is Health.UNPROVEN
    assert len(report.faults) == 1 and report.faults[0].startswith("GET /v1/models answered 401")
    assert "api_key_file" in report.faults[0]
    # Busy and proven by progress: the canary's fault stands (no canary was asked since).
    _, report = visit(watch, Target(URL, in_flight=2), 41.0,
                      [moved(BUSY, steps=5, generation_tokens=20)])
    assert report.health is Health.PROVEN and len(report.faults) == 1
    # A read that finds /metrics refused adds its own.
    _, report = visit(watch, Target(URL, in_flight=2), 42.0,
                      [NoMetrics("/metrics answered 403", (("/metrics", 403),))])
    assert [f.split(":")[0] for f in report.faults] == ["GET /metrics answered 403",
                                                        "GET /v1/models answered 401"]
    # The key fixed: the metrics read and the canary answered, and no fault is left.
    watch.keep_baseline(IDLE, 42.0)
    _, report = visit(watch, Target(URL), 80.0, [IDLE, ANSWERED, moved(IDLE, steps=1)])
    assert report.health is Health.PROVEN and report.faults == ()


def test_a_refused_canary_is_none_for_the_ledger() -> None:
    """The ledger is told no canary was sent (it proves nothing), so it counts no failed
    probe; a canary that failed otherwise is told as failed."""
    from fleetwarden.reads import reading_of

    watch = EngineWatch()
    watch.keep_baseline(IDLE, 0.0)
    _, report = visit(watch, Target(URL), 40.0, [IDLE, CanaryResult(False, 0.01, 401, "401")])
    assert reading_of(report).canary_ok is None and reading_of(report).health == "unproven"
    _, report = visit(watch, Target(URL), 80.0, [IDLE, CanaryResult(False, 0.01, 500, "500")])
    assert reading_of(report).canary_ok is False and reading_of(report).health == "failing"


# ---------------------------------------------------------------------- silence is evidence


def silent_visit(watch: EngineWatch, target: Target, began: float, answered_at: float,
                 reading: Reading) -> Report:
    """One visit whose read began at ``began`` and came back at ``answered_at``."""
    step = watch.next(Visit(target, began))
    assert isinstance(step, ReadEngine)
    report = watch.next(Read(step.visit, reading, answered_at))
    assert isinstance(report, Report)
    return report


def test_a_read_accepted_and_never_answered_is_a_stall_of_the_requests_held_there() -> None:
    """SIGSTOP of the whole process, a black hole: the read waited for nothing, as the
    router's requests there wait. They are hedged as a stall's are; a read that waited the
    whole read timeout is one failed probe too (its streak condemns, as unreachable reads
    do)."""
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    held = Target(URL, in_flight=3, held_s=1.5)
    step = watch.next(Visit(held, 10.0))
    # a request held there: read with the short silence timeout
    assert isinstance(step, ReadEngine) and step.timeout_s == DEFAULT_POLICY.silence_read_s
    r = watch.next(Read(step.visit, Silent("/metrics: no answer within 1 s", waited_s=1.0),
                        11.0))
    assert isinstance(r, Report)
    assert r.verdict is Verdict.SILENT and r.health is Health.UNPROVEN  # no failed probe yet
    assert r.held_flat_s == 1.0  # our read's second of nothing; the request's 2.5 s
    assert r.hedge(1.0) is Hedge.STEP
    assert r.accuses and not r.settled and not r.answered
    assert exit_code(r) == EXIT_UNREACHABLE
    # nothing held: the full read timeout, and its silence is a failed probe
    watch2 = EngineWatch()
    step = watch2.next(Visit(Target(URL), 10.0))
    assert isinstance(step, ReadEngine) and step.timeout_s is None
    idle = watch2.next(Read(step.visit, Silent("no answer", waited_s=2.0), 12.0))
    assert isinstance(idle, Report)
    assert idle.held_flat_s == 0.0 and idle.hedge(1.0) is None
    assert idle.health is Health.FAILING


def test_a_silence_lasts_across_reads_until_one_is_answered() -> None:
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    first = silent_visit(watch, Target(URL, held_s=0.5), 10.0, 11.0,
                         Silent("no answer", waited_s=1))
    assert first.health is Health.UNPROVEN  # a second of silence: hedges, condemns nothing
    # the second silent read counts from the first one's start: 2.25 s of nothing, as long
    # as a whole read timeout: a failed probe
    r = silent_visit(watch, Target(URL, held_s=9.0), 11.25, 12.25,
                     Silent("no answer", waited_s=1.0))
    assert r.held_flat_s == pytest.approx(2.25) and r.health is Health.FAILING
    # an answer ends it: the next silence counts from its own read only
    silent_visit(watch, Target(URL), 15.0, 15.0, moved(BUSY, steps=5, generation_tokens=5))
    r = silent_visit(watch, Target(URL, held_s=9.0), 20.0, 21.0,
                     Silent("no answer", waited_s=1.0))
    assert r.held_flat_s == pytest.approx(1.0)


def test_a_process_the_os_reports_stopped_is_judged_silent_without_a_read() -> None:
    """Known of a launched engine (``/proc/PID/stat`` state T): nothing to fetch, and the
    requests it holds have waited on a process that cannot answer."""
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    r = watch.next(Visit(Target(URL, in_flight=2, held_s=1.2, stopped=True), 10.0))
    assert isinstance(r, Report)  # no ReadEngine asked for
    assert r.verdict is Verdict.SILENT and r.health is Health.FAILING
    assert r.held_flat_s == 1.2 and r.hedge(1.0) is Hedge.STEP
    assert "stopped" in r.evidence.summary
    # a refit lease excuses stalls: nothing is hedged then
    excused = watch.next(Visit(Target(URL, held_s=3.0, stopped=True, stalls_excused=True),
                               11.0))
    assert isinstance(excused, Report) and excused.hedge(1.0) is None


def test_silence_counts_only_where_requests_wait() -> None:
    """An idle engine whose /metrics hangs while /health answers is one with slow metrics,
    read by /health and canaries as before; with a request there (in flight, or held
    silent), the same silence is the engine's."""
    for target, counts in [(Target(URL), False), (Target(URL, in_flight=1), True),
                           (Target(URL, held_s=0.5), True),
                           (Target(URL, in_flight=2, held_s=3.0, stalls_excused=True), False)]:
        step = EngineWatch().next(Visit(target, 10.0))
        assert isinstance(step, ReadEngine) and step.silence_counts is counts, target
    # A silence begun with a request there lasts, though the request was hedged away since:
    # only an answer ends it.
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    silent_visit(watch, Target(URL, held_s=0.5), 10.0, 11.0, Silent("no answer", waited_s=1))
    step = watch.next(Visit(Target(URL), 12.0))
    assert isinstance(step, ReadEngine) and step.silence_counts
    silent_visit(watch, Target(URL), 12.0, 12.0, moved(BUSY, steps=5, generation_tokens=5))
    step = watch.next(Visit(Target(URL), 13.0))
    assert isinstance(step, ReadEngine) and not step.silence_counts


def test_an_engine_whose_reads_were_already_slow_is_starved_not_silent() -> None:
    """A saturated engine on a starved host answers /metrics in seconds: its next read waits
    the whole read timeout, and one that times out is no silence (no hedge); once a read comes
    back quickly again, a short silent read counts as before."""
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    held = Target(URL, in_flight=8, held_s=1.5)
    # a read that took 1.8 s of the 2 s: the engine was starved, not stopped
    silent_visit(watch, held, 10.0, 11.8, moved(BUSY, steps=5, generation_tokens=40))
    step = watch.next(Visit(held, 12.0))
    assert isinstance(step, ReadEngine)
    assert step.timeout_s is None and not step.silence_counts
    # a quick read again: the short silence read, and its silence counts
    watch.next(Read(step.visit, moved(BUSY, steps=9, generation_tokens=80), 12.01))
    step = watch.next(Visit(held, 13.0))
    assert isinstance(step, ReadEngine)
    assert step.timeout_s == DEFAULT_POLICY.silence_read_s and step.silence_counts
    r = watch.next(Read(step.visit, Silent("no answer", waited_s=1.0), 14.0))
    assert isinstance(r, Report) and r.verdict is Verdict.SILENT


def test_an_engine_that_streams_while_its_metrics_hang_is_not_a_failed_probe() -> None:
    """A saturated engine on a starved host: /metrics hangs past the silence timeout on reads
    in a row while the routers hear its events (their held time there stays short). Before,
    two such reads added up to a read timeout of silence and a failed probe (the real demo's
    saturated stretch: both healthy engines SUSPECT). Once the routers too hear nothing for a
    read timeout, the silence is the engine's and condemns as before."""
    watch = EngineWatch()
    watch.keep_baseline(BUSY, 0.0)
    policy = DEFAULT_POLICY
    streaming = Target(URL, in_flight=16, held_s=0.05)  # an event 50 ms before each read
    first = silent_visit(watch, streaming, 10.0, 11.0, Silent("no answer", waited_s=1.0))
    second = silent_visit(watch, streaming, 11.25, 12.25, Silent("no answer", waited_s=1.0))
    assert policy.read_timeout_s <= 12.25 - 10.0  # reads alone: a failed probe, as before
    for r in (first, second):
        assert r.verdict is Verdict.SILENT and r.health is Health.UNPROVEN
    # what a hedge is decided on: the read's second, then the routers' 1.05 s
    assert (first.held_flat_s, second.held_flat_s) == pytest.approx((1.0, 1.05))
    # One tick either side of the read timeout, as the routers see the engine: their held
    # time plus the read's own wait.
    below = silent_visit(watch, Target(URL, in_flight=16,
                                       held_s=policy.read_timeout_s - 1.0 - TICK_S),
                         12.5, 13.5, Silent("no answer", waited_s=1.0))
    assert below.health is Health.UNPROVEN
    at = silent_visit(watch, Target(URL, in_flight=16, held_s=policy.read_timeout_s - 1.0),
                      13.75, 14.75, Silent("no answer", waited_s=1.0))
    assert at.health is Health.FAILING
