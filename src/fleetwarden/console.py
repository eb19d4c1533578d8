"""How a fleet looks in a terminal: the table `fleetwarden up` keeps live and `status` prints."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

__all__ = ["STATE_STYLE", "fleet_view"]

STATE_STYLE = {
    "HEALTHY": "bold green", "SUSPECT": "bold yellow", "STALE": "bold cyan",
    "SLEEPING": "bold blue", "DEAD": "bold red", "RESTARTING": "bold magenta", "RETIRED": "dim",
}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(max(0.0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _short(url: str) -> str:
    """``http://127.0.0.1:8123`` -> ``:8123``: loopback engines differ only by port."""
    for prefix in ("http://127.0.0.1", "http://localhost"):
        if url.startswith(prefix):
            return url[len(prefix):] or url
    return url.removeprefix("http://")


def fleet_view(status: dict[str, Any], shards: list[dict[str, Any]],
               transitions: list[dict[str, Any]] | None = None) -> Group:
    """A status line, a table with one row per shard, and the last transitions."""
    state = status.get("status", "?")
    colour = {"serving": "green", "degraded": "yellow", "asleep": "blue", "down": "red",
              "exhausted": "red"}.get(state, "white")
    head = Text.assemble(("fleet ", "bold"), (state, f"bold {colour}"),
                         f"  {status.get('detail', '')}  ·  router {status.get('router_url', '')}"
                         f"  ·  tick {status.get('tick', 0)}")
    table = Table(expand=False, pad_edge=False)
    for col, hint in (("#", "shard"), ("state", ""), ("engine", ""),
                      ("kind", "engine profile (fleetwarden.engines)"), ("age", ""),
                      ("infl", "router in-flight"), ("run/wait", ""), ("tok/s", ""),
                      ("verdict", ""), ("p/r", "failed probes / failed request windows"),
                      ("restarts", "spent/budget"), ("w", "weight version"),
                      ("last error", "")):
        table.add_column(col, overflow="ellipsis", no_wrap=col != "last error")
        del hint
    now = time.time()
    for s in shards:
        wd = s.get("watchdog") or {}
        sample = wd.get("sample") or {}
        run_wait = (f"{sample['running']:.0f}/{sample['waiting']:.0f}"
                    if "running" in sample else "—")
        tps = wd.get("tokens_per_s")
        started = s.get("incarnation_started_at")
        table.add_row(
            str(s["index"]), Text(s["state"], style=STATE_STYLE.get(s["state"], "")),
            _short(s["base_url"]), wd.get("engine") or "—",
            _age(now - started if started else None),
            str(s["in_flight"]),
            run_wait, "—" if tps is None else f"{tps:.0f}", (wd.get("verdict") or "—"),
            f"{s['consecutive_probe_failures']}/{s['consecutive_reported_failures']}",
            f"{s['restart_attempts']}/{s['restart_attempts'] + s['restart_budget_left']}",
            str(s["weight_version"]), (s.get("last_error") or "")[:80],
        )
    parts: list[Any] = [head, table]
    if transitions:
        lines = Text()
        for t in transitions[-6:]:
            when = time.strftime("%H:%M:%S", time.localtime(t["wall"]))
            lines.append(f"{when}  shard {t['shard']}  ")
            lines.append(t["from"], style=STATE_STYLE.get(t["from"], ""))
            lines.append(" → ")
            lines.append(t["to"], style=STATE_STYLE.get(t["to"], ""))
            lines.append(f"  {t['cause'][:90]}\n")
        parts.append(lines)
    return Group(*parts)
