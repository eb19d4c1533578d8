"""``fleetwarden status`` in a terminal: state, engine URL, in-flight and verdict always read
whole; the other columns give way, by priority, when the terminal is narrow."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from fleetwarden.console import ALWAYS, COLUMNS, fleet_view

STATUS = {"status": "degraded", "detail": "3 of 4 shards serve", "router_url":
          "http://127.0.0.1:8080", "tick": 412}


def shard(i: int, state: str, url: str, in_flight: int, verdict: str | None,
          error: str = "") -> dict[str, Any]:
    return {
        "index": i, "state": state, "base_url": url, "in_flight": in_flight,
        "watchdog": None if verdict is None else {
            "verdict": verdict, "tokens_per_s": 1785.2,
            "sample": {"running": 12.0, "waiting": 3.0}},
        "incarnation_started_at": None, "last_error": error,
        "consecutive_probe_failures": 2, "consecutive_reported_failures": 11,
        "restart_attempts": 3, "restart_budget_left": 2, "weight_version": 17,
    }


#: The widest values each kept column can hold: the longest state and verdict, a remote URL,
#: a three-digit in-flight count, and a long error.
SHARDS = [
    shard(0, "HEALTHY", "http://127.0.0.1:8101", 7, "busy"),
    shard(1, "RESTARTING", "http://10.20.30.40:8000", 128, "unreachable",
          "unreachable: cannot connect: Connection refused (3 probes in a row)"),
    shard(2, "SUSPECT", "http://engine-2.fleet.internal:8000", 0, "no-metrics"),
    shard(3, "STALE", "http://127.0.0.1:8104", 3, None),
]
TRANSITIONS = [{"wall": 1764447672.4, "shard": 1, "from": "HEALTHY", "to": "DEAD",
                "cause": "STUCK: 2 running, 0 waiting; nothing advanced on 4 reads over 2.1 s"}]


#: A fleet of local engines: every URL is a loopback port.
LOCAL = [shard(i, s["state"], f"http://127.0.0.1:81{i:02d}", s["in_flight"],
               (s["watchdog"] or {}).get("verdict"), s["last_error"]) for i, s in enumerate(SHARDS)]


def render(width: int, shards: list[dict[str, Any]] = SHARDS) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, highlight=False)
    console.print(fleet_view(STATUS, shards, TRANSITIONS))
    out = console.file.getvalue()
    assert isinstance(out, str)
    return out


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "│" in line or "┃" in line]


def row_of(lines: list[str], url: str) -> str:
    (row,) = [line for line in lines if url in line]
    return row


@pytest.mark.parametrize("width", [80, 100])
def test_state_url_in_flight_and_verdict_read_whole(width: int) -> None:
    text = render(width)
    lines = table_lines(text)
    assert all(len(line) <= width for line in text.splitlines())
    header = lines[0]
    assert {"state", "engine", "infl", "verdict"} <= {c.strip() for c in header.split("┃")}
    for s in SHARDS:
        short = s["base_url"].removeprefix("http://127.0.0.1").removeprefix("http://")
        cells = [c.strip() for c in row_of(lines, short).split("│")]
        verdict = (s["watchdog"] or {}).get("verdict") or "—"
        # each a whole cell, on the row's first line
        assert {short, s["state"], str(s["in_flight"]), verdict} <= set(cells), cells
    assert "…" not in "".join(lines)  # nothing cut: what does not fit is left out whole


def shown(text: str) -> list[str]:
    header = table_lines(text)[0].replace("┃", " ")
    return [col for col, _ in COLUMNS if f" {col} " in header]


@pytest.mark.parametrize("shards", [SHARDS, LOCAL], ids=["remote URLs", "local engines"])
def test_at_80_columns_the_least_needed_columns_give_way(shards: list[dict[str, Any]]) -> None:
    cols = shown(render(80, shards))
    assert set(ALWAYS) <= set(cols) and len(cols) < len(COLUMNS)
    assert cols == [col for col, _ in COLUMNS][: len(cols)]  # dropped from the end only


def test_local_engines_at_80_columns_keep_the_last_error_and_the_restarts() -> None:
    assert {"last error", "restarts"} <= set(shown(render(80, LOCAL)))


def test_a_wide_terminal_shows_every_column() -> None:
    assert shown(render(200)) == [col for col, _ in COLUMNS]


def test_the_columns_that_always_stay_lead_the_priority_list() -> None:
    assert {col for col, _ in COLUMNS[: len(ALWAYS)]} == ALWAYS


def test_a_configuration_fault_is_a_line_of_its_own_under_the_table() -> None:
    """Never held against the engine, so no state shows it: `status` says it in words."""
    fault = ("GET /v1/models answered 401: the engine wants an API key fleetwarden did not "
             "send, or refuses the one it sent: set api_key_file or api_key_env for it")
    shards = [{**SHARDS[0], "config_faults": [fault]}, *SHARDS[1:]]
    text = render(200, shards)
    assert f"shard 0  config fault  {fault}" in text
    assert "config fault" not in render(200)
