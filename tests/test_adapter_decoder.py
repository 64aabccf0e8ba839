"""The decoder (target layers above the deepest tap) and the adapter (predicted tap states)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import adapter_config, init_adapter
from jetspec_jax.decoding.proxy import LearnedProxy
from jetspec_jax.models import adapter, decoder
from jetspec_jax.models.transformer import forward, unembed

PROMPT, BLOCK = 11, 6


@pytest.fixture(scope="module", params=["qwen3", "llama3_rope_bias", "qwen3_5"])
def any_target(request, checkpoints):
    # qwen3_5: upper layers with recurrent (Gated DeltaNet) state.
    return jetspec_jax.load_target(checkpoints.get(request.param)[0])


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


def _sequence(batch=2, length=PROMPT + BLOCK, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 97, (batch, length)), jnp.int32)


@pytest.mark.parametrize("taps", [(0, 1), (0, 2)])
def test_decoder_on_true_states_gives_the_target_logits(any_target, taps):
    """Fed the target's own deepest-tap states, the decoder reproduces the target's logits, for
    a context filled in two ragged steps (prompt, then a partly committed block)."""
    cfg, params = any_target.config, any_target.params
    tokens = _sequence()
    full = forward(params, cfg, tokens, tap_layers=taps)
    want = unembed(params, cfg, full.hidden)
    first = taps[-1] + 1
    states = full.taps[-1]

    cache = decoder.empty_cache(cfg, first, 2, 32, jnp.float32)
    lengths = jnp.asarray([PROMPT, PROMPT - 3])
    extend = jax.jit(decoder.extend_context, static_argnums=(1, 2))
    cache = extend(params, cfg, first, cache, states[:, :PROMPT], lengths)
    blocks = jnp.stack([states[b, int(n) : int(n) + BLOCK] for b, n in enumerate(lengths)])
    logits = jax.jit(decoder.decoder_logits, static_argnums=(1, 2))
    got, written = logits(params, cfg, first, cache, blocks)  # rows start at their own lengths
    for b, n in enumerate(lengths.tolist()):
        np.testing.assert_allclose(got[b], want[b, n : n + BLOCK], atol=1e-4, rtol=1e-4)
    # The returned cache: the block's rows written past the lengths, as extending would write
    # them, but nothing committed.
    np.testing.assert_array_equal(written.lengths, lengths)
    extended = extend(params, cfg, first, cache, blocks, jnp.asarray([BLOCK, BLOCK]))
    np.testing.assert_array_equal(written.k, extended.k)
    np.testing.assert_array_equal(written.v, extended.v)
    for name in ("conv", "state", "start", "block_conv"):  # a hybrid's recurrence: unadvanced
        if hasattr(cache, name):
            np.testing.assert_array_equal(getattr(written, name), getattr(cache, name))


def test_the_learned_proxy_made_exact_predicts_the_target_logits(target, monkeypatch):
    """The proxy's wiring, with the adapter made exact (its predicted states replaced by the
    target's own): its decoder starts above the deepest tap, its context holds that tap's
    states, and it reads that tap's predictions, so its logits are the target's."""
    taps = (0, 1)  # of the tiny target's 3 layers: the decoder runs the last
    tokens = _sequence(batch=1)
    full = forward(target.params, target.config, tokens, tap_layers=taps)
    want = unembed(target.params, target.config, full.hidden)[0, PROMPT:]
    config, params = _adapter(target, taps=taps, per_module=(1, 1))
    proxy = LearnedProxy(config, target.config)
    state = proxy.extend(
        params,
        target.params,
        proxy.empty(params, target.params, 1, 32),
        tokens[:, :PROMPT],
        full.taps[:, :, :PROMPT],
        jnp.asarray([PROMPT]),
    )
    monkeypatch.setattr(adapter, "predict_states", lambda *args: full.taps[:, :, PROMPT:])
    predicted, logits, _ = proxy.predict(params, target.params, state, tokens[:, PROMPT:])
    np.testing.assert_array_equal(predicted, full.taps[:, :, PROMPT:])
    np.testing.assert_allclose(logits[0], want, atol=1e-4, rtol=1e-4)


def _adapter(target, taps=(0, 1, 2), per_module=(1, 2, 1), std=0.05):
    draft = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=taps, block_size=BLOCK)
    made = init_adapter(draft, layers_per_module=per_module, init_std=std)
    return made.config, made.params


def _adapter_layers(target_config):
    from jetspec_jax.draft import layers_like_target

    return layers_like_target(target_config, 1, None, None, None, None)


def test_adapter_config_is_the_architecture_init_adapter_builds(target):
    """A warm start compares a saved adapter with `adapter_config`, not with a random adapter."""
    draft = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=(0, 2), block_size=4)
    for settings in (dict(), dict(layers_per_module=(2, 1), intermediate_size=24)):
        assert adapter_config(draft, **settings) == init_adapter(draft, **settings).config


@pytest.mark.parametrize(
    "seed, message",
    [
        (-1, "seed must be an integer >= 0, got -1"),  # jax.random.key: 2**32 - 1's key
        (2**32 + 5, "seed must be in \\[0, 2\\*\\*32\\)"),  # jax.random.key: 5's key
        (2**63, "seed must be in \\[0, 2\\*\\*32\\)"),  # jax.random.key: an OverflowError
        (True, "seed must be an integer >= 0, got True"),
        (1.5, "seed must be an integer >= 0, got 1.5"),
    ],
)
def test_init_adapter_names_a_bad_seed(target, seed, message):
    """Refused as `init_draft` refuses it, not drawn with another seed's key."""
    draft = jetspec_jax.init_draft(target, num_layers=1, target_layer_ids=(0, 2), block_size=4)
    with pytest.raises(ValueError, match=message):
        init_adapter(draft, seed=seed)


