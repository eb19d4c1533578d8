"""Cache-aware routing side by side: fleetwarden and sglang-router on the same simulated engines.

Four simulated vLLM engines with prefix caches (``fleetwarden sim``: an LRU of 16-token KV
blocks whose hits shorten the prefill, vLLM's ``prefix_cache_*`` counters), each router in
front of them in turn, one run:

- fleetwarden ``cache_aware``, as ``fleetwarden up`` runs it (attach mode: its controller
  watches the engines and pushes each one's incarnation, so it sees the restart below);
- fleetwarden ``cache_aware`` under ``fleetwarden route`` (no controller: the policy alone,
  in the same process layout as the next; it is told of no restart);
- fleetwarden ``least_in_flight`` (``fleetwarden route --routing least_in_flight``);
- sglang-router 0.3.2 ``cache_aware`` and ``round_robin`` (installed on first use into its own
  virtual environment, bench/_peers.py).

Workloads (every engine's prefix cache reset before each, so each starts cold):

- GRPO: 32 prompts x 8 siblings sharing a system prompt, each epoch's 256 requests at once,
  3 epochs;
- multi-turn agents: 24 sessions x 6 turns, every turn re-sending the conversation, the
  sessions running free (0-200 ms of seeded think time between turns): without a session
  header, with ``x-session-id``, and with a shared system prompt (and the header);
- the agents with the header again in lockstep (every session's turn, then the next), the
  engine that served the most restarted after the third turn (the turns after it measured
  apart).

Per router and workload: the token hit rate from the engines' own counters
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``), TTFT p50/p99 at the
client (streamed; time to the first event that carries a token: a chat's role chunk, which
the engine sends as it takes the request, is timed apart as ``first_event_p50_ms``, the
router's and the network's share), total time, and requests per engine
(``vllm:request_success_total``). For fleetwarden's cache-aware run, also what its router
predicted per engine beside what each engine reported. Every request is also taken apart
(its answer's id joined to the engine's ``GET /sim/requests``: which engine, prompt and cached
tokens, time queued, engine steps to the first token): ``ttft_by_turn`` gives TTFT p50 / p99 of
the first turn and of the turns after it and the slowest requests; ``--trace`` writes them all.

    python bench/cache.py [--quick] [--no-peer] [--engines N] [--sessions N] [--baseline SRC]
                          [--routers NAMES] [--workloads NAMES] [--trace FILE]
    python bench/cache.py --events [--quick] [--engines N] [--seeds N] [--routers NAMES]

``--events``: instead, the router's index fed by the engines' own KV events beside the
approximate index (its guess from where it sent each prompt) and least in flight, each with
1, 2 and 4 router workers (``fleetwarden route`` processes sharing one port, as ``[router]
workers`` runs them). The engines publish vLLM's KV events (``--kv-events-config``) and keep
a bounded block pool (``EVENT_BLOCKS``); the workloads are prompts of token ids (the events
route only those: the router has no tokenizer): Zipf-popular documents whose working set fits
the engines' pools, and one whose working set exceeds them (evictions). ``--seeds N`` runs;
hit rates from the engines' own counters, their means printed as a table at the end.
sglang-router is not in this comparison: 0.3.2 (the peer installed here) has no KV-event
mode (its ``--help`` names no event, ZMQ or KV-event option; its ``cache_aware`` is the
approximate radix tree measured above).

``--quick``: smaller workloads (a smoke run). ``--baseline SRC``: also the cache-aware policy of
another source folder (``/work/main/src``: before a change), on the same engines in the same
run. The machine is shared and small: compare figures within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from _peers import SGLANG_ROUTER, PeerUnavailable, free_port, peer_python, process

#: The simulated engines: 8 slots, 50 steps/s, a 512-token step budget (a 1,400-token prompt
#: takes 3 steps to prefill cold, 1 warm), 4,096 cached blocks each (their whole KV room).
SIM_ARGS = ["--slots", "8", "--steps-per-s", "50", "--max-num-batched-tokens", "512"]
SYSTEM = ("You are a careful assistant that solves problems step by step, checks each step, "
          "and states the final answer on its own line. ") * 9  # ~1,100 characters
MAX_TOKENS = 8
SETTLE_S = 8.0
#: --events: each engine's block pool (16-token blocks). The fitting workload's documents
#: (24 of 8 blocks: 192) fit 4 engines' 4 x 96 once each, with room for the questions, but
#: not one engine: where each document goes decides the hit rate. The evicting one's (64 of
#: 8 blocks: 512) exceed the 4 pools: engines evict, and a guess cannot see which.
EVENT_BLOCKS = 96
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    #: Time to the stream's first event, a token or not: a chat's role chunk, which an engine
    #: sends as it takes the request (the router's and the network's share of TTFT).
    first_event: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    per_engine: list[float] = field(default_factory=list)
    after_restart: tuple[float, float] | None = None  # (queries, hits) after it
    restarted: int | None = None  # which engine
    #: fleetwarden's router: index entries it dropped in the pause after the restart.
    forgotten_at_restart: float | None = None
    #: Per engine: (queries, hits) from its counters, and fleetwarden's router's (prompt
    #: blocks placed there, blocks predicted held) over the same workload.
    actual: list[tuple[float, float]] = field(default_factory=list)
    predicted: list[tuple[float, float]] = field(default_factory=list)
    #: Per request: its id (from its answer), TTFT, and the workload's tag (session, turn).
    sent: list[dict[str, Any]] = field(default_factory=list)
    #: Per request, ``sent`` joined to what its engine says of it (``GET /sim/requests``).
    trace: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        ms = [1000 * t for t in self.ttft]
        mean = statistics.fmean(self.per_engine) if self.per_engine else 0.0
        out: dict[str, Any] = {
            "hit_rate": self.hits / self.queries if self.queries else 0.0,
            "ttft_p50_ms": pct(ms, 0.5),
            "ttft_p99_ms": pct(ms, 0.99),
            "first_event_p50_ms": pct([1000 * t for t in self.first_event], 0.5),
            "wall_s": self.wall_s,
            "requests_per_engine": [int(n) for n in self.per_engine],
            "busiest_over_mean": max(self.per_engine) / mean if mean else None,
            "errors": self.errors,
        }
        if self.after_restart is not None:
            q, h = self.after_restart
            out["hit_rate_after_restart"] = h / q if q else 0.0
        if self.restarted is not None:
            out["restarted_engine"] = self.restarted
        if self.forgotten_at_restart is not None:
            out["index_blocks_forgotten_at_restart"] = int(self.forgotten_at_restart)
        if self.trace:
            out["ttft_by_turn"] = breakdown(self.trace)
        if any(b for b, _ in self.predicted):
            out["per_engine_predicted_vs_actual"] = [
                (round(ph / pb, 3) if pb else None, round(h / q, 3) if q else None)
                for (pb, ph), (q, h) in zip(self.predicted, self.actual, strict=True)]
        return out


# ---------------------------------------------------------------------- engines


@contextlib.contextmanager
def engines(n: int, extra: tuple[str, ...] = ()) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(n):
            proc = stack.enter_context(process(
                [sys.executable, "-m", "fleetwarden", "sim", "--port", "0", *SIM_ARGS,
                 *extra]))
            assert proc.stdout is not None
            urls.append(proc.stdout.readline().split()[1])
        yield urls


async def engine_counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float, float]:
    """(prefix-cache queries, hits, requests finished) of one engine, from its /metrics."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                          "vllm:request_success_total"):
                found[s.name] = found.get(s.name, 0.0) + s.value
    return (found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"],
            found["vllm:request_success_total"])


