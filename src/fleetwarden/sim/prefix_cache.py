"""The simulated engine's prefix cache: an LRU of full KV blocks, keyed by hash chains.

Owns: which prompt prefixes the simulated engine holds, and how many tokens a prompt finds.
Must not: do I/O or read a clock (the engine core asks it).

It follows vLLM V1's automatic prefix caching closely enough for a router's affinity to be
measured against it:

* a block is ``block_size`` (16) tokens; only full blocks are cached, each keyed by the hash of
  its parent's key and its own tokens, so a block matches only under the same whole prefix;
* a prompt's hit is its longest run of cached blocks from the start, capped so at least one
  token is computed (vLLM's ``max_cache_hit_length = num_tokens - 1``: the last position's
  logits are needed to sample);
* a scheduled prompt's blocks are cached at once (vLLM caches blocks as it allocates them), so a
  sibling scheduled later finds them; a finished request's output blocks are cached too;
* the least recently used block goes first when ``capacity_blocks`` are held; a cache of zero
  blocks holds nothing (prefix caching off).

The engine empties it with :meth:`reset` where vLLM loses its KV cache: a restart (a new process
gets a new cache), sleep (level 1 discards the KV cache too) and ``POST /reset_prefix_cache``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BLOCK_SIZE", "PrefixCache"]

#: vLLM's default KV block size (``cache_config_info`` says ``block_size="16"``).
BLOCK_SIZE = 16


class PrefixCache:
    """Full blocks of prompt tokens an engine holds, least recently used first."""

    __slots__ = ("_blocks", "block_size", "capacity_blocks")

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError(f"capacity_blocks must be >= 0 and block_size >= 1, got "
                             f"{capacity_blocks} and {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, ids: Sequence[int], limit: int) -> list[int]:
        size = self.block_size
        keys: list[int] = []
        parent = 0
        for start in range(0, limit - limit % size, size):
            parent = hash((parent, *ids[start:start + size]))
            keys.append(parent)
        return keys

    def lookup(self, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` the cache holds from the start (a multiple of the block size, at
        most ``len(ids) - 1``); the blocks found become the most recently used."""
        if not self.capacity_blocks or len(ids) < 2:
            return 0
        hit = 0
        for key in self._keys(ids, len(ids) - 1):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hit += self.block_size
        return hit

    def insert(self, ids: Sequence[int]) -> None:
        """Hold every full block of ``ids``, evicting the least recently used beyond capacity."""
        if not self.capacity_blocks:
            return
        blocks = self._blocks
        for key in self._keys(ids, len(ids)):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def reset(self) -> None:
        """Forget every block (vLLM's ``reset_prefix_cache``; a sleep; a new process)."""
        self._blocks.clear()
