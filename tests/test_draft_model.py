"""The draft head: fp32 parity with `dflash.model.DFlashDraftModel` over two cached rounds,
export/import in the DFlash/JetSpec HF layout, every refusal of a mismatched draft, `init_draft`."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from dflash import model as dflash_model

from jetspec_jax import CheckpointError, generate, load_target
from jetspec_jax.checkpoint.draft_hf import draft_config_from_hf, draft_config_to_hf
from jetspec_jax.draft import default_target_layer_ids, draft_config, init_draft, load_draft
from jetspec_jax.models.draft import DraftConfig, draft_hidden, draft_logits, empty_cache
from jetspec_jax.models.draft import extend_context as extend_draft_context
from jetspec_jax.models.transformer import forward

TOL = 1e-4
BLOCK = 8
MASK = 96
PROMPT = 10  # round 1: context rows 0..9, block at positions 10..17
EXTRA = 3  # round 2: context rows 10..12, block at positions 13..20
PAD = 2  # round 2 passes EXTRA + PAD rows, of which PAD are padding (as a batched decode loop)
TOKENS = np.random.default_rng(0).integers(0, MASK, (1, PROMPT + EXTRA + PAD))


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def torch_target(checkpoints):
    return checkpoints.get("qwen3")[1]


def _reference_draft(
    causal: bool, *, vocab_size, mask_token_id, block_size, initializer_range, **options
) -> dflash_model.DFlashDraftModel:
    """A random reference draft over taps [0, 2] of a 3-layer target, norms randomised (they
    start at 1) so that each one matters; `options`: extra `dflash_config` entries."""
    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=initializer_range,
        num_target_layers=3,
        block_size=block_size,
        dflash_config={
            "mask_token_id": mask_token_id,
            "target_layer_ids": [0, 2],
            "causal_head": causal,
            **options,
        },
        is_causal=causal,
    )
    model = dflash_model.DFlashDraftModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def reference_drafts(tmp_path_factory):
    """`get(causal, **options)` -> (dir, model): a random reference draft saved with
    `save_pretrained` (`options`: extra `dflash_config` entries, e.g. `output_multiplier`)."""
    made = {}

    def get(causal: bool, **options):
        key = (causal, *sorted(options.items()))
        if key not in made:
            torch.manual_seed(int(causal))
            model = _reference_draft(
                causal,
                vocab_size=97,
                mask_token_id=MASK,
                block_size=BLOCK,
                initializer_range=0.1,  # peaked logits: a wrong mask or position shows clearly
                **options,
            )
            path = tmp_path_factory.mktemp("drafts") / f"causal_{causal}"
            model.save_pretrained(path)
            made[key] = (path, model)
        return made[key]

    return get


def _blocks(
    config: DraftConfig, tokens=TOKENS, prompt=PROMPT, extra=EXTRA, seed=1
) -> list[np.ndarray]:
    """The two rounds' `[1, K]` blocks: the anchor, then mask tokens or (token inputs) tokens."""
    anchors = [tokens[0, prompt], tokens[0, prompt + extra]]
    if config.token_inputs:
        rest = np.random.default_rng(seed).integers(0, MASK, (2, BLOCK - 1))
    else:
        rest = np.full((2, BLOCK - 1), config.mask_token_id)
    return [np.concatenate([[a], r])[None] for a, r in zip(anchors, rest, strict=True)]


def _taps(target, config: DraftConfig, tokens=TOKENS) -> jax.Array:
    """`[n_taps, 1, T, H]` target tap states of `tokens`."""
    return forward(target.params, target.config, tokens, tap_layers=config.target_layer_ids).taps


def _draft_rounds(draft, target, extensions, blocks, *, jit=False) -> list[np.ndarray]:
    """Our logits, round by round: extend the cache with `extensions[i]` = (tap rows
    `[n_taps, B, T, H]`, num_new `[B]`), then run block `blocks[i]` `[B, K]`. (`jit`: one
    compile per config and shape, cheaper than op-by-op dispatch for shapes not seen before.)"""
    config = draft.config
    cache = empty_cache(config, blocks[0].shape[0], 32, jnp.float32)
    embedding = target.params["embed_tokens"]["embedding"]
    lm_head = target.params["lm_head"]["kernel"]
    step = _jitted_round if jit else _round
    out = []
    for (rows, num_new), block in zip(extensions, blocks, strict=True):
        cache, logits = step(
            draft.params, config, cache, rows, jnp.array(num_new), embedding, lm_head, block
        )
        out.append(np.asarray(logits))
    return out


