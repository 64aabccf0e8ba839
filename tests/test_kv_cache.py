"""Cached forwards (prefill + decode, ragged batches, rollback) equal the full forward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.models import layers
from jetspec_jax.models.kv_cache import KVCache
from jetspec_jax.models.transformer import forward, init_cache, unembed

TOL = 1e-4


@pytest.fixture(scope="module")
def whole_cache_target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3_gqa4_headdim")[0])


@pytest.fixture(scope="module", params=[1024, 8], ids=["one-softmax", "chunks-of-8"])
def target(whole_cache_target, request):
    """Both forms of cached attention over these 32-slot caches: one softmax over every slot, and
    chunks of 8 slots over the filled span only."""
    config = dataclasses.replace(whole_cache_target.config, cache_chunk=request.param)
    return dataclasses.replace(whole_cache_target, config=config)


@functools.partial(jax.jit, static_argnums=1)
def _jitted(params, config, tokens, cache, num_new):
    out = forward(params, config, tokens, cache, num_new=num_new)
    return unembed(params, config, out.hidden), out.cache


def _cached_logits(target, cache, tokens, num_new=None):
    logits, cache = _jitted(target.params, target.config, jnp.asarray(tokens), cache, num_new)
    return np.asarray(logits), cache


def test_logits_refuse_more_tokens_than_the_context(whole_cache_target):
    context = whole_cache_target.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"{context + 1} tokens exceed the model's context"):
        whole_cache_target.logits(np.zeros((1, context + 1), np.int32))


@pytest.mark.parametrize("chunk", [0, 2.5, True])
def test_a_cache_chunk_that_is_not_a_positive_integer_is_refused(whole_cache_target, chunk):
    with pytest.raises(ValueError, match="cache_chunk"):
        dataclasses.replace(whole_cache_target.config, cache_chunk=chunk)


def test_prefill_then_chunks_then_single_tokens_equal_full_forward(target):
    ids = np.random.default_rng(0).integers(0, 97, (2, 20))
    full = np.asarray(target.logits(ids))
    cache = KVCache.zeros(target.config, 2, 32, jnp.float32)
    pieces = [(0, 9), (9, 12), *[(i, i + 1) for i in range(12, 20)]]
    for start, stop in pieces:
        logits, cache = _cached_logits(target, cache, ids[:, start:stop])
        np.testing.assert_allclose(logits, full[:, start:stop], atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20])


def test_ragged_batch_equals_rows_alone(target):
    """Rows of different lengths, right-padded, in one prefill and one decode step."""
    rng = np.random.default_rng(1)
    lengths = [5, 13, 9]
    rows = [rng.integers(0, 97, n) for n in lengths]
    padded = np.zeros((3, 13), np.int32)
    for r, row in enumerate(rows):
        padded[r, : len(row)] = row
    cache = KVCache.zeros(target.config, 3, 32, jnp.float32)
    logits, cache = _cached_logits(target, cache, padded, num_new=jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    next_tokens = rng.integers(0, 97, (3, 1))
    step_logits, _ = _cached_logits(target, cache, next_tokens)
    for r, row in enumerate(rows):
        alone = np.asarray(target.logits(np.concatenate([row, next_tokens[r]])[None]))[0]
        np.testing.assert_allclose(logits[r, : len(row)], alone[: len(row)], atol=TOL, rtol=0)
        np.testing.assert_allclose(step_logits[r, 0], alone[-1], atol=TOL, rtol=0)


def test_rollback_by_length_then_new_tokens_equals_full_forward(target):
    """Rejected tokens are undone by lowering the length alone; stale slots are never read."""
    rng = np.random.default_rng(2)
    prefix, rejected, replacement = (rng.integers(0, 97, (1, n)) for n in (8, 6, 4))
    cache = KVCache.zeros(target.config, 1, 32, jnp.float32)
    _, cache = _cached_logits(target, cache, np.concatenate([prefix, rejected], axis=1))
    cache = cache.rolled_back(jnp.asarray([8 + 2]))  # keep 2 of the 6
    logits, cache = _cached_logits(target, cache, replacement)
    sequence = np.concatenate([prefix, rejected[:, :2], replacement], axis=1)
    np.testing.assert_allclose(
        logits, np.asarray(target.logits(sequence))[:, -4:], atol=TOL, rtol=0
    )
    assert int(cache.lengths[0]) == 14


@pytest.mark.parametrize("last", [22, 49], ids=["span-of-3-chunks", "shifted-last-chunk"])
def test_chunked_cache_attention_reads_only_the_filled_span(last):
    """Chunks of 16 over a 50-slot cache equal one softmax over it. Slots past the chunks the
    latest query needs hold NaN, which one softmax would carry into the output (0 * NaN): they
    are not read. The last chunk, when needed, is shifted back to end at slot 50 and its overlap
    with the previous chunk is not counted twice."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 50, 2, 16)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([[3, 4, 5], [last - 2, last - 1, last]], jnp.int32)
    want = layers.cached_attention(q, k, v, 1, positions, chunk=50)  # one softmax
    read = -(-(last + 1) // 16) * 16
    poisoned = [x.at[:, :, read:].set(jnp.nan) for x in (k, v)]
    got = layers.cached_attention(q, *poisoned, 1, positions, chunk=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


def test_decoding_over_chunked_caches_gives_the_same_tokens(whole_cache_target, monkeypatch):
    """AR and JetSpec++ over caches attended in chunks of 16 give the tokens of AR over whole
    caches, and the model did attend in chunks of 16. The caches hold 16 + 64 slots: the prompt's
    length bucket plus the budget's (docs/DECODING.md, "Long budgets"), no block beyond them."""
    chunks = []
    cached_attention = layers.cached_attention

    def spy(*args, chunk, **kwargs):  # called while tracing
        chunks.append(chunk)
        return cached_attention(*args, chunk=chunk, **kwargs)

    monkeypatch.setattr(layers, "cached_attention", spy)
    jax.clear_caches()  # programs compiled before the spy would not trace through it
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, n).tolist() for n in (11, 5)]
    common = dict(max_new_tokens=40, stop_token_ids=[])
    want = [r.tokens for r in jetspec_jax.generate_batch(whole_cache_target, prompts, **common)]
    config = dataclasses.replace(whole_cache_target.config, cache_chunk=16)
    target = dataclasses.replace(whole_cache_target, config=config)
    draft = jetspec_jax.init_draft(target, block_size=4, init_std=0.1)
    for method in ("ar", "jetspec++"):
        kwargs = dict(draft=draft, method=method) if method != "ar" else {}
        got = jetspec_jax.generate_batch(target, prompts, **kwargs, **common)
        assert [r.tokens for r in got] == want, method
    assert 16 in chunks
    session = DecodeSession(
        target, prompts, draft=draft, options=DecodingOptions("jetspec++"), **common
    )
    session.start()  # the prefill generate_batch compiled
    assert session._state.decode.cache.k.shape[2] == 16 + 64


