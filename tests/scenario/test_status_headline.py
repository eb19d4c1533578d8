"""`fleetwarden status` through a crash: the headline and the rows are one snapshot, and the
headline counts what the rows show, in the ledger's terms (serving, coming back, out); so does
`status --json` (docs/operations.md, "Status, history and chaos")."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetwarden.cli import app
from fleetwarden.console import STATE_STYLE
from fleetwarden.ledger import ShardState, tally
from support.fleet import running_fleet

pytestmark = pytest.mark.scenario

#: Reads at most, and seconds at most: the crash, the restart and the shard back HEALTHY
#: take a few seconds at the test fleet's timings.
MAX_READS = 400
LIMIT_S = 60.0


def agrees(status: dict[str, object], states: list[str]) -> None:
    """The headline (``status``) says what the rows (``states``) show."""
    told = tally(ShardState(s) for s in states)
    n, serving, detail = len(states), told["serving"], str(status["detail"])
    assert status["tally"] == told, (status, states)
    assert status["counts"] == {s.value: states.count(s.value) for s in ShardState}
    assert status["status"] == ("serving" if serving == n else "degraded" if serving
                                else "down"), (status, states)
    expected = (f"all {n} shards serve" if serving == n else
                f"{serving} of {n} shards serve" if serving else "no shard serves")
    assert detail.startswith(expected), (detail, states)
    for words, count in (("coming back", told["coming_back"]), ("out", told["out"])):
        assert (f"{count} {words}" in detail) == bool(count), (detail, states)


async def test_the_status_headline_agrees_with_its_rows_through_a_crash(tmp_path: Path) -> None:
    runner = CliRunner()
    async with running_fleet(tmp_path) as fleet:
        where = ["--admin", fleet.admin.url, "--token-file", str(tmp_path / "admin.token")]

        async def status(*extra: str) -> str:
            # wide enough that the headline is one line
            result = await asyncio.to_thread(runner.invoke, app, ["status", *where, *extra],
                                             env={"COLUMNS": "200"})
            assert result.exit_code == 0, result.output
            return result.stdout

        old = fleet.ledger.shard(0).incarnation
        await fleet.inject_fault(0, "crash", {})
        started, seen, reads = time.monotonic(), Counter[str](), 0
        while reads < MAX_READS and time.monotonic() - started < LIMIT_S:
            view = json.loads(await status("--json"))
            states = [row["state"] for row in view["shards"]]
            agrees(view["status"], states)
            # the text: the headline line and the table's rows, one read
            lines = (await status()).splitlines()
            rows = [line for line in lines if "│" in line]
            shown = [name for row in rows for name in STATE_STYLE if f" {name} " in row]
            assert len(shown) == len(states), lines
            in_text = tally(ShardState(s) for s in shown)
            head = lines[0]
            if in_text["serving"] == len(shown):
                assert f"all {len(shown)} shards serve" in head, lines
            else:
                assert f"{in_text['serving']} of {len(shown)} shards serve" in head \
                    or "no shard serves" in head, lines
                assert f"{in_text['coming_back']} coming back" in head, lines
            reads += 1
            seen.update(states[:1])
            if states[0] == "HEALTHY" and len(seen) > 1:
                break  # it left and came back
        print(f"\n{reads} reads (json and text each) in {time.monotonic() - started:.1f} s; "
              f"shard 0 seen {dict(seen)}")
        assert len(seen) > 1 and states[0] == "HEALTHY", seen  # it left, and came back
        assert fleet.ledger.shard(0).incarnation != old
