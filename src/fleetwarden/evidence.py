"""Evidence intake: what the routers saw of the engines, into the ledger and into accusations.

Owns: the routers' outcome windows (drained one at a time per router, applied to the ledger),
the in-process routers' failure events, the remote routers' long poll (``GET /evidence``),
the polling for requests held silent, and the questions every read asks the routers first
(requests in flight and how long the oldest has been silent, per engine).
Must not: read an engine or decide health (the watchdog reads, the judge and the ledger's table
decide), or push the serving set (the controller does); an accusation goes to its ``accuse``
callback, which starts focused reads (focus.py).

Evidence does not wait for the tick (docs/design.md, "Judgement at the speed of evidence"):

* An in-process router reports each failed attempt as it happens (its ``listen``); its outcomes
  are drained at once, so the ledger ejects the engine within milliseconds.
* A router in another process holds one long poll open; a failed attempt it answers with is
  drained at once too.
* Engines holding requests silent for ``silent_after_s`` are accused: asked for every
  ``evidence_poll_s`` of the in-process routers, at each long poll's answer and once a tick of
  the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from fleetwarden.config import Config
from fleetwarden.ledger import Ledger
from fleetwarden.router.links import EVIDENCE_WAIT_S, ControlError, RouterLink
from fleetwarden.router.ops import Holding
from fleetwarden.tasks import TaskOwner, sleep_unless
from fleetwarden.workmeter import WorkMeter

__all__ = ["Evidence", "router_error"]

log = logging.getLogger(__name__)


class Evidence:
    """The routers' evidence about the engines, taken in as it comes."""

    def __init__(self, ledger: Ledger, routers: Sequence[RouterLink], config: Config, *,
                 tasks: TaskOwner, meter: WorkMeter,
                 accuse: Callable[[int, str], None]) -> None:
        self.ledger = ledger
        self.routers = routers
        self.config = config
        self.tasks = tasks
        self.meter = meter
        #: Starts focused reads of a shard, saying why.
        self.accuse = accuse
        #: URLs whose engine was seen restarted on its own since their last drained window:
        #: that window's failures are the old process's, never the new one's.
        self._renewed: set[str] = set()
        #: Links whose outcomes are drained now (an evidence event came), not at the tick.
        self._drain_pending: set[int] = set()
        self._drain_locks = [asyncio.Lock() for _ in self.routers]
        #: When each router's current window began (the ledger's clock: its last drain).
        self._window_began: list[float | None] = [None for _ in self.routers]
        #: When each link's first reported failure of the burst not yet drained came.
        self._evidence_at: dict[int, float] = {}
        self._unlisten = [link.listen(self._failed_at(k))
                          for k, link in enumerate(self.routers) if link.in_process]

    def renewed(self, url: str) -> None:
        """The engine at ``url`` restarted on its own: its window's failures are not its own."""
        self._renewed.add(url)

    def close(self) -> None:
        for unlisten in self._unlisten:
            unlisten()

    # ------------------------------------------------------------------ windows

    def _failed_at(self, k: int) -> Callable[[str, str], None]:
        def failed(url: str, cause: str) -> None:
            # Called inside the router's request path: only schedule, never wait. Failures
            # that come in the same turn of the loop (a burst) are drained as one window.
            if k not in self._drain_pending:
                self._drain_pending.add(k)
                self._evidence_at.setdefault(k, time.monotonic())
                self.tasks.start_if_running(self._drain_now(k), f"drain:{k}")
        return failed

    async def _drain_now(self, k: int) -> None:
        self._drain_pending.discard(k)
        try:
            began, outcomes = await self._drain(k)
        except Exception as exc:
            log.warning("router %s: drain: %s", self.routers[k].name, exc)
            return
        self.apply_outcomes(outcomes, window_began_at=began)
        came = self._evidence_at.pop(k, None)
        if came is not None:
            self.meter.decided(time.monotonic() - came)

    async def _drain(self, k: int) -> tuple[float | None, dict[str, tuple[int, int, int]]]:
        """One window of router ``k``'s outcomes, and when it began (None: the first). One
        drain per router at a time: two in flight would both acknowledge the same batch, and
        the router would count it twice. The next window is dated from just before this
        drain is asked for: a little early, so a suspicion is never taken to be older than
        the window."""
        async with self._drain_locks[k]:
            began, self._window_began[k] = self._window_began[k], self.ledger.now()
            try:
                return began, await self.routers[k].drain_outcomes()
            except BaseException:
                # nothing was acknowledged: the window still began where it did
                self._window_began[k] = began
                raise

    async def take_windows(self, failed_probe: frozenset[str], errors: list[str]) -> None:
        """The tick's intake: one window of outcomes from every router, and the silent
        requests of the routers in other processes. A router that fails is noted in
        ``errors`` and the others are read all the same."""
        for k, link in enumerate(self.routers):
            try:
                began, outcomes = await self._drain(k)
            except Exception as exc:
                errors.append(f"{link.name}: drain: {exc}")
                continue
            self.apply_outcomes(outcomes, failed_probe, window_began_at=began)
        remote = [link for link in self.routers if not link.in_process]
        if remote:
            await self._accuse_silent(remote)
        # Every router's window of this tick has been read: a restart seen before it no longer
        # needs its failures set aside.
        self._renewed.clear()

    def apply_outcomes(self, outcomes: Mapping[str, tuple[int, int, int]],
                       failed_probe: frozenset[str] = frozenset(), *,
                       window_began_at: float | None = None) -> None:
        """Router windows into the ledger. ``failed_probe``: engines whose probe failed in
        this tick's round: their windows began before it and may have ended before it too,
        so their completions lift no suspicion (:meth:`Ledger.report_outcomes`); nor do
        those of a window that began before the engine became suspect (``window_began_at``,
        the ledger's clock)."""
        for url, (successes, failures, trailing) in outcomes.items():
            i = self.ledger.shard_for_url(url)
            if i is None:
                continue
            if url in self._renewed:
                # The engine restarted on its own during this window: its failures are the old
                # process's (they are why it restarted), and a new process has no history.
                failures = trailing = 0
            self.ledger.report_outcomes(i, successes, failures, trailing,
                                        may_predate_suspicion=url in failed_probe,
                                        window_began_at=window_began_at)

    # ------------------------------------------------------------------ what the routers hold

    async def holding(self, errors: list[str] | None) -> Holding:
        """Per engine, the requests every router has in flight there, and how long the oldest
        request any router holds there has received nothing (engines holding none left out,
        as ``silent``): one read of each router (``errors``: where a router's failure is
        noted; ``None``: logged)."""
        total: dict[str, int] = {}
        oldest: dict[str, float] = {}
        for link in self.routers:
            try:
                holding = await link.holding()
            except Exception as exc:
                router_error(errors, f"{link.name}: holding: {exc}")
                continue
            for url, n in holding.in_flight.items():
                total[url] = total.get(url, 0) + n
            for url, age in holding.silent.items():
                oldest[url] = max(oldest.get(url, 0.0), age)
        return Holding(total, oldest)

    # ------------------------------------------------------------------ watching

    def watch(self, stop: asyncio.Event, tasks: TaskOwner) -> None:
        """Start, in ``tasks``, the watchers that run until ``stop``: the silent-request poll
        of the in-process routers, and one long poll per router in another process."""
        tasks.start(self._watch_silence(stop), "watch-silence")
        for k, link in enumerate(self.routers):
            if not link.in_process:
                tasks.start(self._watch_remote(k, stop), f"evidence:{k}")

    async def _watch_remote(self, k: int, stop: asyncio.Event) -> None:
        """Router ``k`` runs in another process: one long poll of its evidence open at a time
        (``GET /evidence``). A failed attempt drains its outcomes at once (the ledger ejects
        within a round trip, as for a router in this process); engines holding requests
        silent are accused. A router that does not answer is retried at the tick's pace; an
        older one without the call is judged at the tick, as before."""
        link = self.routers[k]
        h = self.config.health
        while not stop.is_set():
            try:
                failed, silent = await link.evidence(EVIDENCE_WAIT_S, h.silent_after_s)
            except ControlError as exc:
                if exc.status == 404:
                    log.info("router %s has no evidence call: judged at the tick", link.name)
                    return
                log.warning("router %s: evidence: %s", link.name, exc)
                await sleep_unless(stop, h.probe_interval_s)
                continue
            except Exception as exc:  # down, or restarting: the tick reports it
                log.debug("router %s: evidence: %s", link.name, exc)
                await sleep_unless(stop, h.probe_interval_s)
                continue
            if failed:
                await self._drain_now(k)
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.accuse(i, "silent requests")
            if silent and not failed:
                # still silent at the next poll, which would answer at once: the in-process
                # routers are asked at this pace too
                await sleep_unless(stop, h.evidence_poll_s)

    async def _watch_silence(self, stop: asyncio.Event) -> None:
        """Every ``evidence_poll_s``: engines holding requests silent for ``silent_after_s``
        are accused (in-process routers; those in other processes: :meth:`_watch_remote`)."""
        h = self.config.health
        local = [link for link in self.routers if link.in_process]
        if not local:
            return
        while not stop.is_set():
            await self._accuse_silent(local)
            await sleep_unless(stop, h.evidence_poll_s)

    async def _accuse_silent(self, links: Sequence[RouterLink]) -> None:
        after = self.config.health.silent_after_s
        for link in links:
            try:
                silent = (await link.holding(after)).silent
            except Exception as exc:
                log.warning("router %s: silent: %s", link.name, exc)
                continue
            for url in silent:
                i = self.ledger.shard_for_url(url)
                if i is not None:
                    self.accuse(i, "silent requests")


def router_error(errors: list[str] | None, message: str) -> None:
    """A router's failure noted where the caller keeps them (a tick's report), or logged."""
    if errors is None:
        log.warning("%s", message)
    else:
        errors.append(message)
