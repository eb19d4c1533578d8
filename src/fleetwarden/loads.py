"""The checkpoint loads fleetwarden runs itself: ``refit_from`` (a checkpoint into every
participant, credited only where its engine confirms it) and a replacement's catch-up (the
last checkpoint loaded into an engine that came back after it).

Owns: a load's steps (out of routing, drained, paused, reloaded, stamped, resumed,
confirmed), the checkpoint a replacement is loaded from, and the routers' fault counters a
load charges to its trainer's step.
Must not: decide who serves or what version a process holds: the ledger does, from the refit
coordinator's completion (``refit.py``); this module only asks for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from fleetwarden.ledger import ABSENT, ShardState
from fleetwarden.refit import Lease, RefitRecord, confirmation
from fleetwarden.sleep import drain_routers
from fleetwarden.weight_sync import (
    CONFIRM_READ_S,
    PAUSE_MODES,
    EngineOutcome,
    RefitLoad,
    cost_since,
    cost_totals,
    load_checkpoint,
    read_all,
    read_weights,
)

if TYPE_CHECKING:
    from fleetwarden.fleet import Fleet

__all__ = ["CheckpointLoads"]

log = logging.getLogger(__name__)


class CheckpointLoads:
    """The refits of one running fleet: the trainer's begin, complete and abort, with every
    participant read at both ends (docs/design.md section 8); and the loads fleetwarden runs
    itself, one at a time: a fleet's and a replacement's never overlap."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        #: The checkpoint of the last load fleetwarden ran (``refit_from``): a replacement
        #: engine waiting in STALE is loaded from it at once (:meth:`_catch_up`).
        self._source: tuple[str, int, Mapping[str, str] | None] | None = None
        #: Loads fleetwarden runs, one at a time: a fleet's and a replacement's never overlap.
        self._loading = asyncio.Lock()
        self._catching_up: asyncio.Task[None] | None = None
        #: (shard, incarnation, version) already tried: a replacement is loaded once per
        #: process and checkpoint, so an engine that cannot load is not tried every tick.
        self._caught: set[tuple[int, str | None, int]] = set()
        #: The routers' fault counters at the end of the last load (``refit_from``): the next
        #: one charges the trainer's step with what they counted since (``RefitLoad.cost``).
        self._costs_at_load: dict[str, Any] = cost_totals([])

    async def close(self) -> None:
        """The fleet stops: a catch-up under way ends first."""
        if self._catching_up is not None:
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._catching_up

    async def begin_refit(self, version: int) -> Lease:
        lease = self.fleet.refit.begin_refit(version)
        # Every participant read at the start: the baseline its read at the completion is
        # compared with (docs/design.md section 8).
        self.fleet.refit.read_at_start(await self.fleet.controller.reads.read_participants())
        self.fleet.admin.announce("refit", phase="begin", version=version)
        return lease

    async def complete_refit(self, version: int, checksums: Mapping[str, str] | None = None,
                             *, failed: Mapping[int, str] | None = None) -> RefitRecord:
        # Every participant read once more first: a version is credited only to a process
        # known alive through the whole lease, and whose engine, where it can say, says it
        # holds that version (and the trainer's checksums, when given): docs/design.md
        # section 8.
        lease = self.fleet.refit.lease
        engine_of = self.fleet.config.fleet.engine_of
        targets = {} if lease is None else {
            p.shard: (p.url, engine_of(p.shard)) for p in lease.participants}
        read, weights = await asyncio.gather(
            self.fleet.controller.reads.read_participants(),
            read_all(targets, checksums=checksums is not None,
                     timeout_s=max(self.fleet.config.health.probe_timeout_s, CONFIRM_READ_S),
                     keys={i: self.fleet.engine_keys.of_shard(i) for i in targets}))
        record = self.fleet.refit.complete_refit(version, read_at_end=read, weights=weights,
                                           checksums=checksums, failed=failed)
        self.fleet.controller.wake()
        self.fleet.admin.announce("refit", phase="complete", version=version)
        return record

    def abort_refit(self, version: int, reason: str) -> RefitRecord:
        record = self.fleet.refit.abort_refit(version, reason)
        self.fleet.controller.wake()
        self.fleet.admin.announce("refit", phase="abort", version=version)
        return record

    async def refit_from(self, path: str, version: int, *, pause_mode: str | None = None,
                         checksums: Mapping[str, str] | None = None) -> RefitLoad:
        """Load the checkpoint at ``path`` into every participant as ``version``, and credit
        only the engines that confirm it. Out of routing first (each participant STALE: no
        request is sent to an engine whose weights are changing, nor labelled with a version
        it no longer holds), the routers' requests on them drained for ``[refit] drain_s``;
        then on every engine at once: pause (``pause_mode``, default ``[refit] pause_mode``),
        reload from ``path``, stamp ``version``, resume; then the completion reads each
        engine's own version (and checksums, when given). An engine whose load failed stays
        STALE with the error; the others serve ``version``; the routers know before this
        returns. Per engine: :class:`~fleetwarden.weight_sync.EngineOutcome`."""
        mode = self.fleet.config.refit.pause_mode if pause_mode is None else pause_mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self._catching_up is not None and not self._catching_up.done():
            # The trainer's load goes first: a replacement being caught up is a participant
            # of it (STALE), loaded with the newer checkpoint after whatever its engine was
            # doing (vLLM's core takes one call at a time).
            self._catching_up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._catching_up
        async with self._loading:
            load = await self._refit_from(path, version, mode, checksums)
        now = await self._fault_costs()
        load = dataclasses.replace(load, cost=cost_since(self._costs_at_load, now))
        self._costs_at_load = now
        if load.credited:
            self._source = (path, version, checksums)  # what a replacement is loaded from
        return load

    async def _refit_from(self, path: str, version: int, mode: str,
                          checksums: Mapping[str, str] | None) -> RefitLoad:
        cfg = self.fleet.config.refit
        started = time.monotonic()
        lease = await self.begin_refit(version)
        if self.fleet.ledger.weights_loaded():
            # From the first load on, a good canary would label a new process's launch
            # weights with the checkpoint's version (docs/rl.md, a replacement's weights).
            log.warning("weights = \"static\" no longer holds: fleetwarden loads %s as version "
                        "%d, so a new engine process waits in STALE until it is loaded with the "
                        "fleet's checkpoint (as with weights = \"trainer\")", path, version)
        try:
            parts = [(p.shard, p.url) for p in lease.participants
                     if self.fleet.ledger.shard(p.shard).base_url == p.url
                     and self.fleet.ledger.state(p.shard) not in ABSENT]
            for i, _ in parts:
                self.fleet.ledger.mark_weights_partial(i, f"loading weight version {version} from "
                                                    f"{path}")
            pushes = self.fleet.controller.pushes
            await pushes.push()
            # Requests already sent finish where they are (for drain_s at most; past it the
            # pause mode decides), so none reaches an engine in the middle of its load.
            await drain_routers(pushes, {url for _, url in parts}, cfg.drain_s)
            if mode == "keep":
                # Those still under way go on under the new weights: their answers name both
                # versions, never the old one alone (docs/rl.md, the pause mode).
                await pushes.weights_changing([url for _, url in parts], version)
            timeout = aiohttp.ClientTimeout(total=cfg.load_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                loads = await asyncio.gather(*(
                    load_checkpoint(http, url, path, version, pause_mode=mode,
                                    key=self.fleet.engine_keys.of_shard(i))
                    for i, url in parts))
            failed = {i: r.error for (i, _), r in zip(parts, loads, strict=True) if not r.took}
            record = await self.complete_refit(version, checksums, failed=failed)
        except BaseException:
            if self.fleet.refit.lease is not None and self.fleet.refit.lease.version == version:
                self.abort_refit(version, "the load was interrupted")
            raise
        await self.fleet.push()
        disagreed = dict(record.unconfirmed)
        engines = tuple(
            EngineOutcome(i, url, took=r.took,
                          confirmed=True if i in record.confirmed
                          else False if i in disagreed else None,
                          state=self.fleet.ledger.state(i).value,
                          error=r.error or disagreed.get(i, ""), seconds=r.seconds)
            for (i, url), r in zip(parts, loads, strict=True))
        return RefitLoad(version, path, mode, engines, time.monotonic() - started)

    async def _fault_costs(self) -> dict[str, Any]:
        """The routers' fault counters now, summed (:func:`~fleetwarden.weight_sync.
        cost_totals`); a router that does not answer is left out of this read."""
        said = []
        for link in self.fleet.controller.routers:
            try:
                said.append((await link.status())["stats"])
            except Exception as exc:
                log.warning("router %s: its counters were not read: %s", link.name, exc)
        return cost_totals(said)

    def _stale_replacements(self) -> list[int]:
        """STALE shards not yet tried with the current source, in this process."""
        if self._source is None:
            return []
        version = self._source[1]
        return [r.index for r in self.fleet.ledger.snapshot()
                if r.state is ShardState.STALE and r.weight_version <= version
                and (r.index, r.incarnation, version) not in self._caught]

    async def _catch_up(self) -> None:
        """Load the last checkpoint fleetwarden loaded into each replacement engine waiting in
        STALE (restarted, or attached after the load), only it, at once: without this it
        would wait for the trainer's next step, or, worse, in static mode be promoted with the
        checkpoint's weights under the current version. Credited only where its engine
        confirms the version (an engine that cannot say waits for the next refit) and its
        process is the one loaded (the same URL and incarnation before and after)."""
        assert self._source is not None
        path, version, checksums = self._source
        async with self._loading:
            if self.fleet.refit.lease is not None:
                return
            shards = [(i, self.fleet.ledger.shard(i)) for i in self._stale_replacements()]
            self._caught = {c for c in self._caught if c[2] == version}  # older: done with
            self._caught.update((i, r.incarnation, version) for i, r in shards)
            timeout = aiohttp.ClientTimeout(total=self.fleet.config.refit.load_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                loads = await asyncio.gather(*(
                    load_checkpoint(http, r.base_url, path, version,
                                    pause_mode=self.fleet.config.refit.pause_mode,
                                    key=self.fleet.engine_keys.of_shard(i))
                    for i, r in shards))
                said = await asyncio.gather(*(
                    read_weights(http, r.base_url, self.fleet.config.fleet.engine_of(i),
                                 checksums=checksums is not None,
                                 key=self.fleet.engine_keys.of_shard(i)) for i, r in shards))
            credited = []
            for (i, before), load, weights in zip(shards, loads, said, strict=True):
                now = self.fleet.ledger.shard(i)
                ok, why = confirmation(version, checksums, weights)
                if not load.took or ok is not True or now.state is not ShardState.STALE or (
                        now.base_url, now.incarnation) != (before.base_url, before.incarnation):
                    log.warning("shard %d: not loaded with version %d from %s: %s", i,
                                version, path, load.error or why)
                    continue
                self.fleet.ledger.report_refit(i, version)
                credited.append(i)
        if credited:
            await self.fleet.push()
            self.fleet.admin.announce("refit", phase="catch-up", version=version)

    def catch_up_soon(self) -> None:
        """Start a catch-up load (:meth:`_catch_up`) when a replacement waits for one and no
        load runs."""
        if (self._source is not None and self.fleet.refit.lease is None
                and not self._loading.locked()
                and (self._catching_up is None or self._catching_up.done())
                and self._stale_replacements()):
            self._catching_up = asyncio.ensure_future(self._catch_up())
