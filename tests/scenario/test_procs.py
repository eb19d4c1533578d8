"""The /proc helpers on ordinary processes: ``sleep`` children in sessions of their own.

Each test starts its own group and its fixture kills that group (and only it) however the
test ends. Waits poll the process's state; none sleeps a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetwarden.launchers import procs
from support.wait import wait_until

GroupStarter = Callable[[str], subprocess.Popen[bytes]]


def member_count(pgid: int, n: int) -> Callable[[], bool]:
    return lambda: len(procs.group_members(pgid)) == n


@pytest.fixture
def start_group() -> Iterator[GroupStarter]:
    """Start ``bash -c SCRIPT`` in a new session; kill every group started, at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(script: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["bash", "-c", script], start_new_session=True,
                             stdin=subprocess.DEVNULL)
        started.append(p)
        return p

    yield start
    for p in started:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_a_new_session_is_one_group_and_its_members_are_listed(
        start_group: GroupStarter) -> None:
    leader = start_group("sleep 60 & sleep 61 & wait")
    # three members, and both children past their exec (a forked child is "bash" until then:
    # under make test's load a count of three came before the second exec)
    wait_until(lambda: sorted(m.comm for m in procs.group_members(leader.pid))
          == ["bash", "sleep", "sleep"])
    members = procs.group_members(leader.pid)
    assert members[0].pid == leader.pid
    assert {m.comm for m in members} == {"bash", "sleep"}
    assert all(m.pgid == m.sid == leader.pid for m in members)
    assert [m.cmdline for m in members if m.comm == "sleep"] == [("sleep", "60"), ("sleep", "61")]
    assert procs.group_members(os.getpgrp()) != members  # other groups stay out


def test_a_member_is_found_by_its_title_or_by_its_kernel_name(
        start_group: GroupStarter) -> None:
    # vLLM's setproctitle rewrites the command line to "VLLM::EngineCore" and the kernel keeps
    # its first 15 bytes as comm; these children have one of the two each.
    titled = start_group("exec -a VLLM::EngineCore sleep 60")
    renamed = start_group(
        f"exec {sys.executable} -c \"open('/proc/self/comm', 'w').write('VLLM::EngineCor'); "
        "import time; time.sleep(60)\"")
    wait_until(lambda: procs.find_group_member(titled.pid, "VLLM::EngineCore") is not None)
    wait_until(lambda: procs.find_group_member(renamed.pid, "VLLM::EngineCore") is not None)

    by_title = procs.find_group_member(titled.pid, "VLLM::EngineCore")
    assert by_title is not None
    assert by_title.cmdline == ("VLLM::EngineCore", "60") and by_title.comm == "sleep"
    by_comm = procs.find_group_member(renamed.pid, "VLLM::EngineCore")
    assert by_comm is not None and by_comm.comm == "VLLM::EngineCor"
    assert procs.find_group_member(titled.pid, "VLLM::Worker") is None


def test_start_time_is_field_22_and_matches_the_clock(start_group: GroupStarter) -> None:
    before = time.time()
    p = start_group("exec sleep 60")
    ticks = procs.process_start_ticks(p.pid)
    assert ticks is not None
    fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(fields[22 - 3]) == ticks
    started = procs.process_start_time(p.pid)
    assert started is not None and before - 1.0 <= started <= time.time() + 1.0
    assert procs.process_start_ticks(p.pid) == ticks  # stable for the life of the process


def test_a_process_that_is_gone_reads_as_none() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert procs.process_info(p.pid) is None
    assert procs.process_start_ticks(p.pid) is None
    assert procs.group_members(p.pid) == []


def test_a_zombie_is_not_a_member(start_group: GroupStarter) -> None:
    # The child exits and its parent (a sleeping shell that never waits) leaves it a zombie.
    # It exits only once its parent has become `sleep`: exiting earlier, the shell would reap
    # it before the exec and no zombie would ever appear (seen once in a full run).
    leader = start_group("sh -c 'until [ \"$(cat /proc/$PPID/comm)\" = sleep ]; do "
                         "sleep 0.01; done' & exec sleep 60")
    # The zombie is the shell, the leader's child (not one of the shell's own short-lived
    # children, which it reaps itself).
    wait_until(lambda: any(p.state == "Z" and p.ppid == leader.pid
                      for p in _all_in_group(leader.pid)))
    assert [m.comm for m in procs.group_members(leader.pid)] == ["sleep"]


