"""One attempt of a request on one backend: sent, its head awaited, its answer relayed.

Owns: :class:`Attempts`: the upstream client and the parsed targets it sends to, one try on one
backend (the request as that backend takes it, sent; the head of its answer awaited in the
backend's waiting list; an engine's 5xx read to its bound; the answer handed to the relay),
and the race of a hedge with the attempt it hedges (the hedge's own try, the winner relayed, the
loser dropped).
Must not: choose a backend or decide what follows a failure: the attempt loop
(:class:`~fleetwarden.router.forward.Forwarder`) picks, and re-sends as
:mod:`~fleetwarden.router.retry` says; when to hedge is the fleet's command
(:meth:`~fleetwarden.router.waiting.WaitingRequests.hedge`).
"""

from __future__ import annotations

import asyncio
import time

from fleetwarden.router.exchange import (
    CLOSE,
    Attempt,
    Exchange,
    Failure,
    Hold,
    Won,
    classify,
    with_key,
)
from fleetwarden.router.pool import BackendFacts, Pool
from fleetwarden.router.relay import Answering, Relay
from fleetwarden.router.retry import Cause
from fleetwarden.router.serve import RawHeaders, Request, StreamResponse, error_body
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import RouterStats
from fleetwarden.router.tally import Tally
from fleetwarden.router.upstream import Address, Answer, UpstreamClient, UpstreamError
from fleetwarden.router.waiting import WaitingRequests

__all__ = ["Attempts"]

#: Parsed target URLs kept (backends x allowlisted paths, plus any query strings).
_MAX_CACHED_TARGETS = 4096


class Attempts:
    """The tries of one router's requests on its backends, over keep-alive connections
    (:mod:`fleetwarden.router.upstream`), and the hedges that race them."""

    def __init__(self, pool: Pool, settings: RouterSettings, stats: RouterStats, tally: Tally,
                 waiting: WaitingRequests, relay: Relay) -> None:
        self.pool = pool
        self.settings = settings
        self.stats = stats
        self.tally = tally
        self.waiting = waiting
        self.relay = relay
        self._client: UpstreamClient | None = None
        #: Every attempt carries its engine's key (the push's ``key``), not only the router's
        #: own continuations: set when the router checks client keys, whose keys never go on
        #: to an engine (router/keys.py), so that clients never need to hold the engines' key.
        self.engine_keys_always = False
        #: Parsed target URLs, by backend + path (the allowlist keeps this small).
        self._targets: dict[str, Address] = {}

    def open(self) -> UpstreamClient:
        """The upstream client every attempt sends through, made now."""
        s = self.settings
        # No limit on connections: the engines queue; the router never should.
        self._client = UpstreamClient(connect_timeout_s=s.connect_timeout_s,
                                      total_timeout_s=s.backend_timeout_s,
                                      keepalive_timeout_s=s.keepalive_timeout_s,
                                      max_head_bytes=s.max_head_bytes,
                                      max_headers=s.max_headers)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def send(self, ex: Exchange, backend: str) -> StreamResponse | Failure:
        """One try on one backend: its answer relayed, or why there is none. A request the
        router does not continue as a stream may be hedged (:meth:`WaitingRequests.hedge`)."""
        pool = self.pool
        request, body, stream = ex.request, ex.body, ex.stream
        key = backend + request.raw_path  # the request target exactly as the client sent it
        headers = ex.headers
        facts = pool.facts(backend)  # what the push said of it as the attempt leaves
        if stream is not None:
            body = stream.splice.request.body_for(self.takes_fields(backend))
            if stream.began and stream.continuation is not None:
                key = backend + stream.continuation.path
                body = stream.continuation.body
                # A continuation is the router's own request, not the client's: it carries
                # the engine's key where the push gave one (the client's otherwise).
                headers = with_key(headers, facts.key)
        if self.engine_keys_always:
            headers = with_key(headers, facts.key)
        target = self.target(key)
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
        assert self._client is not None, "Attempts.open() was not awaited"
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
                    at.target, at.method, headers, at.body, keep_alive=CLOSE not in headers)
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

    async def hedge(self, scope: Hold, backend: str, request: Request,
                     body: bytes, headers: RawHeaders, other: str,
                     ) -> Won | Failure:
        """The hedge of the request waiting in ``scope`` on ``backend``: the same request on
        ``other``, up to its headers. The first of the two to answer wakes or drops the other
        (:meth:`send`); a failure here is counted against ``other`` and leaves the original
        waiting."""
        facts = self.pool.facts(other)
        if self.engine_keys_always:
            headers = with_key(headers, facts.key)
        sent = time.perf_counter()
        # In ``other``'s waiting list: its silence is seen, a rescue moves it on (it is never
        # hedged itself: the original is its hedge).
        answer, _ = await self._wait_head(Attempt(
            other, request.method, self.target(other + request.raw_path), body, headers,
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

    def target(self, key: str) -> Address:
        """Where ``key`` (backend + path) goes, parsed once and cached."""
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()  # query strings or many restarts: start afresh
            target = self._targets[key] = Address.parse(key)
        return target

    def takes_fields(self, backend: str) -> bool:
        """Whether ``backend``'s engine takes vLLM's own request fields: its profile's word in
        the controller's push, else the router's ``upstream_fields`` setting."""
        said = self.pool.facts(backend).upstream_fields
        return self.settings.upstream_fields if said is None else said
