"""Convert a llama-architecture GGUF file into a Hugging Face safetensors checkpoint.

The result is a plain HF directory (``config.json``, ``generation_config.json``,
float32 safetensors weights, tokenizer files with the chat template) that
the rest of the library loads like any other Llama checkpoint.

Only numpy is used for the weights: this module must work without torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import pathlib
import re
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
from tokenizers import Regex, pre_tokenizers
from tqdm.auto import tqdm

from jetspec_jax.checkpoint.atomic import atomic_directory
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.hf_config import config_from_hf
from jetspec_jax.checkpoint.hf_params import (
    MAX_SHARD_BYTES,
    LazyTensor,
    save_tokenizer,
    tensor_specs,
    write_safetensors,
)
from jetspec_jax.console import bar_disabled

__all__ = ["SUPPORTED_ARCHITECTURES", "convert_gguf_to_hf"]

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor names that are not per-layer -> HF Llama names.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when embeddings are tied
}

# ``blk.{i}.<key>.weight`` -> ``model.layers.{i}.<value>.weight``.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# llama.cpp's `tokenizer.ggml.model` of a Llama file: SentencePiece, or byte-level BPE.
_TOKENIZER_MODELS = ("llama", "gpt2")
# `tokenizer.ggml.pre` values for which llama.cpp cuts every numeral (\p{N}) off before GPT-2's
# split, as the model's own tokenizer did (SmolLM2's tokenizer.json: individual digits).
_NUMERALS_APART = ("smollm",)
# The oldest transformers verified to hold the GGUF tokenizer builders `_save_tokenizer` uses in
# `integrations.gguf.gguf_tokenizer_mapping`, importable without torch (5.17.0 has neither);
# pyproject.toml's floor.
_TRANSFORMERS_FLOOR = "5.24"


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    show_progress: bool | None = True,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> pathlib.Path:
    """Convert ``gguf_path`` into an HF Llama checkpoint directory at ``out_dir``.

    Quantized tensors are dequantized to float32 exactly as ``gguf`` does it.
    The conversion is atomic: everything is written to a temporary sibling
    directory that is renamed to ``out_dir`` only when complete, so a killed
    process may leave a ``.<name>.tmp-*`` directory behind but never a
    half-written ``out_dir``. An existing ``out_dir`` is an error; if another
    process creates it while this one converts, theirs is kept and returned.
    ``show_progress``: a progress bar over the tensors (None: only on a terminal).
    The weights are float32 safetensors, in shards of at most ``max_shard_bytes``
    with an index past that size (transformers' layout); tensors are dequantized
    one shard at a time.

    Raises:
        CheckpointError (a ``ValueError``, naming ``gguf_path``): it is not a
            readable GGUF file (or not in this machine's byte order), the
            architecture is not ``llama``, a required metadata key is missing
            or a size in it is not an integer >= 1, the tokenizer metadata is
            unusable, a tensor is unknown, missing or shaped against the metadata
            (the token list included; all refused before any tensor is
            dequantized), or a tensor's type is one ``gguf`` cannot dequantize.
        FileExistsError: ``out_dir`` exists already.
        ImportError: the installed transformers is older than the tokenizer needs (named,
            before any tensor is dequantized).
    """
    gguf_path = pathlib.Path(gguf_path)
    out = pathlib.Path(out_dir)
    try:  # validate before touching the filesystem
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError, IndexError) as e:  # gguf names no file; IndexError: truncated
        raise CheckpointError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    try:
        if reader.byte_order == "S":  # gguf dequantizes with native views: garbage weights
            raise CheckpointError(
                f"it is {reader.endianess.name.lower()}-endian, unlike this machine; convert it "
                "first with gguf's gguf_convert_endian.py"
            )
        arch = _field(reader, "general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        _check_tokenizer_metadata(reader)
        _tokenizer_builders()  # an old transformers: refused before any tensor is dequantized
        config = _llama_config(reader)
        _check_tensors(reader, config)
        with atomic_directory(out) as tmp:
            _write_checkpoint(
                reader,
                tmp,
                config=config,
                show_progress=show_progress,
                max_shard_bytes=max_shard_bytes,
            )
    except CheckpointError as e:  # the helpers know no file: a caller may convert several
        raise CheckpointError(f"cannot convert {gguf_path}: {e}") from e
    return out


def _write_checkpoint(
    reader: gguf.GGUFReader,
    out: pathlib.Path,
    *,
    config: dict[str, Any],
    show_progress: bool | None,
    max_shard_bytes: int,
) -> None:
    """Write ``config`` (checked by `_check_tensors`), generation config, weights and tokenizer
    into ``out``."""
    disable = bar_disabled(show_progress)
    with tqdm(total=len(reader.tensors), desc="Converting GGUF tensors", disable=disable) as bar:
        tensors = _lazy_tensors(reader, config, on_load=bar.update)
        _write_json(out / "config.json", config)
        _write_json(out / "generation_config.json", _generation_config(reader, config))
        write_safetensors(tensors, out, max_shard_bytes=max_shard_bytes)
    _save_tokenizer(reader, out)


def _generation_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: the special-token ids of ``config``, with the end-of-turn
    token among the eos ids."""
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    # A chat model's end of turn, when not its eos: decoding stops there too (as llama.cpp).
    eot = _field(reader, "tokenizer.ggml.eot_token_id", default=None)
    eos = generation.get("eos_token_id")
    if eot is not None and eot != eos:
        generation["eos_token_id"] = eot if eos is None else [eos, eot]
    return generation


def _llama_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Build a transformers ``LlamaConfig`` dict from the GGUF metadata.

    ``vocab_size`` and ``tie_word_embeddings`` depend on the tensors and are
    filled in by `_check_tensors`.
    """
    rope_scaling = _field(reader, "llama.rope.scaling.type", default="none")
    if rope_scaling != "none":
        raise CheckpointError(f"GGUF rope scaling {rope_scaling!r} is not supported")

    hidden = _count(reader, "llama.embedding_length")
    n_heads = _count(reader, "llama.attention.head_count")
    head_dim = _count(reader, "llama.attention.key_length", default=hidden // n_heads)
    rotated = _count(reader, "llama.rope.dimension_count", default=head_dim)
    if rotated != head_dim:  # an HF Llama rotates every channel of a head
        raise CheckpointError(
            f"GGUF rope.dimension_count {rotated} != head_dim {head_dim}: partial rotary "
            "embeddings are not supported for llama GGUF files"
        )
    rope_theta = _f32(_field(reader, "llama.rope.freq_base", default=10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _count(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _count(reader, "llama.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _count(reader, "llama.attention.head_count_kv", default=n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": _count(reader, "llama.context_length"),
        "rms_norm_eps": _f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_theta": rope_theta,  # transformers < 5 layout
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for ours, theirs in [("bos", "bos"), ("eos", "eos"), ("pad", "padding")]:
        token_id = _field(reader, f"tokenizer.ggml.{theirs}_token_id", default=None)
        if token_id is not None:
            config[f"{ours}_token_id"] = token_id
    return config


def _check_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """Refuses an unknown, missing or extra tensor, one whose shape contradicts the metadata
    (the q/k unpermutation and the converted checkpoint need them to agree), or an embedding with
    fewer rows than the tokenizer has tokens, before any is dequantized; fills in ``config``'s
    ``vocab_size`` and ``tie_word_embeddings``."""
    shapes = {_hf_name(t.name): _hf_shape(t) for t in reader.tensors}
    config["vocab_size"] = shapes.get("model.embed_tokens.weight", (0,))[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in shapes
    # The tensors an HF Llama of this config has: loading's own table (lm_head when untied).
    expected = {spec.hf_name: spec.hf_shape for spec in tensor_specs(config_from_hf(config))}
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise CheckpointError(f"GGUF file lacks tensors for: {', '.join(missing[:5])}")
    extra = sorted(set(shapes) - set(expected))
    if extra:
        raise CheckpointError(
            f"GGUF tensors beyond its {config['num_hidden_layers']} layers (llama.block_count): "
            f"{', '.join(extra[:5])}"
        )
    wrong = [
        f"{name} {list(shape)} (expected {list(expected[name])})"
        for name, shape in shapes.items()
        if shape != expected[name]
    ]
    if wrong:
        raise CheckpointError(
            f"GGUF tensors do not match its metadata (as HF shapes): {'; '.join(wrong[:5])}"
        )
    # Ids past the embedding's rows would be refused in every prompt that holds them (as the
    # client's fault); llama.cpp refuses such a file. Fewer tokens than rows is padding.
    tokens = len(reader.get_field("tokenizer.ggml.tokens").data)  # `_check_tokenizer_metadata`
    if tokens > config["vocab_size"]:
        raise CheckpointError(
            f"its tokenizer has {tokens} tokens (tokenizer.ggml.tokens) but token_embd.weight "
            f"only {config['vocab_size']} rows"
        )


def _hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in HF's row-major order (GGUF lists dimensions fastest-first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _lazy_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], *, on_load: Callable[[], Any]
) -> list[LazyTensor]:
    """Every tensor under its HF name (checked by `_check_tensors`), dequantized to float32 only
    when its shard is written (so converting an 8B model holds one shard in memory, not 32 GB)."""
    n_heads = config["num_attention_heads"]
    rope_heads = {"attn_q": n_heads, "attn_k": config["num_key_value_heads"]}
    tensors = []
    for tensor in reader.tensors:
        shape = _hf_shape(tensor)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
        load = functools.partial(_dequantize, tensor, shape, rope_heads.get(kind), on_load)
        tensors.append(LazyTensor(_hf_name(tensor.name), 4 * math.prod(shape), load))
    return tensors


def _dequantize(
    tensor: gguf.ReaderTensor,
    shape: tuple[int, ...],
    rope_heads: int | None,
    on_load: Callable[[], Any],
) -> np.ndarray:
    """One tensor in float32 and HF's layout (q/k rows unpermuted for ``rope_heads`` heads)."""
    try:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError as e:  # F64, integer types, Q8_K...: gguf has no dequantizer
        raise CheckpointError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the "
            f"installed gguf package cannot dequantize ({e})"
        ) from e
    if rope_heads is not None:
        weight = _unpermute_rope(weight, rope_heads)
    on_load()
    return np.ascontiguousarray(weight, dtype=np.float32)


def _hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF Llama name; unknown names are an error."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise CheckpointError(
            "GGUF tensor 'rope_freqs.weight' holds per-frequency rope scaling (Llama 3.1 and "
            "later), which this converter cannot rebuild: convert the original HF checkpoint"
        )
    raise CheckpointError(f"unsupported GGUF tensor {gguf_name!r} (no HF Llama equivalent known)")


