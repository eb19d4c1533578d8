"""Checkpoints of the tiny model that answer differently: what a trainer's steps write to disk.

Owns: making and caching a perturbed copy of a model folder (same architecture, same tokenizer,
other weights), for tests that load checkpoints into real engines (vLLM's ``reload_weights``).
Must not: download anything, or import torch into fleetwarden's own environment: the
perturbation runs under the vLLM environment's Python.

A checkpoint is the model's folder with every floating-point tensor moved by seeded noise (half
its standard deviation): its greedy answers differ from the base model's, measured on the tiny
model on every prompt tried (tests/vllm/test_real_fleet.py). The same base and seed give the
same bytes. The folder is cached beside the base, named by the base's folder and the seed, and
complete once its marker file is written (the last step).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["CheckpointError", "ensure_checkpoint"]

#: Bump when the perturbation changes: the cached folders' names change with it.
PERTURB_VERSION = 1
_DONE = "fleetwarden-checkpoint.done"

_SCRIPT = """
import shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
shutil.copytree(src, out)
g = torch.Generator().manual_seed(seed)
for f in sorted(out.glob("*.safetensors")):
    tensors = load_file(str(f))
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            tensors[name] = (t.float() + 0.5 * t.float().std() * noise).to(t.dtype).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
"""


class CheckpointError(RuntimeError):
    """The checkpoint could not be made; the message names the cause."""


def ensure_checkpoint(base: str | os.PathLike[str], seed: int,
                      python: str | os.PathLike[str]) -> Path:
    """The folder of ``base`` perturbed with ``seed`` (made under ``python``, the vLLM
    environment's, when not cached yet)."""
    base = Path(base)
    target = base.parent / f"{base.name}-ckpt{PERTURB_VERSION}-seed{seed}"
    if (target / _DONE).exists():
        return target
    tmp = base.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        done = subprocess.run([os.fspath(python), "-I", "-c", _SCRIPT, str(base), str(tmp),
                               str(seed)], capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckpointError(f"the checkpoint maker under {python} did not run: {e}") from e
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"the checkpoint maker failed (exit {done.returncode}):\n"
                              + (done.stdout + done.stderr)[-3000:])
    (tmp / _DONE).write_text(f"{base} seed {seed}\n")
    shutil.rmtree(target, ignore_errors=True)  # incomplete: it has no marker
    tmp.rename(target)
    return target