def _round(params, config, cache, rows, num_new, embedding, lm_head, block):
    cache = extend_draft_context(params, config, cache, rows, num_new)
    hidden = draft_hidden(params, config, cache, embedding, jnp.asarray(block))
    return cache, draft_logits(config, lm_head, hidden)


_jitted_round = jax.jit(_round, static_argnames="config")


def _our_logits(draft, target, taps, blocks) -> list[np.ndarray]:
    """Batch 1: round 1 extends by PROMPT rows, round 2 by EXTRA real rows of EXTRA + PAD."""
    extensions = [(taps[:, :, :PROMPT], [PROMPT]), (taps[:, :, PROMPT:], [EXTRA])]
    return _draft_rounds(draft, target, extensions, blocks)


def _reference_logits(
    model, torch_target, taps, blocks, prompt=PROMPT, extra=EXTRA
) -> list[np.ndarray]:
    """The reference's two rounds (one sequence), with its cache handled exactly as
    `dflash_generate` does: round 1 appends context rows [0, prompt), round 2 the next `extra`."""
    context = torch.tensor(np.asarray(jnp.concatenate(list(taps), axis=-1)))
    positions = torch.arange(prompt + extra + BLOCK)[None]
    cache = dflash_model._make_cache(model.config)
    head = dflash_model._output_head(torch_target)
    scale = float(dflash_model._draft_value(model.config, "input_embedding_scale", 1.0))
    out = []
    with torch.no_grad():
        for (begin, end), block in zip(
            [(0, prompt), (prompt, prompt + extra)], blocks, strict=True
        ):
            # Positions cover the new context rows and the block; the call appends both to the
            # cache, and the crop drops the block again.
            hidden = model(
                target_hidden=context[:, begin:end],
                noise_embedding=dflash_model._raw_input_embeddings(
                    torch_target, torch.from_numpy(block), scale
                ),
                position_ids=positions[:, begin : end + BLOCK],
                past_key_values=cache,
                use_cache=True,
            )
            dflash_model._crop_to(cache, end)
            out.append(model.compute_logits(hidden, head).numpy())
    return out


def _assert_rounds_close(ours, reference):
    for round_, (got, want) in enumerate(zip(ours, reference, strict=True), start=1):
        assert got.shape == want.shape == (1, BLOCK, 97), round_
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"round {round_}")


@pytest.mark.parametrize("causal", [True, False])
def test_draft_matches_dflash_reference_over_two_cached_rounds(
    reference_drafts, target, torch_target, causal
):
    path, model = reference_drafts(causal)
    draft = load_draft(path, target)
    assert draft.config.causal is causal
    assert draft.config.variant == ("jetspec" if causal else "dflash")
    assert (draft.config.target_layer_ids, draft.config.block_size) == ((0, 2), BLOCK)
    taps, blocks = _taps(target, draft.config), _blocks(draft.config)
    reference = _reference_logits(model, torch_target, taps, blocks)
    _assert_rounds_close(_our_logits(draft, target, taps, blocks), reference)

    # The within-block mask matters here: the other setting is far off (except on the last row,
    # which sees the whole block either way).
    flipped = dataclasses.replace(
        draft, config=dataclasses.replace(draft.config, causal=not causal)
    )
    wrong = _our_logits(flipped, target, taps, blocks)[1]
    assert np.abs(wrong[:, :-1] - reference[1][:, :-1]).max() > 100 * TOL


# Row 1 of the ragged batch: a shorter prompt (round 1 passes PROMPT rows, PROMPT_1 of them real)
# and a longer round-2 extension with no padding (EXTRA_1 = EXTRA + PAD real rows).
PROMPT_1, EXTRA_1 = 6, EXTRA + PAD


