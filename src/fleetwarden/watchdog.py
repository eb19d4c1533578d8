"""The watchdog: the I/O around :mod:`fleetwarden.judge` (docs/design.md section 5, note 002).

Owns: the reads of each engine (``/metrics``, ``/health`` via ``probe.py``, ``/v1/models``),
canaries, and the previous sample per engine.
Must not: decide what a read means (the judge does) or import the ledger.

It reads each engine's ``/metrics`` (short timeout, bounded size), falls back to ``/health``
when there are no metrics, keeps the previous sample per engine URL, asks the judge, and sends a
canary — one completion of ``max_tokens`` 1 — only when the judge allows it and at most every
``canary_interval_s``. A proxy target is only ever asked ``GET /v1/models``: behind a
least-connections proxy every ``/metrics`` read may come from another backend, and two of them
compared would look like a restart (``tests/scenario/test_watchdog.py`` shows it).

The rule it exists for: **a health check must never consume the resource it protects.** A busy
engine is never sent a request; its progress counters are the proof of health.

A controller calls :meth:`Watchdog.round` once per tick for the whole fleet; the engines are
visited ``concurrency`` at a time (64 by default), so a round of up to that many costs one
engine's worst case (a read, the ``/health`` fallback, a canary), not the sum, and a larger
fleet's round grows with the fleet instead of bursting with it. Parsing is done inline,
between awaits: ``engine_metrics.parse`` cuts the 52 KB body to the judged families first,
so one body costs ~0.3 ms of CPU instead of ~10 ms (``bench/metrics_parse.py``) — at 64
engines, ~20 ms per 5 s tick in 0.3 ms slices, none long enough to move the latency of a
router on the same loop.

What a :class:`Report` says, and what it amounts to (``Report.health``), is the judge's table,
:data:`fleetwarden.judge.VERDICTS`; what the ledger does with it is
:meth:`fleetwarden.ledger.Ledger.record_reading` (the controller only gathers and calls). This
module does not import the ledger.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from fleetwarden.engine_metrics import Sample, Unreadable, parse
from fleetwarden.engines import AUTO, EngineProfile, detect, profile
from fleetwarden.judge import (
    DEFAULT_POLICY,
    NO_CADENCE,
    NO_STALL,
    Cadence,
    CanaryRule,
    Down,
    Evidence,
    Health,
    Judgement,
    NoMetrics,
    ProxyAnswered,
    Reading,
    Stall,
    Verdict,
    WatchdogPolicy,
    conclude,
    flat,
    held_its_canary,
    held_its_requests,
    held_then_canary,
    judge,
)
from fleetwarden.probe import describe as _describe
from fleetwarden.probe import health_status

__all__ = [
    "CANARY_ID_PREFIX",
    "EXIT_CANNOT_JUDGE",
    "EXIT_HEALTHY",
    "EXIT_NOT_SERVING",
    "EXIT_UNREACHABLE",
    "CanaryResult",
    "Check",
    "Report",
    "Target",
    "Watchdog",
    "check",
    "exit_code",
]

log = logging.getLogger(__name__)

#: Every canary carries ``x-request-id: fleetwarden-canary-…``, so an engine's logs (and the
#: simulator's ``/sim/stats``) tell a health check from real traffic.
CANARY_ID_PREFIX = "fleetwarden-canary-"
#: The canary's prompt: a few tokens, so it is one short prefill step on any engine.
CANARY_PROMPT = "ping"
_MODELS_BODY_LIMIT = 1024 * 1024  # a model list is a few KB; a proxy's may list many models


@dataclass(frozen=True, slots=True)
class Target:
    """One engine to visit in a round, with what the router knows about it."""

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
    #: (:func:`~fleetwarden.judge.held_its_requests`).
    held_s: float = 0.0
    #: Its kind (``fleetwarden.engines``): a profile name, or ``auto`` to recognise it from
    #: ``/metrics`` at the first read.
    engine: str = AUTO


@dataclass(frozen=True, slots=True)
class CanaryResult:
    ok: bool
    latency_s: float
    status: int | None = None  # HTTP status, None when no answer came
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "latency_s": self.latency_s, "status": self.status,
                "error": self.error}


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
    #: less (its cadence, ``judge.Cadence``): a pause it has come back from before. A hedge
    #: waits past it.
    longest_pause_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
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


@dataclass(slots=True)
class _Memory:
    """What the watchdog keeps per engine URL between visits."""

    sample: Sample | None = None
    sample_at: float = 0.0
    #: When the read was taken that began the stretch over which every counter of this process
    #: has read the same (``sample_at`` of the first read of it).
    flat_since: float = 0.0
    stall: Stall = NO_STALL
    cadence: Cadence = NO_CADENCE
    canary_at: float | None = None
    model: str | None = None  # from /v1/models, for the canary; looked up again after a restart
    #: The last process start times read here. A start time that comes back after another
    #: one is no restart (a process never returns to an earlier start): it is a load
    #: balancer answering from several engines, and the URL is judged as a proxy from then on.
    incarnations: list[str] = field(default_factory=list)
    proxy: bool = False
    #: When this URL was last read: a URL no one reads any more is forgotten.
    visited_at: float = 0.0
    #: The engine's profile: configured, or recognised at a read (then kept for this URL).
    profile: EngineProfile | None = None


#: Engines one round reads at once by default (the fleet passes ``health.max_concurrent_reads``).
DEFAULT_CONCURRENCY = 64


class Watchdog:
    """Visits engines and judges them. Use as ``async with Watchdog() as watchdog:``.

    ``model`` names the model a canary asks for; without it, each engine's ``/v1/models`` is
    asked once (and again after a restart). ``clock`` is monotonic seconds (inject one in tests).
    """

    def __init__(self, policy: WatchdogPolicy = DEFAULT_POLICY, *, model: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 session: aiohttp.ClientSession | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.policy = policy
        #: Engines a round reads at once (``health.max_concurrent_reads``).
        self.concurrency = concurrency
        self.model = model
        self._clock = clock
        self._session = session
        self._own_session = session is None
        self._memory: dict[str, _Memory] = {}
        #: When each read of the last round finished (monotonic seconds, by URL): how long its
        #: evidence then waited for the round's end (the controller's evidence-to-decision).
        self.finished_at: dict[str, float] = {}
        #: Called with each read of a round as it finishes (the controller decides on it then,
        #: not at the round's end); what it raises is logged, and the round goes on.
        self.on_report: Callable[[str, Report], None] | None = None

    async def __aenter__(self) -> Watchdog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No keep-alive: a pooled connection could outlive the engine it reached, and a
            # fresh connect per visit is what tells "refused" from "answers". It costs one TCP
            # handshake per request, a few per engine per tick.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                headers={"user-agent": "fleetwarden-watchdog"},
            )
        return self._session

    def forget(self, url: str) -> None:
        """Drop what is remembered of an engine (it left the fleet, or moved)."""
        self._memory.pop(url, None)

    # ------------------------------------------------------------------ a round

    async def round(self, targets: Iterable[Target]) -> dict[str, Report]:
        """Visit every target, ``concurrency`` at a time; one :class:`Report` per URL."""
        targets = list(targets)
        urls = [t.url for t in targets]
        if len(set(urls)) != len(urls):
            raise ValueError("each engine URL may appear once in a round")
        self._forget_gone()
        self.finished_at = {}
        reports: dict[str, Report] = {}
        waiting = iter(targets)

        async def reader() -> None:
            # Each reader takes the next engine when its last read is done: at most
            # ``concurrency`` reads at once, and as many tasks, whatever the fleet's size.
            for target in waiting:
                reports[target.url] = report = await self.probe(target)
                self.finished_at[target.url] = time.monotonic()
                if self.on_report is not None:
                    try:
                        self.on_report(target.url, report)
                    except Exception:
                        log.exception("%s: deciding on its read failed", target.url)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.concurrency, len(targets))):
                group.create_task(reader())
        return {t.url: reports[t.url] for t in targets}

    async def probe(self, target: Target) -> Report:
        """One visit: read, judge, and send a canary if (and only if) the judge allows it."""
        memory = self._remember(target)
        proxy = target.proxy or memory.proxy
        reading = await self._read(target.url, proxy, memory, check_health=target.check_health)
        if not proxy and isinstance(reading, Sample) and _comes_back(memory, reading):
            log.warning("%s: its process start time went back to an earlier one (%s): a load "
                        "balancer in front of several engines, not one engine; judged as a "
                        "proxy from now on (GET /v1/models only, never a canary)",
                        target.url, reading.incarnation)
            memory.proxy = proxy = True
            memory.sample = None
            reading = await self._read(target.url, True, memory)
        now = self._clock()
        before = None if proxy else memory.sample
        since_canary = None if memory.canary_at is None else now - memory.canary_at
        judgement = judge(
            before, reading,
            elapsed_s=now - memory.sample_at if before is not None else 0.0,
            in_flight=target.in_flight, stall=memory.stall, since_canary_s=since_canary,
            stalls_excused=target.stalls_excused, cadence=memory.cadence,
            confirm=target.confirm, policy=self.policy_for(memory.profile),
        )
        canary = None
        health: Health | None = None
        evidence = judgement.evidence
        held, wait_s, held_flat_s = self._held(target, memory, before, reading, judgement, now)
        if held is not None:  # conclusive without a canary
            health = Health.CONDEMNED
            evidence = replace(evidence, summary=f"{evidence.summary}; {held}")
        elif wait_s is not None:
            # The request it holds is a canary already sent: it concludes sooner than a new
            # one could time out, and a canary would hold this read for its whole timeout.
            evidence = replace(evidence, summary=f"{evidence.summary}; no canary: its held "
                               f"request concludes in {wait_s:.1f} s if nothing advances")
        elif judgement.send_canary:
            if judgement.verdict is Verdict.RESTARTED:
                memory.model = None  # a new process may serve another model
            memory.canary_at = now
            canary = await self.canary(target.url, memory)
            if (not canary.ok and canary.status is None and judgement.verdict is Verdict.IDLE
                    and before is not None and isinstance(reading, Sample)):
                # An idle engine that answered nothing: a second read tells a wedge (nothing
                # advanced for the canary) from a slow engine (judge.held_its_canary). Never at
                # the first read of an engine: a new process's first generation may be slow
                # (compilation, cold caches) and that is no wedge; a failed probe, as before.
                after = await self._read(target.url, False, memory)
                # Only the same process: a new start time means it restarted during the canary
                # (the canary dropped with the old process), and kept as the sample, the new
                # process would hide its restart from every later read.
                if isinstance(after, Sample) and after.start_time == reading.start_time:
                    held = held_its_canary(reading, after, canary.latency_s,
                                           self.policy_for(memory.profile))
                    reading, now = after, self._clock()
                    if held is not None:
                        health = Health.CONDEMNED
                        evidence = replace(evidence, summary=f"{evidence.summary}; {held}")
            elif canary.ok and isinstance(reading, Sample) and not proxy:
                # The sample kept is read after the canary, with the canary's own work in it:
                # the next read must judge the engine, not our canary (progress only the canary
                # explains reads IDLE, never a lost core, and never flat). One more read of
                # /metrics per canary (history: docs/design.md section 13).
                after = await self._read(target.url, False, memory)
                if isinstance(after, Sample) and after.start_time == reading.start_time:
                    reading, now = after, self._clock()
        tokens_per_s = None
        elapsed = judgement.evidence.elapsed_s
        if elapsed and judgement.evidence.deltas:
            tokens_per_s = judgement.evidence.deltas.get("generation_tokens", 0.0) / elapsed
        # Unless another visit kept a newer sample while this one waited (a tick's canary, 5 s,
        # beside a controller's focused reads of the same engine): this one's older sample,
        # stall and cadence kept over it would turn the engine's history back.
        if now >= memory.sample_at:
            if isinstance(reading, Sample):
                if memory.sample is None or not flat(memory.sample, reading):
                    memory.flat_since = now
                memory.sample, memory.sample_at = reading, now
            memory.stall = judgement.stall
            memory.cadence = judgement.cadence
        return Report(
            url=target.url, verdict=judgement.verdict, evidence=evidence,
            health=health or conclude(judgement, None if canary is None else canary.ok),
            canary_rule=judgement.canary,
            sample=reading if isinstance(reading, Sample) else None,
            tokens_per_s=tokens_per_s, canary=canary,
            incarnation=reading.incarnation if isinstance(reading, Sample) else None,
            engine=memory.profile, held_flat_s=held_flat_s,
            longest_pause_s=(judgement.cadence.gap_at(reading.running + reading.waiting)
                             if isinstance(reading, Sample) else 0.0),
        )

    async def watch_hedged(self, url: str, held_flat_s: float,
                           ) -> tuple[CanaryResult | None, str | None]:
        """A canary for a lost core whose held requests are being hedged away (the caller
        hedges them as this is sent): those requests, cancelled when their hedges answer, will
        not reach the stall limit there, so the canary takes over their watch. It waits what
        they had left of the limit; no answer and no counter advanced condemn
        (:func:`~fleetwarden.judge.held_then_canary`). Returns the canary (``None`` when the
        last read of the engine is not a sample to compare with) and why it condemns, if it
        does."""
        memory = self._memory.get(url)
        if memory is None or memory.sample is None:
            return None, None
        before, policy = memory.sample, self.policy_for(memory.profile)
        limit = memory.cadence.limit(before.running + before.waiting, policy)
        memory.canary_at = self._clock()
        canary = await self.canary(url, memory, timeout_s=max(limit - held_flat_s, 0.1))
        if canary.ok or canary.status is not None:
            return canary, None  # it answered: whatever it is, it is not a wedge
        after = await self._read(url, False, memory)
        if not isinstance(after, Sample):
            return canary, None
        why = held_then_canary(before, after, held_flat_s, canary.latency_s, limit)
        now = self._clock()
        if now >= memory.sample_at:  # as probe keeps it, unless a newer one was kept meanwhile
            if not flat(memory.sample, after):
                memory.flat_since = now
            memory.sample, memory.sample_at = after, now
        return canary, why

    def _held(self, target: Target, memory: _Memory, before: Sample | None,
              reading: Reading, judgement: Judgement,
              now: float) -> tuple[str | None, float | None, float]:
        """What the requests the router holds there say: why they condemn the engine
        (:func:`~fleetwarden.judge.held_its_requests`); else, for a lost core whose held
        request will conclude before a canary sent now could time out, the seconds left (no
        canary then); and how long a held request has gone with no step
        (:attr:`Report.held_flat_s`). ``(None, None, 0.0)`` when it holds none."""
        if (target.held_s <= 0 or target.stalls_excused or before is None
                or not isinstance(reading, Sample)
                or judgement.verdict not in (Verdict.STALLED, Verdict.LOST_CORE)):
            return None, None, 0.0
        flat_for = now - memory.flat_since if flat(before, reading) else 0.0
        held_flat = min(flat_for, target.held_s)
        policy = self.policy_for(memory.profile)
        limit = judgement.cadence.limit(reading.running + reading.waiting, policy)
        worked = any(v > 0 for v in reading.counters().values())
        # A process that never advanced a counter may be in its first generation, which can be
        # slow (compilation, cold caches): its held requests prove nothing, so none is hedged
        # either (a lost race counts against the engine).
        shown = held_flat if worked else 0.0
        why = held_its_requests(flat_for, target.held_s, limit, worked)
        if why is not None or not worked or judgement.verdict is not Verdict.LOST_CORE:
            return why, None, shown
        left = limit - held_flat
        return None, (left if left < policy.canary_timeout_s else None), shown

    def _forget_gone(self) -> None:
        """Drop what is kept of URLs not read for :data:`FORGET_AFTER_S`: a restarted engine's
        old port, a retired shard's URL. Memory that only grows is a leak."""
        cutoff = self._clock() - FORGET_AFTER_S
        for url in [u for u, m in self._memory.items() if m.visited_at < cutoff]:
            del self._memory[url]

    def is_proxy(self, url: str) -> bool:
        """``url`` was found to be a load balancer (its start time came back)."""
        memory = self._memory.get(url)
        return memory is not None and memory.proxy

    def policy_for(self, engine: EngineProfile | None) -> WatchdogPolicy:
        """The policy an engine is judged by: no stall is concluded sooner than its profile's
        ``min_stall_s`` (an engine whose gauges lag can read "running" and flat while healthy).
        """
        if engine is None or engine.min_stall_s <= self.policy.stall_s:
            return self.policy
        return replace(self.policy, stall_s=engine.min_stall_s)

    def _remember(self, target: Target) -> _Memory:
        memory = self._memory.setdefault(target.url, _Memory())
        memory.visited_at = self._clock()
        if target.engine != AUTO and (memory.profile is None
                                      or memory.profile.name != target.engine):
            memory.profile = profile(target.engine)
        return memory

    async def observe(self, target: Target) -> Reading:
        """Read an engine and remember the sample as the baseline; judge and send nothing."""
        memory = self._remember(target)
        reading = await self._read(target.url, target.proxy, memory)
        if isinstance(reading, Sample) and not target.proxy:
            memory.sample, memory.sample_at = reading, self._clock()
        return reading

    # ------------------------------------------------------------------ reads

    async def read(self, url: str, *, proxy: bool = False, engine: str = AUTO) -> Reading:
        """One look at an engine: its metrics, else its liveness. Never raises for I/O."""
        return await self._read(url, proxy, self._remember(Target(url, engine=engine)))

    async def _read(self, url: str, proxy: bool, memory: _Memory, *,
                    check_health: bool = False) -> Reading:
        if proxy:
            models = await self._models(url)
            if isinstance(models, str):
                return Down(f"GET /v1/models: {models}")
            return ProxyAnswered(models)
        known = memory.profile
        if known is not None and not known.has_metrics:
            problem = (f"the {known.name} profile has no /metrics: nothing proves progress; "
                       "canaries when idle and the router's outcomes only")
        else:
            result, found = await self._metrics(url, known)
            if found is not None:
                memory.profile = found
            if isinstance(result, Sample):
                engine = memory.profile
                if check_health and engine is not None and engine.health_proves_core:
                    health = await self._get_status(url + engine.health_path)
                    if health != 200:
                        why = health if isinstance(health, str) else f"answered {health}"
                        return Down(f"{engine.health_path}: {why}, while /metrics answers "
                                    "(its engine core is dead)")
                return result
            problem = result
        path = memory.profile.health_path if memory.profile is not None else "/health"
        health = await self._get_status(url + path)
        if health == 200:
            return NoMetrics(problem)
        why = health if isinstance(health, str) else f"answered {health}"
        return Down(f"/metrics: {problem}; {path}: {why}")

    async def _metrics(self, url: str, known: EngineProfile | None
                       ) -> tuple[Sample | str, EngineProfile | None]:
        """The sample, or why there is none; and the profile it was read by, if any."""
        limit = self.policy.max_metrics_bytes
        try:
            async with self._http().get(url + "/metrics", timeout=self._read_timeout()) as resp:
                if resp.status != 200:
                    return f"/metrics answered {resp.status}", None
                body = await _read_bounded(resp, limit)
                headers = resp.headers
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return _describe(e), None
        if body is None:
            return f"/metrics body over the {limit}-byte limit", None
        engine = known
        if engine is None:
            engine = detect(body[:limit].decode("utf-8", errors="replace"))
            if engine is None:
                return ("no known engine's families in /metrics (vllm, llamacpp, sglang, tgi); "
                        "set engine in the config"), None
        start = headers.get(engine.start_header) if engine.start_header else None
        result = parse(body, max_bytes=limit, profile=engine, start_header=start)
        return (result.reason if isinstance(result, Unreadable) else result), engine

    async def _get_status(self, url: str) -> int | str:
        return await health_status(self._http(), url, read_timeout=self._read_timeout())

    async def _models(self, url: str) -> tuple[str, ...] | str:
        """The served model names, or why they could not be had."""
        try:
            async with self._http().get(url + "/v1/models", timeout=self._read_timeout()) as resp:
                if resp.status != 200:
                    return f"answered {resp.status}"
                body = await _read_bounded(resp, _MODELS_BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return _describe(e)
        try:
            data = json.loads(body or b"")["data"]
            return tuple(str(m["id"]) for m in data)
        except (ValueError, KeyError, TypeError):
            return "not a model list"

    def _read_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.policy.read_timeout_s)

    # ------------------------------------------------------------------ the canary

    async def canary(self, url: str, memory: _Memory | None = None,
                     timeout_s: float | None = None) -> CanaryResult:
        """One tiny completion (``max_tokens`` 1), with the canary timeout (or ``timeout_s``)
        over everything."""
        if memory is None:
            memory = self._memory.setdefault(url, _Memory())
            memory.visited_at = self._clock()
        started = self._clock()
        timeout = self.policy.canary_timeout_s if timeout_s is None else timeout_s

        def result(ok: bool, status: int | None = None, error: str = "") -> CanaryResult:
            return CanaryResult(ok, self._clock() - started, status, error)

        try:
            async with asyncio.timeout(timeout):
                model = self.model or memory.model
                if model is None:
                    models = await self._models(url)
                    if isinstance(models, str) or not models:
                        return result(False, error=f"no model to ask for: GET /v1/models "
                                      f"{models or 'listed none'}")
                    model = memory.model = models[0]
                headers = {"x-request-id": CANARY_ID_PREFIX + uuid.uuid4().hex[:16]}
                payload = {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1,
                           "temperature": 0}
                async with self._http().post(url + "/v1/completions", json=payload,
                                             headers=headers) as resp:
                    body = await _read_bounded(resp, _MODELS_BODY_LIMIT)
                    if resp.status != 200:
                        return result(False, resp.status, f"answered {resp.status}: "
                                      f"{(body or b'')[:200].decode(errors='replace')}")
                    try:
                        choices = json.loads(body or b"")["choices"]
                    except (ValueError, KeyError, TypeError):
                        choices = None
                    if not choices:
                        return result(False, resp.status, "answered 200 without a completion")
                    return result(True, resp.status)
        except TimeoutError:
            return result(False, error=f"no answer within {timeout:g} s")
        except (aiohttp.ClientError, OSError) as e:
            return result(False, error=_describe(e))


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to be over ``limit`` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- one-shot check