def _unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of the q/k projections.

    llama.cpp rotates interleaved pairs, so ``convert_hf_to_gguf.py`` reorders
    each head's rows with ``w.reshape(n_heads, 2, d // n_heads // 2, ...)
    .swapaxes(1, 2)``; HF Llama rotates halves and needs the original order.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _check_tokenizer_metadata(reader: gguf.GGUFReader) -> None:
    """Refuses what `_save_tokenizer` cannot use, before the tensors are converted (it runs
    last): no token list, a vocabulary type it cannot rebuild, neither merges nor scores to
    rebuild it from, or a special-token id outside the token list."""
    tokens = _field(reader, "tokenizer.ggml.tokens", default=None)
    if not tokens:
        raise CheckpointError(
            "it has no tokenizer (metadata key 'tokenizer.ggml.tokens'), which the converted "
            "checkpoint needs"
        )
    model = _field(reader, "tokenizer.ggml.model", default=None)
    if model not in _TOKENIZER_MODELS:
        raise CheckpointError(
            f"its tokenizer.ggml.model {model!r} is not a vocabulary this converter rebuilds "
            f"(supported: {', '.join(_TOKENIZER_MODELS)})"
        )
    # Both vocabulary types are rebuilt as BPE: with the file's merges, or merges derived from
    # its scores (transformers' builders raise a bare KeyError, after every tensor, otherwise).
    if all(reader.get_field(f"tokenizer.ggml.{key}") is None for key in ("merges", "scores")):
        raise CheckpointError(
            f"its {model!r} tokenizer has neither merges nor scores (metadata keys "
            "'tokenizer.ggml.merges', 'tokenizer.ggml.scores'), one of which rebuilding it needs"
        )
    for key in ("bos", "eos", "eot", "unknown", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", default=None)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise CheckpointError(
                f"tokenizer.ggml.{key}_token_id {token_id} is outside its {len(tokens)} tokens"
            )


