"""fp32 parity of the JAX targets with transformers on tiny random checkpoints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jetspec_jax
from jetspec_jax.models.config import RopeConfig
from jetspec_jax.models.rope import apply_rope, inverse_frequencies
from jetspec_jax.models.transformer import forward, unembed
from tests.jaxprs import dot_precisions
from tests.tiny_models import VARIANTS

TOL = 1e-4


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids), output_hidden_states=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoints, variant):
    path, model = checkpoints.get(variant)
    target = jetspec_jax.load_target(path)
    ids = np.random.default_rng(1).integers(0, target.config.vocab_size, (2, 37))
    ours = np.asarray(target.logits(ids))
    assert ours.shape == (2, 37, target.config.vocab_size)
    np.testing.assert_allclose(ours, _reference(model, ids).logits.numpy(), atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3", "llama3_rope_bias"])
def test_long_prompt_logits_match_transformers(checkpoints, variant):
    """>= 512 positions: wrong RoPE frequencies or scaling show up at long range."""
    path, model = checkpoints.get(variant)
    target = jetspec_jax.load_target(path)
    ids = np.random.default_rng(2).integers(0, target.config.vocab_size, (1, 600))
    ours = np.asarray(target.logits(ids))
    np.testing.assert_allclose(ours, _reference(model, ids).logits.numpy(), atol=TOL, rtol=0)


def test_tap_states_follow_hf_hidden_states_convention(checkpoints):
    """tap layer i is HF's hidden_states[i + 1], in the order requested (last layer: normed)."""
    path, model = checkpoints.get("qwen3")
    target = jetspec_jax.load_target(path)
    ids = np.random.default_rng(3).integers(0, target.config.vocab_size, (2, 11))
    taps = (2, 0, 1)
    out = forward(target.params, target.config, ids, tap_layers=taps)
    hidden_states = _reference(model, ids).hidden_states
    assert out.taps.shape == (3, 2, 11, target.config.hidden_size)
    for got, layer in zip(np.asarray(out.taps), taps, strict=True):
        np.testing.assert_allclose(got, hidden_states[layer + 1].numpy(), atol=TOL, rtol=0)


def test_tap_layers_out_of_range_are_refused(checkpoints):
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    with pytest.raises(ValueError, match="out of range"):
        forward(target.params, target.config, np.zeros((1, 4), np.int32), tap_layers=(3,))


def test_bfloat16_weights_are_rounded_to_nearest_as_torch_rounds_them(checkpoints):
    """A truncating cast would stay within the tolerance below, but lose bitwise agreement with
    HF's own bfloat16 weights."""
    path, model = checkpoints.get("qwen3")
    target = jetspec_jax.load_target(path, dtype="bfloat16")

    def torch_bf16(weight):
        return weight.detach().to(torch.bfloat16).float().numpy()

    q_kernel = target.params["layers"][0]["self_attn"]["q_proj"]["kernel"]
    want = torch_bf16(model.model.layers[0].self_attn.q_proj.weight).T
    np.testing.assert_array_equal(np.asarray(q_kernel).astype(np.float32), want)
    embedding = np.asarray(target.params["embed_tokens"]["embedding"]).astype(np.float32)
    np.testing.assert_array_equal(embedding, torch_bf16(model.model.embed_tokens.weight))


def test_bfloat16_stays_close_to_float32(checkpoints):
    path, _ = checkpoints.get("qwen3")
    ids = np.random.default_rng(4).integers(0, 97, (1, 24))
    fp32 = np.asarray(jetspec_jax.load_target(path).logits(ids))
    bf16_target = jetspec_jax.load_target(path, dtype="bfloat16")
    assert bf16_target.params["embed_tokens"]["embedding"].dtype == np.dtype("bfloat16")
    bf16 = np.asarray(bf16_target.logits(ids))
    assert bf16.dtype == np.float32
    # bf16 keeps ~3 significant digits (measured: 1.4% of the largest logit); the argmax may
    # flip only at near-ties.
    assert np.max(np.abs(bf16 - fp32)) < 0.025 * np.max(np.abs(fp32))
    assert np.mean(bf16.argmax(-1) == fp32.argmax(-1)) >= 0.95


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_5"])
def test_float32_matmuls_ask_for_float32_precision(checkpoints, variant):
    """XLA's default precision lets GPUs use TF32 (TPUs bfloat16 passes) for float32 matmuls;
    CPUs ignore it, so the request itself is what a CPU test can check. bfloat16 keeps the
    default (the hybrid's delta rule asks for HIGHEST in any dtype: its state is float32)."""
    path = checkpoints.get(variant)[0]
    ids = np.zeros((1, 5), np.int32)
    highest = (jax.lax.Precision.HIGHEST,) * 2
    found = {}
    for dtype in ("float32", "bfloat16"):
        target = jetspec_jax.load_target(path, dtype=dtype)

        def logits(params, config=target.config):
            return unembed(params, config, forward(params, config, ids).hidden)

        # The library's own request, not conftest's process-wide "highest".
        with jax.default_matmul_precision("default"):
            jaxpr = jax.make_jaxpr(logits)(target.params).jaxpr
        found[dtype] = set(dot_precisions(jaxpr))
    assert found["float32"] == {highest}
    default = (jax.lax.Precision.DEFAULT,) * 2
    assert found["bfloat16"] - {highest} and found["bfloat16"] <= {None, default, highest}


def test_rope_rotates_a_bfloat16_input_in_bfloat16_as_transformers():
    """transformers casts cos and sin to the input's dtype before the products: a bfloat16 query
    is rotated in bfloat16 (not promoted to float32 by float32 cos and sin)."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16)).astype(jnp.bfloat16)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [100, 2000, 7, 31, 4095]], jnp.int32)
    inv_freq = inverse_frequencies(RopeConfig(theta=10000.0), 16)
    rotated = apply_rope(x, positions, inv_freq)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos = jnp.cos(angles)[:, :, None, :].astype(jnp.bfloat16)
    sin = jnp.sin(angles)[:, :, None, :].astype(jnp.bfloat16)
    x1, x2 = x[..., :8], x[..., 8:]
    expected = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    assert rotated.dtype == jnp.bfloat16
    np.testing.assert_array_equal(rotated.astype(jnp.float32), expected.astype(jnp.float32))
