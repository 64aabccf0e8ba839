"""An adapter paired with its target and draft: random init (load and save: `checkpoint`)."""

from __future__ import annotations

import dataclasses

from jetspec_jax import random_streams
from jetspec_jax.checkpoint.adapter_files import adapter_tensor_specs
from jetspec_jax.draft import (
    Draft,
    check_init_seed,
    check_init_std,
    layers_like_target,
    random_params,
)
from jetspec_jax.models.adapter import AdapterConfig
from jetspec_jax.target import DTYPES

__all__ = ["Adapter", "adapter_config", "init_adapter"]


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """Predicts a target's tap states for unverified block positions (see `models/adapter.py`).

    Attributes:
        config: the adapter architecture (static under jit).
        params: the parameter pytree (`{"layers": [decoder layer, ...]}`), in `dtype`.
        dtype: "float32" or "bfloat16".
    """

    config: AdapterConfig
    params: dict
    dtype: str


def init_adapter(
    draft: Draft,
    *,
    layers_per_module: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
    init_std: float = 0.02,
    seed: int = 0,
) -> Adapter:
    """A randomly initialised adapter for `draft`'s taps, in the draft's dtype.

    Args:
        draft: the draft whose tap layers the adapter predicts (its target sets the sizes).
        layers_per_module: layers of each module (one per tap); None: one each.
        intermediate_size: MLP width of the adapter layers; None: the target's.
        init_std: standard deviation of the kernels (norm scales 1, biases 0). Small values start
            every module near the identity: level m-1 states as the guess for level m.
        seed: seed of `jax.random`, in [0, 2**32).

    Raises:
        ValueError: `layers_per_module` does not give each of the draft's taps >= 1 layer
            (`AdapterConfig`), `intermediate_size` is < 1, `init_std` is not a finite
            number >= 0, or `seed` is not an integer in [0, 2**32).
    """
    config = adapter_config(
        draft, layers_per_module=layers_per_module, intermediate_size=intermediate_size
    )
    init_std = check_init_std(init_std)
    seed = check_init_seed(seed)
    key = random_streams.stream(seed, random_streams.ADAPTER_INIT)
    params = random_params(adapter_tensor_specs(config), key, init_std, DTYPES[draft.dtype])
    return Adapter(config=config, params=params, dtype=draft.dtype)


def adapter_config(
    draft: Draft,
    *,
    layers_per_module: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
) -> AdapterConfig:
    """The architecture of an adapter for `draft`'s taps with these settings (what
    `init_adapter` builds, without drawing its weights); arguments as `init_adapter`'s."""
    taps = draft.config.target_layer_ids
    per_module = (1,) * len(taps) if layers_per_module is None else tuple(layers_per_module)
    return AdapterConfig(
        layers=layers_like_target(draft.target_config, 1, intermediate_size, None, None, None),
        target_layer_ids=tuple(taps),
        layers_per_module=per_module,
    )
