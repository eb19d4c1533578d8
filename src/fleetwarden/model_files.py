"""A model folder's files, read from this host's disk for the pure ``engines`` module (which
reads none itself): what vLLM's ``GenerationConfig.from_pretrained`` reads there.

Owns: :func:`generation_config_file` (a folder's ``generation_config.json``, or nothing).
Must not: decide what the file means for an engine's output limits (``engines.
generation_limits`` does, mirroring vLLM), or read anything over the network.
"""

from __future__ import annotations

import json
import os
from typing import Any


def generation_config_file(folder: str) -> dict[str, Any] | None:
    """``folder``'s ``generation_config.json``, or ``None`` where there is none to read (a hub
    name, another host's path, no such file: vLLM then falls back to the model's
    ``config.json``, which is not mirrored here). Never raises."""
    try:
        with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
