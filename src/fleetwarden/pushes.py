"""What the routers are told: the serving set with each engine's facts, rescues, the wait.

Owns: the push (the ledger's routed set, the trial set and ``coming_back``, with each serving
engine's facts: shard, weight version, incarnation, models, key, server cap and default limit),
at once when a transition changes what may be routed, coalesced while one is pending
(docs/design.md 6.2); the rescue of what waits on condemned or sleeping engines, and the
supervisor's wait for it before it stops an old process; the Retry-After the routers give
while shards restart; the marks on requests kept across a weight load.
Must not: decide who is routed (the ledger's :class:`~fleetwarden.ledger.Admission` does), read
an engine (what it pushes, the watchdog read), or follow the ledger on its own: the controller's
one transition channel hands it every transition (:meth:`Pushes.follow`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from fleetwarden.config import Config, FleetConfig
from fleetwarden.credentials import NO_KEYS, EngineKeys
from fleetwarden.engines import (
    AUTO,
    COMPLETION_UNKNOWN,
    CapUnknown,
    output_cap_of,
    output_default_of,
    profile,
)
from fleetwarden.ledger import ABSENT, ROUTABLE, Ledger, ShardRecord, ShardState, Transition
from fleetwarden.model_files import generation_config_file
from fleetwarden.reads import ReportBook, router_error
from fleetwarden.router.links import CONTROL_TIMEOUT_S, RouterLink
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.splice import CompletionDefault
from fleetwarden.supervisor import Supervisor
from fleetwarden.tasks import TaskOwner
from fleetwarden.watchdog import Report, Watchdog
from fleetwarden.workmeter import WorkMeter

__all__ = ["RELEASE_WAIT_S", "UNKNOWN", "Pushes", "completion_default_of", "output_cap_from",
           "output_default_from"]

log = logging.getLogger(__name__)

#: The longest the supervisor waits for the routers to be told of a condemnation before it stops
#: the old process: a push and a rescue, each a control call bounded by CONTROL_TIMEOUT_S. In
#: the fleet's own process both are immediate; only a router that does not answer makes it
#: wait this long, and its requests are then moved by the stop itself (refused, re-sent).
RELEASE_WAIT_S = 2 * CONTROL_TIMEOUT_S

#: How :func:`output_cap_from` begins the source of a cap it does not know.
UNKNOWN = "unknown: "


def output_cap_from(said: int | CapUnknown | None, fleet: FleetConfig,
                    shard: int) -> tuple[int | None, str]:
    """A shard's server cap on every request's output, and where it comes from, in the order
    of trust: what its engine's ``/server_info`` says (the running process's word); the
    config's declared ``output_cap``; a launched engine's command
    (``--override-generation-config``); else ``unknown: why`` (:data:`UNKNOWN`: an attached
    engine that says nothing, with no declaration), with ``None``."""
    if not isinstance(said, CapUnknown):
        return said, "engine"
    declared = fleet.declared_output_cap(shard)
    if declared is not None:
        return (None if declared == "none" else int(declared)), "declared"
    if shard < fleet.launched:
        group = fleet.group_of(shard)
        return output_cap_of(fleet.engine_cmd if group is None else group.engine_cmd,
                             generation_config_file), "command"
    return None, f"{UNKNOWN}{said.why}"


def output_default_from(said: int | CapUnknown | None, fleet: FleetConfig,
                        shard: int) -> tuple[int | None, str | None]:
    """A shard's default limit of a request that names none (a chat's; vLLM's
    ``default_sampling_params``, :func:`~fleetwarden.engines.generation_limits`) and why it is
    not known, if it is not: what its engine's ``/server_info`` shows (its model folder, where
    that is on this host), else the config's declared ``output_default``, else a launched
    engine's command (its model folder, ``--generation-config``, the override); else unknown
    (an attached engine elsewhere: its chats naming no limit are continued only as far as
    their finishes proved, docs/design.md 4.1)."""
    if not isinstance(said, CapUnknown):
        return said, None
    declared = fleet.declared_output_default(shard)
    if declared is not None:
        return (None if declared == "none" else int(declared)), None
    if shard < fleet.launched:
        group = fleet.group_of(shard)
        said = output_default_of(fleet.engine_cmd if group is None else group.engine_cmd,
                                 generation_config_file)
        if not isinstance(said, CapUnknown):
            return said, None
    return None, said.why


def completion_default_of(engine: str, report: Report | None) -> CompletionDefault:
    """What a shard's engine gives a completion that names no limit: its kind's rule
    (:data:`~fleetwarden.engines.COMPLETION_FIXED` and the others), the kind configured (its
    ``engine``) or, under ``engine = "auto"``, recognised at its last read (``report``); not
    known before (the router then ends such a completion cut there rather than guess)."""
    kind = profile(engine) if engine != AUTO else None if report is None else report.engine
    return CompletionDefault(COMPLETION_UNKNOWN if kind is None else kind.completion_default)


class Pushes:
    """What the routers are told, and when: every push, rescue and mark goes through here."""

    def __init__(self, ledger: Ledger, watchdog: Watchdog, supervisor: Supervisor,
                 routers: Sequence[RouterLink], config: Config, *, book: ReportBook,
                 tasks: TaskOwner, meter: WorkMeter, engine_keys: EngineKeys = NO_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.watchdog = watchdog
        self.supervisor = supervisor
        #: The controller's own list, not a copy: a router added there is told from then on.
        self.routers = routers
        self.config = config
        self.book = book
        self.tasks = tasks
        self.meter = meter
        #: The API key each shard's engine wants: pushed to the routers (their own requests
        #: there) and sent with sleep and wake.
        self.engine_keys = engine_keys
        self.clock = clock
        #: Shards condemned since the last rescue, with the URL their requests wait on.
        self._condemned: dict[int, str] = {}
        #: Shards that fell asleep since the last tick: their waiting requests move elsewhere,
        #: with their URL and whether the streams begun there move too (an engine seen asleep
        #: holds them; one the trainer holds asleep is still awake: they finish first, sleep.py).
        self._fell_asleep: dict[int, tuple[str, bool]] = {}
        #: The serving and trial sets last pushed: a transition that changes them pushes now.
        self._pushed: tuple[tuple[str, ...], tuple[str, ...], int] | None = None
        self._push_pending = False
        #: The engine process whose unknown server cap was last told, by shard: told once.
        self._cap_told: dict[int, str | None] = {}
        #: Condemned URLs whose requests the routers have not yet been told to move: set once
        #: they were (what the supervisor waits for before it stops the old process).
        self._released: dict[str, asyncio.Event] = {}

    def follow(self, t: Transition) -> None:
        """One transition of the ledger, as the controller's one channel passes it on: what it
        condemns or puts to sleep is rescued, and a change of what is pushed pushes now."""
        if t.to_state is ShardState.DEAD and t.from_state not in ABSENT:
            # The URL the shard had when it was condemned: the routers' requests wait there.
            self._condemned[t.shard] = t.record.base_url
            self._released.setdefault(t.record.base_url, asyncio.Event())
            self._push_soon()
        elif t.to_state is ShardState.SLEEPING and t.from_state in ROUTABLE:
            # A sleeping engine holds what it has not begun to answer until it wakes: those
            # requests are rescued, as off a condemned one (it is not condemned). Streams under
            # way go too, unless the trainer holds it: its engine sleeps only once they are done.
            self._fell_asleep[t.shard] = (t.record.base_url, not t.record.sleep_held)
            self._push_soon()
        elif self._sets() != self._pushed:
            self._push_soon()

    # ------------------------------------------------------------------ what a push carries

    def _sets(self) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        return tuple(self.serving()), tuple(self.ledger.trial_urls()), self.coming_back()

    def coming_back(self) -> int:
        """Shards with an engine on its way back to routing: restarting, condemned with a
        restart to come or a return awaited (:meth:`Supervisor.coming_back`), or a new process
        that only its proof stands between it and routing (STALE with static weights: one
        canary). A STALE shard with a trainer's weights waits for a refit nobody can time, so
        it is not counted. A serving engine held or ejected out of the push is counted too: a
        proof or its time puts it back, and once the others fail the never-empty rule or the
        panic threshold does, a push away: a request that finds none waits for that push
        rather than a 409 (docs/design.md section 12, "None left, one coming"). Pushed beside the
        serving set: a router that finds no engine waits for one while this is not 0."""
        static = self.ledger.policy.weights == "static"
        routed = set(self.serving())
        n = 0
        for rec in self.ledger.snapshot():
            if rec.state is ShardState.STALE:
                n += static and not rec.weights_discarded
            elif rec.state in ABSENT:
                n += self.supervisor.coming_back(rec.index)
            elif rec.state in ROUTABLE and rec.base_url not in routed:
                n += 1
        return n

    def serving(self) -> list[str]:
        """What the routers may use: the ledger's routed set (:meth:`Admission.routed`: its
        serving set less the engines the focused reads hold out, a lost core its hedges'
        canary watches or an engine with hedged requests that shows work and takes no step,
        unless none would be left). A lost race drops an engine from its router's list only
        until the next push, and a tick's push put a wedge back in routing before its
        condemnation (history: docs/design.md section 13). Held out is no verdict: the ledger
        still calls it HEALTHY, and it is pushed again when the hold ends (a transition)."""
        return self.ledger.admission.routed()

    def serving_push(self) -> tuple[list[str], dict[str, BackendFacts]]:
        """What every push carries: the serving URLs, and each one's shard, weight version,
        incarnation (a router's cache-aware policy forgets a restarted engine's prefixes) and
        the models it serves, as the watchdog read them (the routers' ``GET /v1/models``), and
        its server cap (:meth:`output_cap`) and default limit (:func:`output_default_from`)."""
        urls = self.serving()
        wanted = set(urls)
        facts = {rec.base_url: self._facts(rec)
                 for rec in self.ledger.snapshot() if rec.base_url in wanted}
        return urls, facts

    def _facts(self, rec: ShardRecord) -> BackendFacts:
        cap, source = self.output_cap(rec)
        default, default_unknown = self.output_default(rec)
        return BackendFacts(rec.index, rec.weight_version,
                            upstream_fields=self._upstream_fields(rec.index),
                            incarnation=rec.incarnation,
                            models=self.watchdog.models(rec.base_url), key=self._key(rec.index),
                            output_cap=cap, output_default=default,
                            output_cap_unknown=(source.removeprefix(UNKNOWN)
                                                if source.startswith(UNKNOWN) else None),
                            output_default_unknown=default_unknown,
                            completion_default=completion_default_of(
                                self.config.fleet.engine_of(rec.index),
                                self.book.last.get(rec.index)))

    def output_cap(self, rec: ShardRecord) -> tuple[int | None, str]:
        """The server cap on every request's output of ``rec``'s engine (``None``: none, or
        not known) and where it comes from: ``engine`` (its own ``GET /server_info``, the
        running process's word), ``declared`` (the config's ``output_cap``), ``command`` (a
        launched engine's ``--override-generation-config``), or ``unknown: why`` (an attached
        engine that says nothing and has no declaration: its continuations go only as far as
        what requests there produced proves, until a ``"length"`` finish reveals it,
        docs/design.md 4.1; said once per process in the log, and on its status row)."""
        said = self.watchdog.output_cap(rec.base_url, rec.incarnation)
        cap, source = output_cap_from(said, self.config.fleet, rec.index)
        if isinstance(said, CapUnknown) and source.startswith("unknown"):
            self._tell_unknown_cap(rec, said)
        return cap, source

    def output_default(self, rec: ShardRecord) -> tuple[int | None, str | None]:
        """``rec``'s engine's default limit of a chat that names none (``None``: none, or not
        known) and why it is not known (:func:`output_default_from`; ``None``: known): a
        chat begun there is then continued only as far as such chats there proved
        (docs/design.md 4.1), and its status row says so."""
        return output_default_from(self.watchdog.output_default(rec.base_url, rec.incarnation),
                                   self.config.fleet, rec.index)

    def _tell_unknown_cap(self, rec: ShardRecord, said: CapUnknown) -> None:
        """Log an attached engine's unknown cap once per process, once it was asked."""
        if said.settled and self._cap_told.get(rec.index, "") != rec.incarnation:
            self._cap_told[rec.index] = rec.incarnation
            log.warning("shard %d (%s): its server cap on a request's output is unknown (%s; "
                        "no output_cap on its [[fleet.backends]] table): a stream cut there is "
                        "continued only as far as what requests there produced proves, until "
                        "a \"length\" finish reveals it; declare output_cap (\"none\" where "
                        "it caps nothing) or run vLLM with VLLM_SERVER_DEV_MODE=1 "
                        "(docs/design.md 4.1)", rec.index, rec.base_url, said.why)

    def _key(self, shard: int) -> str | None:
        key = self.engine_keys.of_shard(shard)
        return None if key is None else key.reveal()

    def _upstream_fields(self, shard: int) -> bool | None:
        """Whether shard's engine takes vLLM's own request fields, as its profile says
        (``None`` for ``engine = "auto"``: the router's setting decides)."""
        name = self.config.fleet.engine_of(shard)
        return None if name == AUTO else profile(name).upstream_fields

    # ------------------------------------------------------------------ telling the routers

    def _push_soon(self) -> None:
        if not self._push_pending:
            self._push_pending = True
            self.tasks.start_if_running(self._push_and_rescue(), "push")

    async def _push_and_rescue(self) -> None:
        """Push what the ledger says now, and rescue what waits on condemned shards."""
        self._push_pending = False
        await self.push()
        await self.rescue()

    async def push(self, errors: list[str] | None = None) -> None:
        """Push the serving set to every router now (a tick, a transition, start-up, admin
        actions); a router's failure is noted in ``errors`` (a tick's report), else logged."""
        started = time.monotonic()
        urls, facts = self.serving_push()
        trial = self.ledger.trial_urls()
        coming = self.coming_back()
        self._pushed = (tuple(urls), tuple(trial), coming)
        for link in self.routers:
            try:
                await link.set_serving_backends(urls, facts, coming_back=coming)
                await link.set_trial_backends(trial)
            except Exception as exc:
                router_error(errors, f"{link.name}: push: {exc}")
        self.meter.pushed(time.monotonic() - started, len(urls))

    async def rescue(self, errors: list[str] | None = None) -> tuple[list[int], int]:
        """Every router moves what waits on the shards condemned or fallen asleep since the
        last rescue (a router's failure noted in ``errors``, else logged), and the supervisor's
        wait on each condemned URL ends. Returns the shards condemned, and how many requests
        were moved."""
        condemned, self._condemned = self._condemned, {}
        asleep, self._fell_asleep = self._fell_asleep, {}
        rescued = 0
        moves = [(url, True) for url in condemned.values()] + list(asleep.values())
        for url, streams in moves:
            for link in self.routers:
                try:
                    rescued += await link.rescue(url, streams=streams)
                except Exception as exc:
                    router_error(errors, f"{link.name}: rescue: {exc}")
            released = self._released.pop(url, None)
            if released is not None:
                released.set()
        return sorted(condemned), rescued

    async def released(self, url: str) -> None:
        """Until the routers were told to move the requests off ``url`` (condemned), at most
        :data:`RELEASE_WAIT_S`: the supervisor stops the old process only then."""
        released = self._released.get(url)
        if released is None:
            return  # not condemned, or its requests were moved already
        try:
            await asyncio.wait_for(released.wait(), RELEASE_WAIT_S)
        except TimeoutError:
            log.warning("the routers were not told to move the requests off %s within %g s; "
                        "stopping it all the same", url, RELEASE_WAIT_S)

    async def tell_retry_after(self, errors: list[str]) -> None:
        """Every router's Retry-After for a request that finds no backend: the seconds until
        a shard is expected back (``None`` when none restarts); a failure noted in ``errors``."""
        retry_after = self._retry_after_estimate()
        for link in self.routers:
            try:
                await link.set_retry_after(retry_after)
            except Exception as exc:
                errors.append(f"{link.name}: retry-after: {exc}")

    def _retry_after_estimate(self) -> float | None:
        """Seconds until a shard is expected back, when some are restarting; else None."""
        restarting = [a for a in self.supervisor.attempts.values() if not a.passive]
        if not restarting:
            return None
        expected = self.supervisor.typical_restart_s()
        now = self.clock()
        left = min(max(1.0, expected - (now - a.started_at)) for a in restarting)
        return round(left)

    async def push_and_rescue_now(self) -> int:
        """Push now, and move the requests waiting on shards that fell asleep since the last
        push elsewhere (the trainer's sleep bracket, before its engines sleep; the streams
        begun on a shard the trainer holds asleep stay to finish). Returns how many were
        moved."""
        await self.push()
        asleep, self._fell_asleep = self._fell_asleep, {}
        moved = 0
        for url, streams in asleep.values():
            moved += await self.rescue_now([url], streams=streams)
        return moved

    async def rescue_now(self, urls: Sequence[str], *, streams: bool = True) -> int:
        """Every router moves the requests on ``urls`` elsewhere now (``streams``: the streams
        begun there too, continued from where they are). Returns how many were moved."""
        moved = 0
        for url in urls:
            for link in self.routers:
                try:
                    moved += await (link.rescue(url) if streams
                                    else link.rescue(url, streams=False))
                except Exception as exc:
                    log.warning("router %s: rescue failed: %s", link.name, exc)
        return moved

    async def weights_changing(self, urls: Sequence[str], version: int) -> int:
        """Every router marks the requests on ``urls`` as kept across a load of ``version``
        (their answers name each version: router/relay.py). Returns how many."""
        marked = 0
        for url in urls:
            for link in self.routers:
                try:
                    marked += await link.weights_changing(url, version)
                except Exception as exc:
                    log.warning("router %s: marking a load failed: %s", link.name, exc)
        return marked
