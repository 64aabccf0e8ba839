"""HF tensor names <-> our parameter pytree, with strict validation.

One table, `tensor_specs(config)`, lists every tensor a checkpoint of that config must hold, where
it goes in the pytree and its HF shape; loading and export both read it, so the two can never
disagree. HF stores linear weights as `[out, in]`; our kernels are `[in, out]`.

Parameter pytree (N = num_heads, K = num_kv_heads, D = head_dim, F = intermediate_size):

    embed_tokens.embedding          [V, H]
    layers[i].input_layernorm.scale [H]
    layers[i].self_attn.{q,k,v,o}_proj.kernel   [H, N*D] / [H, K*D] / [H, K*D] / [N*D, H]  (+ .bias)
    layers[i].self_attn.{q,k}_norm.scale        [D]            (Qwen3 only)
    layers[i].post_attention_layernorm.scale    [H]
    layers[i].mlp.{gate,up,down}_proj.kernel    [H, F] / [H, F] / [F, H]  (+ .bias)
    norm.scale                      [H]
    lm_head.kernel                  [H, V]         (untied only)

Qwen3.5 hybrids (`config.is_hybrid`; Hk/Hv linear key/value heads, Dk/Dv their sizes,
C = 2 Hk Dk + Hv Dv, K = conv window): attention layers hold `self_attn` as above but with
`q_proj` `[H, 2 N D]` (query and output gate per head); Gated DeltaNet layers hold instead

    layers[i].linear_attn.in_proj_{qkv,z,b,a}.kernel  [H, C] / [H, Hv*Dv] / [H, Hv] / [H, Hv]
    layers[i].linear_attn.conv1d.kernel         [K, 1, C]   (HF `conv1d.weight` [C, 1, K])
    layers[i].linear_attn.{dt_bias,A_log}       [Hv]
    layers[i].linear_attn.norm.scale            [Dv]
    layers[i].linear_attn.out_proj.kernel       [Hv*Dv, H]

Their RMSNorm scales are stored as in the checkpoint (zero-centred: the model scales by 1 + w).
A multimodal checkpoint's text model (`model.language_model.*`) loads under the same names;
its vision tower (`model.visual.*`) and multi-token-prediction head (`mtp.*`) are skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
import tqdm

from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.console import bar_disabled
from jetspec_jax.models.config import TransformerConfig

Params = dict
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TIED_HEAD = "lm_head.weight"
# Multimodal Qwen3.5 checkpoints: the text model's prefix, and the parts we do not load.
_MULTIMODAL_TEXT_PREFIX = "model.language_model."
_MULTIMODAL_SKIPPED = ("model.visual.", "mtp.")
# safetensors dtypes a weight may be stored in (cast to the model's dtype as read). Others are
# quantized or packed data (float8 cannot even be read with numpy), not weights of this model.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# What `locate_tensors` returns: each tensor name -> (its file, its shape).
Located = Mapping[str, tuple[pathlib.Path, tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF name and shape, and where it lives in the pytree."""

    hf_name: str
    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]

    @property
    def is_kernel(self) -> bool:
        """Linear weights are transposed between HF `[out, in]` and our `[in, out]`."""
        return self.path[-1] == "kernel"


def tensor_specs(config: TransformerConfig) -> list[TensorSpec]:
    """Every tensor of a target checkpoint of `config`, in a stable order."""
    c = config
    specs = [
        TensorSpec(
            "model.embed_tokens.weight",
            ("embed_tokens", "embedding"),
            (c.vocab_size, c.hidden_size),
        )
    ]
    for i in range(c.num_layers):
        if c.is_hybrid:
            specs += hybrid_layer_specs(c, i)
        else:
            specs += decoder_layer_specs(c, f"model.layers.{i}", ("layers", i))
    specs.append(norm_spec("model.norm", ("norm",), c.hidden_size))
    if not c.tie_word_embeddings:
        specs.append(
            TensorSpec("lm_head.weight", ("lm_head", "kernel"), (c.vocab_size, c.hidden_size))
        )
    return specs


