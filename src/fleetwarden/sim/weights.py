"""The simulated engine's weights: what a checkpoint on disk changes in its answers.

Owns: what a simulated checkpoint is (a file, or a directory of files), the salt its bytes give
the sampler, and the checksums vLLM's ``POST /weight_checker`` reports of loaded weights.
Must not: hold the HTTP side (``server.py``) or the sampler (``sampling.py``).

A real engine's greedy answer is a function of the prompt and the weights; the simulator's is a
function of the prompt and a salt (:attr:`fleetwarden.sim.sampling.Generation.salt`). A
checkpoint's salt is a hash of its bytes, so two checkpoints that differ in any byte answer the
same prompt differently, and a test can tell from an answer's text which checkpoint produced
it. The base weights (what a process loads at its start: ``SimConfig.weights_path``, or none)
have an empty salt unless a path is given: the simulator's older answers.

The checksums change with the weights, as vLLM's per-parameter digests do: one key per
simulated parameter, named as vLLM names them (its worker's ``dp0:pp0:pcp0:tp0:`` prefix).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BASE", "DEFAULT_VERSION", "Weights", "load_weights"]

#: The weight version an engine reports before anyone sets one (vLLM 0.32's EngineCore starts
#: with ``_weight_version = "default"``).
DEFAULT_VERSION = "default"
#: The simulated model's parameters: a checksum per name, as vLLM's worker reports them.
_PREFIX = "dp0:pp0:pcp0:tp0:"
_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class Weights:
    """Weights loaded in a simulated engine."""

    #: Where they were read from (``None``: the base weights a process starts with).
    source: str | None
    #: What the sampler mixes into every choice (empty: the simulator's base answers).
    salt: bytes

    def checksums(self) -> dict[str, str]:
        """``{"dp0:pp0:pcp0:tp0:<parameter>": hex digest}``: each changes with the bytes."""
        return {_PREFIX + name: hashlib.sha256(name.encode() + b"\0" + self.salt).hexdigest()
                for name in _PARAMETERS}


BASE = Weights(None, b"")


def load_weights(path: str) -> Weights:
    """The weights at ``path``: a file's bytes, or a directory's files (names and bytes, in
    order). Raises ``OSError`` naming the path when there is nothing to read, as a real
    loader fails on a checkpoint that is not there."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=32)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        if not files:
            raise FileNotFoundError(f"no weights files found in {path}")
        for f in files:
            h.update(str(f.relative_to(p)).encode() + b"\0" + f.read_bytes() + b"\0")
    else:
        h.update(p.read_bytes())  # raises FileNotFoundError naming the path
    return Weights(str(p), h.digest())
