"""The pipelined round (shard_map over two CPU devices): the single-device round's results.

Pipelined, single-device foresight and autoregressive decoding give the same tokens, and the two
foresight rounds the same outcomes and hit statistics, with forced hits, forced misses and natural
mixes (the scaled oracle proxy of test_foresight.py), greedy and sampled. The pipeline is
proxy-agnostic: the learned proxy (adapter + decoder) is covered by the single-device round in
test_foresight.py. On CPU the two virtual devices share the cores: correctness, not overlap.
"""

from __future__ import annotations

import jax
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.decoding import pipeline
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.session import DecodeSession
from tests.test_foresight import (
    BLOCK,
    HITS,
    MISSES,
    MIXED,
    N_NEW,
    ScaledOracleDraft,
    _ar,
    make_draft,
    make_prompts,
    run,
)


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.mark.parametrize("scale", [HITS, MISSES, MIXED])
def test_pipelined_equals_single_device_and_ar(target, draft, prompts, scale):
    oracle = ScaledOracleDraft(draft, scale)
    piped = run(target, prompts, oracle, pipeline=True)
    single = run(target, prompts, oracle)
    assert piped == single  # tokens, outcomes, hit and occupancy logs
    assert piped[0] == _ar(target, prompts)
    hits = [h for row in piped[2] for h in row["hits"][1:]]
    if scale == HITS:
        assert all(hits)
    if scale == MISSES:
        assert not any(hits)


@pytest.mark.parametrize("scale", [HITS, MISSES])
def test_pipelined_sampled_tokens_equal_ar_with_the_same_seed(target, draft, prompts, scale):
    for seed in (1, 2):
        sampling = dict(temperature=1.0, top_p=0.9, seed=seed)
        tokens, _, _ = run(
            target, prompts, ScaledOracleDraft(draft, scale), pipeline=True, **sampling
        )
        assert tokens == _ar(target, prompts, **sampling)


def test_pipelined_chunks_give_the_same_tokens(target, draft, prompts):
    """The loop resumes across chunks (the carry is gathered and re-replicated each call)."""
    session = DecodeSession(
        target,
        prompts,
        draft=ScaledOracleDraft(draft, MIXED),
        options=DecodingOptions("jetspec++", foresight=1, pipeline=True),
        max_new_tokens=N_NEW,
        stop_token_ids=[],
    )
    chunks = list(session.chunks(2))
    assert len(chunks) > 2
    joined = [sum((chunk[row] for chunk in chunks), []) for row in range(len(prompts))]
    assert joined == _ar(target, prompts)


def test_pipeline_is_refused_on_one_device(target, draft, monkeypatch):
    learned = draft.with_adapter(init_adapter(draft))
    one = jax.devices()[:1]
    monkeypatch.setattr(pipeline.jax, "devices", lambda *args: one)
    with pytest.raises(ValueError, match="pipeline=True needs >= 2 devices"):
        DecodeSession(
            target,
            [[1, 2]],
            draft=learned,
            options=DecodingOptions("jetspec++", foresight=2, pipeline=True),
        )


def test_pipelined_round_on_a_hybrid_target(checkpoints):
    """Qwen3.5 hybrid: the verify stage's Gated DeltaNet states roll back across the pipeline
    (recompute of the committed prefix) and the tokens stay exactly AR's, greedy and sampled."""
    hybrid = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    prompts = make_prompts()
    oracle = ScaledOracleDraft(make_draft(hybrid), MIXED)
    for sampling in ({}, dict(temperature=1.0, top_p=0.9, seed=3)):
        tokens, outcomes, _ = run(hybrid, prompts, oracle, pipeline=True, **sampling)
        assert tokens == _ar(hybrid, prompts, **sampling)
        assert any(k < BLOCK - 1 for row in outcomes for k, _ in row)  # rejections happened
