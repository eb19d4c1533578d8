"""The supervisor: restarts condemned shards through a launcher, within budgets.

Owns: restarts: budgets, backoff, the concurrency cap, and every task it starts.
Must not: decide that a shard is condemned (the ledger does) or how an engine is launched (the
launchers do).

The ledger decides *that* a shard is restarted (it is DEAD and has budget left); the supervisor
does it: ``mark_restarting`` (spends one restart), launch, wait until the engine answers within
``startup_timeout_s``, then ``mark_loaded`` with the new URL and incarnation. A failed attempt is
``mark_restart_failed`` and an exponential backoff (2 s doubling to 60 s). At most
``max_concurrent_restarts`` run at once, fleet-wide.

Restarts run in the background, each a task owned by the supervisor (a :class:`TaskOwner`: none
is started bare, none outlives :meth:`Supervisor.close`, which cancels the attempts and awaits
every task, background stops included); the ledger is only
touched from :meth:`Supervisor.tick` and the exit callback, both on the controller's event loop.
A process exit is conclusive: the shard is condemned the moment the launcher sees it.

A condemnation reaches the supervisor the way it reaches the routers: through the ledger's
transition stream. A shard that goes DEAD, whoever condemned it, has its restart begun on the
next turn of the event loop, not at the next tick. A restart that ends is collected the same
way, as its task ends: a replacement that answers is loaded (and the controller proves it with
one canary) at once, not at the next tick, which left a restarted engine unrouted for up to a
tick after it answered (docs/design.md, "A comeback is seen at once").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fleetwarden.config import FleetConfig, SupervisorConfig
from fleetwarden.journal import Journal
from fleetwarden.launchers import EngineHandle, Launcher, LaunchError
from fleetwarden.ledger import ABSENT, Ledger, ShardState, Transition
from fleetwarden.tasks import TaskOwner

__all__ = ["RestartAttempt", "Supervisor", "launch_first"]

log = logging.getLogger(__name__)

@dataclass
class RestartAttempt:
    shard: int
    attempt: int
    started_at: float
    task: asyncio.Task[EngineHandle]
    #: Waiting for something else to restart the engine: no budget spent until it returns.
    passive: bool = False


class Supervisor:
    """Keeps one engine per shard running, restarting condemned ones within budgets."""

    def __init__(
        self,
        ledger: Ledger,
        launcher: Launcher,
        fleet: FleetConfig,
        config: SupervisorConfig,
        *,
        journal: Journal | None = None,
        passive: Callable[[int], bool] = lambda i: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.launcher = launcher
        self.fleet = fleet
        self.config = config
        self.journal = journal
        #: Shards whose engines something else restarts: wait for their return, spend the
        #: budget only when a new process answers (attach mode with no restart command).
        self.passive = passive
        self.clock = clock
        #: The engine of each shard that has one (launched by this supervisor or adopted).
        self.engines: dict[int, EngineHandle] = {}
        self.attempts: dict[int, RestartAttempt] = {}
        #: Earliest time of the next attempt per shard, after a failed one.
        self._not_before: dict[int, float] = {}
        self._failures_in_a_row: dict[int, int] = {}
        #: Awaited before a condemned engine's process is stopped, with its URL: the routers
        #: must have moved its requests first (``Pushes.released``, pushes.py).
        #: Stopped first, a wedged vLLM is let go (SIGCONT) into its shutdown, which aborts
        #: what it held and answers each one 200 with ``finish_reason`` "abort": a truncated
        #: answer the router would pass on as a success (seen in CI's real-vLLM tier).
        self.before_stop: Callable[[str], Awaitable[None]] | None = None
        #: Every task this supervisor starts: restart attempts and background stops.
        self.tasks = TaskOwner()
        self.cap = config.concurrency_cap(len(ledger))
        #: Restarts completed since start, for the fleet's own metrics.
        self.restarts_completed = 0
        self.restarts_failed = 0
        #: Durations of recent successful restarts, for the routers' Retry-After estimate.
        self._durations: list[float] = []
        self._tick_pending = False
        self._closing = False
        self._unsubscribe = ledger.subscribe(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        if t.to_state is ShardState.DEAD:
            self._tick_soon()

    def _tick_soon(self) -> None:
        """A pass on the next turn of the event loop (a condemnation, an attempt that ended)."""
        if self._tick_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: the next tick begins the restart
        self._tick_pending = True
        loop.call_soon(self._tick_now)

    def _tick_now(self) -> None:
        self._tick_pending = False
        if self._closing:
            return  # scheduled before close(): nothing new starts now
        try:
            self.tick()
        except Exception:
            log.exception("supervisor: a restart begun on a condemnation failed to start")

    # ------------------------------------------------------------------ start

    def adopt(self, i: int, handle: EngineHandle) -> None:
        """Take charge of a running engine (a first launch, or one from an earlier run)."""
        self.engines[i] = handle

    # ------------------------------------------------------------------ the tick

    def tick(self) -> None:
        """Collect finished restarts, then start restarts for DEAD shards (within the cap)."""
        self._collect()
        now = self.clock()
        for i in range(len(self.ledger)):
            state = self.ledger.state(i)
            if state is ShardState.RETIRED:
                if i in self.attempts:  # retired while restarting or awaited: nothing to wait for
                    self._cancel(self.attempts.pop(i))
                if i in self.engines:
                    self._stop_in_background(self.engines.pop(i))
            if state is ShardState.RESTARTING and i not in self.attempts:
                # Nothing of ours brings it up (a restore whose first launch failed): without
                # this it would wait for ever. The next pass restarts it as any DEAD shard.
                self.ledger.mark_restart_failed(i, "no restart attempt is in progress")
                state = self.ledger.state(i)
            if state is not ShardState.DEAD or i in self.attempts:
                continue
            if self.passive(i):
                task = self.tasks.start(self._restart(i), f"await-return:{i}", collected=True)
                task.add_done_callback(self._attempt_ended)
                self.attempts[i] = RestartAttempt(i, 0, now, task, passive=True)
                continue
            if self.restarts_in_progress() >= self.cap or now < self._not_before.get(i, 0.0):
                continue
            outcome = self.ledger.mark_restarting(i)
            record = self.ledger.shard(i)
            if self.ledger.state(i) is ShardState.RETIRED:
                log.error("shard %d retired: %s", i, record.last_error)
                if self.journal is not None:
                    self.journal.record_restart(i, record.restart_attempts, "retired",
                                                record.last_error)
                old = self.engines.pop(i, None)
                if old is not None:
                    self._stop_in_background(old)
                continue
            if not outcome:
                continue
            attempt = record.restart_attempts
            task = self.tasks.start(self._restart(i), f"restart:{i}:{attempt}",
                                    collected=True)
            task.add_done_callback(self._attempt_ended)
            self.attempts[i] = RestartAttempt(i, attempt, now, task)
            if self.journal is not None:
                self.journal.record_restart(i, attempt, "started")
            log.info("shard %d: restart %d of %d begun", i, attempt,
                     self.ledger.policy.max_restart_attempts)

    def _attempt_ended(self, task: asyncio.Task[EngineHandle]) -> None:
        """Collected on the next turn of the loop: a replacement that answers is loaded now."""
        if not task.cancelled():
            self._tick_soon()

    def coming_back(self, i: int) -> bool:
        """Whether shard ``i`` has an engine on its way back: a restart under way, a DEAD
        shard whose restart begins (budget left), or one whose return something else is
        awaited for, within ``startup_timeout_s`` of its condemnation (the time a launched
        engine gets to start; past it, nothing is known to be coming). What the routers are
        told, so that a request finding no engine waits for it a while (docs/design.md, "None
        left, one coming")."""
        state = self.ledger.state(i)
        if state is ShardState.RESTARTING:
            return True
        if state is not ShardState.DEAD:
            return False
        attempt = self.attempts.get(i)
        if attempt is not None and not attempt.passive:
            return True
        if self.passive(i):
            since = attempt.started_at if attempt is not None else self.clock()
            return self.clock() - since < self.fleet.startup_timeout_s
        record = self.ledger.shard(i)
        return record.restart_attempts < self.ledger.policy.max_restart_attempts

    def restarts_in_progress(self) -> int:
        """Attempts that hold a slot of the fleet-wide cap. A passive wait for an attached
        engine's return costs this machine nothing and may last for ever (the system that runs
        it may never replace it), so it holds none: it never keeps another shard DEAD."""
        return sum(1 for a in self.attempts.values() if not a.passive)

    def _cancel(self, attempt: RestartAttempt) -> None:
        attempt.task.cancel()  # the attempt stops what it launched on its way out (its task
        # stays owned by self.tasks, so close() awaits that stop)

    def _collect(self) -> None:
        for i, attempt in list(self.attempts.items()):
            if not attempt.task.done():
                continue
            del self.attempts[i]
            try:
                self._finish(i, attempt)
            except Exception:
                # A bug here must cost one attempt, never the caller's tick: the shard is put
                # back to DEAD (when the attempt had made it RESTARTING) so the next tick retries.
                log.exception("shard %d: collecting restart %d failed", i, attempt.attempt)
                self.ledger.mark_restart_failed(i, "the attempt could not be collected")

    def _finish(self, i: int, attempt: RestartAttempt) -> None:
        try:
            handle = attempt.task.result()
        except asyncio.CancelledError:
            error = "cancelled"
            handle = None
        except Exception as exc:  # a failed attempt, whatever its cause
            error = str(exc) or type(exc).__name__
            handle = None
        if attempt.passive:
            if handle is None or self.ledger.state(i) is not ShardState.DEAD:
                return  # cancelled, or the shard left DEAD some other way; look again
            self.ledger.mark_restarting(i)  # restarted by someone else: still a restart
            if self.ledger.state(i) is not ShardState.RESTARTING:
                return  # that restart exhausted the budget: RETIRED
            attempt.attempt = self.ledger.shard(i).restart_attempts
        if handle is not None and not handle.exited:
            self.engines[i] = handle
            loaded = self.ledger.mark_loaded(i, handle.url, handle.incarnation)
            if loaded:
                self._failures_in_a_row.pop(i, None)
                self._not_before.pop(i, None)
                self.restarts_completed += 1
                self._durations = [*self._durations[-9:], self.clock() - attempt.started_at]
                if self.journal is not None:
                    self.journal.record_restart(i, attempt.attempt, "loaded", handle.url)
                log.info("shard %d: replacement up at %s", i, handle.url)
                return
            error = f"ledger refused the load: {loaded.reason}"
            self._stop_in_background(self.engines.pop(i))
        elif handle is not None:
            error = f"{handle.exit_description} right after starting"
        self.restarts_failed += 1
        failures = self._failures_in_a_row.get(i, 0) + 1
        self._failures_in_a_row[i] = failures
        delay = min(self.config.backoff_initial_s * 2 ** (failures - 1),
                    self.config.backoff_max_s)
        self._not_before[i] = self.clock() + delay
        self.ledger.mark_restart_failed(i, error)
        if self.journal is not None:
            self.journal.record_restart(i, attempt.attempt, "failed", error)
        log.warning("shard %d: restart %d failed (%s); next try in %.0f s",
                    i, attempt.attempt, error, delay)

    async def _restart(self, i: int) -> EngineHandle:
        old = self.engines.pop(i, None)
        if old is not None:
            if self.before_stop is not None:
                await self.before_stop(old.url)
            await self.launcher.stop(old)  # the whole group, verified gone
        if self.passive(i):  # waits for as long as the system that runs it takes
            return await _launch_ready(self.launcher, i, float("inf"))
        return await _launch_ready(self.launcher, i, self.fleet.startup_timeout_s)

    def typical_restart_s(self) -> float:
        """The median of the last successful restarts; before any, the startup timeout's tenth
        (a rough first guess that the next completed restart replaces)."""
        if not self._durations:
            return self.fleet.startup_timeout_s / 10
        ordered = sorted(self._durations)
        return ordered[len(ordered) // 2]

    # ------------------------------------------------------------------ exits and stops

    def engine_exited(self, handle: EngineHandle) -> None:
        """The launcher saw an engine's process end. Conclusive: condemn it now."""
        current = self.engines.get(handle.shard)
        if current is not handle:
            return  # an old incarnation, or one that a restart attempt is watching itself
        self._condemn(handle.shard, handle.exit_description)

    def _condemn(self, i: int, cause: str) -> None:
        self.ledger.condemn(i, cause)  # the transition tells the routers and this supervisor

    def _stop_in_background(self, handle: EngineHandle) -> None:
        self.tasks.start(self._stop_logged(handle), f"stop:{handle.launch_id}")

    async def _stop_logged(self, handle: EngineHandle) -> None:
        try:
            await self.launcher.stop(handle)
        except Exception as exc:  # never swallowed: an engine may be left running
            log.error("shard %d: stopping engine %s failed: %s", handle.shard, handle.launch_id,
                      exc)

    async def restart_now(self, i: int, reason: str) -> bool:
        """An operator's restart: condemn the shard so the next tick replaces it."""
        if self.ledger.state(i) in ABSENT:
            return False
        self._condemn(i, reason)
        self._not_before.pop(i, None)
        self.tick()
        return True

    async def close(self) -> bool:
        """Cancel restarts in progress and stop every engine (the launcher's own check that
        nothing of any group is left). True when every engine was stopped and verified gone."""
        self._closing = True
        self._unsubscribe()
        for attempt in self.attempts.values():
            attempt.task.cancel()
        self.attempts.clear()
        await self.tasks.wait_all()  # the cancelled attempts, and every stop to its end
        self.engines.clear()
        try:
            await self.launcher.close()
        except LaunchError as exc:
            log.error("stopping the engines: %s", exc)
            return False
        return True


async def launch_first(
    launcher: Launcher, shards: list[int], startup_timeout_s: float
) -> dict[int, EngineHandle | BaseException]:
    """Start the first engine of each shard concurrently, before there is a ledger to record
    them in (the ledger is then built with their URLs). A failure is returned, not raised."""

    results = await asyncio.gather(
        *(_launch_ready(launcher, i, startup_timeout_s) for i in shards), return_exceptions=True
    )
    return dict(zip(shards, results, strict=True))


async def _launch_ready(launcher: Launcher, i: int, timeout_s: float) -> EngineHandle:
    """Launch shard ``i``'s engine and wait until it answers, all within ``timeout_s``: a
    launch that hangs (a restart command, a scheduler that never places the engine) fails the
    attempt like an engine that never answers. What was launched is stopped on any failure."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    handle: EngineHandle | None = None
    try:
        async with asyncio.timeout_at(deadline if timeout_s != float("inf") else None):
            handle = await launcher.launch(i)
            await launcher.wait_ready(handle, max(0.0, deadline - loop.time()))
    except TimeoutError:
        await _stop_quietly(launcher, handle)
        step = "launch" if handle is None else "wait for /health"
        raise LaunchError(f"shard {i}: no engine ready within {timeout_s:g} s "
                          f"(the {step} did not finish)") from None
    except BaseException:
        await _stop_quietly(launcher, handle)
        raise
    return handle


async def _stop_quietly(launcher: Launcher, handle: EngineHandle | None) -> None:
    if handle is not None:
        try:
            await launcher.stop(handle)
        except Exception as exc:
            log.error("shard %d: stopping a failed attempt's engine: %s", handle.shard, exc)
