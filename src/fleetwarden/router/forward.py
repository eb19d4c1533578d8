"""Forwarding one request: pick a backend, send, hand the answer to the relay, count.

Owns: the attempt loop, one request's way through the backends (pick, send, wait for the
head, retry, hedge's race, continue a stream). Beside it, by job:
the waits the fleet's commands act on (:mod:`~fleetwarden.router.waiting`), the relay of an
answer to its client (:mod:`~fleetwarden.router.relay`), the failures counted
(:mod:`~fleetwarden.router.tally`), the cache-aware index kept in step with the fleet
(:mod:`~fleetwarden.router.cache_sync`), the engines' limits learnt
(:mod:`~fleetwarden.router.limits_learning`), the router's own answers
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
import json
import logging
import time
from functools import partial

from fleetwarden.router.affinity import Affinity, AffinitySettings, Query, query_of
from fleetwarden.router.answers import DESCRIPTIONS, OwnAnswers, error_response
from fleetwarden.router.cache_sync import CacheSync
from fleetwarden.router.exchange import (
    Attempt,
    Exchange,
    Failure,
    Hold,
    Stream,
    Won,
    classify,
    with_key,
)
from fleetwarden.router.kv_events import KVEvents
from fleetwarden.router.kv_index import KVIndex
from fleetwarden.router.limits_learning import LimitsLearner
from fleetwarden.router.pool import (
    BackendFacts,
    Pool,
)
from fleetwarden.router.relay import HOP_BY_HOP, Answering, Relay
from fleetwarden.router.retry import AfterFailure, Cause, Retries, settle
from fleetwarden.router.serve import (
    BodyTooLarge,
    RawHeaders,
    Request,
    Response,
    StreamResponse,
    error_body,
)
from fleetwarden.router.settings import (
    MIN_VERSION_HEADER,
    RouterSettings,
)
from fleetwarden.router.splice import (
    ABORTED_ERROR,
    EngineLimits,
    Splice,
    read_stream_request,
)
from fleetwarden.router.stats import RouterStats
from fleetwarden.router.tally import Tally
from fleetwarden.router.upstream import (
    Address,
    Answer,
    UpstreamClient,
    UpstreamError,
)
from fleetwarden.router.waiting import WaitingRequests

__all__ = ["Forwarder"]

log = logging.getLogger("fleetwarden.router")

#: The body is buffered and re-sent, so its length is recomputed and there is nothing left to
#: expect; the Host is the backend's.
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_MIN_VERSION = MIN_VERSION_HEADER.encode()
_CLOSE = (b"Connection", b"close")
#: Digits of a minimum weight version read (a 64-bit counter has 20).
_MAX_VERSION_DIGITS = 20
#: Parsed target URLs kept (backends x allowlisted paths, plus any query strings).
_MAX_CACHED_TARGETS = 4096


def _min_version(value: bytes | None) -> int | Response | None:
    """The request's minimum weight version, ``None`` without one, or the 400 for a bad one."""
    if value is None:
        return None
    raw = value.decode("latin-1")
    digits = raw.strip()
    # Bounded: Python refuses to read an integer of over 4,300 digits (ValueError), and no
    # weight version needs more than a 64-bit counter's 20.
    if not (digits.isascii() and digits.isdigit()) or len(digits) > _MAX_VERSION_DIGITS:
        return error_response(400, f"{MIN_VERSION_HEADER} must be an integer >= 0, got "
                              f"{raw!r}.", "invalid_request_error", param=MIN_VERSION_HEADER)
    return int(digits)


