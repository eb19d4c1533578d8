"""Stop one thread of a process, leaving the others running: the compute-only wedge.

Owns: stopping and releasing one thread of a local process (ptrace), and the threads held so.
Must not: decide which engine to wedge or when (``chaos.py``), or signal whole processes.

On a one-process engine (llama.cpp's ``llama-server``), ``SIGSTOP`` stops every thread, so its
``/health`` and ``/metrics`` stop answering too: a wedge that any probe sees. The wedge that
probes cannot see is a compute thread that stops while the HTTP threads go on answering
(``requests_processing`` 4, ``n_decode_total`` flat: ``tests/fixtures/llamacpp/README.md``).
A signal cannot stop one thread (a stop signal stops the whole process), so this uses
``ptrace``: ``PTRACE_SEIZE`` then ``PTRACE_INTERRUPT`` of the thread that used the most CPU over
a short window (threads share one name; the main thread is never chosen: it serves
``/metrics``, which must go on answering). :func:`release` detaches it and it runs on.

Limits, from ptrace itself: it needs root (or ``CAP_SYS_PTRACE``, or a permissive
``kernel.yama.ptrace_scope``); the tracer is *this thread* of *this process* — release from the
same thread (an asyncio loop's), and if this process dies the thread resumes by itself.
"""

from __future__ import annotations

import ctypes
import os
import time

__all__ = ["busiest_thread", "release", "stop_thread", "stopped"]

_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207

#: The threads this process holds stopped: engine pid -> thread id.
stopped: dict[int, int] = {}


def _ptrace(request: int, tid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    if libc.ptrace(request, tid, None, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")


def _cpu_ticks(pid: int) -> dict[int, int]:
    """utime + stime of each thread of ``pid`` (``/proc/PID/task/TID/stat`` fields 14, 15)."""
    ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def busiest_thread(pid: int, window_s: float = 0.5) -> int | None:
    """The thread other than the main one that used the most CPU over ``window_s``; None when
    no such thread used any."""
    before = _cpu_ticks(pid)
    time.sleep(window_s)
    after = _cpu_ticks(pid)
    used = {tid: after[tid] - before.get(tid, 0) for tid in after if tid != pid}
    if not used or max(used.values()) <= 0:
        return None
    return max(used, key=lambda tid: used[tid])


def stop_thread(pid: int, tid: int) -> None:
    """Stop thread ``tid`` of process ``pid`` (ptrace-seize and interrupt it)."""
    if tid == pid:
        raise ValueError("the main thread is never stopped alone (it may serve /metrics)")
    _ptrace(_PTRACE_SEIZE, tid)
    try:
        _ptrace(_PTRACE_INTERRUPT, tid)
    except OSError:
        _ptrace(_PTRACE_DETACH, tid)
        raise
    stopped[pid] = tid


def release(pid: int) -> int | None:
    """Let the thread stopped in ``pid`` run again; its id, or None if none was stopped."""
    tid = stopped.pop(pid, None)
    if tid is None:
        return None
    deadline = time.monotonic() + 2.0
    while True:  # the interrupt may not have landed yet: detach needs the thread stopped
        try:
            _ptrace(_PTRACE_DETACH, tid)
            return tid
        except ProcessLookupError:
            if time.monotonic() > deadline or not os.path.exists(f"/proc/{pid}/task/{tid}"):
                return tid  # gone with its process: nothing left to release
            time.sleep(0.01)
