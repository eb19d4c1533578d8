"""The watchdog: the I/O around :mod:`fleetwarden.judge` (docs/design.md section 5, note 002).

Owns: the reads of each engine (``/metrics``, ``/health`` via ``probe.py``, ``/v1/models``),
canaries, and each engine URL's :class:`~fleetwarden.judge.EngineWatch` (with the model a
canary asks for and when the URL was last read).
Must not: decide what a read means (the engine's watch does) or import the ledger.

Each visit is a loop that fetches what the engine's watch asks for, tells it what came, and
stops when it answers a report (:meth:`Watchdog._fetch_for`): the watch says read
``/metrics`` (falling back to ``/health`` when there are none), send a canary (one completion
of ``max_tokens`` 1) with this timeout, read again after it, or read this URL as a proxy from
now on (only ever ``GET /v1/models``: behind a least-connections proxy every ``/metrics``
read may come from another backend, and two of them compared would look like a restart;
``tests/scenario/test_watchdog.py`` shows it).

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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp

from fleetwarden.credentials import Secret
from fleetwarden.engine_metrics import Sample, Unreadable, parse
from fleetwarden.engines import (
    AUTO,
    SERVER_INFO_PATH,
    VLLM,
    CapUnknown,
    EngineProfile,
    detect,
    output_cap_of_server_info,
    output_default_of_server_info,
    profile,
)
from fleetwarden.judge import (
    DEFAULT_POLICY,
    EXIT_CANNOT_JUDGE,
    EXIT_HEALTHY,
    EXIT_NOT_SERVING,
    EXIT_UNREACHABLE,
    Answer,
    Canaried,
    CanaryResult,
    Down,
    EngineWatch,
    Fetch,
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
    Visit,
    WatchdogPolicy,
    asked_wrong,
    exit_code,
)
from fleetwarden.model_files import generation_config_file
from fleetwarden.probe import describe as _describe
from fleetwarden.probe import health_status
from fleetwarden.router.models import ModelCard, cards_of

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
    "read_offsets",
]

log = logging.getLogger(__name__)

#: Every canary carries ``x-request-id: fleetwarden-canary-…``, so an engine's logs (and the
#: simulator's ``/sim/stats``) tell a health check from real traffic.
CANARY_ID_PREFIX = "fleetwarden-canary-"
#: The canary's prompt: a few tokens, so it is one short prefill step on any engine.
CANARY_PROMPT = "ping"
_MODELS_BODY_LIMIT = 1024 * 1024  # a model list is a few KB; a proxy's may list many models
#: vLLM's /server_info is ~25 KB (its config, its environment, ``pip list``); a large
#: environment's package list may make it several times that.
_SERVER_INFO_BODY_LIMIT = 4 * 1024 * 1024
#: Not asked yet: what :meth:`Watchdog.output_cap` says until the engine's process was read.
_NOT_ASKED = CapUnknown("its /server_info not read yet", settled=False)


@dataclass(slots=True)
class _Memory:
    """What the watchdog keeps per engine URL between visits: the judge's watch of it, and
    what only the fetching needs."""

    watch: EngineWatch
    model: str | None = None  # from /v1/models, for the canary; looked up again after a restart
    #: When this URL was last read: a URL no one reads any more is forgotten.
    visited_at: float = 0.0
    #: The models it serves, from its ``/v1/models`` (``None``: not known), and the process
    #: they were read of (:meth:`Watchdog.models`).
    models: tuple[ModelCard, ...] | None = None
    models_of: str | None = None
    models_read: bool = False  # the engine answered /v1/models (a list or not) for models_of
    #: Its server cap as its ``/server_info`` said (:meth:`Watchdog.learn_output_cap`), and
    #: the process it was read of.
    output_cap: int | CapUnknown | None = _NOT_ASKED
    output_cap_of: str | None = None
    #: Its default limit of a request that names none, from the same answer (``None``: none;
    #: unknown where it has no ``/server_info`` or its model's folder is not on this host).
    output_default: int | CapUnknown | None = _NOT_ASKED
    #: The configuration faults already logged for this URL (:meth:`Watchdog._tell_faults`):
    #: one log line per engine and cause, not one per read.
    faults_told: frozenset[str] = frozenset()

    def read(self, report: Report) -> None:
        """A read made: one that saw a new process drops what the old one said of its limits
        and its models before the read is decided on (docs/design.md 4.1, "Server caps"), so
        that they are asked again (:meth:`Watchdog.learn_output_cap`, :meth:`learn_models`)
        and none of it is pushed meanwhile. An
        engine that gives no start time needs it: the ledger names its new process itself
        (``restart-seen-N``), which no read says, so :func:`_said` cannot tell them apart."""
        if report.restarted:
            self.output_cap = self.output_default = _NOT_ASKED
            self.output_cap_of = None
            self.models, self.models_read = None, False  # a new one may serve other models


#: A limit an engine's ``/server_info`` says: tokens, none, or why not known.
_Limit = int | CapUnknown | None


#: What a restarted engine's limits are until its new process was read (docs/design.md 4.1,
#: "Server caps"): not settled, so that the controller tells no missing cap meanwhile.
_NOT_READ_YET = CapUnknown("not read from the new process yet", settled=False)


def _said(memory: _Memory | None, incarnation: str | None) -> tuple[_Limit, _Limit]:
    """The cap and default an engine's ``/server_info`` said, if the process that said them
    is ``incarnation`` (the one the ledger names there now); else not read yet. A restart on
    the same URL (an attached engine, one started again with other flags) is named by the
    read that sees it, and that read is decided on, and may be pushed, before the new process
    is asked: the old process's word may be a bigger cap than the new one's, which a
    continuation sent there would ask past. Read of no named process (an engine that gives no
    start time): what it said, nothing tells its processes apart."""
    if memory is None:
        return _NOT_ASKED, _NOT_ASKED
    if memory.output_cap_of is not None and memory.output_cap_of != incarnation:
        return _NOT_READ_YET, _NOT_READ_YET
    return memory.output_cap, memory.output_default


def _both(unknown: CapUnknown) -> tuple[CapUnknown, CapUnknown]:
    """No ``/server_info`` to read: the cap and the default unknown for the same reason."""
    return unknown, unknown


class _NoModels(NamedTuple):
    """Why the model list could not be had: the status when one came, and in words."""

    status: int | None
    why: str


#: Engines one round reads at once by default (the fleet passes ``health.max_concurrent_reads``).
DEFAULT_CONCURRENCY = 64


class _EngineWord:
    """What an engine says of itself, asked once per process beside the reads (the models it
    serves, its ``/v1/models``; its output limits, its ``/server_info``), and the HTTP session
    every request of the watchdog goes through, each carrying its engine's key."""

    policy: WatchdogPolicy
    key_of: Callable[[str], Secret | None] | None
    _session: aiohttp.ClientSession | None
    _own_session: bool
    _memory: dict[str, _Memory]

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

    def _auth(self, url: str) -> dict[str, str]:
        """The headers that carry ``url``'s key, if its engine wants one."""
        key = None if self.key_of is None else self.key_of(url)
        return {} if key is None else key.bearer()

    def models(self, url: str) -> tuple[ModelCard, ...] | None:
        """The models the engine at ``url`` serves, as its ``/v1/models`` said (``None``: not
        known yet, or it has no model list): what the routers' own ``GET /v1/models`` lists."""
        memory = self._memory.get(url)
        return None if memory is None else memory.models

    async def learn_models(self, report: Report) -> None:
        """After a read that answered: ``/v1/models`` of its engine, once per process (a new
        one may serve other models), one small GET, never a generation. A read that got no
        answer is tried again after the next; an answer that is no model list is kept as none
        until the process changes. Called once the report was decided on, so that a slow
        list delays no verdict."""
        memory = self._memory.get(report.url)
        if memory is None or memory.watch.proxy or not report.answered:
            return
        url, incarnation = report.url, report.incarnation
        if memory.models_read and memory.models_of == incarnation:
            return
        if memory.models_of != incarnation:
            memory.models = None
        cards, answered = await self._model_cards(url)
        memory.models_of, memory.models_read = incarnation, answered
        memory.models = None if isinstance(cards, _NoModels) else cards
        if isinstance(cards, _NoModels) and answered:
            log.info("%s: GET /v1/models %s: the router lists none of its models", url,
                     cards.why)

    def output_cap(self, url: str, incarnation: str | None) -> int | CapUnknown | None:
        """The server cap on every request's output that the engine at ``url`` says (its
        ``/server_info``; ``None``: it caps none), or why that is not known: its process
        ``incarnation``'s word only (:func:`_said`)."""
        return _said(self._memory.get(url), incarnation)[0]

    async def learn_output_cap(self, report: Report) -> None:
        """After a read that answered: a vLLM engine's server cap, from its ``GET
        /server_info`` (dev mode, ``VLLM_SERVER_DEV_MODE=1``), once per process, with its key;
        never on a request's path (docs/design.md 4.1, "Server caps"). One that got no answer
        (vLLM's first answer runs ``pip list`` and more: seconds) is asked again after the next
        read; a 404 (no dev mode) or an answer that does not tell is kept until the process
        changes. Called once the report was decided on, as :meth:`learn_models`."""
        memory = self._memory.get(report.url)
        if memory is None or memory.watch.proxy or not report.answered:
            return
        url, incarnation = report.url, report.incarnation
        known = memory.watch.profile
        if known is not VLLM:
            if known is not None:  # only vLLM has /server_info; the others' caps are declared
                memory.output_cap_of = incarnation
                memory.output_cap = CapUnknown(f"a {known.name} engine shows no server cap")
                # Not "none": a launched one's command (llama-server -n) or a declaration says it
                memory.output_default = CapUnknown(f"a {known.name} engine shows no default limit")
            return
        if memory.output_cap_of == incarnation and not (
                isinstance(memory.output_cap, CapUnknown) and not memory.output_cap.settled):
            return
        if memory.output_cap_of != incarnation:
            memory.output_cap = _NOT_ASKED  # a new process may have been started otherwise
            memory.output_default = _NOT_ASKED
        said = await self._server_cap(url)
        memory.output_cap_of, memory.output_cap = incarnation, said[0]
        memory.output_default = said[1]

    def output_default(self, url: str, incarnation: str | None) -> int | CapUnknown | None:
        """The default limit of a request that names none that the engine at ``url`` shows
        (its ``/server_info``'s model folder, read on this host): ``None``: none; else why it
        is not known. Its process ``incarnation``'s word only, as :meth:`output_cap`."""
        return _said(self._memory.get(url), incarnation)[1]

    async def _server_cap(self, url: str) -> tuple[_Limit, _Limit]:
        try:
            async with self._http().get(url + SERVER_INFO_PATH, timeout=self._read_timeout(),
                                        headers=self._auth(url)) as resp:
                if resp.status == 404:
                    return _both(CapUnknown("no GET /server_info (vLLM shows it only with "
                                            "VLLM_SERVER_DEV_MODE=1)"))
                if resp.status != 200:
                    return _both(CapUnknown(f"GET /server_info answered {resp.status}",
                                            settled=resp.status < 500))
                body = await _read_bounded(resp, _SERVER_INFO_BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return _both(CapUnknown(f"GET /server_info: {_describe(e)}", settled=False))
        if body is None:
            return _both(CapUnknown(f"GET /server_info over {_SERVER_INFO_BODY_LIMIT} bytes"))
        return (output_cap_of_server_info(body, generation_config_file),
                output_default_of_server_info(body, generation_config_file))

    async def _models(self, url: str) -> tuple[str, ...] | _NoModels:
        """The served model names, or why they could not be had."""
        cards, _ = await self._model_cards(url)
        return cards if isinstance(cards, _NoModels) else tuple(card.id for card in cards)

    async def _model_cards(self, url: str) -> tuple[tuple[ModelCard, ...] | _NoModels, bool]:
        """The served models' cards, or why they could not be had; and whether the engine
        answered at all."""
        try:
            async with self._http().get(url + "/v1/models", timeout=self._read_timeout(),
                                        headers=self._auth(url)) as resp:
                if resp.status != 200:
                    return _NoModels(resp.status, f"answered {resp.status}"), True
                body = await _read_bounded(resp, _MODELS_BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return _NoModels(None, _describe(e)), False
        cards = cards_of(body or b"")
        return (_NoModels(None, cards) if isinstance(cards, str) else cards), True

    def _read_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.policy.read_timeout_s)


class Watchdog(_EngineWord):
    """Visits engines and judges them. Use as ``async with Watchdog() as watchdog:``.

    ``model`` names the model a canary asks for; without it, each engine's ``/v1/models`` is
    asked once (and again after a restart). ``clock`` is monotonic seconds (inject one in tests).
    """

    def __init__(self, policy: WatchdogPolicy = DEFAULT_POLICY, *, model: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 session: aiohttp.ClientSession | None = None,
                 concurrency: int = DEFAULT_CONCURRENCY,
                 key_of: Callable[[str], Secret | None] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.policy = policy
        #: Engines a round reads at once (``health.max_concurrent_reads``).
        self.concurrency = concurrency
        self.model = model
        #: The API key each engine URL wants (``credentials.EngineKeys``), carried by every
        #: request sent there; ``None``: none wants one.
        self.key_of = key_of
        self._clock = clock
        self._session = session
        self._own_session = session is None
        self._memory: dict[str, _Memory] = {}
        #: When each read of the last round finished (monotonic seconds, by URL): how long its
        #: evidence then waited for the round's end (the controller's evidence-to-decision).
        self.finished_at: dict[str, float] = {}

    async def __aenter__(self) -> Watchdog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def forget(self, url: str) -> None:
        """Drop what is remembered of an engine (it left the fleet, or moved)."""
        self._memory.pop(url, None)

    # ------------------------------------------------------------------ a round

    async def round(self, targets: Iterable[Target], *, spread_s: float = 0.0,
                    fresh: Callable[[Target], Awaitable[Target | None]] | None = None,
                    on_report: Callable[[str, Report], None] | None = None,
                    ) -> dict[str, Report]:
        """Visit every target, ``concurrency`` at a time; one :class:`Report` per URL read.

        ``spread_s``: when each target is read, :func:`read_offsets` (engines never read
        first and at once, the others in slices spread over ``spread_s``); a reader free before
        its next target is due waits for it, one that is late reads at once, so a round
        takes ``spread_s`` or, when the reads are slower, what they take. ``fresh``: called
        with each target just before its read, for what the routers know about it now
        (``None``: no longer to be read, left out of the round). ``on_report``: called with
        each read as it finishes, before the round goes on (a crash in it is logged)."""
        targets = list(targets)
        urls = [t.url for t in targets]
        if len(set(urls)) != len(urls):
            raise ValueError("each engine URL may appear once in a round")
        self._forget_gone()
        self.finished_at = {}
        reports: dict[str, Report] = {}
        known = [t.url in self._memory for t in targets]
        offsets = read_offsets(known, self.concurrency, spread_s)
        # Never read first (known sorts after unknown), then by when due, then in order.
        order = sorted(range(len(targets)), key=lambda k: (known[k], offsets[k], k))
        waiting = ((offsets[k], targets[k]) for k in order)
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def reader() -> None:
            # Each reader takes the next engine when its last read is done: at most
            # ``concurrency`` reads at once, and as many tasks, whatever the fleet's size.
            for offset, target in waiting:
                due = started + offset
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                now = target if fresh is None else await fresh(target)
                if now is None:
                    continue
                reports[now.url] = report = await self.probe(now)
                self.finished_at[now.url] = time.monotonic()
                if on_report is not None:
                    try:
                        on_report(now.url, report)
                    except Exception:
                        log.exception("%s: deciding on its read failed", now.url)
                await self.learn_models(report)
                await self.learn_output_cap(report)

        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.concurrency, len(targets))):
                group.create_task(reader())
        return {t.url: reports[t.url] for t in targets if t.url in reports}

    async def probe(self, target: Target) -> Report:
        """One visit: the watch of the engine says what to fetch (a read, a canary, a read
        after it) until it has its report; this only fetches."""
        memory = self._remember(target)
        step = memory.watch.next(Visit(target, self._clock()))
        report = await self._fetch_for(target.url, memory, step)
        assert report is not None  # a visit always ends in a report
        self._tell_faults(target.url, memory, report.faults)
        memory.read(report)
        return report

    @staticmethod
    def _tell_faults(url: str, memory: _Memory, faults: tuple[str, ...]) -> None:
        """Log each configuration fault of an engine once, when first seen (and again if it
        comes back after it was gone): loud, but not once per read."""
        for fault in faults:
            if fault not in memory.faults_told:
                log.warning("%s: configuration fault, not held against the engine: %s",
                            url, fault)
        memory.faults_told = frozenset(faults)

    async def watch_hedged(self, report: Report) -> Report | None:
        """A canary for a lost core whose held requests are being hedged away (the caller
        hedges them as this is sent; ``report`` is the read that found it): those requests,
        cancelled when their hedges answer, will not reach the stall limit there, so the canary
        takes over their watch (:class:`~fleetwarden.judge.Hedged`). Returns the report that
        condemns the engine, or ``None`` when nothing was concluded."""
        memory = self._memory.get(report.url)
        if memory is None:
            return None
        step = memory.watch.next(Hedged(report, self._clock()))
        return await self._fetch_for(report.url, memory, step)

    async def _fetch_for(self, url: str, memory: _Memory,
                         step: Report | Fetch | None) -> Report | None:
        """Fetch what the engine's watch asks for, and tell it what came, until it answers."""
        watch = memory.watch
        while isinstance(step, ReadEngine | SendCanary):
            if isinstance(step, ReadEngine):
                if step.why:
                    log.warning("%s: %s", url, step.why)
                reading = await self._read(url, step.proxy, memory,
                                           check_health=step.check_health,
                                           timeout_s=step.timeout_s,
                                           silence_counts=step.silence_counts)
                step = watch.next(Read(step.visit, reading, self._clock()))
            else:
                if step.new_model:
                    memory.model = None  # a new process may serve another model
                result = await self.canary(url, memory, timeout_s=step.timeout_s)
                step = watch.next(Canaried(step.visit, result, self._clock()))
        return step

    def _forget_gone(self) -> None:
        """Drop what is kept of URLs not read for :data:`FORGET_AFTER_S`: a restarted engine's
        old port, a retired shard's URL. Memory that only grows is a leak."""
        cutoff = self._clock() - FORGET_AFTER_S
        for url in [u for u, m in self._memory.items() if m.visited_at < cutoff]:
            del self._memory[url]

    def is_proxy(self, url: str) -> bool:
        """``url`` was found to be a load balancer (its start time came back)."""
        memory = self._memory.get(url)
        return memory is not None and memory.watch.proxy

    def _remember(self, target: Target) -> _Memory:
        memory = self._memory.get(target.url)
        if memory is None:
            memory = self._memory[target.url] = _Memory(EngineWatch(self.policy))
        memory.visited_at = self._clock()
        known = memory.watch.profile
        if target.engine != AUTO and (known is None or known.name != target.engine):
            memory.watch.profile = profile(target.engine)
        return memory

    async def observe(self, target: Target) -> Reading:
        """Read an engine and remember the sample as the baseline; judge and send nothing."""
        memory = self._remember(target)
        reading = await self._read(target.url, target.proxy, memory)
        memory.watch.keep_baseline(reading, self._clock(), proxy=target.proxy)
        return reading

    # ------------------------------------------------------------------ reads

    async def read(self, url: str, *, proxy: bool = False, engine: str = AUTO) -> Reading:
        """One look at an engine: its metrics, else its liveness. Never raises for I/O."""
        return await self._read(url, proxy, self._remember(Target(url, engine=engine)))

    async def _read(self, url: str, proxy: bool, memory: _Memory, *,
                    check_health: bool = False, timeout_s: float | None = None,
                    silence_counts: bool = True) -> Reading:
        if proxy:
            models = await self._models(url)
            if isinstance(models, _NoModels):
                return Down(f"GET /v1/models: {models.why}",
                            _answer("/v1/models", models.status), models.status)
            return ProxyAnswered(models)
        known = memory.watch.profile
        answers: tuple[Answer, ...] = ()
        if known is not None and not known.has_metrics:
            problem = (f"the {known.name} profile has no /metrics: nothing proves progress; "
                       "canaries when idle and the router's outcomes only")
        else:
            result, found, status = await self._metrics(url, known, timeout_s)
            answers += _answer("/metrics", status)
            if found is not None:
                memory.watch.profile = found
            if isinstance(result, Silent) and not silence_counts:
                result = result.reason  # nothing waits there: /health says the rest
            elif isinstance(result, Silent):
                # It took the connection and answered nothing for the whole read timeout: its
                # /health would keep it as long again (a SIGSTOPped process, a black hole), and
                # an answer there would not undo this silence (docs/design.md, "Silence is
                # evidence").
                return result
            if isinstance(result, Sample):
                engine = memory.watch.profile
                if check_health and engine is not None and engine.health_proves_core:
                    health = await self._get_status(url, engine.health_path)
                    # A refusal ("you asked wrong": a key it wants) says nothing of its core.
                    if health != 200 and not (isinstance(health, int) and asked_wrong(health)):
                        why = health if isinstance(health, str) else f"answered {health}"
                        return Down(f"{engine.health_path}: {why}, while /metrics answers "
                                    "(its engine core is dead)")
                return result
            problem = result
        known = memory.watch.profile
        path = known.health_path if known is not None else "/health"
        health = await self._get_status(url, path)
        if health == 200:
            return NoMetrics(problem, answers)
        why = health if isinstance(health, str) else f"answered {health}"
        status = health if isinstance(health, int) else None
        return Down(f"/metrics: {problem}; {path}: {why}", answers + _answer(path, status),
                    status)

    async def _metrics(self, url: str, known: EngineProfile | None,
                       timeout_s: float | None = None,
                       ) -> tuple[Sample | Silent | str, EngineProfile | None, int | None]:
        """The sample, silence (no answer within ``timeout_s``, the read timeout when
        ``None``), or why there is none; the profile it was read by, if any; and the status
        when it was not 200."""
        limit = self.policy.max_metrics_bytes
        waited = self.policy.read_timeout_s if timeout_s is None else timeout_s
        try:
            async with self._http().get(url + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=waited),
                                        headers=self._auth(url)) as resp:
                if resp.status != 200:
                    return f"/metrics answered {resp.status}", None, resp.status
                body = await _read_bounded(resp, limit)
                headers = resp.headers
        except TimeoutError:
            return (Silent(f"/metrics: no answer within {waited:g} s", waited_s=waited), None,
                    None)
        except (aiohttp.ClientError, OSError) as e:
            return _describe(e), None, None
        if body is None:
            return f"/metrics body over the {limit}-byte limit", None, None
        engine = known
        if engine is None:
            engine = detect(body[:limit].decode("utf-8", errors="replace"))
            if engine is None:
                return ("no known engine's families in /metrics (vllm, llamacpp, sglang, tgi); "
                        "set engine in the config"), None, None
        start = headers.get(engine.start_header) if engine.start_header else None
        result = parse(body, max_bytes=limit, profile=engine, start_header=start)
        return (result.reason if isinstance(result, Unreadable) else result), engine, None

    async def _get_status(self, base: str, path: str) -> int | str:
        return await health_status(self._http(), base + path, read_timeout=self._read_timeout(),
                                   headers=self._auth(base))

    # ------------------------------------------------------------------ the canary

    async def canary(self, url: str, memory: _Memory | None = None,
                     timeout_s: float | None = None) -> CanaryResult:
        """One tiny completion (``max_tokens`` 1), with the canary timeout (or ``timeout_s``)
        over everything."""
        if memory is None:
            memory = self._remember(Target(url))
        started = self._clock()
        timeout = self.policy.canary_timeout_s if timeout_s is None else timeout_s

        def result(ok: bool, status: int | None = None, error: str = "") -> CanaryResult:
            return CanaryResult(ok, self._clock() - started, status, error)

        try:
            async with asyncio.timeout(timeout):
                model = self.model or memory.model
                if model is None:
                    models = await self._models(url)
                    if isinstance(models, _NoModels) or not models:
                        why = models.why if isinstance(models, _NoModels) else "listed none"
                        status = models.status if isinstance(models, _NoModels) else None
                        return CanaryResult(False, self._clock() - started, status,
                                            f"no model to ask for: GET /v1/models {why}",
                                            request="GET /v1/models")
                    model = memory.model = models[0]
                headers = {"x-request-id": CANARY_ID_PREFIX + uuid.uuid4().hex[:16],
                           **self._auth(url)}
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
            # It waited its whole timeout: asyncio fires a timer up to its clock resolution
            # early, and a latency a hair under the timeout once made a held canary's span
            # fall short of the stall limit it was sized to reach (history: docs/design.md
            # section 13).
            waited = max(self._clock() - started, timeout)
            return CanaryResult(False, waited, None, f"no answer within {timeout:g} s")
        except (aiohttp.ClientError, OSError) as e:
            return result(False, error=_describe(e))