async def snapshot(http: aiohttp.ClientSession, urls: list[str]
                   ) -> list[tuple[float, float, float]]:
    return [await engine_counters(http, u) for u in urls]


def deltas(before: list[tuple[float, float, float]], after: list[tuple[float, float, float]]
           ) -> list[tuple[float, float, float]]:
    """Per engine; an engine whose counters went back (a restart) counts from zero."""
    out = []
    for b, a in zip(before, after, strict=True):
        out.append(a if a[0] < b[0] else (a[0] - b[0], a[1] - b[1], a[2] - b[2]))
    return out


# ---------------------------------------------------------------------- the client


async def send(http: aiohttp.ClientSession, router: str, body: dict[str, Any],
               headers: dict[str, str], result: Result, tag: dict[str, Any] | None = None
               ) -> str:
    """One streamed request; its TTFT into ``result``; the text it generated.

    TTFT is the time to the first event that carries a token: a chat's role chunk comes as
    the engine takes the request, before its prefill (and before any wait for a slot)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    started = time.perf_counter()
    text = []
    evented = False
    try:
        async with http.post(router + path, json={**body, "stream": True},
                             headers=headers) as r:
            if r.status != 200:
                result.errors += 1
                return ""
            first = True
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not evented:
                    result.first_event.append(time.perf_counter() - started)
                    evented = True
                choice = chunk["choices"]
                if not choice:
                    continue
                delta = choice[0].get("delta", {})
                if "role" in delta and not delta.get("content"):
                    continue  # the role chunk: no token yet
                if first:
                    result.ttft.append(time.perf_counter() - started)
                    result.sent.append({"id": chunk.get("id"), "sent_at": started,
                                        "ttft_ms": round(1000 * result.ttft[-1], 3),
                                        **(tag or {})})
                    first = False
                part = delta.get("content") or choice[0].get("text")
                text.append(part or "")
    except (TimeoutError, aiohttp.ClientError):
        result.errors += 1
    return "".join(text)


def grpo(prompts: int, siblings: int, epochs: int, salt: str) -> Callable[..., Awaitable[None]]:
    async def run(http: aiohttp.ClientSession, router: str, result: Result,
                  between: Callable[[int], Awaitable[None]]) -> None:
        for epoch in range(epochs):
            await asyncio.gather(*(
                send(http, router, {"model": "tiny", "max_tokens": MAX_TOKENS,
                                    "prompt": f"{salt}{SYSTEM}\nProblem {p}: compute {p * 7919} "
                                              f"modulo {p + 13}, showing the work."},
                     {}, result, {"prompt": p, "turn": epoch})
                for p in range(prompts) for _ in range(siblings)))
            await between(epoch)
    return run


def agents(sessions: int, turns: int, *, header: bool, system: bool, salt: str,
           lockstep: bool = False) -> Callable[..., Awaitable[None]]:
    async def run(http: aiohttp.ClientSession, router: str, result: Result,
                  between: Callable[[int], Awaitable[None]]) -> None:
        histories: list[list[dict[str, str]]] = [
            [{"role": "system", "content": salt + SYSTEM}] if system else []
            for _ in range(sessions)]

        async def turn(k: int, t: int) -> None:
            history = histories[k]
            history.append({"role": "user", "content": (
                f"{salt}Agent {k}, turn {t}: here is the tool output you asked for. " * 5)})
            answer = await send(http, router, {"model": "tiny", "max_tokens": MAX_TOKENS,
                                               "messages": history},
                                {"x-session-id": f"agent-{k}"} if header else {}, result,
                                {"session": k, "turn": t})
            history.append({"role": "assistant", "content": answer})

        if lockstep:  # every session's turn t, then every turn t + 1 (the restart needs it)
            for t in range(turns):
                await asyncio.gather(*(turn(k, t) for k in range(sessions)))
                await between(t)
            return

        async def session(k: int) -> None:
            # Agents run free, each thinking 0-200 ms between turns (seeded: a run replays),
            # so their turns interleave as real ones do: a router that only balances load
            # sends a session's next turn wherever happens to be least busy then.
            rng = random.Random(f"{salt}{k}")
            for t in range(turns):
                await asyncio.sleep(rng.uniform(0.0, 0.2))
                await turn(k, t)

        await asyncio.gather(*(session(k) for k in range(sessions)))
    return run


def documents(docs: int, requests: int, clients: int, seed: int, base: int
              ) -> Callable[..., Awaitable[None]]:
    """Prompts of token ids: ``docs`` documents of 8 blocks (128 tokens), Zipf-popular, each
    request one of them and a question of its own (10 tokens); ``clients`` at once."""
    async def run(http: aiohttp.ClientSession, router: str, result: Result,
                  between: Callable[[int], Awaitable[None]]) -> None:
        rng = random.Random(seed)
        texts = [[base + 1_000 * d + i for i in range(128)] for d in range(docs)]
        weights = [1 / (rank + 1) for rank in range(docs)]
        prompts = [[*rng.choices(texts, weights)[0], *(rng.randrange(1, 900) for _ in range(9)),
                    n] for n in range(requests)]
        queue = iter(prompts)

        async def client() -> None:
            for prompt in queue:
                await send(http, router, {"model": "tiny", "max_tokens": MAX_TOKENS,
                                          "prompt": prompt}, {}, result, {"turn": 0})

        await asyncio.gather(*(client() for _ in range(clients)))
    return run


# ---------------------------------------------------------------------- routers


@contextlib.contextmanager
def fleetwarden_up(urls: list[str], folder: Path) -> Iterator[str]:
    port = free_port()
    config = folder / "fleetwarden.toml"
    config.write_text('[router]\nrouting = "cache_aware"\n\n[health]\nprobe_interval_s = 1.0\n')
    argv = [sys.executable, "-m", "fleetwarden", "up", "--config", str(config),
            "--port", str(port), "--admin-port", str(free_port()),
            "--journal", str(folder / "journal.sqlite"), "--quiet", "--log-level", "error"]
    for url in urls:
        argv += ["--backend", url]
    with process(argv, cwd=folder, stdout=subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def fleetwarden_route(urls: list[str], routing: str, source: str | None = None
                      ) -> Iterator[str]:
    """``fleetwarden route``; ``source``: run the fleetwarden package of that source folder
    (another checkout's ``src``), to compare two versions of a policy on the same engines."""
    argv = [sys.executable, "-m", "fleetwarden", "route", "--port", "0", "--log-level", "error",
            "--routing", routing]
    for url in urls:
        argv += ["--backend", url]
    env = None if source is None else {**os.environ, "PYTHONPATH": source}
    with process(argv, env=env) as proc:
        assert proc.stdout is not None
        yield proc.stdout.readline().split(" on ", 1)[1].split(",")[0]


@contextlib.contextmanager
def fleetwarden_workers(urls: list[str], workers: int, settings: dict[str, Any]
                        ) -> Iterator[str]:
    """``workers`` ``fleetwarden route`` processes sharing one port (SO_REUSEPORT, as ``[router]
    workers`` runs them): the kernel spreads the client's connections over them, and each
    keeps its own index (each subscribes to every engine's events itself)."""
    port = free_port()
    argv = [sys.executable, "-m", "fleetwarden", "route", "--port", str(port), "--reuse-port",
            "--log-level", "error", "--settings-json", json.dumps(settings)]
    for url in urls:
        argv += ["--backend", url]
    with contextlib.ExitStack() as stack:
        for _ in range(workers):
            proc = stack.enter_context(process(argv))
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("fleetwarden route: listening on "), line
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def sglang_router(urls: list[str], policy: str) -> Iterator[str]:
    python = peer_python(SGLANG_ROUTER)
    port = free_port()
    with process([str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                  "--port", str(port), "--worker-urls", *urls, "--policy", policy,
                  "--log-level", "warn", "--prometheus-port", str(free_port())],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}"


async def wait_serving(http: aiohttp.ClientSession, router: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with http.post(router + "/v1/completions",
                                 json={"model": "tiny", "prompt": "warm", "max_tokens": 1}) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{router} did not serve within {timeout_s} s")


FORGOTTEN = "fleetwarden_router_cache_forgotten_blocks_total"


async def router_counter(http: aiohttp.ClientSession, router: str, name: str) -> float | None:
    """One counter of the router's own /metrics, summed; None for a router without it."""
    async with http.get(router + "/metrics") as r:
        if r.status != 200:
            return None
        text = await r.text()
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == name]
    return sum(values) if values else None


async def predicted(http: aiohttp.ClientSession, router: str) -> dict[str, tuple[float, float]]:
    """fleetwarden's router: per backend, (prompt blocks placed, blocks predicted held);
    empty for a router without those series."""
    async with http.get(router + "/metrics") as r:
        if r.status != 200:
            return {}
        text = await r.text()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("fleetwarden_router_cache_blocks_total",
                          "fleetwarden_router_cache_predicted_hit_blocks_total"):
                pair = out.setdefault(s.labels["backend"], [0.0, 0.0])
                pair[s.name.endswith("hit_blocks_total")] += s.value
    return {url: (b, h) for url, (b, h) in out.items()}


# ---------------------------------------------------------------------- the breakdown


async def taken_apart(http: aiohttp.ClientSession, urls: list[str],
                      sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``sent`` joined, by the id each answer carried, to what its engine says of it
    (``GET /sim/requests``: which engine, prompt and cached tokens, time queued for a slot and
    the step budget, time and engine steps to the first token)."""
    engine_side: dict[str, dict[str, Any]] = {}
    for i, url in enumerate(urls):
        async with http.get(url + "/sim/requests") as r:
            if r.status != 200:
                return []
            for record in await r.json():
                engine_side[record["id"]] = {**record, "engine": i}
    return [{**s, **engine_side[s["id"]]} for s in sent if s.get("id") in engine_side]


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (the nearest rank below), ``None`` for none: every
    p50 and p99 of this bench and bench/cache_model.py."""
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else None


def breakdown(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT p50 / p99 (ms, at the client and at the engine) of the first turn (a GRPO
    workload's first epoch) and of the turns after it, and the slowest requests taken apart."""
    out: dict[str, Any] = {}
    for name, rows in (("first", [t for t in trace if t["turn"] == 0]),
                       ("after_first", [t for t in trace if t["turn"] > 0])):
        ttft = [t["ttft_ms"] for t in rows]
        at_engine = [t["first_token_ms"] for t in rows]
        out[name] = {"n": len(rows), "p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99),
                     # The engine's own view, from the request's arrival to its first token's
                     # step: without the client's, the router's and the machine's share.
                     "engine_p50": pct(at_engine, 0.5), "engine_p99": pct(at_engine, 0.99),
                     "steps_p50": pct([t["steps_to_first_token"] for t in rows], 0.5)}
    at_engine = [t["first_token_ms"] for t in trace]
    out["all"] = {"engine_p50": pct(at_engine, 0.5), "engine_p99": pct(at_engine, 0.99)}
    out["slowest"] = [
        {k: t[k] for k in ("turn", "engine", "prompt_tokens", "cached", "queued_ms",
                           "steps_to_first_token", "first_token_ms", "ttft_ms")}
        for t in sorted(trace, key=lambda t: -t["ttft_ms"])[:4]]
    return out


# ---------------------------------------------------------------------- the run


async def measure(router: str, urls: list[str], workload: Callable[..., Awaitable[None]],
                  restart_after: int | None = None) -> Result:
    result = Result()
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as http:
        for url in urls:  # every workload starts cold
            async with http.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200
        before = await snapshot(http, urls)
        guessed = await predicted(http, router)
        marks: dict[str, list[tuple[float, float, float]]] = {}

        async def between(step: int) -> None:
            if restart_after is not None and step == restart_after:
                forgotten = await router_counter(http, router, FORGOTTEN)
                # The engine that served the most so far: the one whose cache matters most
                # (a router that left one engine idle must not be spared the restart).
                served = deltas(before, await snapshot(http, urls))
                busiest = max(range(len(urls)), key=lambda i: served[i][2])
                result.restarted = busiest
                async with http.post(urls[busiest] + "/sim/fault",
                                     json={"mode": "restart"}) as r:
                    assert r.status == 200
                await asyncio.sleep(3.0)  # the same pause for every router
                marks["restart"] = await snapshot(http, urls)
                if forgotten is not None:
                    after = await router_counter(http, router, FORGOTTEN)
                    result.forgotten_at_restart = None if after is None else after - forgotten

        started = time.perf_counter()
        await workload(http, router, result, between)
        result.wall_s = time.perf_counter() - started
        after = await snapshot(http, urls)
        moved = deltas(before, after)
        result.queries = sum(q for q, _, _ in moved)
        result.hits = sum(h for _, h, _ in moved)
        result.per_engine = [n for _, _, n in moved]
        result.actual = [(q, h) for q, h, _ in moved]
        now_guessed = await predicted(http, router)
        result.predicted = [
            (now_guessed.get(u, (0.0, 0.0))[0] - guessed.get(u, (0.0, 0.0))[0],
             now_guessed.get(u, (0.0, 0.0))[1] - guessed.get(u, (0.0, 0.0))[1]) for u in urls]
        result.trace = await taken_apart(http, urls, result.sent)
        if "restart" in marks:
            since = deltas(marks["restart"], after)
            result.after_restart = (sum(q for q, _, _ in since), sum(h for _, h, _ in since))
    return result


def workloads(quick: bool, sessions: int | None = None
              ) -> dict[str, tuple[Callable[..., Awaitable[None]], int | None]]:
    # Each workload's texts are its own (the salt), so no router's index of one workload
    # helps it in the next: the engines' caches are reset between them.
    s, t = (8, 4) if quick else (24, 6)
    s = s if sessions is None else sessions
    g = 8 if quick else 32
    return {
        f"GRPO {g}x8, shared system prompt, 3 epochs": (grpo(g, 8, 3, "[grpo] "), None),
        f"agents {s}x{t}, no header": (
            agents(s, t, header=False, system=False, salt="[plain] "), None),
        f"agents {s}x{t}, x-session-id": (
            agents(s, t, header=True, system=False, salt="[header] "), None),
        f"agents {s}x{t}, shared system prompt": (
            agents(s, t, header=True, system=True, salt="[system] "), None),
        f"agents {s}x{t}, busiest engine restarted after turn 3": (
            agents(s, t, header=True, system=False, salt="[restart] ", lockstep=True), 2),
    }


async def run_router(name: str, router: str, urls: list[str], quick: bool,
                     wanted: list[str], sessions: int | None = None,
                     trace: Path | None = None) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        await wait_serving(http, router)
    # A fleet's controller proves each attached engine before it serves at full share (a
    # few probe intervals of 1 s): measure the fleet once it has, as it runs for hours.
    await asyncio.sleep(SETTLE_S if name.startswith("fleetwarden cache_aware") else 0)
    rows = {}
    for label, (workload, restart_after) in workloads(quick, sessions).items():
        if wanted and not any(w in label for w in wanted):
            continue
        result = await measure(router, urls, workload, restart_after)
        rows[label] = result.row()
        print(f"{name} | {label}: {json.dumps(rows[label])}", file=sys.stderr, flush=True)
        if trace is not None:
            with trace.open("a") as f:
                for t in result.trace:
                    f.write(json.dumps({"router": name, "workload": label, **t}) + "\n")
    return rows


def event_routers() -> list[tuple[str, int, dict[str, Any]]]:
    """--events: (name, router workers, settings) of each router measured."""
    out: list[tuple[str, int, dict[str, Any]]] = [
        ("least_in_flight x1", 1, {"routing": "least_in_flight"})]
    for workers in (1, 2, 4):
        out += [(f"approximate x{workers}", workers,
                 {"routing": "cache_aware", "kv_events": False}),
                (f"events x{workers}", workers, {"routing": "cache_aware", "kv_events": True})]
    return out


def event_workloads(quick: bool, seed: int) -> dict[str, Callable[..., Awaitable[None]]]:
    # Token ids of their own for every workload and seed, so no router's index of one run
    # helps it in the next (the engines' caches are reset between them; a router's guess is
    # not).
    requests = 160 if quick else 400
    return {"documents that fit (24 x 8 blocks)":
            documents(24, requests, 16, seed, 1_000_000 * (1 + 2 * seed)),
            "documents evicted (64 x 8 blocks)":
            documents(64, requests, 16, seed, 1_000_000 * (2 + 2 * seed))}


async def run_events_router(name: str, router: str, urls: list[str], quick: bool,
                            seeds: int) -> dict[str, list[dict[str, Any]]]:
    async with aiohttp.ClientSession() as http:
        await wait_serving(http, router)
    await asyncio.sleep(1.0)  # every worker reads /kv_event_sources and subscribes
    rows: dict[str, list[dict[str, Any]]] = {}
    for seed in range(seeds):
        for label, workload in event_workloads(quick, seed).items():
            result = await measure(router, urls, workload)
            row = {k: v for k, v in result.row().items() if k != "ttft_by_turn"}
            async with aiohttp.ClientSession() as http:
                row["kv_events_lost"] = await router_counter(
                    http, router, "fleetwarden_router_kv_events_lost_total")
            row["seed"] = seed
            rows.setdefault(label, []).append(row)
            print(f"{name} | {label} | seed {seed}: {json.dumps(row)}", file=sys.stderr,
                  flush=True)
    return rows


def run_events(args: argparse.Namespace) -> None:
    """--events: see the module's docstring."""
    report: dict[str, Any] = {}
    picked = [r for r in args.routers.split(",") if r]
    extra = ("--kv-events-config", KV_EVENTS, "--prefix-cache-blocks", str(EVENT_BLOCKS))
    with engines(args.engines, extra) as urls:
        for name, workers, settings in event_routers():
            if picked and not any(p in name for p in picked):
                continue
            with fleetwarden_workers(urls, workers, settings) as router:
                report[name] = asyncio.run(run_events_router(name, router, urls, args.quick,
                                                             args.seeds))
    print(json.dumps(report, indent=1))
    print(f"\ntoken hit rate from the engines' counters, mean (min-max) of {args.seeds} seeds; "
          f"{args.engines} engines of {EVENT_BLOCKS} blocks")
    for name, by_workload in report.items():
        cells = []
        for label, rows in by_workload.items():
            rates = [r["hit_rate"] for r in rows]
            cells.append(f"{label}: {statistics.fmean(rates):.3f} "
                         f"({min(rates):.3f}-{max(rates):.3f})")
        print(f"{name:20} | " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--no-peer", action="store_true", help="leave sglang-router out")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--routers", default="",
                        help="comma-separated names (or parts of names) of the routers to run; "
                             "all by default")
    parser.add_argument("--sessions", type=int, default=None,
                        help="conversations of the agent workloads (24; 8 with --quick)")
    parser.add_argument("--baseline", default=None, metavar="SRC",
                        help="also run `fleetwarden route cache_aware` from this source folder "
                             "(e.g. the main checkout's src), as 'fleetwarden baseline "
                             "cache_aware', on the same engines")
    parser.add_argument("--workloads", default="",
                        help="comma-separated parts of the workloads' names to run (e.g. "
                             "'system,restart'); all by default")
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="append every request, taken apart, to FILE (JSON lines: router, "
                             "workload, session or prompt, turn, engine, prompt and cached "
                             "tokens, time queued, engine steps and TTFT)")
    parser.add_argument("--events", action="store_true",
                        help="the KV-event index beside the approximate one and least in "
                             "flight, 1, 2 and 4 router workers (see the docstring)")
    parser.add_argument("--seeds", type=int, default=3, help="--events: runs of each workload")
    args = parser.parse_args()
    if args.events:
        run_events(args)
        return
    wanted = [w for w in args.workloads.split(",") if w]
    report: dict[str, Any] = {}
    with engines(args.engines) as urls, tempfile.TemporaryDirectory() as tmp:
        routers: list[tuple[str, Callable[[], contextlib.AbstractContextManager[str]]]] = [
            ("fleetwarden cache_aware", lambda: fleetwarden_up(urls, Path(tmp))),
            # The same policy without a controller, as the least-in-flight router runs: the
            # policy's figures apart from the fleet's processes (it misses the restart's push).
            ("fleetwarden route cache_aware", lambda: fleetwarden_route(urls, "cache_aware")),
            ("fleetwarden least_in_flight", lambda: fleetwarden_route(urls, "least_in_flight")),
        ]
        if args.baseline is not None:
            routers.append(("fleetwarden baseline cache_aware",
                            lambda: fleetwarden_route(urls, "cache_aware", args.baseline)))
        if not args.no_peer:
            routers += [
                ("sglang-router 0.3.2 cache_aware", lambda: sglang_router(urls, "cache_aware")),
                ("sglang-router 0.3.2 round_robin", lambda: sglang_router(urls, "round_robin")),
            ]
        picked = [r for r in args.routers.split(",") if r]
        for name, start in routers:
            if picked and not any(p in name for p in picked):
                continue
            try:
                with start() as router:
                    report[name] = asyncio.run(run_router(name, router, urls, args.quick,
                                                          wanted, args.sessions, args.trace))
            except PeerUnavailable as exc:
                report[name] = f"not run: {exc}"
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