def test_stop_continue_and_kill_reach_only_the_named_member(start_group: GroupStarter) -> None:
    leader = start_group("(exec -a VLLM::EngineCore sleep 60) & sleep 61 & wait")
    wait_until(lambda: procs.find_group_member(leader.pid, "VLLM::EngineCore") is not None)

    core = procs.signal_group_member(leader.pid, "VLLM::EngineCore", signal.SIGSTOP)
    wait_until(lambda: _state(core.pid) == "T")
    others = [m for m in procs.group_members(leader.pid) if m.pid != core.pid]
    assert others and not any(m.stopped for m in others)

    procs.signal_group_member(leader.pid, "VLLM::EngineCore", signal.SIGCONT)
    wait_until(lambda: _state(core.pid) not in ("T", "t"))

    procs.signal_group_member(leader.pid, "VLLM::EngineCore", signal.SIGKILL)
    wait_until(lambda: procs.find_group_member(leader.pid, "VLLM::EngineCore") is None)
    assert len(procs.group_members(leader.pid)) == 2  # the shell and the other sleep live on
    with pytest.raises(ProcessLookupError, match="VLLM::EngineCore"):
        procs.signal_group_member(leader.pid, "VLLM::EngineCore", signal.SIGKILL)


def test_a_signal_for_a_process_that_started_at_another_time_is_not_sent(
        start_group: GroupStarter) -> None:
    p = start_group("exec sleep 60")
    info = procs.process_info(p.pid)
    assert info is not None
    # The PID-reuse guard: same pid, other start time, so another process.
    assert not procs.signal_process(p.pid, info.start_ticks + 1, signal.SIGKILL)
    assert procs.process_info(p.pid) is not None
    assert procs.signal_process(p.pid, info.start_ticks, signal.SIGKILL)
    p.wait(timeout=5)
    assert not procs.signal_process(p.pid, info.start_ticks, signal.SIGKILL)


def test_killing_the_leader_alone_orphans_the_rest_and_the_group_stop_ends_them(
        start_group: GroupStarter) -> None:
    # The vLLM pitfall in miniature: SIGKILL of the API server leaves its engine processes.
    leader = start_group("sleep 60 & sleep 61 & wait")
    wait_until(member_count(leader.pid, 3))
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait(timeout=5)
    wait_until(member_count(leader.pid, 2))
    assert {m.ppid for m in procs.group_members(leader.pid)} != {leader.pid}

    stop = procs.terminate_group(leader.pid, grace_s=5.0)
    assert stop.clean and not stop.killed and stop.members_at_start == 2
    assert procs.group_members(leader.pid) == []


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(
        start_group: GroupStarter) -> None:
    leader = start_group("trap '' TERM; sleep 60 & sleep 61 & wait")
    wait_until(member_count(leader.pid, 3))
    stop = procs.terminate_group(leader.pid, grace_s=0.3)
    assert stop.killed and stop.clean and stop.seconds >= 0.3
    assert procs.group_members(leader.pid) == []


def test_a_stopped_group_still_ends_on_sigterm(start_group: GroupStarter) -> None:
    leader = start_group("exec sleep 60")
    os.killpg(leader.pid, signal.SIGSTOP)
    wait_until(lambda: _state(leader.pid) == "T")
    stop = procs.terminate_group(leader.pid, grace_s=5.0)
    assert stop.clean and not stop.killed


def test_stopping_an_empty_group_does_nothing() -> None:
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    stop = procs.terminate_group(p.pid, grace_s=5.0)
    assert stop.clean and stop.members_at_start == 0 and not stop.killed


def test_a_command_line_with_parentheses_and_spaces_parses() -> None:
    info = procs._parse(42, b"42 (a) b (c)) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 "
                            b"12345 1000 10 0\n", b"a) b\0x\0")
    assert info is not None
    assert (info.comm, info.state, info.ppid, info.pgid, info.start_ticks) == (
        "a) b (c)", "S", 1, 42, 12345)
    assert info.cmdline == ("a) b", "x") and info.is_named("a) b")


def _state(pid: int) -> str:
    info = procs.process_info(pid)
    return info.state if info else "gone"


def _all_in_group(pgid: int) -> list[procs.ProcessInfo]:
    # Zombies included: what group_members deliberately leaves out.
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = procs.process_info(int(entry))
            if info and info.pgid == pgid:
                found.append(info)
    return found