def _tokenizer_builders() -> tuple[Any, dict, Callable]:
    """transformers' `PreTrainedTokenizerFast`, `GGUF_TOKENIZER_MAPPING` and
    `convert_gguf_tokenizer`, or an ImportError naming the version needed and the one found."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # the module is transformers-internal; 5.17 kept it elsewhere
        try:
            found = f"transformers {importlib.metadata.version('transformers')}"
        except importlib.metadata.PackageNotFoundError:
            found = "no transformers"
        raise ImportError(
            f"converting a GGUF tokenizer needs transformers>={_TRANSFORMERS_FLOOR} "
            f"(transformers.integrations.gguf.gguf_tokenizer_mapping, importable without torch); "
            f"found: {found} ({e}); upgrade: pip install -U 'transformers>={_TRANSFORMERS_FLOOR}'"
        ) from e
    return PreTrainedTokenizerFast, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def _save_tokenizer(reader: gguf.GGUFReader, out: pathlib.Path) -> None:
    """Rebuild the HF tokenizer (incl. chat template) from the GGUF metadata.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would do this, but
    transformers' GGUF *reader* imports torch. Its tokenizer builders do not,
    so we feed them the metadata as read by ``gguf`` and mirror what
    ``get_gguf_tokenizer`` does with it (the output is byte-identical), but for
    the numeral split of `_NUMERALS_APART` vocabularies, which it lacks.
    """
    PreTrainedTokenizerFast, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _tokenizer_builders()
    meta = {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    }
    groups = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # As get_gguf_tokenizer: llama.cpp adds BOS to a SentencePiece vocabulary whose file
        # does not say otherwise (older files have no flag).
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in [("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")]:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        tokenizer_config[f"{name}_token"] = tokens[token_id] if token_id is not None else None

    backend, extra_kwargs = convert_gguf_tokenizer(
        _field(reader, "general.architecture"), tokenizer_dict
    )
    if tokenizer_dict.get("pre_tokenizer_type") in _NUMERALS_APART:
        # Without it " ٣" or " Ⅻ" start with a "Ġ"+byte token llama.cpp never makes of them.
        numerals = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([numerals, backend.pre_tokenizer])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, **tokenizer_config, **extra_kwargs
    )
    save_tokenizer(tokenizer, out)


_REQUIRED = object()  # `_field`'s default: a missing key is an error


def _field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """Return a metadata value; without ``default`` a missing key is an error."""
    field = reader.get_field(key)
    if field is None:
        if default is not _REQUIRED:
            return default
        raise CheckpointError(f"GGUF metadata lacks required key {key!r}")
    return field.contents()


def _count(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> int:
    """A size or count of the metadata (`_field`): an integer >= 1, named by its GGUF key when
    not (a zero would divide by zero; a per-layer array, which llama.cpp also reads, would reach
    the config as a list)."""
    value = _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        per_layer = " (per-layer values are not supported)" if isinstance(value, list) else ""
        raise CheckpointError(
            f"GGUF metadata {key} must be an integer >= 1, got {value!r}{per_layer}"
        )
    return value


def _f32(value: float) -> float:
    """Shortest decimal of a GGUF float32 (e.g. 1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