EXIT_HEALTHY = 0  # busy, or idle (no metrics, lost core, restarted) with a good canary
EXIT_NOT_SERVING = 1  # stuck, a lost core, or a canary that failed on an idle engine
EXIT_UNREACHABLE = 2  # neither /metrics nor /health answered (or /health not 200)
EXIT_CANNOT_JUDGE = 3  # nothing proved: no metrics and no canary allowed, or still stalled

#: Reads a one-shot check may take: a baseline, a comparison, and more only while the verdict
#: needs them (a stall to be told from a wedge, a restart to be compared within its process).
MAX_CHECK_READS = 5


def exit_code(report: Report) -> int:
    """``fleetwarden check``'s status for a report."""
    if report.health is Health.PROVEN:
        return EXIT_HEALTHY
    if report.verdict is Verdict.UNREACHABLE:
        return EXIT_UNREACHABLE
    if report.health in (Health.CONDEMNED, Health.FAILING):
        return EXIT_NOT_SERVING
    return EXIT_CANNOT_JUDGE


@dataclass(frozen=True, slots=True)
class Check:
    report: Report
    reads: int
    exit_code: int

    def to_dict(self) -> dict[str, Any]:
        return {**self.report.to_dict(), "reads": self.reads, "exit_code": self.exit_code}


