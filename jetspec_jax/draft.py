"""A draft head paired with its target: load (DFlash/JetSpec HF layout), random init, export."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import random_streams
from jetspec_jax.calibration import Calibration
from jetspec_jax.checkpoint.adapter_files import ARCHITECTURE as ADAPTER_ARCHITECTURE
from jetspec_jax.checkpoint.adapter_files import check_adapter_matches_draft
from jetspec_jax.checkpoint.atomic import atomic_directory
from jetspec_jax.checkpoint.draft_hf import (
    check_draft_matches_target,
    default_target_layer_ids,
    draft_config_from_hf,
    draft_config_to_hf,
    draft_tensor_specs,
    is_draft_config,
    load_draft_params,
    save_draft_params,
)
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.hf_config import read_hf_config
from jetspec_jax.checkpoint.hf_params import TensorSpec, tree_from_tensors
from jetspec_jax.checkpoint.roles import replaces_only
from jetspec_jax.decoding.proposers import draft_proposer
from jetspec_jax.decoding.proxy import LearnedProxy
from jetspec_jax.decoding.refinement import refining_proposer
from jetspec_jax.decoding.request_checks import check_int
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import DraftConfig
from jetspec_jax.scalars import as_int, as_real
from jetspec_jax.target import DTYPES, Target, check_dtype, check_is_target

__all__ = [
    "Draft",
    "default_target_layer_ids",
    "draft_config",
    "init_draft",
    "load_draft",
    "load_draft_for_config",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """A draft head for one target (whose embedding and LM head it shares).

    Attributes:
        config: the draft architecture and variant (static under jit).
        params: the parameter pytree (see `jetspec_jax.checkpoint.draft_hf`), in `dtype`.
        dtype: "float32" or "bfloat16".
        target_config: the config of the target it was loaded for or initialised from (its
            depth is the `num_target_layers` an export records).
        path: the directory it was loaded from, if any.
        adapter: the `Adapter` predicting its taps (context refreshes need one), if any.
        calibration: its fitted `Calibration` (foresight's outcome scores, refinement's
            replacement confidence), if any.
    """

    config: DraftConfig
    params: dict
    dtype: str
    target_config: TransformerConfig
    path: pathlib.Path | None = None
    adapter: Any = None
    calibration: Calibration | None = None

    def with_adapter(self, adapter, calibration: Calibration | None = None) -> Draft:
        """This draft with `adapter` (an `Adapter` for its taps) and optionally a calibration.

        Raises:
            ValueError: `adapter` is not an `Adapter` or `calibration` neither a `Calibration`
                nor None, a mask-input (dflash, jetspec) draft, an adapter that predicts other
                tap layers than the draft reads or states of another width (each a
                `CheckpointError`), or one that holds another dtype than the draft's.
        """
        from jetspec_jax.adapter import Adapter  # imports this module

        # Checked here: a wrong type would otherwise fail as an AttributeError, the calibration's
        # only at the first decode that reads it.
        if not isinstance(adapter, Adapter):
            raise ValueError(
                f"adapter must be an Adapter (init_adapter, checkpoint.adapter_files."
                f"load_adapter), got {type(adapter).__name__}"
            )
        if calibration is not None and not isinstance(calibration, Calibration):
            raise ValueError(
                f"calibration must be a Calibration or None, got {type(calibration).__name__}"
            )
        check_adapter_matches_draft(adapter.config, self)
        if adapter.dtype != self.dtype:  # one dtype per checkpoint (its manifest names one)
            raise ValueError(
                f"the adapter is {adapter.dtype} and the draft {self.dtype}: load both in one dtype"
            )
        return dataclasses.replace(self, adapter=adapter, calibration=calibration)

    def with_attention_impl(self, impl: str) -> Draft:
        """This draft, and its adapter if any, with the refinement attention on `impl` (one of
        `jetspec_jax.kernels.IMPLS`; a runtime choice, not part of the checkpoint): the two run
        the same attention, so they switch together."""
        return self._reconfigured(lambda config: dataclasses.replace(config, attention_impl=impl))

    def with_cache_chunk(self, chunk: int) -> Draft:
        """This draft, and its adapter if any, attending a decode cache of more than `chunk`
        slots over its filled span only, `chunk` slots at a time (`TransformerConfig.cache_chunk`,
        default 1024; a runtime choice, not part of the checkpoint)."""
        return self._reconfigured(
            lambda config: dataclasses.replace(
                config, layers=dataclasses.replace(config.layers, cache_chunk=chunk)
            )
        )

    def _reconfigured(self, change: Callable[[Any], Any]) -> Draft:
        """This draft with `change` applied to its config and its adapter's, if any (a
        `DraftConfig` and an `AdapterConfig`: runtime settings they share)."""
        adapter = self.adapter
        if adapter is not None:
            adapter = dataclasses.replace(adapter, config=change(adapter.config))
        return dataclasses.replace(self, config=change(self.config), adapter=adapter)

    def save(self, out_dir: str | pathlib.Path, *, overwrite: bool = False) -> pathlib.Path:
        """Exports the draft in the DFlash/JetSpec HF layout (`config.json`, `model.safetensors`),
        loadable by `dflash.model.DFlashDraftModel.from_pretrained`; a draft with an adapter is
        written as a JetSpec++ checkpoint instead (`checkpoint/bundle.py`: draft in that layout
        under `draft/`, plus `adapter/` and the calibration).

        Written atomically: `out_dir` appears complete or not at all. `overwrite` replaces
        only a draft's checkpoint directory, plain or JetSpec++ (or an empty one): anything else
        there is refused.

        Raises:
            FileExistsError: `out_dir` exists and `overwrite` is False, or it holds something
                `overwrite` may not replace (not a checkpoint or empty directory, or a target or
                adapter checkpoint).
            NotADirectoryError: a parent of `out_dir` is a file.
            OSError: writing fails (permissions, disk space); no partial `out_dir` is left.
        """
        if self.adapter is not None:
            from jetspec_jax.checkpoint.bundle import save_bundle  # imports this module

            return save_bundle(self, out_dir, overwrite=overwrite)
        hf = draft_config_to_hf(self.config, self.target_config, self.dtype)
        with atomic_directory(out_dir, overwrite=overwrite, refuse=replaces_only("draft")) as tmp:
            (tmp / "config.json").write_text(json.dumps(hf, indent=2))
            save_draft_params(self.params, self.config, tmp)
        return pathlib.Path(out_dir)

    def proposer(
        self,
        target: Target,
        *,
        method: str,
        refine_passes: int = 0,
        refreshes: int = 0,
        replacement_confidence: float | None = None,
        block_size: int | None = None,
    ):
        """`(proposer, params)` drafting for `target` with `method` (the decode loop's interface):
        `Jj` Jacobi passes, the first `refreshes` of them after a context refresh (`Jj-Rr`) whose
        anchor replacement trusts the proxy above `replacement_confidence` (None: the
        calibration's value; 0, the paper's rule, for a draft without a calibration), over
        blocks of `block_size` positions (None: as trained; `DraftConfig.with_block_size`).

        Raises:
            ValueError: `method` is not this draft's variant, refinement on a mask-input draft,
                refreshes without an adapter, more refreshes than passes, or a block size the
                draft cannot draft.
            CheckpointError: the draft does not fit `target` (hidden size, vocabulary, taps).
        """
        check_draft_matches_target(self.config, target.config, self.target_config.num_layers)
        proposer = draft_proposer(self.config, target.config, method, refine_passes, block_size)
        if not refreshes:
            return proposer, self.params
        if self.adapter is None:
            raise ValueError(
                f"refreshes={refreshes} needs a draft with an adapter (Draft.with_adapter, or a "
                "JetSpec++ checkpoint that holds one)"
            )
        calibration = None  # a confidence given here overrides the calibration's: no warning
        if replacement_confidence is None:
            calibration = self.calibration or Calibration()
            replacement_confidence = calibration.replacement_confidence
        proxy = LearnedProxy(self.adapter.config, target.config)
        refiner, params = refining_proposer(
            proposer, proxy, refreshes, self.params, self.adapter.params, replacement_confidence
        )
        if calibration is not None:
            calibration.warn_if_fitted_for_another(refine_passes, refiner.refreshes)
        # c = 1 trusts no position: no refresh runs, and without one nothing reads the proxy.
        return (proposer, self.params) if refiner.refreshes == 0 else (refiner, params)


def load_draft(path: str | pathlib.Path, target: Target, *, dtype: str | None = None) -> Draft:
    """Loads a draft head for `target`: a plain DFlash/JetSpec HF directory, or a JetSpec++
    checkpoint (recognised by its `jetspec_pp.json`; the draft comes with its adapter and
    calibration).

    Args:
        path: a directory with the draft's `config.json` and `model.safetensors` (or shards with
            `model.safetensors.index.json`), or a JetSpec++ checkpoint directory.
        target: the target the draft conditions on and shares its embedding / LM head with.
        dtype: "float32" or "bfloat16"; None: the target's.

    Raises:
        CheckpointError: the directory is missing or malformed, holds a target or an adapter
            instead, or the draft does not fit the target (hidden size, vocabulary, target depth,
            tap layers, mask token), or a JetSpec++ checkpoint is malformed
            (`checkpoint.bundle.load_bundle`).
        ValueError: `dtype` is neither "float32" nor "bfloat16".
    """
    check_is_target(target)
    return load_draft_for_config(
        path, target.config, dtype=target.dtype if dtype is None else dtype
    )


def load_draft_for_config(
    path: str | pathlib.Path, target_config: TransformerConfig, *, dtype: str
) -> Draft:
    """`load_draft` given the target's architecture alone (`load_target_config`), not its
    weights: to re-save or convert a draft without holding the target in memory. The draft is
    checked against `target_config` as `load_draft` checks it.

    Raises:
        CheckpointError, ValueError: as `load_draft`.
    """
    from jetspec_jax.checkpoint.bundle import is_bundle, load_bundle  # imports this module

    check_dtype(dtype)
    path = pathlib.Path(path)
    if is_bundle(path):
        return load_bundle(path, target_config, dtype=dtype)
    config = read_draft_config(path, target_config)
    params = load_draft_params(path, config, DTYPES[dtype])
    return Draft(config=config, params=params, dtype=dtype, target_config=target_config, path=path)


def read_draft_config(path: str | pathlib.Path, target_config: TransformerConfig) -> DraftConfig:
    """The architecture of the draft saved at `path` (a DFlash/JetSpec directory, or the draft of
    a JetSpec++ checkpoint), checked against `target_config` as `load_draft` checks it, without
    reading its weights: for checks that should not wait for a model load.

    Raises:
        CheckpointError: as `load_draft`, for the config alone.
    """
    from jetspec_jax.checkpoint.bundle import (  # imports this module
        bundle_draft_dir,
        is_bundle,
        read_manifest,
    )

    path = pathlib.Path(path)
    if is_bundle(path):  # its manifest and layout as `load_bundle` checks them, first
        read_manifest(path)
        path = bundle_draft_dir(path)
    hf = read_hf_config(path)
    if hf.get("architecture") == ADAPTER_ARCHITECTURE:
        raise CheckpointError(
            f"{path} is an adapter, not a draft: load the JetSpec++ checkpoint that holds it (the "
            "directory with jetspec_pp.json), or pair it with its draft via Draft.with_adapter"
        )
    if not is_draft_config(hf):
        raise CheckpointError(
            f"{path} is a target model checkpoint (architectures {hf.get('architectures')}), not "
            "a draft: pass it as the target; a draft's config.json names DFlashDraftModel"
        )
    try:
        return draft_config_from_hf(hf, target_config)
    except CheckpointError as e:  # its messages name fields, not the directory (a bundle's draft/)
        raise type(e)(f"{path}: {e}") from e  # a target mismatch stays one


def init_draft(target: Target, *, init_std: float = 0.02, seed: int = 0, **architecture) -> Draft:
    """A randomly initialised draft head for `target`, in the target's dtype.

    Kernels are drawn from N(0, init_std) and norm scales are 1.

    Args:
        target: the target to draft for.
        init_std: standard deviation of the kernels.
        seed: seed of `jax.random`.
        **architecture: `draft_config`'s keywords, with its defaults: `variant="jetspec++"`,
            `num_layers=1`, `target_layer_ids`, `block_size=16`, `mask_token_id`, and the
            layers' `intermediate_size`, `num_heads`, `num_kv_heads`, `head_dim`.

    Raises:
        ValueError, CheckpointError, TypeError: as `draft_config` (a TypeError also for a keyword
            it does not take); ValueError: a seed outside [0, 2**32), an `init_std` that is not
            a finite number >= 0.
    """
    config = draft_config(target, **architecture)
    seed = check_init_seed(seed)
    init_std = check_init_std(init_std)
    key = random_streams.stream(seed, random_streams.DRAFT_INIT)
    params = random_params(draft_tensor_specs(config), key, init_std, DTYPES[target.dtype])
    return Draft(config=config, params=params, dtype=target.dtype, target_config=target.config)


def check_init_seed(seed) -> int:
    """`seed` as an int, after checking it is an integer in [0, 2**32), as the training config's
    `optim.seed` is (ValueError otherwise: `jax.random.key` would wrap -1 or 2**32 + s onto
    another seed's key without a word, and raise an OverflowError from 2**63 on)."""
    seed = check_int("seed", seed, 0)
    if seed >= 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    return seed


def check_init_std(init_std) -> float:
    """`init_std` as a float, after checking it is a finite number >= 0, as the training
    config's `init_std` is (ValueError otherwise: a NaN would draw NaN weights without a word)."""
    std = as_real(init_std)
    if std is None or not (math.isfinite(std) and std >= 0):
        raise ValueError(f"init_std must be a finite number >= 0, got {init_std!r}")
    return std


def draft_config(
    target: Target,
    *,
    variant: str = "jetspec++",
    num_layers: int = 1,
    target_layer_ids: tuple[int, ...] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> DraftConfig:
    """The architecture of a draft head for `target` with these settings, checked against the
    target (what `init_draft` builds, without drawing its weights). Sizes default to the
    target's (hidden size always is the target's; heads, head_dim, intermediate size, RoPE and
    RMSNorm eps by default).

    Args:
        target: the target to draft for.
        variant: "dflash", "jetspec" or "jetspec++" (`DraftConfig.variant_switches`).
        num_layers: draft decoder layers.
        target_layer_ids: tap layers; None: DFlash's rule (`default_target_layer_ids`).
        block_size: positions per drafted block.
        mask_token_id: None: the tokenizer's mask token, else its pad token, else its unk token,
            else `vocab_size - 1` (the first the target has). Only mask-input variants
            (dflash, jetspec) ever feed it to the draft.
        intermediate_size, num_heads, num_kv_heads, head_dim: None: the target's.

    Raises:
        ValueError: an unknown variant, or a size or tap list that is not one (each named).
        CheckpointError: tap layers or the mask token out of the target's range.
        TypeError: `target` is not a `Target`.
    """
    check_is_target(target)
    return _configured(
        target.config,
        lambda: _default_mask_token_id(target),
        variant=variant,
        num_layers=num_layers,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        mask_token_id=mask_token_id,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def check_draft_fits(target_config: TransformerConfig, **settings) -> None:
    """Refuses draft settings for a target known by its config alone, before its weights (and
    tokenizer) load: every check of `draft_config`, raising as it does, the default mask token
    aside (the tokenizer's; any id the vocabulary holds fits).

    Args:
        target_config: the target's architecture (`load_target_config`).
        **settings: every keyword of `draft_config` (`DraftArchConfig.architecture()`).
    """
    draft_config_for(target_config, target_config.vocab_size - 1, **settings)


def draft_config_for(
    target_config: TransformerConfig, default_mask_token_id: int, **settings
) -> DraftConfig:
    """`draft_config` for a target known by its config alone: `default_mask_token_id` stands in
    for the tokenizer's mask-token rule where `settings` leave `mask_token_id` None.

    Raises:
        ValueError, CheckpointError: as `draft_config`.
    """
    return _configured(target_config, lambda: default_mask_token_id, **settings)


def _configured(
    target_config: TransformerConfig,
    default_mask_token_id: Callable[[], int],
    *,
    variant: str,
    num_layers: int,
    target_layer_ids: tuple[int, ...] | None,
    block_size: int,
    mask_token_id: int | None,
    intermediate_size: int | None,
    num_heads: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
) -> DraftConfig:
    """`draft_config` for `target_config` (every setting given: the defaults are
    `draft_config`'s), `default_mask_token_id()` standing in for a None `mask_token_id`."""
    switches = DraftConfig.variant_switches(variant)
    num_layers = check_int("num_layers", num_layers, 1)
    block_size = check_int("block_size", block_size, 2)
    sizes = dict(
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    sizes = {k: None if v is None else check_int(k, v, 1) for k, v in sizes.items()}
    if target_layer_ids is None:
        # DFlash's rule, kept as it is: for very shallow targets it can repeat a tap or
        # go down (e.g. (1, 0) for 3 target layers and 2 draft layers).
        taps = default_target_layer_ids(target_config.num_layers, num_layers)
        if not all(0 <= i < target_config.num_layers for i in taps):
            # Said here, not as a bad `target_layer_ids` the caller never gave.
            raise CheckpointError(
                f"the default target_layer_ids for num_layers={num_layers} over a "
                f"{target_config.num_layers}-layer target ({list(taps)}, DFlash's rule) leave "
                f"its layers [0, {target_config.num_layers}); pass target_layer_ids"
            )
    else:
        try:
            taps = tuple(as_int(i) for i in target_layer_ids)
        except TypeError:  # not a sequence
            taps = (None,)
        if None in taps or list(taps) != sorted(set(taps)):
            raise ValueError(
                f"target_layer_ids must be distinct layer indices in increasing order, got "
                f"{target_layer_ids!r}"
            )
    config = DraftConfig(
        layers=layers_like_target(target_config, num_layers, **sizes),
        target_layer_ids=taps,
        block_size=block_size,
        mask_token_id=(
            default_mask_token_id()
            if mask_token_id is None
            # An int: a float would be saved in a config.json that `load_draft` refuses.
            else check_int("mask_token_id", mask_token_id, 0)
        ),
        **switches,
    )
    check_draft_matches_target(config, target_config)
    return config


def layers_like_target(
    target_config: TransformerConfig,
    num_layers: int,
    intermediate_size: int | None,
    num_heads: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
) -> TransformerConfig:
    """Qwen3 decoder layers sized by the target unless overridden (DFlash's drafts are)."""
    t = target_config
    return TransformerConfig(
        model_type="qwen3",
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size if intermediate_size is None else intermediate_size,
        num_layers=num_layers,
        num_heads=t.num_heads if num_heads is None else num_heads,
        num_kv_heads=t.num_kv_heads if num_kv_heads is None else num_kv_heads,
        head_dim=t.head_dim if head_dim is None else head_dim,
        rms_norm_eps=t.rms_norm_eps,
        rope=t.rope,
        max_position_embeddings=t.max_position_embeddings,
    )


def _default_mask_token_id(target: Target) -> int:
    """The tokenizer's mask, pad or unk token (first present), else `vocab_size - 1`."""
    tokenizer = target.tokenizer
    if tokenizer is not None:
        for name in ("mask_token_id", "pad_token_id", "unk_token_id"):
            token_id = getattr(tokenizer, name, None)
            if token_id is not None:
                return int(token_id)
    return target.config.vocab_size - 1


def random_params(specs: Sequence[TensorSpec], key: jax.Array, init_std: float, dtype) -> dict:
    """The parameter pytree of `specs`, each tensor `random_tensor`'s with its own key."""
    keys = jax.random.split(key, len(specs))
    tensors = {
        spec.hf_name: random_tensor(spec, k, init_std) for spec, k in zip(specs, keys, strict=True)
    }
    return tree_from_tensors(specs, tensors, dtype)


def random_tensor(spec: TensorSpec, key: jax.Array, init_std: float) -> np.ndarray:
    """One HF-layout tensor: kernels ~ N(0, init_std), norm scales 1, biases 0 (float32)."""
    kind = spec.path[-1]
    if kind == "kernel":
        return np.asarray(init_std * jax.random.normal(key, spec.hf_shape, jnp.float32))
    if kind == "scale":
        return np.ones(spec.hf_shape, np.float32)
    if kind == "bias":
        return np.zeros(spec.hf_shape, np.float32)
    raise ValueError(f"no initialiser for parameter {spec.hf_name} (leaf {kind!r})")