def test_adapter_decode_path_equals_training_path(target):
    """Predicting a block from the incremental context cache == the all-anchors training
    forward at that block's anchor (both are causal and see only the context before it)."""
    cfg = target.config
    config, params = _adapter(target)
    tokens = _sequence(batch=1, length=24, seed=1)
    emb = target.params["embed_tokens"]["embedding"]
    taps = forward(target.params, cfg, tokens, tap_layers=config.target_layer_ids).taps
    levels = adapter.context_levels(emb, tokens, taps)
    anchors = jnp.asarray([[4, 9, 15]])
    blocks = jnp.stack([tokens[:, a : a + BLOCK] for a in (4, 9, 15)], axis=1)
    training = jax.jit(adapter.predict_states_for_training, static_argnums=1)
    together = training(params, config, emb, levels, blocks, anchors)

    @jax.jit
    def alone(block, anchor):  # the context is the first `anchor` positions (the rest: stale)
        cache = adapter.empty_cache(config, 1, 32, jnp.float32)
        cache = adapter.extend_context(params, config, cache, levels, anchor[None])
        return adapter.predict_states(params, config, cache, emb, block)

    for i, a in enumerate((4, 9, 15)):
        np.testing.assert_allclose(together[:, :, i], alone(blocks[:, i], a), atol=2e-5)


def test_adapter_is_causal(target):
    """Changing a later block token never changes an earlier position's predicted states."""
    config, params = _adapter(target, std=0.2)
    tokens = _sequence(batch=1, length=20, seed=2)
    emb = target.params["embed_tokens"]["embedding"]
    taps = forward(target.params, target.config, tokens, tap_layers=config.target_layer_ids).taps
    cache = adapter.empty_cache(config, 1, 32, jnp.float32)
    levels = adapter.context_levels(emb, tokens, taps)
    cache = adapter.extend_context(params, config, cache, levels[:, :, :12], jnp.asarray([12]))
    block = tokens[:, 12:18]
    changed = block.at[:, 3].set((block[:, 3] + 1) % 97)
    predict = jax.jit(adapter.predict_states, static_argnums=1)
    a = predict(params, config, cache, emb, block)
    b = predict(params, config, cache, emb, changed)
    np.testing.assert_allclose(a[:, :, :3], b[:, :, :3], atol=1e-6)
    assert not np.allclose(a[:, :, 3:], b[:, :, 3:], atol=1e-4)


