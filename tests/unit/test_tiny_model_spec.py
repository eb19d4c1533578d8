"""The tiny model's cache key and training text: pure, so tested without torch.

Building the model needs torch, transformers and tokenizers (the vLLM environment has them);
the vllm tier builds it twice and compares the bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fleetwarden.testing.tiny_model import MANIFEST, TinyModelSpec, corpus, ensure_tiny_model


def test_every_field_of_the_spec_changes_the_folder() -> None:
    base = TinyModelSpec()
    names = {base.folder_name()}
    for f in dataclasses.fields(TinyModelSpec):
        changed = dataclasses.replace(base, **{f.name: getattr(base, f.name) + 1})
        names.add(changed.folder_name())
    assert len(names) == len(dataclasses.fields(TinyModelSpec)) + 1
    assert TinyModelSpec().folder_name() == base.folder_name()  # and nothing else does


def test_the_default_model_is_the_one_the_cpu_backend_serves() -> None:
    spec = TinyModelSpec()
    assert spec.hidden_size == spec.num_attention_heads * spec.head_dim
    assert spec.head_dim == 32  # 16 kills the CPU engine on its first request


def test_the_training_text_is_the_same_every_time_and_differs_by_seed() -> None:
    spec = dataclasses.replace(TinyModelSpec(), corpus_sentences=200)
    assert corpus(spec) == corpus(spec)
    assert corpus(spec) != corpus(dataclasses.replace(spec, seed=1))
    assert len(corpus(spec)) == 200 and all(line.strip() for line in corpus(spec))


def test_a_cached_model_is_returned_without_building(tmp_path: Path) -> None:
    spec = TinyModelSpec()
    folder = tmp_path / spec.folder_name()
    folder.mkdir()
    (folder / MANIFEST).write_text("{}")
    # No torch here and a python that does not exist: only the cache can answer.
    assert ensure_tiny_model(tmp_path, spec, python=tmp_path / "no-python") == folder


def test_a_builder_that_cannot_run_is_an_error(tmp_path: Path) -> None:
    from fleetwarden.testing.tiny_model import TinyModelError

    with pytest.raises(TinyModelError, match="did not run"):
        ensure_tiny_model(tmp_path, python=tmp_path / "no-python")
