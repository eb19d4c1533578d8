"""A small client for a fleet's admin API: what a trainer in another process, and the CLI, use.

Owns: the admin API's Python client (what a trainer in another process, and the CLI, call).
Must not: know a fleet's internals: it speaks only the admin API's JSON.

    from fleetwarden.client import FleetClient

    fleet = FleetClient("http://127.0.0.1:8081", token_file="fleetwarden-admin.token")
    lease = fleet.begin_refit(7)            # {"version": 7, "participants": [...], ...}
    ...                                     # push weights to lease["participants"]
    fleet.complete_refit(7)                 # or fleet.abort_refit(7, "NCCL timeout")
    fleet.sleep(level=1); train(); fleet.wake()   # colocated RL: the GPU to the trainer

Synchronous and dependency-free (the standard library's HTTP client), so it drops into any
training loop. Every refused call raises :class:`FleetClientError` with the fleet's message.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["FleetClient", "FleetClientError"]


class FleetClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class FleetClient:
    def __init__(self, admin_url: str, *, token: str | None = None,
                 token_file: str | Path | None = None, timeout_s: float = 30.0) -> None:
        if token is None:
            if token_file is None:
                raise ValueError("FleetClient needs token= or token_file=")
            try:
                token = Path(token_file).expanduser().read_text().strip()
            except OSError as exc:
                raise FleetClientError(0, f"cannot read the admin token file {token_file}: "
                                          f"{exc.strerror}") from None
        self.admin_url = admin_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
              timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.admin_url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self._token}",
                     "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace")[:300] or exc.reason
            raise FleetClientError(exc.code, str(message)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise FleetClientError(0, f"cannot reach the admin API at {self.admin_url}: "
                                      f"{reason}") from None

    # ------------------------------------------------------------------ reading

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/admin/status")
        return result

    def shards(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/admin/shards")["shards"]
        return result

    def status_and_shards(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The status and the shards of one snapshot (one call): a headline that agrees with
        its rows."""
        result: dict[str, Any] = self._call("GET", "/admin/shards")
        return result["status"], result["shards"]

    def states(self) -> dict[int, str]:
        return {s["index"]: s["state"] for s in self.shards()}

    def transitions(self, since: int = 0) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(
            "GET", f"/admin/transitions?since={since}")["transitions"]
        return result

    def serving(self) -> list[str]:
        result: list[str] = self._call("GET", "/admin/serving")["urls"]
        return result

    # ------------------------------------------------------------------ refits

    def begin_refit(self, version: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/admin/refit/begin", {"version": version})
        return result

    def complete_refit(self, version: int,
                       checksums: dict[str, str] | None = None) -> dict[str, Any]:
        """Credit ``version`` to the participants whose engine confirms it (vLLM: its
        ``/weight_info`` says ``str(version)``: stamp it with ``finish_weight_update`` or
        ``update_weight_version``; and, given ``checksums``, its ``/weight_checker`` agrees).
        ``["unconfirmed"]``: the shards left STALE, each with what its engine reported."""
        body: dict[str, Any] = {"version": version}
        if checksums is not None:
            body["checksums"] = checksums
        result: dict[str, Any] = self._call("POST", "/admin/refit/complete", body)
        return result

    def refit_from(self, path: str, version: int, *, pause_mode: str | None = None,
                   checksums: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
        """Have fleetwarden load the checkpoint at ``path`` (as the engines' hosts see it) into
        every participant as ``version``: out of routing, paused (``pause_mode``: the
        fleet's ``[refit] pause_mode`` by default), reloaded, stamped, resumed, and credited
        only where the engine confirms. ``["engines"]``: per engine ``took``, ``confirmed``,
        ``state`` and ``error``; ``["credited"]`` / ``["failed"]``: the shards; ``["cost"]``:
        what faults cost the requests since the last load (re-sent, continued, aborted,
        tokens discarded, failures by engine: docs/rl.md). Waits up to
        ``timeout_s`` (default: the client's, at least 600 s: a load takes minutes)."""
        body: dict[str, Any] = {"path": path, "version": version}
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        if checksums is not None:
            body["checksums"] = checksums
        result: dict[str, Any] = self._call(
            "POST", "/admin/refit/load", body,
            timeout_s=timeout_s if timeout_s is not None else max(self.timeout_s, 600.0))
        return result

    def abort_refit(self, version: int, reason: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/admin/refit/abort",
                                            {"version": version, "reason": reason})
        return result

    def refit_status(self) -> dict[str, Any] | None:
        """The open lease as fleetwarden sees it (``None`` without one): per participant
        whether its process lives and its API answers, since when, with the evidence, and
        ``culprits``: the shards a hung broadcast waits on. Abort naming them; the abort
        condemns a single suspect."""
        lease: dict[str, Any] | None = self.refits()["lease"]
        return lease

    def refits(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/admin/refits")
        return result

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1, shards: list[int] | None = None) -> dict[str, Any]:
        """Put the engines to sleep for a training step (every awake shard by default): out
        of routing first (what has received nothing moves; streams under way finish, for
        ``sleep.SLEEP_DRAIN_S`` at most, then go on elsewhere), then vLLM's
        ``/sleep?level=N``. ``["shards"]`` says per shard how it went (``error`` empty when
        it sleeps)."""
        body: dict[str, Any] = {"level": level}
        if shards is not None:
            body["shards"] = shards
        result: dict[str, Any] = self._call("POST", "/admin/sleep", body)
        return result

    def wake(self, shards: list[int] | None = None) -> dict[str, Any]:
        """Wake the sleeping engines (all by default); each serves again, as it was before it
        slept, once it says it is awake. Routers know before this returns."""
        body: dict[str, Any] = {} if shards is None else {"shards": shards}
        result: dict[str, Any] = self._call("POST", "/admin/wake", body)
        return result

    # ------------------------------------------------------------------ operator actions

    def retire(self, shard: int, reason: str = "") -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/admin/shards/{shard}/retire",
                                            {"reason": reason})
        return result

    def restart(self, shard: int, reason: str = "") -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/admin/shards/{shard}/restart",
                                            {"reason": reason})
        return result

    def chaos(self, shard: int, fault: str, **options: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/admin/shards/{shard}/chaos",
                                            {"fault": fault, **options})
        return result

    def report_outcomes(self, outcomes: dict[str, tuple[int, int, int]]) -> int:
        """For an external router: hand over one drained window of outcomes."""
        result = self._call("POST", "/admin/outcomes",
                            {"outcomes": {u: list(c) for u, c in outcomes.items()}})
        return int(result["accepted"])
