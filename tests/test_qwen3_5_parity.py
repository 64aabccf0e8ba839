"""fp32 parity of the Qwen3.5 hybrid (Gated DeltaNet + gated attention) with transformers."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.hf_config import config_from_hf, config_to_hf
from jetspec_jax.models.transformer import forward, init_cache, unembed
from tests.tiny_models import near_bigram, with_target_norm

TOL = 1e-4
CHUNK = 64  # gated_deltanet.DEFAULT_CHUNK


@pytest.fixture(scope="module")
def hybrid(checkpoints):
    path, model = checkpoints.get("qwen3_5")
    return path, model, jetspec_jax.load_target(path)


@functools.partial(jax.jit, static_argnames=("config",))
def append(params, tokens, cache, num_new, *, config):
    """`(logits, cache)` after appending `tokens` `[B, T]` (`num_new` real per row); shared with
    the rollback tests so that one session compiles each shape once."""
    out = forward(params, config, tokens, cache, num_new=num_new)
    return unembed(params, config, out.hidden), out.cache


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)), output_hidden_states=True)


def test_full_forward_and_taps_match_transformers_beyond_a_chunk(hybrid):
    """Two chunks of the recurrence (80 > 64 positions), many conv windows, two rows; tap i is
    HF's hidden_states[i + 1] (DeltaNet, attention, and the final-normed last layer)."""
    _, model, target = hybrid
    ids = np.random.default_rng(1).integers(0, 97, (2, CHUNK + 16))
    reference = _reference(model, ids)
    np.testing.assert_allclose(
        np.asarray(target.logits(ids)), reference.logits.numpy(), atol=TOL, rtol=0
    )
    taps = (3, 0, 1)
    out = jax.jit(forward, static_argnames=("config", "tap_layers"))(
        target.params, target.config, ids, tap_layers=taps
    )
    for got, layer in zip(np.asarray(out.taps), taps, strict=True):
        want = reference.hidden_states[layer + 1].numpy()
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"tap {layer}")


def test_a_bfloat16_hybrid_runs_alike_under_x64_and_strict_promotion(hybrid):
    """docs/DECODING.md: a process may set `jax_enable_x64` and strict dtype promotion. A
    bfloat16 target's gated norm multiplied its float32 scale by bfloat16 activations, which
    strict promotion refused (TypePromotionError in every forward)."""
    target = jetspec_jax.load_target(hybrid[0], dtype="bfloat16")
    ids = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)
    want = np.asarray(target.logits(ids))
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        got = np.asarray(target.logits(ids))
    np.testing.assert_array_equal(got, want)


def test_prefill_then_blocks_then_single_steps_match_transformers(hybrid):
    """Right-padded prefill (rows of 70, 3 and 20 tokens: beyond a chunk, shorter than the conv
    window), an 8-token block, then one token at a time; every logit equals HF's full forward over
    the row's real tokens, so padding never leaked into a state."""
    _, model, target = hybrid
    params, config = target.params, target.config
    rng = np.random.default_rng(2)
    lengths = np.array([70, 3, 20])
    seqs = rng.integers(0, 97, (3, 90))
    prompts = np.where(np.arange(80)[None] < lengths[:, None], seqs[:, :80], 0)
    cache = init_cache(config, 3, 128, jnp.float32)
    logits, cache = append(params, prompts, cache, jnp.asarray(lengths), config=config)
    got = {b: [np.asarray(logits[b, : lengths[b]])] for b in range(3)}
    pos = lengths.copy()
    for width in (8, 1, 1):
        block = np.stack([seqs[b, pos[b] : pos[b] + width] for b in range(3)])
        logits, cache = append(params, block, cache, jnp.full((3,), width), config=config)
        for b in range(3):
            got[b].append(np.asarray(logits[b]))
        pos = pos + width
    assert np.asarray(cache.lengths).tolist() == pos.tolist()
    for b in range(3):
        ref = _reference(model, seqs[b : b + 1, : pos[b]]).logits.numpy()[0]
        np.testing.assert_allclose(np.concatenate(got[b]), ref, atol=TOL, rtol=0)


