"""Forwarding one request: pick a backend, send, hand the answer to the relay, count.

Owns: the attempt loop, one request's way through the backends (pick, try, retry, wait for
an engine coming back, continue a stream, give up with the answer that fits). Beside it, by
job: a client's request read into its exchange (:mod:`~fleetwarden.router.intake`), one try
on one backend and a hedge's race (:mod:`~fleetwarden.router.attempts`), the waits the fleet's
commands act on (:mod:`~fleetwarden.router.waiting`), the relay of an answer to its client
(:mod:`~fleetwarden.router.relay`), the failures counted (:mod:`~fleetwarden.router.tally`),
the cache-aware index kept in step with the fleet (:mod:`~fleetwarden.router.cache_sync`), the
engines' limits learnt (:mod:`~fleetwarden.router.limits_learning`), the router's own answers
(:mod:`~fleetwarden.router.answers`) and the records an exchange's attempts share
(:mod:`~fleetwarden.router.exchange`).
Must not: decide health or change the serving set: it reports outcomes, the controller and the
ledger judge.

The imperative shell around :class:`~fleetwarden.router.pool.Pool`. Its rules (docs/design.md
section 4):

* Upstream statuses pass through untouched. A transport error (refused, reset, timeout), or a
  5xx before any byte reached the client, is a backend failure, and so is a whole 200 whose
  generation the engine aborted (vLLM's ``finish_reason`` "abort": what a vLLM shut down with
  SIGTERM answers for what it held, truncated); a completed 2xx/3xx response
  is a success; a 4xx (429 included) is neither: the client's request was at fault, and an
  engine whose core is wedged still answers validation errors from its API process.
* A request that has sent nothing to its client can be re-sent elsewhere: freely if it never
  reached an engine (refused, connect timeout), at most ``max_retries`` times and within the
  fleet's retry budget if an engine may have worked on it. The same 5xx from every engine the
  request may try (:func:`~fleetwarden.router.pool.poison_quorum`) marks the request itself as
  the problem (poison): it is answered with that 5xx, and counted against none of them. A 5xx
  is held until the request ends: counted once another engine has answered the request, or
  when no other engine repeated it (:func:`~fleetwarden.router.pool.blamed_5xx`).
* While a request waits on a backend with nothing sent to its client, the controller may
  :meth:`WaitingRequests.rescue` it: it is cancelled there and re-sent elsewhere at once.
* A request held on a backend is one that has received nothing from it: waiting for its head,
  or a stream with its head and no event since its send or its last event (a stream's head
  comes at once; its tokens are the evidence). :meth:`WaitingRequests.silent` reports both alike, so
  a stream parked on a wedge accuses its engine as fast as a request waiting there does.
* The controller may also :meth:`WaitingRequests.hedge` a backend that holds requests while it takes
  no step: each request waiting there long enough with nothing sent to its client is sent to
  another backend as well, and the first answer is the client's; the other attempt is
  cancelled (its engine sees the disconnect and aborts). The engine keeps its chance: a long
  step that ends answers as before; when the hedge answers first, the held attempt lost a
  race (``hedged``): its engine leaves this router's list until the next push, and nothing
  is reported against it (a long step looks the same as a wedge until it ends; only the
  stall limit condemns). A hedge takes a token of the
  retry budget while it is in flight, unless its backend is already out of the serving set
  (then, as for a reflex drop, it moves load rather than adding to it). Streams the router
  continues are never hedged (two engines cannot write one client's stream): one held as long
  is moved instead, continued elsewhere at once as a rescue does, and its engine has failed it
  (``hedged``), as if it had lost the race.
* A streamed completion or chat whose engine fails it after its first bytes reached the client
  (a crash, a reset, a rescue from a wedge) is continued on another engine with the same
  weights, from the tokens already produced, and spliced into the client's stream
  (:mod:`fleetwarden.router.splice` decides and rewrites; this module does the I/O). One that
  cannot be continued ends with an error event naming the cause, never with a silent cut.
* When it cannot serve, the router answers deliberately: ``status_when_others_serve`` (500)
  while backends remain, ``status_when_none_left`` (409) when none does. Never 504: clients
  retry it without bound. A request that finds none while the controller's push says an engine
  is coming back waits for the next push, ``comeback_wait_s`` at most, before that 409: a
  rolling restart leaves a small fleet none for the moment between one engine's stop and the
  last one's admission (docs/design.md, "None left, one coming"). (An exception that escapes
  a handler is answered 500 by the server, :mod:`fleetwarden.router.serve`; none is meant
  to.)
* Every answer an engine produced carries the weight version and shard index the controller's
  push gave that engine (``x-fleetwarden-weight-version``, ``x-fleetwarden-shard``). A request
  with ``x-fleetwarden-min-weight-version: N`` is sent only to engines at version N or later;
  when none is, it is answered ``status_when_none_left`` (409), type
  ``weight_version_unavailable``, naming the versions that serve.
* The router decides nothing about health. Its one local act, the reflex drop, happens only
  when fleet health drives membership (``health_managed``), so that the next push undoes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any

from fleetwarden.router.affinity import Affinity, AffinitySettings
from fleetwarden.router.answers import DESCRIPTIONS, OwnAnswers
from fleetwarden.router.attempts import Attempts
from fleetwarden.router.cache_sync import CacheSync
from fleetwarden.router.exchange import Exchange, Failure, Hold, Stream, Won
from fleetwarden.router.intake import Intake
from fleetwarden.router.kv_events import KVEvents
from fleetwarden.router.kv_index import KVIndex
from fleetwarden.router.limits_learning import LimitsLearner
from fleetwarden.router.pool import Pool
from fleetwarden.router.relay import Relay
from fleetwarden.router.retry import AfterFailure, Cause, Retries, settle
from fleetwarden.router.serve import RawHeaders, Request, Response, StreamResponse
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.splice import ABORTED_ERROR, CompletionDefault, EngineLimits, Splice
from fleetwarden.router.stats import RouterStats
from fleetwarden.router.tally import Tally
from fleetwarden.router.waiting import WaitingRequests

__all__ = ["Forwarder"]

log = logging.getLogger("fleetwarden.router")


class Forwarder:
    """The attempt loop: each request tried on the pool's backends until one answers or it
    gives up, with the jobs beside it (its intake, its attempts, the waits, the relay) made
    and joined here."""

    def __init__(self, pool: Pool, settings: RouterSettings, stats: RouterStats, *,
                 health_managed: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.stats = stats
        #: The failures of its attempts, counted where they count (and the reflex drop).
        self.tally = Tally(pool, settings, stats, health_managed=health_managed)
        #: The router's own answers (it cannot serve, a version none holds, its own trouble).
        self.answers = OwnAnswers(pool, settings, stats)
        #: Engines the last push said are coming back (:meth:`pushed`), and the event the
        #: requests waiting for one wait on: set, and replaced, at every push.
        self.coming_back = 0
        self._push_seen = asyncio.Event()
        #: The requests each backend holds, and the fleet's commands on them (rescue, hedge,
        #: a weight load with the requests kept, the silence read).
        self.waiting = WaitingRequests(pool, stats, self._hedge)
        #: Each engine's context length and server caps (:class:`EngineLimits`), as the
        #: pushes say them and the engines' ``/v1/models`` tell.
        self.limits = EngineLimits(unsaid=CompletionDefault.FIXED if settings.upstream_fields
                                   else CompletionDefault.UNKNOWN)
        self.learner = LimitsLearner(pool, self.limits)
        #: The answers on their way to their clients.
        self.relay = Relay(pool, stats, self.waiting, self.answers, self.limits,
                           count_failure=self.tally.count_failure,
                           learn_context=self.learner.learn_context)
        #: Each try on one backend, and the hedges that race them.
        self.attempts = Attempts(pool, settings, stats, self.tally, self.waiting, self.relay)
        #: The cache-aware policy's index (router/affinity.py); None: least in flight.
        self.affinity: Affinity | None = None
        #: The policy's index kept in step with the serving set, and the engines' KV events
        #: (router/cache_sync.py); None: least in flight.
        self.cache: CacheSync | None = None
        if settings.routing == "cache_aware":
            self.affinity = Affinity(AffinitySettings.of(settings))
            if settings.kv_events:
                # A gap no replay fills is served by the guess for the guess's own lifetime.
                self.affinity.precise = KVIndex(self.affinity.settings.token_block,
                                                resync_s=settings.cache_ttl_s)
            self.cache = CacheSync(pool, settings, self.affinity)
        #: Each client request read once, into the exchange its attempts share.
        self.intake = Intake(settings, stats, self.answers, self.affinity)

    @property
    def kv_events(self) -> KVEvents | None:
        """The subscriptions to the engines' KV events, opened with the forwarder; None:
        cache-aware routing off, or ``kv_events`` off."""
        return None if self.cache is None else self.cache.kv_events

    def sync_affinity(self) -> None:
        """A push arrived: the cache-aware policy follows it (:meth:`CacheSync.sync`)."""
        if self.cache is not None:
            self.cache.sync()

    def pushed(self, coming_back: int) -> None:
        """A push arrived: the requests waiting for a backend look again."""
        self.coming_back = coming_back
        seen, self._push_seen = self._push_seen, asyncio.Event()
        seen.set()

    async def _wait_for_comeback(self, ex: Exchange) -> bool:
        """No backend is left for ``ex``: wait for the next push while one is coming back,
        until ``comeback_wait_s`` from the first time it found none. True: look again."""
        if self.coming_back <= 0:
            return False
        now = time.monotonic()
        if ex.none_left_since is None:
            ex.none_left_since = now
            self.stats.comeback_waits += 1
        left = ex.none_left_since + self.settings.comeback_wait_s - now
        if left <= 0:
            return False
        try:
            async with asyncio.timeout(left):
                await self._push_seen.wait()
        except TimeoutError:
            return False
        # A push: the backends it serves are tried afresh, those this request tried before
        # too (an engine that refused it may be the one back, as a new process at its URL).
        ex.tried.clear()
        return True

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        client = self.attempts.open()
        self.learner.open(client, self.attempts.target)
        if self.cache is not None:
            self.cache.open(client, self.attempts.target)

    async def close(self) -> None:
        self.learner.close()
        if self.cache is not None:
            await self.cache.close()
        await self.attempts.close()

    # ------------------------------------------------------------------ the request path

    async def forward(self, request: Request) -> StreamResponse:
        """Answer one allowlisted request through the fleet: attempts until one answers or
        the request gives up (:mod:`~fleetwarden.router.retry` says which after each failure;
        this loop does what it says)."""
        started = time.perf_counter()
        self.stats.requests += 1
        body = await self.intake.read_body(request)
        if isinstance(body, Response):
            return body
        ex = self.intake.exchange(request, body, started)
        if isinstance(ex, Response):
            return ex
        budget = self.pool.retry_budget
        budget.requests_in_flight += 1
        try:
            while True:
                stream = ex.stream
                backend: str | StreamResponse | None
                if stream is not None and stream.began:
                    backend = await self._continue_on(ex, stream)
                else:
                    backend = self._pick(ex)
                    if backend is None:
                        if await self._wait_for_comeback(ex):
                            continue
                        return self.answers.refuse(ex.last, ex.min_version)
                    if ex.none_left_since is not None and isinstance(backend, str):
                        self.stats.comeback_served += 1
                        ex.none_left_since = None
                    ex.crossed.clear()  # sent again from the start: its tokens come afresh
                if not isinstance(backend, str):
                    return backend
                if ex.resend is not None and ex.resend is not AfterFailure.AT_ONCE:
                    self.stats.retries[ex.resend.value] += 1
                ex.tried.append(backend)
                answer = await self.attempts.send(ex, backend)
                if not isinstance(answer, Failure):
                    ex.answered = True
                    return answer
                if answer.cause is Cause.ABORTED or (
                        answer.cause is Cause.STREAM_ERROR and stream is not None
                        and stream.splice.error is ABORTED_ERROR):
                    self.tally.aborted(answer)
                ex.answered = ex.answered or (stream is not None and stream.began)
                step = self._after_failure(ex, answer)
                if not step.resends:
                    return await self._give_up(ex, answer, step)
        finally:
            if ex.held:
                self.tally.settle_held(ex)
            budget.requests_in_flight -= 1
            if ex.retries is not None:
                ex.retries.release()

    def _after_failure(self, ex: Exchange, failure: Failure) -> AfterFailure:
        """What follows a failed attempt (:mod:`~fleetwarden.router.retry`), with the failure
        counted where it counts."""
        stream = ex.stream
        began = stream is not None and stream.began
        step = settle(failure.cause, streamed=stream is not None, began=began,
                      finished=began and stream is not None and stream.splice.finished(),
                      same_5xx_again=failure.cause is Cause.SERVER_ERROR
                      and self.tally.poison(ex, failure))
        if step is None:
            self.tally.count(ex, failure, began)
            if ex.retries is None:  # the first failure that counts: most requests have none
                ex.retries = Retries(self.pool.retry_budget, self.settings.max_retries)
            step = ex.retries.resend(failure.cause, began=began, replaced=(
                self.tally.health_managed and failure.backend not in self.pool.serving))
        elif step is AfterFailure.AT_ONCE and failure.cause is Cause.HEDGED:
            # A stream moved off an engine that held it without a step
            # (:meth:`WaitingRequests._move_streams`): a lost race, that engine's failure only
            # on a lost core; the stream goes on at once, as a rescued one does.
            if failure.race_fails:
                self.tally.count_failure(failure)
            else:
                self.tally.lost_race(failure)
        ex.last, ex.resend = failure, step
        return step

    async def _give_up(self, ex: Exchange, failure: Failure, step: AfterFailure
                       ) -> StreamResponse:
        """The answer of a request that is re-sent no more (``step``)."""
        if step is AfterFailure.WHOLE:
            # Its final chunk was read: the generation is whole whatever became of [DONE], a
            # success of the engine, never continued past its end.
            assert ex.stream is not None
            self.relay.whole(failure.backend, ex.stream.splice)
            return await self.relay.end_whole(ex.request, ex.stream, failure.backend)
        if step is AfterFailure.POISON:
            # The same 5xx from every engine it may try: the request is the problem, not
            # them. None is counted, and their reflex drops are undone (at its end).
            self.stats.poison_requests += 1
            ex.held.append(failure)  # one of the same 5xx: the others are not alone
            return self.relay.pass_through(failure)
        if step is AfterFailure.EXHAUSTED:
            # The router's own trouble: no engine is blamed, none is tried next.
            self.stats.local_exhaustion += 1
            log.warning("%s: %s", failure.backend, DESCRIPTIONS[failure.cause])
            return self.answers.exhausted()
        # Not re-sent (max_retries, or the fleet's retry budget is spent): the engine's own
        # 5xx goes back as it is; a transport failure gets the router's answer.
        if step is AfterFailure.END_STREAM:
            assert ex.stream is not None
            return await self.relay.end_stream(ex.stream, failure, "retries spent")
        if step is AfterFailure.PASS_THROUGH:
            return self.relay.pass_through(failure)  # the engine's answer, as it stands
        return self.answers.refuse(failure, ex.min_version)

    async def _continue_on(self, ex: Exchange, stream: Stream) -> str | StreamResponse:
        """Bytes reached the client: the generation goes on elsewhere, from where it is, on
        the same weights; where it cannot, the stream ends with why."""
        backend = self.pool.pick_same_weights(stream.weight_version, ex.tried)
        while backend is None and await self._wait_for_comeback(ex):
            # None left, one coming: the stream waits for it as a new request would.
            backend = self.pool.pick_same_weights(stream.weight_version, ex.tried)
        if backend is None:
            return await self.relay.end_stream(stream, ex.last,
                                          "no other backend with the same weights")
        if ex.none_left_since is not None:
            self.stats.comeback_served += 1
            ex.none_left_since = None
        # The limits of the engine that began it, learnt before (never read here, outside
        # every rescue and hedge); a chat with no limit on an engine whose context length is
        # not known yet is refused.
        limits, began_on = self.limits, stream.began_on
        rule = limits.completion_rule(began_on)
        no_limit = stream.splice.request.names_no_limit(rule)
        plan = stream.splice.cut().continuation(
            max_model_len=None if began_on is None else limits.context.get(began_on),
            upstream_fields=self.attempts.takes_fields(backend),
            output_cap=limits.output_cap(began_on, no_limit),
            next_output_cap=limits.output_cap(backend, False),
            began_unknown=limits.unknown_cap(began_on, no_limit),
            next_unknown=limits.unknown_cap(backend), completion=rule)
        if isinstance(plan, str):
            if stream.response is not None:
                return await self.relay.end_stream(stream, ex.last, plan)
            # An answer being assembled that cannot go on exactly: nothing reached its
            # client, so it is sent again from the start instead.
            stream.splice = Splice(stream.splice.request)
            stream.continuation = None
        else:
            stream.continuation = plan
        if self.affinity is not None and ex.query is not None:
            self.affinity.moved(ex.query, backend, time.monotonic())
        return backend

    def _pick(self, ex: Exchange) -> str | Response | None:
        """The backend of a first attempt or a re-send from the start, the refusal of a
        request no backend may take, or ``None`` when none is left to try (the caller waits
        for one coming back, or refuses)."""
        affinity, query, tried, min_version = self.affinity, ex.query, ex.tried, ex.min_version
        prefer = None
        if affinity is not None and query is not None and not tried:
            prefer = partial(affinity.choose, query, now=time.monotonic())
        picking = time.perf_counter()
        backend = self.pool.pick(tried, ex.session if not tried else None,
                                 min_version=min_version, prefer=prefer)
        self.stats.picked(time.perf_counter() - picking)
        if backend is None:
            if ex.last is None and min_version is not None and self.pool.serving:
                return self.answers.refuse_version(min_version)
            if ex.held and self.tally.poison(ex, ex.held[-1]):
                # Every engine left that could answer it gave the same 5xx (the others
                # refused it): poison, as in :meth:`_give_up`.
                self.stats.poison_requests += 1
                return self.relay.pass_through(ex.held[-1])
            return None  # nobody left to try
        if ex.stream is not None:
            ex.stream.weight_version = self.pool.facts(backend).weight_version
            ex.stream.splice = Splice(ex.stream.splice.request)  # from the start
        if affinity is not None and query is not None:
            affinity.placed(query, backend, time.monotonic())
        return backend

    def _hedge(self, scope: Hold, backend: str, request: Request, body: bytes,
               headers: RawHeaders, other: str) -> Coroutine[Any, Any, Won | Failure]:
        """The hedge the fleet's command sends (:meth:`Attempts.hedge`), looked up when sent:
        the waits and the attempts each hold the other."""
        return self.attempts.hedge(scope, backend, request, body, headers, other)
