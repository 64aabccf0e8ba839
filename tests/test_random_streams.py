"""One seed, independent streams: no consumer draws with another's key."""

from __future__ import annotations

import jax
import numpy as np

from jetspec_jax.random_streams import EVAL_BATCH, INIT, TRAIN_STEP, stream


def _key_bits(keys) -> set[tuple[int, ...]]:
    return {tuple(row) for row in np.asarray(jax.random.key_data(keys)).reshape(-1, 2).tolist()}


def test_init_step_and_eval_keys_never_coincide():
    seed, n = 0, 64
    init = _key_bits(jax.random.split(stream(seed, INIT), n))
    steps = _key_bits(
        jax.vmap(lambda i: jax.random.fold_in(stream(seed, TRAIN_STEP), i))(np.arange(n))
    )
    evals = _key_bits(
        jax.vmap(lambda i: jax.random.fold_in(stream(seed, EVAL_BATCH), i))(np.arange(n))
    )
    assert len(init) == len(steps) == len(evals) == n
    assert not init & steps and not init & evals and not steps & evals