@pytest.mark.parametrize("causal", [True, False])
def test_a_ragged_batch_matches_the_reference_row_by_row(
    reference_drafts, target, torch_target, causal
):
    """Two rows of different lengths, cached over two rounds with different num_new and padding
    per row: each row's logits are the reference's for that row's sequence alone. Padding rows
    hold noise, so a row that read past its own length (or at another row's) shows."""
    path, model = reference_drafts(causal)
    draft = load_draft(path, target)
    tokens_1 = np.random.default_rng(2).integers(0, MASK, (1, PROMPT_1 + EXTRA_1 + 1))
    rows = [(TOKENS, PROMPT, EXTRA), (tokens_1, PROMPT_1, EXTRA_1)]
    taps = [np.asarray(_taps(target, draft.config, t)) for t, _, _ in rows]
    blocks = [_blocks(draft.config, t, p, e, seed=1 + i) for i, (t, p, e) in enumerate(rows)]
    reference = [
        _reference_logits(model, torch_target, jnp.asarray(tap), block, p, e)
        for tap, block, (_, p, e) in zip(taps, blocks, rows, strict=True)
    ]

    noise = np.random.default_rng(3).normal(
        0.0, taps[0].std(), (taps[0].shape[0], 2, PROMPT + EXTRA + PAD, taps[0].shape[-1])
    )
    round_1, round_2 = noise[:, :, :PROMPT].copy(), noise[:, :, PROMPT:].copy()
    round_1[:, 0] = taps[0][:, 0, :PROMPT]
    round_1[:, 1, :PROMPT_1] = taps[1][:, 0, :PROMPT_1]
    round_2[:, 0, :EXTRA] = taps[0][:, 0, PROMPT : PROMPT + EXTRA]
    round_2[:, 1] = taps[1][:, 0, PROMPT_1 : PROMPT_1 + EXTRA_1]
    extensions = [
        (jnp.asarray(round_1, jnp.float32), [PROMPT, PROMPT_1]),
        (jnp.asarray(round_2, jnp.float32), [EXTRA, EXTRA_1]),
    ]
    batched = [np.concatenate(pair) for pair in zip(*blocks, strict=True)]
    ours = _draft_rounds(draft, target, extensions, batched, jit=True)
    for row in range(2):
        _assert_rounds_close([got[row : row + 1] for got in ours], reference[row])


@pytest.mark.parametrize("causal", [True, False])
def test_decoding_equals_dflash_generate(checkpoints, tmp_path, monkeypatch, causal):
    """End to end against the reference's own loop, `dflash.model.dflash_generate`: the same
    tokens, and the same acceptance length every round whose full block fits in the budget. In
    the last rounds the reference drafts a shorter block, which changes a bidirectional draft's
    drafts; ours drafts the full block as trained (a causal draft's drafts are the same either
    way). A vocabulary of 8 makes a random draft right often enough that rounds accept more
    than one token (the check asserts they do)."""
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # its stats time on CUDA
    target_path, torch_target = checkpoints.get("qwen3_vocab8")
    target = load_target(target_path)
    torch.manual_seed(3)
    model = _reference_draft(
        causal, vocab_size=8, mask_token_id=7, block_size=4, initializer_range=0.3
    )
    model.save_pretrained(tmp_path / "draft")
    draft = load_draft(tmp_path / "draft", target)
    accepted = []
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, 8, 9).tolist()
        with torch.no_grad():
            reference = dflash_model.dflash_generate(
                model, torch_target, torch.tensor([prompt]), 24, None, return_stats=True
            )
        ours = generate(
            target,
            prompt,
            draft=draft,
            method=draft.config.variant,
            max_new_tokens=24,
            stop_token_ids=[],
        )
        assert ours.tokens == reference.output_ids[0, len(prompt) :].tolist(), seed
        ours_rounds, rounds = ours.acceptance_lengths[1:], list(reference.acceptance_lengths)
        if not causal:  # the rounds whose full block fits in the budget
            starts = len(prompt) + np.cumsum([0, *rounds[:-1]])  # the reference's `start`
            fits = int(np.sum(starts + 4 <= len(prompt) + 24))
            ours_rounds, rounds = ours_rounds[:fits], rounds[:fits]
        assert ours_rounds == rounds, seed
        accepted += ours.acceptance_lengths[1:]
    assert max(accepted) > 1


