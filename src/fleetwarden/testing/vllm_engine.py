"""One real engine for tests and benchmarks, launched the way fleetwarden's launcher does.

Owns: one real local engine (vLLM, or llama.cpp's ``llama-server`` through
:func:`fleetwarden.testing.llamacpp_env.start_llamacpp_engine`), launched as the launcher does.
Must not: leave a process behind.

The command and environment come from :mod:`fleetwarden.testing.vllm_env` with their
placeholders filled in; the engine runs in a new session (its own process group), and
:meth:`LocalEngine.stop` stops the whole group and reaps its first process. Only stdlib and
:mod:`fleetwarden.launchers.procs` are imported: the caller's interpreter needs no vLLM.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fleetwarden.launchers import local, procs
from fleetwarden.testing.vllm_env import fill_engine_env, vllm_engine_command, vllm_engine_env

__all__ = ["STARTUP_TIMEOUT_S", "LocalEngine", "VllmEngine", "free_port", "launch",
           "start_vllm_engine"]

#: Start-up to /health 200 takes 25–35 s on this project's machine kind, one or two at once;
#: four times that is a hang, not a slow start.
STARTUP_TIMEOUT_S = 120.0

#: SIGTERM to the group empties it in about 0.4 s; past this the group gets SIGKILL.
STOP_GRACE_S = 15.0


@dataclass
class LocalEngine:
    """A real engine in its own process group, whose id is its first process's pid: a vLLM API
    server (with its ``VLLM::EngineCore`` and ``VLLM::Worker``), or a ``llama-server``."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    name: str = "vLLM"
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None

    @property
    def pgid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """``GET path``: (status, body). Raises OSError when nothing answers."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Wait for ``/health`` 200; return the seconds since launch. Raises RuntimeError with
        the log's tail when the server exits or does not answer in time."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.process.returncode} "
                                   f"before /health answered. Log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                if self.get("/health", timeout=1.0)[0] == 200:
                    self.ready_after_s = time.monotonic() - self.started_at
                    return self.ready_after_s
            except OSError:
                pass  # not listening yet
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} gave no /health 200 within {timeout_s:.0f} s. "
                           f"Log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> procs.GroupStop:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``, reap its first process."""
        stop = procs.terminate_group(self.pgid, grace_s=grace_s)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()  # only if it is not in its own group any more
            self.process.wait(timeout=10)
        return stop

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    return local.free_port("127.0.0.1")  # the launcher's: one copy


def start_vllm_engine(python: str | os.PathLike[str], model_dir: str | os.PathLike[str],
                      log_dir: str | os.PathLike[str], shard: int = 0,
                      port: int | None = None, extra_args: str = "") -> LocalEngine:
    """Launch one engine on 127.0.0.1 (a free port unless given) and return at once; call
    :meth:`LocalEngine.wait_ready` next, and :meth:`LocalEngine.stop` in a ``finally``.
    ``extra_args`` go to the API server as they are (e.g. ``--enable-server-load-tracking``)."""
    port = port or free_port()
    values = {"host": "127.0.0.1", "port": port, "shard": shard}
    command = vllm_engine_command(model_dir, python, extra_args=extra_args)
    argv = shlex.split(command.format(**values))
    env = {**os.environ, **fill_engine_env(vllm_engine_env(), **values)}
    return launch(argv, env, Path(log_dir) / f"vllm-shard{shard}-port{port}.log", port, "vLLM")


def launch(argv: list[str], env: dict[str, str], log_path: Path, port: int,
           name: str) -> LocalEngine:
    """Start ``argv`` in a new session (its own process group), its output to ``log_path``."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return LocalEngine(process=process, port=port, log_path=log_path, name=name)


#: The name the vLLM tier knows it by.
VllmEngine = LocalEngine
