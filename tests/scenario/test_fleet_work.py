"""The fleet's own work (``workmeter.py``) where an operator looks: the fleet's /metrics, the
dashboard's snapshot, and the journal's run summary (``fleetwarden history --summary``)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from fleetwarden.admin import dashboard
from fleetwarden.journal import Journal
from support.fleet import running_fleet, until

pytestmark = pytest.mark.scenario

FAMILIES = ("fleetwarden_tick_seconds_count", "fleetwarden_read_round_seconds_count",
            "fleetwarden_evidence_to_decision_seconds_count", "fleetwarden_push_seconds_count",
            "fleetwarden_push_backends_sum", "fleetwarden_engine_reads_total",
            "fleetwarden_engine_reads_per_second")


def sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert lines, f"{name} not on /metrics"
    return float(lines[0].split()[1])


async def history_summary(journal: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "history", "--journal", str(journal), "--summary",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_the_fleets_own_work_is_on_metrics_the_dashboard_and_the_journal(
        tmp_path: Path) -> None:
    journal = tmp_path / "fleet.sqlite"
    async with running_fleet(tmp_path) as fleet:
        # before any run stopped, there is no summary to show, and the command says so
        code, out = await history_summary(journal)
        assert code == 1 and "no run summary" in out
        # The reads run beside the ticks: three of each, not three ticks alone.
        await until(lambda: fleet.controller.tick_number >= 3
                    and fleet.controller.meter.read_round.count >= 3, 30,
                    "three ticks and three read rounds")
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {fleet.admin.token}"}) as http, \
                http.get(fleet.admin_url + "/metrics") as resp:
            text = await resp.text()
        for name in FAMILIES:
            sample(text, name)
        assert sample(text, "fleetwarden_tick_seconds_count") >= 2  # the third may be under way
        assert sample(text, "fleetwarden_engine_reads_total") >= 4  # two engines a round
        assert sample(text, "fleetwarden_push_backends_sum") >= 4
        work = dashboard.snapshot(fleet, fleet.admin)["work"]
        assert work["tick_s"]["count"] >= 2 and work["tick_s"]["p99"] is not None
        assert work["reads_per_s"] is not None and work["reads_per_s"] > 0
        ticks = fleet.controller.tick_number
    with Journal(journal) as j:
        summary = j.run_summary()
    assert summary is not None
    assert summary["shards"] == 2 and summary["ticks"] >= ticks
    assert summary["work"]["read_round_s"]["count"] >= 3
    assert summary["work"]["evidence_to_decision_s"]["count"] >= 6
    code, out = await history_summary(journal)
    assert code == 0 and json.loads(out) == summary
