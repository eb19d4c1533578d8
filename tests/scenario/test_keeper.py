"""The keeper (launchers.keeper): the process that owns a Ray engine's process group, without
Ray. Each test starts a real keeper around a small shell "engine" and reads what it says.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetwarden.launchers import keeper
from fleetwarden.launchers.procs import group_members, process_info
from support.wait import wait_until

#: A loaded 2-core machine may take seconds to start a Python process.
_WAIT_S = 30.0


class Keeper:
    def __init__(self, log: Path, command: list[str], grace: float = 5.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwarden.launchers.keeper", "--grace", str(grace),
             "--kill-wait", "5", "--log", str(log), "--", *command],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.first_exit = self.proc.wait(_WAIT_S)  # the keeper detaches: its caller returns
        self.started = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            assert sel.select(_WAIT_S), "the keeper said nothing"
        line = self.proc.stdout.readline()
        assert line, "the keeper closed its output without a word"
        event: dict[str, Any] = json.loads(line)
        return event

    @property
    def pgid(self) -> int:
        pid: int = self.started["pid"]
        return pid

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()


def live(pid: int) -> bool:
    info = process_info(pid)
    return info is not None and info.state not in "ZX"


@pytest.fixture
def keepers(tmp_path: Path) -> Iterator[Callable[..., Keeper]]:
    started: list[Keeper] = []

    def start(command: list[str], grace: float = 5.0) -> Keeper:
        keeper = Keeper(tmp_path / "engine.log", command, grace)
        started.append(keeper)
        return keeper

    yield start
    for k in started:  # whatever a failed test left: only what these keepers started
        for pid in [m.pid for m in group_members(k.started.get("pid", -1))]:
            os.kill(pid, signal.SIGKILL)
        keeper_pid = k.started.get("keeper_pid")
        if keeper_pid and live(keeper_pid):
            os.kill(keeper_pid, signal.SIGKILL)


#: An engine with a child in its group, as vLLM's API server has its EngineCore.
TWO = ["sh", "-c", "sleep 300 & exec sleep 300"]


def test_the_keeper_detaches_and_runs_the_engine_in_a_group_of_its_own(
        keepers: Callable[..., Keeper]) -> None:
    k = keepers(TWO)
    assert k.first_exit == 0 and k.started["event"] == "started"
    keeper = process_info(k.started["keeper_pid"])
    engine = process_info(k.pgid)
    assert keeper is not None and engine is not None
    assert keeper.pid != k.proc.pid and keeper.ppid != os.getpid()  # no child of its caller
    assert keeper.sid == keeper.pid  # a session of its own: no signal to ours reaches it
    assert engine.pgid == engine.pid != keeper.pgid  # the engine leads its own group
    assert engine.start_ticks == k.started["start_ticks"]
    wait_until(lambda: len(group_members(k.pgid)) == 2, _WAIT_S, "the engine's child started")


def test_the_keeper_stops_the_whole_group_when_its_owner_is_gone(
        keepers: Callable[..., Keeper]) -> None:
    k = keepers(TWO)
    wait_until(lambda: len(group_members(k.pgid)) == 2, _WAIT_S, "the engine's child started")
    k.close_stdin()  # what a killed Ray actor's pipe does
    end = k.read()
    assert end["event"] == "ended" and end["why"] == "owner gone", end
    assert end["left"] == [] and group_members(k.pgid) == []
    assert end["code"] == -signal.SIGTERM
    wait_until(lambda: not live(k.started["keeper_pid"]), _WAIT_S, "the keeper exited")


def test_a_stop_kills_a_group_that_ignores_sigterm(keepers: Callable[..., Keeper]) -> None:
    k = keepers(["sh", "-c", "trap '' TERM; sleep 300 & wait"], grace=0.5)
    wait_until(lambda: len(group_members(k.pgid)) == 2, _WAIT_S, "the engine's child started")
    k.stop()
    end = k.read()
    assert end["why"] == "stop" and end["killed"] is True and end["left"] == [], end
    assert group_members(k.pgid) == []


def test_an_engine_that_exits_takes_what_it_left_in_its_group_with_it(
        keepers: Callable[..., Keeper]) -> None:
    # the leader exits with 3 and leaves a child behind, as a killed vLLM API server leaves
    # its EngineCore
    k = keepers(["sh", "-c", "sleep 300 & sleep 0.5; exit 3"])
    end = k.read()
    assert end["why"] == "exited" and end["code"] == 3 and end["left"] == [], end
    assert group_members(k.pgid) == []


def test_sigterm_to_the_keeper_stops_the_group(keepers: Callable[..., Keeper]) -> None:
    k = keepers(TWO)
    os.kill(k.started["keeper_pid"], signal.SIGTERM)
    end = k.read()
    assert end["why"] == "signalled" and end["left"] == [], end
    assert group_members(k.pgid) == []


def test_an_engine_that_cannot_start_is_reported(tmp_path: Path) -> None:
    k = Keeper(tmp_path / "engine.log", ["/nonexistent/engine"])
    assert k.started["event"] == "failed" and "/nonexistent/engine" in k.started["error"]


def test_the_sigterm_handler_never_waits_on_a_lock_the_main_thread_may_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python runs a signal handler in the main thread between two bytecodes, maybe while
    that thread holds the lock of the queue it waits on: a handler that put into a
    ``queue.Queue`` (whose lock is not reentrant) would wait on itself for ever. The keeper's
    handler must put without a lock (``queue.SimpleQueue``, documented reentrant)."""
    handlers: dict[int, Any] = {}
    monkeypatch.setattr(keeper.signal, "signal", lambda sig, h: handlers.__setitem__(sig, h))
    # No engine: the keeper installs its handlers, fails to start it, and returns.
    assert keeper.main(["--grace", "1", "--kill-wait", "1", "--log", str(tmp_path / "log"),
                        "--no-detach", "--", str(tmp_path / "no-such-engine")]) == 1
    handler = handlers[signal.SIGTERM]
    [events] = [c.cell_contents for c in handler.__closure__ or ()]
    lock = getattr(events, "mutex", None)  # what the main thread holds inside get()
    if lock is not None:
        lock.acquire()
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (handler(signal.SIGTERM, None), done.set()),
                         daemon=True).start()
        assert done.wait(_WAIT_S / 10), "the handler waited on the queue's lock"
    finally:
        if lock is not None:
            lock.release()
    assert events.get_nowait() == (keeper.SIGNALLED, None)
