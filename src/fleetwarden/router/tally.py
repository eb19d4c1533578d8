"""What a router counts of its attempts' failures, and its one local act on them.

Owns: :class:`Tally`: a failure into the outcomes the controller drains and the evidence
stream, as it happens or, a 5xx, when the request ends (whether the request itself was the
problem: poison); a lost race counted without failing its engine; the reflex drop.
Must not: decide health: the controller drains the tallies and the ledger judges; the reflex
drop acts only when fleet health drives membership, so that the next push undoes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable

from fleetwarden.router.answers import DESCRIPTIONS
from fleetwarden.router.exchange import Exchange, Failure
from fleetwarden.router.pool import Pool, blamed_5xx, poison_quorum
from fleetwarden.router.retry import Cause
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import RouterStats

__all__ = ["Tally"]

log = logging.getLogger("fleetwarden.router")


class Tally:
    """The failures of one router's attempts, counted where they count."""

    def __init__(self, pool: Pool, settings: RouterSettings, stats: RouterStats, *,
                 health_managed: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.stats = stats
        #: Fleet health drives membership: the reflex drop is armed.
        self.health_managed = health_managed
        #: Told of every failed attempt as it happens: (backend, cause). The router's evidence
        #: stream; whoever listens must not raise.
        self.on_failure: Callable[[str, str], None] | None = None

    def count(self, ex: Exchange, failure: Failure, began: bool) -> None:
        """A failure that counts against its engine: reported now or, a 5xx, held back until
        the request's end tells whether the request itself is the problem."""
        if not failure.counted:
            if failure.cause is Cause.SERVER_ERROR and not began:
                # Out of this router's list at once (the reflex), reported when the request
                # ends (:meth:`settle_held`).
                self.reflex(failure)
                ex.held.append(failure)
            else:
                self.count_failure(failure)

    def aborted(self, failure: Failure) -> None:
        """An attempt whose engine aborted its generation: counted, and a whole answer's
        tokens (its usage says them) as discarded: the request goes again from the start."""
        self.stats.aborted += 1
        if failure.body:
            with contextlib.suppress(ValueError, RecursionError, AttributeError, TypeError):
                tokens = json.loads(failure.body)["usage"]["completion_tokens"]
                if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                    self.stats.tokens_discarded += tokens

    def count_failure(self, failure: Failure) -> None:
        self.report_failure(failure)
        self.reflex(failure)

    def poison(self, ex: Exchange, failure: Failure) -> bool:
        """Whether ``failure`` (a 5xx) makes the request poison: the same status from every
        engine it may try (:func:`poison_quorum`). Those are the engines that answered it 5xx
        and those it has not tried yet; one that failed it otherwise (refused, reset) could
        not answer it at all, and has no say."""
        pool, held = self.pool, ex.held
        answered_5xx = {h.backend for h in held} | {failure.backend}
        same = {h.backend for h in held if h.status == failure.status} | {failure.backend}
        if len(same) < len(answered_5xx):
            return False  # another 5xx among them: not the same answer everywhere
        untried = {u for u in pool.serving
                   if u not in ex.tried and pool.qualifies(u, ex.min_version)}
        routable = answered_5xx | untried
        return len(same) >= poison_quorum(len(routable), self.settings.max_retries)

    def settle_held(self, ex: Exchange) -> None:
        """A request's held 5xx at its end: those :func:`blamed_5xx` names are reported; the
        others were perhaps the request's own, and their reflex drops are undone."""
        pool = self.pool
        answered = ex.answered or (ex.stream is not None and ex.stream.began)
        untried = sum(1 for u in pool.serving
                      if u not in ex.tried and pool.qualifies(u, ex.min_version))
        blamed = blamed_5xx([(h.backend, h.status) for h in ex.held], answered, untried)
        for h in ex.held:
            if h.backend in blamed:
                self.report_failure(h)
            elif self.health_managed:
                pool.undrop(h.backend)

    def report_failure(self, failure: Failure) -> None:
        """The failure into the tallies the controller drains, and its evidence stream."""
        self.pool.record_failure(failure.backend)
        self.stats.backend_failed(failure.backend, failure.cause.value)
        if self.on_failure is not None:
            self.on_failure(failure.backend, failure.cause.value)

    def lost_race(self, failure: Failure) -> None:
        """The held attempt lost the race to its hedge: out of this router's list until the next
        push (no new request waits there meanwhile), but no failure of its engine. A hedge is
        sent on a second without a step; a healthy engine in one long step (a long prefill
        before its cadence learned one) looks the same until the step ends, and counted, its
        lost races ejected it from the fleet, to come back only on proof. A wedge is condemned
        by the stall limit, or by the canary that watches a hedged lost core."""
        self.stats.backend_failed(failure.backend, failure.cause.value)
        if len(self.pool.serving) > 1 or failure.backend not in self.pool.serving:
            # Never the last: a lost race is no failure of its engine, and an empty list would
            # answer every request 409 until the next push.
            self.reflex(failure)

    def reflex(self, failure: Failure) -> None:
        if self.health_managed and self.pool.drop(failure.backend):
            log.info("reflex drop: %s %s; out until the next push", failure.backend,
                     DESCRIPTIONS[failure.cause])
