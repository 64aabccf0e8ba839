"""Typed, validated training configs, read from YAML.

Every section is a frozen dataclass; `load_train_config` refuses unknown keys and wrong types by
their dotted path (`optim.learning_rate must be a number, got 'fast'`), so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

logger = logging.getLogger(__name__)

# An optimisation section's one budget, given two ways (`steps = ceil(epochs * examples /
# batch_size)`): a section holds one of them.
_BUDGET_KEYS = ("steps", "epochs")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data: JSONL files written by `train.py regenerate` (prompt_ids + response_ids)."""

    files: tuple[str, ...]
    max_length: int = 1024
    eval_prompts: str | None = None  # JSONL prompt file for the periodic tau evaluation
    eval_num_prompts: int = 8
    eval_max_new_tokens: int = 64
    eval_math_suffix: bool = True


@dataclasses.dataclass(frozen=True)
class DraftArchConfig:
    """The draft to train (see `jetspec_jax.init_draft`).

    `init_from`: a saved draft (DFlash/JetSpec layout or JetSpec++ checkpoint) to start from
    instead of a random initialisation — to continue with more data, or to fine-tune an imported
    draft. Its architecture must be the one this section describes: an imported draft whose
    heads, head size or mask token differ from the target's defaults names them here.
    """

    variant: str = "jetspec++"
    num_layers: int = 1
    target_layer_ids: tuple[int, ...] | None = None
    block_size: int = 16
    intermediate_size: int | None = None  # None: the target's
    num_heads: int | None = None  # None: the target's
    num_kv_heads: int | None = None  # None: the target's
    head_dim: int | None = None  # None: the target's
    mask_token_id: int | None = None  # None: `draft_config`'s rule (the tokenizer's mask token...)
    init_std: float = 0.02
    init_from: str | None = None

    def architecture(self) -> dict:
        """The keywords of `jetspec_jax.draft.draft_config` this section sets: every field but
        how a run starts (`init_std`, `init_from`)."""
        fields = dataclasses.asdict(self)
        return {k: v for k, v in fields.items() if k not in ("init_std", "init_from")}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimisation: AdamW with linear warmup then cosine decay, global-norm clipping."""

    batch_size: int = 8
    anchors_per_sequence: int = 512
    # The draft loss forms both models' [B, chunk, K, V] logits a chunk of anchors at a time.
    anchors_per_loss_chunk: int = 32
    p_full_noise: float = 0.25
    steps: int = 1000
    epochs: float | None = None  # when set: steps = ceil(epochs * examples / batch_size)
    learning_rate: float = 3e-4
    end_learning_rate_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class AdapterTrainConfig:
    """The adapter to train for the draft (`train.py adapter`; `jetspec_jax.adapter.init_adapter`).

    Blocks are the draft's `block_size` positions from random anchors; position j of a block
    weighs `kappa**j` (its chance of being reached), normalised per block.

    `init_from`: a saved adapter (a JetSpec++ checkpoint, or its `adapter/` directory) to start
    from instead of a random initialisation: to continue with more data or steps. It must have
    the architecture this section describes and predict the draft's taps; which draft it was
    trained with does not matter (it predicts the target's states).
    """

    layers_per_module: tuple[int, ...] | None = None  # one entry per tap; None: 1 each
    intermediate_size: int | None = None  # None: the target's
    init_std: float = 0.02
    kappa: float = 0.5
    # None: the top-level `optim`. Given in the file, a whole section: unset fields take
    # OptimConfig's defaults, not the top-level values. Created by `--set adapter.optim.*`
    # overrides alone, it is the top-level section (overrides applied) with those keys changed.
    optim: OptimConfig | None = None
    eval_files: tuple[str, ...] = ()  # held-out regenerated JSONL; empty: the training files
    eval_batches: int = 2  # batches of the state metrics (normalised MSE, gap closed) per eval
    eval_tau: bool = True  # tau with J1-R1, predicted vs true states, on data.eval_prompts
    init_from: str | None = None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh: `data` x `fsdp` devices (-1 on one axis = all remaining devices)."""

    data: int = -1
    fsdp: int = 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how often to checkpoint, log and evaluate."""

    dir: str = "runs/draft"
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the end (and a warm-started adapter at step 0)
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole training run."""

    data: DataConfig
    target: str | None = None  # HF directory; None: the embedded default model
    target_dtype: str = "bfloat16"
    # The exported draft's and adapter's dtype; None: the target's. float32 keeps the master
    # weights unrounded (a bfloat16 target's export is otherwise bfloat16).
    export_dtype: str | None = None
    draft: DraftArchConfig = DraftArchConfig()
    optim: OptimConfig = OptimConfig()
    adapter: AdapterTrainConfig = AdapterTrainConfig()
    mesh: MeshConfig = MeshConfig()
    run: RunConfig = RunConfig()

    def __post_init__(self):
        # Named with the choices: "float16" reads like a dtype the run could take.
        _check(
            self.target_dtype in ("float32", "bfloat16"),
            "target_dtype (float32 or bfloat16)",
            self.target_dtype,
        )
        _check(
            self.export_dtype in (None, "float32", "bfloat16"),
            "export_dtype (float32, bfloat16, or null for the target's)",
            self.export_dtype,
        )
        _check_draft(self.draft)
        _check_optim(self.optim, "optim")
        _check_adapter(self.adapter, self.draft)
        # Named with the bound: an override of the block size alone fails here.
        _check(
            self.data.max_length >= self.draft.block_size + 1,
            f"data.max_length (>= draft.block_size + 1: {self.draft.block_size + 1})",
            self.data.max_length,
        )
        _check(bool(self.data.files), "data.files", self.data.files)
        _check_files(self.data.files, "data.files", "trained on twice as often as the others")
        # An empty path is no "none": run.dir '' would write the run into the working directory,
        # data.eval_prompts '' would turn the evaluation off unsaid (null does either on purpose).
        _check(self.target != "", "target (a directory, or null for the default model)", "")
        _check(self.run.dir != "", "run.dir (a directory)", "")
        _check(self.data.eval_prompts != "", "data.eval_prompts (a file, or null)", "")
        for name in ("eval_num_prompts", "eval_max_new_tokens"):
            _check(getattr(self.data, name) >= 1, f"data.{name}", getattr(self.data, name))
        for name in ("checkpoint_every", "keep_checkpoints", "log_every"):
            _check(getattr(self.run, name) >= 1, f"run.{name}", getattr(self.run, name))
        _check(self.run.eval_every >= 0, "run.eval_every", self.run.eval_every)
        # Anchors are distinct positions of a sequence (`lax.top_k` over its max_length).
        for where, optim in (("optim", self.optim), ("adapter.optim", self.adapter.optim)):
            if optim is not None:
                _check(
                    optim.anchors_per_sequence <= self.data.max_length,
                    f"{where}.anchors_per_sequence (<= data.max_length {self.data.max_length})",
                    optim.anchors_per_sequence,
                )


def _check_draft(draft: DraftArchConfig) -> None:
    """The draft section's own checks."""
    # Named with the choices: "DFlash" (the baseline as the docs write it) reads like a variant.
    _check(
        draft.variant in ("dflash", "jetspec", "jetspec++"),
        "draft.variant (dflash, jetspec or jetspec++)",
        draft.variant,
    )
    _check(draft.num_layers >= 1, "draft.num_layers", draft.num_layers)
    _check(draft.block_size >= 2, "draft.block_size", draft.block_size)
    taps = draft.target_layer_ids
    if taps is not None:
        # Shallow to deep, as the default rule picks them and the adapter chains them: a
        # draft trained on other taps could never get an adapter.
        _check(
            len(taps) >= 1 and taps[0] >= 0 and list(taps) == sorted(set(taps)),
            "draft.target_layer_ids (distinct layers >= 0, in increasing order)",
            taps,
        )
    _check(math.isfinite(draft.init_std) and draft.init_std >= 0, "draft.init_std", draft.init_std)
    for name in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        value = getattr(draft, name)
        _check(value is None or value >= 1, f"draft.{name}", value)
    mask = draft.mask_token_id
    _check(mask is None or mask >= 0, "draft.mask_token_id", mask)
    _check(draft.init_from != "", "draft.init_from (a path, or null)", "")


def _check_optim(optim: OptimConfig, where: str) -> None:
    """An optimisation section's own checks (`where`: its dotted path, `optim` or
    `adapter.optim`)."""
    for name in ("batch_size", "anchors_per_sequence", "anchors_per_loss_chunk", "steps"):
        _check(getattr(optim, name) >= 1, f"{where}.{name}", getattr(optim, name))
    if optim.epochs is None:
        # Named with the bound: `--set optim.steps=N` alone fails here when N < the warmup.
        _check(
            0 <= optim.warmup_steps <= optim.steps,
            f"{where}.warmup_steps (in [0, {where}.steps {optim.steps}])",
            optim.warmup_steps,
        )
    else:  # steps come from the data (`resolve_steps`, which caps the warmup at them)
        _check(math.isfinite(optim.epochs) and optim.epochs > 0, f"{where}.epochs", optim.epochs)
        _check(optim.warmup_steps >= 0, f"{where}.warmup_steps", optim.warmup_steps)
    _check(
        math.isfinite(optim.learning_rate) and optim.learning_rate > 0,
        f"{where}.learning_rate",
        optim.learning_rate,
    )
    ratio = optim.end_learning_rate_ratio
    _check(0.0 <= ratio <= 1.0, f"{where}.end_learning_rate_ratio (in [0, 1])", ratio)
    _check(
        math.isfinite(optim.weight_decay) and optim.weight_decay >= 0,
        f"{where}.weight_decay",
        optim.weight_decay,
    )
    # A negative clip norm flips the gradient's sign: training would climb the loss.
    _check(
        math.isfinite(optim.grad_clip) and optim.grad_clip > 0,
        f"{where}.grad_clip",
        optim.grad_clip,
    )
    _check(0.0 <= optim.p_full_noise <= 1.0, f"{where}.p_full_noise", optim.p_full_noise)
    # grain's shuffle and the PRNG keys take 32 bits.
    _check(0 <= optim.seed < 2**32, f"{where}.seed (in [0, 2**32))", optim.seed)
    _check(
        optim.compute_dtype in ("float32", "bfloat16"),
        f"{where}.compute_dtype (float32 or bfloat16)",
        optim.compute_dtype,
    )


def _check_adapter(adapter: AdapterTrainConfig, draft: DraftArchConfig) -> None:
    """The adapter section's own checks; the tap count is checked here when the config names the
    taps (`draft.target_layer_ids`), else against the loaded draft (`train_adapter`)."""
    per_module = adapter.layers_per_module
    if per_module is not None:
        if not per_module or any(n < 1 for n in per_module):
            raise ValueError(
                f"invalid value for adapter.layers_per_module: {list(per_module)!r} (one "
                "entry >= 1 per tap layer)"
            )
        taps = draft.target_layer_ids
        if taps is not None and len(per_module) != len(taps):
            raise ValueError(
                f"adapter.layers_per_module {list(per_module)} needs one entry per tap layer "
                f"(draft.target_layer_ids {list(taps)}: {len(taps)})"
            )
    if adapter.intermediate_size is not None:
        _check(
            adapter.intermediate_size >= 1, "adapter.intermediate_size", adapter.intermediate_size
        )
    _check(0.0 < adapter.kappa <= 1.0, "adapter.kappa (in (0, 1])", adapter.kappa)
    _check(
        math.isfinite(adapter.init_std) and adapter.init_std >= 0.0,
        "adapter.init_std",
        adapter.init_std,
    )
    _check(adapter.eval_batches >= 1, "adapter.eval_batches", adapter.eval_batches)
    _check_files(adapter.eval_files, "adapter.eval_files", "weighed twice in the evaluation")
    _check(adapter.init_from != "", "adapter.init_from (a path, or null)", "")
    if adapter.optim is not None:
        _check_optim(adapter.optim, "adapter.optim")


def resolve_steps(config: TrainConfig, num_examples: int, where: str = "optim") -> TrainConfig:
    """`config` with `optim.steps` derived from `optim.epochs` (unchanged without epochs);
    `where`: the section the optimisation settings came from, for the warning."""
    if config.optim.epochs is None:
        return config
    steps = max(1, math.ceil(config.optim.epochs * num_examples / config.optim.batch_size))
    warmup = min(config.optim.warmup_steps, steps)
    if warmup == steps:
        logger.warning(
            "%s.warmup_steps %d >= the %d steps of %s epoch(s) over %d examples: the whole run "
            "warms up and the learning rate never decays",
            where,
            config.optim.warmup_steps,
            steps,
            config.optim.epochs,
            num_examples,
        )
    optim = dataclasses.replace(config.optim, steps=steps, warmup_steps=warmup)
    return dataclasses.replace(config, optim=optim)


def load_train_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads and validates a YAML training config, with command-line overrides applied.

    Args:
        path: the YAML file.
        overrides: `"dotted.key=value"` strings, applied in order before validation; the value is
            parsed as YAML (`draft.variant=dflash`, `optim.steps=500`, `data.files=[a.jsonl]`);
            an empty one is refused (none is `=null`).
            `steps` and `epochs` give one budget two ways: overriding one drops the other.
            `adapter.optim.*` overrides on a config without that section change the top-level
            `optim` (with its overrides, in any order) for the adapter.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: `path` is a directory.
        ValueError: malformed YAML or override, a key given twice (named with its line; YAML
            would keep the last silently), an unknown key, a missing required key, a wrong
            type or an invalid value, named by its dotted path; an `optim` section with both
            `steps` and `epochs` (epochs would silently win).
    """
    path = pathlib.Path(path)
    # Read, not tested with `is_file`: a pipe (`--config <(...)`) is a config too.
    if path.is_dir():
        raise IsADirectoryError(f"training config {path} is a directory; give its YAML file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise FileNotFoundError(f"training config {path} not found") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    inherits_optim = _adapter_optim(data) is None
    for override in overrides:
        _apply_override(data, override)
    if inherits_optim and isinstance(_adapter_optim(data), dict):
        _inherit_optim(data)
    for where, section in (("optim", data.get("optim")), ("adapter.optim", _adapter_optim(data))):
        if isinstance(section, dict) and all(section.get(k) is not None for k in _BUDGET_KEYS):
            raise ValueError(
                f"{where} gives both steps and epochs; give one (epochs: steps = ceil(epochs * "
                "examples / batch_size))"
            )
    return from_dict(TrainConfig, data, "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` refusing a key given twice in one mapping: PyYAML keeps the last one
    silently, so a second `optim:` section, or `steps:` twice in one, would drop settings."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}  # key -> the line (1-based) it is first given on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges keys the mapping's own ones may override
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line
                try:
                    if key in lines:
                        raise yaml.constructor.ConstructorError(
                            problem=f"duplicate key {key!r} on line {line + 1} (first given on "
                            f"line {lines[key]}): YAML would keep only the last; give it once"
                        )
                    lines[key] = line + 1
                except TypeError:
                    continue  # an unhashable key: SafeLoader names it
        return super().construct_mapping(node, deep=deep)


def _inherit_optim(data: dict) -> None:
    """An `adapter.optim` made by overrides alone changes the optim the adapter ran with (the
    top-level one, overrides applied), not the built-in defaults: only its given keys differ.
    A null budget key means "not given" (`--set adapter.optim.epochs=null` must not replace the
    top-level budget with the built-in default steps)."""
    base, given = data.get("optim") or {}, data["adapter"]["optim"]
    if not isinstance(base, dict):
        return  # from_dict names the malformed section
    given = {k: v for k, v in given.items() if not (k in _BUDGET_KEYS and v is None)}
    if any(given.get(k) is not None for k in _BUDGET_KEYS):  # one budget: the override's
        base = {k: v for k, v in base.items() if k not in _BUDGET_KEYS}
    data["adapter"]["optim"] = {**base, **given}


def _adapter_optim(data: dict) -> Any:
    """The raw `adapter.optim` section of the YAML data (None when absent or null)."""
    adapter = data.get("adapter")
    return adapter.get("optim") if isinstance(adapter, dict) else None


def _apply_override(data: dict, override: str) -> None:
    """Sets `data[k1][k2]... = value` for `"k1.k2...=value"` (sections created as needed; the
    keys themselves are checked by `from_dict`)."""
    key, sep, text = override.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        raise ValueError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"override {override!r}: the value is not valid YAML: {e}") from e
    if not text.strip():
        # YAML reads nothing as null, but a shell's empty expansion (`--set target=$T`, T unset)
        # is no "none": it would train the default model, or the default steps for `epochs=`.
        raise ValueError(f"override {override!r} gives no value; write null for none")
    node = data
    for i, name in enumerate(keys[:-1]):
        if node.get(name) is None:  # absent, or `null`: the defaults, which the override edits
            node[name] = {}
        elif isinstance(node[name], dict):
            # A copy: a YAML alias (`adapter: {optim: *o}`) is one dict in two places, and the
            # override edits only the one it names.
            node[name] = dict(node[name])
        node = node[name]
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {'.'.join(keys[: i + 1])} is not a section")
    node[keys[-1]] = value
    if value is not None and keys[-2:-1] == ["optim"] and keys[-1] in _BUDGET_KEYS:
        # One budget given two ways: the override replaces the config's.
        for other in _BUDGET_KEYS:
            if other != keys[-1]:
                node.pop(other, None)


def from_dict(cls, data: Any, where: str):
    """Builds dataclass `cls` from plain data, checking keys and types recursively."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(data) - set(fields))  # YAML keys may be ints, bools
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(_join(where, k) for k in unknown)}; "
            f"known: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, field in fields.items():
        # A null section (`adapter:` with every key commented out) is absent, its defaults, as
        # `_apply_override` takes it; one that may be None (`adapter.optim: null`) stays None.
        null_section = data.get(name) is None and dataclasses.is_dataclass(hints[name])
        if name in data and not null_section:
            kwargs[name] = _convert(hints[name], data[name], _join(where, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"missing required key {_join(where, name)}")
    return cls(**kwargs)


def _convert(hint, value, where: str):
    """`value` as the field type `hint` (a dataclass, optional, tuple or scalar), or a ValueError
    naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past float's range: inf, as YAML reads 1.0e400
            return math.inf if value > 0 else -math.inf
    if hint is float and isinstance(value, str):  # YAML reads 3e-4 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    kind = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[hint]
    raise ValueError(f"{where} must be {kind}, got {value!r}")


def _check_files(files: Sequence[str], where: str, twice: str) -> None:
    """Refuses an empty path, and a file listed twice (it would be `twice`, silently), by its real
    path: `a.jsonl`, `./a.jsonl` and a symlink to it are one file."""
    seen: dict[str, str] = {}  # real path -> the entry that named it first
    for name in files:
        _check(name != "", f"{where} (an empty path)", list(files))
        real = os.path.realpath(name)
        if real in seen:
            raise ValueError(
                f"invalid value for {where}: {seen[real]!r} and {name!r} are one file, listed "
                f"twice (it would be {twice})"
            )
        seen[real] = name


def _check(ok: bool, where: str, value) -> None:
    if not ok:
        raise ValueError(f"invalid value for {where}: {value!r}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
