"""The draft's and the adapter's attention over a long decode cache: only its filled span is read.

`refinement_attention_over_span` (an online softmax over chunks of the stacked cache, as many as
the longest context needs) against the dense reference, and decoding with draft and adapter
caches attended that way: AR's tokens, and the dense run's round outcomes.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.kernels import refinement as refinement_module
from jetspec_jax.kernels.reference import (
    refinement_attention_over_span,
    refinement_attention_reference,
)
from tests.test_foresight import foresight_options, make_accepting_draft
from tests.tiny_models import near_bigram

LAYERS, CAPACITY, CHUNK = 3, 43, 8  # the last chunk (35-42) overlaps the one before


def operands(seed, cands, lengths, num_heads=4, num_kv=2, k_len=4, head_dim=16):
    keys = jax.random.split(jax.random.key(seed), 5)
    batch = len(lengths)
    q = jax.random.normal(keys[0], (batch, cands, k_len, num_heads, head_dim))
    cache = (LAYERS, batch, CAPACITY, num_kv, head_dim)
    cache_k, cache_v = (jax.random.normal(k, cache) for k in keys[1:3])
    block = (batch, cands, k_len, num_kv, head_dim)
    block_k, block_v = (jax.random.normal(k, block) for k in keys[3:5])
    return q, cache_k, cache_v, jnp.asarray(lengths, jnp.int32), block_k, block_v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "lengths",
    [
        [[0]],  # the block only
        [[8], [16]],  # chunk multiples
        [[13, 0, 42]],  # candidates of one row apart, into the shifted last chunk
        [[43, 21], [3, 33]],  # the whole capacity
    ],
    ids=["empty", "multiples", "candidates", "full"],
)
def test_the_span_form_equals_the_dense_reference(causal, lengths):
    cands = len(lengths[0])
    q, cache_k, cache_v, lens, block_k, block_v = operands(1, cands, lengths)
    layer = 1
    want = refinement_attention_reference(
        q, cache_k[layer], cache_v[layer], lens, block_k, block_v, causal=causal
    )
    got = refinement_attention_over_span(
        q, cache_k, cache_v, layer, lens, block_k, block_v, causal=causal, chunk=CHUNK
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_slots_past_the_needed_chunks_are_not_read():
    """NaN in every slot past the chunks the longest context (19) needs (3 of 8 slots), and in
    the other layers: the output is the dense reference's over clean caches. (Slots inside a read
    chunk must be finite, as the dense reference requires of every slot.)"""
    q, cache_k, cache_v, lens, block_k, block_v = operands(2, 2, [[5, 19]])
    want = refinement_attention_reference(
        q, cache_k[0], cache_v[0], lens, block_k, block_v, causal=True
    )
    poisoned = [x.at[:, :, 24:].set(jnp.nan).at[1:].set(jnp.nan) for x in (cache_k, cache_v)]
    got = refinement_attention_over_span(
        q, *poisoned, 0, lens, block_k, block_v, causal=True, chunk=CHUNK
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_a_cache_shorter_than_a_chunk_is_refused():
    q, cache_k, cache_v, lens, block_k, block_v = operands(3, 1, [[4]])
    with pytest.raises(ValueError, match="shorter than one chunk"):
        refinement_attention_over_span(
            q, cache_k, cache_v, 0, lens, block_k, block_v, causal=True, chunk=CAPACITY + 1
        )


@pytest.fixture(scope="module")
def target(checkpoints):
    return near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))


def test_decoding_over_chunked_draft_and_adapter_caches(target, monkeypatch):
    """J1-R1 with foresight B = 2 (the draft and adapter caches, foresight's candidates of one
    row at several context lengths) over caches of more than 8 slots attended 8 at a time: the
    whole-cache run's tokens, outcomes and hits; the span form did run, for the draft's caches
    and for the adapter's. (The whole-cache run's tokens are AR's: test_foresight.py and
    test_refinement.py check foresight and J1-R1 against AR; no AR program is compiled here.)"""
    spans = []  # per call (at trace time), the model files on the stack
    span = refinement_module.refinement_attention_over_span

    def spy(*args, **kwargs):
        models = {pathlib.Path(frame.filename).name for frame in inspect.stack()}
        spans.append(models & {"draft.py", "adapter.py"})
        return span(*args, **kwargs)

    monkeypatch.setattr(refinement_module, "refinement_attention_over_span", spy)
    draft = make_accepting_draft(target)
    draft = draft.with_adapter(init_adapter(draft, init_std=0.05))
    prompts = [np.random.default_rng(8).integers(0, 97, n).tolist() for n in (13, 6)]
    options = dataclasses.replace(foresight_options(2), refine_passes=1, refreshes=1)
    common = dict(max_new_tokens=24, stop_token_ids=[], **dataclasses.asdict(options))
    runs = {}
    for chunk in (1024, 8):  # the whole caches (<= 1024 slots), then chunks of 8
        runs[chunk] = jetspec_jax.generate_batch(
            target, prompts, draft=draft.with_cache_chunk(chunk), **common
        )
        assert bool(spans) == (chunk == 8), chunk
    assert {"draft.py"} in spans and {"adapter.py"} in spans
    for row, (whole, chunked) in enumerate(zip(runs[1024], runs[8], strict=True)):
        assert chunked.tokens == whole.tokens, row
        assert chunked.outcomes == whole.outcomes, row
        assert chunked.foresight_hits == whole.foresight_hits, row
    assert any(k > 0 for r in runs[8] for k, _ in r.outcomes)
