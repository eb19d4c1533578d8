"""Admission's table: the holds that keep a serving engine out of routing, and never-empty.

Owns: the holds (each held URL's causes, when its hold began and the until-time at which it
holds nothing more, on the ledger's clock; the URLs whose hold ran out, not held again until
their accusation's reads end), a shard's admission (routed, on trial, ejected, held, out) from
the facts the ledger keeps, and the rule that a hold never leaves the routers none.
Must not: do I/O, read a clock (the ledger passes its own time in), or emit anything:
:class:`fleetwarden.ledger.Admission` owns this table, applies its operations and emits each
change as a transition of the ledger's (docs/design.md section 2), as h11's ``_state.py`` keeps
its tables apart from the connection that drives them.

Three things keep an engine that serves out of routing, each with its way back:

* ejected (the ledger's table): failed requests; proof (an answered canary, a completed
  request) puts it on trial, one request at a time, and the panic threshold lets it serve
  when too few others are left;
* held (this table): focused reads of an accused engine hold it out while they watch it, no
  verdict (the ledger still calls it HEALTHY); the hold ends when its cause does, or at its
  until-time, whichever comes first, and is not taken again for the same accusation;
* none of it leaves the routers nothing: a held engine still serves when it is all there is
  (:func:`never_empty`), as an ejected one does below the panic threshold.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence, Set
from dataclasses import dataclass, replace

__all__ = ["Admitted", "Hold", "HoldCause", "Holds", "admitted", "never_empty"]


class Admitted(enum.Enum):
    """What the routers may do with a shard's engine now."""

    ROUTED = "routed"  # serving, pushed to every router
    ON_TRIAL = "on trial"  # pushed, one request at a time until one completes
    EJECTED = "ejected"  # serving, out of routing for failed requests until proof
    HELD = "held"  # serving, out of routing while focused reads watch it (no verdict)
    OUT = "out"  # no state that serves: STALE, asleep, condemned, restarting, retired

    def __str__(self) -> str:
        return self.value


class HoldCause(enum.Enum):
    """Why focused reads hold an engine out of routing (focus.py)."""

    #: A lost core (no work in its gauges, a request held with no step): its held requests
    #: are hedged, and a canary sent with them watches it.
    LOST_CORE = "a lost core its hedges' canary watches"
    #: It shows work, holds hedged requests and takes no step.
    STALLED = "hedged requests, work shown and no step taken"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Hold:
    """One URL's hold: why, since when, and the time at which it holds nothing more."""

    causes: frozenset[HoldCause]
    since: float
    until: float

    @property
    def why(self) -> str:
        """Its causes, in words."""
        return ", ".join(sorted(map(str, self.causes)))

    def holds(self, now: float) -> bool:
        """Whether it still holds at ``now``: up to, not at, its until-time."""
        return now < self.until


class Holds:
    """The hold table, by URL. Every operation takes the time from its caller (the ledger's
    clock) and returns what it changed, ``None`` when it changed nothing."""

    def __init__(self) -> None:
        self._held: dict[str, Hold] = {}
        #: URLs whose hold ran out: not held again until their accusation's reads end.
        self._spent: set[str] = set()

    def get(self, url: str) -> Hold | None:
        return self._held.get(url)

    def spent(self, url: str) -> bool:
        return url in self._spent

    def hold(self, url: str, cause: HoldCause, now: float, for_s: float) -> Hold | None:
        """Hold ``url`` for ``cause``: the new hold, or ``None`` (held so already, or spent).
        The until-time is set by the first cause; a second one adds to the hold, never
        lengthens it (a hold is at most ``for_s``, whatever holds it)."""
        if url in self._spent:
            return None
        old = self._held.get(url)
        if old is not None and cause in old.causes:
            return None
        new = (Hold(frozenset({cause}), now, now + for_s) if old is None
               else replace(old, causes=old.causes | {cause}))
        self._held[url] = new
        return new

    def release(self, url: str, cause: HoldCause) -> Hold | None:
        """``cause`` ends: the hold as it was, or ``None`` (``cause`` did not hold it). The
        URL stays held for its other causes, to the same until-time."""
        old = self._held.get(url)
        if old is None or cause not in old.causes:
            return None
        rest = old.causes - {cause}
        if rest:
            self._held[url] = replace(old, causes=rest)
        else:
            del self._held[url]
        return old

    def due(self, now: float) -> list[str]:
        """The URLs whose hold no longer holds at ``now`` (:meth:`expire` ends them)."""
        return [url for url, h in self._held.items() if not h.holds(now)]

    def expire(self, url: str) -> Hold | None:
        """End ``url``'s hold at its until-time, every cause at once: spent until
        :meth:`reads_ended`."""
        old = self._held.pop(url, None)
        if old is not None:
            self._spent.add(url)
        return old

    def reads_ended(self, url: str) -> None:
        """``url``'s accusation's reads ended: a new accusation may hold it again."""
        self._spent.discard(url)

    def held(self, now: float) -> set[str]:
        """The URLs held at ``now`` (a hold past its until-time holds nothing, expired or
        not yet)."""
        return {url for url, h in self._held.items() if h.holds(now)}


def never_empty(serving: Sequence[str], held: Set[str]) -> list[str]:
    """``serving`` less the URLs ``held``, unless that would leave none: an engine in doubt
    still serves when it is all there is (a held engine is no condemned one)."""
    kept = [url for url in serving if url not in held]
    return kept or list(serving)


def admitted(*, serves: bool, ejected: bool, on_trial: bool, held: bool,
             panicking: bool) -> Admitted:
    """One shard's admission from the ledger's facts: ``serves`` (a ROUTABLE state),
    ``ejected`` (an ejection's time set), ``on_trial``, ``held`` (held now) and whether the
    fleet is below its panic threshold (ejected engines serve then). Held is reported before
    the never-empty rule, which looks at the whole fleet (:func:`never_empty`)."""
    if not serves:
        return Admitted.OUT
    if ejected and not panicking:
        return Admitted.EJECTED
    if held:
        return Admitted.HELD
    return Admitted.ON_TRIAL if on_trial else Admitted.ROUTED
