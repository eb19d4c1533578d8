"""Model folders whose generation config sets an engine's default output limit, for tests.

Owns: the folders the limit tests read (:data:`NO_GENERATION_CONFIG`: a ``config.json`` and
no usable ``generation_config.json``), and a copy of a real model folder with a
``generation_config.json`` of its own (:func:`with_generation_config`): the weights and the
tokenizer linked, not copied, so it costs nothing but the folder.
Must not: change the folder it copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["NO_GENERATION_CONFIG", "with_generation_config", "without_generation_config"]

#: Model folders without a ``generation_config.json`` (or with one that is not JSON), by what
#: their ``config.json`` holds, and the default vLLM 0.32 takes from them: its
#: ``try_get_generation_config`` falls back to ``GenerationConfig.from_model_config`` on
#: ``config.json``, whose ``max_new_tokens`` is the top level's, else the text section's (a
#: composite model's). Case -> (config.json's fields, generation_config.json's text or
#: ``None`` for none, the default).
NO_GENERATION_CONFIG: dict[str, tuple[dict[str, Any], str | None, int | None]] = {
    "config.json's max_new_tokens": ({"max_new_tokens": 40}, None, 40),
    "none set": ({}, None, None),
    "a null one": ({"max_new_tokens": None}, None, None),
    "the text section's": ({"architectures": ["LlavaForConditionalGeneration"],
                            "model_type": "llava",
                            "text_config": {"model_type": "llama", "max_new_tokens": 33}},
                           None, 33),
    "not JSON, then config.json's": ({"max_new_tokens": 40}, "{not json", 40),
}


def without_generation_config(folder: Path, case: str) -> str:
    """A model folder's config files as :data:`NO_GENERATION_CONFIG` ``case`` has them."""
    config, generation, _ = NO_GENERATION_CONFIG[case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}))
    if generation is not None:
        (folder / "generation_config.json").write_text(generation)
    return str(folder)


def with_generation_config(model: Path, folder: Path, fields: dict[str, Any]) -> Path:
    """``folder``: ``model``'s files linked, and a ``generation_config.json`` of its own,
    ``model``'s updated with ``fields`` (what vLLM reads as the model's default limit)."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in model.iterdir():
        if entry.name != "generation_config.json" and not (folder / entry.name).exists():
            os.symlink(entry.resolve(), folder / entry.name)
    own = model / "generation_config.json"
    config = json.loads(own.read_text()) if own.exists() else {}
    (folder / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return folder
