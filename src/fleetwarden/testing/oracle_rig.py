"""The exactness oracle's shell: a few long-lived simulated engines behind the real router.

Owns: running oracle cases (:mod:`fleetwarden.testing.oracle`) over real sockets on 127.0.0.1:
each case's reference straight from an engine, then the same request through the router with
its engine cut by a per-request fault directive, many cases at once.
Must not: judge (the pure module does).

Cheap by design: one process, a handful of engines that stay up, and a cut that is a header
(``x-sim-fault``), so thousands of cases cost what their tokens cost. A wedge is rescued as the
controller would at condemnation (``Router.rescue`` on that engine), which rescues every stream
held there at that moment: those are cut too, at whatever point they were, and must still come
out exact or refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from fleetwarden.config import FleetConfig
from fleetwarden.engines import CapUnknown
from fleetwarden.judge import Target
from fleetwarden.pushes import UNKNOWN, output_cap_from, output_default_from
from fleetwarden.router import Router, RouterSettings
from fleetwarden.router.pool import BackendFacts
from fleetwarden.sim import Sim, SimConfig
from fleetwarden.sim.server import FAULT_HEADER, FAULT_ID_HEADER, directive_fired
from fleetwarden.testing.oracle import Case, Exactness, compare, draw, normalize
from fleetwarden.watchdog import Watchdog

__all__ = ["Oracle", "Result", "oracle"]

#: The engines' context (vLLM's max_model_len): small, so a chat sent without max_tokens (the
#: context left) stays cheap, yet long enough for the longest prompt and 48 tokens.
MAX_MODEL_LEN = 192
#: About one token in this many may end the generation (vLLM's EOS).
EOS_PERIOD = 40
#: Fast engines: a case's tokens are what it costs.
STEPS_PER_S = 2000.0
#: Tokens per step on each engine: 1 as vLLM, and more, whose chunks carry several tokens (a
#: cut inside one of them is one of the cuts).
TOKENS_PER_STEP = (1, 1, 3, 1)
#: The engines of the second fleet: started with a server cap (vLLM's
#: ``--override-generation-config '{"max_new_tokens": N}'``) below many cases' limits, which
#: their router is told by the push, as the controller learns it (``pushes.
#: output_cap_from``): one launched (read from its command), one attached in vLLM's dev mode
#: (read from its ``GET /server_info``), one attached that says nothing (its
#: ``[[fleet.backends]]`` table declares it), and one attached that says nothing and declares
#: nothing: its cap unknown, a continuation there is exact or refused (its floor).
CAPPED_TOKENS_PER_STEP = (1, 1, 1, 1)
OUTPUT_CAP = 20
#: How each capped engine's cap is known, in the order of :data:`CAPPED_TOKENS_PER_STEP`.
CAP_SOURCES = ("command", "engine", "declared", "unknown")
CAPPED_COMMAND = ("fleetwarden sim --port {port} --override-generation-config "
                  f"'{{{{\"max_new_tokens\": {OUTPUT_CAP}}}}}'")
#: The engines of the third fleet: no cap, but their model's ``generation_config.json`` sets
#: ``max_new_tokens``, vLLM's default limit of a chat that names none (``--generation-config
#: auto``; a completion's stays 16, above it), which their router is told by the push, as
#: the controller learns it (``pushes.output_default_from``): two launched (their
#: command's model folder), one attached in vLLM's dev mode (its ``/server_info``'s model
#: path, a folder on this host). Three, not two: a wedge's rescue cuts every stream held on
#: its engine, and with two those often find no other engine left.
DEFAULTED_TOKENS_PER_STEP = (1, 3, 1)
OUTPUT_DEFAULT = 12
#: How each one's default is known, in the order of :data:`DEFAULTED_TOKENS_PER_STEP`.
DEFAULT_SOURCES = ("command", "command", "engine")


@dataclass
class Result:
    cases: int = 0
    #: Cases whose cut landed (the others' generations ended before their cut point: they
    #: went through whole, and must still be exact).
    cut: int = 0
    #: Exact answers of cases whose cut landed: continued (or sent again) exactly.
    continued: int = 0
    verdicts: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    by_cut: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Outcomes by what the request was: greedy, sampled, seeded (sampled with a seed), and
    #: whether it went to the capped engines.
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    inexact: list[tuple[Case, Exactness]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"cases run {self.cases} in {self.seconds:.1f} s: exact "
                 f"{self.verdicts['exact']}, refused {self.verdicts['refused']}, inexact "
                 f"{self.verdicts['inexact']}",
                 f"  cut {self.cut}: continued exactly {self.continued}, refused "
                 f"{self.verdicts['refused']}; not cut (ended before the cut point) "
                 f"{self.cases - self.cut}"]
        lines += [f"  refused {n:5d}: {reason}" for reason, n in self.refused.most_common()]
        for case, v in self.inexact[:10]:
            lines.append(f"  INEXACT {case.describe()}\n    {v.detail}")
        return "\n".join(lines)


@dataclass
class Oracle:
    router: Router
    sims: list[Sim]
    http: aiohttp.ClientSession
    #: The fleet of capped engines and its router (cases with ``capped``).
    capped_router: Router
    capped_sims: list[Sim]
    #: The fleet of engines with a model default and its router (cases with ``defaulted``).
    defaulted_router: Router
    defaulted_sims: list[Sim]

    async def _post(self, url: str, case: Case, headers: dict[str, str] | None = None
                    ) -> tuple[int, bytes]:
        async with self.http.post(url + case.path, json=case.body, headers=headers) as r:
            try:
                return r.status, await r.read()
            except aiohttp.ClientPayloadError as e:
                return -1, f"the client's read failed: {e}".encode()

    async def run_case(self, case: Case) -> Exactness:
        router, sims = ((self.capped_router, self.capped_sims) if case.capped
                        else (self.defaulted_router, self.defaulted_sims) if case.defaulted
                        else (self.router, self.sims))
        reference = normalize(*await self._post(sims[0].url, case), chat=case.chat,
                              stream=case.stream, held_back=case.held_back)
        headers = {FAULT_HEADER: f"{case.cut}@{case.cut_after}",
                   FAULT_ID_HEADER: f"{case.seed}:{case.index}"}
        got = normalize(*await self._post(router.url, case, headers), chat=case.chat,
                        stream=case.stream, held_back=case.held_back)
        return compare(reference, got)

    async def run(self, seed: int, cases: int, *, first: int = 0,
                  concurrency: int = 48) -> Result:
        result = Result()
        gate = asyncio.Semaphore(concurrency)
        started = time.perf_counter()

        async def one(index: int) -> None:
            case = draw(seed, index)
            async with gate:
                v = await self.run_case(case)
            result.cases += 1
            if directive_fired(f"{case.seed}:{case.index}"):
                result.cut += 1
                result.continued += v.outcome == "exact"
            result.verdicts[v.outcome] += 1
            result.by_cut[(case.cut, v.outcome)] += 1
            result.by_kind[(case.kind, v.outcome)] += 1
            if v.outcome == "refused":
                # counted by cause: the token counts in a reason (proven, needed, left) vary
                result.refused[re.sub(r"\d+(?= tokens\b| needed\b| left\b)", "N",
                                      v.detail)] += 1
            elif v.outcome == "inexact":
                result.inexact.append((case, v))

        async with asyncio.TaskGroup() as group:
            for index in range(first, first + cases):
                group.create_task(one(index))
        result.seconds = time.perf_counter() - started
        return result


async def capped_facts(fleet: list[Sim]) -> dict[str, BackendFacts]:
    """The capped engines' facts as a controller pushes them: each engine read once by a
    watchdog (its ``/server_info`` where it has one), then ``output_cap_from`` over a fleet
    config that launches the first and attaches the others, the third with its cap declared,
    the last with none (unknown: pushed with why)."""
    launched, learnt, declared, silent = (s.url for s in fleet)
    config = FleetConfig(engines=1, engine_cmd=CAPPED_COMMAND, backends=[
        learnt, {"url": declared, "output_cap": OUTPUT_CAP}, silent])  # type: ignore[list-item]
    facts = {}
    async with Watchdog() as watchdog:
        for shard, url in enumerate((launched, learnt, declared, silent)):
            report = await watchdog.probe(Target(url, engine="vllm"))
            await watchdog.learn_output_cap(report)
            cap, source = output_cap_from(watchdog.output_cap(url, report.incarnation), config,
                                          shard)
            assert source.split(":")[0] == CAP_SOURCES[shard], (url, source)
            facts[url] = BackendFacts(output_cap=cap, output_cap_unknown=(
                source.removeprefix(UNKNOWN) if source.startswith(UNKNOWN) else None))
    return facts


async def defaulted_facts(fleet: list[Sim], folder: str) -> dict[str, BackendFacts]:
    """The defaulted engines' facts as a controller pushes them: each engine read once by a
    watchdog (its model list too: a chat's default is bounded by the context left), then
    ``output_default_from`` over a fleet config that launches the first ones (a vLLM command
    naming the model folder; the simulator stands in for it) and attaches the last (its
    ``/server_info`` names the folder)."""
    urls = [s.url for s in fleet]
    command = f"vllm serve {shlex.quote(folder)} --served-model-name tiny --port {{port}}"
    config = FleetConfig(engines=len(urls) - 1, engine_cmd=command, backends=urls[-1:])
    facts = {}
    async with Watchdog() as watchdog:
        for shard, url in enumerate(urls):
            report = await watchdog.probe(Target(url, engine="vllm"))
            await watchdog.learn_output_cap(report)
            await watchdog.learn_models(report)  # the context left, a chat's other bound
            said = watchdog.output_default(url, report.incarnation)
            assert isinstance(said, CapUnknown) == (DEFAULT_SOURCES[shard] == "command"), (
                url, said)
            default, unknown = output_default_from(said, config, shard)
            assert (default, unknown) == (OUTPUT_DEFAULT, None), (url, default, unknown)
            facts[url] = BackendFacts(models=watchdog.models(url), output_default=default)
    return facts


def _model_folder() -> tempfile.TemporaryDirectory[str]:
    """The model folder of the defaulted engines: its generation_config.json, as a model's."""
    folder = tempfile.TemporaryDirectory(prefix="fleetwarden-oracle-model-")
    pathlib.Path(folder.name, "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "max_new_tokens": OUTPUT_DEFAULT}))
    return folder


@contextlib.asynccontextmanager
async def oracle(settings: RouterSettings | None = None, *,
                 eos_period: int = EOS_PERIOD) -> AsyncIterator[Oracle]:
    """Engines and a router, started; stopped at the end."""
    def engines(steps: tuple[int, ...], cap: int | None, sources: tuple[str, ...] = (),
                default: int | None = None) -> list[Sim]:
        return [Sim(SimConfig(steps_per_s=STEPS_PER_S, tokens_per_step=n, slots=256,
                              max_model_len=MAX_MODEL_LEN, eos_period=eos_period,
                              reasoning_parser=True, override_max_new_tokens=cap,
                              default_max_new_tokens=default,
                              model_path=None if default is None else model_folder.name,
                              dev_mode=i < len(sources) and sources[i] == "engine"))
                for i, n in enumerate(steps)]

    model_folder = _model_folder()
    sims = engines(TOKENS_PER_STEP, None)
    capped = engines(CAPPED_TOKENS_PER_STEP, OUTPUT_CAP, CAP_SOURCES)
    defaulted = engines(DEFAULTED_TOKENS_PER_STEP, None, DEFAULT_SOURCES, OUTPUT_DEFAULT)
    # Every request here is cut: a retry budget sized for a fleet where few fail would refuse
    # most of them for the budget's sake, which says nothing of exactness.
    routers = [Router([], settings or RouterSettings(continue_answers=True, max_retries=4,
                                                     retry_budget_ratio=1.0))
               for _ in range(3)]
    loop = asyncio.get_running_loop()
    try:
        for router, fleet in zip(routers, (sims, capped, defaulted), strict=True):
            for sim in fleet:
                await sim.start()

                def rescue_on_wedge(kind: str, url: str = sim.url,
                                    router: Router = router) -> None:
                    if kind == "wedge":  # the controller's call at condemnation, a moment later
                        loop.call_later(0.01, router.forwarder.waiting.rescue, url)

                sim.on_directive = rescue_on_wedge
            facts = (await capped_facts(fleet) if fleet is capped
                     else await defaulted_facts(fleet, model_folder.name) if fleet is defaulted
                     else {s.url: BackendFacts() for s in fleet})
            router.set_serving_backends([s.url for s in fleet], facts)
            await router.start()
        timeout = aiohttp.ClientTimeout(total=60)
        # A pooled connection is let go before the router's own idle timeout (5 s) closes it
        # under a request sent on it (aiohttp keeps one 15 s): a reset that is no case's.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            yield Oracle(routers[0], sims, http, routers[1], capped, routers[2], defaulted)
    finally:
        for router in routers:
            await router.stop()
        for sim in (*sims, *capped, *defaulted):
            await sim.stop()
        model_folder.cleanup()
