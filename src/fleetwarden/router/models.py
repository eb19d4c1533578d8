"""The models a fleet serves: one engine's ``GET /v1/models`` read, and the router's answer.

Owns: :class:`ModelCard` (what a push says of one model an engine serves),
:func:`cards_of` (an engine's ``/v1/models`` body, reduced to cards) and :func:`model_list`
(the router's own answer to ``GET /v1/models``: the union over the backends it may use, in
vLLM's shape).
Must not: do I/O or read a clock (pure: the caller passes the time of the answer).

Where it comes from (docs/engines.md, "The model list"): the watchdog reads each engine's
``/v1/models`` once per process, the controller pushes the cards with the serving set, and a
router answers from the last push; no request of a client's ever waits on an engine's list.

Where engines serving one model disagree, one rule per field, so that the list is a promise
every engine behind the router keeps:

* ``max_model_len``: the smallest known. A request that fits it fits on every engine that
  serves the model; a larger one would be refused by some of them, by chance of placement.
* ``root``, ``parent``, ``owned_by``: the first backend's in push order (the fleet's shard
  order), so the answer stays the same from one request to the next.
* ``created``: the time of the answer, as vLLM stamps its own (each of its answers makes new
  cards), and ``permission``: vLLM's one default permission, made afresh the same way.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CARDS", "ModelCard", "card_error", "cards_of", "model_list"]

#: The most cards kept of one engine's list: a real engine lists its model and its LoRA
#: adapters, a few dozen at most; the bound keeps a hostile list out of every push.
MAX_CARDS = 256


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One model an engine serves, as its ``/v1/models`` card says (``None``: not said)."""

    id: str
    owned_by: str | None = None
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None

    def to_dict(self) -> dict[str, str | int | None]:
        return {"id": self.id, "owned_by": self.owned_by, "root": self.root,
                "parent": self.parent, "max_model_len": self.max_model_len}

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> ModelCard:
        """A card from JSON that :func:`card_error` found nothing wrong with."""
        return cls(str(raw["id"]), raw.get("owned_by"), raw.get("root"), raw.get("parent"),
                   raw.get("max_model_len"))


def card_error(raw: object) -> str | None:
    """What is wrong with one card's JSON (naming the field), or ``None``."""
    if not isinstance(raw, dict):
        return "must be an object"
    if not isinstance(raw.get("id"), str) or not raw["id"]:
        return "'id' must be a non-empty string"
    for name in ("owned_by", "root", "parent"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            return f"'{name}' must be a string or null"
    length = raw.get("max_model_len")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 1):
        return "'max_model_len' must be an integer >= 1 or null"
    return None


def cards_of(body: bytes) -> tuple[ModelCard, ...] | str:
    """An engine's ``/v1/models`` body as cards (at most :data:`MAX_CARDS`), or why it is
    not a model list. Never raises: a card with a field of the wrong type keeps its ``id``
    and loses that field (an engine's own dialect of the list, e.g. llama.cpp's, still
    names its models)."""
    try:
        data = json.loads(body or b"")["data"]
    except (ValueError, KeyError, TypeError):
        return "not a model list"
    if not isinstance(data, list):
        return "not a model list"
    cards = []
    for raw in data[:MAX_CARDS]:
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            return "not a model list"
        kept = {"id": raw["id"]}
        for name in ("owned_by", "root", "parent", "max_model_len"):
            if card_error({"id": raw["id"], name: raw.get(name)}) is None:
                kept[name] = raw.get(name)
        cards.append(ModelCard.of(kept))
    return tuple(cards)


def model_list(backends: Iterable[Sequence[ModelCard]], now: int) -> dict[str, Any]:
    """The router's ``GET /v1/models`` answer: every model of ``backends`` (each backend's
    cards, in push order) listed once, merged by the rules above, in vLLM's shape; ``now``
    (Unix seconds) stamps the cards."""
    merged: dict[str, ModelCard] = {}
    for cards in backends:
        for card in cards:
            first = merged.get(card.id)
            if first is None:
                merged[card.id] = card
                continue
            lengths = [n for n in (first.max_model_len, card.max_model_len) if n is not None]
            merged[card.id] = ModelCard(first.id, first.owned_by, first.root, first.parent,
                                        min(lengths) if lengths else None)
    return {"object": "list", "data": [_vllm_card(c, now) for c in merged.values()]}


def _vllm_card(card: ModelCard, now: int) -> dict[str, Any]:
    # vLLM's ModelCard and ModelPermission, field for field, with their defaults
    # (vllm/entrypoints/openai/protocol.py; tests/fixtures/vllm/models.http).
    return {
        "id": card.id, "object": "model", "created": now,
        "owned_by": card.owned_by if card.owned_by is not None else "vllm",
        "root": card.root, "parent": card.parent, "max_model_len": card.max_model_len,
        "permission": [{
            "id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
            "created": now, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False,
        }],
    }