def test_tied_head_and_attention_bias_match_transformers(checkpoints):
    path, model = checkpoints.get("qwen3_5_tied")
    target = jetspec_jax.load_target(path)
    assert target.config.tie_word_embeddings and "lm_head" not in target.params
    ids = np.random.default_rng(4).integers(0, 97, (1, 23))
    np.testing.assert_allclose(
        np.asarray(target.logits(ids)), _reference(model, ids).logits.numpy(), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("variant", ["qwen3_5_attention_only", "qwen3_5_deltanet_only"])
def test_a_hybrid_of_one_layer_kind_matches_transformers_and_decodes_as_ar(checkpoints, variant):
    """A Qwen3.5 checkpoint whose layers are all attention or all Gated DeltaNet: the other
    kind's stack and cache are empty. Its logits are HF's (without HF's cache, which needs an
    attention layer), and JetSpec++ with refreshes and foresight (the adapter, the draft-ahead
    caches, rollbacks after partly accepted blocks) gives AR's greedy tokens."""
    path, model = checkpoints.get(variant)
    target = jetspec_jax.load_target(path)
    ids = np.random.default_rng(5).integers(0, 97, (2, 21))
    with torch.no_grad():
        want = model(torch.tensor(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(np.asarray(target.logits(ids)), want, atol=TOL, rtol=0)

    target = near_bigram(target)
    draft = jetspec_jax.init_draft(target, num_layers=1, block_size=4, init_std=0.02, seed=4)
    draft = with_target_norm(draft, target)
    draft = draft.with_adapter(init_adapter(draft))
    prompt, budget = [5, 17, 3, 60, 2], 16
    ar = jetspec_jax.generate(target, prompt, max_new_tokens=budget, stop_token_ids=[])
    speculative = jetspec_jax.generate(
        target,
        prompt,
        draft=draft,
        max_new_tokens=budget,
        stop_token_ids=[],
        method="jetspec++",
        refine_passes=1,
        refreshes=1,
        foresight=2,
        foresight_rule="uncalibrated",
    )
    assert speculative.tokens == ar.tokens
    accepted = [k for k, _ in speculative.outcomes]
    assert max(accepted) > 0 and min(accepted) < 3, accepted  # some accepted, some rejected


def test_multimodal_checkpoint_loads_its_text_model(hybrid, tmp_path):
    """The released layout: `qwen3_5` config with text_config, `model.language_model.*` weights,
    a vision tower and an MTP head (both skipped). Its token ids are in text_config: transformers'
    `generate` stops on that eos (with no generation_config.json), and so do we and our export."""
    path, _, target = hybrid
    text = json.loads((path / "config.json").read_text())
    text.update(bos_token_id=1, eos_token_id=5)
    hf = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in safetensors.numpy.load_file(path / "model.safetensors").items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    loaded = jetspec_jax.load_target(tmp_path)
    assert loaded.config == target.config
    ids = np.random.default_rng(5).integers(0, 97, (2, CHUNK + 16))  # the compiled shape
    np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(target.logits(ids)))
    reference = transformers.GenerationConfig.from_model_config(
        transformers.AutoConfig.from_pretrained(tmp_path)
    )
    assert (reference.eos_token_id, reference.bos_token_id) == (5, 1)
    assert loaded.stop_token_ids == (5,)
    exported = json.loads((loaded.save(tmp_path / "export") / "config.json").read_text())
    assert (exported["eos_token_id"], exported["bos_token_id"]) == ([5], 1)
    # A tensor under both spellings: which copy is meant would be a guess.
    tensors["model.norm.weight"] = tensors["model.language_model.norm.weight"]
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight is stored under both"):
        jetspec_jax.load_target(tmp_path)


def test_missing_tensor_and_unsupported_options_are_named(hybrid, tmp_path):
    path, _, target = hybrid
    text = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(text))
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    del tensors["model.layers.2.linear_attn.A_log"]
    tensors["model.layers.2.linear_attn.conv1d.bias"] = np.zeros((7,), np.float32)
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        jetspec_jax.load_target(tmp_path)
    assert "model.layers.2.linear_attn.A_log" in str(err.value)
    assert "model.layers.2.linear_attn.conv1d.bias" in str(err.value)
    with pytest.raises(CheckpointError, match="attn_output_gate"):
        config_from_hf({**text, "attn_output_gate": False})
    with pytest.raises(CheckpointError, match="layer types"):
        config_from_hf({**text, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(CheckpointError, match="text_config"):
        config_from_hf({"model_type": "qwen3_5"})


def test_config_layouts_and_export_round_trip(hybrid):
    """transformers-4 layout (top-level rope_theta / partial_rotary_factor, mrope scaling, layer
    types from full_attention_interval) reads as the -5 layout; export reads back the same."""
    path, _, target = hybrid
    v5 = json.loads((path / "config.json").read_text())
    assert config_from_hf(config_to_hf(target.config)) == target.config
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 0]},
        full_attention_interval=2,
    )
    config = config_from_hf(v4)
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.rope == target.config.rope and config.rotary_dim == 4