def test_adapter_config_refusals(target):
    layers = _adapter_layers(target.config)
    with pytest.raises(ValueError, match="one entry per tap"):
        adapter.AdapterConfig(layers, (0, 1), (1,))
    with pytest.raises(ValueError, match="strictly increasing"):
        adapter.AdapterConfig(layers, (1, 0), (1, 1))
    with pytest.raises(ValueError, match=">= 1 layer"):
        adapter.AdapterConfig(layers, (0, 1), (1, 0))
    with pytest.raises(ValueError, match="strictly increasing"):
        adapter.AdapterConfig(layers, (1, 1), (1, 1))  # a tap twice


def test_draft_and_adapter_layers_must_be_qwen3_and_only_the_hybrid_rotates_partially(target):
    """The draft's and adapter's block stack runs Qwen3 layers, and only the hybrid's attention
    applies `partial_rotary_factor`: other configs would construct and then compute wrongly."""
    import dataclasses

    from jetspec_jax.models.draft import DraftConfig

    llama = dataclasses.replace(_adapter_layers(target.config), model_type="llama")
    with pytest.raises(ValueError, match="adapter layers must be model_type 'qwen3'"):
        adapter.AdapterConfig(llama, (0, 1), (1, 1))
    with pytest.raises(ValueError, match="draft layers must be model_type 'qwen3'"):
        DraftConfig(llama, target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is only supported for qwen3_5"):
        dataclasses.replace(target.config, partial_rotary_factor=0.5)


def test_configs_given_lists_are_hashable_static_arguments(target):
    """Lists construct; as jit static arguments they must hash, and equal the tuple form."""
    import dataclasses

    from jetspec_jax.models.draft import DraftConfig

    layers = _adapter_layers(target.config)
    config = adapter.AdapterConfig(layers, [0, 1], [1, 1])
    assert hash(config) == hash(adapter.AdapterConfig(layers, (0, 1), (1, 1)))
    draft = DraftConfig(layers, target_layer_ids=[0, 1])
    assert draft == DraftConfig(layers, target_layer_ids=(0, 1)) and hash(draft)
    hybrid = dataclasses.replace(
        layers, model_type="qwen3_5", layer_types=["full_attention"] * layers.num_layers
    )
    assert hash(hybrid) and isinstance(hybrid.layer_types, tuple)


def test_the_adapter_contexts_are_the_embedding_then_every_tap_but_the_deepest():
    """Module m reads level m - 1: the token embedding for module 1, tap m - 1 after it."""
    embedding = jnp.arange(5 * 3, dtype=jnp.float32).reshape(5, 3)
    tokens = jnp.asarray([[4, 0], [2, 2]], jnp.int32)
    taps = jnp.stack([jnp.full((2, 2, 3), float(100 + i)) for i in range(3)])  # [3, B, T, H]
    levels = np.asarray(adapter.context_levels(embedding, tokens, taps))
    assert levels.shape == (3, 2, 2, 3)
    np.testing.assert_array_equal(levels[0], np.asarray(embedding)[np.asarray(tokens)])
    np.testing.assert_array_equal(levels[1:], np.asarray(taps[:-1]))


def test_the_decoder_reads_states_in_its_cache_dtype(checkpoints):
    """The upper layers run on states cast to the cache's dtype (the target's numerics): float32
    predictions over a bfloat16 cache give exactly the logits of the same states in bfloat16."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    config, params = target.config, target.params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 12)), jnp.int32)
    states = forward(params, config, tokens, tap_layers=(0,)).taps[-1]  # float32
    cache = decoder.empty_cache(config, 1, 2, 32, jnp.bfloat16)
    cache = decoder.extend_context(params, config, 1, cache, states[:, :8], jnp.asarray([8, 6]))
    block = states[:, 8:12] + 1e-3 * jnp.arange(4, dtype=jnp.float32)[None, :, None]
    got, _ = decoder.decoder_logits(params, config, 1, cache, block)
    want, _ = decoder.decoder_logits(params, config, 1, cache, block.astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
