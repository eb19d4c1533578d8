"""The compute-only wedge's mechanism, on a real two-thread process (a small C program built
with the machine's gcc): the busiest non-main thread is stopped while the main thread answers,
and runs on when released. Needs ptrace rights (root, as this project's machines and CI run)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from fleetwarden.launchers.threadstop import busiest_thread, release, stop_thread, stopped

PROGRAM = r"""
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
static volatile unsigned long work = 0, beats = 0;
static void *compute(void *arg) { (void)arg; for (;;) work++; return 0; }
int main(int argc, char **argv) {
    pthread_t t; pthread_create(&t, 0, compute, 0);
    for (;;) {  /* the main thread: every 20 ms, its beat and the compute thread's count */
        char line[64]; int n = snprintf(line, sizeof line, "%lu %lu\n", ++beats, work);
        int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
        write(fd, line, n); close(fd); usleep(20000);
    }
}
"""


@pytest.fixture
def two_threads(tmp_path: Path) -> subprocess.Popen[bytes]:
    source = tmp_path / "two.c"
    source.write_text(PROGRAM)
    subprocess.run(["gcc", "-O1", "-pthread", "-o", str(tmp_path / "two"), str(source)],
                   check=True, timeout=60)
    proc = subprocess.Popen([str(tmp_path / "two"), str(tmp_path / "beat")])
    proc.beat = tmp_path / "beat"  # type: ignore[attr-defined]
    yield proc
    release(proc.pid)
    proc.kill()
    proc.wait(timeout=5)


def last_line(proc: subprocess.Popen[bytes]) -> tuple[int, int]:
    """The main thread's latest beat and the compute thread's count, a few beats later."""
    time.sleep(0.2)
    for _ in range(50):
        parts = proc.beat.read_text().split()  # type: ignore[attr-defined]
        if len(parts) == 2:  # not caught between the truncate and the write
            return int(parts[0]), int(parts[1])
        time.sleep(0.005)
    raise AssertionError("no beat written")


def test_the_busiest_thread_stops_alone_and_runs_on_when_released(
        two_threads: subprocess.Popen[bytes]) -> None:
    pid = two_threads.pid
    tid = busiest_thread(pid, window_s=0.3)
    assert tid is not None and tid != pid
    stop_thread(pid, tid)
    assert stopped[pid] == tid
    time.sleep(0.1)
    beats1, work1 = last_line(two_threads)
    beats2, work2 = last_line(two_threads)
    assert beats2 > beats1  # the main thread goes on
    assert work2 == work1  # the compute thread does not
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "t"  # traced, stopped
    assert release(pid) == tid and pid not in stopped
    _, work3 = last_line(two_threads)
    assert work3 > work2


def test_the_main_thread_is_never_stopped_alone() -> None:
    with pytest.raises(ValueError, match="main thread"):
        stop_thread(os.getpid(), os.getpid())
    assert release(os.getpid()) is None
