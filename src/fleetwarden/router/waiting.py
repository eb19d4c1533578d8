"""The requests each backend holds, and the fleet's commands on them.

Owns: :class:`WaitingRequests`: every request waiting on a backend for its answer's head, every
stream relayed from one, the hedges in flight, and when each backend last answered; the
controller's commands on them (rescue, hedge, a weight load with the requests kept) and its
read of them (:meth:`WaitingRequests.silent`); :class:`EvidenceFeed`, the long poll a controller
holds open for the router's failed attempts and its backends turned silent (``GET /evidence``,
and an in-process link's :meth:`~fleetwarden.router.links.RouterLink.evidence`).
Must not: send a request: a hedge is sent by the attempts
(:class:`~fleetwarden.router.attempts.Attempts`), whose waits enter and leave these tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from fleetwarden.router.exchange import Exchange, Failure, Hold, Stream, Won
from fleetwarden.router.ops import Evidence
from fleetwarden.router.pool import Pool
from fleetwarden.router.retry import Cause
from fleetwarden.router.serve import RawHeaders, Request
from fleetwarden.router.stats import RouterStats

__all__ = ["EVIDENCE_SCAN_S", "EvidenceFeed", "WaitingRequests", "hedge_ended"]

log = logging.getLogger("fleetwarden.router")

#: How often a held evidence poll looks for requests that turned silent (failures wake it at
#: once): the in-process controller's own evidence_poll_s is 0.5 s.
EVIDENCE_SCAN_S = 0.25

#: How a hedge is sent: (the hold of the wait it hedges, its backend, the request, its body,
#: its headers, the other backend) -> the hedge's attempt
#: (:meth:`Attempts.hedge <fleetwarden.router.attempts.Attempts.hedge>`).
SendHedge = Callable[[Hold, str, Request, bytes, RawHeaders, str],
                     Coroutine[Any, Any, Won | Failure]]


class WaitingRequests:
    """The waits of one router's requests on its backends, by backend, and the hedges in
    flight for them: what a rescue may cancel, a hedge may race, and a silence read reports."""

    def __init__(self, pool: Pool, stats: RouterStats, send_hedge: SendHedge) -> None:
        self.pool = pool
        self.stats = stats
        self._send_hedge = send_hedge
        #: Requests waiting on each backend with nothing sent to their client: what a rescue
        #: may cancel. Each is the hold around its wait, with the loop time it began
        #: (what :meth:`silent` reports) and its request, for a hedge (None: not hedgeable).
        self.heads: dict[str, dict[Hold, tuple[float, Exchange | None]]] = {}
        #: Hedges in flight, by the hold of the wait they hedge (:meth:`hedge`).
        self.hedging: dict[Hold, asyncio.Task[Won | Failure]] = {}
        #: The holds whose hedges were sent with ``lost_race_fails`` (:meth:`hedge`).
        self.races_fail: set[Hold] = set()
        #: Streams being relayed from each backend (their answer has begun): a rescue cuts
        #: them too, and they go on elsewhere. Each hold's ``since`` is when it last received
        #: anything: a stream whose engine stopped after its head is held there all the same.
        self.streams: dict[str, set[Hold]] = {}
        #: The loop time each backend last answered anything on the request path (a head, a
        #: stream's bytes): a request waiting there is silent only as long as its engine is.
        #: A saturated engine queues requests for seconds while it answers others; a stopped
        #: one answers none (docs/design.md, "Silence is evidence").
        self.heard: dict[str, float] = {}

    def rescue(self, backend: str, *, streams: bool = True) -> int:
        """Cancel the requests on ``backend``: those waiting with nothing sent to their client
        are re-sent elsewhere at once; streams whose answer has begun go on elsewhere from
        where they are (or end with an error event where they cannot). ``streams`` False
        leaves the streams whose answer has begun to finish there (the trainer's sleep
        bracket: its engine still works until it is asked to sleep). Returns how many."""
        holds = set(self.heads.pop(backend, {}))
        if streams:
            holds |= self.streams.pop(backend, set())
        if not holds:
            return 0
        for hold in holds:
            hold.interrupt()  # the request moves on from its wait at once
        self.stats.rescues += len(holds)
        return len(holds)

    def weights_changing(self, backend: str, version: int) -> int:
        """``backend``'s engine is about to load ``version`` with the requests on it kept
        (vLLM's ``pause?mode=keep``: they go on under the new weights). Each request there now
        (waiting for its head, or streaming) may end with tokens of both: its answer names
        every version (:func:`~fleetwarden.router.relay.response_headers`, and a stream's
        last event). One that ends before the pause is named so too: the label may list a
        version that produced none of its tokens, never leave out one that did. Returns how
        many were marked."""
        holds = [*self.heads.get(backend, {}), *self.streams.get(backend, ())]
        marked = 0
        for hold in holds:
            if hold.crossed is not None and version not in hold.crossed[-1:]:
                hold.crossed.append(version)
                marked += 1
        return marked

    def hedge(self, backend: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        """Send each request that has waited on ``backend`` for at least ``held_s`` with nothing
        sent to its client (and is not a stream, nor hedged already) to another backend as
        well; the first answer is the client's. Each hedge takes a retry-budget token while in
        flight unless ``backend`` is out of the serving set; a hedge for which no token or no
        other backend is left is not sent (a later call may). A stream the router continues,
        held there as long (waiting for its head, or with no event since), cannot have two
        engines write to its client: it is moved instead (:meth:`_move_streams`). Returns how
        many were sent or moved.

        ``lost_race_fails``: a held request that loses its race, or a stream moved, is a failed
        attempt of ``backend`` (the caller knows no step is in progress there: a lost core);
        otherwise it only leaves this router's list until the next push (a long step looks the
        same as a wedge until it ends)."""
        if not math.isfinite(held_s) or held_s < 0:
            raise ValueError(f"held_s must be a finite number >= 0, got {held_s}")
        moved = self._move_streams(backend, held_s, lost_race_fails)
        waiting = self.heads.get(backend)
        if not waiting:
            return moved
        pool = self.pool
        budget = pool.retry_budget
        free = backend not in pool.serving
        now = asyncio.get_running_loop().time()
        sent = 0
        for scope, (since, ex) in list(waiting.items()):
            if ex is None or now - since < held_s or scope in self.hedging:
                continue  # a stream (moved above), a hedge's own wait, or not held that long
            other = pool.pick([*ex.tried, backend], None, min_version=ex.min_version)
            if other is None:
                continue  # no other backend for this one (its weight version, say)
            if not free and not budget.try_acquire():
                break  # the fleet's retry budget is spent: the next call may find a token
            ex.tried.append(other)
            # In flight on ``other`` from now, so the next pick of this call sees it (several
            # held requests' hedges spread as requests do).
            pool.dispatched(other)
            task = asyncio.create_task(
                self._send_hedge(scope, backend, ex.request, ex.body, ex.headers, other),
                name=f"hedge:{other}")
            # Whatever ends it: a task cancelled before its first step (its original answered
            # in the same turn of the loop) runs none of its own code.
            task.add_done_callback(partial(hedge_ended, pool, other))
            if not free:
                task.add_done_callback(lambda _: budget.release())
            self.hedging[scope] = task
            if lost_race_fails:
                self.races_fail.add(scope)
            sent += 1
        self.stats.hedges += sent
        if sent:
            log.info("hedged %d request(s) held on %s", sent, backend)
        return moved + sent

    def _move_streams(self, backend: str, held_s: float, lost_race_fails: bool) -> int:
        """Move the streams the router continues that ``backend`` has held for ``held_s`` with
        nothing received, where another backend could take them: each goes on elsewhere at
        once, from where it is (from the start if its client has nothing yet), as a rescue
        moves it. Where a waiting request's hedge would have won the race, the engine held the
        stream without a step while the fleet moved it: the attempt ends ``hedged``, a lost
        race (``Forwarder.forward``), which fails the engine only with ``lost_race_fails``; it
        moves the load rather than adding to it, so it takes no token of the retry budget."""
        now = asyncio.get_running_loop().time()
        waiting = self.heads.get(backend, {})
        held = [hold for hold, (since, _) in waiting.items()
                if hold.stream is not None and now - since >= held_s
                and self._elsewhere(hold.stream, backend)]
        for hold in held:
            del waiting[hold]
        streaming = self.streams.get(backend, set())
        relayed = [hold for hold in streaming
                   if now - hold.since >= held_s and hold.stream is not None
                   and self._elsewhere(hold.stream, backend)]
        streaming.difference_update(relayed)
        held += relayed
        for hold in held:
            hold.interrupt(Cause.HEDGED)
            if lost_race_fails:
                self.races_fail.add(hold)
        if held:
            self.stats.rescues += len(held)
            log.info("moved %d stream(s) held on %s with nothing received for %g s", len(held),
                     backend, held_s)
        return len(held)

    def _elsewhere(self, stream: Stream, backend: str) -> bool:
        """Whether another backend could take ``stream`` off ``backend`` now: where none could,
        moved it would end (with an error event, or refused), so it waits on, as a request is
        not hedged where no other backend is left."""
        exclude = [*stream.tried, backend]
        if stream.began:
            return self.pool.pick_same_weights(stream.weight_version, exclude) is not None
        return self.pool.pick(exclude, min_version=stream.min_version) is not None

    def silent(self, after_s: float) -> dict[str, float]:
        """Backends holding a request while they have answered nothing for at least
        ``after_s``: ``{backend: seconds}``, the oldest request's wait or, where the engine
        answered another request since it began, the time since that answer. A stream counts
        from its send as a waiting request does, and from each event it receives: one whose
        engine stops after its head (or mid-answer) is held there, silent, like a request
        waiting for its head. An engine that answers others while requests queue there is
        saturated, not silent: only an engine that answers nothing at all is."""
        now = asyncio.get_running_loop().time()
        out: dict[str, float] = {}
        for backend in self.heads.keys() | self.streams.keys():
            sinces = [since for since, _ in self.heads.get(backend, {}).values()]
            sinces += [hold.since for hold in self.streams.get(backend, ())]
            if sinces:
                oldest = now - max(min(sinces), self.heard.get(backend, -math.inf))
                if oldest >= after_s:
                    out[backend] = oldest
        return out

    def forget_idle(self, keep: set[str]) -> None:
        """Drop bookkeeping for backends that are neither kept nor have anything waiting."""
        for table in (self.heads, self.streams):
            for url in [u for u, w in table.items() if not w and u not in keep]:
                del table[url]
        for url in [u for u in self.heard if u not in keep
                    and not self.heads.get(u) and not self.streams.get(u)]:
            del self.heard[url]

    def race_fails(self, hold: Hold) -> bool:
        """Whether ``hold`` was moved by a hedge that said a lost race fails its engine (spent)."""
        if hold in self.races_fail:
            self.races_fail.discard(hold)
            return True
        return False


def hedge_ended(pool: Pool, backend: str, task: asyncio.Task[Won | Failure]) -> None:
    """A hedge's attempt on ``backend`` is no longer in flight, unless it won: then its
    answer is, until the client has it or it is dropped (:meth:`Attempts._after_hedge
    <fleetwarden.router.attempts.Attempts._after_hedge>`, :meth:`Attempts._drop_hedge
    <fleetwarden.router.attempts.Attempts._drop_hedge>`)."""
    if task.cancelled() or task.exception() is not None or not isinstance(task.result(), Won):
        pool.finished(backend)


class EvidenceFeed:
    """The failed attempts of one router, counted from the router's start, so that a caller
    that names the count it last saw misses none between two polls.

    ``listen`` subscribes a callback to each failed attempt (the router's own
    :meth:`~fleetwarden.router.app.Router.listen`); ``silent`` reads the backends holding a
    request silent for so long (:meth:`~fleetwarden.router.app.Router.silent_backends`)."""

    def __init__(self, listen: Callable[[Callable[[str, str], None]], Callable[[], None]],
                 silent: Callable[[float], dict[str, float]]) -> None:
        self._silent = silent
        #: Failed attempts since this feed began: what a poll's ``after`` counts against.
        self.failures = 0
        self._came = asyncio.Event()  # set at each failure, cleared as a poll takes it
        self._closing = False
        self._unlisten = listen(self._failed)

    def _failed(self, backend: str, cause: str) -> None:
        self.failures += 1
        self._came.set()

    def close(self) -> None:
        """The router is stopping: held polls are answered now, not at their wait."""
        self._closing = True
        self._came.set()
        self._unlisten()

    async def wait(self, after: int | None, wait_s: float, silent_after_s: float) -> Evidence:
        """Up to ``wait_s``: the failed attempts since the count ``after`` (``None``: from
        now) and the backends holding a request silent for ``silent_after_s``, answered as
        soon as there is any."""
        if after is None:
            after = self.failures
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            # ``after`` above the count: the caller counted in an earlier router process
            new = self.failures - after if self.failures >= after else self.failures
            silent = self._silent(silent_after_s)
            left = deadline - loop.time()
            if new or silent or left <= 0 or self._closing:
                return Evidence(new, self.failures, silent)
            self._came.clear()
            # a request turns silent without an event: looked for again every EVIDENCE_SCAN_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._came.wait(), min(left, EVIDENCE_SCAN_S))
