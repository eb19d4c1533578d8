"""`fleetwarden up` as a subprocess in a work folder: what examples, benchmarks and tests that
must kill fleetwarden itself (not just its engines) use.

Owns: ``fleetwarden up`` as a subprocess in a work folder.
Must not: leave a process behind: it stops what it started.

    up = UpProcess(workdir, "--engines", "2")      # waits until the router and admin listen
    up.client.shards(); up.router; up.admin
    up.kill9()                                    # SIGKILL to fleetwarden alone
    output = up.stop()                            # SIGTERM, wait, return everything it printed
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from fleetwarden.client import FleetClient

__all__ = ["UpProcess"]


class UpProcess:
    """`fleetwarden up --quiet`, on free ports unless ``args`` name ports or a config file."""

    def __init__(self, workdir: Path, *args: str, start_timeout_s: float = 120.0,
                 drain: bool = False, env: Mapping[str, str] | None = None,
                 client_key: str = "none") -> None:
        """``drain``: read what it prints after the start too, in a thread (into
        ``output``), so a fleet that runs long and logs much never blocks on a full pipe.
        ``env``: more environment for it (and the engines it launches: ``VLLM_API_KEY``);
        ``client_key``: the key the tests' clients send through its router (the engines',
        when they run with ``--api-key``)."""
        self.workdir = workdir
        self.client_key = client_key
        self._drain: threading.Thread | None = None
        argv = [sys.executable, "-m", "fleetwarden", "up", "--quiet"]
        if "--config" not in args:  # a config file names its own ports
            if "--port" not in args:
                argv += ["--port", "0"]
            if "--admin-port" not in args:
                argv += ["--admin-port", "0"]
        self.proc = subprocess.Popen(
            [*argv, *args], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.output: list[str] = []
        self.router = self.admin = ""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + start_timeout_s
        for line in self.proc.stdout:
            self.output.append(line)
            if m := re.match(r"router\s+(http://\S+)/v1", line):
                self.router = m.group(1)
            if m := re.match(r"admin\s+(http://\S+)/admin/status", line):
                self.admin = m.group(1)
            if (self.router and self.admin) or time.monotonic() > deadline:
                break
        if not (self.router and self.admin):
            self.kill9()
            raise RuntimeError("fleetwarden up did not start:\n" + "".join(self.output))
        self.client_token_file = self._token_file()
        self.client = FleetClient(self.admin, token_file=self.client_token_file)
        if drain:
            self._drain = threading.Thread(target=self._read_rest, daemon=True)
            self._drain.start()

    def _read_rest(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def _token_file(self) -> Path:
        args = self.proc.args
        assert isinstance(args, list)
        if "--config" in args:
            from fleetwarden.config import load_config

            path = Path(str(args[args.index("--config") + 1]))
            token_file = load_config(path if path.is_absolute() else self.workdir / path
                                     ).admin.token_file
            return token_file if token_file.is_absolute() else self.workdir / token_file
        return self.workdir / "fleetwarden-admin.token"

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL to fleetwarden only: its engines run in sessions of their own and live on."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        if self._drain is not None:
            self._drain.join(timeout=10)

    def stop(self, timeout_s: float = 120.0) -> str:
        """SIGTERM (a clean stop: every engine stopped); everything it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        if self._drain is not None:
            self.proc.wait(timeout=timeout_s)
            self._drain.join(timeout=10)
            return "".join(self.output)
        out, _ = self.proc.communicate(timeout=timeout_s)
        return "".join(self.output) + (out or "")
