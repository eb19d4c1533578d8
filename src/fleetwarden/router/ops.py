"""The router's control operations, declared once: the table both sides are built from.

Owns: :data:`OPERATIONS`, each :class:`Operation` with its name, arguments, answer and HTTP
route; the readers that check each argument as the control API receives it; the answers of
the reads, :class:`Holding` and :class:`Evidence`.
Must not: send or serve anything: :mod:`fleetwarden.router.links` builds its clients from this
table (a router across a socket, a router in this process, a slot of worker processes), and
:mod:`fleetwarden.router.control` its server.

An operation's ``target`` is the attribute path, from the
:class:`~fleetwarden.router.app.Router`, of the call that does it, with the operation's
arguments as keywords: the in-process link and the control server both call it, so that what
an operation does is written in one place, and its arguments are named in one other (the
typed method of :class:`~fleetwarden.router.links.RouterLink`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from fleetwarden.router.models import MAX_CARDS, ModelCard, card_error
from fleetwarden.router.pool import BackendFacts
from fleetwarden.router.splice import CompletionDefault

__all__ = ["DRAIN", "EVIDENCE", "EVIDENCE_WAIT_MAX_S", "EVIDENCE_WAIT_S", "HEDGE", "HOLDING",
           "OPERATIONS", "RESCUE", "RETRY_AFTER", "SERVING", "STATUS", "TRIAL",
           "WEIGHTS_CHANGING", "Arg", "Evidence", "Fan", "Holding", "Operation", "Outcomes",
           "facts_json"]

R = TypeVar("R")

#: ``{url: (successes, failures, trailing_failures)}``: one window of a router's outcomes.
Outcomes = dict[str, tuple[int, int, int]]

#: How a slot of worker processes (``fleetwarden up``) sends an operation: ``push`` to the
#: slot's worker and every predecessor still draining, remembered for a replacement; ``sum``
#: to all of them, their answers added; ``now`` to the slot's worker alone.
Fan = Literal["push", "sum", "now"]

_ABSENT: Any = object()  # a field the body leaves out

#: How long an evidence poll waits for evidence by default: a long poll held open, answered
#: at once when there is any.
EVIDENCE_WAIT_S = 20.0
#: How long ``GET /evidence`` waits at most: the bound keeps a connection from outliving a
#: controller that went away unseen.
EVIDENCE_WAIT_MAX_S = 60.0


@dataclass(frozen=True)
class Holding:
    """What a router holds on each backend, in one read: requests in flight (counted from
    dispatch to the last byte), and the backends holding one that has received nothing for
    the read's ``silent_after_s``, with that wait (:meth:`WaitingRequests.silent
    <fleetwarden.router.waiting.WaitingRequests.silent>`)."""

    in_flight: dict[str, int] = field(default_factory=dict)
    silent: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "silent": self.silent}

    @classmethod
    def of_json(cls, raw: Mapping[str, Any]) -> Holding:
        return cls({url: int(n) for url, n in raw["in_flight"].items()},
                   {url: float(x) for url, x in raw["silent"].items()})


@dataclass(frozen=True)
class Evidence:
    """One answer of the evidence long poll (:class:`~fleetwarden.router.waiting.EvidenceFeed`):
    ``failed`` attempts since the count the caller named, ``failures`` the router's count now
    (what the caller names next time), and the backends holding a request silent for the poll's
    ``silent_after_s``, with that wait."""

    failed: int = 0
    failures: int = 0
    silent: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"failed": self.failed, "failures": self.failures, "silent": self.silent}

    @classmethod
    def of_json(cls, raw: Mapping[str, Any]) -> Evidence:
        return cls(int(raw["failed"]), int(raw["failures"]),
                   {url: float(x) for url, x in raw["silent"].items()})


@dataclass(frozen=True)
class Arg:
    """One argument of an operation: ``name`` in the call; ``read`` takes it from a request's
    JSON body (its query, for a GET), raising ``ValueError`` with a message naming the field;
    ``write`` gives the body's fields for a value."""

    name: str
    read: Callable[[Mapping[str, Any]], Any]
    write: Callable[[Any], dict[str, Any]]


@dataclass(frozen=True, eq=False)
class Operation(Generic[R]):
    """One control operation: a row of :data:`OPERATIONS`."""

    name: str            # the link's method (:class:`~fleetwarden.router.links.RouterLink`)
    method: str          # its HTTP route: method and path
    path: str
    args: tuple[Arg, ...]
    answer: str | None   # the answer's key holding the result; None: the answer is it
    decode: Callable[[Any], R]  # the answer's value as the link's result
    target: str          # the call that does it, from the router: ``forwarder.waiting.hedge``
    quiet: Callable[[], R]  # the answer of a link to a router that holds nothing
    fan: Fan = "now"
    encode: Callable[[Any], Any] = lambda result: result  # the target's result as JSON


def facts_json(facts: Mapping[str, BackendFacts]) -> dict[str, dict[str, Any]]:
    """``facts`` of a push as JSON (the control API's ``PUT /serving``)."""
    return {url: f.to_dict() for url, f in facts.items()}


# ---------------------------------------------------------------------- readers


def _field(name: str, check: Callable[[Any], Any], *, wire: str | None = None,
           default: Any = _ABSENT) -> Arg:
    """An argument carried in one field of the body (``wire``, default its ``name``)."""
    key = wire or name
    return Arg(name, lambda body: check(body.get(key, default)), lambda value: {key: value})


def _backend(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("'backend' must be a URL string")
    return value


def _urls(name: str) -> Callable[[Any], list[str]]:
    def check(value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
            raise ValueError(f"'{name}' must be a list of URL strings")
        return value
    return check


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"'{name}' must be true or false")
        return value
    return check


def _count(name: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"'{name}' must be an integer >= 0")
        return value
    return check


def _held_s(value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0):
        raise ValueError("'held_s' must be a number of seconds >= 0")
    return float(value)


def _retry_after(value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not math.isfinite(value) or value < 0):
        raise ValueError("'seconds' must be a number >= 0 or null")
    return value


def _query_seconds(name: str, default: float = 0.0, most: float = math.inf) -> Arg:
    """Seconds in a GET's query, from 0 to ``most``; absent is ``default``."""

    def read(query: Mapping[str, Any]) -> float:
        try:
            value = float(query.get(name, default))
        except ValueError:
            raise ValueError(f"'{name}' must be a number of seconds") from None
        if not math.isfinite(value) or value < 0 or value > most:
            raise ValueError(f"'{name}' must be a number of seconds from 0 to {most:g}"
                             if math.isfinite(most) else f"'{name}' must be a number >= 0")
        return value

    return Arg(name, read, lambda value: {name: f"{value:g}"})


def _query_count(name: str) -> Arg:
    """A count in a GET's query; absent is ``None``."""

    def read(query: Mapping[str, Any]) -> int | None:
        raw = query.get(name)
        if raw is None:
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"'{name}' must be a count of failed attempts") from None
        if value < 0:
            raise ValueError(f"'{name}' must be a count of failed attempts")
        return value

    return Arg(name, read, lambda value: {} if value is None else {name: str(value)})


def _facts_arg() -> Arg:
    """``facts`` of a push, with the engines' keys apart from them: the facts are echoed in
    answers and statuses, the keys never."""

    def write(facts: Mapping[str, BackendFacts] | None) -> dict[str, Any]:
        if facts is None:
            return {}
        body: dict[str, Any] = {"facts": facts_json(facts)}
        keys = {url: f.key for url, f in facts.items() if f.key is not None}
        if keys:
            body["keys"] = keys
        return body

    return Arg("facts", lambda body: facts_of(body.get("facts"), body.get("keys")), write)


def facts_of(raw: object, keys: object = None) -> dict[str, BackendFacts] | None:
    """``facts`` of a push: absent or null (an older controller), or ``{url: {"shard": i,
    "weight_version": v}}`` with either field absent or null when unknown; ``keys``: the
    engines' API keys by URL (absent: none), never echoed (no error names one)."""
    if keys is not None and (not isinstance(keys, dict) or not all(
            isinstance(k, str) and k for k in keys.values())):
        raise ValueError("'keys' must be an object mapping URLs to non-empty strings")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("'facts' must be an object mapping URLs to facts")
    return {url: _fact_of(url, fact, (keys or {}).get(url)) for url, fact in raw.items()}


def _fact_of(url: str, fact: object, key: str | None) -> BackendFacts:
    if not isinstance(fact, dict):
        raise ValueError(f"'facts.{url}' must be an object")
    values: dict[str, int | None] = {}
    for name, least in (("shard", 0), ("weight_version", 0), ("output_cap", 1),
                        ("output_default", 1)):
        value = fact.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):
            raise ValueError(f"'facts.{url}.{name}' must be an integer >= {least} or null")
        values[name] = value
    fields = fact.get("upstream_fields")
    if fields is not None and not isinstance(fields, bool):
        raise ValueError(f"'facts.{url}.upstream_fields' must be true, false or null")
    strings: dict[str, str | None] = {}
    for name in ("incarnation", "output_cap_unknown", "output_default_unknown",
                 "completion_default"):
        value = fact.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"'facts.{url}.{name}' must be a string or null")
        strings[name] = value
    return BackendFacts(values["shard"], values["weight_version"], upstream_fields=fields,
                        incarnation=strings["incarnation"],
                        models=_models_of(url, fact.get("models")),
                        key=key, output_cap=values["output_cap"],
                        output_default=values["output_default"],
                        output_cap_unknown=strings["output_cap_unknown"],
                        output_default_unknown=strings["output_default_unknown"],
                        completion_default=_completion_default(url, strings))


def _completion_default(url: str, strings: dict[str, str | None]) -> CompletionDefault | None:
    """``facts.URL.completion_default``: one of :class:`CompletionDefault`'s words, or null."""
    value = strings["completion_default"]
    try:
        return None if value is None else CompletionDefault(value)
    except ValueError:
        words = ", ".join(repr(r.value) for r in CompletionDefault)
        raise ValueError(f"'facts.{url}.completion_default' must be one of {words} or "
                         "null") from None


def _models_of(url: str, raw: object) -> tuple[ModelCard, ...] | None:
    """``facts.URL.models`` of a push: absent or null (not read yet, or an older
    controller), or a list of cards (:class:`~fleetwarden.router.models.ModelCard`)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_CARDS:
        raise ValueError(f"'facts.{url}.models' must be a list of at most {MAX_CARDS} "
                         "model cards or null")
    for k, card in enumerate(raw):
        problem = card_error(card)
        if problem is not None:
            raise ValueError(f"'facts.{url}.models[{k}]': {problem}")
    return tuple(ModelCard.of(card) for card in raw)


def _none(answer: Any) -> None:
    return None


def _outcomes(answer: Mapping[str, Any]) -> Outcomes:
    return {url: (int(s), int(f), int(t)) for url, (s, f, t) in answer.items()}


def _status(answer: Any) -> dict[str, Any]:
    return dict(answer)


# ---------------------------------------------------------------------- the table
# PUT /serving and POST /outcomes/drain have a protocol of their own besides (the push arms the
# reflex; the drain's batches are acknowledged): :mod:`fleetwarden.router.control` says how.

SERVING: Operation[None] = Operation(
    "set_serving_backends", "PUT", "/serving",
    (_field("urls", _urls("backends"), wire="backends"), _facts_arg(),
     _field("coming_back", _count("coming_back"), default=0)),
    None, _none, "set_serving_backends", lambda: None, fan="push")
TRIAL: Operation[None] = Operation(
    "set_trial_backends", "PUT", "/trial", (_field("urls", _urls("backends"), wire="backends"),),
    "trial", _none, "set_trial_backends", lambda: None, fan="push")
RETRY_AFTER: Operation[None] = Operation(
    "set_retry_after", "PUT", "/retry-after", (_field("seconds", _retry_after),),
    "retry_after", _none, "set_retry_after", lambda: None, fan="push")
DRAIN: Operation[Outcomes] = Operation(
    "drain_outcomes", "POST", "/outcomes/drain", (), "outcomes", _outcomes,
    "pool.drain_outcomes", dict)
RESCUE: Operation[int] = Operation(
    "rescue", "POST", "/rescue",
    (_field("backend", _backend), _field("streams", _flag("streams"), default=True)),
    "rescued", int, "forwarder.waiting.rescue", int, fan="sum")
WEIGHTS_CHANGING: Operation[int] = Operation(
    "weights_changing", "POST", "/weights-changing",
    (_field("backend", _backend), _field("version", _count("version"))),
    "marked", int, "forwarder.waiting.weights_changing", int, fan="sum")
HEDGE: Operation[int] = Operation(
    "hedge", "POST", "/hedge",
    (_field("backend", _backend), _field("held_s", _held_s),
     _field("lost_race_fails", _flag("lost_race_fails"), default=False)),
    "hedged", int, "forwarder.waiting.hedge", int)
HOLDING: Operation[Holding] = Operation(
    "holding", "GET", "/holding", (_query_seconds("silent_after_s"),), "holding",
    Holding.of_json, "holding", Holding, encode=Holding.to_json)
STATUS: Operation[dict[str, Any]] = Operation(
    "status", "GET", "/status", (), None, _status, "status", dict)
#: The long poll of failed attempts and silent backends (a router in another process:
#: :meth:`~fleetwarden.router.links.RouterLink.evidence`); ``after``: the count the caller saw.
EVIDENCE: Operation[Evidence] = Operation(
    "evidence", "GET", "/evidence",
    (_query_seconds("wait_s", EVIDENCE_WAIT_S, EVIDENCE_WAIT_MAX_S),
     _query_seconds("silent_after_s", 1.0), _query_count("after")),
    None, Evidence.of_json, "evidence", Evidence, encode=Evidence.to_json)
#: The two reads :data:`HOLDING` makes in one, still served to an older controller.
IN_FLIGHT: Operation[dict[str, int]] = Operation(
    "in_flight", "GET", "/in-flight", (), "in_flight", dict, "in_flight", dict)
SILENT: Operation[dict[str, float]] = Operation(
    "silent_backends", "GET", "/silent", (_query_seconds("after_s"),), "silent", dict,
    "silent_backends", dict)

#: Every operation the control API serves, in the order a replacement worker is given the
#: pushes (serving set, then trial set, then Retry-After).
OPERATIONS: tuple[Operation[Any], ...] = (
    SERVING, TRIAL, RETRY_AFTER, DRAIN, RESCUE, WEIGHTS_CHANGING, HEDGE, HOLDING, STATUS,
    EVIDENCE, IN_FLIGHT, SILENT)
