"""`GET /v1/models` through the router of a fleet whose engines serve different models
(docs/engines.md, "The model list"): the union of the routable engines' models, each once;
an engine that leaves routing takes its model with it, and brings it back when it returns."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.ledger import ShardState
from support.fleet import SIM, running_fleet
from support.wait import until

pytestmark = pytest.mark.scenario


async def test_the_router_lists_the_models_of_the_engines_it_routes_to(tmp_path: Path) -> None:
    # shard 0 serves model-0 with a context of 2048, shard 1 model-1 with 2148
    cmd = SIM + " --model model-{shard} --max-model-len 2{shard}48"
    async with (running_fleet(tmp_path, fleet={"engine_cmd": cmd}) as fleet,
                aiohttp.ClientSession() as http):

        async def listed() -> list[dict[str, object]]:
            async with http.get(fleet.router_url + "/v1/models") as response:
                assert response.status == 200
                body = await response.json()
            assert body["object"] == "list"
            data: list[dict[str, object]] = body["data"]
            return data

        async def lists(*expected: str) -> bool:
            return sorted(str(card["id"]) for card in await listed()) == list(expected)

        took = await until(lambda: lists("model-0", "model-1"), timeout=30,
                           what="both engines' models listed")
        print(f"\nboth models listed {took:.1f} s after the fleet started")
        cards = {card["id"]: card for card in await listed()}
        assert cards["model-0"]["max_model_len"] == 2048
        assert cards["model-1"]["max_model_len"] == 2148
        assert all(card["object"] == "model" and card["permission"] for card in cards.values())

        await fleet.inject_fault(1, "crash", {})
        crashed = time.monotonic()
        await until(lambda: fleet.ledger.state(1) is not ShardState.HEALTHY, what="crash seen")
        await until(lambda: lists("model-0"), timeout=10,
                    what="the crashed engine's model out of the list")
        print(f"model-1 out of the list {time.monotonic() - crashed:.2f} s after the crash")
        assert fleet.ledger.state(1) is not ShardState.HEALTHY  # out while it is out
        await until(lambda: lists("model-0", "model-1"), timeout=60,
                    what="the restarted engine's model back in the list")
        assert fleet.ledger.state(1) is ShardState.HEALTHY
        print(f"model-1 back {time.monotonic() - crashed:.1f} s after the crash")
