"""The router's own ``GET /v1/models``: the union of what its backends serve, in vLLM's shape,
from the push (docs/engines.md, "The model list")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetwarden.router.keys import add_key
from fleetwarden.router.links import ControlError, RemoteRouter
from fleetwarden.router.models import MAX_CARDS, ModelCard, cards_of, model_list
from fleetwarden.router.pool import BackendFacts
from support.router_rig import rig
from support.scripted_engine import MODELS

TOKEN = "models-token"


def test_the_list_has_vllms_shape_field_for_field() -> None:
    captured = json.loads(MODELS.body)
    cards = cards_of(MODELS.body)
    assert cards == (ModelCard("tiny", "vllm", "/srv/models/tiny-llama", None, 512),)
    listed = model_list([cards], 1795973051)
    assert list(listed) == list(captured)
    (ours,), (theirs,) = listed["data"], captured["data"]
    assert list(ours) == list(theirs)  # every field, in vLLM's order
    assert list(ours["permission"][0]) == list(theirs["permission"][0])
    ignored = {"permission"}
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in theirs.items() if k not in ignored}
    made, seen = ours["permission"][0], theirs["permission"][0]
    assert {k: v for k, v in made.items() if k != "id"} == {
        k: v for k, v in seen.items() if k != "id"}
    assert made["id"].startswith("modelperm-") and len(made["id"]) == len(seen["id"])


def test_each_model_is_listed_once_and_the_smallest_context_wins() -> None:
    first = (ModelCard("alpha", "vllm", "/a", None, 4096),)
    second = (ModelCard("alpha", "other", "/elsewhere", None, 2048),
              ModelCard("beta", "vllm", "/b", None, None))
    third = (ModelCard("alpha", None, None, None, None),)
    data = model_list([first, second, third], 7)["data"]
    assert [m["id"] for m in data] == ["alpha", "beta"]
    alpha = data[0]
    # the smallest known context: a request that fits it fits on every engine serving alpha;
    # the rest from the first backend in push order
    assert (alpha["max_model_len"], alpha["owned_by"], alpha["root"]) == (2048, "vllm", "/a")
    assert data[1]["max_model_len"] is None
    assert model_list([], 7) == {"object": "list", "data": []}


@pytest.mark.parametrize("body, expected", [
    (b"", "not a model list"),
    (b"[]", "not a model list"),
    (b'{"data": 3}', "not a model list"),
    (b'{"data": [{"object": "model"}]}', "not a model list"),
    (b'{"data": [{"id": 3}]}', "not a model list"),
    # a field of the wrong type is dropped, the model kept (llama.cpp's list has no
    # max_model_len; a hostile one may say anything)
    (b'{"data": [{"id": "m", "max_model_len": "long", "root": 5, "owned_by": "me"}]}',
     (ModelCard("m", "me"),)),
    (b'{"data": [{"id": "m", "max_model_len": true}]}', (ModelCard("m"),)),
])
def test_an_engines_list_is_reduced_never_raised_on(
        body: bytes, expected: tuple[ModelCard, ...] | str) -> None:
    assert cards_of(body) == expected


def test_a_list_of_more_than_max_cards_is_cut() -> None:
    body = json.dumps({"data": [{"id": f"m{i}"} for i in range(MAX_CARDS + 5)]}).encode()
    cards = cards_of(body)
    assert isinstance(cards, tuple) and len(cards) == MAX_CARDS


async def test_the_router_answers_from_the_push_and_asks_no_engine() -> None:
    async with rig(2, health_managed=True, control_token=TOKEN) as r:
        a, b = (e.url for e in r.engines)
        alpha = (ModelCard("alpha", "vllm", "/a", None, 4096),)
        beta = (ModelCard("beta", "vllm", "/b", None, 2048),)
        assert r.router.control_url is not None
        async with RemoteRouter(r.router.control_url, TOKEN) as remote:
            await remote.set_serving_backends(
                [a, b], {a: BackendFacts(0, 0, models=alpha), b: BackendFacts(1, 0, models=beta)})
            assert r.router.pool.facts(b).models == beta  # through the control API whole
            status, body = await r.get("/v1/models")
            assert status == 200
            assert [m["id"] for m in json.loads(body)["data"]] == ["alpha", "beta"]
            assert [e.received for e in r.engines] == [0, 0]
            # b leaves routing: its model leaves the list; back when it returns
            await remote.set_serving_backends([a], {a: BackendFacts(0, 0, models=alpha)})
            assert [m["id"] for m in json.loads((await r.get("/v1/models"))[1])["data"]] == [
                "alpha"]
            r.router.set_serving_backends(
                [a, b], {a: BackendFacts(0, 0, models=alpha), b: BackendFacts(1, 0, models=beta)})
            assert r.router.pool.drop(b)  # the reflex takes it out at once
            assert [m["id"] for m in json.loads((await r.get("/v1/models"))[1])["data"]] == [
                "alpha"]
            assert [e.received for e in r.engines] == [0, 0]
            # a push that names no models (an older controller): forwarded, as before
            await remote.set_serving_backends([a], {a: BackendFacts(0, 0)})
            status, body = await r.get("/v1/models")
            assert status == 200 and r.engines[0].received == 1
            # a card of the wrong shape is refused, naming its field
            bad = {"backends": [a], "facts": {a: {"models": [{"id": "x", "max_model_len": 0}]}}}
            with pytest.raises(ControlError, match=r"facts\..*\.models\[0\].*max_model_len"):
                await remote._call("PUT", "/serving", bad)
            with pytest.raises(ControlError, match=r"models' must be a list"):
                await remote._call("PUT", "/serving", {"backends": [a], "facts": {
                    a: {"models": {"id": "x"}}}})


async def test_a_router_behind_keys_answers_its_list_to_a_keyed_client_alone(
        tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    alpha = add_key(keys, "alpha")
    async with rig(1, health_managed=True, keys_file=str(keys)) as r:
        a = r.engines[0].url
        r.router.set_serving_backends(
            [a], {a: BackendFacts(0, 0, models=(ModelCard("alpha", "vllm", "/a", None, 4096),))})
        async with r.http.get(r.router.url + "/v1/models") as refused:
            assert refused.status == 401
        async with r.http.get(r.router.url + "/v1/models",
                              headers={"Authorization": f"Bearer {alpha}"}) as answered:
            assert answered.status == 200
            assert [m["id"] for m in (await answered.json())["data"]] == ["alpha"]
        assert r.engines[0].received == 0  # from the push, behind the key as without one
        assert r.router.stats.keys["alpha"].requests == 1
