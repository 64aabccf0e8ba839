"""Model configs refuse values that would construct and then compute something wrong."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jetspec_jax.models.config import RopeConfig, TransformerConfig
from jetspec_jax.models.draft import DraftConfig
from jetspec_jax.models.rope import inverse_frequencies

QWEN3 = TransformerConfig("qwen3", 97, 64, 96, 1, 4, 2, 16)


def test_qk_norm_follows_the_model_type():
    """Qwen3 checkpoints carry q/k norms; a switch that could be left off would skip them."""
    assert QWEN3.qk_norm
    assert dataclasses.replace(QWEN3, model_type="qwen3_5", layer_types=("full_attention",)).qk_norm
    assert not dataclasses.replace(QWEN3, model_type="llama").qk_norm


def test_only_llama_has_an_mlp_bias():
    assert dataclasses.replace(QWEN3, model_type="llama", mlp_bias=True).mlp_bias
    with pytest.raises(ValueError, match="mlp_bias is only supported for llama, not qwen3"):
        dataclasses.replace(QWEN3, mlp_bias=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(theta=0.0), "theta and factor must be finite and > 0"),
        (dict(theta=-1e4), "theta and factor must be finite and > 0"),
        (dict(theta=math.inf), "theta and factor must be finite and > 0"),
        (dict(theta=math.nan), "theta and factor must be finite and > 0"),
        (dict(rope_type="linear", factor=0.0), "theta and factor must be finite and > 0"),
        (dict(rope_type="linear", factor=math.inf), "theta and factor must be finite and > 0"),
        (dict(rope_type="llama3", high_freq_factor=math.inf), "high_freq_factor >"),
        (dict(rope_type="llama3", low_freq_factor=4.0, high_freq_factor=4.0), "high_freq_factor >"),
        (dict(rope_type="llama3", low_freq_factor=0.0), "high_freq_factor >"),
        (dict(rope_type="llama3", original_max_position_embeddings=0), "high_freq_factor >"),
    ],
)
def test_a_rope_that_gives_non_finite_frequencies_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RopeConfig(**fields)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_accepted_ropes_give_finite_positive_frequencies(rope_type):
    rope = RopeConfig(rope_type=rope_type, factor=8.0, original_max_position_embeddings=64)
    inv_freq = inverse_frequencies(rope, 64)
    assert np.all(np.isfinite(inv_freq)) and np.all(inv_freq > 0)


@pytest.mark.parametrize("cap", [0.0, -5.0])
def test_a_draft_softcap_must_be_positive(cap):
    """The reference applies the cap only when it is > 0; a negative one would cap by |c|."""
    with pytest.raises(ValueError, match="final_logit_softcapping must be > 0"):
        DraftConfig(QWEN3, target_layer_ids=(0,), final_logit_softcapping=cap)
    assert DraftConfig(QWEN3, target_layer_ids=(0,), final_logit_softcapping=30.0)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps=nan must be a finite number > 0"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0 must be a finite number > 0"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps=-1.0 must be a finite number > 0"),
        (dict(max_position_embeddings=0), "max_position_embeddings=0 must be >= 1"),
        (dict(head_dim=0), "head_dim=0 must be >= 1"),
        (dict(intermediate_size=0), "intermediate_size=0 must be >= 1"),
    ],
)
def test_sizes_and_epsilons_that_would_compute_nonsense_are_refused(fields, message):
    """A NaN or non-positive epsilon makes every logit NaN (decoding then returns token 0 with
    no error); a zero context refuses every request, a zero head_dim divides by zero."""
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(QWEN3, **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        # rotary_dim = int(16 * 0.5625) = 9: odd, RoPE's halves would not pair up.
        (dict(partial_rotary_factor=0.5625, layer_types=("full_attention",)), "rotary_dim=9"),
        # 3 value heads over 2 key heads: no whole repeat of the keys serves them.
        (
            dict(
                layer_types=("linear_attention",),
                linear_num_key_heads=2,
                linear_num_value_heads=3,
                linear_key_head_dim=4,
                linear_value_head_dim=4,
            ),
            "multiple of linear_num_key_heads",
        ),
    ],
)
def test_hybrid_shapes_that_would_compute_nonsense_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(QWEN3, model_type="qwen3_5", **fields)


def test_a_mask_token_must_be_inside_the_vocabulary():
    assert DraftConfig(QWEN3, target_layer_ids=(0,), mask_token_id=96)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DraftConfig(QWEN3, target_layer_ids=(0,), mask_token_id=97)