def test_logit_and_embedding_options_match_the_reference(reference_drafts, target, torch_target):
    """`input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` load from the
    checkpoint and act as the reference's do (multiplier before the cap); each one matters."""
    options = dict(input_embedding_scale=1.5, output_multiplier=2.0, final_logit_softcapping=5.0)
    path, model = reference_drafts(True, **options)
    draft = load_draft(path, target)
    assert {name: getattr(draft.config, name) for name in options} == options
    taps, blocks = _taps(target, draft.config), _blocks(draft.config)
    reference = _reference_logits(model, torch_target, taps, blocks)
    _assert_rounds_close(_our_logits(draft, target, taps, blocks), reference)
    assert np.abs(reference[1]).max() > 0.6 * options["final_logit_softcapping"]  # the cap bends

    # Each option matters: the reference without it is far off.
    for name in options:
        without = copy.deepcopy(model)
        without.config.dflash_config = {
            k: v for k, v in without.config.dflash_config.items() if k != name
        }
        wrong = _reference_logits(without, torch_target, taps, blocks)[1]
        assert np.abs(wrong - reference[1]).max() > 100 * TOL, name


@pytest.mark.parametrize("variant", ["jetspec", "jetspec++"])
def test_export_loads_in_dflash_with_the_same_logits(target, torch_target, tmp_path, variant):
    draft = init_draft(target, variant=variant, num_layers=2, init_std=0.1, seed=3)
    out = draft.save(tmp_path / "draft")
    model, info = dflash_model.DFlashDraftModel.from_pretrained(out, output_loading_info=True)
    model = model.float().eval()
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert model.layers[0].self_attn.is_causal is True
    assert list(model.target_layer_ids) == list(draft.config.target_layer_ids)
    assert (model.block_size, model.mask_token_id) == (16, draft.config.mask_token_id)

    taps, blocks = _taps(target, draft.config), _blocks(draft.config)
    _assert_rounds_close(
        _our_logits(draft, target, taps, blocks),
        _reference_logits(model, torch_target, taps, blocks),
    )

    again = load_draft(out, target)
    assert again.config == draft.config
    assert jax.tree.structure(again.params) == jax.tree.structure(draft.params)
    for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(draft.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_export_round_trips(checkpoints, tmp_path):
    target = load_target(checkpoints.get("qwen3")[0], dtype="bfloat16")
    draft = init_draft(target, variant="dflash")
    assert draft.params["fc"]["kernel"].dtype == jnp.bfloat16
    out = draft.save(tmp_path / "bf16")
    # The file says so too: `from_pretrained(dtype="auto")` (the reference's loader) reads it.
    hf = json.loads((out / "config.json").read_text())
    assert (hf["dtype"], hf["torch_dtype"]) == ("bfloat16", "bfloat16")
    again = load_draft(out, target)
    assert again.dtype == "bfloat16" and again.config == draft.config
    for got, want in zip(jax.tree.leaves(again.params), jax.tree.leaves(draft.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_export_refuses_to_overwrite(target, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_draft(target).save(tmp_path / "taken")


# --- refusals ---------------------------------------------------------------------------------


def _copy(reference_drafts, tmp_path):
    path = tmp_path / "draft"
    shutil.copytree(reference_drafts(True)[0], path)
    return path


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _set_dflash(**changes):
    return lambda config: config["dflash_config"].update(changes)


def _drop(key):
    return lambda config: config.pop(key)


def _set(**changes):
    return lambda config: config.update(changes)


@pytest.mark.parametrize(
    "edit, message",
    [
        (_set(hidden_size=32), "draft hidden_size 32 != target hidden_size 64"),
        (_set(vocab_size=98), "draft vocab_size 98 != target vocab_size 97"),
        (_set(num_target_layers=4), "draft num_target_layers 4 != the target's 3 layers"),
        (
            _set_dflash(target_layer_ids=[0, 3]),
            r"target_layer_ids \[0, 3\]: \[3\] outside the target's layers \[0, 3\)",
        ),
        (_set_dflash(mask_token_id=97), r"mask_token_id 97 is outside .* \[0, 97\)"),
        (_set_dflash(mask_token_id=None), r"lacks the required field\(s\) mask_token_id"),
        (_drop("block_size"), r"lacks the required field\(s\) block_size"),
        (
            _set_dflash(target_layer_ids=None),
            r"target_layer_ids .* the reference's default taps for this config would be \[1, 0\]",
        ),
        (  # no draft layers: no default taps to suggest (it used to raise a bare ValueError)
            lambda c: _set(num_hidden_layers=0)(c) or _set_dflash(target_layer_ids=None)(c),
            r"lacks the required field\(s\) target_layer_ids \(in dflash_config or at the top "
            r"level\)$",
        ),
        (_drop("num_target_layers"), "lacks the required field 'num_target_layers'"),
        (_drop("hidden_size"), "lacks the required field 'hidden_size'"),
        (_set(model_type="llama"), "must have model_type 'qwen3', got 'llama'"),
        (_set(layer_types=["full_attention", "sliding_attention"]), r"layers \[1\] are not"),
        (  # every layer from max_window_layers on slides
            _set(use_sliding_window=True, sliding_window=4, layer_types=None, max_window_layers=0),
            "sliding-window",
        ),
        (
            _set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            "unsupported rope scaling type 'yarn'",
        ),
        (_set(is_causal=False), "causal_head=True contradicts is_causal=False"),
        (_set_dflash(block_size=16), r"dflash_config\.block_size=16 and block_size=8"),
        (_set_dflash(block_size=8), None),  # the same value in both places is fine
        (  # the reference takes dflash_config's null: no cap, whatever the top level says
            lambda c: (
                _set_dflash(final_logit_softcapping=None)(c) or _set(final_logit_softcapping=5.0)(c)
            ),
            r"dflash_config\.final_logit_softcapping=None and final_logit_softcapping=5\.0",
        ),
        (_set_dflash(input_mode="noise"), "input_mode must be one of mask, tokens, got 'noise'"),
        (_set_dflash(prediction="shifted"), "none of the published variants"),
        (_set_dflash(output_multiplier="2"), "output_multiplier must be a number, got '2'"),
        (_set(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel drafts .* not supported"),
        (_set(architectures=5), None),  # malformed: read as absent, as is_draft_config reads it
        (_set(architectures="DFlash2DraftModel"), "DFlash2DraftModel drafts .* not supported"),
    ],
)
def test_mismatched_or_unsupported_draft_config_is_refused(
    reference_drafts, target, tmp_path, edit, message
):
    path = _copy(reference_drafts, tmp_path)
    _edit_config(path, edit)
    if message is None:
        load_draft(path, target)
        return
    with pytest.raises(CheckpointError, match=message):
        load_draft(path, target)


def _pop_dflash(*keys):
    return lambda config: [config["dflash_config"].pop(key) for key in keys] and None


@pytest.mark.parametrize(
    "edit, causal",
    [
        (_pop_dflash("causal_head"), True),  # is_causal alone: what the reference reads
        (lambda c: _pop_dflash("causal_head")(c) or c.pop("is_causal"), False),  # neither
        (_drop("is_causal"), True),  # causal_head alone (the JetSpec layout's name)
    ],
)
def test_the_causal_switch_is_read_from_either_field(
    reference_drafts, target, tmp_path, edit, causal
):
    """A config with only one of `is_causal` / `dflash_config.causal_head` (another exporter's)
    loads as causal as that field says; with neither it is bidirectional, as the reference takes
    it when it has no `causal_head` to agree with."""
    path = _copy(reference_drafts, tmp_path)
    _edit_config(path, edit)
    assert load_draft(path, target).config.causal is causal
    if "causal_head" not in json.loads((path / "config.json").read_text())["dflash_config"]:
        reference = dflash_model.DFlashDraftModel.from_pretrained(path)
        assert bool(reference.layers[0].self_attn.is_causal) is causal


def test_a_zero_logit_softcap_is_no_cap(reference_drafts, target, tmp_path):
    """The reference caps the logits only when `final_logit_softcapping` is > 0: 0 means none."""
    path = _copy(reference_drafts, tmp_path)
    _edit_config(path, _set_dflash(final_logit_softcapping=0.0))
    assert load_draft(path, target).config.final_logit_softcapping is None


def test_missing_tensor_is_named(reference_drafts, target, tmp_path):
    path = _copy(reference_drafts, tmp_path)
    _edit_tensors(path, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(
        CheckpointError,
        match=rf"^draft {re.escape(str(path))}: checkpoint does not match its config\.json — "
        r"missing tensors: layers\.1\.self_attn\.k_norm",
    ):
        load_draft(path, target)


def test_shape_mismatch_is_named(reference_drafts, target, tmp_path):
    path = _copy(reference_drafts, tmp_path)
    _edit_tensors(path, lambda t: t.update({"fc.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(
        CheckpointError, match=r"fc\.weight: checkpoint \[64, 64\], config expects \[64, 128\]"
    ):
        load_draft(path, target)


def test_unexpected_tensor_is_named(reference_drafts, target, tmp_path):
    path = _copy(reference_drafts, tmp_path)
    _edit_tensors(path, lambda t: t.update({"embed_tokens.weight": np.zeros((97, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: embed_tokens\.weight"):
        load_draft(path, target)


def test_missing_config_is_refused(reference_drafts, target, tmp_path):
    path = _copy(reference_drafts, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_draft(path, target)


def test_bad_dtype_is_refused(reference_drafts, target):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_draft(reference_drafts(True)[0], target, dtype="float16")


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file)


# --- init_draft -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, switches",
    [
        ("dflash", dict(causal=False, token_inputs=False, shifted=False)),
        ("jetspec", dict(causal=True, token_inputs=False, shifted=False)),
        ("jetspec++", dict(causal=True, token_inputs=True, shifted=True)),
    ],
)
def test_init_variants_map_to_their_switches(target, variant, switches):
    config = init_draft(target, variant=variant).config
    assert {name: getattr(config, name) for name in switches} == switches
    assert config.variant == variant


def test_unknown_variant_is_refused(target):
    with pytest.raises(ValueError, match="unknown draft variant 'medusa'"):
        init_draft(target, variant="medusa")


def test_default_taps_follow_the_reference_rule():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for num_target in range(4, 65):
        for num_draft in range(1, 9):
            expected = dflash_model.build_target_layer_ids(num_target, num_draft)
            assert default_target_layer_ids(num_target, num_draft) == tuple(expected)


def test_default_taps_beyond_a_shallow_target_are_refused_as_the_default(target):
    """DFlash's rule gives (1, -1) for two draft layers over two target layers: the error names
    the default taps and asks for target_layer_ids, rather than blaming taps never given."""
    shallow = dataclasses.replace(target, config=dataclasses.replace(target.config, num_layers=2))
    with pytest.raises(
        CheckpointError,
        match=r"default target_layer_ids for num_layers=2 over a 2-layer target \(\[1, -1\], "
        r"DFlash's rule\) leave its layers \[0, 2\); pass target_layer_ids",
    ):
        draft_config(shallow, num_layers=2)
    assert draft_config(shallow, num_layers=2, target_layer_ids=(0, 1)).target_layer_ids == (0, 1)


def test_init_defaults_follow_the_target(target):
    draft = init_draft(target, num_layers=2)
    c, t = draft.config, target.config
    assert c.target_layer_ids == default_target_layer_ids(3, 2)
    assert c.mask_token_id == t.vocab_size - 1  # the tiny target has no tokenizer
    assert (c.layers.hidden_size, c.layers.num_heads, c.layers.num_kv_heads) == (
        t.hidden_size,
        t.num_heads,
        t.num_kv_heads,
    )
    assert (c.layers.head_dim, c.layers.intermediate_size, c.layers.rope) == (
        t.head_dim,
        t.intermediate_size,
        t.rope,
    )
    assert (c.layers.num_layers, c.block_size, draft.dtype) == (2, 16, "float32")
    np.testing.assert_array_equal(np.asarray(draft.params["norm"]["scale"]), np.ones(64))
    assert abs(float(jnp.std(draft.params["fc"]["kernel"])) - 0.02) < 0.002


def test_init_is_seeded(target):
    kernel = lambda seed: np.asarray(init_draft(target, seed=seed).params["fc"]["kernel"])  # noqa: E731
    np.testing.assert_array_equal(kernel(0), kernel(0))
    assert not np.array_equal(kernel(0), kernel(1))


def test_init_mask_token_prefers_the_tokenizers(target):
    tokenizer = types.SimpleNamespace(mask_token_id=None, pad_token_id=5, unk_token_id=3)
    with_tokenizer = dataclasses.replace(target, tokenizer=tokenizer)
    assert init_draft(with_tokenizer).config.mask_token_id == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=1.5), "seed must be an integer >= 0, got 1.5"),
        (dict(seed=-1), "seed must be an integer >= 0, got -1"),
        (dict(seed=2**40), "seed must be in \\[0, 2\\*\\*32\\)"),
        (dict(num_layers=1.5), "num_layers must be an integer >= 1"),
        (dict(block_size="4"), "block_size must be an integer >= 2, got '4'"),
        (dict(head_dim=0), "head_dim must be an integer >= 1, got 0"),
        (dict(target_layer_ids=1), "target_layer_ids must be distinct .* increasing order, got 1"),
        (dict(target_layer_ids=(2, 0)), "distinct layer indices in increasing order"),
        (dict(target_layer_ids=(1, 1)), "distinct layer indices in increasing order"),
        (dict(init_std="0.1"), "init_std must be a finite number >= 0, got '0.1'"),
        (dict(init_std=float("nan")), "init_std must be a finite number >= 0, got nan"),
        (dict(variant="dflash", mask_token_id=3.0), "mask_token_id must be an integer >= 0"),
        (dict(mask_token_id="3"), "mask_token_id must be an integer >= 0, got '3'"),
    ],
)
def test_init_names_a_bad_argument(target, kwargs, message):
    """Refused by name, not as a TypeError from inside JAX (a float seed, a str init_std), a
    ZeroDivisionError at the first decode (head_dim 0), a failure at `with_adapter` (taps out of
    order), a draft of NaN weights (a NaN init_std) or a saved config.json that `load_draft`
    refuses (a float mask token)."""
    with pytest.raises(ValueError, match=message):
        init_draft(target, **kwargs)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(variant="dflash", num_layers=2, block_size=4, mask_token_id=7),
        dict(target_layer_ids=(0, 2), num_layers=2, intermediate_size=48, head_dim=8),
    ],
)
def test_draft_config_is_the_architecture_init_draft_builds(target, settings):
    """A warm start compares a saved draft with `draft_config`, not with a random draft."""
    assert draft_config(target, **settings) == init_draft(target, **settings, seed=3).config


def test_draft_config_refuses_what_init_draft_refuses(target):
    with pytest.raises(ValueError, match="distinct layer indices in increasing order"):
        draft_config(target, target_layer_ids=(2, 0))
    with pytest.raises(CheckpointError, match=r"outside the target's layers"):
        draft_config(target, target_layer_ids=(0, 3))


def test_init_refuses_taps_outside_the_target(target):
    with pytest.raises(CheckpointError, match=r"\[3\] outside the target's layers \[0, 3\)"):
        init_draft(target, target_layer_ids=(0, 3))


def test_a_target_or_an_adapter_directory_is_refused_as_a_draft(checkpoints, target, tmp_path):
    from jetspec_jax.adapter import init_adapter
    from jetspec_jax.checkpoint.adapter_files import save_adapter

    with pytest.raises(CheckpointError, match="is a target model checkpoint .* not a draft"):
        load_draft(checkpoints.get("qwen3")[0], target)
    draft = init_draft(target, variant="jetspec++", block_size=4)
    adapter = init_adapter(draft, layers_per_module=(1,), intermediate_size=32)
    save_adapter(adapter, tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="is an adapter, not a draft"):
        load_draft(tmp_path / "adapter", target)


def test_the_drafts_output_options_survive_export_and_load(target):
    """Non-default logit and embedding options written to config.json and read back: a field
    export dropped would change the served draft's logits (and its acceptance) unsaid."""
    draft = init_draft(target, variant="jetspec++")
    config = dataclasses.replace(
        draft.config, input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0
    )
    assert draft_config_from_hf(draft_config_to_hf(config, target.config), target.config) == config


@pytest.mark.parametrize("variant, causal", [("dflash", False), ("jetspec", True)])
def test_the_export_writes_the_causal_switch_under_both_its_names(target, variant, causal):
    """`is_causal` (what the reference reads) and `dflash_config.causal_head` (the JetSpec layout's
    name, which other readers of that layout take): a round trip through our own loader, which
    reads either, would not see one of them dropped."""
    draft = init_draft(target, variant=variant)
    hf = draft_config_to_hf(draft.config, target.config)
    assert hf["is_causal"] is causal
    assert hf["dflash_config"]["causal_head"] is causal