class Forwarder:
    """Sends requests to the pool's backends over keep-alive connections
    (:mod:`fleetwarden.router.upstream`)."""

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
        self._client: UpstreamClient | None = None
        #: The requests each backend holds, and the fleet's commands on them (rescue, hedge,
        #: a weight load with the requests kept, the silence read).
        self.waiting = WaitingRequests(pool, stats, self._hedge)
        #: Every attempt carries its engine's key (the push's ``key``), not only the router's
        #: own continuations: set when the router checks client keys, whose keys never go on
        #: to an engine (router/keys.py), so that clients never need to hold the engines' key.
        self.engine_keys_always = False
        #: Parsed target URLs, by backend + path (the allowlist keeps this small).
        self._targets: dict[str, Address] = {}
        #: Each engine's context length and server caps (:class:`EngineLimits`), as the
        #: pushes say them and the engines' ``/v1/models`` tell.
        self.limits = EngineLimits()
        self.learner = LimitsLearner(pool, self.limits)
        #: The answers on their way to their clients.
        self.relay = Relay(pool, stats, self.waiting, self.answers, self.limits,
                           count_failure=self.tally.count_failure,
                           learn_context=self.learner.learn_context)
        header = settings.session_header
        self._session_header = None if header is None else header.strip().lower().encode()
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

    def _query(self, body: bytes, session: str | None) -> Query | None:
        """What the cache-aware policy reads of a request; None for a body it cannot read
        (the engine answers that one with its own error)."""
        assert self.affinity is not None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return query_of(parsed, session, self.affinity.settings,
                        self.settings.cache_user_is_session)

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        s = self.settings
        # No limit on connections: the engines queue; the router never should.
        self._client = UpstreamClient(connect_timeout_s=s.connect_timeout_s,
                                      total_timeout_s=s.backend_timeout_s,
                                      keepalive_timeout_s=s.keepalive_timeout_s,
                                      max_head_bytes=s.max_head_bytes,
                                      max_headers=s.max_headers)
        self.learner.open(self._client, self._target)
        if self.cache is not None:
            self.cache.open(self._client, self._target)

    async def close(self) -> None:
        self.learner.close()
        if self.cache is not None:
            await self.cache.close()
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ------------------------------------------------------------------ the request path

    async def forward(self, request: Request) -> StreamResponse:
        """Answer one allowlisted request through the fleet: attempts until one answers or
        the request gives up (:mod:`~fleetwarden.router.retry` says which after each failure;
        this loop does what it says)."""
        started = time.perf_counter()
        self.stats.requests += 1
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        ex = self._exchange(request, body, started)
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
                answer = await self._attempt(ex, backend)
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

    async def _read_body(self, request: Request) -> bytes | Response:
        """The client's whole body, or the answer to a client that sent too much or stalled."""
        length = request.content_length
        if length is not None and length > self.settings.max_body_bytes:
            return self.answers.too_large()
        try:
            if request.body_arrived:
                # The whole body has arrived (a small one comes with its headers): reading it
                # cannot stall, so no timer is set and cancelled for it.
                return await request.read()
            async with asyncio.timeout(self.settings.client_body_timeout_s):
                return await request.read()
        except BodyTooLarge:
            return self.answers.too_large()
        except TimeoutError:
            # A client that sent its headers and stalled: no backend was picked yet, so it
            # held nothing but this handler, which it now gives back.
            self.stats.responded(408)
            return error_response(
                408, f"The request body did not arrive within "
                f"{self.settings.client_body_timeout_s:g} s.", "request_timeout")

    def _exchange(self, request: Request, body: bytes, started: float) -> Exchange | Response:
        """What every attempt of ``request`` sends, read once; or the answer to a request the
        router refuses as it came (a malformed minimum weight version, JSON nested too deep)."""
        # One pass over the headers as they came: what is forwarded, and what the router reads.
        headers: RawHeaders = []
        connection = session_value = min_value = None
        session_header = self._session_header
        for name, value in request.raw_headers:
            lowered = name.lower()
            if lowered in _NOT_FORWARDED:
                if lowered == b"connection" and connection is None:
                    connection = value
                continue
            if lowered == session_header and session_value is None:
                session_value = value
            elif lowered == _MIN_VERSION and min_value is None:
                min_value = value
            headers.append((name, value))
        if connection is not None:  # headers it names are hop-by-hop too
            named = {t.strip().lower() for t in connection.split(b",")}
            headers = [(k, v) for k, v in headers if k.lower() not in named]
        session = (None if session_value is None
                   else session_value.decode("utf-8", "surrogateescape"))
        min_version = _min_version(min_value)
        if isinstance(min_version, Response):
            self.stats.responded(min_version.status)
            return min_version
        stream = None
        if self.settings.continue_streams:
            try:
                read = read_stream_request(request.path, body, request.headers,
                                           assemble_answers=self.settings.continue_answers)
            except RecursionError:  # JSON nested deeper than Python's parser goes
                self.stats.responded(400)
                return error_response(400, "The request body is JSON nested too deeply.",
                                      "invalid_request_error")
            if read is not None:
                stream = Stream(Splice(read), min_version=min_version)
                headers.append(_CLOSE)  # never pooled (router/upstream.py)
        query = None if self.affinity is None else self._query(body, session)
        exchange = Exchange(request, body, headers, started, session, min_version, stream,
                             query)
        if stream is not None:
            stream.tried = exchange.tried
            stream.crossed = exchange.crossed
        return exchange

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
        no_limit = stream.splice.names_no_limit()
        plan = stream.splice.continuation(
            max_model_len=None if began_on is None else limits.context.get(began_on),
            upstream_fields=self._takes_fields(backend),
            output_cap=limits.output_cap(began_on, no_limit),
            next_output_cap=limits.output_cap(backend, False),
            began_unknown=limits.unknown_cap(began_on), next_unknown=limits.unknown_cap(backend))
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

    async def _attempt(self, ex: Exchange, backend: str) -> StreamResponse | Failure:
        """One try on one backend: its answer relayed, or why there is none. A request the
        router does not continue as a stream may be hedged (:meth:`WaitingRequests.hedge`)."""
        pool = self.pool
        request, body, stream = ex.request, ex.body, ex.stream
        key = backend + request.raw_path  # the request target exactly as the client sent it
        headers = ex.headers
        facts = pool.facts(backend)  # what the push said of it as the attempt leaves
        if stream is not None:
            body = stream.splice.request.body_for(self._takes_fields(backend))
            if stream.began and stream.continuation is not None:
                key = backend + stream.continuation.path
                body = stream.continuation.body
                # A continuation is the router's own request, not the client's: it carries
                # the engine's key where the push gave one (the client's otherwise).
                headers = with_key(headers, facts.key)
        if self.engine_keys_always:
            headers = with_key(headers, facts.key)
        target = self._target(key)
        pool.dispatched(backend)
        try:
            sent = time.perf_counter()
            answer, hedge = await self._wait_head(Attempt(
                backend, request.method, target, body, headers, facts,
                None if stream is not None else ex, stream, ex.crossed))
            if hedge is not None:
                if not isinstance(answer, Failure):
                    self._drop_hedge(hedge)  # this answer came first
                else:
                    return await self._after_hedge(request, hedge, answer, ex.started,
                                                   ex.crossed)
            if isinstance(answer, Failure):
                return answer
            return await self.relay.deliver(Answering(request, answer, backend, ex.started,
                                                      time.perf_counter() - sent, facts,
                                                      ex.crossed, stream))
        finally:
            pool.finished(backend)

    async def _wait_head(self, at: Attempt) -> tuple[Answer | Failure,
                                                     asyncio.Task[Won | Failure] | None]:
        """Send attempt ``at`` to its backend and wait for the head of its answer, in the
        backend's waiting list (a rescue, or the answer of its hedge, ends the wait at once).
        Returns the answer (a 5xx as a failure) and the hedge that was in flight for it when
        the wait ended, if any."""
        assert self._client is not None, "Forwarder.open() was not awaited"
        backend, headers = at.backend, at.headers
        waits = self.waiting
        waiting = waits.heads.get(backend)
        if waiting is None:
            waiting = waits.heads[backend] = {}
        hedge: asyncio.Task[Won | Failure] | None = None
        race_fails = False
        answer: Answer | Failure
        hold = Hold(stream=at.stream, crossed=at.crossed)
        waiting[hold] = (asyncio.get_running_loop().time(), at.hedgeable)
        try:
            try:
                upstream = await self._client.request(
                    at.target, at.method, headers, at.body, keep_alive=_CLOSE not in headers)
                waits.heard[backend] = asyncio.get_running_loop().time()
                if upstream.status >= 500:
                    answer = await self._server_error(backend, upstream, at.facts)
                else:
                    answer = upstream  # an event stream's connection is never pooled
            finally:
                waiting.pop(hold, None)
                if waits.hedging:
                    hedge = waits.hedging.pop(hold, None)
                    race_fails = hold in waits.races_fail
                    waits.races_fail.discard(hold)
        except asyncio.CancelledError:
            if not hold.caught():  # the client left while both waited
                if hedge is not None:
                    self._drop_hedge(hedge)
                raise
            # Interrupted: the hedge's answer came first, a rescue, or a stream moved.
            if (hedge is not None and hedge.done() and not hedge.cancelled()
                    and isinstance(hedge.result(), Won)):
                answer = Failure(backend, Cause.HEDGED, race_fails=race_fails)
            else:
                answer = Failure(backend, hold.why, race_fails=self.waiting.race_fails(hold))
        except TimeoutError as exc:  # the backend timeout
            answer = Failure(backend, classify(exc))
        except UpstreamError as exc:
            answer = Failure(backend, classify(exc))
        except BaseException:  # the client left while both waited
            if hedge is not None:
                self._drop_hedge(hedge)
            raise
        return answer, hedge

    async def _server_error(self, backend: str, upstream: Answer,
                            facts: BackendFacts) -> Failure:
        """An engine's 5xx, its body read to ``max_error_body_bytes``: one over it is not waited
        on to its end (its connection is dropped), and what the client may be given of it is
        the router's word, naming the bound."""
        limit = self.settings.max_error_body_bytes
        try:
            body, cut = await upstream.read_at_most(limit)
        except BaseException:
            upstream.close()
            raise
        if not cut:
            return Failure(backend, Cause.SERVER_ERROR, upstream.status, upstream.raw_headers,
                            body, facts)
        status = upstream.status
        return Failure(backend, Cause.SERVER_ERROR, status,
                        [(b"Content-Type", b"application/json")],
                        error_body(status, f"Backend {backend} answered {status} with a body "
                                   f"over {limit} bytes (not relayed); it began: "
                                   f"{body[:300].decode(errors='replace')}", "backend_error"),
                        facts)

    # ------------------------------------------------------------------ hedges

    async def _hedge(self, scope: Hold, backend: str, request: Request,
                     body: bytes, headers: RawHeaders, other: str,
                     ) -> Won | Failure:
        """The hedge of the request waiting in ``scope`` on ``backend``: the same request on
        ``other``, up to its headers. The first of the two to answer wakes or drops the other
        (:meth:`_attempt`); a failure here is counted against ``other`` and leaves the original
        waiting."""
        facts = self.pool.facts(other)
        if self.engine_keys_always:
            headers = with_key(headers, facts.key)
        sent = time.perf_counter()
        # In ``other``'s waiting list: its silence is seen, a rescue moves it on (it is never
        # hedged itself: the original is its hedge).
        answer, _ = await self._wait_head(Attempt(
            other, request.method, self._target(other + request.raw_path), body, headers,
            facts, crossed=scope.crossed))
        if isinstance(answer, Failure):
            if answer.cause is not Cause.RESCUED:
                self.tally.count_failure(answer)
            return answer
        if self.waiting.hedging.get(scope) is asyncio.current_task():
            # the original still waits: wake it, this is the client's answer
            scope.interrupt()
        return Won(other, answer, time.perf_counter() - sent, facts)

    async def _after_hedge(self, request: Request, hedge: asyncio.Task[Won | Failure],
                           failure: Failure, started: float,
                           crossed: list[int]) -> StreamResponse | Failure:
        """The original attempt ended without an answer while its hedge was in flight (or
        because the hedge's answer came): the hedge's answer is the client's, if it has one."""
        if failure.cause is Cause.HEDGED and not failure.race_fails:
            self.tally.lost_race(failure)
            failure.counted = True
        elif failure.cause is not Cause.RESCUED:
            self.tally.count_failure(failure)  # the original's own failure is evidence all the same
            failure.counted = True
        won = await hedge  # cancelled with this handler, if the client leaves
        if isinstance(won, Failure):
            return failure
        self.stats.hedges_won += 1
        try:
            return await self.relay.deliver(Answering(request, won.upstream, won.backend,
                                                      started, won.backend_time, won.facts,
                                                      crossed))
        finally:
            self.pool.finished(won.backend)

    def _drop_hedge(self, hedge: asyncio.Task[Won | Failure]) -> None:
        """The original answered first (or its client left): cancel the hedge, or close the
        answer it already has (its engine sees the disconnect and aborts)."""
        if not hedge.done():
            hedge.cancel()
            return
        if hedge.cancelled():
            return
        won = hedge.result()
        if isinstance(won, Won):
            won.upstream.close()
            self.pool.finished(won.backend)

    def _target(self, key: str) -> Address:
        """Where ``key`` (backend + path) goes, parsed once and cached."""
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()  # query strings or many restarts: start afresh
            target = self._targets[key] = Address.parse(key)
        return target

    def _takes_fields(self, backend: str) -> bool:
        """Whether ``backend``'s engine takes vLLM's own request fields: its profile's word in
        the controller's push, else the router's ``upstream_fields`` setting."""
        said = self.pool.facts(backend).upstream_fields
        return self.settings.upstream_fields if said is None else said
