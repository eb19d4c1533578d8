"""Nothing left behind: every engine `fleetwarden demo` started is stopped,
whatever way the demo ends: an exception in the story, SIGTERM (a test's timeout, a cancelled
CI job), even SIGKILL. On simulated engines; the real-engine demo uses the same path."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fleetwarden import demo
from support.wait import wait_until

pytestmark = pytest.mark.scenario

MARK = "FLEETWARDEN_TEST_MARK"


def marked(mark: str, but: int | None = None) -> list[int]:
    """Live processes that inherited ``MARK=mark`` (the engines the demo started)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), but):
            continue
        try:
            env = Path(f"/proc/{entry.name}/environ").read_bytes()
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_an_exception_in_the_story_stops_every_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    seen: list[int] = []

    async def broken(self: demo.Story) -> None:
        seen.extend(marked(mark))
        raise RuntimeError("an act that cannot be played")

    monkeypatch.setattr(demo.Story, "play", broken)
    try:
        with pytest.raises(RuntimeError, match="cannot be played"):
            await demo.run_demo(quick=True, report_dir=tmp_path / "report", live=False)
        assert len(seen) >= 3  # the engines were up when the story failed
        assert marked(mark) == []
    finally:
        kill_all(marked(mark))


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_demo_ended_by_a_signal_leaves_no_engine(tmp_path: Path, how: signal.Signals) -> None:
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetwarden", "demo", "--quick", "--no-live",
         "--report", str(tmp_path / "report")],
        cwd=tmp_path, env={**os.environ, MARK: mark},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: len(marked(mark, but=proc.pid)) >= 3, 60, "three engines up")
        proc.send_signal(how)
        proc.wait(timeout=60)
        if how is signal.SIGTERM:
            assert proc.returncode == 1
        wait_until(lambda: marked(mark, but=proc.pid) == [], 30, "every engine gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(marked(mark))
