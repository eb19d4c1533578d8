"""How a fleet looks in a terminal: the table `fleetwarden up` keeps live and `status` prints.

Owns: the terminal rendering of the admin views (a status line, the shard table, the last
transitions), and which columns give way in a narrow terminal (:data:`COLUMNS`).

Must not: read a fleet: it renders the JSON views it is given (``admin/views.py``'s shape,
whether from ``fleet.snapshot()`` or from the admin API).
"""

from __future__ import annotations

import time
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

__all__ = ["ALWAYS", "COLUMNS", "STATE_STYLE", "ShardTable", "fleet_view"]

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


#: The table's columns, most important first: (header, what it shows). When the terminal is
#: too narrow for all of them, columns are dropped from the end of this list until the table
#: fits, so that state, engine URL, in-flight and verdict always read whole (80 columns
#: with local engines keep them, the last error and the restarts).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("#", "shard"), ("state", ""), ("engine", "URL (loopback: its port)"),
    ("infl", "router in-flight"), ("verdict", "the watchdog's last"),
    ("last error", ""), ("restarts", "spent/budget"),
    ("kind", "engine profile (fleetwarden.engines)"),
    ("p/r", "failed probes / failed request windows"), ("run/wait", "running/waiting"),
    ("tok/s", "output tokens per second"), ("age", "of the engine's process"),
    ("w", "weight version"),
)
#: Columns never dropped, and never cut: each cell reads whole.
ALWAYS = frozenset({"#", "state", "engine", "infl", "verdict"})
#: The last error may wrap, but is never narrower than this.
_ERROR_MIN_WIDTH = 16


def _cells(s: dict[str, Any], now: float) -> dict[str, str | Text]:
    wd = s.get("watchdog") or {}
    sample = wd.get("sample") or {}
    tps = wd.get("tokens_per_s")
    started = s.get("incarnation_started_at")
    return {
        "#": str(s["index"]),
        "state": Text(s["state"], style=STATE_STYLE.get(s["state"], "")),
        "engine": _short(s["base_url"]),
        "infl": str(s["in_flight"]),
        "verdict": wd.get("verdict") or "—",
        "last error": (s.get("last_error") or "")[:80],
        "restarts": f"{s['restart_attempts']}/{s['restart_attempts'] + s['restart_budget_left']}",
        "kind": wd.get("engine") or "—",
        "p/r": f"{s['consecutive_probe_failures']}/{s['consecutive_reported_failures']}",
        "run/wait": (f"{sample['running']:.0f}/{sample['waiting']:.0f}"
                     if "running" in sample else "—"),
        "tok/s": "—" if tps is None else f"{tps:.0f}",
        "age": _age(now - started if started else None),
        "w": str(s["weight_version"]),
    }


def _width(col: str, rows: list[dict[str, str | Text]]) -> int:
    """The width a column needs to show its header and every cell whole."""
    if col == "last error":
        return _ERROR_MIN_WIDTH  # it wraps: this is its least
    return max(cell_len(col), *(cell_len(str(row[col])) for row in rows))


def _table_width(widths: list[int]) -> int:
    # a border before each column and after the last; one space of padding on either side
    # of each cell, but none at the table's outer edges (pad_edge=False)
    return sum(widths) + 3 * len(widths) - 1


def _table(rows: list[dict[str, str | Text]], headers: list[str]) -> Table:
    table = Table(expand=False, pad_edge=False)
    for col in headers:
        if col == "last error":
            table.add_column(col, overflow="fold", min_width=_ERROR_MIN_WIDTH)
        else:  # held at its full width: rich never cuts it
            table.add_column(col, no_wrap=True, min_width=_width(col, rows))
    for row in rows:
        table.add_row(*(row[col] for col in headers))
    return table


class ShardTable:
    """One row per shard, with as many columns as the width allows (see :data:`COLUMNS`)."""

    def __init__(self, shards: list[dict[str, Any]], now: float | None = None) -> None:
        when = time.time() if now is None else now
        self.rows = [_cells(s, when) for s in shards]

    def columns_for(self, width: int) -> list[str]:
        """The columns that fit in ``width``: the first of :data:`COLUMNS`, as many as fit
        (the ones in :data:`ALWAYS` lead the list, so they are the last to go: never)."""
        headers = [col for col, _ in COLUMNS]
        widths = [_width(col, self.rows) for col in headers]
        while len(headers) > len(ALWAYS) and _table_width(widths) > width:
            headers, widths = headers[:-1], widths[:-1]
        return headers

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield _table(self.rows, self.columns_for(options.max_width))


def fleet_view(status: dict[str, Any], shards: list[dict[str, Any]],
               transitions: list[dict[str, Any]] | None = None) -> Group:
    """A status line, a table with one row per shard, and the last transitions."""
    state = status.get("status", "?")
    colour = {"serving": "green", "degraded": "yellow", "asleep": "blue", "down": "red",
              "exhausted": "red"}.get(state, "white")
    head = Text.assemble(("fleet ", "bold"), (state, f"bold {colour}"),
                         f"  {status.get('detail', '')}  ·  router {status.get('router_url', '')}"
                         f"  ·  tick {status.get('tick', 0)}")
    parts: list[Any] = [head, ShardTable(shards)]
    faults = Text()
    for s in shards:
        for fault in s.get("config_faults") or ():
            # Loud: never held against the engine, so no state shows it.
            faults.append(f"shard {s['index']}  config fault  ", style="bold red")
            faults.append(f"{fault}\n")
    if faults:
        parts.append(faults)
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
