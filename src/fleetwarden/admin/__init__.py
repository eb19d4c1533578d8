"""The admin side: a token-protected HTTP API on its own port, and the dashboard.

Owns: nothing but the package: the admin side is ``surface``, ``state``, ``server``, ``app``,
``views``, ``events``, ``dashboard`` and ``keys``.
Must not: import ``fleet.py``: the admin side asks through ``admin/surface.py``.
"""