def test_chunked_attention_decodes_alike_under_x64_and_strict_promotion(whole_cache_target):
    """docs/DECODING.md: the same tokens under a process's `jax_enable_x64` and strict dtype
    promotion. A cache longer than `cache_chunk` (1024 by default: any long generation) is read
    chunk by chunk; x64 made the slices' Python-int indices int64 beside the int32 chunk start,
    which `dynamic_slice` refuses."""
    from jetspec_jax.decoding.session import COMPILED

    config = dataclasses.replace(whole_cache_target.config, cache_chunk=8)
    target = dataclasses.replace(whole_cache_target, config=config)
    draft = jetspec_jax.init_draft(target, block_size=4, init_std=0.1).with_cache_chunk(8)
    prompts, common = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7]], dict(max_new_tokens=8)
    runs = dict(ar={}, spec=dict(draft=draft, method="jetspec++", refine_passes=1))

    def tokens():
        return {
            name: [r.tokens for r in jetspec_jax.generate_batch(target, prompts, **kw, **common)]
            for name, kw in runs.items()
        }

    want = tokens()
    COMPILED.clear()  # its programs are keyed without the JAX config: trace them under both
    try:
        with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
            got = tokens()
    finally:
        COMPILED.clear()  # the other tests' programs: traced without them
    assert got == want


def test_a_cache_of_the_other_kind_is_refused_by_name(checkpoints):
    dense = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    hybrid = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    tokens = jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="hybrid model's cache is a HybridCache, got KVCache"):
        forward(hybrid.params, hybrid.config, tokens, init_cache(dense.config, 1, 8, jnp.float32))
    hybrid_cache = init_cache(hybrid.config, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="dense model's cache is a KVCache, got HybridCache"):
        forward(dense.params, dense.config, tokens, hybrid_cache)
    assert isinstance(init_cache(dense.config, 1, 8, jnp.float32), KVCache)


def test_rolling_back_never_lengthens_a_row(whole_cache_target):
    """`rolled_back` to a length past a row's own keeps the row's (what it holds past that is
    not its context)."""
    t = whole_cache_target
    cache = init_cache(t.config, 2, 16, jnp.float32)
    ids = np.random.default_rng(0).integers(0, t.config.vocab_size, (2, 5))
    cache = forward(t.params, t.config, ids, cache, num_new=jnp.array([5, 3])).cache
    np.testing.assert_array_equal(cache.rolled_back(jnp.array([2, 9])).lengths, [2, 3])


def test_padding_past_a_full_cache_is_dropped_not_written_on_its_last_slot(whole_cache_target):
    """A block whose real token fills the cache's last slot and whose padding runs past the
    capacity (a verify block near the end of a budget): the padding's writes are dropped, so the
    committed slot keeps the real token's key and value."""
    t = whole_cache_target
    p, c = t.params, t.config
    ids = np.random.default_rng(5).integers(0, c.vocab_size, (1, 6))
    want = np.asarray(unembed(p, c, forward(p, c, ids).hidden))[0, -1]
    cache = forward(p, c, ids[:, :5], init_cache(c, 1, 6, jnp.float32)).cache
    block = np.concatenate([ids[:, 5:], np.array([[7, 8, 9]])], axis=1)  # positions 5 .. 8
    out = forward(p, c, block, cache, num_new=jnp.array([1]))
    np.testing.assert_allclose(np.asarray(unembed(p, c, out.hidden))[0, 0], want, atol=TOL)
    alone = forward(p, c, ids[:, 5:], cache).cache  # the real token written alone
    np.testing.assert_allclose(out.cache.k[:, 0, 5], alone.k[:, 0, 5], atol=TOL)
    np.testing.assert_allclose(out.cache.v[:, 0, 5], alone.v[:, 0, 5], atol=TOL)
