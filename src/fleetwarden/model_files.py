"""A model folder's files, read from this host's disk for the pure ``engines`` module (which
reads none itself): what vLLM's ``try_get_generation_config`` reads there.

Owns: :func:`generation_config_file` (a folder's generation config, or nothing).
Must not: decide what the file means for an engine's output limits (``engines.
generation_limits`` does, mirroring vLLM), or read anything over the network.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: The sections of a composite model's ``config.json`` that hold its text decoder's settings,
#: in the order transformers' ``GenerationConfig.from_model_config`` looks for them.
TEXT_SECTIONS = ("decoder", "generator", "text_config")


def _json(path: str) -> object:
    """The JSON in ``path``, or ``None`` where it cannot be read or is no JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def generation_config_file(folder: str) -> dict[str, Any] | None:
    """``folder``'s generation config as vLLM 0.32's ``try_get_generation_config``
    (``vllm/transformers_utils/config.py``) reads it: its ``generation_config.json``; where
    that is missing or not JSON (transformers raises ``OSError``), the model's own
    ``config.json`` through ``GenerationConfig.from_model_config``, of which only
    ``max_new_tokens`` bears on a limit: its top level's, else its text section's (a
    composite model's). ``None`` where neither file can be read (a hub name, another host's
    path): the default is then not known here. Never raises."""
    config = _json(os.path.join(folder, "generation_config.json"))
    if config is not None:
        return config if isinstance(config, dict) else None
    model = _json(os.path.join(folder, "config.json"))
    if not isinstance(model, dict):
        return None
    tokens = model.get("max_new_tokens")
    if tokens is None:
        section = next((model[name] for name in TEXT_SECTIONS if model.get(name)), None)
        tokens = section.get("max_new_tokens") if isinstance(section, dict) else None
    # from_model_config drops the None values: an unset limit is no default
    return {} if tokens is None else {"max_new_tokens": tokens}
