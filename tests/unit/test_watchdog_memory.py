"""What the watchdog keeps per URL is dropped once the URL is gone (memory that
only grows is a leak). No engine needed: a round of no targets still forgets."""

from __future__ import annotations

import asyncio

from fleetwarden.engines import CapUnknown
from fleetwarden.judge import (
    CanaryRule,
    EngineWatch,
    Evidence,
    Fetch,
    Health,
    Report,
    Target,
    Verdict,
)
from fleetwarden.router.models import ModelCard
from fleetwarden.watchdog import FORGET_AFTER_S, Watchdog, _Memory


class Clock:
    now = 10_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_url_not_read_for_an_hour_is_forgotten() -> None:
    clock = Clock()
    async with Watchdog(clock=clock) as watchdog:
        watchdog._memory["http://old:1"] = _Memory(EngineWatch(), visited_at=clock.now)
        clock.now += FORGET_AFTER_S / 2
        watchdog._memory["http://new:1"] = _Memory(EngineWatch(), visited_at=clock.now)
        await watchdog.round([])
        assert set(watchdog._memory) == {"http://old:1", "http://new:1"}
        clock.now += FORGET_AFTER_S / 2 + 1
        await watchdog.round([])
        assert set(watchdog._memory) == {"http://new:1"}


async def test_a_canary_that_timed_out_waited_its_whole_timeout() -> None:
    """asyncio fires a timer up to its clock resolution early. A canary measured 0.4 ms under
    the timeout it was sized to (the stall limit less what its held requests had waited) fell
    short of the limit, and a hedged idle wedge was not condemned: it was routed again and
    held new requests for 10 s more. A timed-out canary reports at least its timeout."""
    silent: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)  # reads nothing, answers nothing: a wedged engine

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # The canary's start, then every later reading: its end 1 ms under the 0.05 s timeout.
    ticks = [100.0]

    def clock() -> float:
        return ticks.pop() if ticks else 100.049

    async with server, Watchdog(model="m", clock=clock) as watchdog:
        result = await watchdog.canary(f"http://127.0.0.1:{port}", timeout_s=0.05)
    assert not result.ok and result.status is None and "no answer" in result.error
    assert result.latency_s == 0.05
    for w in silent:
        w.close()


class _Answers(Watchdog):
    """A watchdog whose reads find ``reports`` in turn and whose engine's ``/server_info``
    says ``says`` (cap, default): its memory is the real one, only the fetching is not made."""

    def __init__(self, *reports: Report) -> None:
        super().__init__()
        self.reports = list(reports)
        self.says: tuple[int | None, int | None] = (None, None)
        self.asked = 0

    async def _fetch_for(self, url: str, memory: _Memory,
                         step: Report | Fetch | None) -> Report:
        return self.reports.pop(0)

    async def _server_cap(self, url: str) -> tuple[int | None, int | None]:
        self.asked += 1
        return self.says

    async def learn_models(self, report: Report) -> None:
        return None  # not what this asks


async def test_a_restart_of_an_engine_that_names_no_process_drops_its_old_cap_at_once(
        ) -> None:
    """An engine that gives no start time (no incarnation in its reads) restarts: the ledger
    names its new process itself (``restart-seen-1``) when the read that saw the restart is
    decided on, before the watchdog asks the new process's ``/server_info``. What the old
    process said is dropped by that read, so that no push meanwhile carries it, and asked
    again after it (still once per process)."""
    url = "http://127.0.0.1:8000"

    def read(verdict: Verdict) -> Report:
        return Report(url, verdict, Evidence(verdict.value), Health.UNPROVEN, CanaryRule.NEVER,
                      None, None, None, None)

    target = Target(url, engine="vllm")
    decided: list[int | CapUnknown | None] = []
    watchdog = _Answers(read(Verdict.IDLE), read(Verdict.IDLE), read(Verdict.RESTARTED))
    async with watchdog:
        watchdog.says = (64, 48)
        for _ in range(2):
            await watchdog.round([target])
        assert (watchdog.output_cap(url, None), watchdog.asked) == (64, 1)
        watchdog.says = (16, None)  # started again with a smaller cap
        await watchdog.round([target], on_report=lambda u, r: decided.append(
            watchdog.output_cap(u, "restart-seen-1")))
        assert isinstance(decided[0], CapUnknown) and not decided[0].settled
        assert (watchdog.output_cap(url, "restart-seen-1"), watchdog.asked) == (16, 2)
        assert watchdog.output_default(url, "restart-seen-1") is None


async def test_a_restart_of_an_engine_that_names_no_process_has_its_models_read_again(
        ) -> None:
    """The models an engine serves are read once per process: one that gives no start time
    (no incarnation in its reads) is told apart only by the read that sees its restart, which
    drops the old list, so the new process's ``/v1/models`` is read (it may serve others)."""
    url = "http://127.0.0.1:8000"

    def read(verdict: Verdict) -> Report:
        return Report(url, verdict, Evidence(verdict.value), Health.UNPROVEN, CanaryRule.NEVER,
                      None, None, None, None)

    class Lists(_Answers):
        served = "old"
        lists = 0

        async def learn_models(self, report: Report) -> None:
            await Watchdog.learn_models(self, report)

        async def _model_cards(self, url: str) -> tuple[tuple[ModelCard, ...], bool]:
            self.lists += 1
            return (ModelCard.of({"id": self.served, "object": "model"}),), True

    watchdog = Lists(read(Verdict.IDLE), read(Verdict.IDLE), read(Verdict.RESTARTED))
    async with watchdog:
        target = Target(url, engine="vllm")
        for _ in range(2):
            await watchdog.round([target])
        assert watchdog.lists == 1  # once for the process
        watchdog.served = "new"
        await watchdog.round([target])
        models = watchdog.models(url)
        assert watchdog.lists == 2 and models is not None and [m.id for m in models] == ["new"]