def read_offsets(known: list[bool], concurrency: int, spread_s: float) -> list[float]:
    """When each target of a round is due, in seconds from the round's start (``known``: the
    watchdog has read that engine before). An engine never read is due at once: until its
    first read it serves on trust alone, and a new fleet (or a new engine) is confirmed as
    fast as the readers allow. The others go in slices of ``concurrency``, in their order, the
    slices' starts spread evenly over ``spread_s`` (one slice: all at once): the steady reads
    of a large fleet, kept even over the interval."""
    slices = -(-sum(known) // concurrency)
    offsets: list[float] = []
    k = 0
    for seen in known:
        if not seen:
            offsets.append(0.0)
            continue
        offsets.append((k // concurrency) * spread_s / slices)
        k += 1
    return offsets


def _answer(path: str, status: int | None) -> tuple[Answer, ...]:
    """``path``'s answer as a read records it: its status when one came that was not 200."""
    return () if status is None or status == 200 else ((path, status),)


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

#: Reads a one-shot check may take: a baseline, a comparison, and more only while the verdict
#: needs them (a stall to be told from a wedge, a restart to be compared within its process).
MAX_CHECK_READS = 5


@dataclass(frozen=True, slots=True)
class Check:
    report: Report
    reads: int
    exit_code: int
    #: Its server cap on every request's output, as its ``/server_info`` said (``None``: it
    #: caps none), or why that is unknown: an attached engine's cap is then to be declared.
    output_cap: int | CapUnknown | None = _NOT_ASKED
    #: Its default limit of a request that names none (a chat's), from the same answer
    #: (its model folder, where that is on this host), or why that is unknown.
    output_default: int | CapUnknown | None = _NOT_ASKED

    def to_dict(self) -> dict[str, Any]:
        cap, default = self.output_cap, self.output_default
        return {**self.report.to_dict(), "reads": self.reads, "exit_code": self.exit_code,
                "output_cap": None if isinstance(cap, CapUnknown) else cap,
                "output_cap_unknown": cap.why if isinstance(cap, CapUnknown) else None,
                "output_default": None if isinstance(default, CapUnknown) else default,
                "output_default_unknown": (default.why if isinstance(default, CapUnknown)
                                           else None)}


async def check(url: str, *, proxy: bool = False, in_flight: int = 0,
                policy: WatchdogPolicy = DEFAULT_POLICY, model: str | None = None,
                engine: str = AUTO, key: Secret | None = None) -> Check:
    """One engine, judged once: a baseline read, then reads ``check_interval_s`` apart until the
    verdict is final — a third read only to tell STALLED from STUCK (timed so that the stall
    spans ``stall_s``), or to compare a restarted engine within its new process.

    A proxy is read once, ``GET /v1/models`` only. ``engine`` names the engine's profile
    (``auto``: recognised from ``/metrics``); a stall is never concluded sooner than the
    profile's ``min_stall_s``. ``key``: the engine's API key, carried by every request.
    """
    target = Target(url.rstrip("/"), in_flight=in_flight, proxy=proxy, engine=engine)
    interval_s = policy.check_interval_s
    async with Watchdog(policy, model=model, key_of=lambda _url: key) as watchdog:
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
            if not report.compare_again or reads >= MAX_CHECK_READS:
                await watchdog.learn_output_cap(report)
                said = (target.url, report.incarnation)
                return Check(report, reads, exit_code(report), watchdog.output_cap(*said),
                             watchdog.output_default(*said))
            wait = report.compare_in(interval_s)


#: Seconds after its last read that a URL's memory is dropped. An hour: far longer than any
#: tick or canary interval of a URL still in the fleet, so only gone URLs are forgotten.
FORGET_AFTER_S = 3600.0
