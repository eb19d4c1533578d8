"""RouterWorkers' bookkeeping across a reload, with stand-in links and processes: no process
is started, no socket opened."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetwarden.config import RouterConfig
from fleetwarden.launchers.routers import RouterRecord, RouterWorkers, _Process

OLD, NEW = "http://127.0.0.1:1001", "http://127.0.0.1:1002"


def _process(control_url: str) -> _Process:
    return _Process(RouterRecord(worker=0, launch_id=control_url[-4:], url="http://x:1",
                                 control_url=control_url, pid=0, pgid=0, proc_start_ticks=None,
                                 log_path="", launched_at=0.0), None)


class _Link:
    """A worker slot whose worker answers its status with its own request count."""

    worker = 0

    def __init__(self) -> None:
        self.url = OLD
        self.requests = {OLD: 5, NEW: 1}

    async def status(self) -> dict[str, Any]:
        return {"stats": {"requests": self.requests[self.url]}}

    async def metrics_text(self) -> str:
        return ""


async def test_a_reload_keeps_the_old_workers_totals_and_counts_the_new_ones_once(
    tmp_path: Path,
) -> None:
    """The status read that comes while the new worker starts reads the new one: the old
    one's totals retired at the end of the reload are its own, not the new one's."""
    workers = RouterWorkers(RouterConfig(port=0, workers=1), "token", tmp_path / "token",
                            tmp_path / "logs")
    link = _Link()
    workers.links[0] = link  # type: ignore[assignment]
    workers._procs[0] = _process(OLD)
    await workers.statuses.read(workers.links)
    assert workers.stats.requests == 5

    async def replace(worker: int, take_from: Sequence[str]) -> None:
        workers._procs[worker] = _process(NEW)
        link.url = NEW
        await workers.statuses.read(workers.links)  # the status loop, while the reload goes on

    async def nothing(*_: object) -> None:
        return None

    workers._replace = replace  # type: ignore[method-assign]
    workers._stop_accepting = nothing  # type: ignore[method-assign]
    workers._drain = lambda old: None  # type: ignore[method-assign]
    await workers._reload()
    assert workers.stats.requests == 5 + 1
    await workers.statuses.read(workers.links)
    assert workers.stats.requests == 5 + 1
