"""fleetwarden keeps a fleet of LLM inference engines serving.

Owns: the package's version and its one-line story.
Must not: import any module at import time (``fleetwarden.router.settings`` and the CLI stay
quick to load).

One router in front of the fleet notices failures on the request path; one authority behind it,
the ledger, decides which engines serve, which join a weight sync and which are restarted.
"""

__version__ = "0.1.0"
