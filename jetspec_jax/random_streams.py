"""Independent random streams from one seed.

A run has one seed and several consumers of randomness: the draft's and the adapter's parameter
initialisation, each training step's draws (block anchors, noised inputs), each evaluation batch.
Every consumer derives its keys from its own stream, `fold_in(key(seed), purpose)`, so no two of
them ever share a key. Deriving them all from `key(seed)` directly would collide: with
partitionable threefry (JAX's default), `split(k, n)[i] == fold_in(k, i)`, so training step i
would draw with the key that initialised parameter tensor i (and the draft's and the adapter's
tensor i would start from the same numbers).
"""

from __future__ import annotations

import jax

DRAFT_INIT = 1  # the draft's parameters: `split(stream, num_tensors)`
ADAPTER_INIT = 2  # the adapter's parameters: `split(stream, num_tensors)`
TRAIN_STEP = 3  # training draws: `fold_in(stream, step)`
EVAL_BATCH = 4  # evaluation draws: `fold_in(stream, batch_index)`


def stream(seed: int, purpose: int) -> jax.Array:
    """The typed key of `purpose`'s stream (one of the constants above) for `seed`."""
    return jax.random.fold_in(jax.random.key(seed), purpose)