def decoder_layer_specs(
    config: TransformerConfig, hf_prefix: str, path: tuple[str | int, ...]
) -> list[TensorSpec]:
    """The tensors of one Llama/Qwen3 decoder layer (targets and drafts share this layout)."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attn, attn_path = f"{hf_prefix}.self_attn", (*path, "self_attn")
    specs = [norm_spec(f"{hf_prefix}.input_layernorm", (*path, "input_layernorm"), c.hidden_size)]
    for name, out_dim, in_dim in [
        ("q_proj", q_dim, c.hidden_size),
        ("k_proj", kv_dim, c.hidden_size),
        ("v_proj", kv_dim, c.hidden_size),
        ("o_proj", c.hidden_size, q_dim),
    ]:
        specs += linear_specs(
            f"{attn}.{name}", (*attn_path, name), out_dim, in_dim, c.attention_bias
        )
    if c.qk_norm:
        specs.append(norm_spec(f"{attn}.q_norm", (*attn_path, "q_norm"), c.head_dim))
        specs.append(norm_spec(f"{attn}.k_norm", (*attn_path, "k_norm"), c.head_dim))
    return specs + _post_attention_specs(c, hf_prefix, path, c.mlp_bias)


def hybrid_layer_specs(config: TransformerConfig, index: int) -> list[TensorSpec]:
    """The tensors of Qwen3.5 layer `index`: Gated DeltaNet or gated attention, norms, MLP."""
    c, prefix, path = config, f"model.layers.{index}", ("layers", index)
    if index in c.attention_layers:
        # The Qwen3 layout with a doubled q_proj (query and output gate per head).
        specs = decoder_layer_specs(c, prefix, path)
        q = next(s for s in specs if s.hf_name == f"{prefix}.self_attn.q_proj.weight")
        doubled = TensorSpec(q.hf_name, q.path, (2 * q.hf_shape[0], q.hf_shape[1]))
        specs = [doubled if s is q else s for s in specs]
        if c.attention_bias:
            qb = next(s for s in specs if s.hf_name == f"{prefix}.self_attn.q_proj.bias")
            specs[specs.index(qb)] = TensorSpec(qb.hf_name, qb.path, (2 * qb.hf_shape[0],))
        return specs
    hv, conv_dim = c.linear_num_value_heads, c.linear_conv_dim
    value_dim = hv * c.linear_value_head_dim
    lin, lin_path = f"{prefix}.linear_attn", (*path, "linear_attn")
    specs = [norm_spec(f"{prefix}.input_layernorm", (*path, "input_layernorm"), c.hidden_size)]
    for name, out_dim, in_dim in [
        ("in_proj_qkv", conv_dim, c.hidden_size),
        ("in_proj_z", value_dim, c.hidden_size),
        ("in_proj_b", hv, c.hidden_size),
        ("in_proj_a", hv, c.hidden_size),
        ("out_proj", c.hidden_size, value_dim),
    ]:
        specs += linear_specs(f"{lin}.{name}", (*lin_path, name), out_dim, in_dim, False)
    specs += [
        # [C, 1, K] transposed is flax's depthwise conv kernel layout [K, 1, C].
        TensorSpec(
            f"{lin}.conv1d.weight",
            (*lin_path, "conv1d", "kernel"),
            (conv_dim, 1, c.linear_conv_kernel_dim),
        ),
        TensorSpec(f"{lin}.dt_bias", (*lin_path, "dt_bias"), (hv,)),
        TensorSpec(f"{lin}.A_log", (*lin_path, "A_log"), (hv,)),
        norm_spec(f"{lin}.norm", (*lin_path, "norm"), c.linear_value_head_dim),
    ]
    return specs + _post_attention_specs(c, prefix, path, bias=False)


def _post_attention_specs(
    config: TransformerConfig, hf_prefix: str, path: tuple[str | int, ...], bias: bool
) -> list[TensorSpec]:
    """A layer's second half, shared by every layer kind: `post_attention_layernorm` `[H]`, then
    the MLP's `gate_proj` / `up_proj` `[F, H]` and `down_proj` `[H, F]` (HF shapes)."""
    c = config
    specs = [
        norm_spec(
            f"{hf_prefix}.post_attention_layernorm",
            (*path, "post_attention_layernorm"),
            c.hidden_size,
        )
    ]
    for name, out_dim, in_dim in [
        ("gate_proj", c.intermediate_size, c.hidden_size),
        ("up_proj", c.intermediate_size, c.hidden_size),
        ("down_proj", c.hidden_size, c.intermediate_size),
    ]:
        specs += linear_specs(
            f"{hf_prefix}.mlp.{name}", (*path, "mlp", name), out_dim, in_dim, bias
        )
    return specs