async def check(url: str, *, proxy: bool = False, in_flight: int = 0,
                policy: WatchdogPolicy = DEFAULT_POLICY, model: str | None = None,
                engine: str = AUTO) -> Check:
    """One engine, judged once: a baseline read, then reads ``check_interval_s`` apart until the
    verdict is final — a third read only to tell STALLED from STUCK (timed so that the stall
    spans ``stall_s``), or to compare a restarted engine within its new process.

    A proxy is read once, ``GET /v1/models`` only. ``engine`` names the engine's profile
    (``auto``: recognised from ``/metrics``); a stall is never concluded sooner than the
    profile's ``min_stall_s``.
    """
    target = Target(url.rstrip("/"), in_flight=in_flight, proxy=proxy, engine=engine)
    interval_s = policy.check_interval_s
    async with Watchdog(policy, model=model) as watchdog:
        if proxy:
            report = await watchdog.probe(target)
            return Check(report, 1, exit_code(report))
        await watchdog.observe(target)
        reads = 1
        wait = interval_s
        while True:
            await asyncio.sleep(wait)
            report = await watchdog.probe(target)
            reads += 1
            more = report.verdict in (Verdict.STALLED, Verdict.FIRST_READ) or (
                report.verdict is Verdict.RESTARTED and report.canary is None)
            if not more or reads >= MAX_CHECK_READS:
                return Check(report, reads, exit_code(report))
            wait = interval_s
            if report.verdict is Verdict.STALLED:
                stall_s = watchdog.policy_for(report.engine).stall_s
                wait = max(interval_s, stall_s - report.evidence.stalled_for_s)


#: Seconds after its last read that a URL's memory is dropped. An hour: far longer than any
#: tick or canary interval of a URL still in the fleet, so only gone URLs are forgotten.
FORGET_AFTER_S = 3600.0

#: Start times remembered per URL to tell a load balancer from a restarting engine.
_INCARNATIONS_KEPT = 8


def _comes_back(memory: _Memory, sample: Sample) -> bool:
    """True when ``sample``'s start time is one seen before, but not the last one: only a
    proxy answering from several processes does that (note 002)."""
    now = sample.incarnation
    if now is None:
        return False
    seen = memory.incarnations
    back = bool(seen) and seen[-1] != now and now in seen
    if not seen or seen[-1] != now:
        memory.incarnations = [*seen[-(_INCARNATIONS_KEPT - 1):], now]
    return back
