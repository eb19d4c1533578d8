"""The simulated engine's prefix cache: vLLM's block rules, LRU eviction, shorter prefills."""

from __future__ import annotations

import pytest

from fleetwarden.sim.engine import EngineCore, SimRequest
from fleetwarden.sim.families import VllmFamilies
from fleetwarden.sim.prefix_cache import BLOCK_SIZE, PrefixCache
from fleetwarden.sim.sampling import Generation, parse_params


def _request(request_id: str, ids: list[int], max_tokens: int, now: float) -> SimRequest:
    params = parse_params({"max_tokens": max_tokens}, chat=False, prompt_tokens=len(ids),
                          max_model_len=4096, reasoning_parser=False)
    assert not isinstance(params, dict), params
    return SimRequest(request_id, len(ids), max_tokens, now, Generation(list(ids), params),
                      prompt_ids=ids)


def test_a_hit_is_whole_blocks_from_the_start_and_leaves_one_token_to_compute() -> None:
    cache = PrefixCache(100)
    prompt = list(range(48))  # three full blocks
    assert cache.lookup(prompt) == 0
    cache.insert(prompt)
    # The same 48 tokens: the last one must be computed, so only two blocks are a hit.
    assert cache.lookup(prompt) == 2 * BLOCK_SIZE
    assert cache.lookup([*prompt, 7]) == 3 * BLOCK_SIZE
    assert cache.lookup(prompt[:40]) == 2 * BLOCK_SIZE  # a partial block is never a hit
    assert cache.lookup([1]) == 0


def test_a_block_matches_only_under_the_same_whole_prefix() -> None:
    cache = PrefixCache(100)
    cache.insert(list(range(64)))
    changed_first = [999, *range(1, 64), 5]
    assert cache.lookup(changed_first) == 0  # later blocks are equal but their parent is not
    changed_third = [*range(32), 999, *range(33, 64), 5]
    assert cache.lookup(changed_third) == 2 * BLOCK_SIZE


def test_the_least_recently_used_blocks_go_first_and_zero_blocks_hold_nothing() -> None:
    cache = PrefixCache(4)
    a, b = [1] * 33, [2] * 33  # two full blocks each
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup(a) == 32  # a is now the most recently used
    cache.insert([3] * 33)  # two more blocks: b's go
    assert (cache.lookup(a), cache.lookup(b), len(cache)) == (32, 0, 4)
    cache.reset()
    assert (cache.lookup(a), len(cache)) == (0, 0)
    off = PrefixCache(0)
    off.insert(a)
    assert off.lookup(a) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixCache(-1)


def _prefill_steps(core: EngineCore, ids: list[int], now: float) -> tuple[int, int]:
    request = _request("r", ids, 1, now)
    core.add(request)
    steps = 0
    while core.has_work:
        core.step(now + steps)
        steps += 1
    return steps, request.cached


def test_a_hit_shortens_the_prefill_and_is_counted_as_vllm_counts_it() -> None:
    families = VllmFamilies("tiny", max_model_len=8192, kv_capacity_tokens=8192)
    core = EngineCore(families, slots=2, tokens_per_step=1, max_num_batched_tokens=100,
                      prefix_cache=PrefixCache(512))
    ids = list(range(1000))
    assert _prefill_steps(core, ids, 0.0) == (10, 0)  # ten chunks of 100, the last samples
    # 992 tokens (62 blocks) cached: 8 left, one step that also samples the only token.
    assert _prefill_steps(core, ids, 100.0) == (1, 992)
    text = families.exposition().decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 2000.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 992.0' in text
    assert ('vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",'
            'source="local_compute"} 1008.0') in text


def test_a_finished_requests_output_is_cached_for_the_next_turn() -> None:
    families = VllmFamilies("tiny", max_model_len=8192, kv_capacity_tokens=8192)
    core = EngineCore(families, slots=2, tokens_per_step=1, max_num_batched_tokens=100,
                      prefix_cache=PrefixCache(512))
    prompt = list(range(40))
    request = _request("r", prompt, 24, 0.0)
    core.add(request)
    for step in range(100):
        if not core.has_work:
            break
        core.step(float(step))
    next_turn = [*prompt, *request.output, 7, 7, 7]  # 67 tokens: 4 full blocks before the last
    nxt = _request("n", next_turn, 1, 200.0)
    core.add(nxt)
    core.step(200.0)
    assert nxt.cached == 4 * BLOCK_SIZE  # the prompt's 2 blocks and the answer's 2 more


def test_blocks_are_cached_as_their_chunk_is_scheduled_and_looked_up_when_scheduled() -> None:
    """vLLM's rule (``allocate_slots`` caches the blocks of the tokens scheduled in the step;
    a request is looked up when it is scheduled, which takes budget left for it): a request
    scheduled after another in the same step finds that step's chunk, never a chunk not
    scheduled yet."""
    families = VllmFamilies("tiny", max_model_len=8192, kv_capacity_tokens=8192)
    cache = PrefixCache(512)
    core = EngineCore(families, slots=4, tokens_per_step=1, max_num_batched_tokens=100,
                      prefix_cache=cache)
    prompt = list(range(1000))
    first, sibling = _request("a", prompt, 1, 0.0), _request("b", prompt, 1, 0.0)
    core.add(first)
    core.add(sibling)
    core.step(0.0)
    # The first chunk of 100 took the budget: 6 full blocks cached; the sibling holds a slot
    # but is not looked up yet (looked up at once and handed the whole prompt, it would claim
    # 992 tokens of which 100 were computed).
    assert (first.computed, len(cache), sibling.cached, sibling.looked_up) == (100, 6, 0, False)
    steps = 1
    while core.has_work:
        core.step(float(steps))
        steps += 1
    # The first one's ten chunks take the budget of ten steps; the sibling is scheduled in the
    # eleventh, and finds every block of the prompt.
    assert (sibling.cached, sibling.first_token_step, first.first_token_step) == (992, 11, 10)

    # In one step: the first request's whole prompt, then a sibling that shares 480 tokens.
    core = EngineCore(families, slots=4, tokens_per_step=1, max_num_batched_tokens=600,
                      prefix_cache=PrefixCache(512))
    head = list(range(2000, 2500))
    a, b = _request("a", head, 1, 0.0), _request("b", [*head[:480], *range(100)], 1, 0.0)
    core.add(a)
    core.add(b)
    core.step(0.0)
    assert (a.cached, b.cached, b.first_token_step) == (0, 480, 1)