def linear_specs(
    hf_prefix: str, path: tuple[str | int, ...], out_dim: int, in_dim: int, bias: bool
) -> list[TensorSpec]:
    """A linear layer: HF `weight` `[out, in]` (our `kernel` `[in, out]`) and optional `bias`."""
    specs = [TensorSpec(f"{hf_prefix}.weight", (*path, "kernel"), (out_dim, in_dim))]
    if bias:
        specs.append(TensorSpec(f"{hf_prefix}.bias", (*path, "bias"), (out_dim,)))
    return specs


def norm_spec(hf_prefix: str, path: tuple[str | int, ...], dim: int) -> TensorSpec:
    """An RMSNorm: HF `weight` -> our `scale`."""
    return TensorSpec(f"{hf_prefix}.weight", (*path, "scale"), (dim,))


def tree_from_tensors(specs: list[TensorSpec], tensors: Mapping[str, np.ndarray], dtype) -> Params:
    """The pytree of `specs` filled from HF-named arrays (names/shapes already validated)."""
    params: Params = {}
    for spec in specs:
        array = np.asarray(tensors[spec.hf_name])
        _set(params, spec.path, jnp.asarray(array.T if spec.is_kernel else array, dtype=dtype))
    return params


def tensors_from_tree(specs: list[TensorSpec], params: Params) -> dict[str, np.ndarray]:
    """HF-named numpy arrays of the pytree leaves that `specs` lists."""
    return {spec.hf_name: _hf_array(spec, params) for spec in specs}


def load_hf_params(
    checkpoint_dir: str | pathlib.Path,
    config: TransformerConfig,
    dtype=jnp.float32,
    show_progress=None,
) -> Params:
    """Reads and validates the safetensors weights of an HF checkpoint directory.

    Accepts a single `model.safetensors` or shards listed in `model.safetensors.index.json`.
    Tensors are validated (names and shapes, from the file headers) before any is read, then read
    and converted one at a time (`TensorReader`).

    Raises:
        CheckpointError: a missing or malformed weights file, tensors that do not match
            `config`, or one not stored as a float (the message names `checkpoint_dir` or the
            file at fault).
    """
    located = locate_tensors(pathlib.Path(checkpoint_dir))
    specs = tensor_specs(config)
    try:
        if config.is_hybrid:
            located = _text_model_tensors(located)
        validate_names_and_shapes(specs, _shapes(located), _ignorable(config))
    except CheckpointError as e:  # its message names tensors, not the directory they are in
        raise CheckpointError(f"{checkpoint_dir}: {e}") from e
    progress = tqdm.tqdm(
        total=len(specs),
        desc="loading weights",
        unit="tensor",
        disable=bar_disabled(show_progress),
    )
    with progress, TensorReader(located, on_read=progress.update) as tensors:
        tensors.check_floats(spec.hf_name for spec in specs)  # before the tied head is read
        _check_tied_head(tensors, config, checkpoint_dir)
        params = tree_from_tensors(specs, tensors, dtype)
    # A model of no layers has no layer tensor to create the list, but the forward reads one.
    params.setdefault("layers", [])
    return params


