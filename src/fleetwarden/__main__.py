"""``python -m fleetwarden``: the ``fleetwarden`` command.

Owns: nothing but the entry point.
Must not: hold any code of its own (``cli.py`` does).
"""

from fleetwarden.cli import main

main()
