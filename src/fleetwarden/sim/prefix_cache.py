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

With ``events`` on it records vLLM's KV events as they happen (``sim/kv_events.py``): one
``BlockStored`` per run of blocks an insert adds (their tokens, the parent's hash), one
``BlockRemoved`` per evicted block, ``AllBlocksCleared`` on a reset. The hashes it reports are
its keys hashed again with a salt drawn per cache (per process), as vLLM's are seeded: a
consumer must key blocks by their tokens.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

from fleetwarden.sim.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["BLOCK_SIZE", "PrefixCache"]

#: vLLM's default KV block size (``cache_config_info`` says ``block_size="16"``).
BLOCK_SIZE = 16


class PrefixCache:
    """Full blocks of prompt tokens an engine holds, least recently used first."""

    __slots__ = ("_blocks", "_salt", "block_size", "capacity_blocks", "events")

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE,
                 events: bool = False) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError(f"capacity_blocks must be >= 0 and block_size >= 1, got "
                             f"{capacity_blocks} and {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        #: The KV events since the last :meth:`take_events` (None: events off).
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] | None = (
            [] if events else None)
        self._salt = os.urandom(16)

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
        events = self.events
        keys = self._keys(ids, len(ids))
        first_new: int | None = None  # where the run of blocks new to the cache began
        for i, key in enumerate(keys):
            if events is not None:
                if key not in blocks and first_new is None:
                    first_new = i
                elif key in blocks and first_new is not None:
                    self._stored(ids, keys, first_new, i)
                    first_new = None
            blocks[key] = None
            blocks.move_to_end(key)
        if events is not None and first_new is not None:
            self._stored(ids, keys, first_new, len(keys))
        while len(blocks) > self.capacity_blocks:
            key, _ = blocks.popitem(last=False)
            if events is not None:
                events.append(BlockRemoved(block_hashes=[self.external(key)], medium=MEDIUM_GPU,
                                           group_idx=0))

    def _stored(self, ids: Sequence[int], keys: list[int], start: int, end: int) -> None:
        """One ``BlockStored`` for blocks ``start:end`` of ``ids``, as vLLM's
        ``cache_full_blocks`` reports the blocks one scheduling of a request cached."""
        assert self.events is not None
        size = self.block_size
        self.events.append(BlockStored(
            block_hashes=[self.external(k) for k in keys[start:end]],
            parent_block_hash=self.external(keys[start - 1]) if start else None,
            token_ids=list(ids[start * size:end * size]), block_size=size, lora_id=None,
            medium=MEDIUM_GPU, lora_name=None, group_idx=0))

    def external(self, key: int) -> bytes:
        """The hash a block is reported by: its key, salted (32 bytes, as vLLM's sha256)."""
        return hashlib.sha256(self._salt + key.to_bytes(8, "big", signed=True)).digest()

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last call, oldest first (vLLM's ``take_events``)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    def reset(self) -> None:
        """Forget every block (vLLM's ``reset_prefix_cache``; a sleep; a new process)."""
        self._blocks.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