def load_tree(
    checkpoint_dir: str | pathlib.Path, specs: list[TensorSpec], dtype, *, what: str
) -> Params:
    """The pytree of `specs` read from a checkpoint directory's safetensors (single file or
    shards), for the draft and adapter loaders: names, shapes and float storage are checked from
    the file headers before any tensor is read.

    Raises:
        CheckpointError: a missing or malformed weights file, every missing, unexpected and
            mis-shaped tensor (named, after `what` and the directory: "draft <dir>: ..."), or a
            tensor not stored as a float.
    """
    located = locate_tensors(pathlib.Path(checkpoint_dir))
    try:
        validate_names_and_shapes(specs, _shapes(located))
    except CheckpointError as e:  # its message names tensors, not the directory they are in
        raise CheckpointError(f"{what} {checkpoint_dir}: {e}") from e
    with TensorReader(located) as tensors:
        tensors.check_floats(spec.hf_name for spec in specs)
        return tree_from_tensors(specs, tensors, dtype)


class TensorReader(Mapping):
    """The tensors `locate_tensors` found, each read from its file when accessed.

    A context manager holding one open handle per file. Building a pytree through it keeps one
    tensor on the host at a time, not a host copy of the whole checkpoint beside the device one.
    A name may be stored in its multimodal spelling (`_stored_name`). Reading a tensor not
    stored as a float (`FLOAT_DTYPES`) is a `CheckpointError` naming it and its file
    (`check_floats` checks the tensors a model needs from the headers, before any is read).
    """

    def __init__(self, located: Located, on_read=None):
        self._located = located
        self._on_read = on_read
        self._handles: dict[pathlib.Path, tuple[Any, set[str]]] = {}
        self._files = contextlib.ExitStack()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def check_floats(self, names: Iterable[str]) -> None:
        """Refuses the first of `names` not stored as a float, from the file headers alone: a
        quantized tensor late in a large checkpoint fails before the others are read, not
        after."""
        for name in names:
            self._float_tensor(name)

    def _float_tensor(self, name: str) -> tuple[Any, str]:
        """`(handle, stored name)` of `name`, after checking it is stored as a float."""
        file = self._located[name][0]
        if file not in self._handles:
            handle = self._files.enter_context(safetensors.safe_open(file, framework="numpy"))
            self._handles[file] = (handle, set(handle.keys()))
        handle, stored = self._handles[file]
        stored_name = _stored_name(name, stored)
        dtype = handle.get_slice(stored_name).get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{file}: tensor {stored_name} is stored as {dtype}; only floating-point "
                f"weights ({', '.join(FLOAT_DTYPES)}) are supported: give the original (or "
                "dequantized) float weights"
            )
        return handle, stored_name

    def __getitem__(self, name: str) -> np.ndarray:
        handle, stored_name = self._float_tensor(name)
        array = handle.get_tensor(stored_name)
        if self._on_read is not None:
            self._on_read(1)
        return array

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._located

    def __iter__(self) -> Iterator[str]:
        return iter(self._located)

    def __len__(self) -> int:
        return len(self._located)


# Small enough that gathering one shard on the host beside the (device-resident) model is cheap;
# transformers 5 writes up to 50 GB per shard, 4 wrote 5 GB.
MAX_SHARD_BYTES = 5 * 10**9


def save_hf_params(
    params: Params,
    config: TransformerConfig,
    out_dir: pathlib.Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Writes the weights with HF names into an existing directory, in `write_safetensors`'s
    layout. One shard's tensors at a time are copied to the host, so exporting a model never holds
    a second whole copy of it there.

    Raises:
        FileExistsError: the directory already holds weights (of either layout: a stale file of
            the other one would be what loads).
    """
    tensors = [
        LazyTensor(
            spec.hf_name, _get(params, spec.path).nbytes, functools.partial(_hf_array, spec, params)
        )
        for spec in tensor_specs(config)
    ]
    write_safetensors(tensors, out_dir, max_shard_bytes=max_shard_bytes)


class LazyTensor(NamedTuple):
    """A tensor to write under `name`: `nbytes` as it will be stored, `load()` its array, called
    only when its shard is written."""

    name: str
    nbytes: int
    load: Callable[[], np.ndarray]


def save_tensors(arrays: dict[str, np.ndarray], path: pathlib.Path) -> None:
    """Writes `arrays` as the safetensors file `path` (HF's `{"format": "pt"}` metadata).

    Raises:
        OSError: the file could not be written (a full disk, say), naming it: safetensors
            raises its own `SafetensorError`, no OSError, which the commands' "error:" line
            would not catch (a traceback naming no file).
    """
    try:
        safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})
    except safetensors.SafetensorError as e:
        raise OSError(f"cannot write {path}: {e}") from e


def save_tokenizer(tokenizer, out_dir: pathlib.Path) -> None:
    """Writes a transformers `tokenizer`'s files into the directory `out_dir`.

    Raises:
        OSError: a file could not be written (a full disk, say), naming `out_dir`: the Rust
            tokenizer raises a bare `Exception` for it, no OSError.
    """
    try:
        tokenizer.save_pretrained(str(out_dir))
    except Exception as e:
        if type(e) is not Exception:  # only the Rust tokenizer's own errors: the rest are bugs
            raise
        raise OSError(f"cannot write the tokenizer into {out_dir}: {e}") from e


def write_safetensors(
    tensors: Sequence[LazyTensor],
    out_dir: pathlib.Path,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Writes `tensors` in order into an existing directory: `model.safetensors`, or past
    `max_shard_bytes`, shards `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
    (transformers' layout). Only one shard's arrays are alive at a time.

    Raises:
        FileExistsError: the directory already holds weights (of either layout: a stale file of
            the other one would be what loads).
    """
    present = sorted(p.name for p in out_dir.glob("model*.safetensors*"))
    if present:
        raise FileExistsError(f"{out_dir} already holds weights ({', '.join(present)})")
    shards: list[list[LazyTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    count = len(shards)
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    if count == 1:
        names = [SINGLE_FILE]
    for name, shard in zip(names, shards, strict=True):
        arrays = {tensor.name: tensor.load() for tensor in shard}
        save_tensors(arrays, out_dir / name)
        del arrays  # freed before the next shard is loaded
    if count > 1:
        weight_map = {
            tensor.name: name for name, shard in zip(names, shards, strict=True) for tensor in shard
        }
        total = sum(tensor.nbytes for tensor in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _hf_array(spec: TensorSpec, params: Params) -> np.ndarray:
    """The host array of one leaf, in HF's orientation."""
    array = np.asarray(_get(params, spec.path))
    return np.ascontiguousarray(array.T if spec.is_kernel else array)


def locate_tensors(checkpoint_dir: pathlib.Path) -> dict[str, tuple[pathlib.Path, tuple[int, ...]]]:
    """Maps every tensor name in the checkpoint to (file, shape), reading headers only.

    A directory holding both files is read from `model.safetensors`, as transformers reads it
    (so that one directory is one model in both libraries)."""
    index = checkpoint_dir / INDEX_FILE
    if (checkpoint_dir / SINGLE_FILE).is_file():
        weight_map, files = None, [SINGLE_FILE]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:  # bad JSON, no weight_map, not an object
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard files")
        files = sorted(set(weight_map.values()))
        # A shard is a file beside the index: an absolute or `../` name would read elsewhere.
        outside = [f for f in files if f in ("", ".", "..") or os.path.basename(f) != f]
        if outside:
            raise CheckpointError(
                f"{index}: shard names must be plain file names in its directory, got "
                f"{', '.join(map(repr, outside))}"
            )
    else:
        raise CheckpointError(f"{checkpoint_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    located = {}
    for file_name in files:
        path = checkpoint_dir / file_name
        if not path.is_file():
            raise CheckpointError(f"{index} lists the shard {file_name}, which does not exist")
        try:
            with safetensors.safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    if name in located:  # which copy is meant would be a guess
                        raise CheckpointError(
                            f"tensor {name} is in two shards: {located[name][0]} and {path}"
                        )
                    located[name] = (path, tuple(f.get_slice(name).get_shape()))
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
    if weight_map is not None:  # each tensor where the index says, as transformers reads it
        missing = sorted(
            n for n, f in weight_map.items() if n not in located or located[n][0].name != f
        )
        if missing:
            raise CheckpointError(
                f"{index} lists tensors absent from their shards: "
                + ", ".join(
                    f"{n} (stored in {located[n][0].name})" if n in located else n for n in missing
                )
            )
    return located


def _text_model_tensors(located: Located) -> dict[str, tuple[pathlib.Path, tuple[int, ...]]]:
    """A multimodal Qwen3.5 checkpoint's tensors renamed to the text-only layout.

    `model.language_model.X` -> `model.X`; the vision tower and the MTP head are dropped.
    Text-only checkpoints pass unchanged.
    """
    out = {}
    for name, where in located.items():
        if name.startswith(_MULTIMODAL_SKIPPED):
            continue
        if name.startswith(_MULTIMODAL_TEXT_PREFIX):
            name = "model." + name[len(_MULTIMODAL_TEXT_PREFIX) :]
            if name in located:  # which copy is meant would be a guess
                raise CheckpointError(
                    f"tensor {name} is stored under both its text-only and its multimodal "
                    f"({_MULTIMODAL_TEXT_PREFIX}...) name"
                )
        out[name] = where
    return out


def _shapes(located: Located) -> dict[str, tuple[int, ...]]:
    """Each located tensor's shape, by name (what `validate_names_and_shapes` compares)."""
    return {name: shape for name, (_, shape) in located.items()}


def _stored_name(name: str, stored) -> str:
    """The name under which a file holds `name` (its multimodal spelling, if it uses that)."""
    if name in stored or not name.startswith("model."):
        return name
    return _MULTIMODAL_TEXT_PREFIX + name[len("model.") :]


def _ignorable(config: TransformerConfig) -> set[str]:
    """Names a target checkpoint may hold beyond its specs (checked or derived elsewhere)."""
    # Some tied checkpoints store a copy of the embedding as the head; `_check_tied_head` checks it.
    return {_TIED_HEAD} if config.tie_word_embeddings else set()


def validate_names_and_shapes(
    specs: list[TensorSpec], shapes: Mapping[str, tuple[int, ...]], ignorable=frozenset()
) -> None:
    """Raises `CheckpointError` listing every missing, unexpected and mis-shaped tensor by name.

    Names ending in `rotary_emb.inv_freq` (derived buffers old Llama checkpoints stored) and the
    `ignorable` names are allowed in addition to `specs`.
    """
    expected = {s.hf_name: s.hf_shape for s in specs}
    ignorable = set(ignorable) | {n for n in shapes if n.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected) - ignorable)
    mismatched = sorted(
        f"{n}: checkpoint {list(shapes[n])}, config expects {list(expected[n])}"
        for n in set(expected) & set(shapes)
        if tuple(shapes[n]) != expected[n]
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if mismatched:
        problems.append("shape mismatches: " + "; ".join(mismatched))
    if problems:
        raise CheckpointError("checkpoint does not match its config.json — " + " | ".join(problems))


def _check_tied_head(
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    checkpoint_dir: str | pathlib.Path,
) -> None:
    """A tied checkpoint may store `lm_head.weight` only as an exact copy of the embedding."""
    if config.tie_word_embeddings and _TIED_HEAD in tensors:
        if not np.array_equal(tensors[_TIED_HEAD], tensors["model.embed_tokens.weight"]):
            raise CheckpointError(
                f"{checkpoint_dir}: config.json says tie_word_embeddings=true (at its top level, "
                "or in a multimodal config's text_config) but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings=false to use the separate head"
            )


def _set(tree: dict, path: tuple, value) -> None:
    """Sets `tree[path]`, creating dicts and (for int keys) list slots on the way."""
    for key, next_key in zip(path[:-1], path[1:], strict=True):
        empty = [] if isinstance(next_key, int) else {}
        if isinstance(key, int):
            tree.extend({} for _ in range(key + 1 - len(tree)))
            tree = tree[key]
        else:
            tree = tree.setdefault(key, empty)
    tree[path[-1]] = value


def _get(tree, path: tuple):
    """`tree[path]`, the leaf `_set` put there."""
    for key in path:
        tree = tree[key]
    return tree
